"""LLaDA's plain `generate`: full-sequence forward every step, low-confidence remasking.

This is the cache-free, top-k-schedule decoder of the LLaDA paper (Algorithm "low-confidence
remasking", semi-autoregressive blocks). It runs one jitted forward of static shape
[B, prompt + gen] per step and keeps the commit logic on the host in NumPy. It is the
reference point every faster decoder is compared against.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlm_jax._config import ConfigError
from dlm_jax.models._transformer import Transformer


def num_transfer_tokens(masked: np.ndarray, steps: int) -> np.ndarray:
    """LLaDA's `get_num_transfer_tokens`: split each row's masked count evenly over `steps`,
    the remainder going to the first steps. masked: [B, block] bool -> [B, steps] int."""
    count = masked.sum(axis=1, keepdims=True)
    base = count // steps
    out = np.repeat(base, steps, axis=1)
    remainder = (count % steps)[:, 0]
    for b in range(masked.shape[0]):
        out[b, : remainder[b]] += 1
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class VanillaResult:
    tokens: np.ndarray  # [B, prompt + gen] final sequence
    nfe: int
    seconds: float


def _logits_fn(model: Transformer) -> Callable[[jax.Array], jax.Array]:
    graphdef, state = nnx.split(model)

    @jax.jit
    def logits(state, tokens):
        return nnx.merge(graphdef, state)(tokens).logits

    return lambda tokens: logits(state, tokens)


def generate_vanilla(model: Transformer, prompt: np.ndarray, *, gen_len: int, steps: int,
                     block_len: int, temperature: float = 0.0, seed: int = 0,
                     on_block: Callable[[int, np.ndarray], None] | None = None) -> VanillaResult:
    """Decode `gen_len` tokens after `prompt` ([B, P] int) with LLaDA's low-confidence schedule.

    Args:
      steps: total denoising steps, split evenly over the `gen_len // block_len` blocks.
      temperature: 0 for greedy; otherwise Gumbel-max sampling in float64 as LLaDA does.
      on_block: called with (block index, current tokens) after each block completes.
    """
    cfg = model.config
    if cfg.mask_token_id is None:
        raise ConfigError("the model config has no mask_token_id; diffusion decoding needs one")
    if gen_len % block_len:
        raise ConfigError(f"block_len={block_len} must divide gen_len={gen_len}")
    n_blocks = gen_len // block_len
    if steps % n_blocks:
        raise ConfigError(f"steps={steps} must be a multiple of the number of blocks ({n_blocks})")
    prompt = np.asarray(prompt, dtype=np.int32)
    b, p = prompt.shape
    if p + gen_len > cfg.max_seq_len:
        raise ConfigError(f"prompt ({p}) + gen_len ({gen_len}) exceeds max_seq_len={cfg.max_seq_len}")
    x = np.full((b, p + gen_len), cfg.mask_token_id, dtype=np.int32)
    x[:, :p] = prompt
    forward = _logits_fn(model)
    rng = np.random.default_rng(seed)
    per_block = steps // n_blocks
    nfe = 0
    start = time.perf_counter()
    for blk in range(n_blocks):
        lo, hi = p + blk * block_len, p + (blk + 1) * block_len
        schedule = num_transfer_tokens(x[:, lo:hi] == cfg.mask_token_id, per_block)
        for i in range(per_block):
            masked = x == cfg.mask_token_id
            logits = np.asarray(forward(jnp.asarray(x)), dtype=np.float64)
            nfe += 1
            if cfg.logit_shift:  # row i predicts i + 1: align predictions with positions (Dream)
                logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
            if temperature > 0:
                gumbel = (-np.log(rng.random(logits.shape))) ** temperature
                x0 = np.argmax(np.exp(logits) / gumbel, axis=-1)
            else:
                x0 = np.argmax(logits, axis=-1)
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            conf = np.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
            conf[:, hi:] = -np.inf
            conf = np.where(masked, conf, -np.inf)
            x0 = np.where(masked, x0, x)
            for r in range(b):
                k = int(schedule[r, i])
                if k:
                    chosen = np.argsort(-conf[r], kind="stable")[:k]
                    x[r, chosen] = x0[r, chosen]
        if on_block is not None:
            on_block(blk, x.copy())
    return VanillaResult(tokens=x, nfe=nfe, seconds=time.perf_counter() - start)

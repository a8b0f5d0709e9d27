"""Test seams: the tiny model twin every test shares and a scripted executor.

    cfg = tiny_config()                          # the one tiny config (vocab 64, 2 layers)
    model = tiny_model(attention="causal")       # a random model of it (JAX)
    model = sharp_model()                        # the same, made confident and position-sensitive
    path = tiny_checkpoint(tmp / "m")            # a saved HF-layout checkpoint with a tokenizer
    exe = MockExecutor(cfg, answer=..., confidence=...)   # hand-computable predictions, no JAX
    handle = mock_model(answer=..., confidence=...)       # `dlm_jax.Model` over a MockExecutor
    with cudnn_stand_in(): ...                   # JAX's XLA attention where cuDNN's kernel is called

Importing this module does not import JAX; the model helpers do when called.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._tokenizer import ByteTokenizer, Tokenizer
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.step import Capabilities, Executor, StepInputs, StepOutputs

MASK, EOS = 63, 62  # the tiny config's special ids
TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, block_size=8,
            mask_token_id=MASK, eos_token_id=EOS, max_seq_len=96)


def tiny_config(*, tokenizer: Tokenizer | None = None, **overrides: Any) -> ModelConfig:
    """The tiny config (`TINY`) with `overrides`; with a `tokenizer`, its vocabulary size and
    special ids replace the tiny ones."""
    base = dict(TINY)
    if tokenizer is not None:
        base.update(vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.mask_id,
                    eos_token_id=tokenizer.eos_id)
    return ModelConfig(**{**base, **overrides})


def tiny_model(*, seed: int = 0, tokenizer: Tokenizer | None = None, **overrides: Any):
    """A randomly initialised `Transformer` of `tiny_config(**overrides)`."""
    import dlm_jax

    return dlm_jax.init_model(tiny_config(tokenizer=tokenizer, **overrides), seed=seed)


def sharp_model(*, seed: int = 0, **overrides: Any):
    """A tiny random model made position-sensitive and confident, so confidences spread over
    (0.5, 0.95) and differ between positions by far more than float noise: the mask token's
    embedding is zero (masked slots are pure attention read-outs), fast RoPE and sharp
    attention make those read-outs depend on position, and a scaled head sharpens them."""
    import dlm_jax

    cfg = tiny_config(**{"rope_theta": 4.0, **overrides})
    params = dlm_jax.get_params(dlm_jax.init_model(cfg, seed=seed))
    scale = {"lm_head.kernel": 70.0, "q_proj": 8.0, "k_proj": 8.0}
    params = {k: v * next((f for key, f in scale.items() if key in k), 1.0) for k, v in params.items()}
    embedding = params["embed.embedding"].copy()
    embedding[cfg.mask_token_id] = 0.0
    params["embed.embedding"] = embedding
    return dlm_jax.model_from_params(cfg, params)


def xla_cudnn_part(q, keys, values, mask, scale: float):
    """`dlm_jax.models._transformer.cudnn_part`'s contract (heads-first operands; the output in
    their dtype and the log-sum-exp in float32) from JAX's own XLA attention
    (`jax.nn.dot_product_attention`, implementation "xla"): cuDNN's stand-in where no GPU is.
    JAX's XLA form gives its log-sum-exp in the operands' dtype, so it is taken from a float32
    call over the same values (cuDNN keeps it in float32, from float32 scores)."""
    import jax
    import jax.numpy as jnp

    def call(x, y, z, **kw):
        return jax.nn.dot_product_attention(x.swapaxes(1, 2), y.swapaxes(1, 2), z.swapaxes(1, 2), mask=mask[:, None],
                                            scale=scale, implementation="xla", **kw)

    f32 = [x.astype(jnp.float32) for x in (q, keys, values)]
    _, lse = call(*f32, return_residual=True)
    return call(q, keys, values).swapaxes(1, 2), lse.swapaxes(1, 2)


def xla_attend_window(q, keys, values, mask):
    """`dlm_jax.models._transformer.attend_cudnn` (q [B, T, H, Dh], keys and values [B, S, Hkv,
    Dh], mask [B, T, S] bool) with JAX's XLA attention in cuDNN's place."""
    import jax

    return jax.nn.dot_product_attention(q, keys, values, mask=mask[:, None], implementation="xla")


@contextlib.contextmanager
def cudnn_stand_in() -> Iterator[None]:
    """Inside: the model's cuDNN calls (`cudnn_part`, `attend_cudnn`) run JAX's XLA attention
    instead, so the "cudnn" and "cudnn_split" forms' own code (layouts, masks, the merge) runs
    on a machine without a GPU. Only programs traced inside take it."""
    from dlm_jax.models import _transformer

    saved = _transformer.cudnn_part, _transformer.attend_cudnn
    _transformer.cudnn_part, _transformer.attend_cudnn = xla_cudnn_part, xla_attend_window
    try:
        yield
    finally:
        _transformer.cudnn_part, _transformer.attend_cudnn = saved


def tiny_checkpoint(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a random tiny model with the byte-level tokenizer at `path` (HF layout)."""
    import dlm_jax

    tok = ByteTokenizer()
    return dlm_jax.save_pretrained(tiny_model(seed=seed, tokenizer=tok, **overrides), path, tokenizer=tok)


Script = np.ndarray | Sequence[float] | Callable[[StepInputs, np.ndarray], np.ndarray]


def echo_kv(config: ModelConfig, inputs: StepInputs) -> dict[str, np.ndarray]:
    """The window K/V a scripted executor returns when asked (`inputs.want.kv`): each row's fed
    token id in `k_new` and its position in `v_new`, [L, B, W, Hkv, Dh]; empty otherwise."""
    if not inputs.want.kv:
        return {}
    shape = (config.n_layers, *inputs.tokens.shape, config.n_kv_heads, config.head_dim)
    return {"k_new": np.broadcast_to(inputs.tokens[None, :, :, None, None], shape).astype(config.dtype),
            "v_new": np.broadcast_to(inputs.positions[None, :, :, None, None], shape).astype(config.dtype)}


class MockExecutor(Executor):
    """An `Executor` whose predictions are a script, by the position each row predicts.

    A requested row whose query sits at position q predicts position p = q (+1 for a
    logit-shift config). Its top token is `answer[p]` and its probability `confidence[p]`
    (arrays indexed by position; or callables `f(inputs, p) -> [B, R]` for predictions that
    depend on the step). The remaining probability is spread evenly over the other tokens
    except the mask, which fixes `second_prob`, `entropy` and `logits`. The window K/V
    encode what was fed: `k_new[..., w, :, :]` is the token id at window row w and `v_new`
    its position. Every `StepInputs` is kept in `calls`; every warmed bucket in `warmed`.
    """

    def __init__(self, config: ModelConfig, *, answer: Script, confidence: Script,
                 capabilities: Capabilities | None = None):
        self.config = config
        self.answer = answer
        self.confidence = confidence
        self._capabilities = capabilities or Capabilities.for_length(config.max_seq_len)
        self.calls: list[StepInputs] = []
        self.warmed: set[BucketKey] = set()

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def warmup(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False) -> int:
        new = set(keys) - self.warmed
        self.warmed |= new
        return len(new)

    def _lookup(self, script: Script, inputs: StepInputs, predicted: np.ndarray) -> np.ndarray:
        if callable(script):
            return np.asarray(script(inputs, predicted))
        table = np.asarray(script)
        return table[np.clip(predicted, 0, len(table) - 1)]

    def step(self, inputs: StepInputs, *, timings: dict[str, float] | None = None) -> StepOutputs:
        cfg = self.config
        self.calls.append(inputs)
        q = np.take_along_axis(inputs.positions, inputs.logit_rows, axis=1)
        predicted = q + (1 if cfg.logit_shift else 0)
        top = self._lookup(self.answer, inputs, predicted).astype(np.int32)
        prob = self._lookup(self.confidence, inputs, predicted).astype(np.float64)
        others = cfg.vocab_size - 1 - (cfg.mask_token_id is not None)  # tokens sharing 1 - prob
        rest = (1.0 - prob) / others
        entropy = -(prob * np.log(np.maximum(prob, 1e-300)) + others * np.where(rest > 0, rest * np.log(np.maximum(rest, 1e-300)), 0.0))
        out: dict[str, np.ndarray] = {"top_token": top, "top_prob": prob.astype(np.float32),
                                      "second_prob": rest.astype(np.float32), "entropy": entropy.astype(np.float32)}
        out.update(echo_kv(cfg, inputs))
        if inputs.want.logits:
            probs = np.broadcast_to(rest[..., None], (*top.shape, cfg.vocab_size)).copy()
            np.put_along_axis(probs, top[..., None], prob[..., None], axis=-1)
            if cfg.mask_token_id is not None:
                probs[..., cfg.mask_token_id] = 0.0
            with np.errstate(divide="ignore"):
                out["logits"] = np.log(probs).astype(np.float32)
        return StepOutputs.from_named(out)


def mock_model(*, answer: Script, confidence: Script, tokenizer: Tokenizer | None = None,
               capabilities: Capabilities | None = None, **overrides: Any):
    """A `dlm_jax.Model` (no weights, no JAX) whose executor is a `MockExecutor`; the config is
    `tiny_config(tokenizer=..., **overrides)` with the byte-level tokenizer by default."""
    from dlm_jax.api import Model

    tok = tokenizer or ByteTokenizer()
    cfg = tiny_config(tokenizer=tok, **overrides)
    return Model(None, tok, config=cfg,
                 executor=MockExecutor(cfg, answer=answer, confidence=confidence, capabilities=capabilities))


class ToyCausalExecutor(MockExecutor):
    """A causal toy language model over tokens 0..n-1 (no JAX), for tests about decoding rules
    that need a model whose predictions depend on what it sees (ISD's exactness).

    The window K/V echo what was fed (as `MockExecutor`: token id in `k`, position in `v`), and
    each requested row reads its context back through the step's visibility, so cache reads,
    padding and masks behave as a model's would. A row fed a token x predicts the next token
    from `clean[x]` (logits [n]); a row fed the mask predicts from `mask[y, d]`, y the last
    token it sees and d its distance from it (clipped to the table). Tokens >= n get -inf.
    With capabilities whose `logits_on` names a platform, a step asked to keep its logits on
    the device (`OutputRequest.device_logits`) gives them as the JAX executor does, in a JAX
    array on the CPU, so device rules run on the toy too."""

    def __init__(self, config: ModelConfig, *, clean: np.ndarray, mask: np.ndarray,
                 capabilities: Capabilities | None = None):
        super().__init__(config, answer=[0], confidence=[1.0], capabilities=capabilities)
        self.clean = np.asarray(clean, np.float64)
        self.mask = np.asarray(mask, np.float64)

    def step(self, inputs: StepInputs, *, timings: dict[str, float] | None = None) -> StepOutputs:
        cfg = self.config
        self.calls.append(inputs)
        b, w = inputs.tokens.shape
        p = inputs.k_cache.shape[2]
        key_tok = np.concatenate([inputs.k_cache[0, :, :, 0, 0], inputs.tokens], axis=1).astype(np.int64)
        key_pos = np.concatenate([inputs.v_cache[0, :, :, 0, 0], inputs.positions], axis=1).astype(np.int64)
        n = self.clean.shape[0]
        logits = np.full((b, inputs.logit_rows.shape[1], cfg.vocab_size), -np.inf)
        for r in range(b):
            for j, row in enumerate(inputs.logit_rows[r]):
                seen = inputs.visibility[r, row]
                tok, pos = inputs.tokens[r, row], inputs.positions[r, row]
                if tok != cfg.mask_token_id:
                    logits[r, j, :n] = self.clean[min(int(tok), n - 1)]
                    continue
                clean = seen & (key_tok[r] != cfg.mask_token_id) & (key_pos[r] < pos)
                cols = np.flatnonzero(clean)
                last = cols[np.argmax(key_pos[r, cols])] if len(cols) else -1
                y = min(int(key_tok[r, last]), n - 1) if last >= 0 else 0
                d = int(pos - key_pos[r, last]) if last >= 0 else 1
                logits[r, j, :n] = self.mask[y, min(d, self.mask.shape[1]) - 1]
        z = np.exp(logits - logits.max(-1, keepdims=True))
        probs = z / z.sum(-1, keepdims=True)
        top = probs.argmax(-1)
        srt = np.sort(probs, -1)
        ent = -(probs * np.log(np.maximum(probs, 1e-300))).sum(-1)
        out: dict[str, np.ndarray] = {"top_token": top.astype(np.int32), "top_prob": srt[..., -1].astype(np.float32),
                                      "second_prob": srt[..., -2].astype(np.float32), "entropy": ent.astype(np.float32)}
        out.update(echo_kv(cfg, inputs))
        if inputs.want.logits:
            out["logits"] = logits.astype(np.float32)
            if inputs.want.device_logits and self.capabilities.logits_on:  # kept "on the device": JAX's CPU
                import jax.numpy as jnp

                from dlm_jax.executors._logits import DeviceLogits

                out["logits"] = DeviceLogits(jnp.asarray(out["logits"]))
        del p
        return StepOutputs.from_named(out)

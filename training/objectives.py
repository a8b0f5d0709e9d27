"""Training objectives on the shared model family.

Axes: B batch, T sequence length, V vocabulary. A batch is a dict with `tokens` [B, T] int32
and `prompt_mask` [B, T] bool (True on prompt tokens, never masked and never a target; all
False for plain corpus rows). Every objective returns (loss, metrics) and is a pure function
of (model, batch, rng), so it jits and shards like any JAX function.

- `masked_diffusion` (LLaDA): t ~ U(eps, 1) per row, each response token masked with prob t,
  cross-entropy on masked positions weighted 1/t, normalised per row by its response length
  (LLaDA's SFT loss); bidirectional attention. Optional clean-position term
  (`clean_loss_weight` > 0): a fraction `corrupt_prob` of the response tokens left visible is
  replaced by random regular tokens (never the mask id or another special, never the true
  token), and `clean_loss_weight` x the mean cross-entropy of the true token over every visible
  response position (corrupted or not) is added, so the model's distribution at a filled
  position says how likely the token there is right (in-place confidence for remasking).
- `block_diffusion` (BD3-LM / SDAR): input [x_noisy ; x_clean]; noisy block k attends
  bidirectionally within itself and to clean blocks < k; the clean half is block-causal;
  loss on masked noisy positions weighted 1/t.
- `introspective` (I-DLM): input [x_masked ; x_clean] with every response token of the noisy
  half masked; strict causal attention inside each noisy block, noisy block k sees clean
  tokens before it, the clean half is causal; logit shift (row i predicts token i + 1);
  loss = L_noisy + sg(L_noisy / L_clean) * L_clean (auto-balanced, Eq. 2), or with `ce_alpha`
  the fixed L_noisy + ce_alpha * L_clean. `noisy_block` overrides the noisy block size (a
  stride-N curriculum stage trains N - 1 masks per block); `lora_gate` runs the model with the
  R-ISD gate (1 on [MASK] rows, 0 elsewhere: clean rows use the base weights only).
- `autoregressive`: causal next-token loss on response tokens (the lossless reference).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.models._transformer import Transformer

Batch = dict[str, jax.Array]
Objective = Callable[[Transformer, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
EPS = 1e-3


def _token_ce(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """[B, T] cross-entropy of `targets` under `logits` [B, T, V] (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _mask_id(model: Transformer) -> int:
    if model.config.mask_token_id is None:
        raise ConfigError("training a diffusion objective needs ModelConfig.mask_token_id")
    return model.config.mask_token_id


# Regular (non-special) token ids: training encodes with dlm_jax.ByteTokenizer, whose ids
# 0..255 are bytes and 256.. its specials (pad, bos, eos, mask, chat markers).
REGULAR_VOCAB = 256


def corrupt_visible(tokens: jax.Array, visible: jax.Array, corrupt_prob: float, rng: jax.Array, *,
                    regular_vocab: int = REGULAR_VOCAB) -> tuple[jax.Array, jax.Array]:
    """Replace each `visible` token with prob `corrupt_prob` by a uniformly drawn regular id in
    [0, regular_vocab) other than the token itself. Returns (new tokens, corrupted [B, T] bool)."""
    k_c, k_r = jax.random.split(rng)
    corrupted = (jax.random.uniform(k_c, tokens.shape) < corrupt_prob) & visible
    # Draw from regular_vocab - 1 values and skip the true token (a special true token, e.g. an
    # EOS of the fill, can never be drawn, so the shift only matters for regular ones).
    r = jax.random.randint(k_r, tokens.shape, 0, regular_vocab - 1, dtype=tokens.dtype)
    r = jnp.where((tokens < regular_vocab) & (r >= tokens), r + 1, r)
    return jnp.where(corrupted, r, tokens), corrupted


def masked_diffusion(model: Transformer, batch: Batch, rng: jax.Array, *, clean_loss_weight: float = 0.0,
                     corrupt_prob: float = 0.0, regular_vocab: int = REGULAR_VOCAB):
    tokens, response = batch["tokens"], ~batch["prompt_mask"]
    b, t_len = tokens.shape
    k_t, k_m = jax.random.split(rng)
    t = jax.random.uniform(k_t, (b, 1), minval=EPS, maxval=1.0)
    masked = (jax.random.uniform(k_m, (b, t_len)) < t) & response
    noisy = jnp.where(masked, _mask_id(model), tokens)
    clean_term = clean_loss_weight > 0
    if clean_term:
        visible = response & ~masked
        noisy, corrupted = corrupt_visible(noisy, visible, corrupt_prob, jax.random.fold_in(rng, 1),
                                           regular_vocab=regular_vocab)
    logits = model(noisy).logits
    token_ce = _token_ce(logits, tokens)
    ce = token_ce * masked / t
    answer_len = jnp.maximum(response.sum(axis=1, keepdims=True), 1)
    loss = jnp.sum(ce / answer_len) / b
    hit = logits.argmax(-1) == tokens
    acc = jnp.sum(hit & masked) / jnp.maximum(masked.sum(), 1)
    if not clean_term:
        return loss, {"loss": loss, "masked_acc": acc}
    clean_ce = jnp.sum(token_ce * visible) / jnp.maximum(visible.sum(), 1)
    intact = visible & ~corrupted
    metrics = {"md_loss": loss, "clean_ce": clean_ce, "masked_acc": acc,
               "clean_acc": jnp.sum(hit & intact) / jnp.maximum(intact.sum(), 1),
               "corrupt_acc": jnp.sum(hit & corrupted) / jnp.maximum(corrupted.sum(), 1)}
    loss = loss + clean_loss_weight * clean_ce
    return loss, {"loss": loss, **metrics}


def two_stream_mask(length: int, block: int, *, noisy_causal: bool, clean_causal: bool) -> np.ndarray:
    """[2T, 2T] visibility for inputs [x_noisy ; x_clean] (True = may attend).

    Noisy block k sees its own block (causally when `noisy_causal`, else bidirectionally) and
    the clean tokens of blocks < k; the clean half sees itself causally (`clean_causal`) or
    block-causally, and never the noisy half.
    """
    pos = np.arange(length)
    blk = pos // block
    same_block = blk[:, None] == blk[None, :]
    noisy_self = same_block & (pos[None, :] <= pos[:, None]) if noisy_causal else same_block
    noisy_clean = blk[None, :] < blk[:, None]
    clean_self = (pos[None, :] <= pos[:, None]) if clean_causal else (blk[None, :] <= blk[:, None])
    top = np.concatenate([noisy_self, noisy_clean], axis=1)
    bottom = np.concatenate([np.zeros((length, length), bool), clean_self], axis=1)
    return np.concatenate([top, bottom], axis=0)


def _two_stream_forward(model: Transformer, noisy: jax.Array, clean: jax.Array, mask: np.ndarray, *,
                        lora_gate: bool = False):
    b, t_len = clean.shape
    positions = jnp.broadcast_to(jnp.tile(jnp.arange(t_len, dtype=jnp.int32), 2), (b, 2 * t_len))
    full = jnp.broadcast_to(jnp.asarray(mask), (b, 2 * t_len, 2 * t_len))
    tokens = jnp.concatenate([noisy, clean], axis=1)
    kw = {"lora_gate": (tokens == _mask_id(model)).astype(jnp.float32)} if lora_gate else {}
    logits = model(tokens, positions=positions, mask=full, **kw).logits
    return logits[:, :t_len], logits[:, t_len:]


def block_diffusion(model: Transformer, batch: Batch, rng: jax.Array):
    tokens, response = batch["tokens"], ~batch["prompt_mask"]
    b, t_len = tokens.shape
    block = model.config.block_size
    k_t, k_m = jax.random.split(rng)
    t = jax.random.uniform(k_t, (b, 1), minval=EPS, maxval=1.0)
    masked = (jax.random.uniform(k_m, (b, t_len)) < t) & response
    noisy = jnp.where(masked, _mask_id(model), tokens)
    mask = two_stream_mask(t_len, block, noisy_causal=False, clean_causal=False)
    noisy_logits, _ = _two_stream_forward(model, noisy, tokens, mask)
    ce = _token_ce(noisy_logits, tokens) * masked / t
    loss = jnp.sum(ce) / jnp.maximum(response.sum(), 1)
    acc = jnp.sum((noisy_logits.argmax(-1) == tokens) & masked) / jnp.maximum(masked.sum(), 1)
    return loss, {"loss": loss, "masked_acc": acc}


def introspective(model: Transformer, batch: Batch, rng: jax.Array, *, ce_alpha: float | None = None,
                  noisy_block: int | None = None, lora_gate: bool = False):
    """I-DLM's loss. `ce_alpha` None: Eq. 2's auto-balance (the clean term's weight is the
    constant CE_mask / CE_clean of this batch: no gradient flows through it); a number: that
    fixed weight. `noisy_block`: masks per noisy block (default `config.block_size`).
    `lora_gate`: pass the R-ISD gate, 1.0 on [MASK] rows (masked response tokens of the noisy
    stream), 0.0 on every other row (prompt tokens, the whole clean stream)."""
    del rng  # all-masked: nothing is random
    tokens, response = batch["tokens"], ~batch["prompt_mask"]
    t_len = tokens.shape[1]
    noisy = jnp.where(response, _mask_id(model), tokens)
    block = model.config.block_size if noisy_block is None else noisy_block
    mask = two_stream_mask(t_len, block, noisy_causal=True, clean_causal=True)
    noisy_logits, clean_logits = _two_stream_forward(model, noisy, tokens, mask, lora_gate=lora_gate)
    # Logit shift: row i predicts token i + 1; a target counts when it is a response token.
    targets = tokens[:, 1:]
    weight = response[:, 1:].astype(jnp.float32)
    n = jnp.maximum(weight.sum(), 1.0)
    noisy_ce = jnp.sum(_token_ce(noisy_logits[:, :-1], targets) * weight) / n
    clean_ce = jnp.sum(_token_ce(clean_logits[:, :-1], targets) * weight) / n
    if ce_alpha is None:
        scale = jax.lax.stop_gradient(noisy_ce / jnp.maximum(clean_ce, 1e-6))
    else:
        scale = jnp.float32(ce_alpha)
    loss = noisy_ce + scale * clean_ce
    acc = jnp.sum((noisy_logits[:, :-1].argmax(-1) == targets) * weight) / n
    return loss, {"loss": loss, "noisy_ce": noisy_ce, "clean_ce": clean_ce, "clean_scale": scale,
                  "masked_acc": acc}


def autoregressive(model: Transformer, batch: Batch, rng: jax.Array):
    del rng
    tokens, response = batch["tokens"], ~batch["prompt_mask"]
    logits = model(tokens).logits  # the model's own (causal) attention
    weight = response[:, 1:].astype(jnp.float32)
    n = jnp.maximum(weight.sum(), 1.0)
    loss = jnp.sum(_token_ce(logits[:, :-1], tokens[:, 1:]) * weight) / n
    acc = jnp.sum((logits[:, :-1].argmax(-1) == tokens[:, 1:]) * weight) / n
    return loss, {"loss": loss, "next_token_acc": acc}


OBJECTIVES: dict[str, Objective] = {
    "masked_diffusion": masked_diffusion,
    "block_diffusion": block_diffusion,
    "introspective": introspective,
    "autoregressive": autoregressive,
}
# What each objective needs from the model config.
REQUIREMENTS: dict[str, dict[str, object]] = {
    "masked_diffusion": {"attention": "bidirectional", "logit_shift": False},
    "block_diffusion": {"attention": "block_causal", "logit_shift": False},
    "introspective": {"attention": "causal", "logit_shift": True},
    "autoregressive": {"attention": "causal", "logit_shift": True},
}


# Objective options ([train] keys passed on to the objective) and the objectives taking them.
# `noisy_block` and `lora_gate` come from the loop (a curriculum stage, a [lora] run), not [train].
OPTIONS: dict[str, tuple[str, ...]] = {"masked_diffusion": ("clean_loss_weight", "corrupt_prob"),
                                       "introspective": ("ce_alpha", "noisy_block", "lora_gate")}


def get_objective(name: str, model_config, **options: float) -> Objective:
    """The objective `name`, after checking the model is configured for it, with `options`
    (e.g. masked_diffusion's clean_loss_weight, corrupt_prob) bound. An option left at 0 is
    off and accepted by every objective; a non-zero one the objective lacks is refused."""
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; known: {sorted(OBJECTIVES)}")
    for field, value in REQUIREMENTS[name].items():
        if getattr(model_config, field) != value:
            raise ConfigError(f"objective {name!r} needs model {field}={value!r}, "
                              f"got {getattr(model_config, field)!r}")
    known = OPTIONS.get(name, ())
    bad = sorted(k for k, v in options.items() if v and k not in known)
    if bad:
        raise ConfigError(f"objective {name!r} has no option(s) {bad}"
                          + (f" (it takes {list(known)})" if known else ""))
    bound = {k: v for k, v in options.items() if k in known and v is not None}
    if bound.get("noisy_block", 1) < 1:
        raise ConfigError(f"objective {name!r}: noisy_block={bound['noisy_block']} must be >= 1")
    if name == "masked_diffusion" and bound.get("clean_loss_weight", 0) > 0:
        if not 0 < bound.get("corrupt_prob", 0) < 1:
            raise ConfigError(f"objective {name!r}: clean_loss_weight > 0 needs corrupt_prob in (0, 1), got "
                              f"{bound.get('corrupt_prob', 0)} (with no corrupted tokens the clean term "
                              f"only teaches copying the visible token)")
    return functools.partial(OBJECTIVES[name], **bound) if bound else OBJECTIVES[name]

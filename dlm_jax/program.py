"""The decode program (one pure function per static bucket) and the JAX executor over it.

`decode_step` follows the step contract of DESIGN.md: window tokens, positions, a visibility
mask over cache + window slots, an external K/V cache and the rows whose predictions are
wanted go in; per-row top-1 token and probability, the runner-up probability, the entropy,
optionally the rows' logits, and the window's K/V come out. It is model-agnostic: logit shift
is the host's business (it asks for row i - 1 to predict position i).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from buckets._compile import CompiledBuckets
from buckets._sets import BucketKey
from dlm_jax.models._transformer import Transformer
from dlm_jax.runtime.step import StepInputs, StepOutputs


def decode_step(graphdef, state, tokens, positions, visibility, k_cache, v_cache, logit_rows, *,
                full_logits: bool, mask_id: int | None = None):
    """One forward over the window; shapes as in `StepInputs`. Returns a tuple in the field
    order of `StepOutputs` (logits last, or None).

    `mask_id` is never proposed: its logit is removed before the softmax, so a commit always
    unmasks (committing the mask token would leave the slot masked and stall the block)."""
    model = nnx.merge(graphdef, state)
    has_cache = k_cache.shape[2] > 0  # static: P == 0 means no cache input is used
    out = model(tokens, positions=positions, mask=visibility,
                k_cache=k_cache if has_cache else None, v_cache=v_cache if has_cache else None,
                logit_rows=logit_rows)
    logits = out.logits
    if mask_id is not None:  # a select, not a scatter: stays a TFLite builtin
        logits = jnp.where(jnp.arange(logits.shape[-1]) == mask_id, -jnp.inf, logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    probs = jnp.exp(logp)
    top2, idx = jax.lax.top_k(probs, 2)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)
    return (idx[..., 0].astype(jnp.int32), top2[..., 0], top2[..., 1], entropy, out.k, out.v,
            logits if full_logits else None)


class JaxExecutor:
    """Executor over AOT-compiled `decode_step`s, one per bucket key."""

    def __init__(self, model: Transformer):
        self.config = model.config
        self._graphdef, state = nnx.split(model)
        # Flattened once: the state pytree is not re-walked on every step.
        self._leaves, self._treedef = jax.tree.flatten(state)
        self._programs = CompiledBuckets(self._build)

    def _build(self, key: BucketKey):
        cfg = self.config
        cache = jax.ShapeDtypeStruct((cfg.n_layers, key.batch, key.cache, cfg.n_kv_heads, cfg.head_dim),
                                     jnp.dtype(cfg.dtype))
        specs = (
            self._leaves,
            jax.ShapeDtypeStruct((key.batch, key.window), jnp.int32),
            jax.ShapeDtypeStruct((key.batch, key.window), jnp.int32),
            jax.ShapeDtypeStruct((key.batch, key.window, key.cache + key.window), jnp.bool_),
            cache, cache,
            jax.ShapeDtypeStruct((key.batch, key.rows), jnp.int32),
        )
        graphdef, treedef = self._graphdef, self._treedef

        def program(leaves, *inputs):
            return decode_step(graphdef, jax.tree.unflatten(treedef, leaves), *inputs,
                               full_logits=key.full_logits, mask_id=cfg.mask_token_id)

        return program, specs

    @property
    def compile_count(self) -> int:
        return self._programs.compile_count

    @property
    def compiled_keys(self) -> list[BucketKey]:
        return self._programs.keys

    def warmup(self, keys: list[BucketKey]) -> int:
        return self._programs.warmup(keys)

    def step(self, inputs: StepInputs) -> StepOutputs:
        exe = self._programs.get(inputs.key)
        out = exe(self._leaves, inputs.tokens, inputs.positions, inputs.visibility,
                  inputs.k_cache, inputs.v_cache, inputs.logit_rows)
        top_token, top_prob, second, entropy, k, v, logits = jax.device_get(out)
        return StepOutputs(top_token=np.asarray(top_token), top_prob=np.asarray(top_prob),
                           second_prob=np.asarray(second), entropy=np.asarray(entropy),
                           k_new=np.asarray(k), v_new=np.asarray(v),
                           logits=None if logits is None else np.asarray(logits))

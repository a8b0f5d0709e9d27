"""The decode program (one pure function per static bucket) and the JAX executor over it.

`decode_step` follows the step contract of `dlm_jax.runtime.step`: window tokens, positions,
a visibility mask over cache + window slots, an external K/V cache and the rows whose
predictions are wanted go in; per-row top-1 token and probability, the runner-up
probability, the entropy, optionally the rows' logits, and the window's K/V come out, named
as the contract names them. It is model-agnostic: logit shift is the host's business (it asks
for row i - 1 to predict slot i).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlm_jax._compile import CompiledBuckets
from dlm_jax.models._transformer import Transformer
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.step import (BuildCounts, Capabilities, Executor, StepInputs, StepOutputs, input_specs,
                                  output_names)


def decode_step(graphdef, state, tokens, positions, visibility, k_cache, v_cache, logit_rows, *,
                full_logits: bool, mask_id: int | None = None) -> dict[str, jax.Array]:
    """One forward over the window; shapes as in `StepInputs`. Returns `{output name: array}`
    for the names of `output_names` (logits only with `full_logits`).

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
    top_token, top_prob, second_prob = top2(probs)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)
    named = {"top_token": top_token.astype(jnp.int32), "top_prob": top_prob, "second_prob": second_prob,
             "entropy": entropy, "k_new": out.k, "v_new": out.v}
    if full_logits:
        named["logits"] = logits
    return named


def _is_kernel(path, leaf) -> bool:
    """A 2-D Linear kernel ([d_in, d_out]) of the state pytree."""
    return getattr(leaf, "ndim", 0) == 2 and any(getattr(k, "key", None) == "kernel" for k in path)


def top2(probs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(argmax, max, runner-up) over the last axis, as `jax.lax.top_k(probs, 2)` gives them
    (ties: the lower index first; a tied runner-up equals the max), from two max reductions:
    XLA's CPU top_k sorts every row, which took half the step time of a 30M model at 32 rows."""
    top = jnp.argmax(probs, axis=-1)
    vocab = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
    second = jnp.max(jnp.where(vocab == top[..., None], -jnp.inf, probs), axis=-1)
    return top, jnp.max(probs, axis=-1), second


def abstract_inputs(config, key: BucketKey) -> tuple[jax.ShapeDtypeStruct, ...]:
    """`jax.ShapeDtypeStruct`s of a bucket's inputs, from the step contract."""
    return tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for _, shape, dtype in input_specs(config, key))


class JaxExecutor(Executor):
    """Executor over AOT-compiled `decode_step`s, one per bucket key, compiled on first use
    (or ahead of time by `warmup`). `compile_count` counts its compilations. It runs every
    bucket of `capabilities` (default: `Capabilities.for_length(max_seq_len)`)."""

    def __init__(self, model: Transformer, *, capabilities: Capabilities | None = None):
        self.config = model.config
        self._capabilities = capabilities or Capabilities.for_length(self.config.max_seq_len)
        self._graphdef, state = nnx.split(model)
        # Flattened once: the state pytree is not re-walked on every step.
        paths, self._treedef = jax.tree_util.tree_flatten_with_path(state)
        # Linear kernels are held [d_out, d_in] and transposed back inside the program, where
        # XLA folds the transpose into the dot: its CPU GEMM runs that layout up to twice as
        # fast at 32 rows (benchmarks/roofline.py).
        self._transposed = tuple(_is_kernel(path, leaf) for path, leaf in paths)
        self._leaves = [jnp.asarray(leaf.T) if t else leaf for (_, leaf), t in zip(paths, self._transposed)]
        self._programs = CompiledBuckets(self._build)

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def _build(self, key: BucketKey):
        cfg = self.config
        graphdef, treedef, transposed = self._graphdef, self._treedef, self._transposed

        def program(leaves, *inputs):
            leaves = [leaf.T if t else leaf for leaf, t in zip(leaves, transposed)]
            return decode_step(graphdef, jax.tree.unflatten(treedef, leaves), *inputs,
                               full_logits=key.full_logits, mask_id=cfg.mask_token_id)

        return program, (self._leaves, *abstract_inputs(cfg, key))

    def fork(self) -> JaxExecutor:
        """A second executor over the same weights (no copy) with programs of its own, for a
        second thread (the CPU refresh path of progressive revision)."""
        twin = object.__new__(JaxExecutor)
        twin.__dict__.update(self.__dict__)
        twin._programs = CompiledBuckets(twin._build)
        return twin

    @property
    def compile_count(self) -> int:
        return self._programs.compile_count

    def build_counts(self) -> BuildCounts:
        return BuildCounts(compiles=self._programs.compile_count, compile_seconds=self._programs.compile_seconds)

    @property
    def compiled_keys(self) -> list[BucketKey]:
        return self._programs.keys

    def warmup(self, keys: Sequence[BucketKey]) -> int:
        return self._programs.warmup(keys)

    def step(self, inputs: StepInputs, *, timings: dict[str, float] | None = None) -> StepOutputs:
        """Run one step. With `timings`, the transfer in, the compiled compute and the
        transfer out are each waited for and timed (seconds, under "h2d", "compute", "d2h");
        without, JAX overlaps them as it likes."""
        key = inputs.key
        program = self._programs.get(key)
        # Only what the host reads leaves the device: the window K/V stay behind on steps
        # that do not store them.
        names = [n for n in output_names(key) if inputs.want.kv or n not in ("k_new", "v_new")]
        if timings is None:
            out = program(self._leaves, *inputs.arrays())
            fetched = jax.device_get({n: out[n] for n in names})
        else:
            t0 = time.perf_counter()
            args = jax.block_until_ready(jax.device_put(inputs.arrays()))
            t1 = time.perf_counter()
            out = jax.block_until_ready(program(self._leaves, *args))
            t2 = time.perf_counter()
            fetched = jax.device_get({n: out[n] for n in names})
            timings.update(h2d=t1 - t0, compute=t2 - t1, d2h=time.perf_counter() - t2)
        return StepOutputs.from_named({n: np.asarray(v) for n, v in fetched.items()})

"""The decode program (one pure function per static bucket) and the JAX executor over it.

`decode_step` follows the dense step contract of `dlm_jax.runtime.step`: window tokens,
positions, a visibility mask over cache + window slots, an external K/V cache and the rows
whose predictions are wanted go in; per-row top-1 token and probability, the runner-up
probability, the entropy, optionally the rows' logits, and the window's K/V come out, named
as the contract names them. It is model-agnostic: logit shift is the host's business (it asks
for row i - 1 to predict slot i).

A decode does not feed it from the host: `JaxExecutor.open` makes a `DeviceKVCache`, the
decode's K and V as device arrays, one [B, Hkv, S, Dh] array per layer each (S: the decode's
slots, bucketed), and each step is one program (`_build_resident`) that reads the cache (in
place on an accelerator, every slot with the unread ones masked: `slot_reads`; the read slots
gathered first on a CPU: `default_attention`), builds the visibility there from the slot
positions uploaded once, runs `decode_step` and scatters the window rows' K/V into the cache,
whose buffers it donates. Per
step the host sends the `SlotStep` (ids, positions, flags, slot indices) and reads back the
rows' predictions, each as one array (`pack_request`, `pack_predictions`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlm_jax._errors import ConfigError
from dlm_jax.executors._compile import CompiledBuckets, choose_compile, target_platform
from dlm_jax.executors._logits import DeviceLogits
from dlm_jax._config import ModelConfig
from dlm_jax.models import _attention_kernel
from dlm_jax.models.quant import widen_int4
from dlm_jax.models._fuse import PROJECTIONS_ENV, choose_projections, fuse_projections, is_fused
from dlm_jax.models._scan import ScannedTransformer, StackedLayers, choose_layers
from dlm_jax._partition import param_name
from dlm_jax.models._transformer import (ATTENTION_FORMS, CUDNN_FORMS, EXPERT_EXCHANGES, KERNEL_FORMS, Transformer,
                                         attention_form, expert_mesh, joint_rope, layers_traced_once)
from dlm_jax.runtime.buckets import JAX_BATCH_BUCKETS, BucketKey, pad_axis
from dlm_jax.runtime.kvcache import KVCache, Transfers
from dlm_jax.runtime.step import (INPUT_NAMES, LORA_GATE, OUTPUTS, REQUEST, VIEW_NAMES, BuildCounts, Capabilities,
                                  Executor, SlotStep, StepInputs, StepOutputs, input_specs, model_outputs,
                                  output_names, output_specs, request_specs, visibility)

# How a decode's step reads its resident K/V: in place ("split", "concat", "cudnn" or
# "cudnn_split", the model's `ATTENTION_FORMS`, over every slot with the unread ones masked;
# "cudnn" over a concatenated copy of each layer's cache and window) or "gather" (the
# read slots copied out first, [L, B, P, Hkv, Dh], as before).
RESIDENT_ATTENTION = (*ATTENTION_FORMS, "gather")
ATTENTION_ENV = "DLM_JAX_ATTENTION"
# How an engine's call (a cache whose rows are assigned to requests) computes its batch rows:
# "batched" (one forward over all of them: the matmuls' rows are every batch row's window rows)
# or "each" (the batch-1 forward once per live row, in a loop inside one program): every row
# runs the same code, whichever batch row it sits in and whatever the others hold, and with the
# engine's "free" padding every call is the one program of its bucket, so a request's outputs
# are the same bytes alone and under load (batch invariance, `docs/engine.md`). A decode's own
# fixed batch (`Decoder.decode`) runs batched either way.
ROW_MODES = ("batched", "each")
ROWS_ENV = "DLM_JAX_ROWS"
EXCHANGE_ENV = "DLM_JAX_EXPERT_EXCHANGE"


def default_rows() -> str:
    """"each" on a CPU, where a step's cost is its rows' arithmetic either way (measured on this
    project's 2-core CPU: llada-12m decodes as fast row by row, `docs/engine.md`), so batch
    invariance costs nothing; "batched" on an accelerator, whose step at small batches is
    bound by reading the weights once per call, not once per row."""
    return "each" if target_platform() == "cpu" else "batched"


_NOT_BATCH_LEADING = ("k_new", "v_new", "router_topk", "ffn_active")  # [L or M, B, ...]
_WINDOW_AXIS = {s.name: s.axes.index("W") for s in OUTPUTS if "W" in s.axes}  # outputs along the window


def _but_window(spec: tuple) -> tuple:
    """A resident program's spec ((key, slots, ...)) but its window: the programs that could
    run each other's steps padded share it."""
    return (dataclasses.replace(spec[0], window=0), *spec[1:])


def _widest(specs: Sequence[tuple]) -> list[tuple]:
    """Of resident program specs, in order, those of which no wider window with the same rest
    is among them."""
    top: dict[tuple, int] = {}
    for spec in specs:
        top[_but_window(spec)] = max(top.get(_but_window(spec), 0), spec[0].window)
    return [spec for spec in specs if spec[0].window == top[_but_window(spec)]]


# The JAX executors built over each model. One that changes its model in place (fusing its
# projections, stacking its layers: the joined arrays are deleted) marks the others over that
# model stale, and a stale executor refuses to run in one line (its arrays are gone).
_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def each_row(row_step, live, shapes: dict[str, tuple[tuple[int, ...], str]], cache: tuple):
    """A step computed one batch row at a time: `row_step(i, cache)` (the batch-1 step of batch
    row i, which reads and then writes `cache`, returning its outputs with batch axes of 1 and
    the cache) in a loop over the first `live` rows (a traced count; the rows after it, padding,
    are not computed and read back as zeros). Every row runs the same loop body, so in one
    program a row's bytes depend neither on its batch row nor on the others, and the program
    serves every number of live rows. `shapes`: {output name: (shape, dtype)} of the whole step (`output_specs`, the
    window K/V left out: each row stores its own in the loop). Returns (outputs, cache)."""
    init = {n: jnp.zeros(shape, dtype) for n, (shape, dtype) in shapes.items()}

    def body(i, carry):
        acc, cache = carry
        named, cache = row_step(i, cache)
        acc = {n: jax.lax.dynamic_update_slice_in_dim(acc[n], named[n].astype(acc[n].dtype), i,
                                                       axis=1 if n in _NOT_BATCH_LEADING else 0) for n in acc}
        return acc, cache

    return jax.lax.fori_loop(0, live, body, (init, cache))


# A GPU executor's defaults: what a lease's timed steps chose (`benchmarks/gpu_decide.py`, which
# the lease's `decide` part runs; docs/benchmarks.md). `default_attention` and
# `default_projections` fall back where a model or mesh cannot take them.
GPU_ATTENTION = "split"
GPU_PROJECTIONS = "separate"


def default_attention(config: ModelConfig | None = None, mesh=None) -> str:
    """"gather" on a CPU; on a GPU `GPU_ATTENTION` where this model (`config`) and `mesh` take it
    (a kernel form: a head dim it loads, a tp that divides the K/V heads; a cuDNN form: a
    bfloat16 or float16 model), else "split" (the cache read in place), which is also a TPU's.

    As measured: on one H200 at LLaDA-8B shape the in-place step took 6.66 ms against 7.29 ms
    gathered at batch 1 with the dual cache, and as long elsewhere
    (`benchmarks/results/gpu_step.md`); on this project's 2-core CPU a 29M model's prefix-cache
    decodes took about 13% longer in place (reading every slot costs more there than copying the
    read ones) and as long gathered as before this change
    (`benchmarks/results/before_after_split.json`, `before_after_gather.json`)."""
    platform = target_platform()
    if platform == "cpu":
        return "gather"
    form = GPU_ATTENTION if platform == "gpu" else "split"
    if config is not None and ((form in KERNEL_FORMS and _kernel_refusal(config, mesh))
                               or (form in CUDNN_FORMS and _cudnn_refusal(config))):
        return "split"
    return form


def default_projections(mesh=None) -> str:
    """`GPU_PROJECTIONS` on a GPU off a mesh (fused projections on a mesh are not built), else
    "separate"."""
    return GPU_PROJECTIONS if target_platform() == "gpu" and mesh is None else "separate"


def decode_step(graphdef, state, tokens, positions, visibility, k_cache, v_cache, logit_rows, *,
                full_logits: bool, mask_id: int | None = None, lora_gate=None,
                router_topk: bool = False, ffn_active: bool = False, one_rope: bool = False) -> dict[str, jax.Array]:
    """One forward over the window; shapes as in `StepInputs`. Returns `{output name: array}`
    for the names of `output_names` (logits only with `full_logits`, the MoE layers' routed
    experts only with `router_topk`, the FFN neurons each row activates, bit-packed, only
    with `ffn_active`). `lora_gate` [B, W]: the rows whose LoRA adapters apply (a model with
    adapters; R-ISD).

    `mask_id` is never proposed: its logit is removed before the softmax, so a commit always
    unmasks (committing the mask token would leave the slot masked and stall the block).

    Traced, the blocks of one structure are traced once (`layers_traced_once`): the same
    compiled program, traced and lowered in a fraction of the time. `one_rope`: q and k
    rotated by one RoPE op (`joint_rope`; the executor's `one_rope`)."""
    model = nnx.merge(graphdef, state)
    # static: P == 0 means no cache input is used (a resident cache read in place comes as one
    # array per layer, [B, Hkv, S, Dh])
    has_cache = (k_cache[0] if isinstance(k_cache, (tuple, list)) else k_cache).shape[2] > 0
    with layers_traced_once(), joint_rope(one_rope):
        out = model(tokens, positions=positions, mask=visibility,
                    k_cache=k_cache if has_cache else None, v_cache=v_cache if has_cache else None,
                    logit_rows=logit_rows, **({} if lora_gate is None else {"lora_gate": lora_gate}),
                    **({"router_topk": True} if router_topk else {}), **({"ffn_act": True} if ffn_active else {}))
    named = {**predictions(out.logits, mask_id=mask_id, full_logits=full_logits), "k_new": out.k, "v_new": out.v}
    if router_topk:
        named["router_topk"] = out.router_topk
    if ffn_active:
        named["ffn_active"] = pack_bits(out.ffn_act > 0)
    return named


def predictions(logits: jax.Array, *, mask_id: int | None, full_logits: bool) -> dict[str, jax.Array]:
    """The step's per-row predictions from the rows' logits: top token, its probability, the
    runner-up's, the entropy (and the logits with `full_logits`). `mask_id` is never proposed:
    its logit is removed before the softmax."""
    if mask_id is not None:  # a select, not a scatter: stays a TFLite builtin
        logits = jnp.where(jnp.arange(logits.shape[-1]) == mask_id, -jnp.inf, logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    probs = jnp.exp(logp)
    top_token, top_prob, second_prob = top2(probs)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)
    named = {"top_token": top_token.astype(jnp.int32), "top_prob": top_prob, "second_prob": second_prob,
             "entropy": entropy}
    if full_logits:
        named["logits"] = logits
    return named


# A resident step's request goes to the device as one array, and its predictions come back as
# one: each host array a call takes is a transfer of its own, and each output read back one
# more (on a GPU, a copy and a wait apiece per step; ten request arrays and four predictions
# before). `pack_request` lays the `SlotStep` arrays side by side, int32; `pack_predictions`
# stacks the four predictions, int32 (the probabilities by their bits: integers are moved
# as they are, where float bits that spell a denormal or a NaN might not be).
PREDICTIONS = ("top_token", "top_prob", "second_prob", "entropy")


@functools.lru_cache(maxsize=None)
def request_layout(key: BucketKey, gated: bool = False) -> tuple[tuple[str, int, int, tuple[int, ...], str], ...]:
    """(name, first column, columns, shape, dtype) of each array of a device step of bucket
    `key` (`runtime.step.request_specs`, in order) in its packed request [B, C] int32: each
    batch row's elements side by side, bool as 0 / 1, float32 (`lora_gate`) by its bits."""
    layout, col = [], 0
    for name, shape, dtype in request_specs(key, gated=gated):
        width = int(np.prod(shape[1:], dtype=np.int64))
        layout.append((name, col, width, tuple(shape), dtype))
        col += width
    return tuple(layout)


def request_columns(layout) -> int:
    """C, the columns of a packed request in `layout` (`request_layout`)."""
    return layout[-1][1] + layout[-1][2]


def pack_request(arrays: Mapping[str, np.ndarray], layout) -> np.ndarray:
    """The packed request [B, C] int32 of a step's arrays (`SlotStep.arrays`) in `layout`
    (`request_layout`); `unpack_request` is its inverse in the program."""
    b = layout[0][3][0]
    packed = np.empty((b, request_columns(layout)), np.int32)
    for name, start, width, shape, dtype in layout:
        a = arrays[name]
        if a.shape != shape:  # (a list shared by every row)
            a = np.broadcast_to(a, shape)
        if dtype == "float32":
            a = np.ascontiguousarray(a, np.float32).view(np.int32)
        packed[:, start:start + width] = a.reshape(b, width) if a.ndim != 2 else a
    return packed


def unpack_request(packed: jax.Array, layout) -> list[jax.Array]:
    """The arrays of a packed request (`pack_request`), in `layout`'s order, each in its own
    shape and dtype (its rows `packed`'s: a replica's share in a per-replica step)."""
    out = []
    for _, start, width, shape, dtype in layout:
        x = packed[:, start:start + width].reshape((packed.shape[0], *shape[1:]))
        out.append(x != 0 if dtype == "bool" else
                   jax.lax.bitcast_convert_type(x, jnp.float32) if dtype == "float32" else x)
    return out


def pack_predictions(named: dict[str, jax.Array]) -> jax.Array:
    """[4, B, R] int32: `PREDICTIONS` stacked (removed from `named`), the float32 ones by
    their bits (`unpack_predictions` reads them back)."""
    return jnp.stack([named.pop(n).astype(jnp.int32) if n == "top_token" else
                      jax.lax.bitcast_convert_type(named.pop(n).astype(jnp.float32), jnp.int32) for n in PREDICTIONS])


def unpack_predictions(packed: np.ndarray) -> dict[str, np.ndarray]:
    """`pack_predictions`' arrays on the host, by name."""
    packed = np.ascontiguousarray(packed, np.int32)
    return {n: packed[i] if n == "top_token" else packed[i].view(np.float32) for i, n in enumerate(PREDICTIONS)}


def pack_bits(active: jax.Array) -> jax.Array:
    """bool [..., F] -> int32 [..., ceil(F / 32)]: bit j of word w is element 32 w + j (the
    layout of `dlm_jax.techniques.powerinfer.neurons.unpack_active`). Distinct powers of two summed in int32 are
    their bitwise OR, bit 31 landing on the sign, in ops every backend has (multiply by
    constants, sum: TFLite has no builtin shift)."""
    f = active.shape[-1]
    words = -(-f // 32)
    bits = jnp.pad(active, [(0, 0)] * (active.ndim - 1) + [(0, 32 * words - f)]).astype(jnp.int32)
    bits = bits.reshape(*active.shape[:-1], words, 32)
    powers = jnp.asarray((np.uint32(1) << np.arange(32, dtype=np.uint32)).view(np.int32))
    return jnp.sum(bits * powers, axis=-1, dtype=jnp.int32)


def _transposed(leaf):
    """A 2-D leaf transposed: a device array, or a `jax.ShapeDtypeStruct` (an executor over an
    abstract model, built to lower its programs from shapes alone: `benchmarks/gpu_step.py`)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[::-1], leaf.dtype)
    return jnp.asarray(leaf.T)


def _is_kernel(path, leaf) -> bool:
    """A 2-D Linear kernel ([d_in, d_out]) of the state pytree, stored or weight-only quantized
    (`QuantLinear.qkernel`: held transposed on the CPU too, measured 5% faster there at 29M)."""
    return getattr(leaf, "ndim", 0) == 2 and any(getattr(k, "key", None) in ("kernel", "qkernel") for k in path)


@dataclasses.dataclass
class _SplitLayer:
    """Where a split MoE layer's slots sit among the executor's leaves, and what they hold."""

    weights: tuple[int, int, int]  # leaf indices of the gate, up and down slot buffers
    slot_map: int  # leaf index of its ExpertSlotMap
    cpu: object  # its CpuExperts (host weights, the CPU path)
    resident: np.ndarray  # [S] the expert in each slot


def _split_layers(model: Transformer, paths) -> dict[int, _SplitLayer]:
    """The split MoE layers of `model` (`split_experts`), by layer index."""
    index = {tuple(getattr(k, "key", getattr(k, "name", None)) for k in path): i for i, (path, _) in enumerate(paths)}
    out = {}
    for i, block in enumerate(model.layers):
        ffn = block.ffn
        if getattr(ffn, "slot_of", None) is None:
            continue
        at = lambda name: index[("layers", i, "ffn", name, "value")]  # noqa: E731
        slot_of = np.asarray(ffn.slot_of[...])
        resident = np.empty(ffn.gate[...].shape[0], np.int64)
        resident[slot_of[slot_of >= 0]] = np.flatnonzero(slot_of >= 0)
        out[i] = _SplitLayer((at("gate"), at("up"), at("down")), at("slot_of"), ffn.cpu_experts, resident)
    return out


def _cudnn_refusal(config: ModelConfig) -> str:
    """Why cuDNN's fused attention would never run for this model (its dtype), or ""."""
    if str(config.dtype) in ("bfloat16", "float16"):
        return ""
    return (f"cuDNN's fused attention takes bfloat16 or float16, and the model computes in {config.dtype} "
            f"(load it with dtype='bfloat16')")


def _kernel_refusal(config: ModelConfig, mesh) -> str:
    """Why the attention kernel would never run for this model (on `mesh`, the executor's
    argument), or "": a head dim it cannot load, or a mesh whose tp does not divide the K/V heads
    (`_attention_kernel.shards`). Other shapes, a window or a cache it cannot load, keep the split
    form step by step: a decode's buckets vary."""
    from dlm_jax._partition import MeshShape
    from dlm_jax.executors.sharding import MeshPlacement

    if not _attention_kernel.fits(16, 0, config.head_dim):
        return f"the attention kernel takes head dims of 16-256 (a power of two), and this model's is {config.head_dim}"
    tp = 1 if mesh is None else (mesh.shape if isinstance(mesh, MeshPlacement) else MeshShape.parse(mesh)).tp
    if config.n_kv_heads % tp:
        return (f"the attention kernel on a mesh needs tp to divide the K/V heads, and tp={tp} does not divide this "
                f"model's {config.n_kv_heads}")
    return ""


def _placement(mesh, model: Transformer, slots: dict):
    """The `MeshPlacement` of `mesh` for `model`, refused in one line where it does not divide
    the model or its expert slots, or needs more devices than it has (`MeshShape.check`)."""
    from dlm_jax._partition import MeshShape
    from dlm_jax.executors.sharding import MeshPlacement

    placement = (mesh if isinstance(mesh, MeshPlacement) else MeshPlacement(MeshShape.parse(mesh))).for_model(
        model.config, getattr(model, "quant", None))
    shape = placement.shape
    slot_count = next(iter(slots.values())).resident.size if slots else None
    shape.check(model.config, devices=placement.mesh.devices.size, expert_slots=slot_count)
    return placement


def _sharded_leaf(placement, leaf, sharding, transposed: bool):
    """A parameter on its shards, transposed ([out, in]) where the executor holds it so: put on the
    mesh first, then transposed there, each device its own shard."""
    if not transposed:
        return placement.put(leaf, sharding)
    spec = sharding.spec
    placed = placement.put(leaf, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        *tuple(spec)[::-1]) if len(spec) else spec))
    return jax.jit(lambda a: a.T, out_shardings=sharding)(placed)


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


def gather_view(k_res, v_res, pos, valid, written, read, read_len, rows, *, written_only: bool):
    """The read slots of a resident cache (per layer [B_pool, Hkv, S, Dh]), per batch row: `read`
    [B, P] of cache row `rows` [B] (-1: a padding row, which sees nothing). Returns K/V [L, B,
    P, Hkv, Dh] (zeros where `read` is -1), their positions and whether each batch row may see
    them, [B, P] (a row sees its first `read_len` [B] columns). Each (row, slot) pair is
    gathered directly: nothing but the read entries is copied."""
    ok = (read >= 0) & (rows >= 0)[:, None]  # [B, P]
    idx = jnp.where(ok, read, 0)
    r = jnp.where(rows >= 0, rows, 0)[:, None]  # [B, 1]
    keep = ok[None, :, :, None, None]
    # layer[r, :, idx]: the advanced indices (axes 0 and 2) are split by a slice, so their
    # [B, P] dimensions come first: [B, P, Hkv, Dh] per layer.
    k = jnp.where(keep, jnp.stack([layer[r, :, idx] for layer in k_res]), 0)
    v = jnp.where(keep, jnp.stack([layer[r, :, idx] for layer in v_res]), 0)
    k_pos = jnp.where(ok, pos[r, idx], 0)
    k_ok = ok & valid[r, idx] & (jnp.arange(read.shape[1])[None, :] < read_len[:, None])
    if written_only:
        k_ok = k_ok & written[r, idx]
    return k, v, k_pos, k_ok


def slot_reads(valid, read, read_len, hide):
    """The read slots of a resident cache as a mask over all of its slots, for attention that
    reads the cache in place: [B, S] whether each batch row sees each slot (one of its first
    `read_len` [B] entries of its `read` row [B, P], and `valid` [B, S], the batch rows' own),
    and `hide` [B, W] re-indexed from the read columns (cache columns 0..P-1, then the
    window's) to the slots (0..S-1, then S + window row). The same visibility as
    `gather_view`'s over the gathered columns, column for column."""
    b, s = valid.shape
    p = read.shape[1]
    ok = (read >= 0) & (jnp.arange(p)[None, :] < read_len[:, None])  # [B, P]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, p))
    cols = jnp.where(read >= 0, read, s)  # s: dropped
    seen = jnp.zeros((b, s), bool).at[rows, cols].max(ok, mode="drop") & valid
    from_read = (jnp.take_along_axis(read, jnp.clip(hide, 0, max(p - 1, 0)), axis=1) if p
                 else jnp.full_like(hide, -1))
    hide = jnp.where(hide < 0, -1, jnp.where(hide < p, from_read, hide - p + s))
    return seen, hide


def scatter_rows(k_res, v_res, written, k_new, v_new, write, rows):
    """Store window rows' K/V [L, B, W, Hkv, Dh] at their slots of a resident cache (for K and
    for V, L arrays [B_pool, Hkv, S, Dh]), batch row b into cache row `rows[b]` (`write` [B,
    W], -1: none; a padding row, `rows` -1, stores nothing); the rest of the cache is untouched
    (in place when donated).

    Every (cache row, slot) pair is distinct, the dropped ones too (each gets a slot of its
    own past the cache), so the scatters are declared `unique_indices`: XLA:GPU's scatter
    emitter then stores each update, where it otherwise applies each element atomically (for
    a bfloat16 overwrite, a compare-and-swap loop). Before, a batch-8 refresh's K/V write took
    6.1 ms of its 88 ms step on one H200 (`benchmarks/results/gpu_step.md`, the cache then
    laid out [L, B, S, Hkv, Dh]). The host never stores two window rows at one slot of one
    cache row (a window's slots are distinct, each request has a cache row of its own)."""
    s = written.shape[1]
    b, w = write.shape
    dropped = s + jnp.arange(b * w, dtype=write.dtype).reshape(b, w)  # past the cache, each its own
    target = jnp.where((write >= 0) & (rows >= 0)[:, None], write, dropped)
    at = jnp.broadcast_to(jnp.where(rows >= 0, rows, 0)[:, None], target.shape)
    # A layer's cache is [B, Hkv, S, Dh]: indexed at (rows, slots), its updates are [B, W, Hkv, Dh].
    store = dict(mode="drop", unique_indices=True)
    k_res = tuple(layer.at[at, :, target].set(new.astype(layer.dtype), **store) for layer, new in zip(k_res, k_new))
    v_res = tuple(layer.at[at, :, target].set(new.astype(layer.dtype), **store) for layer, new in zip(v_res, v_new))
    return k_res, v_res, written.at[at, target].set(True, **store)


def replica_local(rows: np.ndarray, pool: int, replicas: int) -> bool:
    """Whether a step's batch rows `rows` [B] (cache rows of a pool of `pool` rows; -1 a padding
    row) can run per replica (`JaxExecutor`'s per-replica steps): the batch splits into
    `replicas` equal chunks, chunk d's live rows all in replica d's cache rows (d * pool /
    replicas onwards) and before its padding rows."""
    rows = np.asarray(rows)
    if replicas <= 1 or pool % replicas or len(rows) % replicas:
        return False
    per = pool // replicas
    for d, chunk in enumerate(np.split(rows, replicas)):
        live = chunk >= 0
        if live.any() and not live[:live.sum()].all():
            return False
        if ((chunk[live] // per) != d).any():
            return False
    return True


def request_names(gated: bool) -> tuple[str, ...]:
    """The `SlotStep` arrays a device step takes, in order (`lora_gate` last, when gated)."""
    return tuple(s.name for s in REQUEST) + ((LORA_GATE.name,) if gated else ())


def device_specs(key: BucketKey, gated: bool = False) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The `SlotStep` arrays of a bucket (`runtime.step.request_specs`), as JAX specs."""
    return tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for _, shape, dtype in request_specs(key, gated=gated))


def _keeps_logits(req: SlotStep, names: list[str], executor) -> bool:
    """Whether a step's logits stay where it ran (`OutputRequest.device_logits`:
    `_logits.DeviceLogits`); they are then taken out of `names`, the outputs read back."""
    kept = req.want.device_logits and "logits" in names and bool(executor.capabilities.logits_on)
    if kept:
        names.remove("logits")
    return kept


class DeviceKVCache(KVCache):
    """The K/V of one decode on the JAX executor's device: `k` and `v`, a tuple of one [B, Hkv,
    S, Dh] array per layer each (each head's slots contiguous: the layout the step's score and
    value products read in place; with [.., S, Hkv, Dh] a GPU profile showed one transposed
    copy of the cache per step, `benchmarks/results/gpu_step.md`). A buffer of its own per
    layer, not one [L, ...] array: a layer read out of a stacked cache is a slice at that
    layer's offset inside each of its GEMMs, which makes every layer's cache products a
    distinct kernel for XLA:GPU's autotuner (compiled for an H200: 72 distinct GEMM fusions in
    a prefix step instead of 10, twice the compile seconds without autotuning,
    `benchmarks/results/gpu_target.md`); over buffers of their own, the layers' products are
    one kernel, tuned once. Beside them, the slots' positions, validity and whether each
    (row, slot) holds K/V, all device arrays.
    A step sends its `SlotStep` and reads back the rows' predictions; its K/V are written in
    place (the cache's buffers are donated to the step)."""

    def __init__(self, executor: JaxExecutor, positions: np.ndarray, valid: np.ndarray):
        self.executor = executor
        b, s = positions.shape
        self._slots = executor.capacity(s)
        self.k, self.v, self.written = executor._allocs.get((b, self._slots))()  # made on the device, nothing sent
        # Host mirrors of the slot positions and validity (`assign` edits a row and uploads again).
        self._pos = pad_axis(np.asarray(positions, np.int32), self._slots, axis=1)
        self._ok = pad_axis(np.asarray(valid, bool), self._slots, axis=1, value=False)
        self.pos, self.valid = executor._put(self._pos), executor._put(self._ok)
        self.transfers = Transfers(opened=self._pos.nbytes + self._ok.nbytes)
        self._writer: JaxExecutor = executor  # whose scatter programs `write` uses
        self.shared = False  # rows handed to requests (`assign`): an engine's cache, stepped by pooled programs

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def rows(self) -> int:
        """The cache rows (a pool's: more than a step's batch bucket)."""
        return self._pos.shape[0]

    @property
    def read_bucket_free(self) -> bool:
        # In place, attention reads all S slots, the unread ones masked (`slot_reads`): the
        # read bucket P only sizes the index list, so -1 padding to a larger P changes nothing
        # (steps with P > 0; a step reading nothing, P = 0, runs the cache-less forward; `step`
        # runs every such step in read bucket S, `JaxExecutor.read_bucket`). The gathered form
        # attends over P columns, whose padding changes the reductions' shape.
        return self.executor.attention != "gather"

    def assign(self, row: int, positions: np.ndarray, valid: np.ndarray) -> None:
        n = len(positions)
        if n > self._slots or len(valid) != n:
            raise ValueError(f"a request of {n} slots (valid: {len(valid)}) does not fit a cache row of {self._slots}")
        self.shared = True
        self._pos[row] = 0
        self._pos[row, :n] = positions
        self._ok[row] = False
        self._ok[row, :n] = valid
        self.pos, self.valid = self.executor._put(self._pos), self.executor._put(self._ok)
        clear = self._writer._clears.get((self.rows, self._slots))
        self.k, self.v, self.written = clear(self.k, self.v, self.written, self.executor._put(np.int32(row)))
        self.transfers.add(self._pos.nbytes + self._ok.nbytes, 0)

    def _resident_key(self, req: SlotStep) -> tuple:
        """The program of `req` on this cache: today's in-place program where the step's batch
        rows are the cache's rows in order (every solo decode), else the pooled one; on a mesh
        whose dp replicas run such steps per replica, the whole mesh's pooled program where
        the rows cross the replicas (`replica_local`)."""
        key = req.key
        if self.shared:  # an engine's calls: batch rows mapped to requests' rows, row by row with rows="each"
            pooled = True
        elif self.executor.attention == "gather" or key.cache == 0:
            pooled = self.rows != key.batch  # (row, slot) pairs gathered either way
        else:
            rows = req.rows
            pooled = not (self.rows == key.batch and (rows is None or np.array_equal(rows, np.arange(key.batch))))
        replicas = self.executor._replicas(self.rows, key.batch)
        if replicas > 1 and not replica_local(req.cache_rows(), self.rows, replicas):
            return (key, self._slots, self.rows, True, "across")  # rows that cross replicas: the whole mesh's program
        return (key, self._slots, self.rows, True) if pooled else (key, self._slots)

    def step(self, req: SlotStep, *, timings: dict[str, float] | None = None) -> StepOutputs:
        ex = self.executor
        key = ex.read_bucket(req.key, self._slots)
        req = req if key is req.key else req.widened(key.cache)
        spec, own = self._resident_key(req), req.key.window
        if ex.compile == "tiered" and spec not in ex._resident and (wider := ex._wider_window(spec)):
            ex._resident.build_behind(spec)  # (this step runs padded until its own program is built)
            req = req.widened_window(wider)
            spec = self._resident_key(req)
            ex.widened_steps += 1
        program = ex._resident.get(spec)
        inputs = ex.resident_inputs(req)
        arrays = ex._send(inputs)
        names = [n for n in output_names(req.key) if n not in ("k_new", "v_new", *PREDICTIONS)]
        kept = _keeps_logits(req, names, ex)
        if timings is None:
            preds, named, self.k, self.v, self.written = program(ex._leaves, self.k, self.v, self.written, self.pos,
                                                                 self.valid, *arrays)
            fetched = ex._get({"predictions": preds, **{n: named[n] for n in names}})
        else:
            t0 = time.perf_counter()
            args = jax.block_until_ready(ex._send(arrays, put=True))
            t1 = time.perf_counter()
            preds, named, self.k, self.v, self.written = jax.block_until_ready(
                program(ex._leaves, self.k, self.v, self.written, self.pos, self.valid, *args))
            t2 = time.perf_counter()
            fetched = ex._get({"predictions": preds, **{n: named[n] for n in names}})
            timings.update(h2d=t1 - t0, compute=t2 - t1, d2h=time.perf_counter() - t2)
        d2h = sum(v.nbytes for v in fetched.values())  # (`_get` gives host arrays)
        out = {**unpack_predictions(fetched.pop("predictions")), **fetched}
        if req.key.window != own:  # a wider window's program: this step's rows of its window outputs
            out = {n: a[(slice(None),) * _WINDOW_AXIS[n] + (slice(0, own),)] if n in _WINDOW_AXIS else a
                   for n, a in out.items()}
        if kept:
            out["logits"] = DeviceLogits(ex._kept(named["logits"]), transfers=self.transfers)
        self.transfers.add(sum(x.nbytes for x in inputs), d2h)
        return StepOutputs.from_named(out)

    def snapshot(self, req: SlotStep, executor) -> callable:
        """Gather the read slots now (a device copy, dispatched before the main step donates
        the cache); the returned callable runs the step over them on `executor`'s programs."""
        key = req.key
        gather = executor._gathers.get((key.batch, key.cache, self._slots, req.written_only, self.rows))
        view = gather(self.k, self.v, self.pos, self.valid, self.written,
                      *executor._send([req.read, req.lengths(), req.cache_rows()]))
        self._writer = executor
        given = req.arrays()
        arrays = executor._send([given[n] for n in VIEW_NAMES + ((LORA_GATE.name,) if executor.gated else ())])
        names = [n for n in output_names(key) if n not in ("k_new", "v_new")]
        kept = _keeps_logits(req, names, executor)
        transfers = self.transfers

        def run() -> StepOutputs:
            named = executor._views.get(key)(executor._leaves, *view, *arrays)
            out = executor._get({n: named[n] for n in names})
            if kept:
                out["logits"] = DeviceLogits(executor._kept(named["logits"]), transfers=transfers)
            transfers.add(req.read.nbytes + req.lengths().nbytes + req.cache_rows().nbytes + sum(a.nbytes for a in arrays),
                          sum(v.nbytes for v in out.values()))
            return StepOutputs(**out, kv=(named["k_new"], named["v_new"]))

        return run

    def write(self, kv, slots: np.ndarray, rows: np.ndarray, *, at: np.ndarray | None = None) -> None:
        k_new, v_new = kv
        width = k_new.shape[2]
        rows = np.asarray(rows, bool)
        write = pad_axis(np.where(rows, np.asarray(slots, np.int32)[None, :], -1).astype(np.int32), width, axis=1,
                         value=-1)
        at = np.arange(write.shape[0], dtype=np.int32) if at is None else np.asarray(at, np.int32)
        scatter = self._writer._scatters.get((write.shape[0], width, self._slots, self.rows))
        self.k, self.v, self.written = scatter(self.k, self.v, self.written, k_new, v_new,
                                               *self._writer._send([write, at]))
        self.transfers.add(write.nbytes + at.nbytes, 0)

    def close(self) -> None:
        self.k = self.v = self.written = None


class JaxExecutor(Executor):
    """Executor over AOT-compiled `decode_step`s, one per bucket key, compiled on first use
    (or ahead of time by `warmup`). `compile_count` counts its compilations. It runs every
    bucket of `capabilities` (default: `Capabilities.for_length(max_seq_len)` with batches up to 64,
    `JAX_BATCH_BUCKETS`).

    `layers`: "unrolled" (a Python loop over the blocks: XLA compiles L copies of a block) or
    "scan" (`dlm_jax.models._scan`: the blocks' weights stacked [L, ...] and run by
    `jax.lax.scan`, one block compiled whatever L); default `$DLM_JAX_LAYERS`, else
    "unrolled". With "scan" the model's layers are stacked in place (`stack_layers`: each
    parameter's per-layer arrays deleted once stacked, so the weights are held once); the model
    stays usable (`Transformer.__call__` runs over slices of the stack), but its layers no
    longer take adapters or split experts, and a model whose blocks differ is refused.

    `attention`: how a decode's step reads its resident cache (`RESIDENT_ATTENTION`); default
    `$DLM_JAX_ATTENTION`, else `default_attention()` (the platform's, where the model and mesh
    take it).

    `projections`: "separate" (each projection its own GEMM) or "fused" (`dlm_jax.models._fuse`:
    q/k/v and gate/up each one wider GEMM, fused in place in the model, each group's arrays
    deleted once joined, so the weights are held once; the model stays usable and saves as
    before, but takes no new adapters); default `$DLM_JAX_PROJECTIONS`, else
    `default_projections()` ("separate" but where a GPU's default says otherwise). A model
    fused before runs fused whatever is asked. Not on a mesh yet (refused in one line).

    Fusing or stacking in place deletes arrays that an executor built earlier over the same
    model holds: that one then refuses to run, in one line (`_HOLDERS`).

    `mesh`: decode on a device mesh (`dlm_jax._partition.MeshShape`, its `tp=2,ep=2` text, or a
    `dlm_jax.executors.sharding.MeshPlacement` over chosen devices): the parameters split by the
    partition rules training uses, the K/V cache by its heads (and rows over dp), every program
    compiled with those shardings (`dlm_jax.executors.sharding`); the host runtime sends and
    receives the same arrays as on one device. None: the default device, as before.

    `expert_exchange`: how an expert-parallel MoE layer brings rows to their experts on a mesh
    (`dlm_jax.models._transformer.EXPERT_EXCHANGES`): "psum" (default) or "all_to_all";
    default `$DLM_JAX_EXPERT_EXCHANGE`, else "psum".

    `compile`: "full" (default; `$DLM_JAX_COMPILE`) or "tiered": each step program compiled
    quick first and replaced by its full compile when a background thread has built it
    (`dlm_jax.executors._compile.CompiledBuckets`); `tiers()` counts each, `wait_for_upgrades`
    waits for the full ones."""

    def __init__(self, model: Transformer, *, capabilities: Capabilities | None = None, layers: str | None = None,
                 attention: str | None = None, rows: str | None = None, mesh=None,
                 expert_exchange: str | None = None, projections: str | None = None, compile: str | None = None):
        from dlm_jax.techniques.isd.lora import lora_spec

        self.compile = choose_compile(compile)
        self.widened_steps = 0  # steps run in a wider window's program while theirs compiled (tiered)

        rows_from_env = rows is None and bool(os.environ.get(ROWS_ENV))
        rows = rows or os.environ.get(ROWS_ENV) or default_rows()
        if rows not in ROW_MODES:
            raise ConfigError(f"{ROWS_ENV if rows_from_env else 'rows'}={rows!r}: known {', '.join(ROW_MODES)}")
        self.rows = rows

        from_env = attention is None and bool(os.environ.get(ATTENTION_ENV))
        attention = attention or os.environ.get(ATTENTION_ENV) or default_attention(model.config, mesh)
        name = ATTENTION_ENV if from_env else "attention"  # (where a refusal says the form came from)
        if attention not in RESIDENT_ATTENTION:
            raise ConfigError(f"{name}={attention!r}: known {', '.join(RESIDENT_ATTENTION)}")
        if attention in CUDNN_FORMS:  # refused here, not by the first compile that reads the cache
            if target_platform() != "gpu":
                raise ConfigError(f"{name}={attention!r}: cuDNN's fused attention runs on a GPU, and JAX's backend "
                                  f"here is {target_platform()!r}; use split or gather")
            if refusal := _cudnn_refusal(model.config):
                raise ConfigError(f"{name}={attention!r}: {refusal}")
        if attention in KERNEL_FORMS:
            if target_platform() != "gpu":
                raise ConfigError(f"{name}={attention!r}: the attention kernel is compiled by Triton for a GPU, and "
                                  f"JAX's backend here is {target_platform()!r}; use split or gather")
            if refusal := _kernel_refusal(model.config, mesh):  # (before anything changes the model)
                raise ConfigError(f"{name}={attention!r}: {refusal}; use split")
        self.attention = attention
        exchange_from_env = expert_exchange is None and bool(os.environ.get(EXCHANGE_ENV))
        expert_exchange = expert_exchange or os.environ.get(EXCHANGE_ENV) or "psum"
        if expert_exchange not in EXPERT_EXCHANGES:
            name = EXCHANGE_ENV if exchange_from_env else "expert_exchange"
            raise ConfigError(f"{name}={expert_exchange!r}: known {', '.join(EXPERT_EXCHANGES)}")
        self.expert_exchange = expert_exchange
        self.config = model.config
        self._stale: str | None = None
        chosen = choose_projections(projections, default_projections(mesh))  # (checked even where the model decides)
        fused_before = is_fused(model)
        self.projections = "fused" if fused_before else chosen
        if self.projections == "fused" and mesh is not None:
            source = ("this model's projections were fused in place by an executor built before" if fused_before
                      else "projections='fused'" if projections else f"{PROJECTIONS_ENV}=fused")
            raise ConfigError(f"{source}: fused projections on a mesh are not built yet (the partition rules name each "
                              f"projection); decode on a mesh with separate projections"
                              + (", over the model loaded again" if fused_before else ""))
        self.layers = choose_layers(model, layers)  # refused before anything changes the model
        changes = []
        if self.projections == "fused" and fuse_projections(model):  # 0 for a model fused before
            changes.append("fused its projections")
        if self.layers == "scan" and not isinstance(model.layers, StackedLayers):
            changes.append("stacked its layers")
        if changes:
            for other in list(_HOLDERS.get(model, ())):
                other._stale = " and ".join(changes)
        self.gated = lora_spec(model) is not None  # adapters: every step takes a `lora_gate`
        self._capabilities = capabilities or Capabilities.for_length(self.config.max_seq_len,
                                                                     batches=JAX_BATCH_BUCKETS)
        if self.gated:
            self._capabilities = dataclasses.replace(self._capabilities,
                                                     inputs=self._capabilities.inputs | {"lora_gate"})
        self._capabilities = dataclasses.replace(self._capabilities,
                                                 outputs=self._capabilities.outputs | model_outputs(self.config))
        if mesh is not None:  # int4 kernels held as int8 on a mesh (`widen_int4`: split int4's layout)
            widen_int4(model)
        self._graphdef, state = nnx.split(ScannedTransformer(model) if self.layers == "scan" else model)
        # Flattened once: the state pytree is not re-walked on every step.
        paths, self._treedef = jax.tree_util.tree_flatten_with_path(state)
        # Linear kernels are held [d_out, d_in] and transposed back inside the program, where
        # XLA folds the transpose into the dot: its CPU GEMM runs that layout up to twice as
        # fast at 32 rows (benchmarks/roofline.py).
        # Elsewhere (GPU) the kernels stay as stored: no second copy of the weights.
        cpu = target_platform() == "cpu"
        self._transposed = tuple(cpu and _is_kernel(path, leaf) for path, leaf in paths)
        self._slots = _split_layers(model, paths) if self.layers == "unrolled" else {}
        if self._slots:
            s = next(iter(self._slots.values())).resident.size
            self._capabilities = dataclasses.replace(self._capabilities, expert_slots=s)
        self.placement = None if mesh is None else _placement(mesh, model, self._slots)
        if self.compile == "tiered" and self.placement is not None and self.placement.processes > 1:
            raise ConfigError(f"compile='tiered' on a mesh over {self.placement.processes} processes: each would put "
                              f"its full programs in place at its own time, and the processes must run the same "
                              f"programs together; use compile='full'")
        # A step's logits can stay where it ran (`_logits.DeviceLogits`): on its device,
        # replicated over a mesh of this process's devices, or, on a mesh over several
        # processes, on the replica this process holds (`_kept`): each process answers its
        # host's asks there, the same answers as every other process's, with no collective.
        self._capabilities = dataclasses.replace(self._capabilities, logits_on=jax.default_backend())
        # q and k rotated by one RoPE op (`joint_rope`): on one accelerator only. A CPU keeps
        # the bits it had (XLA:CPU rounds the joined op otherwise), and on a mesh q's and k's
        # heads are split over the devices, which a join along the heads would regather.
        self.one_rope = mesh is None and target_platform() != "cpu"
        if self.placement is None:
            self._held = [_transposed(leaf) if t else leaf for (_, leaf), t in zip(paths, self._transposed)]
        else:  # each leaf placed on its shards (transposed there: no whole copy on one device)
            self._leaf_shardings = [self.placement.leaf(param_name(path), leaf.shape[::-1] if t else leaf.shape,
                                                        transposed=t)
                                    for (path, leaf), t in zip(paths, self._transposed)]
            self._held = [_sharded_leaf(self.placement, leaf, sharding, t)
                          for (_, leaf), sharding, t in zip(paths, self._leaf_shardings, self._transposed)]
        _HOLDERS.setdefault(model, weakref.WeakSet()).add(self)
        self._model_ref = weakref.ref(model)
        self._new_programs()

    @property
    def _leaves(self) -> list:
        """The parameters the compiled steps take (one flat list, the model's state order)."""
        if self._stale is not None:
            raise ConfigError(f"this JAX executor's weights are gone: a JAX executor built later over the same model "
                              f"{self._stale} in place; decode with that one, or load the model again for this one")
        return self._held

    def _new_programs(self) -> None:
        m, tiered = self._meshed, self.compile == "tiered"  # (the steps tiered; the small programs beside them not)
        self._programs = CompiledBuckets(m(self._build), tiered=tiered)  # the dense step (the contract, bundles')
        self._resident = CompiledBuckets(m(self._build_resident, lambda spec: (
            None, None, *self._cache_out(spec[2] if len(spec) > 2 else spec[0].batch))),
            tiered=tiered)  # (key, slots): a decode's step
        self._views = CompiledBuckets(m(self._build_view), tiered=tiered)  # key: a CPU path's step over gathered slots
        self._gathers = CompiledBuckets(m(self._build_gather))  # (batch, read, slots, written_only, cache rows)
        self._scatters = CompiledBuckets(m(self._build_scatter, lambda spec: self._cache_out(spec[3])))  # (batch, width, slots, cache rows)
        self._allocs = CompiledBuckets(m(self._build_alloc, lambda spec: self._cache_out(spec[0])))  # (batch, slots): a decode's empty cache
        self._clears = CompiledBuckets(m(self._build_clear, lambda spec: self._cache_out(spec[0])))  # (cache rows, slots): `DeviceKVCache.assign`

    # -- the mesh (`dlm_jax.executors.sharding`); each is the one-device behaviour without one --

    def _cache_out(self, rows: int) -> tuple:
        """Output shardings of (K, V, written) of a cache of `rows` rows."""
        p = self.placement
        layers = (p.cache(rows),) * self.config.n_layers
        return layers, layers, p.rows(rows)

    def _meshed(self, build, outputs=None):
        """`build` as it runs on this executor's mesh: its program traced with the MoE layers'
        experts split over the mesh (`expert_mesh`), every argument spec without a sharding
        replicated, and its outputs replicated except where `outputs(spec)` names a sharding
        (a pytree prefix of the outputs; None entries replicated)."""
        if self.placement is None:
            return build
        placement = self.placement

        def meshed(spec):
            fn, specs, *options = build(spec)
            options = dict(options[0]) if options else {}

            def traced(*args):
                with expert_mesh(placement.mesh, self.expert_exchange,
                                 (placement.shape.axes_for(placement.config), placement.act_order)):
                    return fn(*args)

            specs = tuple(placement.spec(s) if isinstance(s, jax.ShapeDtypeStruct) and s.sharding is None else s
                          for s in specs)
            outs = placement.replicated if outputs is None else tuple(
                placement.replicated if o is None else o for o in outputs(spec))
            return traced, specs, {**options, "out_shardings": outs}

        return meshed

    def _replicas(self, pool: int, batch: int) -> int:
        """The mesh's dp where a resident step of `batch` rows on a cache of `pool` rows runs per
        replica (dp divides both; `_build_resident`), else 1."""
        dp = self.engine_replicas
        return dp if dp > 1 and pool % dp == 0 and batch % dp == 0 else 1

    @property
    def engine_replicas(self) -> int:
        """The replicas an engine places its requests' cache rows in (the mesh's dp): a call
        whose batch chunk d holds replica d's rows runs per replica (`replica_local`). 1 with
        TIDE's split execution, whose host callbacks JAX runs only in a program manual over
        every mesh axis: its steps run the whole mesh's program."""
        return 1 if self.placement is None or self._slots else self.placement.shape.dp

    def _row_specs(self, specs) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Per-row input specs [B, ...] with their mesh sharding (`MeshPlacement.batch`)."""
        if self.placement is None:
            return tuple(specs)
        return tuple(self.placement.spec(s, self.placement.batch(s.shape)) for s in specs)

    def _put(self, x) -> jax.Array:
        """A host array on the device (replicated over the mesh)."""
        return jax.device_put(x) if self.placement is None else self.placement.put(x)

    def _send(self, arrays, *, put: bool = False, rows: bool = True):
        """A step's host arrays as its program takes them: as they are on one device (or put
        there with `put`), per-row arrays with their mesh sharding (`rows`; else replicated)
        on a mesh of several processes, whose programs take global arrays only."""
        p = self.placement
        if p is None:
            return jax.device_put(list(arrays)) if put else arrays
        if p.processes == 1 and not put:
            return arrays
        return [x if isinstance(x, jax.Array) else p.put(x, p.batch(np.shape(x)) if rows else None) for x in arrays]

    @staticmethod
    def _kept(x: jax.Array) -> jax.Array:
        """A replicated output kept where it is: as it is where this process holds all of it,
        else this process's replica (programs over a global array would have every process
        run them together; on its replica each runs its own)."""
        return x if x.is_fully_addressable else x.addressable_data(0)

    def _get(self, named: dict) -> dict[str, np.ndarray]:
        """Outputs on the host (a mesh's replicated outputs read from a local replica)."""
        if self.placement is None:
            return {n: np.asarray(v) for n, v in jax.device_get(named).items()}
        return {n: self.placement.fetch(v) for n, v in named.items()}

    def param_bytes_per_device(self) -> dict:
        """{device: bytes of the parameters it holds} (one entry without a mesh)."""
        if self.placement is None:
            return {"default": sum(getattr(leaf, "nbytes", 0) for leaf in self._leaves)}
        return self.placement.per_device_bytes(self._leaves)

    @property
    def _all_programs(self) -> tuple[CompiledBuckets, ...]:
        return self._programs, self._resident, self._views, self._gathers, self._scatters, self._allocs, self._clears

    def place(self, resident) -> int:
        """Move experts into the slots of the split layers (`dlm_jax.techniques.tide.split_experts`):
        experts already resident keep their slot, each incoming one takes the slot of one that
        leaves; the slot buffers and maps are updated on the device between steps. Returns the
        bytes moved."""
        moved = 0
        for layer, want in resident.items():
            held = self._slots.get(layer)
            if held is None:
                continue
            if len(set(np.asarray(want).tolist())) != held.resident.size:
                raise ValueError(f"layer {layer} holds {held.resident.size} distinct experts, not {list(want)}")
            incoming = np.setdiff1d(want, held.resident)
            if not len(incoming):
                continue
            free = np.flatnonzero(~np.isin(held.resident, want))[:len(incoming)]
            held.resident[free] = incoming
            cpu = held.cpu
            for index, host in zip(held.weights, (cpu.gate, cpu.up, cpu.down)):
                self._leaves[index] = self._keep_sharding(index, self._leaves[index].at[free].set(
                    jnp.asarray(host[incoming], self._leaves[index].dtype)))
            slot_of = np.full(len(cpu.gate), -1, np.int32)
            slot_of[held.resident] = np.arange(len(held.resident), dtype=np.int32)
            self._leaves[held.slot_map] = self._keep_sharding(held.slot_map, jnp.asarray(slot_of))
            moved += len(incoming) * cpu.expert_bytes
        return moved

    def _keep_sharding(self, index: int, leaf: jax.Array) -> jax.Array:
        """A replaced leaf back on its mesh sharding (what the compiled programs take)."""
        return leaf if self.placement is None else self.placement.put(leaf, self._leaf_shardings[index])

    @property
    def engine_padding(self) -> str:
        """How an engine runs a group of steps that fills no batch bucket
        (`dlm_jax.runtime.engine.PADDING`): row by row (`rows="each"`), "free": only the live
        rows are computed, so every call takes the engine's whole batch and one program serves
        each step shape (as fast as "split" on this project's CPU, with a program per shape
        instead of one per shape and batch size); batched, "split" on a CPU (a padding row
        costs what a real one does) and "pad" on an accelerator (one call reads the weights
        once)."""
        if self.rows == "each":
            return "free"
        return "split" if target_platform() == "cpu" else "pad"

    def capacity(self, slots: int) -> int:
        """The slot count a decode's cache is allocated with: a power of two from 256 that holds
        `slots` (capped at the largest cache bucket), so that decodes of nearby lengths share
        their compiled steps; a step reads only its slots, so the spare ones cost memory only."""
        top = self._capabilities.caches.largest
        size = max(256, 1 << max(slots - 1, 0).bit_length())
        return size if size <= top else max(top, slots)

    def read_bucket(self, key: BucketKey, slots: int) -> BucketKey:
        """The bucket a resident step of `key` runs in on a cache of `slots` slots. Read in place
        (every form but "gather"), a step that reads the cache masks all of its slots from the
        read list (`slot_reads`), so the read bucket sizes nothing but that list: every such
        step runs in read bucket `slots`, so decodes of other prompt lengths on a cache of the
        same slots run the programs of the first (a dual-cache decode reads all slots but its
        block's: prompts of 100 and 200 tokens, 256 generated, read buckets 384 and 448 of
        512 slots, two programs before, one now), and so do an engine's calls, whose read
        bucket was the largest of its rows'. Otherwise `key` itself: the gathered form attends
        over the read columns, so a wider bucket would cost a step more."""
        if self.attention == "gather" or not 0 < key.cache < slots:
            return key
        return dataclasses.replace(key, cache=slots)

    def open(self, config: ModelConfig, positions: np.ndarray, valid: np.ndarray) -> DeviceKVCache:
        """The decode's K/V on this executor's device."""
        return DeviceKVCache(self, positions, valid)

    def _state(self, leaves):
        leaves = [leaf.T if t else leaf for leaf, t in zip(leaves, self._transposed)]
        return jax.tree.unflatten(self._treedef, leaves)

    def _cache_specs(self, batch: int, slots: int) -> tuple:
        """(K, V, written, positions, validity) of a cache of `batch` rows: K and V a tuple of one
        [batch, Hkv, slots, Dh] array per layer (see `DeviceKVCache`)."""
        cfg = self.config
        shape = (batch, cfg.n_kv_heads, slots, cfg.head_dim)  # heads first: see `DeviceKVCache`
        kv = None if self.placement is None else self.placement.cache(batch)
        layers = tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype), sharding=kv) for _ in range(cfg.n_layers))
        written = None if self.placement is None else self.placement.rows(batch)
        return (layers, layers,
                jax.ShapeDtypeStruct((batch, slots), bool, sharding=written),
                jax.ShapeDtypeStruct((batch, slots), jnp.int32),
                jax.ShapeDtypeStruct((batch, slots), bool))

    def _view_fn(self, key: BucketKey, *, in_place: bool = False):
        """The step over a cache view: the resident cache itself ([B, Hkv, S, Dh] a layer), read in
        this executor's `attention` form (`in_place`), or a gathered copy of the read slots,
        [L, B, P, Hkv, Dh], scored concatenated with the window's K/V (the form bundles are
        traced in): over a copy there is nothing to read in place, and on a CPU the split form's
        extra ops cost llada-tiny's batch-1 dual step 14% (1.14x the concatenated one; a 29M
        model's 1.00-1.02x, a 154M model's 0.97-1.09x). With `attention="cudnn"` or
        `"cudnn_split"` a step that reads no cache (a refresh) takes cuDNN's kernel too, over the
        window alone: compiled
        for an H200, a refresh's attention is then one kernel a layer instead of five
        (`benchmarks/results/gpu_target.md`), and no [B, H, W, W] float32 scores are written."""
        cfg, graphdef = self.config, self._graphdef
        form, heads_first = ((self.attention, True) if in_place else
                             ("cudnn", False) if self.attention in CUDNN_FORMS else
                             (self.attention, False) if self.attention in KERNEL_FORMS else ("concat", False))

        def view(leaves, k, v, k_pos, k_ok, tokens, positions, q_valid, probes, hide, logit_rows, lora_gate=None):
            vis = visibility(jnp, cfg, positions, q_valid, k_pos, k_ok, probes, hide)
            with attention_form(form, heads_first=heads_first):
                return decode_step(graphdef, self._state(leaves), tokens, positions, vis, k, v, logit_rows,
                                   full_logits=key.full_logits, mask_id=cfg.mask_token_id, lora_gate=lora_gate,
                                   router_topk=key.router_topk, ffn_active=key.ffn_active, one_rope=self.one_rope)

        return view

    def _build_resident(self, spec: tuple):
        """The resident step of `spec`: (key, slots), a decode's own cache (batch rows are the
        cache's rows in order), or (key, slots, cache rows, True), a step on a pool whose
        batch rows map to cache rows by `rows` ((..., "across"): rows that cross the mesh's
        replicas, `replica_local`).

        On a mesh with dp replicas where dp divides the batch and the cache rows (and the rows
        stay within their replicas), the step runs per replica: under `jax.shard_map` manual
        over "dp", each replica computes its own chunk of the batch rows over its own cache
        rows (the rest of the mesh's axes split as elsewhere). Left to XLA's partitioner, a
        batch row's cache row could be on any replica: it gathered the rows' inputs onto
        every replica, computed every row there and summed the K/V rows each read over the
        replicas (one all-reduce of the rows' whole caches per layer where the cache is read
        in place)."""
        key, slots = spec[:2]
        pool = spec[2] if len(spec) > 2 else key.batch
        pooled = len(spec) > 2
        replicas = 1 if len(spec) > 4 else self._replicas(pool, key.batch)
        in_place = self.attention != "gather" and key.cache > 0  # (a step reading nothing gathers nothing)

        view = self._view_fn(key, in_place=in_place)
        mine = dataclasses.replace(key, batch=key.batch // replicas)  # the batch rows a replica computes
        out_shapes = {n: (shape, jnp.dtype(dtype)) for n, shape, dtype in output_specs(self.config, mine)
                      if n not in ("k_new", "v_new")}

        def forward(leaves, k_res, v_res, written, pos, valid, tokens, positions, q_valid, read, read_len, probes,
                    hide, logit_rows, rows, *gate, take_rows: bool):
            if in_place:  # attention reads all S slots where they lie, the unread ones masked
                if take_rows:
                    # The batch rows' caches gathered first, [B, Hkv, S, Dh] a layer: on a GPU a
                    # copy of those rows' whole caches per step, as many bytes again as the
                    # attention reads (a pool whose step covers all its rows in order runs the
                    # in-place program instead).
                    r = jnp.where(rows >= 0, rows, 0)
                    k_rows = tuple(jnp.take(layer, r, axis=0) for layer in k_res)
                    v_rows = tuple(jnp.take(layer, r, axis=0) for layer in v_res)
                    pos_rows, valid_rows = jnp.take(pos, r, axis=0), jnp.take(valid, r, axis=0) & (rows >= 0)[:, None]
                else:
                    k_rows, v_rows, pos_rows, valid_rows = k_res, v_res, pos, valid
                seen, hide_slots = slot_reads(valid_rows, read, read_len, hide)
                return view(leaves, k_rows, v_rows, pos_rows, seen, tokens, positions, q_valid, probes,
                            hide_slots, logit_rows, *gate)
            k, v, k_pos, k_ok = gather_view(k_res, v_res, pos, valid, written, read, read_len, rows,
                                            written_only=False)
            return view(leaves, k, v, k_pos, k_ok, tokens, positions, q_valid, probes, hide, logit_rows, *gate)

        layout = request_layout(key, self.gated)

        def program(leaves, k_res, v_res, written, pos, valid, packed):
            tokens, positions, q_valid, read, read_len, probes, hide, write, logit_rows, rows, *gate = unpack_request(
                packed, layout)
            if replicas > 1:  # this replica's cache rows, numbered from 0
                rows = jnp.where(rows >= 0, rows - jax.lax.axis_index("dp") * (pool // replicas), -1)
            per_row = (tokens, positions, q_valid, read, read_len, probes, hide, logit_rows, rows, *gate)
            if self.rows == "each" and pooled:  # batch row i alone: its inputs sliced, its cache row read and written
                # in the loop (only the live rows, which come first: the padding rows, -1, after them)
                def row_step(i, cache):
                    k_c, v_c, w_c = cache
                    mine = [jax.lax.dynamic_slice_in_dim(x, i, 1, axis=0) for x in per_row]
                    named = forward(leaves, k_c, v_c, w_c, pos, valid, *mine, take_rows=True)
                    cache = scatter_rows(k_c, v_c, w_c, named.pop("k_new"), named.pop("v_new"),
                                         jax.lax.dynamic_slice_in_dim(write, i, 1, axis=0), mine[8])
                    return named, cache

                named, (k_res, v_res, written) = each_row(row_step, jnp.sum(rows >= 0), out_shapes,
                                                          (k_res, v_res, written))
            else:
                named = forward(leaves, k_res, v_res, written, pos, valid, *per_row, take_rows=pooled)
                # The stores' slots pass an optimization barrier with the step's outputs, so each
                # layer's store follows every read of the cache: otherwise XLA cannot order a
                # layer's store after its attention's read and copies that layer's cache first.
                k_new, v_new = named.pop("k_new"), named.pop("v_new")
                write, named = jax.lax.optimization_barrier((write, named))
                k_res, v_res, written = scatter_rows(k_res, v_res, written, k_new, v_new, write, rows)
            preds = pack_predictions(named)  # (out of `named`)
            return preds, named, k_res, v_res, written

        if replicas > 1:
            from jax.sharding import PartitionSpec as P

            row = P("dp")  # the batch rows, and the cache's rows: each replica's own
            named = {n: P(None, "dp") if n in _NOT_BATCH_LEADING else row for n in out_shapes
                     if n not in PREDICTIONS}
            program = jax.shard_map(program, mesh=self.placement.mesh, in_specs=(P(), row, row, row, row, row, row),
                                    out_specs=(P(None, "dp"), named, row, row, row), axis_names={"dp"},
                                    check_vma=False)
        packed = jax.ShapeDtypeStruct((key.batch, request_columns(layout)), jnp.int32)
        return program, (self._leaves, *self._cache_specs(pool, slots), *self._row_specs((packed,))), {
            "donate_argnums": (1, 2, 3)}

    def resident_inputs(self, req: SlotStep) -> list[np.ndarray]:
        """What a resident step takes after the cache, for `req`: its packed request
        (`pack_request`). The step returns (packed predictions, the other outputs by name,
        K, V, written)."""
        return [pack_request(req.arrays(), request_layout(req.key, self.gated))]

    def _build_view(self, key: BucketKey):
        cfg = self.config
        kv = jax.ShapeDtypeStruct((cfg.n_layers, key.batch, key.cache, cfg.n_kv_heads, cfg.head_dim),
                                  jnp.dtype(cfg.dtype))
        view_inputs = [s for n, s in zip(request_names(self.gated), self._row_specs(device_specs(key, self.gated)))
                       if n not in ("read", "read_len", "write", "rows")]
        return self._view_fn(key), (self._leaves, kv, kv, jax.ShapeDtypeStruct((key.batch, key.cache), jnp.int32),
                                    jax.ShapeDtypeStruct((key.batch, key.cache), bool), *view_inputs)

    def _build_gather(self, spec: tuple[int, int, int, bool, int]):
        batch, read, slots, written_only, pool = spec

        def gather(k_res, v_res, pos, valid, written, read_slots, read_len, rows):
            return gather_view(k_res, v_res, pos, valid, written, read_slots, read_len, rows,
                               written_only=written_only)

        k, v, written, pos, valid = self._cache_specs(pool, slots)
        return gather, (k, v, pos, valid, written, *self._row_specs((
            jax.ShapeDtypeStruct((batch, read), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))))

    def _build_alloc(self, spec: tuple[int, int]):
        batch, slots = spec
        k, v, written, _, _ = self._cache_specs(batch, slots)

        def alloc():
            return (tuple(jnp.zeros(s.shape, s.dtype) for s in k), tuple(jnp.zeros(s.shape, s.dtype) for s in v),
                    jnp.zeros(written.shape, bool))

        return alloc, ()

    def _build_scatter(self, spec: tuple[int, int, int, int]):
        batch, width, slots, pool = spec
        cfg = self.config
        k, v, written, _, _ = self._cache_specs(pool, slots)
        new = jax.ShapeDtypeStruct((cfg.n_layers, batch, width, cfg.n_kv_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
        return scatter_rows, (k, v, written, new, new, *self._row_specs((
            jax.ShapeDtypeStruct((batch, width), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)))), {
            "donate_argnums": (0, 1, 2)}

    def _build_clear(self, spec: tuple[int, int]):
        pool, slots = spec
        k, v, written, _, _ = self._cache_specs(pool, slots)

        def clear(k_res, v_res, written, row):
            # A row handed to a new request: zeros and unwritten, as a fresh cache's.
            return (tuple(layer.at[row].set(0) for layer in k_res), tuple(layer.at[row].set(0) for layer in v_res),
                    written.at[row].set(False))

        return clear, (k, v, written, jax.ShapeDtypeStruct((), jnp.int32)), {"donate_argnums": (0, 1, 2)}

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def _build(self, key: BucketKey):
        cfg = self.config
        graphdef, treedef, transposed = self._graphdef, self._treedef, self._transposed

        def program(leaves, *inputs):
            leaves = [leaf.T if t else leaf for leaf, t in zip(leaves, transposed)]
            gate = inputs[len(INPUT_NAMES)] if len(inputs) > len(INPUT_NAMES) else None
            return decode_step(graphdef, jax.tree.unflatten(treedef, leaves), *inputs[:len(INPUT_NAMES)],
                               full_logits=key.full_logits, mask_id=cfg.mask_token_id, lora_gate=gate,
                               router_topk=key.router_topk, ffn_active=key.ffn_active, one_rope=self.one_rope)

        gate = (jax.ShapeDtypeStruct((key.batch, key.window), jnp.float32),) if self.gated else ()
        return program, (self._leaves, *abstract_inputs(cfg, key), *gate)

    def fork(self) -> JaxExecutor:
        """A second executor over the same weights (no copy) with programs of its own, for a
        second thread (the CPU refresh path of progressive revision)."""
        twin = object.__new__(JaxExecutor)
        twin.__dict__.update(self.__dict__)
        twin._new_programs()
        if (model := self._model_ref()) is not None:  # made stale with the others (`_HOLDERS`)
            _HOLDERS.setdefault(model, weakref.WeakSet()).add(twin)
        return twin

    @property
    def compile_count(self) -> int:
        return sum(p.compile_count for p in self._all_programs)

    def logits_like(self, batch: int, rows: int) -> DeviceLogits | None:
        """Zero logits [batch, rows, V] float32 where a step keeps them (the default device, or
        replicated over the mesh, as a step's outputs are), for warming the programs that
        answer their asks."""
        if not self.capabilities.logits_on:
            return None
        return DeviceLogits(self._kept(self._put(np.zeros((batch, rows, self.config.vocab_size), np.float32))))

    def tiers(self) -> dict[str, int | float]:
        """The step programs compiled so far by the compile each holds now ("quick", "full"),
        the full compiles done behind quick ones ("upgrades"), the programs built behind while
        their steps ran in a wider window ("behind"; "widened": those steps), the background
        thread's seconds on both ("upgrade_seconds") and its compiles still queued or under way
        ("pending")."""
        steps = (self._programs, self._resident, self._views)
        held = [p.tier(k) for p in steps for k in p.keys]
        return {"quick": held.count("quick"), "full": held.count("full"),
                "upgrades": sum(p.upgrade_count for p in steps), "behind": self._resident.behind_count,
                "widened": self.widened_steps, "pending": sum(p.upgrades_pending for p in steps),
                "upgrade_seconds": round(sum(p.upgrade_seconds for p in steps), 3)}

    def _wider_window(self, spec: tuple) -> int | None:
        """The narrowest window of a resident program compiled so far that could run `spec`'s
        step padded: the same in all but a wider window (None: none is)."""
        rest = _but_window(spec)
        return min((held[0].window for held in self._resident.held()
                    if held[0].window > spec[0].window and _but_window(held) == rest), default=None)

    def wait_for_upgrades(self, timeout: float | None = None) -> bool:
        """Wait until every step program compiled quick holds its full compile, and every one
        built behind is in (`compile="tiered"`); False where `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(p.wait_upgrades(None if deadline is None else max(0.0, deadline - time.monotonic()))
                   for p in (self._programs, self._resident, self._views))

    def build_counts(self) -> BuildCounts:
        tiers = self.tiers()
        return BuildCounts(compiles=self.compile_count,
                           compile_seconds=sum(p.compile_seconds for p in self._all_programs),
                           compile_wait_seconds=sum(p.wait_seconds for p in self._all_programs),
                           quick_programs=tiers["quick"], upgrades=tiers["upgrades"],
                           widened_steps=self.widened_steps, pending_compiles=tiers["pending"])

    @property
    def compiled_keys(self) -> list[BucketKey]:
        """The buckets compiled, as dense steps or as a decode's resident steps."""
        return sorted(set(self._programs.keys) | {k[0] for k in self._resident.keys})

    def _program_keys(self, keys: Sequence[BucketKey], slots: int, views: bool):
        """(programs, their keys in order) that run the buckets `keys` as `warmup` describes."""
        if not slots:
            return [(self._programs, list(keys))]
        cap = self.capacity(slots)
        if not views:
            return [(self._allocs, list(dict.fromkeys((k.batch, cap) for k in keys))),
                    (self._resident, list(dict.fromkeys((self.read_bucket(k, cap), cap) for k in keys)))]
        return [(self._gathers, list(dict.fromkeys((k.batch, k.cache, cap, True, k.batch) for k in keys))),
                (self._views, list(keys)),
                (self._scatters, list(dict.fromkeys((k.batch, k.window, cap, k.batch) for k in keys)))]

    def warmup(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False) -> int:
        """Compile every bucket of `keys`: with `slots`, as the resident steps of a decode of
        that many slots (or, with `views`, as a CPU path's gather, step and write); without,
        as dense steps. Returns how many programs were compiled (the cache allocations, not
        buckets, are counted in `build_counts` only). Tiered, a resident step of which a wider
        window is among them is queued to build behind instead (`_behind`)."""
        new = 0
        for programs, ks in self._program_keys(keys, slots, views):
            n = programs.warmup(self._behind(programs, ks))
            new += 0 if programs is self._allocs else n
        return new

    def _behind(self, programs: CompiledBuckets, specs: list) -> list:
        """Of `specs` to build now: tiered, of the resident steps, those no wider window among
        them could run padded (`DeviceKVCache.step`), the others queued to build behind
        (`CompiledBuckets.build_behind`); otherwise all."""
        if programs is not self._resident or self.compile != "tiered":
            return specs
        now = _widest(specs)
        for spec in specs:
            if spec not in now:
                programs.build_behind(spec)
        return now

    def warmup_engine(self, keys: Sequence[BucketKey], *, slots: int, rows: int, views: bool = False) -> int:
        """Compile an engine's programs: the pooled steps of `keys` on a cache of `rows` rows
        (`DeviceKVCache.assign` makes a cache shared), its allocation and row clearing; with
        `views`, a CPU path's gather, step and write on one row of it. Queued on the background
        compile threads first, so that they build side by side. Returns how many step programs
        were new. Tiered, the narrower windows of a step are left to build behind (`_behind`)."""
        groups = [(programs, self._behind(programs, ks)) for programs, ks in self._engine_keys(keys, slots, rows, views)]
        for programs, ks in groups:
            programs.prefetch(ks)
        built = [programs.warmup(ks) for programs, ks in groups]
        return sum(n for (programs, _), n in zip(groups, built) if programs in (self._resident, self._views))

    def _engine_keys(self, keys: Sequence[BucketKey], slots: int, rows: int, views: bool) -> list:
        """(programs, their keys) of an engine's calls of `keys` (`warmup_engine`), in order."""
        cap = self.capacity(slots)
        if views:
            return [(self._gathers, list(dict.fromkeys((k.batch, k.cache, cap, True, rows) for k in keys))),
                    (self._views, list(keys)),
                    (self._scatters, list(dict.fromkeys((k.batch, k.window, cap, rows) for k in keys)))]
        return [(self._allocs, [(rows, cap)]), (self._clears, [(rows, cap)]),
                (self._resident, list(dict.fromkeys((self.read_bucket(k, cap), cap, rows, True) for k in keys)))]

    def prefetch_engine(self, keys: Sequence[BucketKey], *, slots: int, rows: int, views: bool = False):
        """Compile an engine's programs of `keys` (as `warmup_engine` would) on the background
        threads, in order; tiered, only the widest of a step's windows (as `prefetch`)."""
        return self._queue(self._engine_keys(keys, slots, rows, views))

    def prefetch(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False):
        """Compile the programs of `keys` (as `warmup` would) on background threads, in order.
        Tiered, a resident step of which a wider window is queued too is left out: its steps run
        padded in that one's program until its own is built behind (`DeviceKVCache.step`)."""
        return self._queue(self._program_keys(keys, slots, views))

    def _queue(self, groups: list) -> Callable[[], None]:
        """Queue each (programs, keys) of `groups` on the background threads (tiered, a
        resident step's widest windows only); returns what drops these keys again, not another
        caller's (a second decode's, a warm-up's)."""
        groups = [(programs, _widest(ks) if programs is self._resident and self.compile == "tiered" else ks)
                  for programs, ks in groups]
        for programs, ks in groups:
            programs.prefetch(ks)

        def cancel() -> None:
            for programs, ks in groups:
                programs.cancel(ks)

        return cancel

    def step(self, inputs: StepInputs, *, timings: dict[str, float] | None = None) -> StepOutputs:
        """Run one step. With `timings`, the transfer in, the compiled compute and the
        transfer out are each waited for and timed (seconds, under "h2d", "compute", "d2h");
        without, JAX overlaps them as it likes."""
        key = inputs.key
        program = self._programs.get(key)
        # Only what the host reads leaves the device: the window K/V stay behind on steps
        # that do not store them.
        names = [n for n in output_names(key) if inputs.want.kv or n not in ("k_new", "v_new")]
        arrays = inputs.arrays()
        if self.gated:
            if inputs.lora_gate is None:
                raise ValueError("this executor's model has LoRA adapters: every step needs a lora_gate")
            arrays = (*arrays, inputs.lora_gate)
        if timings is None:
            out = program(self._leaves, *self._send(arrays, rows=False))
            fetched = self._get({n: out[n] for n in names})
        else:
            t0 = time.perf_counter()
            args = jax.block_until_ready(self._send(arrays, put=True, rows=False))
            t1 = time.perf_counter()
            out = jax.block_until_ready(program(self._leaves, *args))
            t2 = time.perf_counter()
            fetched = self._get({n: out[n] for n in names})
            timings.update(h2d=t1 - t0, compute=t2 - t1, d2h=time.perf_counter() - t2)
        return StepOutputs.from_named({n: np.asarray(v) for n, v in fetched.items()})

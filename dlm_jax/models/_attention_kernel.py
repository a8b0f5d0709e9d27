"""One attention kernel a layer, in Pallas (Triton on a GPU): the window's queries over the
resident K/V cache where it lies and over the window's own K/V, under the step's visibility
mask, in one launch.

The XLA forms of `_transformer` take several kernels a layer for the same attention (the
split form: score products, their maxima and sums, exponentials, value products; compiled for
an H200, about 13 non-GEMM kernels a layer at batch 1, `benchmarks/results/gpu_target.md`);
cuDNN's takes one over a concatenated copy ("cudnn") or two and a merge ("cudnn_split"). This
kernel streams the cache in blocks of `block_k` slots with an online softmax (FlashAttention-2,
Dao 2023, algorithm 1: a running maximum and sum per query row, float32), then the window's
columns, and writes each query row once:

- grid (B, H / heads, T / block_q): one program per batch row, group of `heads` query heads
  and block of query rows (up to 64 rows, 4 warps). A grouped-query model's query heads that
  share a K/V head (a power-of-two group: 2, 4, 8) are one program's, their rows stacked (heads
  x block_q rows, up to 128, 8 warps), so a K/V head's cache is read once for all its query
  heads, where a program per query head read it once for each (a window of 32 rows, as the
  dual cache's, with 4 query heads a K/V head: a quarter of the cache reads); a group of
  another size (7, say) runs a program per query head;
- scores are the bf16 (or the model's dtype) products accumulated in float32, scaled by
  1/sqrt(Dh) and masked to the float32 minimum as `attend` masks them; the value products take
  the unnormalized weights (each at most 1) in the values' dtype, accumulated in float32 and
  divided by the softmax's sum at the end, as `attend_cached` does;
- only the cache blocks from the first to the last that a query row of the program sees are
  read (`cache_span`, computed once a step from the mask): the unused capacity past a decode's
  slots costs nothing, and the loop has no branch in it, so Triton can pipeline its loads.

A row that sees nothing gets the mean of the values the kernel reads for it (finite), where
`attend` averages every column; the executor never reads such rows (they are padding).

Shapes the Triton backend takes (each load a power of two, products at least 16 wide): the
window's rows T and the cache's slots S multiples of 16, the head dim a power of two from 16 to
256. `fits` says whether a step's shapes do; `Attention` keeps the split form for those that do
not. On a machine without a GPU the kernel runs in Pallas's interpreter (`interpret()`), which
is how the tests check it against `attend` on a CPU.

On a mesh (`dlm_jax._partition`'s axes: "dp" splits batch rows, "tp" heads) each device runs the
kernel over its own rows and heads under `jax.shard_map`: a Pallas call has no partitioning rule
of its own. That needs each device's query heads and the K/V heads they read on the same device:
tp must divide the K/V heads (`shards`), as it does wherever the mesh splits the cache's heads;
`Attention` keeps the split form on a mesh whose tp does not.

The blocks and Triton's launch settings are a `Tiling` (`DEFAULT_TILING`; `tiled` sets another
for the programs traced inside, as `benchmarks/kernel_sweep.py` does to time each on a GPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

_NEG = float(jnp.finfo(jnp.float32).min)
_interpret = False  # `interpret()`: a process-wide switch, as programs compile on background threads


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The kernel's blocks and launch settings. `rows`: the most query positions a program of
    one head takes; `stacked_rows`: the most rows (heads x positions) a program of a grouped
    K/V head's query heads takes; `block_k`: the cache slots (and window columns) a loop step
    reads; `warps`: Triton's warps a program (0: 8 where a program has more than 64 rows, else
    4); `stages`: its software-pipelining stages (0: Triton's default). Sizes are powers of two
    from 16; a shape a size does not divide takes the largest power of two that does."""

    rows: int = 64
    stacked_rows: int = 128
    block_k: int = 64
    warps: int = 0
    stages: int = 0

    def __post_init__(self) -> None:
        for name in ("rows", "stacked_rows", "block_k"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"Tiling.{name}={n}: a power of two from 16")
        if self.warps not in (0, 1, 2, 4, 8, 16) or self.stages < 0:
            raise ValueError(f"Tiling warps={self.warps} (0, 1, 2, 4, 8 or 16), stages={self.stages} (0: Triton's "
                             "default, or at least 1)")


DEFAULT_TILING = Tiling()
_tiling = DEFAULT_TILING


@contextlib.contextmanager
def swapped(namespace: dict[str, Any], name: str, value: Any) -> Iterator[None]:
    """Inside: the module global `name` of `namespace` (a module's `globals()`) is `value`,
    process-wide (the executors' compile threads trace with it too); the one before after."""
    saved, namespace[name] = namespace[name], value
    try:
        yield
    finally:
        namespace[name] = saved


def tiled(tiling: Tiling) -> contextlib.AbstractContextManager[None]:
    """Inside: the kernel is traced with `tiling`'s blocks and launch settings (process-wide,
    as `interpret`; only programs traced inside take it)."""
    return swapped(globals(), "_tiling", tiling)


def interpret(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Inside: the kernel is traced for Pallas's interpreter (any backend, a CPU's included):
    the same blocks, loops and arithmetic, as XLA ops instead of one Triton kernel. Only
    programs traced inside take it."""
    return swapped(globals(), "_interpret", on)


def _block(n: int, most: int = 64) -> int:
    """The largest power of two at most `most` that divides `n` (0 if below 16)."""
    b = most
    while b >= 16 and n % b:
        b //= 2
    return b if b >= 16 else 0


def fits(t: int, s: int, head_dim: int) -> bool:
    """Whether the kernel takes a step of `t` window rows over `s` cache slots (0: none) at
    `head_dim`: each a shape the Triton backend can load."""
    return bool(_block(t)) and (s == 0 or bool(_block(s))) and head_dim in (16, 32, 64, 128, 256)


def free_axes(mesh) -> tuple[tuple[str, ...], dict[str, int]]:
    """(the axes of `mesh` a `shard_map` inside a traced program splits over, {axis: size} with
    the axes already manual counted as 1): every axis on a program of the whole mesh; all but
    "dp" in the JAX executor's per-replica steps (`_transformer.traced_mesh`), whose rows are
    that replica's already."""
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    sizes = {ax: (1 if ax in manual else n) for ax, n in dict(mesh.shape).items()}
    return tuple(ax for ax in mesh.axis_names if ax not in manual), sizes


def shards(mesh, kv_heads: int) -> bool:
    """Whether the kernel runs on `mesh` (None: one device) for a model of `kv_heads` K/V
    heads: each tp device then holds whole K/V heads and the query heads that read them."""
    return mesh is None or kv_heads % dict(mesh.shape).get("tp", 1) == 0


def _heads(h: int, hkv: int) -> int:
    """Query heads a program takes: the whole group of a K/V head where it is a power of two
    (Triton's blocks are), else 1."""
    group = h // hkv
    return group if group & (group - 1) == 0 else 1


def _kernel(*refs, scale: float, cached: bool, block_k: int, block_w: int, window: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if cached:
        q_ref, kc_ref, vc_ref, mc_ref, span_ref, kw_ref, vw_ref, mw_ref, o_ref = refs
    else:
        q_ref, kw_ref, vw_ref, mw_ref, o_ref = refs
    block_q, heads, dh = q_ref.shape  # (a program's query rows of `heads` query heads)
    rows = block_q * heads
    q = q_ref[...].reshape(rows, dh)  # row t * heads + head: each position's heads side by side
    f32 = q.dtype == jnp.float32

    def attend_block(keys, values, seen, carry):
        acc, top, total = carry
        if heads > 1:  # (every head of a position sees what the position sees)
            seen = jnp.broadcast_to(seen[:, None, :], (block_q, heads, seen.shape[-1])).reshape(rows, -1)
        scores = plgpu.dot(q, keys, trans_b=True, allow_tf32=False if f32 else None) * scale
        scores = jnp.where(seen, scores, _NEG)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        fade = jnp.exp(top - new_top)  # the earlier blocks' weights, rescaled to the new maximum
        weights = jnp.exp(scores - new_top[:, None])
        total = total * fade + weights.sum(axis=-1)
        acc = acc * fade[:, None] + plgpu.dot(weights.astype(values.dtype), values,
                                              allow_tf32=False if f32 else None)
        return acc, new_top, total

    carry = (jnp.zeros((rows, dh), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    if cached:
        def cache_block(j, carry):
            cols = pl.ds(j * block_k, block_k)
            return attend_block(kc_ref[cols, :], vc_ref[cols, :], mc_ref[:, cols] != 0, carry)

        # Only the blocks from the first that a row of this program sees to the last (`span_ref`):
        # a loop without a branch in it, so Triton can load the next blocks while this one computes.
        carry = jax.lax.fori_loop(span_ref[0], span_ref[1], cache_block, carry)

    def window_block(j, carry):
        cols = pl.ds(j * block_w, block_w)
        return attend_block(kw_ref[cols, :], vw_ref[cols, :], mw_ref[:, cols] != 0, carry)

    acc, _, total = jax.lax.fori_loop(0, window // block_w, window_block, carry)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype).reshape(block_q, heads, dh)


def cache_span(mask: jax.Array, block_q: int, block_k: int) -> jax.Array:
    """[B, T / block_q, 2] int32: per batch row and block of query rows, the first block of
    `block_k` cache slots any of those rows sees (`mask` [B, T, S] bool) and one past the last
    (both 0 where they see none): the blocks the kernel reads, the unused capacity past a
    decode's slots and the slots before a prefix left out."""
    b, t, s = mask.shape
    blocks = s // block_k
    seen = mask.reshape(b, t // block_q, block_q, blocks, block_k).any(axis=(2, 4))  # [B, T / bq, blocks]
    index = jnp.arange(blocks, dtype=jnp.int32)
    last = jnp.max(jnp.where(seen, index + 1, 0), axis=-1)
    first = jnp.minimum(jnp.min(jnp.where(seen, index, blocks), axis=-1), last)
    return jnp.stack([first, last], axis=-1).astype(jnp.int32)


def attend_kernel(q: jax.Array, k_cache: jax.Array | None, v_cache: jax.Array | None, k: jax.Array,
                  v: jax.Array, mask: jax.Array, *, mesh=None) -> jax.Array:
    """`attend(q, [k_cache; k], [v_cache; v], mask)` as one kernel over the cache where it lies.

    q: [B, T, H, Dh]; k_cache, v_cache: [B, Hkv, S, Dh] (a resident cache's layer) or None (the
    window alone); k, v: [B, T, Hkv, Dh]; mask: [B, T, S+T] bool, cache columns first. The
    shapes must `fit`. Returns [B, T, H, Dh] in q's dtype. `mesh`: the program's mesh, on which
    each device runs the kernel over its rows (over dp, where dp divides B) and heads (over tp,
    which must divide the K/V heads: `shards`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if mesh is not None:
        return _on_mesh(mesh, q, k_cache, v_cache, k, v, mask)
    b, t, h, dh = q.shape
    hkv = k.shape[2]
    group, heads = h // hkv, _heads(h, hkv)
    s = 0 if k_cache is None else k_cache.shape[2]
    if not fits(t, s, dh):
        raise ValueError(f"the attention kernel takes window rows and cache slots in multiples of 16 and a head "
                         f"dim of 16-256 (a power of two); got T={t}, S={s}, Dh={dh}")
    tiling = _tiling
    # (query positions a program: x heads rows)
    block_q = _block(t, tiling.rows if heads == 1 else max(16, tiling.stacked_rows // heads))
    block_k, block_w = (_block(s, tiling.block_k) if s else 0), _block(t, tiling.block_k)  # (columns a loop step)
    # (one conversion a step, and one span: every layer's mask is the same array)
    seen = mask.astype(jnp.int8)
    # program j takes query heads j * heads .. + heads - 1, which read K/V head j * heads // group
    q_spec = pl.BlockSpec((None, block_q, None, heads, dh), lambda i, j, r: (i, r, j, 0, 0))
    window_specs = [pl.BlockSpec((None, t, None, dh), lambda i, j, r: (i, 0, j * heads // group, 0))] * 2
    window_mask_spec = pl.BlockSpec((None, block_q, t), lambda i, j, r: (i, r, 0))
    packed = q.reshape(b, t, h // heads, heads, dh)  # (a view: query heads are grouped by K/V head)
    if s:
        cache_spec = pl.BlockSpec((None, None, s, dh), lambda i, j, r: (i, j * heads // group, 0, 0))
        in_specs = [q_spec, cache_spec, cache_spec, pl.BlockSpec((None, block_q, s), lambda i, j, r: (i, r, 0)),
                    pl.BlockSpec((None, None, 2), lambda i, j, r: (i, r, 0)), *window_specs, window_mask_spec]
        operands = (packed, k_cache.astype(q.dtype), v_cache.astype(q.dtype), seen[:, :, :s],
                    cache_span(mask[:, :, :s], block_q, block_k), k, v, seen[:, :, s:])
    else:
        in_specs = [q_spec, *window_specs, window_mask_spec]
        operands = (packed, k, v, seen)
    kernel = functools.partial(_kernel, scale=1.0 / float(dh) ** 0.5, cached=bool(s), block_k=block_k,
                               block_w=block_w, window=t)
    # (more rows: the accumulator's [rows, Dh] float32 over more threads)
    params = {} if _interpret else {"compiler_params": plgpu.CompilerParams(
        num_warps=tiling.warps or (8 if block_q * heads > 64 else 4), num_stages=tiling.stages or None)}
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(packed.shape, q.dtype),
                         grid=(b, h // heads, t // block_q), in_specs=in_specs, out_specs=q_spec,
                         interpret=_interpret, name="dlm_jax_attention", **params)(*operands)
    return out.reshape(b, t, h, dh)


def _on_mesh(mesh, q, k_cache, v_cache, k, v, mask) -> jax.Array:
    """`attend_kernel` on `mesh`, each device over its shard: rows over "dp" where it divides the
    batch (as `MeshPlacement.batch` splits a step's rows), query and K/V heads over "tp" (as the
    partition rules split q/k/v's columns and the cache's heads); replicated over other axes."""
    from jax.sharding import PartitionSpec as P

    free, sizes = free_axes(mesh)  # (in a per-replica step, "dp" is manual already: its rows are local)
    tp, dp = sizes.get("tp", 1), sizes.get("dp", 1)
    if not shards(mesh, k.shape[2]):
        raise ValueError(f"the attention kernel on a mesh needs tp to divide the K/V heads; got tp={tp}, "
                         f"{k.shape[2]} K/V heads")
    rows = "dp" if dp > 1 and q.shape[0] % dp == 0 else None
    heads = "tp" if tp > 1 else None
    by_row = P(rows, None, heads, None)  # q, k, v and the output [B, T, heads, Dh]
    specs = [by_row, by_row, by_row, P(rows, None, None)]
    args = [q, k, v, mask]
    if k_cache is not None:  # [B, Hkv, S, Dh]
        specs += [P(rows, heads, None, None)] * 2
        args += [k_cache, v_cache]

    def local(q, k, v, mask, k_cache=None, v_cache=None):
        return attend_kernel(q, k_cache, v_cache, k, v, mask)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=by_row, axis_names=set(free),
                         check_vma=False)(*args)

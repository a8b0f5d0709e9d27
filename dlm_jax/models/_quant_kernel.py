"""A weight-only quantized product in Pallas (Triton on a GPU) for the layouts XLA does not
fuse: int8, float8 or int4 weights in groups of input rows, with zero points (uint4) or an
act-order map, each block of weights dequantised inside the GEMM, never written out.

Why: XLA:GPU converts a per-channel int8 / fp8 / int4 kernel inside its GEMMs, but a grouped
kernel's dequantisation, `q * scale[g]` with scales that change along the contracting axis (or
a zero point's subtraction, or act-order's gather of scales), it computes in a fusion of its
own and writes out in the activations' dtype, which the GEMM then reads: compiled for an H200 at
the LLaDA-8B shape, a grouped step writes 15.0 GB a step more than an int8 one
(`benchmarks/results/gpu_target.md`), where the bfloat16 weights are 16.03 GB. This kernel
reads each weight once, at its stored bytes (int4: two a byte, as XLA stores them):

- grid (M / block_m, O / block_n, split): one program per block of rows, of output columns
  and share of the input rows (`Tiling.split`, by default `auto_split`: at 1 a program sums all
  of them; more shares give a product of few rows, a batch-1 decode's, more programs than 32 of
  128 columns at d 4096, at the price of float32 partial sums [split, M, O] added in a fusion of
  their own, in a fixed order, so the results stay deterministic);
- it loops over blocks of `block_k` input rows (a group, or 128 rows of a larger group or of a
  kernel with one scale a channel): loads x's [block_m, block_k] columns and the block's
  [block_k, block_n] weights, dequantises them in float32 as `dlm_jax.models.quant.dequantize`
  does, `(q - zero) * scale` (the zero points where given; with an act-order map each row's
  scales gathered by its group), rounds them to x's dtype, and accumulates their product in
  float32; the sums are stored in the caller's dtype (`out_dtype`), one rounding as XLA's
  `einsum(..., preferred_element_type=float32).astype(dtype)`.

Routed experts (`expert_matmul`): the same kernel over weights [E, I, O] and the ids of the
experts [U] a product uses, read inside it, each program's expert's blocks read where they lie
in the stacked array (XLA's form gathers the used experts and dequantises them first): rows
[M, I] through each of the U experts, each expert its own rows [U, M, I] (the forms of
`dlm_jax.models._transformer.dispatch_experts`), or the experts' inputs side by side
[M, U * I] summed into one product (its few-experts form's down projection); of the U, only
the first `real` are read (a branch's experts past the step's used ones are pads). Unquantized
experts (bfloat16, float16 or float32, no scales) take it too, their blocks read as they lie:
XLA's form gathers a quarter of the experts into a copy first, or reads all of them in place
from half up (compiled for an H200 at LLaDA2.0-mini's shape, the costliest form of a batch-1
dual step writes 8.26 GB in XLA's form, 7.71 GB of it that copy, and 1.82 GB in the kernel:
`benchmarks/results/gpu_target.md`).

The products are `quantized_matmul`'s up to the order of the float32 sums (block by block).
Shapes it takes (`fits`; Triton's loads are powers of two and its products at least 16 wide):
blocks of rows of a power of two from 16 that divides the group size (the input width for one
scale a channel or an act-order map), an output width that 16 divides, int8, float8_e4m3fn or
int4 weights. Symmetric per-channel kernels are
left to XLA (fused there). On a machine without a GPU it runs in Pallas's interpreter
(`_attention_kernel.interpret()`), which is how the tests check it on a CPU (against NumPy's
product of the dequantised weights, and a model's logits and a decode's tokens against XLA's
form).

On a mesh (`sharded`, `sharded_matmul`) each device runs it over its own shards under a
`jax.shard_map`, as the partition rules place the parameter (`dlm_jax._partition`): a
column-parallel kernel over its output columns, a row-parallel one over its input rows (their
groups, or an act-order map's rows with the whole scales), its float32 partial products summed
over the axis; routed experts inside their own `shard_map` (`use`).

Used where `$DLM_JAX_QUANT_KERNEL` is `pallas` when a program is traced (`enabled`): an
experiment switch until a GPU has timed it against XLA's form (never run on one), in the
tiling `DEFAULT_TILING` (`tiled` sets another; `benchmarks/quant_sweep.py` times them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

from dlm_jax.models import _attention_kernel

QUANT_KERNEL_ENV = "DLM_JAX_QUANT_KERNEL"
DENSE_KERNEL_ENV = "DLM_JAX_DENSE_KERNEL"  # (a model's unquantized dense products: `use_dense`)
_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int4))
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))  # (unquantized experts)
_BLOCK_K = 128  # rows of a group (or of a kernel) dequantised at a time, at most


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The kernel's blocks and launch settings. `block_m`: the most activation rows a program
    takes (fewer rows: the power of two from 16 that holds them); `block_n`: the output
    columns a program takes (a width it does not divide: the largest power of two that does);
    `split`: the shares of the input rows, each a program's (a power of two that divides the
    kernel's blocks of rows, else the largest one that does; 0: `auto_split`); `warps`,
    `stages`: Triton's warps and software-pipelining stages a program."""

    block_m: int = 64
    block_n: int = 128
    split: int = 0
    warps: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"Tiling.{name}={n}: a power of two from 16")
        if self.split < 0 or self.split & (self.split - 1):
            raise ValueError(f"Tiling.split={self.split}: 0 (auto) or a power of two")
        if self.warps not in (1, 2, 4, 8, 16) or self.stages < 1:
            raise ValueError(f"Tiling warps={self.warps} (1, 2, 4, 8 or 16), stages={self.stages} (at least 1)")


DEFAULT_TILING = Tiling()
_tiling = DEFAULT_TILING
_PROGRAMS = 128  # `auto_split` splits until a product has this many programs (an H200 has 132 SMs)
_MAX_SPLIT = 8
_SHARE_BLOCKS = 4  # the fewest blocks of rows a share keeps (512 rows at 128)


def auto_split(programs: int, blocks: int) -> int:
    """The shares a product of `programs` programs (row and column blocks) over `blocks` blocks
    of input rows is split into by default: doubled, up to 8, while it has fewer than 128
    programs and each share keeps at least 4 blocks. XLA's own GEMMs split so at a few rows
    (its bfloat16 GEMM of 32 rows at d 4096, compiled for an H200, sums 4 shares apart); a
    decode step's products have few rows: at batch 1 a q kernel's 32 rows in 128 columns a
    program are 32 programs, a quarter of an H200's multiprocessors."""
    split = 1
    while programs * split < _PROGRAMS and split < _MAX_SPLIT and blocks % (2 * split) == 0 \
            and blocks // (2 * split) >= _SHARE_BLOCKS:
        split *= 2
    return split


def tiled(tiling: Tiling) -> contextlib.AbstractContextManager[None]:
    """Inside: the kernel is traced with `tiling`'s blocks and launch settings (process-wide,
    as `_attention_kernel.interpret`; only programs traced inside take it)."""
    return _attention_kernel.swapped(globals(), "_tiling", tiling)


def enabled(env: str = QUANT_KERNEL_ENV) -> bool:
    """Whether grouped products trace as this kernel: `$DLM_JAX_QUANT_KERNEL` is `pallas` (unset
    or `xla`: XLA's form; anything else is refused in one line); `env=DENSE_KERNEL_ENV`: whether
    a model's unquantized dense products do (`$DLM_JAX_DENSE_KERNEL`, the same values)."""
    value = os.environ.get(env, "")
    if value not in ("", "xla", "pallas"):
        from dlm_jax._errors import ConfigError

        raise ConfigError(f"{env}={value!r}: expected xla or pallas")
    return value == "pallas"


def _runs_here(env: str = QUANT_KERNEL_ENV) -> bool:
    """`enabled(env)`, and a GPU program (`dlm_jax.executors._compile.target_platform`) or
    Pallas's interpreter on."""
    if not enabled(env):
        return False
    if _attention_kernel._interpret:
        return True
    from dlm_jax.executors._compile import target_platform

    return target_platform() == "gpu"


def use(q: jax.Array, scale: jax.Array | None, zero: jax.Array | None = None, g_idx: jax.Array | None = None) -> bool:
    """Whether the product of these weights traces as the kernel over the arrays as they are:
    `enabled`, the shapes `fit`, a GPU program or Pallas's interpreter on, and one device, or a
    `shard_map` manual over every axis of the mesh that splits anything (each device's own
    arrays: `dlm_jax.models._transformer.sharded_experts`' routed experts). On a mesh a product
    of parameters placed by the partition rules runs in the kernel under a `shard_map` of its own
    (`sharded`); a Pallas call has no partitioning rule of its own."""
    return _runs_here() and fits(q, scale, zero, g_idx) and _local()


def use_dense(w: jax.Array) -> bool:
    """Whether a model's unquantized dense product x @ w [I, O] (a projection's, the untied
    head's) traces as the kernel, reading w as it is: `$DLM_JAX_DENSE_KERNEL=pallas`, a GPU
    program or Pallas's interpreter on, one device (`use`'s rule; on a mesh XLA's GEMMs), and a
    shape it takes. An experiment switch (XLA's GEMMs are the default), for the lease to time
    whole steps with it (`benchmarks/gpu_step.py --quant none+dense`)."""
    return w.ndim == 2 and _runs_here(DENSE_KERNEL_ENV) and fits(w) and _local()


def _local() -> bool:
    """One device, or a `shard_map` manual over every axis of the traced mesh that splits
    anything: the arrays a trace sees are the device's own."""
    from dlm_jax.models._tracing import traced_mesh

    mesh = traced_mesh()
    if mesh is None:
        return True
    free, sizes = _attention_kernel.free_axes(mesh)
    return all(sizes[ax] == 1 for ax in free)


@dataclasses.dataclass(frozen=True)
class Placed:
    """A product's shards on the traced mesh (`sharded`): the partition specs of q [I, O], its
    scales, zero points and act-order map as the partition rules place the parameter, the mesh
    axis splitting its input rows (its partial products summed over it; None: whole) and the one
    splitting its output columns, and the axis splitting a product's leading rows ("dp" where a
    step's batch rows are split, as `MeshPlacement.batch` splits them)."""

    mesh: object
    free: tuple[str, ...]
    specs: tuple
    rows_axis: str | None
    cols_axis: str | None
    batch_axis: str | None


def sharded(name: str | None, q: jax.Array, scale: jax.Array, zero: jax.Array | None = None,
            g_idx: jax.Array | None = None) -> Placed | None:
    """Where the product of parameter `name`'s weights ("layers.0.attn.o_proj") runs in the
    kernel on the traced mesh, each device over its own shards (`sharded_matmul`): `enabled`, a
    GPU program or the interpreter, a program the executor traced on its mesh with its placement
    (`dlm_jax.models._tracing.traced_placement`), and each device's shards `fit` (groups split
    as the rows they scale, or an act-order map split as its rows with the scales whole, as the
    rules place them). None: XLA's form (and its partitioner) instead."""
    if name is None or q.ndim != 2 or not _runs_here():
        return None
    from dlm_jax._partition import leaf_axes
    from dlm_jax.models._tracing import traced_mesh, traced_placement

    mesh, placed = traced_mesh(), traced_placement()
    if mesh is None or placed is None:
        return None
    axes, act_order = placed
    free, sizes = _attention_kernel.free_axes(mesh)

    def spec(leaf: str, a):
        if a is None:
            return None
        return tuple(ax if ax in free and sizes[ax] > 1 else None  # (an axis of one device splits nothing)
                     for ax in leaf_axes(f"{name}.{leaf}", a.shape, axes, act_order=act_order))

    specs = (spec("qkernel", q), spec("scale", scale), spec("zero", zero), spec("g_idx", g_idx))
    rows_axis, cols_axis = specs[0]
    if any(ax not in free for ax in specs[0] if ax is not None):
        return None

    def local(a, s):
        return None if a is None else jax.ShapeDtypeStruct(
            tuple(n // (sizes[ax] if ax else 1) for n, ax in zip(a.shape, s)), a.dtype)

    shards = [local(a, s) for a, s in zip((q, scale, zero, g_idx), specs)]
    grouped = scale.ndim == 2 and g_idx is None  # (groups of consecutive rows: split with them or not at all)
    if grouped and specs[1][0] != rows_axis:
        return None
    if g_idx is not None and specs[1][0] is not None:  # (an act-order map's groups are the whole kernel's)
        return None
    if not fits(*shards):
        return None
    dp = sizes.get("dp", 1)
    return Placed(mesh, free, specs, rows_axis, cols_axis, "dp" if "dp" in free and dp > 1 else None)


def sharded_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None, g_idx: jax.Array | None,
                   placed: Placed, *, out_dtype=jnp.float32) -> jax.Array:
    """`grouped_matmul` on `placed`'s mesh (`sharded`) under `jax.shard_map`: each device's
    product over its shards of the weights and of x's input columns, the partial products of a
    kernel split by its input rows (a row-parallel one's) summed in float32 over that axis
    (`psum`) and rounded to `out_dtype` after, x's leading rows split as a step's batch rows
    where their axis divides them."""
    from jax.sharding import PartitionSpec as P

    lead = x.ndim - 1
    batch = placed.batch_axis if lead and placed.batch_axis and x.shape[0] % dict(placed.mesh.shape)[
        placed.batch_axis] == 0 else None
    rows = (batch,) + (None,) * (lead - 1) if lead else ()
    summed = placed.rows_axis is not None

    def product(x, q, scale, zero, g_idx):
        y = grouped_matmul(x, q, scale, zero, g_idx, out_dtype=jnp.float32 if summed else out_dtype)
        return jax.lax.psum(y, placed.rows_axis).astype(out_dtype) if summed else y

    some = lambda s: None if s is None else P(*s)  # noqa: E731
    in_specs = (P(*rows, placed.rows_axis), *(some(s) for s in placed.specs))
    return jax.shard_map(product, mesh=placed.mesh, in_specs=in_specs, out_specs=P(*rows, placed.cols_axis),
                         axis_names=set(placed.free), check_vma=False)(x, q, scale, zero, g_idx)


def _block_k(rows: int, groups: int, act: bool) -> int:
    """Input rows dequantised at a time (0: none fits): a power of two from 16 up to `_BLOCK_K`
    within one group (act-order: any rows, their scales gathered row by row)."""
    if rows % groups:
        return 0
    return _attention_kernel._block(rows if act else rows // groups, _BLOCK_K)


def fits(q: jax.Array, scale: jax.Array | None = None, zero: jax.Array | None = None,
         g_idx: jax.Array | None = None) -> bool:
    """Whether the kernel takes weights q [I, O] (int8, float8_e4m3fn, int4) with grouped
    scales [G, O] (and zero points, and an act-order map [I]), or one scale a channel [O] with
    zero points (uint4; symmetric per-channel kernels are XLA's, fused there): blocks of rows
    (`_block_k`) and an output width that 16 divides. Routed experts' weights take a leading
    expert axis on each: q [E, I, O], scales [E, G, O] or [E, O] (zero points or not: XLA
    gathers the experts a step uses and dequantises them, symmetric or not), maps [E, I]; or
    unquantized (bfloat16, float16, float32) without scales (XLA gathers those experts too; a
    model's unquantized dense products are XLA's own GEMMs, a dense one here is
    `benchmarks/quant_sweep.py --quant none`'s, to time it against them)."""
    lead = q.ndim - 2
    if scale is None:
        return (lead in (0, 1) and jnp.dtype(q.dtype) in _FLOATS and zero is None and g_idx is None
                and bool(_block_k(q.shape[-2], 1, False)) and q.shape[-1] % 16 == 0)
    if lead not in (0, 1) or jnp.dtype(q.dtype) not in _DTYPES or scale.ndim - lead not in (1, 2):
        return False
    if scale.ndim - lead == 1 and ((zero is None and not lead) or g_idx is not None):
        return False
    if g_idx is not None and g_idx.shape != q.shape[:-1]:
        return False
    rows, cols = q.shape[-2:]
    groups = 1 if scale.ndim - lead == 1 else scale.shape[-2]
    return bool(_block_k(rows, groups, g_idx is not None)) and cols % 16 == 0


def _kernel(ids_ref, x_ref, q_ref, *refs, block_k: int, steps: int, per_group: int, per_expert: int,
            row_blocks: int, users: int, padded: bool, scaled: bool, zero: bool, act: bool, summed: bool):
    """One program: `steps` blocks of input rows from its share's first (grid axis 2), of the
    expert `ids_ref[u]` (u: the program's, grid axis 0 over row blocks; `summed`: each block's,
    the blocks of the experts one after another along x's columns). `padded`: `ids_ref[users]`
    says how many of the experts are real, the rest pads whose blocks are not read (their
    products zeros).
    Unquantized weights (`scaled` false) are read in x's dtype as they are."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    refs = list(refs)
    o_ref = refs.pop()
    g_ref = refs.pop() if act else None
    z_ref = refs.pop() if zero else None
    s_ref = refs.pop() if scaled else None
    f32 = x_ref.dtype == jnp.float32
    mine = None if summed else ids_ref[pl.program_id(0) // row_blocks]

    def step(t, acc):
        k = t % per_expert if summed else t  # (the block among its expert's)
        e = ids_ref[t // per_expert] if summed else mine
        rows = pl.ds(k * block_k, block_k)
        if not scaled:
            w = q_ref[e, rows, :].astype(x_ref.dtype)  # [block_k, block_n]
            return acc + plgpu.dot(x_ref[:, pl.ds(t * block_k, block_k)], w, allow_tf32=False if f32 else None)
        w = q_ref[e, rows, :].astype(jnp.float32)  # [block_k, block_n]
        # the block's scales (and zero points): its group's row, or each row's group's (act-order)
        at = (e, g_ref[e, rows], slice(None)) if act else (e, pl.ds(k // per_group, 1), slice(None))
        if zero:
            w = w - z_ref[at].astype(jnp.float32)
        w = (w * s_ref[at]).astype(x_ref.dtype)
        return acc + plgpu.dot(x_ref[:, pl.ds(t * block_k, block_k)], w, allow_tf32=False if f32 else None)

    first = pl.program_id(2) * steps
    last = first + steps
    if padded:
        real = ids_ref[users]  # (the experts before it are read; those from it on are pads)
        if summed:  # the share's blocks up to the pads' first
            last = jnp.maximum(first, jnp.minimum(last, real * per_expert))
        else:  # all of them, or none for a pad's program
            last = jnp.where(pl.program_id(0) // row_blocks < real, last, first)
    acc = jax.lax.fori_loop(first, last, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _call(x: jax.Array, q: jax.Array, scale: jax.Array | None, zero: jax.Array | None, g_idx: jax.Array | None,
          ids: jax.Array, *, per_expert_x: bool, summed: bool, out_dtype, real: jax.Array | None = None) -> jax.Array:
    """The kernel over experts' weights q [E, I, O] (scales [E, G, O], zero points, maps [E, I];
    no scales: unquantized) for the experts `ids` [U]: x [U, M, I] (`per_expert_x`) or [M, I] ->
    [U, M, O]; `summed`: x [M, U * I] -> [M, O], the experts' products added. `real`: only the
    first `real` of the U experts are read, the others pads (zeros; default all)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    n_exp, rows, cols = q.shape
    groups = 1 if scale is None else scale.shape[1]
    act = g_idx is not None
    block_k = _block_k(rows, groups, act)
    per_expert = rows // block_k
    users = ids.shape[0]
    tiling = _tiling
    m = x.shape[-2]
    block_m = min(tiling.block_m, max(16, 1 << max(m - 1, 0).bit_length()))
    padded = -(-m // block_m) * block_m
    if padded != m:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, padded - m), (0, 0)])
    row_blocks = padded // block_m
    block_n = _attention_kernel._block(cols, tiling.block_n)  # (16 or more: `fits`)
    blocks = per_expert * (users if summed else 1)  # (the blocks of rows a program's sum runs over)
    outer = row_blocks if summed else users * row_blocks  # grid axis 0: (expert, row block) pairs, or row blocks
    programs = outer * (cols // block_n)
    split = min(tiling.split or auto_split(programs, blocks), blocks & -blocks)  # (a power of two dividing them)
    rb = row_blocks
    if per_expert_x:
        x_spec = pl.BlockSpec((None, block_m, rows), lambda p, j, s: (p // rb, p % rb, 0))
    else:
        x_spec = pl.BlockSpec((block_m, x.shape[-1]), lambda p, j, s: (p % rb, 0))
    whole = lambda *shape: pl.BlockSpec(shape, lambda p, j, s: (0,) * len(shape))  # noqa: E731
    columns = lambda *shape: pl.BlockSpec((*shape, block_n), lambda p, j, s: (0,) * len(shape) + (j,))  # noqa: E731
    ids = ids.astype(jnp.int32)
    if real is not None:  # (its count after the ids)
        ids = jnp.concatenate([ids, jnp.reshape(real, (1,)).astype(jnp.int32)])
    in_specs = [whole(ids.shape[0]), x_spec, columns(n_exp, rows)]
    operands = [ids, x, q]
    if scale is not None:
        in_specs.append(columns(n_exp, groups))
        operands.append(scale.astype(jnp.float32))
    if zero is not None:
        in_specs.append(columns(n_exp, groups))
        operands.append(zero)
    if act:
        in_specs.append(whole(n_exp, rows))
        operands.append(g_idx.astype(jnp.int32))
    interpret = _attention_kernel._interpret
    params = {} if interpret else {
        "compiler_params": plgpu.CompilerParams(num_warps=tiling.warps, num_stages=tiling.stages)}
    kernel = functools.partial(_kernel, block_k=block_k, steps=blocks // split, per_group=max(1, per_expert // groups),
                               per_expert=per_expert, row_blocks=rb, users=users, padded=real is not None,
                               scaled=scale is not None,
                               zero=zero is not None, act=act, summed=summed)
    if summed:
        shape, block, at = (padded, cols), (block_m, block_n), lambda p, j: (p, j)
    else:
        shape, block, at = (users, padded, cols), (None, block_m, block_n), lambda p, j: (p // rb, p % rb, j)
    if split == 1:
        out_shape = jax.ShapeDtypeStruct(shape, out_dtype)
        out_spec = pl.BlockSpec(block, lambda p, j, s: at(p, j))
    else:  # float32 partial sums, one a share, added below in a fixed order
        out_shape = jax.ShapeDtypeStruct((split, *shape), jnp.float32)
        out_spec = pl.BlockSpec((None, *block), lambda p, j, s: (s, *at(p, j)))
    out = pl.pallas_call(kernel, out_shape=out_shape, grid=(outer, cols // block_n, split), in_specs=in_specs,
                         out_specs=out_spec, interpret=interpret, name="dlm_jax_grouped_matmul", **params)(*operands)
    if split > 1:  # share by share, left to right (one elementwise fusion; no reduction's own order)
        out = functools.reduce(jnp.add, [out[s] for s in range(split)]).astype(out_dtype)
    return out[..., :m, :]


def _as_experts(scale, zero, g_idx, lead: int):
    """Scales [.., O] (one a channel) as one group [.., 1, O], and their zero points."""
    if scale is not None and scale.ndim - lead == 1:
        scale, zero = scale[..., None, :], None if zero is None else zero[..., None, :]
    return scale, zero, g_idx


def grouped_matmul(x: jax.Array, q: jax.Array, scale: jax.Array | None = None, zero: jax.Array | None = None,
                   g_idx: jax.Array | None = None, *, out_dtype=jnp.float32) -> jax.Array:
    """x [..., I] @ the kernel q [I, O] (int8, float8, int4) with scales [G, O] (float32; [O]
    with zero points), zero points shaped as the scales (int8, or None) and an act-order map
    [I] (int32, or None) stand for -> [..., O] in `out_dtype` (summed in float32), as
    `quantized_matmul` computes it (no scales: q unquantized, read as it is); the shapes must
    `fit`."""
    if q.ndim != 2 or not fits(q, scale, zero, g_idx):
        raise ValueError(f"the quantized kernel takes int8 / float8 / int4 weights [I, O] in blocks of rows of a power "
                         f"of two from 16 and O a multiple of 16; got {q.dtype} {tuple(q.shape)} with scales "
                         f"{None if scale is None else tuple(scale.shape)}")
    scale, zero, g_idx = _as_experts(scale, zero, g_idx, 0)
    *lead, rows = x.shape
    some = lambda a: None if a is None else a[None]  # noqa: E731  (one expert)
    out = _call(x.reshape(-1, rows), q[None], some(scale), some(zero), some(g_idx), jnp.zeros((1,), jnp.int32),
                per_expert_x=False, summed=False, out_dtype=out_dtype)
    return out[0].reshape(*lead, q.shape[1])


def expert_matmul(x: jax.Array, q: jax.Array, scale: jax.Array | None, zero: jax.Array | None,
                  g_idx: jax.Array | None, experts: jax.Array, *, summed: bool = False,
                  out_dtype=jnp.float32, real: jax.Array | None = None) -> jax.Array:
    """Routed experts' products with their weights q [E, I, O] (scales [E, G, O] or [E, O] with
    zero points, zero points, act-order maps [E, I]; or unquantized, bfloat16 / float16 / float32
    without scales) of the experts `experts` [U] (int32; any
    order, repeats allowed), each expert's weights read where they lie:
    x [U, M, I] (each expert its rows) or [M, I] (the same rows through each) -> [U, M, O];
    `summed`: x [M, U * I] (expert u's inputs in columns u * I .. (u + 1) * I) -> [M, O], the
    experts' products added. In `out_dtype`, summed in float32; the shapes must `fit`. `real`
    (an int32 scalar, traced or not): only the first `real` experts are read, the others pads
    (a branch of U experts filled past the step's used ones) whose products are zeros."""
    if q.ndim != 3 or not fits(q, scale, zero, g_idx):
        raise ValueError(f"the quantized kernel takes experts' int8 / float8 / int4 weights [E, I, O] (or float ones "
                         f"without scales) in blocks of rows of a power of two from 16 and O a multiple of 16; got "
                         f"{q.dtype} {tuple(q.shape)} with scales {None if scale is None else tuple(scale.shape)}")
    scale, zero, g_idx = _as_experts(scale, zero, g_idx, 1)
    rows = q.shape[1]
    users = experts.shape[0]
    if summed and (x.ndim != 2 or x.shape[-1] != users * rows):
        raise ValueError(f"expert_matmul(summed=True): x {tuple(x.shape)} is not [M, {users} experts x {rows}]")
    if not summed and (x.ndim not in (2, 3) or x.shape[-1] != rows or (x.ndim == 3 and x.shape[0] != users)):
        raise ValueError(f"expert_matmul: x {tuple(x.shape)} is neither [M, {rows}] nor [{users} experts, M, {rows}]")
    return _call(x, q, scale, zero, g_idx, experts, per_expert_x=x.ndim == 3, summed=summed, out_dtype=out_dtype,
                 real=real)

"""A grouped weight-only quantized product in Pallas (Triton on a GPU): each group's tile of
int8 or float8 weights dequantised inside the GEMM, never written out.

Why: XLA:GPU converts a per-channel int8 / fp8 / int4 kernel inside its GEMMs, but a grouped
kernel's dequantisation, `q * scale[g]` with scales that change along the contracting axis, it
computes in a fusion of its own and writes out in the activations' dtype, which the GEMM then
reads: compiled for an H200 at the LLaDA-8B shape, a grouped step writes 15.0 GB a step more
than an int8 one (`benchmarks/results/gpu_target.md`), where the bfloat16 weights are 16.03 GB.
This kernel reads each weight once, at its stored byte:

- grid (M / block_m, O / block_n): one program per block of rows and of output columns;
- it loops over the G groups of input rows: loads x's [block_m, g] columns and the group's
  [g, block_n] weights, dequantises them in float32 as `dlm_jax.models.quant.dequantize` does,
  `(q - zero) * scale` (the zero points where given), rounds them to x's dtype, and accumulates
  their product in float32.

The products are `quantized_matmul`'s up to the order of the float32 sums (group by group).
Shapes it takes (`fits`; Triton's loads are powers of two and its products at least 16 wide): a
group size that is a power of two from 16, an output width that a power of two from 16 divides,
int8 or float8_e4m3fn weights (JAX's int4 has no Triton load here). On a machine without a GPU
it runs in Pallas's interpreter (`_attention_kernel.interpret()`), which is how the tests check
it on a CPU (against NumPy's product of the dequantised weights, and a model's logits and a
decode's tokens against XLA's form).

Used where `$DLM_JAX_QUANT_KERNEL` is `pallas` when a program is traced (`enabled`): an
experiment switch until a GPU has timed it against XLA's form (never run on one).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from dlm_jax.models import _attention_kernel

QUANT_KERNEL_ENV = "DLM_JAX_QUANT_KERNEL"
_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def enabled() -> bool:
    """Whether grouped products trace as this kernel: `$DLM_JAX_QUANT_KERNEL` is `pallas` (unset
    or `xla`: XLA's form; anything else is refused in one line)."""
    value = os.environ.get(QUANT_KERNEL_ENV, "")
    if value not in ("", "xla", "pallas"):
        from dlm_jax._errors import ConfigError

        raise ConfigError(f"{QUANT_KERNEL_ENV}={value!r}: expected xla or pallas")
    return value == "pallas"


def use(q: jax.Array, scale: jax.Array, zero: jax.Array | None = None, g_idx: jax.Array | None = None) -> bool:
    """Whether the product of these weights traces as the kernel: `enabled`, the shapes `fit`,
    off a mesh (a Pallas call has no partitioning rule: XLA's form there), and a GPU program
    (`dlm_jax.executors._compile.target_platform`) or Pallas's interpreter on."""
    if not enabled() or not fits(q, scale, zero, g_idx):
        return False
    from dlm_jax.models._tracing import traced_mesh

    if traced_mesh() is not None:
        return False
    if _attention_kernel._interpret:
        return True
    from dlm_jax.executors._compile import target_platform

    return target_platform() == "gpu"


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def fits(q: jax.Array, scale: jax.Array, zero: jax.Array | None = None, g_idx: jax.Array | None = None) -> bool:
    """Whether the kernel takes weights q [I, O] with grouped scales [G, O] (and zero points):
    int8 / float8 weights, a group size I / G that is a power of two from 16, an output width
    that 16 divides, no act-order map."""
    if q.ndim != 2 or scale.ndim != 2 or g_idx is not None or jnp.dtype(q.dtype) not in _DTYPES:
        return False
    rows, cols = q.shape
    groups = scale.shape[0]
    return rows % groups == 0 and _pow2(rows // groups) and rows // groups >= 16 and cols % 16 == 0


def _kernel(x_ref, q_ref, s_ref, *refs, group: int, groups: int, zero: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    z_ref, o_ref = refs if zero else (None, *refs)
    f32 = x_ref.dtype == jnp.float32

    def step(k, acc):
        rows = pl.ds(k * group, group)
        w = q_ref[rows, :].astype(jnp.float32)  # [g, block_n]
        if zero:
            w = w - z_ref[pl.ds(k, 1), :].astype(jnp.float32)
        w = (w * s_ref[pl.ds(k, 1), :]).astype(x_ref.dtype)
        return acc + plgpu.dot(x_ref[:, rows], w, allow_tf32=False if f32 else None)

    acc = jax.lax.fori_loop(0, groups, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc


def grouped_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None = None) -> jax.Array:
    """x [..., I] @ the kernel q [I, O] (int8 / float8) with scales [G, O] (float32) and zero
    points [G, O] (int8, or None) stand for -> [..., O] float32, as `quantized_matmul` computes
    it; the shapes must `fit`."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if not fits(q, scale, zero):
        raise ValueError(f"the grouped kernel takes int8 / float8 weights [I, O] in groups of a power of two from "
                         f"16 and O a multiple of 16; got {q.dtype} {tuple(q.shape)} with scales {tuple(scale.shape)}")
    *lead, rows = x.shape
    cols = q.shape[1]
    groups = scale.shape[0]
    flat = x.reshape(-1, rows)
    m = flat.shape[0]
    block_m = min(64, max(16, 1 << max(m - 1, 0).bit_length()))
    padded = -(-m // block_m) * block_m
    if padded != m:
        flat = jnp.pad(flat, ((0, padded - m), (0, 0)))
    block_n = _attention_kernel._block(cols, 128)  # (16 or more: `fits`)
    in_specs = [pl.BlockSpec((block_m, rows), lambda i, j: (i, 0)),
                pl.BlockSpec((rows, block_n), lambda i, j: (0, j)),
                pl.BlockSpec((groups, block_n), lambda i, j: (0, j))]
    operands = [flat, q, scale.astype(jnp.float32)]
    if zero is not None:
        in_specs.append(pl.BlockSpec((groups, block_n), lambda i, j: (0, j)))
        operands.append(zero)
    interpret = _attention_kernel._interpret
    params = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=4, num_stages=3)}
    kernel = functools.partial(_kernel, group=rows // groups, groups=groups, zero=zero is not None)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((padded, cols), jnp.float32),
                         grid=(padded // block_m, cols // block_n), in_specs=in_specs,
                         out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
                         interpret=interpret, name="dlm_jax_grouped_matmul", **params)(*operands)
    return out[:m].reshape(*lead, cols)

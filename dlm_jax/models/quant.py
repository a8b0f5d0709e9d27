"""Weight-only quantization of a loaded model for the JAX executor: int8 or fp8 (e4m3) weights
with one float32 scale per output channel, or per output channel and group of input rows,
dequantised inside the matmuls.

Axes: I a kernel's input width, O its output width (the channel a scale belongs to), E experts,
G groups of input rows, N rows.

`quantize(model, mode)` swaps, in place, every dense `nnx.Linear` of attention (q/k/v/o), of the
dense FFNs and the MoE layers' shared experts (gate/up/down) and the untied output head for a
`QuantLinear`, and the routed experts' gate/up/down [E, I, O] for int8 / fp8 arrays with [E, O]
scales (`QuantExperts`, read by the MoE einsums of `dlm_jax.models._transformer`). The embedding
table, the norms, the router and the biases stay as stored, and so does any weight named in
`quantize(..., keep=...)` (a pre-quantized checkpoint's float kernels: its head, or its experts).

- int8: symmetric per output channel, scale[o] = max_i |W[i, o]| / 127 (1 for a zero column),
  q = round(W / scale) clipped to [-127, 127].
- fp8: float8_e4m3fn with scale[o] = max_i |W[i, o]| / 448 (its largest finite value).
- int4: as int8 within [-7, 7], scale[o] = max_i |W[i, o]| / 7, held as JAX's int4 (a
  pre-quantized checkpoint's may hold -8 too); made for groups ("int4-g32", "int4-g128": the
  layout of GPTQ / AWQ and compressed-tensors' W4A16), as one scale per channel over 15 steps is
  coarse.
- uint4: asymmetric 4-bit, each weight an unsigned value q from 0 to 15 with a zero point z per
  scale, w = (q - z) * scale: the layout of AutoAWQ's default and of GPTQ / compressed-tensors'
  `sym: false` checkpoints, whose 16 steps span a column's or group's own range where int4's
  are centred on zero (a skewed column leaves half of them unused). Made as GPTQ's quantizer
  does: over the range [min(w, 0), max(w, 0)] of a channel or group,
  scale = (hi - lo) / 15, z = round(-lo / scale). Held offset by 8, the difference unchanged:
  `qkernel` as JAX's int4 holding q - 8, and `zero` (one per scale, [O] or [G, O]) as int8
  holding z - 8 (int8, not int4: GPTQ's first checkpoint format can hold a zero point of 16).
  Both the weights' dequantisation and the zero-point subtraction are exact in float32.
- "int8-gK" / "fp8-gK" / "uint4-gK" (grouped): the same within each group of K consecutive
  input rows, scale[g, o] = max over rows gK..gK+K-1 of |W[i, o]| / qmax (uint4: the group's
  range, its own zero point), so that one large weight coarsens
  only its group's steps (the layout of GPTQ / AWQ groups and GGUF's Q8_0 blocks, K = 32).
  Scales are [G, O] (G = I / K; a kernel with I <= K is one group; K must divide a larger I).
- "...-gK-act" (act-order, GPTQ's `desc_act`): a grouped mode whose rows are not in runs of K:
  each quantized kernel holds `g_idx` (int32 [I], a routed expert's [E, I]: each its own), the
  group of each input row, read as the kernel is dequantised. Quantizing at load gives the rows
  their groups in order; an act-order checkpoint's maps replace them
  (`dlm_jax.checkpoint._prequantized`).

A per-channel product is `(x @ q.astype(x.dtype)) * scale`, accumulated in float32
(`preferred_element_type`) and cast back to x's dtype: on a GPU, XLA fuses the convert into the
GEMM's operand read, so a step reads 1 byte per weight instead of 2 (bfloat16) or 4. A grouped
product cannot scale after the sum (each group's partial sum has its own scale): the kernel is
dequantised to x's dtype first, `x @ (q * scale[g])`; in bfloat16 the dequantised weights are
rounded to bfloat16 too. uint4 (per channel or grouped) is dequantised first the same way,
`x @ ((q - z) * scale)`, the subtraction exact in float32. XLA:GPU does not fuse that
dequantisation into its GEMMs (compiled for an H200 without one:
`benchmarks/results/gpu_target.md`): each such kernel is written out in x's dtype every step and
read again, so on a GPU those modes save memory, not time; int8, fp8 and int4 per output
channel are read at their own bytes. `$DLM_JAX_QUANT_KERNEL=pallas` runs the grouped, uint4
and act-order products (int8, fp8 and int4 weights; routed experts' too, `expert_kernel`) in a
Pallas kernel that dequantises each block of weights inside the GEMM
(`dlm_jax.models._quant_kernel`; never timed on a GPU).

Scales are computed at load, in float32, one kernel at a time on the device the weights live on,
and each stored kernel is dropped as its quantized twin replaces it: quantizing needs the
model's memory plus about one kernel's (uint4: a few float32 copies of the kernel being
quantized, as its divisions are kept whole, `quantize_kernel`).
"""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dlm_jax._config import WEIGHT_QUANTS, ZERO_OFFSET, act_order, weight_quant_parts
from dlm_jax._errors import ConfigError

QUANT_MODES = WEIGHT_QUANTS
_QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0, "uint4": 15.0}
_QDTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4, "uint4": jnp.int4}


def check_quant(mode: str | None) -> None:
    """Refuse a quant mode that is neither None nor a format of `QUANT_MODES` with an optional
    group ("int8-g128"), in one line."""
    if mode is not None:
        weight_quant_parts(mode)


def groups(mode: str, rows: int, what: str = "a kernel") -> int | None:
    """How many groups of input rows a kernel with `rows` input rows has under `mode`: None per
    output channel (scales [..., O]), else G (scales [..., G, O]). A ConfigError names `what`
    when the group size neither divides `rows` nor covers them."""
    _, group = weight_quant_parts(mode)
    if group is None:
        return None
    if rows <= group:
        return 1
    if rows % group:
        raise ConfigError(f"quant={mode!r}: {what} has {rows} input rows, not a multiple of groups of {group}; "
                          f"pick a group size that divides it (or one of at least {rows})")
    return rows // group


@functools.partial(jax.jit, static_argnames=("mode",))
def quantize_kernel(w: jax.Array, *, mode: str) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(q, scale, zero) of a kernel w [..., I, O]: q [..., I, O] int8, int4 or float8_e4m3fn,
    scale float32 per output channel (the last axis) and per leading index (an expert): [..., O],
    or [..., G, O] for a grouped mode (per group of input rows too); zero the uint4 zero points
    (int8, shaped as the scales, minus `ZERO_OFFSET` as q is), None for the symmetric modes."""
    fmt, _ = weight_quant_parts(mode)
    qmax = _QMAX[fmt]
    w32 = w.astype(jnp.float32)
    *lead, rows, cols = w.shape
    g = groups(mode, rows)
    if g is not None:
        w32 = w32.reshape(*lead, g, rows // g, cols)
    if fmt == "uint4":  # GPTQ's range: zero always representable
        lo = jnp.minimum(jnp.min(w32, axis=-2), 0.0)
        hi = jnp.maximum(jnp.max(w32, axis=-2), 0.0)
        # divided, not multiplied by a reciprocal (XLA's rewrite of a division by a broadcast
        # array, up to an ulp off, which moves a rounding tie): exactly what GPTQ's, AutoRound's
        # and compressed-tensors' quantizers compute (the barriers keep the divisors whole arrays)
        steps = jax.lax.optimization_barrier(jnp.full(hi.shape, qmax, jnp.float32))
        scale = jnp.where(hi > lo, (hi - lo) / steps, 1.0)  # a zero column: scale 1, q = z
        zero = jnp.clip(jnp.round(-lo / scale), 0, qmax)
        per_weight = jax.lax.optimization_barrier(jnp.broadcast_to(scale[..., None, :], w32.shape))
        y = jnp.clip(jnp.round(w32 / per_weight) + zero[..., None, :], 0, qmax).reshape(w.shape)
        return ((y - ZERO_OFFSET).astype(jnp.int4), scale,
                (zero - ZERO_OFFSET).astype(jnp.int8))
    amax = jnp.max(jnp.abs(w32), axis=-2)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)  # a zero column: scale 1, q 0
    y = jnp.clip(w32 / scale[..., None, :], -qmax, qmax).reshape(w.shape)  # w / scale may round past qmax
    q = y.astype(jnp.float8_e4m3fn) if fmt == "fp8" else jnp.round(y).astype(_QDTYPE[fmt])
    return q, scale, None


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32, zero: jax.Array | None = None,
               g_idx: jax.Array | None = None) -> jax.Array:
    """The weights [..., I, O] that q [..., I, O] and scale [..., O] (per output channel) or
    [..., G, O] (grouped) stand for, in `dtype`: q * scale, or (q - zero) * scale with uint4's
    zero points (shaped as the scales); with `g_idx` [I] (an act-order mode's map; [..., I], one
    per expert, for routed experts), row i's scales and zero points are those of group g_idx[i]
    (a gather, done as the kernel is dequantised)."""
    q32 = q.astype(jnp.float32)
    if g_idx is not None and g_idx.ndim > 1:  # each leading index (expert) its own map
        per_row = lambda a: jnp.take_along_axis(a, g_idx[..., None], axis=-2)  # noqa: E731
    elif g_idx is not None:  # scales and zero points [..., I, O], row by row
        per_row = lambda a: jnp.take(a, g_idx, axis=-2)  # noqa: E731
    else:  # broadcast over a channel's rows, or a group's ([..., G, I / G, O])
        per_row = lambda a: a[..., None, :]  # noqa: E731
        if scale.ndim == q.ndim:
            *lead, rows, cols = q.shape
            q32 = q32.reshape(*lead, scale.shape[-2], rows // scale.shape[-2], cols)
    if zero is not None:
        q32 = q32 - per_row(zero).astype(jnp.float32)
    return (q32 * per_row(scale)).reshape(q.shape).astype(dtype)


def quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None = None,
                     g_idx: jax.Array | None = None, dtype=jnp.float32, *, name: str | None = None) -> jax.Array:
    """x [..., I] @ the kernel that q [I, O], scale [O] or [G, O] (and uint4's zero points, an
    act-order map) stand for -> [..., O] in `dtype`, accumulated in float32: per channel, q
    converted to x's dtype inside the matmul, then scaled; grouped or with zero points, q
    dequantised to x's dtype first (or, with `$DLM_JAX_QUANT_KERNEL=pallas` on a GPU, block by
    block inside one Pallas kernel: `dlm_jax.models._quant_kernel`; on a mesh each device over
    its shards of the parameter `name`, "layers.0.attn.q_proj", as the partition rules place it)."""
    if scale.ndim == q.ndim or zero is not None:
        from dlm_jax.models import _quant_kernel

        if _quant_kernel.use(q, scale, zero, g_idx):  # (`$DLM_JAX_QUANT_KERNEL=pallas`: dequantised in it)
            return _quant_kernel.grouped_matmul(x, q, scale, zero, g_idx, out_dtype=dtype)
        placed = _quant_kernel.sharded(name, q, scale, zero, g_idx)
        if placed is not None:  # (the same, on a mesh: each device its shards)
            return _quant_kernel.sharded_matmul(x, q, scale, zero, g_idx, placed, out_dtype=dtype)
        return jnp.einsum("...i,io->...o", x, dequantize(q, scale, x.dtype, zero, g_idx),
                          preferred_element_type=jnp.float32).astype(dtype)
    y = jnp.einsum("...i,io->...o", x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(dtype)


class QuantLinear(nnx.Module):
    """A weight-only quantized `nnx.Linear`: `qkernel` [I, O] (int8, int4 or float8_e4m3fn),
    `scale` [O] (or [G, O], grouped) float32, uint4's `zero` points (int8, shaped as `scale`; None
    for the symmetric modes), an act-order mode's `g_idx` [I] int32 (each input row's group; None
    for runs of consecutive rows) and the stored bias [O] or None; called as the Linear was, x
    [..., I] -> [..., O] in the Linear's `dtype`. `param_name`: the Linear's name as the partition
    rules read it, without its layer ("attn.q_proj" in every block, so that identical blocks stay
    one structure, traced once: `dlm_jax.models._transformer.layers_traced_once`), by which they
    place it on a mesh (the Pallas kernel's shards there: `quantized_matmul`); None for one the
    rules do not name."""

    def __init__(self, qkernel: jax.Array, scale: jax.Array, bias: jax.Array | None, *, dtype,
                 zero: jax.Array | None = None, g_idx: jax.Array | None = None, param_name: str | None = None):
        self.qkernel = nnx.Param(qkernel)
        self.scale = nnx.Param(scale)
        self.zero = nnx.Param(zero) if zero is not None else None
        self.g_idx = nnx.Param(g_idx) if g_idx is not None else None
        self.bias = nnx.Param(bias) if bias is not None else None
        self.dtype = dtype
        self.param_name = param_name
        self.in_features, self.out_features = qkernel.shape

    @classmethod
    def from_linear(cls, linear: nnx.Linear, mode: str, param_name: str | None = None) -> QuantLinear:
        q, scale, zero = quantize_kernel(linear.kernel[...], mode=mode)
        bias = None if linear.bias is None else linear.bias[...]
        rows = linear.kernel[...].shape[0]
        g_idx = (jnp.arange(rows, dtype=jnp.int32) // (rows // scale.shape[0])) if act_order(mode) else None
        return cls(q, scale, bias, dtype=linear.dtype or linear.kernel[...].dtype, zero=zero, g_idx=g_idx,
                   param_name=param_name)

    def product(self, x: jax.Array, dtype=jnp.float32) -> jax.Array:
        """x [..., I] @ the dequantised kernel -> [..., O] in `dtype` (no bias): the int8/fp8
        weights converted to x's dtype inside the matmul, accumulated in float32, then scaled
        (`quantized_matmul`)."""
        return quantized_matmul(x, self.qkernel[...], self.scale[...],
                                None if self.zero is None else self.zero[...],
                                None if self.g_idx is None else self.g_idx[...], dtype, name=self.param_name)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype or x.dtype
        y = self.product(x.astype(dt), dt)
        if self.bias is not None:
            y = y + self.bias[...].astype(dt)
        return y


class QuantExperts(NamedTuple):
    """Routed experts' weights quantized per expert and output channel: q [E, I, O] int8 or
    float8_e4m3fn, scale [E, O] (or [E, G, O], grouped) float32, uint4's zero points (int8,
    shaped as the scales) or None, and an act-order mode's maps of each expert's input rows to
    its groups (int32 [E, I]) or None (`dlm_jax.models._transformer.dispatch_experts` and
    `dense_experts` take it where they take a dense [E, I, O] array)."""

    q: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    g_idx: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def take(self, experts: jax.Array, dtype) -> jax.Array:
        """The dense [U, I, O] weights of the experts [U] in `dtype` (dequantised as gathered:
        one fused gather, no copy of the others)."""
        some = lambda a: None if a is None else jnp.take(a, experts, axis=0)  # noqa: E731
        return dequantize(some(self.q), some(self.scale), dtype, some(self.zero), some(self.g_idx))


def expert_einsum(spec: str, x: jax.Array, w: jax.Array | QuantExperts) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for expert weights w [E, I, O] (the second operand), dense or
    `QuantExperts`: quantized, the product of x and q converted to x's dtype is accumulated in
    float32 and scaled per (expert, output channel), then cast to x's dtype. The output names
    the expert axis before the output-channel axis (`ecd,edf->ecf`, `nd,edf->nef`)."""
    if not isinstance(w, QuantExperts):
        return jnp.einsum(spec, x, w)
    if w.scale.ndim == w.q.ndim or w.zero is not None:  # grouped or zero points: dequantised first
        if expert_kernel(w):  # (`$DLM_JAX_QUANT_KERNEL=pallas`: each expert's blocks dequantised in it)
            return _kernel_einsum(spec, x, w)
        return jnp.einsum(spec, x, dequantize(w.q, w.scale, x.dtype, w.zero, w.g_idx),
                          preferred_element_type=jnp.float32).astype(x.dtype)
    ins, out = spec.split("->")
    wspec = ins.split(",")[1]
    e, o = wspec[0], wspec[-1]
    if out.index(e) > out.index(o):
        raise ValueError(f"expert_einsum({spec!r}): the output must name the expert axis before the channel axis")
    y = jnp.einsum(spec, x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)
    s = w.scale.reshape([w.scale.shape[0] if c == e else w.scale.shape[1] if c == o else 1 for c in out])
    return (y * s).astype(x.dtype)


def expert_kernel(w) -> bool:
    """Whether routed experts' weights `w` run in dlm-jax's Pallas kernel
    (`dlm_jax.models._quant_kernel`, `$DLM_JAX_QUANT_KERNEL=pallas` on a GPU) in
    `dispatch_experts`' few-experts form, which reads the used experts in place there, where
    XLA's form gathers (and dequantises) them into a copy: quantized `QuantExperts` of shapes it
    takes (per channel too), or unquantized [E, I, O] arrays (`expert_einsum` keeps XLA's
    per-channel and unquantized forms, over every expert in place)."""
    from dlm_jax.models import _quant_kernel

    if not isinstance(w, QuantExperts):
        return isinstance(w, jax.Array) and _quant_kernel.use(w, None)
    return _quant_kernel.use(w.q, w.scale, w.zero, w.g_idx)


def experts_matmul(x: jax.Array, w: QuantExperts | jax.Array, experts: jax.Array, *,
                   summed: bool = False, real: jax.Array | None = None) -> jax.Array:
    """The experts `experts` [U] of `w` (quantized, or unquantized [E, I, O]) in the kernel
    (`expert_kernel(w)` must hold), in x's dtype: x [M, I] or [U, M, I] -> [U, M, O]; `summed`:
    x [M, U * I] -> [M, O]; only the first `real` read (`_quant_kernel.expert_matmul`)."""
    from dlm_jax.models import _quant_kernel

    parts = (w, None, None, None) if not isinstance(w, QuantExperts) else (w.q, w.scale, w.zero, w.g_idx)
    return _quant_kernel.expert_matmul(x, *parts, experts, summed=summed, out_dtype=x.dtype, real=real)


def _kernel_einsum(spec: str, x: jax.Array, w: QuantExperts) -> jax.Array:
    """`expert_einsum(spec, x, w)` through the kernel, every expert in order: x's axes moved to
    [E, M, I] (or [M, I] without the expert axis), the product [E, M, O] moved to `spec`'s
    output."""
    ins, out = spec.split("->")
    xs, (e, i, o) = ins.split(",")
    rest = [c for c in xs if c not in (e, i)]
    lead = ([e] if e in xs else []) + rest
    xt = jnp.transpose(x, [xs.index(c) for c in lead + [i]])
    sizes = [xt.shape[lead.index(c)] for c in rest]
    m = math.prod(sizes)
    xt = xt.reshape(((w.q.shape[0],) if e in xs else ()) + (m, xt.shape[-1]))
    y = experts_matmul(xt, w, jnp.arange(w.q.shape[0], dtype=jnp.int32))  # [E, M, O]
    y = y.reshape(w.q.shape[0], *sizes, y.shape[-1])
    return jnp.transpose(y, [([e] + rest + [o]).index(c) for c in out])


_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "qkv_proj", "gate_up_proj")  # the last two: fused (`dlm_jax.models._fuse`)


def quantized_weights(model, *, keep: frozenset[str] = frozenset()) -> list[tuple[str, nnx.Module, str]]:
    """(name, module, attribute) of every weight `quantize` replaces, the routed experts' "gate" /
    "up" / "down" arrays of an MoE layer ("layers.1.ffn.gate"), each dense `nnx.Linear` named in
    `_LINEARS` ("layers.0.attn.q_proj": its parameters are that name's ".kernel" and ".bias") and
    the untied output head ("lm_head"), but those named in `keep`."""
    out: list[tuple[str, nnx.Module, str]] = []
    for path, module in list(nnx.iter_modules(model)):
        prefix = "".join(f"{p}." for p in path)
        if isinstance(getattr(module, "gate", None), nnx.Param):  # an MoEFFN's routed experts [E, I, O]
            out += [(prefix + name, module, name) for name in ("gate", "up", "down")]
        out += [(prefix + name, module, name) for name in _LINEARS
                if isinstance(getattr(module, name, None), nnx.Linear)]
    if isinstance(model.lm_head, nnx.Linear):
        out.append(("lm_head", model, "lm_head"))
    return [w for w in out if w[0] not in keep]


def quantize(model, mode: str, *, keep: frozenset[str] | set[str] | tuple[str, ...] = frozenset()):
    """Quantize `model` (a `dlm_jax.models.Transformer`) in place, weight-only, to `mode`
    ("int8", "fp8", "int4" or "uint4", optionally grouped: "int8-g128"); returns it. See the module docstring
    (and `quantized_weights`) for which weights; those named in `keep` ("lm_head",
    "layers.1.ffn.gate", "layers.0.attn.q_proj") stay as they are: a pre-quantized checkpoint
    that stores some of them in float (`dlm_jax.checkpoint._io`). `model.quant_float` is then
    that set, and `model.quant_head` whether an untied head is quantized. A model whose MoE layers
    are split (TIDE's expert slots) is refused: its experts live on the host too."""
    check_quant(mode)
    if mode is None:
        return model
    if getattr(model, "quant", None) is not None:
        raise ConfigError(f"the model is already quantized ({model.quant})")
    if getattr(model.layers, "stacked", False):  # a `_scan.StackedLayers` (checked before anything is swapped)
        raise ConfigError(f"quant={mode!r}: the model's layers are stacked for a scan (layers='scan'); quantize "
                          f"before the executor stacks them (dlm_jax.load(..., quant=...))")
    keep = frozenset(keep)
    every = quantized_weights(model)
    unknown = sorted(keep - {name for name, _, _ in every} - {"lm_head"})  # (a tied head is the embedding's)
    if unknown:
        raise ConfigError(f"quant={mode!r}: keep names {unknown[:4]}, which are no weights it quantizes "
                          f"(e.g. {every[0][0]!r}, 'lm_head')")
    weights = [(module, name, n) for n, module, name in every if n not in keep]
    if any(getattr(module, "slot_of", None) is not None for module, _, _ in weights):
        raise ConfigError(f"quant={mode!r} with split expert execution (expert_slots) is not supported: "
                          f"quantize before splitting is not built yet; drop one of them")
    for module, name, _ in weights:  # every group size checked before anything is swapped
        weight = getattr(module, name)
        rows = weight.in_features if isinstance(weight, nnx.Linear) else weight[...].shape[-2]
        groups(mode, rows, f"{type(module).__name__}.{name}")
    for module, name, full in weights:
        weight = getattr(module, name)
        if isinstance(weight, nnx.Linear):
            setattr(module, name, QuantLinear.from_linear(weight, mode, re.sub(r"^(.*\.)?layers\.\d+\.", "", full)))
            continue
        q, scale, zero = quantize_kernel(weight[...], mode=mode)
        setattr(module, name, nnx.Param(q))  # the stored weights are dropped here, one tensor at a time
        setattr(module, f"{name}_scale", nnx.Param(scale))
        if zero is not None:
            setattr(module, f"{name}_zero", nnx.Param(zero))
        if act_order(mode):  # each expert's rows in groups in order (a checkpoint's own maps replace them)
            *lead, rows, _ = q.shape
            setattr(module, f"{name}_g_idx", nnx.Param(jnp.broadcast_to(
                jnp.arange(rows, dtype=jnp.int32) // (rows // scale.shape[-2]), (*lead, rows))))
    model.quant = mode
    model.quant_float = keep  # (`model.quant_head` reads it)
    return model


def widen_int4(model) -> int:
    """Hold every int4 weight of `model` as int8, the same values, in place; returns how many.
    On a mesh: a program compiled for int4 arguments split over devices asks for them packed two
    to a byte, a layout JAX's CPU arrays do not take (jax 0.10: "compiled for input layouts that
    disagree"); split int4 on GPUs is untried. A CPU holds an int4 in a byte either way, and the
    planner counts one (`dlm_jax.planner`)."""
    n = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and getattr(node[...], "dtype", None) == jnp.int4:
            node.set_value(node[...].astype(jnp.int8))
            n += 1
    return n


def gpu_bytes(tree) -> int:
    """Bytes of the arrays (or shape-dtype structs) of `tree` as a GPU holds them: int4 two a
    byte, as XLA:GPU packs it (a CPU holds one a byte, as NumPy's itemsize says: `weight_bytes`)."""
    return int(sum(leaf.size * jax.dtypes.itemsize_bits(leaf.dtype) // 8 for leaf in jax.tree.leaves(tree)))


def weight_bytes(model) -> int:
    """Bytes of every parameter of `model` as held (quantized weights and their scales included;
    int4 a byte each, as a CPU holds it and the planner counts it)."""
    state = nnx.state(model, nnx.Param)
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)))

"""Projections that read the same input fused into one linear: attention's q, k and v into
`qkv_proj`, a gated FFN's gate and up (SwiGLU / ReGLU, MoE shared experts included) into
`gate_up_proj`.

Why: at batch 1 a decode step is a string of GEMMs that each read one weight matrix once. On
one H200 at the LLaDA-8B shape (`benchmarks/results/gpu_step.md`) the 4096-wide projections
read their weights at 1.6-2.8 TB/s while the 12288-wide FFN ones reached 3.5 TB/s, and a
batch-8 prefix step ran its 4096-wide GEMMs at about a third of the dense peak: one wide GEMM
in place of three narrow ones (and one kernel launch in place of three) is what serving
stacks do (q/k/v and gate/up are merged at load in vLLM and TensorRT-LLM). The JAX executor's
`projections="fused"` uses this module; whether it pays is measured by
`benchmarks/gpu_step.py --projections separate fused`.

The product is the same per output column: column j of `x @ [Wq Wk Wv]` is column j of the
projection it came from, and the fused linear keeps each kernel's dtype, bias and weight-only
quantization (scales, and uint4's zero points, are per output column, so they concatenate too).
Act-order linears (GPTQ's `desc_act`: a map `g_idx` of input rows to groups) fuse where their
maps are equal, as a GPTQ checkpoint's are for projections of one input (their rows are ordered
by the same input statistics): the fused linear holds the map once. Linears with maps of their
own stay separate.

Ownership of the weights, as `dlm_jax.models._scan.stack_layers` does it: `fuse_projections`
concatenates one group at a time and deletes the arrays it joined, so at most one group's
kernels exist twice. The model keeps working (its forward runs the fused linears), and
`get_params` names its parameters as before fusion (`layers.0.attn.q_proj.kernel`), so its
checkpoints and fingerprints are unchanged. LoRA adapters attached before fusion keep working
(each part gets its own delta); `attach_lora` refuses a fused model.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlm_jax._errors import ConfigError
from dlm_jax.models._scan import StackedLayers, joined_consuming, shared_arrays
from dlm_jax.models._transformer import Attention, DenseFFN, Transformer
from dlm_jax.models.quant import QuantLinear

PROJECTIONS = ("separate", "fused")
PROJECTIONS_ENV = "DLM_JAX_PROJECTIONS"

# A fused parameter's dotted name -> (owner prefix, fused linear, leaf): `get_params` splits it
# back into the names of the projections it holds.
_FUSED_NAME = re.compile(r"^(?P<owner>.*)\.(?P<fused>qkv_proj|gate_up_proj)\."
                         r"(?P<leaf>kernel|bias|qkernel|scale|zero|g_idx)$")
_PARTS = {"qkv_proj": Attention.QKV, "gate_up_proj": ("gate_proj", "up_proj")}


def _joined(arrays: list, keep: frozenset[int]):
    """The arrays side by side on their last axis, each deleted once joined but those in `keep`
    (`shared_arrays`; abstract `jax.ShapeDtypeStruct`s: their shape)."""
    shape = (*arrays[0].shape[:-1], sum(a.shape[-1] for a in arrays))
    return joined_consuming(arrays, lambda xs: jnp.concatenate(xs, axis=-1), shape, keep)


def _fused_linear(linears: list, keep: frozenset[int]):
    """One linear computing `linears` side by side, or None where they do not fuse (different
    kinds, dtypes or quantization; a bias on some only; act-order maps that differ)."""
    first = linears[0]
    maps = [getattr(lin, "g_idx", None) for lin in linears]
    if any(m is not None for m in maps) and not _same_maps(maps):
        return None  # act-order groups (`dlm_jax.models.quant`): each linear's own row map, not joined
    quantized = isinstance(first, QuantLinear)
    if not isinstance(first, (QuantLinear, nnx.Linear)) or any(
            len({key(lin) for lin in linears}) != 1
            for key in (type, lambda lin: lin.dtype, lambda lin: lin.bias is None,
                        lambda lin: getattr(lin, "zero", None) is None,
                        lambda lin: (lin.qkernel if quantized else lin.kernel).get_value().dtype)):
        return None  # (checked before anything is joined: joining deletes the parts)
    bias = None if first.bias is None else _joined([lin.bias.get_value() for lin in linears], keep)
    if quantized:
        zero = None if first.zero is None else _joined([lin.zero.get_value() for lin in linears], keep)
        return QuantLinear(_joined([lin.qkernel.get_value() for lin in linears], keep),
                           _joined([lin.scale.get_value() for lin in linears], keep), bias, dtype=first.dtype,
                           zero=zero, g_idx=None if maps[0] is None else maps[0].get_value())
    kernel = _joined([lin.kernel.get_value() for lin in linears], keep)
    fused = nnx.eval_shape(lambda: nnx.Linear(kernel.shape[0], kernel.shape[1], use_bias=bias is not None,
                                              dtype=first.dtype, param_dtype=kernel.dtype,
                                              precision=first.precision, rngs=nnx.Rngs(0)))
    fused.kernel = nnx.Param(kernel)
    if bias is not None:
        fused.bias = nnx.Param(bias)
    return fused


def _same_maps(maps: list) -> bool:
    """Whether every linear has an act-order map and they are equal (abstract ones: equal shapes)."""
    if any(m is None for m in maps):
        return False
    values = [m.get_value() for m in maps]
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in values):
        return len({(v.shape, v.dtype) for v in values}) == 1
    first = np.asarray(values[0])
    return all(np.array_equal(first, np.asarray(v)) for v in values[1:])


def fuse_refusal(model: Transformer) -> str | None:
    """Why `model`'s projections cannot be fused (None: they can): its layers are stacked for
    a scan (fuse first)."""
    if isinstance(model.layers, StackedLayers):
        return "its layers are stacked for a scan (fuse before stacking)"
    return None


def fuse_projections(model: Transformer) -> int:
    """Fuse, in place, every attention's q/k/v and every gated FFN's gate/up of `model` (see
    the module docstring); returns how many groups were fused (0 for a model fused before).
    A group whose linears differ (kind, dtype, quantization, bias) stays separate. Raises
    ConfigError where the model cannot be fused (`fuse_refusal`), unless it was fused before
    (then there is nothing left to do: a model fused, then stacked, returns 0)."""
    reason = fuse_refusal(model)
    if reason is not None:
        if is_fused(model):
            return 0
        raise ConfigError(f"projections='fused' cannot fuse this model: {reason}")
    count, keep = 0, shared_arrays(model)
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, Attention) and module.qkv_proj is None:
            fused = _fused_linear([getattr(module, n) for n in Attention.QKV], keep)
            if fused is not None:
                module.qkv_proj = fused
                module.q_proj = module.k_proj = module.v_proj = None
                count += 1
        elif isinstance(module, DenseFFN) and module.gate_proj is not None and module.gate_up_proj is None:
            fused = _fused_linear([module.gate_proj, module.up_proj], keep)
            if fused is not None:
                module.gate_up_proj = fused
                module.gate_proj = module.up_proj = None
                count += 1
    return count


def is_fused(model) -> bool:
    """Whether any projection of `model` is fused."""
    return any(getattr(m, "qkv_proj", None) is not None or getattr(m, "gate_up_proj", None) is not None
               for _, m in nnx.iter_modules(model))


def layout_refusal(model) -> str | None:
    """Why `model` is no longer in its checkpoint's layout, as the JAX executor can leave it in
    place (None: it is): projections fused, layers stacked for a scan, weights quantized at
    load. Code that walks a model's modules by the checkpoint's names (the LiteRT export, the
    NPU calibration) refuses such a model with this reason."""
    reasons = []
    if is_fused(model):
        reasons.append("its projections are fused (projections='fused')")
    if isinstance(getattr(model, "layers", None), StackedLayers):
        reasons.append("its layers are stacked for a scan (layers='scan')")
    if getattr(model, "quant", None) is not None:
        reasons.append(f"its weights are quantized for the JAX executor (quant={model.quant!r})")
    return "; ".join(reasons) or None


def split_fused_params(params: dict, config) -> dict:
    """`params` (flat dotted names, per layer) with each fused parameter replaced by the
    parameters of the projections it holds, named as before fusion: what `get_params` returns
    for a fused model."""
    widths = {"qkv_proj": (config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim,
                           config.n_kv_heads * config.head_dim)}
    out = {}
    for name, value in params.items():
        m = _FUSED_NAME.match(name)
        if m is None:
            out[name] = value
            continue
        fused, parts = m["fused"], _PARTS[m["fused"]]
        cols = widths.get(fused) or (value.shape[-1] // 2,) * 2
        start = 0
        for part, width in zip(parts, cols):  # (an act-order map [in] is each part's, whole)
            out[f"{m['owner']}.{part}.{m['leaf']}"] = value if m["leaf"] == "g_idx" else value[..., start:start + width]
            start += width
    return out


def choose_projections(projections: str | None, default: str = "separate") -> str:
    """How the JAX executor holds a model's projections: `projections`, else
    `$DLM_JAX_PROJECTIONS`, else `default` (ConfigError naming the source for another value)."""
    chosen = projections or os.environ.get(PROJECTIONS_ENV) or default
    if chosen not in PROJECTIONS:
        source = f"projections={projections!r}" if projections else f"{PROJECTIONS_ENV}={chosen!r}"
        raise ConfigError(f"{source}: expected one of {', '.join(PROJECTIONS)}")
    return chosen

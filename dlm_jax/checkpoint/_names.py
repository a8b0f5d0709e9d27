"""Tensor naming schemes: dlm-jax parameter names <-> a checkpoint family's tensor names.

dlm-jax names (see `dlm_jax.models.get_params`) are dotted paths such as
`layers.3.attn.q_proj.kernel`. Dense kernels are stored [in, out] here and [out, in] in HF
checkpoints; stacked expert tensors `layers.i.ffn.{gate,up,down}` [E, in, out] are one tensor
per expert there. A fused checkpoint tensor (LLaDA2.0's `query_key_value`) stacks the [out, in]
tensors of several parameters along `out`: its parts are named `{fused}#{k}` here and are row
blocks of it, so each is a contiguous byte range of its file (`NameScheme.split` / `join`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import TypeVar

import numpy as np

from dlm_jax._errors import CheckpointError
from dlm_jax.checkpoint._safetensors import TensorInfo

ArrayT = TypeVar("ArrayT")

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
EXPERT_KEYS = ("ffn.gate", "ffn.up", "ffn.down")
# A weight-only quantized kernel and its per-output-channel scales, beside the float kernel's name.
QKERNEL_SUFFIX = ".qkernel"
SCALE_SUFFIX = ".scale"
ZERO_SUFFIX = ".zero"  # uint4's zero points, beside its scales
_SIDES = ("scale", "zero", "g_idx")  # (g_idx: an act-order mode's map of input rows to groups)


def _quant_scale_of(suffix: str) -> tuple[str, str] | None:
    """(the layer parameter whose scales, zero points or row-to-group map the layer parameter
    `suffix` (after `layers.i.`) holds, which: "scale", "zero" or "g_idx") if it is one: `attn.q_proj.scale` ->
    (`attn.q_proj.kernel`, "scale"), `ffn.gate_zero` -> (`ffn.gate`, "zero")."""
    for side in _SIDES:
        if suffix.endswith(f".{side}"):
            return suffix[:-len(side) - 1] + ".kernel", side
        if suffix.endswith(f"_{side}") and suffix[:-len(side) - 1] in EXPERT_KEYS:
            return suffix[:-len(side) - 1], side
    return None


def is_zero_points(name: str) -> bool:
    """Whether parameter `name` holds uint4's zero points (`X.zero`, `ffn.gate_zero`): int8, but
    no quantized kernel."""
    return name.endswith(ZERO_SUFFIX) or any(name.endswith(f"{k}_zero") for k in EXPERT_KEYS)


@dataclasses.dataclass(frozen=True)
class NameScheme:
    """How one checkpoint family names each parameter.

    top: dlm-jax name -> checkpoint name for parameters outside the layers.
    layer_prefix: prefix of every layer tensor, with `{i}` for the layer index.
    layer: dlm-jax suffix (after `layers.i.`) -> checkpoint suffix.
    experts: stacked expert suffix -> per-expert checkpoint suffix with `{e}`.
    ignorable: regexes of checkpoint tensors that carry no parameter (e.g. RoPE buffers).
    A `layer` value `{fused}#{k}` names row block k of the fused checkpoint tensor `{fused}`.
    """

    top: Mapping[str, str]
    layer_prefix: str
    layer: Mapping[str, str]
    experts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ignorable: tuple[str, ...] = (r".*rotary_emb\.inv_freq$",)

    def sources(self, name: str, shape: tuple[int, ...], *, quantized: bool = False,
                qsuffix: str = QKERNEL_SUFFIX) -> list[str]:
        """Checkpoint tensor names that make up the dlm-jax parameter `name` of `shape`.

        A weight-only quantized model (`dlm_jax.models.quant`) stores each quantized kernel
        under the names of the float kernel it stands for, with `QKERNEL_SUFFIX` (`quantized`:
        the parameter holds int8 / float8 weights: `X.qkernel` or the experts' `ffn.gate`),
        and its float32 scales [O] or grouped [G, O] (one per expert) with `SCALE_SUFFIX`
        (`X.scale` beside `X.qkernel`, `ffn.gate_scale`). A pre-quantized Hugging Face checkpoint
        stores the quantized kernel under the float kernel's own name (`qsuffix=""`)."""
        if quantized:
            base = name[:-len(".qkernel")] + ".kernel" if name.endswith(".qkernel") else name
            return [src + qsuffix for src in self.sources(base, shape)]
        if name in self.top:
            return [self.top[name]]
        for side in _SIDES:  # a quantized head's scales or zero points
            if name.endswith(f".{side}") and name[:-len(side) - 1] + ".kernel" in self.top:
                return [self.top[name[:-len(side) - 1] + ".kernel"] + f".{side}"]
        m = _LAYER.fullmatch(name)
        if m is None:
            raise KeyError(f"parameter {name!r} has no name in this checkpoint family")
        i, suffix = m.group(1), m.group(2)
        prefix = self.layer_prefix.format(i=i)
        if suffix in self.experts:
            return [prefix + self.experts[suffix].format(e=e) for e in range(shape[0])]
        if suffix not in self.layer:
            scaled = _quant_scale_of(suffix)
            if scaled is not None and (scaled[0] in self.layer or scaled[0] in self.experts):
                return [f"{src}.{scaled[1]}" for src in self.sources(f"layers.{i}.{scaled[0]}", shape)]
            raise KeyError(f"parameter {name!r} has no name in this checkpoint family")
        return [prefix + self.layer[suffix]]

    def is_ignorable(self, tensor_name: str) -> bool:
        return any(re.fullmatch(p, tensor_name) for p in self.ignorable)

    def _fused_parts(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """Fused checkpoint name -> [(part name, part checkpoint shape)] in row order, for the
        parameters (dlm-jax name -> shape) of `shapes`."""
        parts: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
        for name, shape in shapes.items():
            m = _LAYER.fullmatch(name)
            if m is None:
                continue
            suffix = m.group(2).removesuffix(QKERNEL_SUFFIX) + (".kernel" if name.endswith(QKERNEL_SUFFIX) else "")
            if "#" not in self.layer.get(suffix, ""):
                continue
            src = self.sources(f"layers.{m.group(1)}.{suffix}", shape)[0]  # (a quantized kernel's: the float one's)
            fused, k = src.rsplit("#", 1)
            parts.setdefault(fused, []).append((int(k), src, checkpoint_shape(name, shape)))
        return {f: [(src, shp) for _, src, shp in sorted(p)] for f, p in parts.items()}

    def split(self, infos: Mapping[str, TensorInfo],
              shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorInfo]:
        """`infos` (checkpoint name -> location) with each fused tensor replaced by its parts,
        each the byte range of its row block; part shapes from the parameters' `shapes`."""
        out = dict(infos)
        for fused, parts in self._fused_parts(shapes).items():
            info = out.pop(fused, None)
            if info is None:
                continue  # reported missing, part by part
            want = (sum(s[0] for _, s in parts), *parts[0][1][1:])
            if info.shape != want:
                raise CheckpointError(f"{info.path}: tensor {fused!r} has shape {info.shape}, "
                                      f"expected {want} for this config")
            begin = info.begin
            for src, shape in parts:
                nbytes = int(np.prod(shape)) * info.dtype.itemsize
                out[src] = TensorInfo(info.path, src, info.dtype, shape, begin, begin + nbytes)
                begin += nbytes
        return out

    def join(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Checkpoint tensors with the parts `{fused}#{k}` concatenated into their fused tensor."""
        out: dict[str, np.ndarray] = {}
        parts: dict[str, list[tuple[int, np.ndarray]]] = {}
        for name, value in tensors.items():
            if "#" in name:
                fused, k = name.rsplit("#", 1)
                parts.setdefault(fused, []).append((int(k), value))
            else:
                out[name] = value
        for fused, blocks in parts.items():
            out[fused] = np.concatenate([v for _, v in sorted(blocks, key=lambda b: b[0])])
        return out


def _is_expert(name: str) -> bool:
    m = _LAYER.fullmatch(name)
    return m is not None and m.group(2) in EXPERT_KEYS


def _is_expert_scale(name: str) -> bool:
    m = _LAYER.fullmatch(name)
    return m is not None and m.group(2) in tuple(f"{k}_{side}" for k in EXPERT_KEYS for side in _SIDES)


_KERNELS = (".kernel", ".qkernel")


def to_checkpoint(name: str, value: np.ndarray) -> list[np.ndarray]:
    """One dlm-jax parameter -> the checkpoint tensors (in `sources` order)."""
    if _is_expert(name):
        return [np.ascontiguousarray(value[e].T) for e in range(value.shape[0])]
    if _is_expert_scale(name):
        return [np.ascontiguousarray(value[e]) for e in range(value.shape[0])]
    if name.endswith(_KERNELS):
        return [np.ascontiguousarray(value.T)]
    return [value]


# How the checkpoint tensors of a parameter become its array (`layout`, `from_layout`).
EXPERTS, STACKED, KERNEL, PLAIN = "experts", "stacked", "kernel", "plain"


def layout(name: str) -> str:
    """EXPERTS: one [out, in] tensor per expert, stacked then transposed to [E, in, out];
    STACKED: one tensor per expert (a quantized expert kernel's scales [out] or [groups, out]), stacked;
    KERNEL: one [out, in] tensor, transposed; PLAIN: one tensor, as stored."""
    if _is_expert(name):
        return EXPERTS
    if _is_expert_scale(name):
        return STACKED
    return KERNEL if name.endswith(_KERNELS) else PLAIN


def from_layout(kind: str, x: ArrayT) -> ArrayT:
    """The parameter from its checkpoint tensors `x` ([E, out, in] stacked for EXPERTS, else
    the one tensor); a NumPy view or a traced JAX array alike (no copy made here)."""
    if kind == EXPERTS:
        return x.swapaxes(1, 2)
    return x.T if kind == KERNEL else x


def from_checkpoint(name: str, tensors: list[np.ndarray]) -> np.ndarray:
    """The checkpoint tensors of one parameter (in `sources` order) -> the dlm-jax array."""
    kind = layout(name)
    stacked = np.stack(tensors) if kind in (EXPERTS, STACKED) else tensors[0]
    if kind == STACKED:
        return stacked
    return stacked if kind == PLAIN else np.ascontiguousarray(from_layout(kind, stacked))


def checkpoint_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of each checkpoint tensor of parameter `name` whose dlm-jax shape is `shape`."""
    if _is_expert(name):
        return (shape[2], shape[1])
    if _is_expert_scale(name):
        return tuple(shape[1:])  # [O], or [G, O] grouped
    if name.endswith(_KERNELS):
        return tuple(reversed(shape))
    return tuple(shape)


def iter_sources(scheme: NameScheme, shapes: Mapping[str, tuple[int, ...]], *,
                 quantized: frozenset[str] = frozenset(),
                 qsuffix: str = QKERNEL_SUFFIX) -> Iterator[tuple[str, list[str]]]:
    """(name, its checkpoint tensor names) for every parameter of `shapes`; those named in
    `quantized` hold int8 / float8 weights (`NameScheme.sources`)."""
    for name, shape in shapes.items():
        yield name, scheme.sources(name, tuple(shape), quantized=name in quantized, qsuffix=qsuffix)


# -- the schemes ----------------------------------------------------------------------------

_HF_LAYER = {
    "attn_norm.scale": "input_layernorm.weight",
    "attn.q_proj.kernel": "self_attn.q_proj.weight",
    "attn.q_proj.bias": "self_attn.q_proj.bias",
    "attn.k_proj.kernel": "self_attn.k_proj.weight",
    "attn.k_proj.bias": "self_attn.k_proj.bias",
    "attn.v_proj.kernel": "self_attn.v_proj.weight",
    "attn.v_proj.bias": "self_attn.v_proj.bias",
    "attn.o_proj.kernel": "self_attn.o_proj.weight",
    "attn.q_norm.scale": "self_attn.q_norm.weight",
    "attn.k_norm.scale": "self_attn.k_norm.weight",
    "ffn_norm.scale": "post_attention_layernorm.weight",
    "ffn.gate_proj.kernel": "mlp.gate_proj.weight",
    "ffn.up_proj.kernel": "mlp.up_proj.weight",
    "ffn.down_proj.kernel": "mlp.down_proj.weight",
    "ffn.router.kernel": "mlp.gate.weight",
    "ffn.expert_bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared.gate_proj.kernel": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared.up_proj.kernel": "mlp.shared_experts.up_proj.weight",
    "ffn.shared.down_proj.kernel": "mlp.shared_experts.down_proj.weight",
}

HF_SCHEME = NameScheme(
    top={"embed.embedding": "model.embed_tokens.weight", "final_norm.scale": "model.norm.weight",
         "lm_head.kernel": "lm_head.weight"},
    layer_prefix="model.layers.{i}.",
    layer=_HF_LAYER,
    experts={"ffn.gate": "mlp.experts.{e}.gate_proj.weight",
             "ffn.up": "mlp.experts.{e}.up_proj.weight",
             "ffn.down": "mlp.experts.{e}.down_proj.weight"},
)

# LLaDA's layout (docs/checkpoints.md, "The LLaDA layout")
LLADA_SCHEME = NameScheme(
    top={"embed.embedding": "model.transformer.wte.weight",
         "final_norm.scale": "model.transformer.ln_f.weight",
         "lm_head.kernel": "model.transformer.ff_out.weight"},
    layer_prefix="model.transformer.blocks.{i}.",
    layer={
        "attn_norm.scale": "attn_norm.weight",
        "attn.q_proj.kernel": "q_proj.weight", "attn.q_proj.bias": "q_proj.bias",
        "attn.k_proj.kernel": "k_proj.weight", "attn.k_proj.bias": "k_proj.bias",
        "attn.v_proj.kernel": "v_proj.weight", "attn.v_proj.bias": "v_proj.bias",
        "attn.o_proj.kernel": "attn_out.weight",
        "ffn_norm.scale": "ff_norm.weight",
        "ffn.gate_proj.kernel": "ff_proj.weight",
        "ffn.up_proj.kernel": "up_proj.weight",
        "ffn.down_proj.kernel": "ff_out.weight",
    },
)

# LLaDA2.0 (`llada2_moe`, see `_families`): q, k, v are row blocks of one fused projection.
_QKV = "attention.query_key_value.weight"
LLADA2_SCHEME = NameScheme(
    top={"embed.embedding": "model.word_embeddings.weight", "final_norm.scale": "model.norm.weight",
         "lm_head.kernel": "lm_head.weight"},
    layer_prefix="model.layers.{i}.",
    layer={
        "attn_norm.scale": "input_layernorm.weight",
        "attn.q_proj.kernel": f"{_QKV}#0", "attn.k_proj.kernel": f"{_QKV}#1",
        "attn.v_proj.kernel": f"{_QKV}#2",
        "attn.q_norm.scale": "attention.query_layernorm.weight",
        "attn.k_norm.scale": "attention.key_layernorm.weight",
        "attn.o_proj.kernel": "attention.dense.weight",
        "ffn_norm.scale": "post_attention_layernorm.weight",
        "ffn.gate_proj.kernel": "mlp.gate_proj.weight",
        "ffn.up_proj.kernel": "mlp.up_proj.weight",
        "ffn.down_proj.kernel": "mlp.down_proj.weight",
        "ffn.router.kernel": "mlp.gate.weight",
        "ffn.expert_bias": "mlp.gate.expert_bias",
        "ffn.shared.gate_proj.kernel": "mlp.shared_experts.gate_proj.weight",
        "ffn.shared.up_proj.kernel": "mlp.shared_experts.up_proj.weight",
        "ffn.shared.down_proj.kernel": "mlp.shared_experts.down_proj.weight",
    },
    experts=HF_SCHEME.experts,
)

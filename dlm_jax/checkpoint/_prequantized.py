"""Pre-quantized Hugging Face checkpoints, read as dlm-jax's weight-only int8 / int4 / fp8
(`dlm_jax.models.quant`): fine-grained FP8, compressed-tensors, AutoAWQ and GPTQ.

Four layouts, each named by config.json's `quantization_config`:

- **Fine-grained FP8** (`quant_method: "fp8"`: transformers' `FineGrainedFP8Config`, DeepSeek-V3,
  the "-FP8" releases of Qwen3). Each quantized linear's weight [out, in] is float8_e4m3fn
  under the float weight's own name, beside `<name>_scale_inv`: float32 scales, one per block
  of `weight_block_size` = [bo, bi] ([128, 128] where the key is absent), shaped
  [ceil(out / bo), ceil(in / bi)], so that `w[o, i] = q[o, i] * scale_inv[o // bo, i // bi]`.
  With `weight_block_size: null`, one scale per tensor.
- **compressed-tensors** (`quant_method: "compressed-tensors"`: llm-compressor's output, the
  "-FP8-dynamic" / "-W8A16" / "-W8A8" releases vLLM serves). Its `config_groups` give the
  weights' `num_bits`, `type` (int / float), `strategy` and the storage `format`:
  `float-quantized` (float8_e4m3fn under the weight's name), `int-quantized` /
  `naive-quantized` (int8 under the weight's name) or `pack-quantized` (int8 values plus 128,
  packed four to an int32 little-endian, as `<name>_packed` [out, in / 4] beside
  `<name>_shape`). The scales are `<name>_scale`: one per tensor ([1]), per output channel
  ([out, 1]), per output channel and group of `group_size` input columns ([out, in / g]) or
  per block of `block_structure` [bo, bi] (as fine-grained FP8's). Asymmetric 4-bit weights
  (`symmetric: false`: llm-compressor's AWQ and "W4A16_ASYM" output) add `<name>_zero_point`, one
  per scale, so that `w = (q - zero) * scale`: packed like the weights but along the output
  rows ([ceil(out / 8), groups] int32) per channel or group, as int8 beside a tensor's or a
  block's scale. `actorder: "weight"` (alias "static", llm-compressor's GPTQ default) changed
  only the calibration order: the format is the same as without it.
- **AutoAWQ** (`quant_method: "awq"`, `version: "gemm"`: the "-AWQ" releases). Each quantized
  linear `<module>` stores `<module>.qweight` [in, out / 8] int32, eight unsigned 4-bit values to
  a word along the output columns in AWQ's order (the word's k-th nibble holds column
  `AWQ_ORDER[k]` of its eight), `<module>.scales` [in / g, out] (float16) and, with
  `zero_point: true`, `<module>.qzeros` [in / g, out / 8] packed as qweight, so that
  `w[i, o] = (q[i, o] - zero[i // g, o]) * scale[i // g, o]`; without zero points, q - 8. The
  float weight `<module>.weight` is absent.
- **GPTQ** (`quant_method: "gptq"`: AutoGPTQ's, GPTQModel's and AutoRound's `auto_gptq` output,
  the "-GPTQ-Int4" / "-Int8" releases). Each quantized linear `<module>` stores
  `<module>.qweight` [in * bits / 32, out] int32, 32 / bits unsigned values a word along the
  input rows (the first lowest), `<module>.scales` [G, out] float16 (G = in / group_size, or 1
  where `group_size` is -1), `<module>.qzeros` [G, out * bits / 32] packed along the output
  columns, each zero point minus one (`checkpoint_format: "gptq"`) or as it is ("gptq_v2"), and
  `<module>.g_idx` [in], each input row's group; `w[i, o] = (q[i, o] - zero[g, o]) * scale[g, o]`
  for g = g_idx[i]. With `sym: true` every zero point is 2^(bits - 1). GPTQModel's `dynamic`
  rules "-:<regex>" leave modules float (their tensors say so too).

dlm-jax holds each as one of its own modes: per tensor or per channel as `fp8` / `int8` (one
scale per output channel; a tensor's scale repeated), a group of g columns as `fp8-gg` /
`int8-gg` / `int4-gg`, a block [bo, bi] as `fp8-gbi` (or int) with each block's scale repeated
over its bo output channels; AutoAWQ's as `uint4-gg` (with zero points) or `int4-gg`; GPTQ's as
`int4-gg` (4 bits, symmetric), `uint4-gg` (asymmetric 4-bit), `int8-gg` (8-bit) or, without
groups, `int4` / `uint4` / `int8`; act-order groups (`desc_act` without `static_groups`) with
"-act" ("int4-g128-act"), the g_idx held beside the scales (a routed expert's with it: each
expert its own map). Every one
of those is exact: a decode computes with the checkpoint's own weights, the float32 weights
transformers' own loading gives (dequantised on a CPU). The stored e4m3 /
int8 bytes load as they are (packed ones are unpacked on the host); only the scales change
shape, on the host (they are a small fraction of the weights). Asymmetric 4-bit weights load
as `uint4` / `uint4-gg`: the values minus 8 as int4 (the symmetric layout's bytes) and the zero
points minus 8 as int8 beside the scales (`dlm_jax.models.quant`), the difference unchanged.
AutoAWQ's and GPTQ's float16 scales become float32 exactly; transformers' float32 path through
compressed-tensors multiplies in float16 instead (1e-3 apart in a tiny model's logits).

Kernels the checkpoint keeps in float (`modules_to_not_convert`, `ignore`; the output head by
default; a Qwen3-MoE's experts, which compressed-tensors leaves float where transformers holds
them fused) stay float (`dlm_jax.checkpoint._io._prequantized_float`, `quantize(keep=...)`); a
weight stored quantized in some of its tensors and float in others is refused. Also refused,
each in one line: another quant method (bitsandbytes, HQQ, ...), fewer or more than 8 bits
(but 4-bit integers: pack-quantized, AutoAWQ, GPTQ), AutoAWQ's packings but "gemm", its
`group_size: -1` and llm-awq's checkpoints, GPTQ repacked for a kernel ("marlin", ...) or with
`dynamic` rules that change a module's bits, e5m2, asymmetric 8-bit weights (dlm-jax holds
zero points for 4-bit weights only), compressed-tensors' activation-ordered groups
(`actorder: "group"`), a GPTQ `g_idx` other than row // g without `desc_act`, static
activation scales, ue8m0 scales, FP4 experts, several weight schemes in one model, sparsity
and transforms, quantized embeddings, and an input width
that is neither a multiple of the group nor at most it.

Activations: the GPU kernels these formats were made for also quantize the activations
("dynamic", per token or group); dlm-jax keeps them in the model's dtype (weight-only), as
transformers' CPU path does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from dlm_jax._config import ACT_ORDER, ZERO_OFFSET, act_order
from dlm_jax._errors import CheckpointError, ConfigError

DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config.weight_block_size

# fine-grained FP8's quantization_config keys that change the computation, with the values
# dlm-jax computes.
_FP8_SUPPORTED: dict[str, list[Any]] = {
    "fmt": [None, "e4m3"],
    "activation_scheme": [None, "dynamic"],
    "scale_fmt": [None, "float"],
    "expert_dtype": [None, "fp8"],
    "modules_to_convert": [None, []],
}
# compressed-tensors' storage formats dlm-jax reads: format -> (weight type, packed)
_CT_FORMATS = {"float-quantized": ("float", False), "int-quantized": ("int", False),
               "naive-quantized": ("int", False), "pack-quantized": ("int", True)}
_CT_STRATEGIES = ("tensor", "channel", "group", "block")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a pre-quantized checkpoint stores its quantized kernels.

    mode: the `dlm_jax.models.quant` mode that holds them exactly.
    strategy: "tensor", "channel", "group" or "block": what one scale covers.
    block: (bo, bi) output rows and input columns of one scale ("block"), or (1, g) ("group").
    weight_suffix: appended to the float weight's name for the stored weight ("_packed").
    scale_suffix: appended to the float weight's name for its scales.
    packed: int8 values stored four to an int32, or 4-bit ones eight (compressed-tensors'
      pack-quantized).
    bits: the stored weights' bits (8, or 4: held as int4, with zero points beside where uint4).
    zero_suffix: appended to the float weight's name for its zero points (asymmetric
      weights), "" for symmetric ones.
    packing: "awq" (AutoAWQ), "gptq" or "gptq_v2" (GPTQ's checkpoint formats): tensors named
      after the module (`name`) and packed that format's way; "" for the others.
    middle_zeros: zero points stored, each the middle of the stored range (GPTQ's `sym: true`):
      `q - zero` fits the stored bits, held as int4 (4 bits) or int8 (8 bits).
    """

    mode: str
    strategy: str
    block: tuple[int, int] | None
    scale_suffix: str
    weight_suffix: str = ""
    packed: bool = False
    bits: int = 8
    zero_suffix: str = ""
    packing: str = ""
    middle_zeros: bool = False

    @property
    def roles(self) -> tuple[str, ...]:
        """The tensors a quantized weight is stored in, besides the weight itself where it is
        not packed (`name`'s roles)."""
        return (("scale",) + (("weight",) + (() if self.packing else ("shape",)) if self.packed else ())
                + (("zero",) if self.zero_suffix else ()) + (("g_idx",) if self.packing.startswith("gptq") else ()))

    def describe(self) -> str:
        """One line saying how the checkpoint stores its quantized weights and how dlm-jax holds
        them ("AutoAWQ (gemm): 4-bit integers with zero points, a scale per group of 128 input
        columns; held as uint4-g128")."""
        fp8 = self.mode.startswith("fp8")
        source = ({"awq": "AutoAWQ (gemm)", "gptq": "GPTQ", "gptq_v2": "GPTQ (v2)"}.get(self.packing)
                  or ("fine-grained FP8" if self.scale_suffix == "_scale_inv"
                      else "compressed-tensors " + ("pack-quantized" if self.packed else "float-quantized" if fp8
                                                    else "int-quantized")))
        zero = bool(self.zero_suffix) and not self.middle_zeros
        per = {"tensor": "tensor", "channel": "output channel",
               "group": f"group of {self.block[1] if self.block else 0} input columns"
                        + (" in act order (a group map, g_idx)" if act_order(self.mode) else ""),
               "block": f"block of {' x '.join(map(str, self.block or ()))}"}[self.strategy]
        return (f"{source}: {self.bits}-bit {'floats (e4m3)' if fp8 else 'integers'}"
                f"{' with zero points' if zero else ''}, a scale per {per}; held as {self.mode}")

    def name(self, base: str, role: str) -> str:
        """The tensor holding `role` ("weight", "scale", "zero", "shape") of the quantized weight
        whose float weight is named `base` ("model.layers.0.mlp.up_proj.weight")."""
        if self.packing:
            return base.removesuffix(".weight") + {"weight": ".qweight", "scale": ".scales", "zero": ".qzeros",
                                                   "g_idx": ".g_idx"}[role]
        return base + {"weight": self.weight_suffix, "scale": self.scale_suffix, "zero": self.zero_suffix,
                       "shape": "_shape"}[role]


def layout(data: dict[str, Any], source: str) -> Layout | None:
    """The pre-quantized layout config.json `data` declares (`quantization_config`), None for a
    float checkpoint; a ConfigError names the key of one dlm-jax cannot read."""
    qc = data.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: quantization_config must be an object, not {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_layout(qc, source)
    if method == "compressed-tensors":
        return _compressed_tensors_layout(qc, source)
    if method == "awq":
        return _awq_layout(qc, source)
    if method == "gptq":
        return _gptq_layout(qc, source)
    raise ConfigError(f"{source}: quantization_config.quant_method={method!r} is not supported: dlm-jax reads "
                      f"fine-grained FP8 ('fp8'), compressed-tensors (8-bit, 4-bit integer), AutoAWQ ('awq') and "
                      f"GPTQ ('gptq') checkpoints; load a float checkpoint with quant='int8', 'fp8' or 'int4-g128' "
                      f"instead")


def _gptq_layout(qc: dict[str, Any], source: str) -> Layout:
    key = f"{source}: quantization_config"
    bits, group, sym = qc.get("bits", 4), qc.get("group_size", 128), qc.get("sym", True)
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"  # (transformers' key, GPTQModel's)
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ConfigError(f"{key}.bits={bits!r}: GPTQ checkpoints of 4 or 8 bits are supported")
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"{key}: format {fmt!r} is not supported: dlm-jax reads GPTQ's own packing "
                          f"('gptq', 'gptq_v2'), not a kernel's repacking ('marlin', 'bitblas', ...)")
    if not isinstance(sym, bool):
        raise ConfigError(f"{key}.sym={sym!r}: expected true or false")
    if not sym and bits == 8:
        raise ConfigError(f"{key}: asymmetric 8-bit weights (sym: false) are not supported: dlm-jax holds zero "
                          f"points for 4-bit weights only (uint4)")
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise ConfigError(f"{key}.dynamic={dynamic!r}: expected an object")
    for rule, change in dynamic.items():  # ("-:<regex>": modules left float, their tensors say so too)
        if not rule.startswith("-:") and any(change.get(k) != qc.get(k) for k in (change or {})):
            raise ConfigError(f"{key}.dynamic[{rule!r}]: per-module bits or groups are not supported "
                              f"({change}); dlm-jax holds one scheme per model (modules left out, '-:', are read)")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise ConfigError(f"{key}.pack_dtype={qc['pack_dtype']!r}: dlm-jax reads weights packed in int32 words")
    if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group >= 2):
        raise ConfigError(f"{key}.group_size={group!r}: expected -1 (a scale per output channel) or an integer of "
                          f"at least 2")
    # act-order groups (desc_act without static_groups: each input row's group in a permuted
    # g_idx) hold the map beside the scales ("-act"); with one group a column there is none
    act = ACT_ORDER if qc.get("desc_act") and not qc.get("static_groups") and group != -1 else ""
    mode = ("int4" if sym else "uint4") if bits == 4 else "int8"  # (8 bits: symmetric, q - 128)
    if group == -1:
        return Layout(mode, "channel", None, ".scales", ".qweight", True, bits, ".qzeros", fmt, sym)
    return Layout(f"{mode}-g{group}{act}", "group", (1, group), ".scales", ".qweight", True, bits, ".qzeros", fmt,
                  sym)


def _awq_layout(qc: dict[str, Any], source: str) -> Layout:
    key = f"{source}: quantization_config"
    bits, version = qc.get("bits", 4), qc.get("version", "gemm")
    if bits != 4:
        raise ConfigError(f"{key}.bits={bits!r}: AutoAWQ checkpoints of 4 bits only are supported")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ConfigError(f"{key}.version={version!r} is not supported: dlm-jax reads AutoAWQ's 'gemm' packing "
                          f"(not 'gemv', 'exllama', 'marlin' or 'ipex')")
    if qc.get("backend", "autoawq") not in (None, "autoawq"):  # (llm-awq packs its own way)
        raise ConfigError(f"{key}.backend={qc['backend']!r} is not supported: dlm-jax reads AutoAWQ's checkpoints "
                          f"('autoawq')")
    group, zero = qc.get("group_size", 128), qc.get("zero_point", True)
    if not isinstance(zero, bool):
        raise ConfigError(f"{key}.zero_point={zero!r}: expected true or false")
    fmt, zero_suffix = ("uint4", ".qzeros") if zero else ("int4", "")
    if not isinstance(group, int) or isinstance(group, bool) or group < 2:  # (-1, one group a column: refused)
        raise ConfigError(f"{key}.group_size={group!r}: expected an integer of at least 2")
    return Layout(f"{fmt}-g{group}", "group", (1, group), ".scales", ".qweight", True, 4, zero_suffix, packing="awq")


def _fp8_layout(qc: dict[str, Any], source: str) -> Layout:
    for key, allowed in _FP8_SUPPORTED.items():
        if qc.get(key) not in allowed:
            raise ConfigError(f"{source}: quantization_config.{key}={qc.get(key)!r} is not supported "
                              f"(supported: {[a for a in allowed if a is not None]})")
    block = qc.get("weight_block_size", DEFAULT_BLOCK)
    if block is None:
        return Layout("fp8", "tensor", None, "_scale_inv")
    bo, bi = _pair(block, f"{source}: quantization_config.weight_block_size")
    return Layout(f"fp8-g{bi}", "block", (bo, bi), "_scale_inv")


def _pair(block: Any, what: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{what}={block!r}: expected two positive integers")
    if block[1] < 2:
        raise ConfigError(f"{what}={list(block)}: dlm-jax's groups hold at least 2 input columns")
    return int(block[0]), int(block[1])


def _compressed_tensors_layout(qc: dict[str, Any], source: str) -> Layout:
    key = f"{source}: quantization_config"
    for name in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(name):
            raise ConfigError(f"{key}.{name} is set: dlm-jax reads quantized weights only, without "
                              f"{name.split('_')[0].replace('kv', 'K/V cache quantization')}")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ConfigError(f"{key}.quantization_status={status!r}: dlm-jax reads compressed checkpoints only")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{key}.config_groups: expected an object of one or more schemes")
    schemes = set()
    for name, group in groups.items():
        where = f"{key}.config_groups.{name}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise ConfigError(f"{where}: expected an object with 'weights'")
        for act in ("input_activations", "output_activations"):
            args = group.get(act)
            if args is not None and (act == "output_activations" or args.get("dynamic") is not True):
                raise ConfigError(f"{where}.{act}: static activation quantization is not supported (dlm-jax "
                                  f"quantizes weights only; dynamic input activations are computed unquantized)")
        w = group["weights"]
        fmt = group.get("format") or qc.get("format")
        schemes.add((fmt, w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("group_size"),
                     tuple(w.get("block_structure") or ()), w.get("symmetric"), w.get("dynamic"),
                     w.get("actorder") or None))
    if len(schemes) > 1:
        raise ConfigError(f"{key}.config_groups: {len(schemes)} different weight schemes; dlm-jax holds one per "
                          f"model")
    fmt, bits, wtype, strategy, group, block, symmetric, dynamic, actorder = schemes.pop()
    where = f"{key}.config_groups"
    if fmt not in _CT_FORMATS:
        raise ConfigError(f"{where}: format {fmt!r} is not supported (supported: {', '.join(_CT_FORMATS)})")
    if bits not in (4, 8) or (bits == 4 and (fmt != "pack-quantized" or wtype != "int")):
        raise ConfigError(f"{where}: {bits}-bit weights{'' if bits != 4 else f' in format {fmt!r}'} are not "
                          f"supported: the JAX executor holds 8-bit int8 / fp8 weights and 4-bit int4 ones "
                          f"(pack-quantized)")
    if wtype != _CT_FORMATS[fmt][0]:
        raise ConfigError(f"{where}: weights of type {wtype!r} in format {fmt!r} are not supported")
    if symmetric is not True and bits != 4:
        raise ConfigError(f"{where}: asymmetric {bits}-bit weights (zero points) are not supported: dlm-jax "
                          f"holds zero points for 4-bit weights only (they load as uint4)")
    if dynamic:
        raise ConfigError(f"{where}: dynamic weight scales are not supported")
    if actorder not in (None, "weight", "static"):  # ("weight": the order of calibration only; the format is unchanged)
        raise ConfigError(f"{where}: activation-ordered groups (actorder={actorder!r}: a group index per input "
                          f"column) are not supported; actorder 'weight' is")
    if strategy not in _CT_STRATEGIES:
        raise ConfigError(f"{where}: weight strategy {strategy!r} is not supported "
                          f"(supported: {', '.join(_CT_STRATEGIES)})")
    zero = "" if symmetric is True else "_zero_point"
    qfmt = "fp8" if wtype == "float" else ("uint4" if zero else "int4") if bits == 4 else "int8"
    packed = _CT_FORMATS[fmt][1]
    suffix = "_packed" if packed else ""
    if strategy in ("tensor", "channel"):
        return Layout(qfmt, strategy, None, "_scale", suffix, packed, bits, zero)
    if strategy == "group":
        if not isinstance(group, int) or isinstance(group, bool) or group < 2:
            raise ConfigError(f"{where}: group_size={group!r}: expected an integer of at least 2")
        return Layout(f"{qfmt}-g{group}", "group", (1, group), "_scale", suffix, packed, bits, zero)
    bo, bi = _pair(list(block) or None, f"{where}: block_structure")
    return Layout(f"{qfmt}-g{bi}", "block", (bo, bi), "_scale", suffix, packed, bits, zero)


def expand_scales(scale: np.ndarray, *, out: int, inp: int, layout: Layout, rows: slice,
                  what: str) -> np.ndarray:
    """The `dlm_jax.models.quant` scales of rows `rows` of a checkpoint weight [out, inp] whose
    scale tensor is `scale`: float32 [G, len(rows)] for a grouped mode (G = ceil(inp / bi)), or
    [len(rows)] per output channel. `what` names the tensor in errors."""
    s = np.asarray(scale).astype(np.float32)
    if layout.strategy == "tensor":
        if s.size != 1:
            raise CheckpointError(f"{what}: shape {tuple(s.shape)}, expected one scale per tensor")
        return np.full((len(range(out)[rows]),), s.reshape(()), np.float32)
    if layout.strategy == "channel":
        if s.shape not in ((out,), (out, 1)):
            raise CheckpointError(f"{what}: shape {tuple(s.shape)}, expected ({out}, 1): one scale per output channel")
        return np.ascontiguousarray(s.reshape(out)[rows])
    bo, bi = layout.block
    want = (-(-out // bo), -(-inp // bi))
    if tuple(s.shape) != want:
        raise CheckpointError(f"{what}: shape {tuple(s.shape)}, expected {want} ("
                              + (f"blocks of {bo} x {bi}" if layout.strategy == "block" else f"groups of {bi}")
                              + f" over the weight's [{out}, {inp}])")
    if inp > bi and inp % bi:
        raise CheckpointError(f"{what}: the weight's {inp} input columns are not a multiple of {bi}; dlm-jax's "
                              f"groups of input rows cannot hold the last, partial one")
    return np.ascontiguousarray(np.repeat(s, bo, axis=0)[:out][rows].T)


class Read(NamedTuple):
    """One quantized weight's rows as `read_weight` gives them."""

    scales: np.ndarray  # as `expand_scales` gives them
    kernel: np.ndarray | None  # stored packed: int8 [rows, in] (4-bit: q - 8, held as int4 by the caller)
    zero: np.ndarray | None = None  # a uint4 layout's zero points minus 8, int8 shaped as the scales
    g_idx: np.ndarray | None = None  # an act-order layout's group of each input row, int32 [in]


def read_weight(tensors: Mapping[str, Any], base: str, *, layout: Layout, rows: slice, where: str) -> Read:
    """Rows `rows` of the quantized weight whose float weight is named `base`, from `tensors`
    (name -> `TensorInfo`): its scales, its kernel where stored packed (else None: the stored
    weight loads as it is), zero points and row-to-group map where the layout has them (`Read`).
    `where` (the checkpoint) begins each error."""
    def what(role: str) -> str:
        return f"{where}: tensor {layout.name(base, role)!r}"

    if layout.packing:
        g_idx = None
        if layout.packing.startswith("gptq"):
            q, scale, zero, g_idx = _gptq_weight(*(tensors[layout.name(base, role)].read()
                                                   for role in ("weight", "scale", "zero", "g_idx")),
                                                 layout=layout, what=what)
        else:
            q, scale, zero = _awq_weight(tensors[layout.name(base, "weight")].read(),
                                         tensors[layout.name(base, "scale")].read(),
                                         None if not layout.zero_suffix else tensors[layout.name(base, "zero")].read(),
                                         layout=layout, what=what)
        out, inp = q.shape
        return Read(expand_scales(scale, out=out, inp=inp, layout=layout, rows=rows, what=what("scale")), q[rows],
                    None if zero is None else
                    expand_scales(zero, out=out, inp=inp, layout=layout, rows=rows, what=what("zero")).astype(np.int8),
                    g_idx)
    if not layout.packed:
        out, inp = tensors[base].shape
    else:
        out, inp = (int(x) for x in np.asarray(tensors[layout.name(base, "shape")].read()).reshape(-1))
    scales = expand_scales(tensors[layout.name(base, "scale")].read(), out=out, inp=inp, layout=layout, rows=rows,
                           what=what("scale"))
    if not layout.packed:
        return Read(scales, None)
    q = unpack(tensors[layout.name(base, "weight")].read(), tensors[layout.name(base, "shape")].read(),
               bits=layout.bits, what=what("weight"))[rows]
    zero = None if not layout.zero_suffix else zero_points(tensors[layout.name(base, "zero")].read(), out=out,
                                                           inp=inp, layout=layout, rows=rows, what=what("zero"))
    return Read(scales, q, zero)


# AutoAWQ's order of a word's eight 4-bit columns: nibble k (bits 4k..4k+3) holds column AWQ_ORDER[k]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_unpack(packed: np.ndarray, *, what: str) -> np.ndarray:
    """The unsigned 4-bit values [rows, 8 * words] (uint8, 0 to 15) that AutoAWQ's int32
    `packed` [rows, words] holds in its order (`AWQ_ORDER`)."""
    if packed.dtype != np.int32 or packed.ndim != 2:
        raise CheckpointError(f"{what}: {packed.dtype} {tuple(packed.shape)}, expected a 2-D int32 tensor of "
                              f"packed 4-bit values")
    return _word_values(packed, 4)[..., _AWQ_COLUMNS].reshape(packed.shape[0], -1)


def _word_values(packed: np.ndarray, bits: int) -> np.ndarray:
    """The unsigned `bits`-bit values (4 or 8) of each int32 word of `packed`, [..., words, 32 /
    bits] uint8: value k holds bits k * bits to (k + 1) * bits - 1 of its word."""
    data = np.ascontiguousarray(packed, dtype="<i4").view(np.uint8).reshape(*packed.shape, 4)  # (any host order)
    if bits == 8:
        return data
    nibbles = np.empty((*packed.shape, 8), np.uint8)
    np.bitwise_and(data, 0xF, out=nibbles[..., 0::2])
    np.right_shift(data, 4, out=nibbles[..., 1::2])
    return nibbles


def _check_group_scales(scale: np.ndarray, *, groups: int, out: int, g: int, inp: int, what: str) -> None:
    if scale.shape != (groups, out):
        raise CheckpointError(f"{what}: shape {tuple(scale.shape)}, expected ({groups}, {out}): a scale per output "
                              f"column and group of {g} of the weight's {inp} input rows")


def _minus_offset(q: np.ndarray) -> np.ndarray:
    """q - 8 as int8 for unsigned 4-bit values q (uint8, overwritten): what int4 holds (the
    symmetric layouts' q - zero, their zero points all 8; uint4's q, `ZERO_OFFSET`)."""
    diff = q.view(np.int8)
    diff -= ZERO_OFFSET
    return diff


_AWQ_COLUMNS = np.argsort(AWQ_ORDER)  # column c of a word's eight is its nibble _AWQ_COLUMNS[c]


def _awq_weight(qweight: np.ndarray, scale: np.ndarray, qzeros: np.ndarray | None, *, layout: Layout,
                what) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q - 8 as int8 [out, in], scales [out, G], zero points - 8 as int8 [out, G] or None where
    the checkpoint has none, every zero point 8) of an AutoAWQ linear's tensors."""
    q = awq_unpack(qweight, what=what("weight"))  # [in, out]
    inp, out = q.shape
    g = layout.block[1]
    groups = -(-inp // g)
    _check_group_scales(scale, groups=groups, out=out, g=g, inp=inp, what=what("scale"))
    zero = None
    if qzeros is not None:
        zero = awq_unpack(qzeros, what=what("zero"))
        if zero.shape != (groups, out):
            raise CheckpointError(f"{what('zero')}: int32 {tuple(qzeros.shape)}, expected int32 ({groups}, "
                                  f"{out // 8}): zero points packed as the weight")
        zero = _minus_offset(zero).T
    # ([out, in] views: the caller's layout, transposed back there)
    return _minus_offset(q).T, np.asarray(scale).T, zero


def gptq_unpack(packed: np.ndarray, bits: int, axis: int, *, what: str) -> np.ndarray:
    """The unsigned `bits`-bit values (uint8) that GPTQ's int32 `packed` holds along `axis` (0:
    qweight [in * bits / 32, out], the input rows; 1: qzeros [groups, out * bits / 32], the output
    columns): 32 / bits values a word, the first in its lowest bits."""
    if packed.dtype != np.int32 or packed.ndim != 2:
        raise CheckpointError(f"{what}: {packed.dtype} {tuple(packed.shape)}, expected a 2-D int32 tensor of "
                              f"packed {bits}-bit values")
    values = _word_values(packed, bits)
    if axis == 1:
        return values.reshape(packed.shape[0], -1)
    return values.transpose(0, 2, 1).reshape(-1, packed.shape[1])


def _gptq_weight(qweight: np.ndarray, scale: np.ndarray, qzeros: np.ndarray, g_idx: np.ndarray, *, layout: Layout,
                 what) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(the values held as int8 [out, in], scales [out, G], uint4's zero points - 8 as int8 [out, G]
    or None where symmetric, an act-order layout's g_idx as int32 [in] or None) of a GPTQ linear's
    tensors: the values q - 8 (4 bits) or q - 128 (8 bits, symmetric: the layout refuses others);
    qweight [in * bits / 32, out], scales [G, out], qzeros [G, out * bits / 32] (the zero points
    minus one in the format 'gptq', as they are in 'gptq_v2') and g_idx [in] (each input row's
    group: row // g without act-order; any group of the G with it)."""
    q = gptq_unpack(qweight, layout.bits, 0, what=what("weight"))  # [in, out]
    inp, out = q.shape
    g = layout.block[1] if layout.block else inp
    groups = -(-inp // g)
    _check_group_scales(scale, groups=groups, out=out, g=g, inp=inp, what=what("scale"))
    gi = np.asarray(g_idx)
    act = act_order(layout.mode)
    if act:
        if gi.shape != (inp,) or gi.dtype.kind not in "iu" or gi.min() < 0 or gi.max() >= groups:
            raise CheckpointError(f"{what('g_idx')}: {gi.dtype} {tuple(gi.shape)}, expected {inp} group indices from "
                                  f"0 to {groups - 1}, one an input row")
    elif gi.shape != (inp,) or not np.array_equal(gi, np.arange(inp) // g):
        raise CheckpointError(f"{what('g_idx')}: the input rows are not in groups of {g} in order, and the config "
                              f"does not say act-order (desc_act: true without static_groups)")
    zero = gptq_unpack(qzeros, layout.bits, 1, what=what("zero")).astype(np.int16)
    if zero.shape != (groups, out):
        raise CheckpointError(f"{what('zero')}: int32 {tuple(qzeros.shape)}, expected int32 ({groups}, "
                              f"{out * layout.bits // 32}): zero points packed along the output columns")
    if layout.packing == "gptq":
        zero += 1  # (the format stores zero - 1)
    middle = 1 << (layout.bits - 1)
    if layout.middle_zeros and (zero != middle).any():
        raise CheckpointError(f"{what('zero')}: zero points other than {middle} in a symmetric checkpoint (sym: true)")
    if layout.bits == 8:  # symmetric (the layout refuses others): q - 128, the bytes' top bit flipped
        diff = q.view(np.int8) ^ np.int8(-128)
    else:  # 4 bits: q - 8 (symmetric: q - zero itself)
        diff = _minus_offset(q)
    held_zero = None if layout.middle_zeros else (zero - ZERO_OFFSET).astype(np.int8).T  # (-8 to 8)
    # ([out, in] views: the caller's layout, transposed back there)
    return diff.T, np.asarray(scale).T, held_zero, gi.astype(np.int32) if act else None


def zero_points(zero: np.ndarray, *, out: int, inp: int, layout: Layout, rows: slice, what: str) -> np.ndarray:
    """The uint4 zero points (int8, minus 8 as `unpack` gives the weights) of rows `rows` of an
    asymmetric compressed-tensors weight [out, inp] whose zero-point tensor is `zero` (one per
    scale; packed along the output rows per channel or group, int8 per tensor or block), shaped
    as `expand_scales` gives the scales. `what` names the zero-point tensor in errors."""
    z = np.asarray(zero)
    lo, hi = -(1 << layout.bits - 1), (1 << layout.bits - 1) - 1
    if layout.strategy in ("group", "channel"):
        cols = 1 if layout.strategy == "channel" else -(-inp // layout.block[1])
        want = (-(-out * layout.bits // 32), cols)
        if z.dtype != np.int32 or z.shape != want:
            raise CheckpointError(f"{what}: {z.dtype} {tuple(z.shape)}, expected int32 {want}: {layout.bits}-bit zero "
                                  f"points packed along the {out} output rows")
        z = unpack(z.T, np.array([cols, out]), bits=layout.bits, what=what).T
    elif z.dtype != np.int8 or z.size and (z.min() < lo or z.max() > hi):
        raise CheckpointError(f"{what}: {z.dtype} from {z.min() if z.size else '-'} to {z.max() if z.size else '-'}, "
                              f"expected int8 zero points from {lo} to {hi}")
    return expand_scales(z, out=out, inp=inp, layout=layout, rows=rows, what=what).astype(np.int8)


def unpack(packed: np.ndarray, shape: np.ndarray, *, bits: int = 8, what: str) -> np.ndarray:
    """The weight [out, in], as int8, that compressed-tensors' pack-quantized `packed` [out,
    ceil(in * bits / 32)] int32 holds, checked against its stored `shape`: 8 bits, each value plus
    128 as one byte, four to a word, the first in the lowest byte; 4 bits, each value plus 8 as
    one nibble, eight to a word, the first in the lowest nibble (values from -8 to 7)."""
    out, inp = (int(x) for x in np.asarray(shape).reshape(-1))
    per = 32 // bits
    if packed.dtype != np.int32 or packed.shape != (out, -(-inp // per)):
        raise CheckpointError(f"{what}: {packed.dtype} {tuple(packed.shape)}, expected int32 "
                              f"({out}, {-(-inp // per)}) for a weight of shape ({out}, {inp})")
    data = np.ascontiguousarray(packed, dtype="<i4").view(np.uint8).reshape(out, -1)  # (any host order)
    if bits == 4:
        data = np.stack([data & 0xF, data >> 4], axis=-1).reshape(out, -1)
    return (data[:, :inp].astype(np.int16) - (1 << (bits - 1))).astype(np.int8)

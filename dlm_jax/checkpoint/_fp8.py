"""Hugging Face's fine-grained FP8 checkpoints, read as dlm-jax's weight-only fp8
(`dlm_jax.models.quant`).

A checkpoint whose config.json carries `quantization_config` with `quant_method: "fp8"` (the
layout of transformers' `FineGrainedFP8Config`, of DeepSeek-V3 and of the "-FP8" releases of
Qwen3) stores each quantized linear's weight [out, in] as float8_e4m3fn under the float
weight's own name, beside `<name>_scale_inv`: float32 scales, one per block of
`weight_block_size` = [bo, bi] ([128, 128] where the key is absent), shaped [ceil(out / bo),
ceil(in / bi)]. The weight is `w[o, i] = q[o, i] * scale_inv[o // bo, i // bi]`. With
`weight_block_size: null` there is one scale per tensor.

dlm-jax holds such a checkpoint as its own grouped fp8, `fp8-g{bi}`: one scale per output
channel and group of bi input rows (per tensor: `fp8`, one scale per output channel). Each
block's scale is repeated over its bo output channels, which is exact: a decode computes with
the checkpoint's weights, the float32 weights transformers' own dequantisation gives. The
stored e4m3 bytes load as they are; only the scales are expanded, on the host (they are
1 / (bo * bi) of the weights).

Kernels the checkpoint keeps in float (transformers' `modules_to_not_convert`, which holds the
output head by default): an untied output head stays float; any other kernel that dlm-jax
quantizes is refused. Also refused, each in one line: another quant method, e5m2, static
activation scales, ue8m0 scales, FP4 experts, quantized embeddings, and an input width that is
neither a multiple of bi nor at most bi.

Activations: transformers' GPU kernels also quantize the activations to fp8, per token and
group of bi ("dynamic"). dlm-jax keeps them in the model's dtype (weight-only), as
transformers' CPU path does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dlm_jax._errors import CheckpointError, ConfigError

SCALE_SUFFIX = "_scale_inv"  # beside the weight's own name: `...q_proj.weight_scale_inv`
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config.weight_block_size

# quantization_config keys that change the computation, with the values dlm-jax computes.
_SUPPORTED: dict[str, list[Any]] = {
    "fmt": [None, "e4m3"],
    "activation_scheme": [None, "dynamic"],
    "scale_fmt": [None, "float"],
    "expert_dtype": [None, "fp8"],
    "modules_to_convert": [None, []],
}


@dataclasses.dataclass(frozen=True)
class FP8Layout:
    """The block of one scale: (bo output rows, bi input columns), or None (one per tensor)."""

    block: tuple[int, int] | None

    @property
    def mode(self) -> str:
        """The `dlm_jax.models.quant` mode that holds it exactly."""
        return "fp8" if self.block is None else f"fp8-g{self.block[1]}"


def fp8_layout(data: dict[str, Any], source: str) -> FP8Layout | None:
    """The FP8 layout config.json `data` declares (`quantization_config`), None for a float
    checkpoint; a ConfigError names the key of one dlm-jax cannot read."""
    qc = data.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: quantization_config must be an object, not {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{source}: quantization_config.quant_method={method!r} is not supported: dlm-jax reads "
                          f"fine-grained FP8 checkpoints (quant_method 'fp8'); load a float checkpoint with "
                          f"quant='int8' or 'fp8' instead")
    for key, allowed in _SUPPORTED.items():
        if qc.get(key) not in allowed:
            raise ConfigError(f"{source}: quantization_config.{key}={qc.get(key)!r} is not supported "
                              f"(supported: {[a for a in allowed if a is not None]})")
    block = qc.get("weight_block_size", DEFAULT_BLOCK)
    if block is None:
        return FP8Layout(None)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{source}: quantization_config.weight_block_size={block!r}: expected two positive "
                          f"integers or null")
    if block[1] < 2:
        raise ConfigError(f"{source}: quantization_config.weight_block_size={list(block)}: dlm-jax's groups hold "
                          f"at least 2 input columns")
    return FP8Layout((int(block[0]), int(block[1])))


def expand_scales(scale_inv: np.ndarray, *, out: int, inp: int, layout: FP8Layout, rows: slice,
                  what: str) -> np.ndarray:
    """The `dlm_jax.models.quant` scales of rows `rows` of a checkpoint weight [out, inp] whose
    `_scale_inv` tensor is `scale_inv`: float32 [G, len(rows)] (G = ceil(inp / bi)), or
    [len(rows)] for one scale per tensor. `what` names the tensor in errors."""
    s = np.asarray(scale_inv).astype(np.float32)
    n = len(range(out)[rows])
    if layout.block is None:
        if s.size != 1:
            raise CheckpointError(f"{what}: shape {tuple(s.shape)}, expected one scale (weight_block_size null)")
        return np.full((n,), s.reshape(()), np.float32)
    bo, bi = layout.block
    want = (-(-out // bo), -(-inp // bi))
    if tuple(s.shape) != want:
        raise CheckpointError(f"{what}: shape {tuple(s.shape)}, expected {want} (blocks of {bo} x {bi} over "
                              f"the weight's [{out}, {inp}])")
    if inp > bi and inp % bi:
        raise CheckpointError(f"{what}: the weight's {inp} input columns are not a multiple of the FP8 block's "
                              f"{bi}; dlm-jax's groups of input rows cannot hold the last, partial block")
    return np.ascontiguousarray(np.repeat(s, bo, axis=0)[:out][rows].T)

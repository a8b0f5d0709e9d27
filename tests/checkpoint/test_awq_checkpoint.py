"""AutoAWQ checkpoints (config `quantization_config.quant_method: "awq"`, its GEMM packing) load
as weight-only uint4 (with zero points) or int4 (without) and compute what transformers
computes from the compressed-tensors checkpoint that compressed-tensors' own converter
(`AutoAWQConverter`) makes of the same files."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import dlm_jax
from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax.checkpoint._prequantized import AWQ_ORDER, awq_unpack

from .hf_models import build, edit_quantization_config, loaded_logits, logits, reference_logits

IDS = np.random.default_rng(0).integers(0, 96, (2, 13))
TOL = 1e-4


def _pack(u: np.ndarray) -> torch.Tensor:
    """AutoAWQ's GEMM packing of unsigned 4-bit values u [rows, cols]: eight columns a word, the
    word's k-th nibble holding column AWQ_ORDER[k] of its eight."""
    rows, cols = u.shape
    words = np.zeros((rows, cols // 8), np.uint32)
    for k, col in enumerate(AWQ_ORDER):
        words |= u[:, col::8].astype(np.uint32) << np.uint32(4 * k)
    return torch.from_numpy(words.view(np.int32))


def awq_checkpoint(dst: Path, *, kind: str = "qwen3", group: int = 16, zero: bool = True,
                   keep: list[str] | None = None) -> Path:
    """A tiny random `kind` model in AutoAWQ's layout: each projection (a Qwen3-MoE's experts
    too; not the head or the router) but the modules named in `keep` (AutoAWQ's
    `modules_to_not_convert`) quantized to 4 bits per group of `group` input rows by min-max,
    with zero points or symmetric (q + 8 stored)."""
    build(kind).save_pretrained(dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight") and not any(k in n for k in keep or ())]:
        w = np.ascontiguousarray(tensors.pop(name).double().numpy().T)  # [in, out]
        rows, cols = w.shape
        blocks = w.reshape(rows // group, group, cols)
        lo, hi = np.minimum(blocks.min(1), 0), np.maximum(blocks.max(1), 0)
        if zero:
            scale = np.maximum(hi - lo, 1e-5) / 15
            z = np.clip(np.round(-lo / scale), 0, 15)
        else:
            scale, z = np.maximum(np.maximum(-lo, hi), 1e-5) / 7, np.full(lo.shape, 8.0)
        scale = scale.astype(np.float16)
        q = np.clip(np.round(blocks / scale[:, None].astype(np.float64)) + z[:, None], 0, 15).reshape(rows, cols)
        module = name[:-len(".weight")]
        tensors[module + ".qweight"] = _pack(q.astype(np.uint8))
        tensors[module + ".scales"] = torch.from_numpy(scale)
        if zero:
            tensors[module + ".qzeros"] = _pack(z.astype(np.uint8))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": zero,
                                     "version": "gemm", "modules_to_not_convert": keep}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _converted(path: Path, dst: Path) -> np.ndarray:
    """transformers' logits of the compressed-tensors checkpoint compressed-tensors' converter
    makes of the AutoAWQ checkpoint `path`, its float16 scales cast to float32 (exactly):
    compressed-tensors' decompression multiplies in the scales' dtype, which would round each
    weight to float16 (by up to 1.5e-3 in these logits), where dlm-jax's float32 model holds
    `(q - zero) * scale` in float32."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    convert_checkpoint(path, dst, AutoAWQConverter.from_pretrained(str(path)), max_workers=1, device="cpu")
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name] = tensors[name].float()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return reference_logits(dst, IDS, quantization_config=T.CompressedTensorsConfig(run_compressed=False))


def _dequantized(path: Path, dst: Path) -> np.ndarray:
    """transformers' logits of the float checkpoint made of the AutoAWQ checkpoint `path` by
    compressed-tensors' converter and its own unpacking and dequantisation (in float32) of each
    weight: the reference where transformers cannot load the converted checkpoint (a Qwen3-MoE's
    per-expert quantized tensors, which transformers 5 holds fused)."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    convert_checkpoint(path, dst / "ct", AutoAWQConverter.from_pretrained(str(path)), max_workers=1, device="cpu")
    config = json.loads((dst / "ct" / "config.json").read_text())
    args = QuantizationArgs(**next(iter(config.pop("quantization_config")["config_groups"].values()))["weights"])
    tensors = load_file(str(dst / "ct" / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name[:-len("_packed")]
        shape = torch.Size(tensors.pop(base + "_shape").tolist())
        scale = tensors.pop(base + "_scale").float()
        zero = tensors.pop(base + "_zero_point", None)
        if zero is not None:
            zero = unpack_from_int32(zero, 4, torch.Size([shape[0], scale.shape[-1]]), packed_dim=0)
        q = unpack_from_int32(tensors.pop(name), 4, shape)
        tensors[base] = dequantize(q, scale, zero_point=zero, args=args, dtype=torch.float32).contiguous()
    (dst / "float").mkdir()
    save_file(tensors, str(dst / "float" / "model.safetensors"), metadata={"format": "pt"})
    (dst / "float" / "config.json").write_text(json.dumps(config))
    return reference_logits(dst / "float", IDS)


@pytest.mark.parametrize("kind,group,zero,mode", [
    ("qwen3", 16, True, "uint4-g16"),  # AutoAWQ's default: zero points, q - 8 held as int4, zero - 8 as int8
    ("qwen3", 16, False, "int4-g16"),  # symmetric: q - 8 fits int4
    ("qwen2", 16, True, "uint4-g16"),  # q/k/v biases stored float beside qweight (Dream's layout)
])
def test_awq_checkpoint_matches_compressed_tensors_conversion(kind, group, zero, mode, tmp_path):
    path = awq_checkpoint(tmp_path / "awq", kind=kind, group=group, zero=zero)
    ref = _converted(path, tmp_path / "ct")
    model, ours = loaded_logits(path, IDS)
    assert model.quant == mode and model.quant_float == {"lm_head"}
    q = model.layers[0].attn.q_proj
    assert str(q.qkernel[...].dtype) == "int4" and (q.zero is not None) == zero
    if zero:  # zero points minus 8: not all 0 (the weights are skewed, not symmetric)
        assert q.zero[...].dtype == jnp.int8 and q.zero[...].shape == q.scale[...].shape
        assert np.abs(np.asarray(q.zero[...])).max() > 0
    assert (model.layers[0].attn.q_proj.bias is not None) == (kind == "qwen2")
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL, diff
    assert float(np.abs(ref - logits(build(kind), IDS)).max()) > 10 * TOL  # (it is not the float model)
    if zero and kind == "qwen3":  # (the MoE test's reference, checked against transformers' own loading where it loads)
        np.testing.assert_allclose(_dequantized(path, tmp_path / "d"), ref, atol=1e-5)


@pytest.mark.parametrize("zero", [True, False])
def test_awq_moe_experts_load_quantized(zero, tmp_path):
    """A Qwen3-MoE's routed experts, one AutoAWQ linear each, stack into one quantized [E, I, O]
    array per layer; the router stays float."""
    path = awq_checkpoint(tmp_path / "awq", kind="qwen3_moe", zero=zero)
    model, ours = loaded_logits(path, IDS)
    assert model.quant == ("uint4-g16" if zero else "int4-g16") and model.quant_float == {"lm_head"}
    experts = model.layers[1].ffn
    assert str(experts.gate[...].dtype) == "int4" and experts.gate_scale[...].shape == (4, 2, 16)
    assert (getattr(experts, "gate_zero", None) is not None) == zero
    if zero:
        assert experts.gate_zero[...].shape == (4, 2, 16) and experts.gate_zero[...].dtype == jnp.int8
    ref = _dequantized(path, tmp_path)
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL, diff


def test_modules_awq_keeps_float_stay_float(tmp_path, capsys):
    from dlm_jax.frontends.cli import main
    from dlm_jax.models.quant import weight_bytes

    path = awq_checkpoint(tmp_path / "awq", keep=["layers.1.mlp"])
    model, ours = loaded_logits(path, IDS)
    float_ = {"lm_head", "layers.1.ffn.gate_proj", "layers.1.ffn.up_proj", "layers.1.ffn.down_proj"}
    assert model.quant_float == float_
    np.testing.assert_allclose(ours, _converted(path, tmp_path / "ct"), atol=TOL)
    assert main(["inspect", "--model", str(path)]) == 0  # `inspect` says how it is stored, `plan` counts it so
    out = json.loads(capsys.readouterr().out)
    assert (out["weight_quant"], out["weight_quant_float"]) == ("uint4-g16", sorted(float_))
    assert out["weight_quant_stored"] == ("AutoAWQ (gemm): 4-bit integers with zero points, a scale per group of 16 "
                                          "input columns; held as uint4-g16")
    assert main(["plan", "--model", str(path), "--devices", "1", "--memory", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["meshes"][0]["weights_bytes"] == weight_bytes(model)
    dlm_jax.save_pretrained(model, tmp_path / "saved")  # and saves as dlm-jax's uint4-g16, bit for bit
    again, theirs = loaded_logits(tmp_path / "saved", IDS)
    assert again.quant == "uint4-g16" and again.quant_float == float_
    np.testing.assert_array_equal(ours, theirs)


def test_unpacking_is_the_converters_own():
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    u = np.random.default_rng(2).integers(0, 16, (3, 24)).astype(np.uint8)
    packed = _pack(u)
    ours = awq_unpack(packed.numpy(), what="w")
    theirs, _ = AutoAWQConverter.unpack_awq(packed, None, 4)
    theirs, _ = AutoAWQConverter.reverse_awq_order(theirs, None, 4)
    np.testing.assert_array_equal(ours, torch.bitwise_and(theirs, 15).numpy())
    np.testing.assert_array_equal(ours, u)


@pytest.mark.parametrize("change,match", [
    ({"bits": 8}, "bits=8: AutoAWQ checkpoints of 4 bits only"),
    ({"version": "gemv"}, "version='gemv' is not supported: dlm-jax reads AutoAWQ's 'gemm' packing"),
    ({"group_size": 0}, "group_size=0: expected an integer of at least 2"),
    ({"group_size": -1}, "group_size=-1: expected an integer of at least 2"),
    ({"backend": "llm-awq"}, "backend='llm-awq' is not supported: dlm-jax reads AutoAWQ's checkpoints"),
])
def test_awq_refusals_are_one_line(change, match, tmp_path):
    path = awq_checkpoint(tmp_path / "awq")
    edit_quantization_config(path, **change)
    with pytest.raises(ConfigError, match=match) as e:
        dlm_jax.load_pretrained(path)
    assert "\n" not in str(e.value)


def test_a_bad_awq_tensor_is_named(tmp_path):
    path = awq_checkpoint(tmp_path / "awq")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.qzeros"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}': int32 .3, 3., expected int32 .3, 4.: zero points"):
        dlm_jax.load_pretrained(path)
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing quantized tensors .'{name}'.$"):
        dlm_jax.load_pretrained(path)

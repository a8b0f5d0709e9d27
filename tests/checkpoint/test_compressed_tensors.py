"""compressed-tensors checkpoints (config `quantization_config.quant_method:
"compressed-tensors"`), 8-bit and 4-bit, symmetric and asymmetric, written by the
compressed-tensors library itself, load as weight-only int8 / int4 / uint4 / fp8 and compute what
transformers computes from the same files (its CPU path decompresses them to float32)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import (
    QuantizationConfig, QuantizationStatus, apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams

import dlm_jax
from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.checkpoint._prequantized import unpack

from .hf_models import build, loaded_logits, logits, reference_logits


IDS = np.random.default_rng(0).integers(0, 96, (2, 13))
TOL = 1e-4


def ct_checkpoint(dst: Path, preset: str, *, kind: str = "qwen3", weights: dict | None = None,
                  ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """A tiny random `kind` model quantized by compressed-tensors' `preset` scheme (its groups
    and blocks 16 wide, `weights` replacing fields of its weight arguments), each scale set as a
    min-max observer sets it, compressed and saved by the library."""
    model = build(kind)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    for field, value in {"group_size": 16 if args.group_size else None,
                         "block_structure": [16, 16] if args.block_structure else None, **(weights or {})}.items():
        setattr(args, field, value)
    if scheme.input_activations is not None and scheme.input_activations.group_size:
        scheme.input_activations.group_size = 16
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data.float()
        rows, cols = w.shape
        if args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        elif args.strategy == "group":
            g = w.reshape(rows, cols // args.group_size, args.group_size)
            lo, hi = g.amin(-1), g.amax(-1)
        else:
            bo, bi = args.block_structure
            b = w.reshape(rows // bo, bo, cols // bi, bi)
            lo, hi = b.amin((1, 3)), b.amax((1, 3))
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape).to(
                module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    return dst


def _ours(path: Path):
    return loaded_logits(path, IDS)


def _dequantized(path: Path, kind: str) -> np.ndarray:
    """transformers' logits of `kind`'s float model (`ct_checkpoint`'s, the same seed) with every
    weight the checkpoint `path` holds quantized replaced by compressed-tensors' own unpacking and
    dequantisation of it: the reference where transformers cannot load the checkpoint itself (a
    Qwen3-MoE whose experts stay float: transformers 5.24 finds none of them to fuse)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    group = _group(json.loads((path / "config.json").read_text())["quantization_config"])
    args = QuantizationArgs(**group["weights"])
    tensors = load_file(str(path / "model.safetensors"))
    model = build(kind)
    state = model.state_dict()
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        base = name[:-len("_scale")]
        q = (unpack_from_int32(tensors[base + "_packed"], 8, torch.Size(tensors[base + "_shape"].tolist()))
             if base + "_packed" in tensors else tensors[base])
        state[base].copy_(dequantize(q, tensors[name], args=args, dtype=torch.float32))
    return logits(model, IDS)


def _transformers(path: Path) -> np.ndarray:
    return reference_logits(path, IDS, quantization_config=T.CompressedTensorsConfig(run_compressed=False))


@pytest.mark.parametrize("preset,weights,mode,stored", [
    ("FP8_DYNAMIC", None, "fp8", "float8_e4m3fn"),  # per channel, the "-FP8-dynamic" releases
    ("FP8_BLOCK", None, "fp8-g16", "float8_e4m3fn"),  # DeepSeek-style blocks
    ("W8A8", None, "int8", "int8"),  # int-quantized, per channel
    ("W8A16", None, "int8-g16", "int32"),  # pack-quantized groups
    ("W8A16", {"strategy": "channel", "group_size": None}, "int8", "int32"),  # pack-quantized per channel
    ("W8A16", {"strategy": "tensor", "group_size": None}, "int8", "int32"),  # one scale a tensor
    ("W4A16", None, "int4-g16", "int32"),  # 4 bits, eight to an int32, in groups: GPTQ's layout
    ("W4A16", {"strategy": "channel", "group_size": None}, "int4", "int32"),
    ("W4A16", {"actorder": "weight"}, "int4-g16", "int32"),  # llm-compressor's GPTQ default: the format unchanged
    ("W4A16_ASYM", None, "uint4-g16", "int32"),  # AWQ's layout: zero points packed along the output rows
    ("W4A16_ASYM", {"strategy": "channel", "group_size": None}, "uint4", "int32"),
    ("W4A16_ASYM", {"strategy": "tensor", "group_size": None}, "uint4", "int32"),  # one int8 zero point
    ("W4A16_ASYM", {"strategy": "block", "group_size": None, "block_structure": [16, 16]}, "uint4-g16", "int32"),
])
def test_compressed_tensors_checkpoint_matches_transformers(preset, weights, mode, stored, tmp_path):
    path = ct_checkpoint(tmp_path / "ct", preset, weights=weights)
    fmt = json.loads((path / "config.json").read_text())["quantization_config"]["format"]
    ref = _transformers(path)
    model, ours = _ours(path)
    assert model.quant == mode and model.quant_float == {"lm_head"}  # (the head, ignored, stays float)
    assert not model.quant_head and type(model.lm_head).__name__ == "Linear"
    q = model.layers[0].attn.q_proj
    dtypes = {"int8": jnp.int8, "int4": jnp.int4, "uint4": jnp.int4, "fp8": jnp.float8_e4m3fn}
    assert q.qkernel[...].dtype == dtypes[mode.split("-")[0]], fmt
    assert (stored == "int32") == (fmt == "pack-quantized")
    assert (q.zero is not None) == preset.endswith("_ASYM")
    if preset.endswith("_ASYM"):  # zero points held beside the scales
        assert q.zero[...].dtype == jnp.int8 and q.zero[...].shape == q.scale[...].shape
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL, (fmt, diff)


def test_a_quantized_head_and_a_dlm_jax_save_reload_bit_for_bit(tmp_path):
    path = ct_checkpoint(tmp_path / "ct", "W8A16", ignore=())
    model, ours = _ours(path)
    assert model.quant == "int8-g16" and model.quant_float == set() and type(model.lm_head).__name__ == "QuantLinear"
    np.testing.assert_allclose(ours, _transformers(path), atol=TOL)
    dlm_jax.save_pretrained(model, tmp_path / "saved")
    again, theirs = _ours(tmp_path / "saved")
    assert again.quant == "int8-g16" and again.quant_head
    np.testing.assert_array_equal(ours, theirs)


# compressed-tensors leaves a Qwen3-MoE's experts float: transformers 5 holds them fused, not as the
# `Linear`s its schemes target (and the recipes' `ignore` names the router); a dense layer's MLP
# named in `ignore` stays float too. dlm-jax holds those kernels float, the others quantized.
MOE_FLOAT = {"lm_head", "layers.1.ffn.gate", "layers.1.ffn.up", "layers.1.ffn.down"}


@pytest.mark.parametrize("kind,preset,ignore,float_", [
    ("qwen3_moe", "W8A16", ("lm_head", "re:.*mlp.gate$"), MOE_FLOAT),
    ("qwen3_moe", "FP8_DYNAMIC", ("lm_head", "re:.*mlp.gate$"), MOE_FLOAT),
    ("qwen3", "W8A8", ("lm_head", "re:.*layers.1.mlp.*"), {
        "lm_head", "layers.1.ffn.gate_proj", "layers.1.ffn.up_proj", "layers.1.ffn.down_proj"}),
])
def test_kernels_the_checkpoint_keeps_float_stay_float(kind, preset, ignore, float_, tmp_path, capsys):
    from dlm_jax.frontends.cli import main
    from dlm_jax.models.quant import weight_bytes

    path = ct_checkpoint(tmp_path / "ct", preset, kind=kind, ignore=ignore)
    model, ours = _ours(path)
    assert model.quant_float == float_
    layer = model.layers[1]
    assert type(layer.attn.q_proj).__name__ == "QuantLinear"
    assert type(model.layers[0].ffn.up_proj).__name__ == "QuantLinear"
    if kind == "qwen3_moe":
        assert layer.ffn.gate[...].dtype == jnp.float32 and getattr(layer.ffn, "gate_scale", None) is None
    else:
        assert type(layer.ffn.up_proj).__name__ == "Linear"
        with pytest.raises(ConfigError, match="layers 0 and 1 differ in which weights are quantized .the checkpoint "
                                              "keeps layers.1.ffn.down_proj, "):
            JaxExecutor(model, layers="scan")
    ref = _dequantized(path, kind)
    assert float(np.abs(ref - logits(build(kind), IDS)).max()) > 10 * TOL  # (it is not the float model)
    if kind == "qwen3":  # (the reference checked against transformers' own loading where it loads)
        np.testing.assert_allclose(ref, _transformers(path), atol=1e-5)
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL, diff
    dlm_jax.save_pretrained(model, tmp_path / "saved")  # the float kernels saved float, and named so
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["weight_quant_float"] == sorted(float_)
    again, theirs = _ours(tmp_path / "saved")
    assert again.quant == model.quant and again.quant_float == float_
    np.testing.assert_array_equal(ours, theirs)
    for source in (path, tmp_path / "saved"):  # `plan` counts them float, `inspect` names them
        assert main(["plan", "--model", str(source), "--devices", "1", "--memory", "1", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["meshes"][0]["weights_bytes"] == weight_bytes(model)
        assert main(["inspect", "--model", str(source)]) == 0
        assert json.loads(capsys.readouterr().out)["weight_quant_float"] == sorted(float_)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("cols", [4, 10, 32, 33])
def test_unpacking_is_compressed_tensors_own(cols, bits):
    values = torch.randint(-(1 << bits - 1), 1 << bits - 1, (3, cols), dtype=torch.int8)
    packed = pack_to_int32(values, bits)
    ours = unpack(packed.numpy(), np.array([3, cols]), bits=bits, what="w")
    np.testing.assert_array_equal(ours, unpack_from_int32(packed, bits, torch.Size([3, cols])).numpy())
    np.testing.assert_array_equal(ours, values.numpy())


def _edit(path: Path, change) -> None:
    data = json.loads((path / "config.json").read_text())
    change(data["quantization_config"])
    (path / "config.json").write_text(json.dumps(data))


def _group(qc: dict) -> dict:
    return next(iter(qc["config_groups"].values()))


@pytest.mark.parametrize("change,match", [
    (lambda qc: _group(qc)["weights"].update(num_bits=2), "2-bit weights are not supported"),
    (lambda qc: (_group(qc)["weights"].update(num_bits=4), _group(qc).update(format="int-quantized")),
     "4-bit weights in format .int-quantized. are not supported"),
    (lambda qc: _group(qc)["weights"].update(symmetric=False), "asymmetric 8-bit weights .zero points. are not "
                                                                "supported: dlm-jax holds zero points for 4-bit"),
    (lambda qc: _group(qc)["weights"].update(actorder="group"), "activation-ordered groups"),
    (lambda qc: _group(qc)["weights"].update(strategy="tensor_group"), "strategy 'tensor_group' is not supported"),
    (lambda qc: _group(qc).update(input_activations={"dynamic": False, "num_bits": 8, "type": "float",
                                                      "strategy": "tensor"}), "static activation quantization"),
    (lambda qc: _group(qc).update(format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized' is not supported"),
    (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config is set"),
    (lambda qc: qc["config_groups"].update(group_1={**copy.deepcopy(_group(qc)), "weights": {
        **_group(qc)["weights"], "group_size": 32}}), "2 different weight schemes"),
    (lambda qc: qc.update(quant_method="bitsandbytes"), "quant_method='bitsandbytes' is not supported"),
])
def test_compressed_tensors_refusals_are_one_line(change, match, tmp_path):
    path = ct_checkpoint(tmp_path / "ct", "W8A16")
    _edit(path, change)
    with pytest.raises(ConfigError, match=match) as e:
        dlm_jax.load_pretrained(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("strategy,bad", [
    ("group", lambda z: z[:-1].contiguous()),  # packed [ceil(out / 8), groups] int32: a row short
    ("tensor", lambda z: torch.full_like(z, 9)),  # an int8 zero point outside 4 bits
])
def test_a_bad_zero_point_tensor_is_named(strategy, bad, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = None if strategy == "group" else {"strategy": strategy, "group_size": None}
    path = ct_checkpoint(tmp_path / "ct", "W4A16_ASYM", weights=weights)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_zero_point"
    tensors[name] = bad(tensors[name])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    want = "int32 .3, 3., expected int32 .4, 3.: 4-bit zero points" if strategy == "group" else "int8 from 9 to 9"
    with pytest.raises(CheckpointError, match=f"tensor '{name}': {want}"):
        dlm_jax.load_pretrained(path)
    del tensors[name]  # and a missing one is named
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing quantized tensors .'{name}'.$"):
        dlm_jax.load_pretrained(path)


def test_a_packed_weight_of_the_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = ct_checkpoint(tmp_path / "ct", "W8A16")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight_packed"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}': int32 .48, 7., expected int32 .48, 8."):
        dlm_jax.load_pretrained(path)


@pytest.mark.parametrize("ignore", [("lm_head",), ()])
def test_plan_counts_the_bytes_a_pre_quantized_checkpoint_loads_into(ignore, tmp_path, capsys):
    """`dlm-jax plan` (and the memory check of a mesh load) counts the head as stored: float
    where the checkpoint keeps it float, quantized where it has scales."""
    from dlm_jax.frontends.cli import main
    from dlm_jax.models.quant import weight_bytes

    path = ct_checkpoint(tmp_path / "ct", "W8A16", ignore=ignore)
    assert main(["plan", "--model", str(path), "--devices", "1", "--memory", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quant"] == "int8-g16"
    assert out["meshes"][0]["weights_bytes"] == weight_bytes(dlm_jax.load_pretrained(path))
    assert main(["inspect", "--model", str(path)]) == 0  # and `inspect` says how it is stored
    out = json.loads(capsys.readouterr().out)
    assert (out["family"], out["weight_quant"], out["weight_quant_float"]) == ("qwen3", "int8-g16", list(ignore))
    assert out["weight_quant_stored"] == ("compressed-tensors pack-quantized: 8-bit integers, a scale per group of 16 "
                                          "input columns; held as int8-g16")

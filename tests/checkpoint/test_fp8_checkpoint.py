"""Fine-grained FP8 checkpoints (config `quantization_config.quant_method: "fp8"`, weights
float8_e4m3fn beside `<name>_scale_inv` block scales) load as weight-only fp8 and compute what
transformers computes from the same files (its CPU path dequantises them to float32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file as torch_load, save_file as torch_save

import dlm_jax
from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax.checkpoint._io import refuse_stored_quant

from .hf_models import build, glm4_moe_to_llada2, loaded_logits, reference_logits
from .test_llada2 import _tiny_config

IDS = np.random.default_rng(0).integers(0, 96, (2, 13))
TOL = 1e-4
_LINEAR = ("proj.weight", "query_key_value.weight", "dense.weight", "lm_head.weight")


def fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] | None, *, keep: tuple[str, ...] = ("lm_head",),
                   **config) -> dict[str, torch.Tensor]:
    """Copy the float checkpoint `src` to `dst` with every linear's weight (but those whose names
    start with one of `keep`) stored as float8_e4m3fn and `_scale_inv` scales per `block`
    (None: per tensor), as transformers' FineGrainedFP8 layout has them; returns the float32
    weights the FP8 tensors stand for (by name)."""
    shutil.copytree(src, dst)
    tensors = torch_load(str(src / "model.safetensors"))
    out, dequantized = {}, {}
    for name, w in tensors.items():
        if not name.endswith(_LINEAR) or name.startswith(keep) or ".gate.weight" in name:
            out[name] = w
            continue
        w = w.float()
        rows, cols = w.shape
        bo, bi = block or (rows, cols)
        go, gi = -(-rows // bo), -(-cols // bi)
        scale = torch.empty(go, gi)
        q = torch.empty_like(w)
        for a in range(go):
            for b in range(gi):
                blk = w[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi]
                scale[a, b] = blk.abs().max() / 448.0
                q[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi] = (blk / scale[a, b]).clamp(-448, 448)
        q8 = q.to(torch.float8_e4m3fn)
        full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :cols]
        dequantized[name] = q8.float() * full
        out[name] = q8
        out[name[:-len("weight")] + "weight_scale_inv"] = scale if block is not None else scale.reshape(())
    torch_save(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "manifest.json").unlink(missing_ok=True)
    data = json.loads((dst / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                   "weight_block_size": None if block is None else list(block), **config}
    (dst / "config.json").write_text(json.dumps(data))
    return dequantized


def _ours(path: Path):
    return loaded_logits(path, IDS)


def _transformers(path: Path) -> np.ndarray:
    return reference_logits(path, IDS)


@pytest.mark.parametrize("kind,block,mode", [("qwen3", (16, 16), "fp8-g16"), ("qwen3_moe", None, "fp8"),
                                             ("qwen3_moe", (8, 16), "fp8-g16")])
def test_fp8_checkpoint_matches_transformers(kind, block, mode, tmp_path):
    build(kind).save_pretrained(tmp_path / "float")
    dequantized = fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", block)
    ref = _transformers(tmp_path / "fp8")
    model, ours = _ours(tmp_path / "fp8")
    assert model.quant == mode and not model.quant_head  # the head stays as stored: float
    assert type(model.lm_head).__name__ == "Linear"
    q = model.layers[0].attn.q_proj
    assert q.qkernel[...].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(  # the stored e4m3 bytes as they are, the scales expanded exactly
        np.asarray(q.qkernel[...].astype(jnp.float32) * (q.scale[...] if block is None else
                                                         np.repeat(q.scale[...], block[1], axis=0)[:32])),
        dequantized["model.layers.0.self_attn.q_proj.weight"].numpy().T)
    assert float(np.abs(ours - ref).max()) <= TOL
    with pytest.raises(ConfigError, match="stored weight-only quantized as"):
        dlm_jax.load(tmp_path / "fp8", quant="int8")
    with pytest.raises(ConfigError, match=f"stored weight-only quantized \\({mode}, for the JAX executor\\); a GGUF"):
        refuse_stored_quant(tmp_path / "fp8", "a GGUF export")  # (exports start from float weights)


def test_fp8_saved_by_dlm_jax_reloads_bit_for_bit(tmp_path):
    build("qwen3").save_pretrained(tmp_path / "float")
    fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", (16, 16))
    model, ours = _ours(tmp_path / "fp8")
    dlm_jax.save_pretrained(model, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["weight_quant_float"] == ["lm_head"]
    from dlm_jax.checkpoint._io import stored_quant_layout  # (what `inspect` prints as weight_quant_stored)

    assert stored_quant_layout(tmp_path / "fp8") == ("fine-grained FP8: 8-bit floats (e4m3), a scale per block of "
                                                     "16 x 16; held as fp8-g16")
    assert stored_quant_layout(tmp_path / "saved") is None  # (saved by dlm-jax: its own weight_quant)
    again, theirs = _ours(tmp_path / "saved")
    assert again.quant == "fp8-g16" and not again.quant_head
    np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(CheckpointError, match="saves only with family='dlm_jax'"):
        dlm_jax.save_pretrained(model, tmp_path / "hf", family="qwen3")


def test_fp8_kernels_kept_float_stay_float(tmp_path):
    """`modules_to_not_convert` beyond the head: a layer's MLP stays float (transformers leaves it
    a `Linear`), the rest fp8; experts quantized in some tensors only are refused in one line; a
    save of an earlier version (`weight_quant_head: false`) still loads with its head float."""
    build("qwen3").save_pretrained(tmp_path / "float")
    fp8_checkpoint(tmp_path / "float", tmp_path / "mixed", (16, 16), keep=("lm_head", "model.layers.1.mlp"),
                   modules_to_not_convert=["lm_head", "model.layers.1.mlp"])
    model, ours = _ours(tmp_path / "mixed")
    assert model.quant == "fp8-g16"
    assert model.quant_float == {"lm_head", "layers.1.ffn.gate_proj", "layers.1.ffn.up_proj", "layers.1.ffn.down_proj"}
    assert type(model.layers[1].ffn.down_proj).__name__ == "Linear"
    assert float(np.abs(ours - _transformers(tmp_path / "mixed")).max()) <= TOL
    dlm_jax.save_pretrained(model, tmp_path / "saved")
    data = json.loads((tmp_path / "saved" / "config.json").read_text())
    data.pop("weight_quant_float")
    data["weight_quant_head"] = False
    (tmp_path / "saved" / "config.json").write_text(json.dumps(data))
    (tmp_path / "saved" / "manifest.json").unlink()  # (edited by hand)
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.mlp.down_proj.weight.qkernel', "):
        dlm_jax.load_pretrained(tmp_path / "saved")  # (its MLP is float: the key no longer says so)
    fp8_checkpoint(tmp_path / "float", tmp_path / "head", (16, 16))
    dlm_jax.save_pretrained(_ours(tmp_path / "head")[0], tmp_path / "saved_head")
    data = json.loads((tmp_path / "saved_head" / "config.json").read_text())
    assert data.pop("weight_quant_float") == ["lm_head"]
    data["weight_quant_head"] = False
    (tmp_path / "saved_head" / "config.json").write_text(json.dumps(data))
    (tmp_path / "saved_head" / "manifest.json").unlink()
    assert dlm_jax.load_pretrained(tmp_path / "saved_head").quant_float == {"lm_head"}
    build("qwen3_moe").save_pretrained(tmp_path / "moe")
    fp8_checkpoint(tmp_path / "moe", tmp_path / "half", None, keep=("lm_head", "model.layers.1.mlp.experts.0."))
    with pytest.raises(CheckpointError, match=r"'layers.1.ffn.(gate|up|down)' is stored partly quantized \(3 of its "
                                              r"4 tensors") as e:
        dlm_jax.load_pretrained(tmp_path / "half")
    assert "\n" not in str(e.value)


def test_fp8_fused_llada2_rows_straddling_blocks(tmp_path):
    """LLaDA2.0's fused query_key_value: blocks of 24 rows straddle its q / k / v row blocks, so
    each part takes its own rows of the fused scales. The reference: transformers' Glm4Moe (the
    same computation as the float checkpoint holding the weights the FP8 tensors stand for
    (whose load matches transformers' Glm4Moe: test_llada2)."""
    glm = build("glm4_moe")
    glm4_moe_to_llada2(glm, tmp_path / "float", _tiny_config(glm))
    dequantized = fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", (24, 16))
    model, ours = _ours(tmp_path / "fp8")
    assert model.quant == "fp8-g16"
    # the fused [q; k; v] rows of the first layer, dequantised, against the model's parts
    qkv = dequantized["model.layers.0.attention.query_key_value.weight"].numpy()
    attn = model.layers[0].attn
    parts = [np.asarray(p.qkernel[...].astype(jnp.float32) * np.repeat(p.scale[...], 16, axis=0)[:32]).T
             for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    np.testing.assert_array_equal(np.concatenate(parts), qkv)
    # the whole model against the float reference holding the dequantised weights
    shutil.copytree(tmp_path / "float", tmp_path / "deq")
    tensors = torch_load(str(tmp_path / "float" / "model.safetensors"))
    tensors.update({k: v.to(tensors[k].dtype) for k, v in dequantized.items()})
    torch_save(tensors, str(tmp_path / "deq" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "deq" / "manifest.json").unlink(missing_ok=True)
    _, deq = _ours(tmp_path / "deq")
    assert float(np.abs(ours - deq).max()) <= 1e-5


@pytest.mark.parametrize("edit,error,match", [
    ({"quant_method": "bitsandbytes"}, ConfigError, "quant_method='bitsandbytes' is not supported"),
    ({"activation_scheme": "static"}, ConfigError, "activation_scheme='static' is not supported"),
    ({"fmt": "e5m2"}, ConfigError, "fmt='e5m2' is not supported"),
    ({"scale_fmt": "ue8m0"}, ConfigError, "scale_fmt='ue8m0' is not supported"),
    ({"weight_block_size": [16, 1]}, ConfigError, "at least 2 input columns"),
    ({"weight_block_size": [16]}, ConfigError, "expected two positive integers"),
    ({"weight_block_size": [32, 16]}, CheckpointError,
     r"weight_scale_inv': shape \(\d+, \d+\), expected \(\d+, \d+\) .blocks of 32 x 16"),
])
def test_fp8_config_refusals(edit, error, match, tmp_path):
    build("qwen3").save_pretrained(tmp_path / "float")
    fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", (16, 16))
    data = json.loads((tmp_path / "fp8" / "config.json").read_text())
    data["quantization_config"].update(edit)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(data))
    with pytest.raises((ConfigError, CheckpointError), match=match) as e:
        dlm_jax.load_pretrained(tmp_path / "fp8")
    assert e.type is error and "\n" not in str(e.value)


def test_fp8_checkpoint_refusals(tmp_path):
    build("qwen3").save_pretrained(tmp_path / "float")
    # an input width that is neither a multiple of the block's columns nor at most it
    fp8_checkpoint(tmp_path / "float", tmp_path / "wide", (16, 20))
    with pytest.raises(ConfigError, match=r"its quantization \(block \[16, 20\]\) does not fit this model"):
        dlm_jax.load_pretrained(tmp_path / "wide")
    # a missing scale
    fp8_checkpoint(tmp_path / "float", tmp_path / "noscale", (16, 16))
    tensors = torch_load(str(tmp_path / "noscale" / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    torch_save(tensors, str(tmp_path / "noscale" / "model.safetensors"), metadata={"format": "pt"})
    missing = r"missing quantized tensors \['model.layers.1.self_attn.o_proj.weight_scale_inv'\]"
    with pytest.raises(CheckpointError, match=missing):
        dlm_jax.load_pretrained(tmp_path / "noscale")
    # a float parameter stored in float8 (its cast would drop the scale)
    tensors = torch_load(str(tmp_path / "float" / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    shutil.copytree(tmp_path / "float", tmp_path / "f8norm")
    torch_save(tensors, str(tmp_path / "f8norm" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "f8norm" / "manifest.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="'model.norm.weight' is float8_e4m3fn, where dlm-jax holds"):
        dlm_jax.load_pretrained(tmp_path / "f8norm")

"""Weight-only quantized checkpoints: `save_pretrained` of a model loaded with `quant=...`, and
`dlm_jax.load` of what it wrote (`dlm_jax.checkpoint._io`, docs/checkpoints.md)."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.checkpoint import CheckpointError, save_pretrained, verify_manifest
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.models import get_params

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "llada-tiny"


def _saved(tmp_path: Path, source: Path, quant: str) -> tuple[dlm_jax.Model, Path]:
    handle = dlm_jax.load(source, executor="jax", quant=quant)
    return handle, save_pretrained(handle.model, tmp_path / f"{source.name}-{quant}", tokenizer=handle.tokenizer)


def _bits(x) -> np.ndarray:
    x = np.asarray(jax.device_get(x))
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(f"u{x.dtype.itemsize}")


def test_int8_checkpoint_reloads_bit_for_bit_and_decodes_the_same(tmp_path):
    """A quantized checkpoint that reloads as a float model quantized anew, or with a kernel
    transposed or a scale on the wrong channel, still decodes text: only the executor's leaves
    compared bit for bit, and the decoded tokens, catch it."""
    handle, path = _saved(tmp_path, TINY, "int8")
    assert verify_manifest(path)
    loaded = dlm_jax.load(path, executor="jax")
    assert loaded.model.quant == "int8"
    want, got = JaxExecutor(handle.model)._leaves, JaxExecutor(loaded.model)._leaves
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))
    cfg = dlm_jax.decode_config(gen_len=32)
    prompts = ["564+894=", "12+30=", "sort: 3 1 2 ->"]
    a, b = handle.generate(prompts, cfg), loaded.generate(prompts, cfg)
    assert a.token_ids == b.token_ids and a.texts == b.texts
    assert a.texts[0].startswith("1458"), a.texts  # the model still adds (the docs snippet prints it)
    assert dlm_jax.load(path, executor="jax", quant="int8").model.quant == "int8"  # the stored mode is accepted


def test_stored_tensors_are_int8_with_float32_scales_of_the_float_weights(tmp_path):
    """A writer that stores the dequantised floats (the same decode, twice the bytes) or scales
    per input channel passes a round trip; the safetensors library's own reader shows which."""
    _, path = _saved(tmp_path, TINY, "int8")
    tensors = load_file(path / "model.safetensors")
    float32 = load_file(TINY / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    q, scale = tensors[name + ".qkernel"], tensors[name + ".scale"]
    assert name not in tensors and q.dtype == np.int8 and scale.dtype == np.float32
    w = float32[name]  # [out, in] as the checkpoint stores it
    assert q.shape == w.shape and scale.shape == (w.shape[0],)
    np.testing.assert_allclose(scale, np.abs(w).max(axis=1) / 127, rtol=1e-6)
    assert np.abs(q * scale[:, None] - w).max() <= scale.max() / 2 + 1e-7  # within half a step
    assert tensors["model.embed_tokens.weight"].dtype == np.float32  # the embedding stays as stored
    quantized = [k for k in tensors if k.endswith(".qkernel")]
    assert quantized and all(tensors[k].dtype == np.int8 for k in quantized)
    assert all(tensors[k[:-len(".qkernel")] + ".scale"].dtype == np.float32 for k in quantized)


def test_fp8_moe_checkpoint_round_trips_its_experts(tmp_path):
    handle, path = _saved(tmp_path, ROOT / "models" / "moe-tiny", "fp8")
    with safe_open(path / "model.safetensors", framework="numpy") as f:  # (its NumPy reader has no float8)
        dtypes = {k: (f.get_slice(k).get_dtype(), len(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118 (a safe_open, not a dict)
    experts = [k for k in dtypes if ".mlp.experts." in k]
    assert any(k.endswith(".qkernel") for k in experts) and not any(k.endswith(".weight") for k in experts)
    assert all(dtypes[k] == ("F8_E4M3", 2) for k in experts if k.endswith(".qkernel"))
    assert all(dtypes[k] == ("F32", 1) for k in experts if k.endswith(".scale"))
    loaded = dlm_jax.load(path, executor="jax")
    want, got = get_params(handle.model), get_params(loaded.model)
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype
        np.testing.assert_array_equal(_bits(want[k]), _bits(got[k]))


def test_grouped_int8_moe_checkpoint_stores_group_scales_and_round_trips(tmp_path):
    """Grouped scales ([G, O] a kernel, [G, O] per expert) saved and reloaded: a writer that
    drops the groups, or a reader that expects [O], fails here (the shapes come from the mode
    config.json records)."""
    handle, path = _saved(tmp_path, ROOT / "models" / "moe-tiny", "int8-g32")
    loaded = dlm_jax.load(path, executor="jax")
    assert loaded.model.quant == "int8-g32"
    want, got = get_params(handle.model), get_params(loaded.model)
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and want[k].shape == got[k].shape
        np.testing.assert_array_equal(_bits(want[k]), _bits(got[k]))
    tensors = load_file(path / "model.safetensors")
    float32 = load_file(ROOT / "models" / "moe-tiny" / "model.safetensors")
    for name in [k[:-len(".qkernel")] for k in tensors if k.endswith(".qkernel")]:
        q, scale, w = tensors[name + ".qkernel"], tensors[name + ".scale"], float32[name]  # w: [out, in]
        groups = max(w.shape[1] // 32, 1)
        assert scale.shape == (groups, w.shape[0]), name
        amax = np.abs(w.T.reshape(groups, -1, w.shape[0])).max(axis=1)
        np.testing.assert_allclose(scale, amax / 127, rtol=1e-6, err_msg=name)
        assert np.abs(q.T * np.repeat(scale, w.shape[1] // groups, axis=0) - w.T).max() <= scale.max() / 2 + 1e-7
    # (bit-for-bit parameters decode alike: the per-channel test above decodes its round trip)


def test_int4_moe_checkpoint_stores_int8_tensors_and_round_trips(tmp_path):
    """int4 kernels (safetensors has no 4-bit integer type) are stored as int8 tensors within
    [-7, 7] and come back as int4, bit for bit; a stored value outside int4's range is named."""
    handle, path = _saved(tmp_path, ROOT / "models" / "moe-tiny", "int4-g32")
    tensors = load_file(path / "model.safetensors")
    quantized = [k for k in tensors if k.endswith(".qkernel")]
    assert any(".mlp.experts." in k for k in quantized)
    assert all(tensors[k].dtype == np.int8 and -7 <= tensors[k].min() and tensors[k].max() <= 7 for k in quantized)
    loaded = dlm_jax.load(path, executor="jax")
    assert loaded.model.quant == "int4-g32" and str(loaded.model.layers[0].attn.q_proj.qkernel[...].dtype) == "int4"
    want, got = get_params(handle.model), get_params(loaded.model)
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and want[k].shape == got[k].shape
        np.testing.assert_array_equal(np.asarray(want[k], np.float32), np.asarray(got[k], np.float32))
    name = next(k for k in quantized if ".mlp.experts.1." in k)  # (not the first tensor of its kernel)
    tensors[name] = tensors[name].copy()
    tensors[name].flat[0] = 9
    from safetensors.numpy import save_file

    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds values -?\d+..9, outside the int4 range"):
        dlm_jax.load(path, executor="jax")


def test_uint4_moe_checkpoint_stores_its_zero_points_and_round_trips(tmp_path):
    """uint4 kernels save as int8 tensors of q - 8 within int4's range, each with its int8 zero
    points (`.zero`, one per scale: the experts' per expert) beside its scales, and come back
    bit for bit; zero points stored in another dtype are named."""
    handle, path = _saved(tmp_path, ROOT / "models" / "moe-tiny", "uint4-g32")
    tensors = load_file(path / "model.safetensors")
    kernels = [k[:-len(".qkernel")] for k in tensors if k.endswith(".qkernel")]
    assert any(".mlp.experts." in k for k in kernels)
    for k in kernels:
        q, scale, zero = tensors[k + ".qkernel"], tensors[k + ".scale"], tensors[k + ".zero"]
        assert q.dtype == zero.dtype == np.int8 and -8 <= q.min() and q.max() <= 7 and zero.shape == scale.shape, k
    loaded = dlm_jax.load(path, executor="jax")
    assert loaded.model.quant == "uint4-g32" and str(loaded.model.layers[0].attn.q_proj.qkernel[...].dtype) == "int4"
    want, got = get_params(handle.model), get_params(loaded.model)
    assert want.keys() == got.keys() and any(k.endswith("ffn.gate_zero") for k in want)
    for k in want:
        assert want[k].dtype == got[k].dtype and want[k].shape == got[k].shape, k
        np.testing.assert_array_equal(np.asarray(want[k], np.float32), np.asarray(got[k], np.float32))
    name = next(k for k in tensors if k.endswith(".zero"))
    tensors[name] = tensors[name].astype(np.float32)
    from safetensors.numpy import save_file

    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}' is float32, expected int8 zero points"):
        dlm_jax.load(path, executor="jax")


def test_quantized_checkpoint_refusals_are_one_line(tmp_path):
    handle, path = _saved(tmp_path, TINY, "int8")
    with pytest.raises(ConfigError, match=r"^quant='fp8': .* is stored weight-only quantized as 'int8'; "
                                          r"load it with quant='int8' or None$"):
        dlm_jax.load(path, quant="fp8")
    with pytest.raises(CheckpointError, match=r"saves only with family='dlm_jax', not 'llada'$"):
        save_pretrained(handle.model, tmp_path / "as-llada", family="llada")
    assert not (tmp_path / "as-llada").exists()
    with pytest.raises(ConfigError, match=r"^.* is stored weight-only quantized as 'int8': it decodes on the JAX "
                                          r"executor, not 'litert'"):  # no quant= given: the folder is named
        dlm_jax.load(path, executor="litert")
    from buckets._profile import profile_model

    with pytest.raises(ConfigError, match=r"^quant='fp8': .* is stored weight-only quantized as 'int8'; profile it"):
        profile_model(str(path), out=tmp_path / "profile", quant="fp8")


def test_plan_reads_a_stored_quantized_checkpoint(tmp_path, capsys):
    """Guards `plan` counting a stored int8 checkpoint's weights as float32 (it loads as int8)."""
    import json

    from dlm_jax.frontends.cli import main

    _, path = _saved(tmp_path, TINY, "int8")
    assert main(["plan", "--model", str(path), "--devices", "1", "--memory", "1", "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", str(TINY), "--devices", "1", "--memory", "1", "--quant", "int8", "--json"]) == 0
    assert stored["meshes"][0]["weights_bytes"] == json.loads(capsys.readouterr().out)["meshes"][0]["weights_bytes"]
    assert main(["plan", "--model", str(path), "--devices", "1", "--memory", "1", "--quant", "fp8"]) == 2
    assert "is stored weight-only quantized as 'int8'; plan it with --quant int8" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["bundle", "gguf", "sparse"])  # sparse: refused before its calibration loads it
def test_exporting_a_stored_quantized_checkpoint_is_refused_in_one_line(tmp_path, fmt):
    """Exports start from float weights: a weight-only quantized folder used to reach the
    exporter and fail inside it; now one `error:` line names the folder, before any weight loads."""
    saved = tmp_path / "int8"
    save_pretrained(dlm_jax.load(TINY, quant="int8").model, saved)
    out = tmp_path / ("bundle" if fmt == "bundle" else "model.gguf")
    extra = ["--format", fmt] if fmt != "sparse" else ["--sparse", "--memory-budget", "0.001"]
    proc = subprocess.run([sys.executable, "-m", "dlm_jax.frontends.cli", "export", "--model", str(saved), "--out",
                           str(out), *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "stored weight-only quantized (int8" in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists()

"""PowerInfer-2's NPU quantisation in the partitioned bundle (`--quant int4-outliers`): every
linear of the NPU programs runs as an INT4 channelwise FULLY_CONNECTED over its inlier input
channels plus an INT8 one over the outliers, and the integers in the `.tflite` are exactly
the lowering plan's (`dlm_jax.lowering.quant`). Guards the silent failures: a linear left in float
(no memory saved, no error), integers the quantizer rounded differently from the plan, and a
channel split that feeds the wrong activations (garbage tokens, no error)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.models._params import get_params
from dlm_jax.executors.partition_contract import body_name, tiled
from dlm_jax.executors.runner import Bundle, load_bundle
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.testing import tiny_checkpoint
from dlm_jax.lowering.quant import quantize_int4, quantize_int8
from dlm_jax.tflite_export.bundle import _Sizes, export_bundle
from dlm_jax.techniques.powerinfer.npu_quant import NpuQuant, channel_runs, quantized_weights, take_channels, weight_types
from dlm_jax.tflite_export.partition import pad_ffn
from dlm_jax.techniques.powerinfer.sparse import decode_statistics, ffn_samples, plan_sparse, record_windows, train_predictor

CONFIG = dlm_jax.decode_config(cache="prefix", rule="threshold", gen_len=16, block_len=8)


def _keys(model, prompts):
    decoder = Decoder(_Sizes(model.config), model.config)
    keys = set()
    for p in prompts:
        keys |= set(decoder.bucket_keys([len(p)], CONFIG))
    return sorted(keys)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("npuq")
    path = tiny_checkpoint(root / "m", seed=5, ffn="reglu", ffn_hidden=96)
    model = dlm_jax.load(path)
    prompts = [model.encode(p, chat=False) for p in ("12+34=", "sort 5 3 1:")]
    keys = _keys(model, prompts)
    for name, quant in (("float", "none"), ("mixed", "int4-outliers")):
        export_bundle(path, root / name, keys=keys, decode=CONFIG, latency_repeats=0, partition=True, quant=quant)
    stats = decode_statistics(model, prompts, CONFIG)
    predictor, _ = train_predictor(ffn_samples(model.model, record_windows(model, prompts, CONFIG)),
                                   model.config, steps=30, batch=64)
    plan = plan_sparse(model.config, stats, predictor, windows=[32], budget_mb=1.0, resident_bytes=20_000,
                       cluster=32)
    export_bundle(path, root / "sparse", keys=keys, decode=CONFIG, latency_repeats=0, sparse=plan,
                  quant="int4-outliers")
    return path, model, root, prompts


def test_channel_slices_equal_indexing():
    x = np.arange(2 * 3 * 10, dtype=np.float32).reshape(2, 3, 10)
    for idx in ([0], [3, 4, 5, 9], [1, 2, 7], list(range(10))):
        np.testing.assert_array_equal(np.asarray(take_channels(x, idx)), x[..., idx])
    assert channel_runs([1, 2, 3, 7, 9, 10]) == [(1, 4), (7, 8), (9, 11)]


def _pack_int4(q: np.ndarray) -> bytes:
    """LiteRT's INT4 layout: two values per byte, the first in the low nibble."""
    nib = (q.astype(np.int16) & 0xF).astype(np.uint8).reshape(-1)
    if nib.size % 2:
        nib = np.append(nib, 0)
    return bytes(nib[0::2] | (nib[1::2] << 4))


@pytest.mark.slow  # an int4-outliers partitioned export: about 20 s cold
def test_every_npu_linear_holds_the_plans_int4_and_int8_integers(exported):
    path, model, root, _ = exported
    content = (root / "mixed" / "model.tflite").read_bytes()
    types = weight_types(content)
    assert set(types) == {"int4", "int8"} and types["int4"] == types["int8"]  # no float FULLY_CONNECTED left
    held = {}
    for w in quantized_weights(content).values():
        held.setdefault((w["type"], bytes(w["buffer"])), np.asarray(w["scale"], np.float32))
    plan = json.loads((root / "mixed" / "plan.json").read_text())["quantization"]
    assert plan["mode"] == "int4-outliers" and plan["calibrated"]
    assert plan["rule"]["salience"].startswith("mean|x_j|")
    params = get_params(pad_ffn(model.model))
    names = {n for n in plan["weights"]}
    cfg = model.config
    assert names == {f"layers.{i}.{p}" for i in range(cfg.n_layers)
                     for p in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                               "ffn.gate_proj", "ffn.up_proj", "ffn.down_proj")}
    for name, entry in plan["weights"].items():
        w = np.asarray(params[name + ".kernel"], np.float32).T  # [out, in]
        outliers = np.asarray(entry["outlier_channels"])
        assert len(outliers) == max(1, int(np.ceil(0.01 * w.shape[1])))
        inliers = np.setdiff1d(np.arange(w.shape[1]), outliers)
        q4, q8 = quantize_int4(w[:, inliers]), quantize_int8(w[:, outliers])
        q8q = q8.q if len(outliers) > 1 else np.concatenate([q8.q, np.zeros_like(q8.q)], axis=1)  # zero companion
        q4q = np.zeros(w.shape, np.int8)  # the INT4 part reads every channel, zero on the outliers
        q4q[:, inliers] = q4.q
        key4, key8 = ("int4", _pack_int4(q4q)), ("int8", q8q.astype(np.int8).tobytes())
        assert key4 in held and key8 in held, name
        np.testing.assert_allclose(held[key4], q4.scale, rtol=1e-6)
        np.testing.assert_allclose(held[key8], q8.scale, rtol=1e-6)


def _body(root, name, key_window, cache):
    from dlm_jax.executors._litert import compiled_model

    bundle = Bundle.open(root / name)
    model = compiled_model(bundle.model_path.read_bytes())
    prog = body_name(1, tiled(key_window), cache)
    idx = model.get_signature_index(prog)
    return model, idx, model.get_signature_list()[prog]


@pytest.mark.slow  # an int4-outliers partitioned export: about 20 s cold
def test_the_split_programs_compute_the_float_programs_within_int4_error(exported):
    _, model, root, _ = exported
    cfg = model.config
    rng = np.random.default_rng(0)
    p = 0
    outs = {}
    for name in ("float", "mixed"):
        compiled, idx, sig = _body(root, name, 32, p)
        ins = compiled.create_input_buffers(idx)
        arrays = {"hidden": rng.standard_normal((1, 32, cfg.d_model)).astype(np.float32) if name == "float"
                  else outs["x"], "positions": np.arange(32, dtype=np.int32)[None],
                  "visibility": np.ones((1, 32, 32), bool)}
        outs["x"] = arrays["hidden"]
        for n, buf in zip(sig["inputs"], ins):
            buf.write(np.ascontiguousarray(arrays[n]))
        res = compiled.create_output_buffers(idx)
        compiled.run_by_index(idx, ins, res)
        h = dict(zip(sig["outputs"], res))["hidden"]
        outs[name] = h.read(32 * cfg.d_model, np.float32).reshape(32, cfg.d_model)
    delta = outs["mixed"] - outs["x"][0]  # what the layers add to the residual stream
    ref = outs["float"] - outs["x"][0]
    rel = np.linalg.norm(delta - ref) / np.linalg.norm(ref)
    assert rel < 0.25, rel  # INT4 weights: ~0.1; a mis-fed channel split: ~1


@pytest.mark.slow  # an int4-outliers partitioned export: about 20 s cold
def test_mixed_bundles_decode(exported):
    _, _, root, prompts = exported
    for name, kwargs in (("mixed", {}), ("sparse", {"oracle": True})):
        runner = load_bundle(root / name, **kwargs)
        out = runner.decoder.decode([prompts[0]], CONFIG)
        assert out.sequences[0].shape[-1] == CONFIG.gen_len and out.stats.nfe > 0
        assert runner.bundle.quant == "int4-outliers"


@pytest.mark.slow  # an int4-outliers partitioned export: about 20 s cold
def test_sparse_hot_clusters_are_split_too(exported):
    _, _, root, _ = exported
    plan = json.loads((root / "sparse" / "plan.json").read_text())["quantization"]
    hot = [n for n in plan["weights"] if ".hot" in n]
    assert hot and all(n.rsplit(".", 1)[1] in ("gate", "up", "down") for n in hot)
    # the whole FFN matrices are on flash, not in a program: only their input's split is recorded
    assert not [n for n in plan["weights"] if n.endswith("down_proj")]
    for n in hot:
        if n.endswith((".gate", ".up")):  # every cluster's gate / up shares its layer's FFN-input channels
            layer = n.split(".ffn.")[0]
            assert plan["weights"][n]["outlier_channels"] == plan["weights"][layer + ".ffn.up_proj"]["outlier_channels"]
    assert "float32" not in weight_types((root / "sparse" / "model.tflite").read_bytes())


def test_int4_alone_has_no_int8_part():
    import jax

    q = NpuQuant(fraction=0.0)
    kernel = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
    assert q.choose(["w"], [kernel]).size == 0 and q.chosen["w"]["outlier_channels"] == []
    y = jax.jit(lambda x: q.cluster_matmul("w", x, kernel))(np.ones((2, 16), np.float32))
    np.testing.assert_allclose(np.asarray(y), np.ones((2, 16)) @ kernel, rtol=1e-5)
    with pytest.raises(ConfigError, match="fraction=1.5"):
        NpuQuant(fraction=1.5)


@pytest.mark.slow  # an int4-outliers partitioned export: about 20 s cold
def test_int4_outliers_needs_a_partitioned_bundle(exported, tmp_path):
    path, _, _, _ = exported
    with pytest.raises(ConfigError, match="--partition"):
        export_bundle(path, tmp_path / "b", keys=[dlm_jax.runtime.BucketKey(1, 32, 0, 32)], decode=CONFIG,
                      latency_repeats=0, quant="int4-outliers")
    proc = subprocess.run([sys.executable, "-m", "dlm_jax.frontends.cli", "export", "--model", str(path), "--out",
                           str(tmp_path / "c"), "--quant", "int4-outliers", "--preset", "fast-dllm", "--gen", "32",
                           "--for-prompts", "8"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --quant int4-outliers quantises the NPU programs of a partitioned bundle: add --partition (or --sparse)"]
    assert not (tmp_path / "c").exists()


@pytest.mark.slow  # an int4-outliers partitioned export: about 20 s cold
def test_calibration_statistics_ignore_padding(exported):
    from dlm_jax.techniques.powerinfer.npu_quant import activation_stats

    _, model, _, prompts = exported
    a, b = prompts[0], prompts[1] + [40, 41, 42]
    both = activation_stats(model.model, [a, b])
    one, two = activation_stats(model.model, [a]), activation_stats(model.model, [b])
    for name in both:  # a padded batch gives the rows' own statistics: padding adds nothing, sees nothing
        np.testing.assert_allclose(both[name] * (len(a) + len(b)), one[name] * len(a) + two[name] * len(b),
                                   rtol=2e-5, atol=1e-6)

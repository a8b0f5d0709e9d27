"""`benchmarks/compile_scan.py`: the scanned decode step gives the unrolled one's outputs, it
really runs one block under a while loop, and a case's report carries every field."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compile_scan  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from dlm_jax.runtime.buckets import BucketKey  # noqa: E402

KEY = BucketKey(batch=1, window=8, cache=16, rows=8, full_logits=True)


def _tiny():
    return compile_scan.model_config(2, 64, heads=2, ffn=128, vocab=128)


@pytest.mark.slow  # (4 s; the scanned executor's tokens stay in the default pass, tests/executors/test_scan_layers.py)
def test_scanned_step_matches_the_unrolled_one_and_is_one_loop():
    cfg = _tiny()
    model = compile_scan.dlm_jax.init_model(cfg, seed=1)
    scanned = compile_scan.ScannedTransformer(model)
    inputs = compile_scan.step_inputs(cfg, KEY, seed=1)
    outs, texts = {}, {}
    for name, mod in (("unrolled", model), ("scanned", scanned)):
        graphdef, state = nnx.split(mod)
        jitted = jax.jit(compile_scan._program(graphdef, KEY, cfg.mask_token_id))
        texts[name] = jitted.lower(state, *inputs).as_text()
        outs[name] = jax.device_get(jitted(state, *inputs))
    for field in ("logits", "k_new", "v_new", "top_prob", "entropy"):
        np.testing.assert_allclose(outs["scanned"][field], outs["unrolled"][field], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outs["scanned"]["top_token"], outs["unrolled"]["top_token"])
    assert outs["unrolled"]["k_new"].shape == (2, 1, 8, 2, 32)
    assert "stablehlo.while" in texts["scanned"] and "stablehlo.while" not in texts["unrolled"]


@pytest.fixture
def no_persistent_cache(monkeypatch):
    """The benchmark's cache switch, undone afterwards (the test session shares a cache)."""
    saved = {n: getattr(jax.config, n) for n in ("jax_compilation_cache_dir", "jax_enable_compilation_cache")}
    monkeypatch.setenv("DLM_JAX_CACHE_DIR", "off")
    compile_scan.disable_persistent_cache()
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_a_case_reports_every_field(tmp_path, no_persistent_cache):
    assert jax.config.jax_compilation_cache_dir is None
    row = compile_scan.measure(_tiny(), KEY, repeats=1, steps=1)
    assert set(compile_scan.FIELDS) <= set(row)
    assert row["layers"] == 2 and row["d_model"] == 64
    assert row["unrolled_compile_s"] > 0 and row["scanned_compile_s"] > 0
    assert np.isfinite(row["max_abs_diff"]) and row["max_abs_diff"] < 1e-4
    rep = compile_scan.report([row], KEY, {})
    env = rep["environment"]
    for field in ("cpu", "cores", "jax", "backend", "jax_compilation_cache_dir"):
        assert field in env
    assert "CPU backend" in rep["note"]
    md = compile_scan.markdown(rep)
    assert "| 2 | 64 |" in md and "compile ratio" in md
    compile_scan.plot(rep, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.slow  # (3 s: the benchmark's 8B-shape path at a small shape; its report's fields run by default)
def test_the_executors_resident_step_compiles_from_abstract_shapes_both_ways(no_persistent_cache):
    cfg = compile_scan.model_config(3, 64, heads=2, ffn=128, vocab=128)
    rows = compile_scan.measure_resident(cfg, ((1, 8, 16), (2, 16, 0)), slots=32, repeats=1)
    assert [r["bucket"] for r in rows] == ["b1_w8_p16_r8", "b2_w16_p0_r16"]
    for r in rows:
        assert r["unrolled_compile_s"] > 0 and r["scanned_compile_s"] > 0 and r["compile_ratio"] > 0
    rep = compile_scan.report([], KEY, {})
    rep["llada_8b"] = {"config": {}, "repeats": 1, "rows": rows}
    assert "| `b1_w8_p16_r8` |" in compile_scan.markdown(rep)


@pytest.mark.slow  # a decode of scanned layers, compiled cold: about 3.5 s
def test_the_first_decode_reports_what_it_waited_for(monkeypatch):
    monkeypatch.setenv("DLM_JAX_LAYERS", "scan")
    row = compile_scan.first_decode_worker(str(ROOT / "models" / "llada-tiny"), "dual", 1, 32)
    assert row["layers"] == "scan" and row["nfe"] > 1  # random weights: many steps
    assert row["buckets"] >= 2 and row["compiles"] > row["buckets"]  # and the cache's allocation
    assert 0 < row["compile_wait_s"] <= row["first_decode_s"]
    rep = compile_scan.report([], KEY, {})
    rep["first_decode"] = [row]
    assert "| dual | 1 | scan |" in compile_scan.markdown(rep)

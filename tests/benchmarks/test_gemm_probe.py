"""benchmarks/gemm_probe.py at a small shape on the CPU. What a GPU lease reads from it (is a
fused projection faster, does int8 read half the bytes) is only worth its device time if
both layouts compute the same products from the same weights, the int8 case holds the
quantizer's int8 weights, and each pair compares the cases it names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gemm_probe  # noqa: E402
from tests.benchmarks._cut import killed_after  # noqa: E402


def test_fused_and_separate_compute_the_same_products_from_the_same_weights():
    shape = gemm_probe.SHAPES["small"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, shape["d_model"])), jnp.float32)
    for group in gemm_probe.GROUPS:
        for quant in gemm_probe.QUANTS:
            kernels = gemm_probe.weights(shape, group, quant, jnp.float32, seed=1)
            fused = gemm_probe.fuse(kernels, quant)
            assert gemm_probe.weight_bytes(fused) == gemm_probe.weight_bytes(kernels)
            sep = gemm_probe.program("separate", quant)(x, kernels)
            assert [y.shape[1] for y in sep] == gemm_probe.widths(shape, group)
            np.testing.assert_allclose(np.asarray(gemm_probe.program("fused", quant)(x, fused)),
                                       np.concatenate([np.asarray(y) for y in sep], axis=1), rtol=1e-5, atol=1e-6)
            if quant != "none":  # the quantizer's int8 kernels with float32 scales, per output channel (or group)
                q, scale, zero = kernels[0]
                assert q.dtype == jnp.int8 and zero is None
                assert scale.shape == ((q.shape[1],) if quant == "int8" else (2, q.shape[1]))
                if scale.ndim == 2:
                    scale = np.repeat(np.asarray(scale), q.shape[0] // 2, axis=0)
                dense = gemm_probe.weights(shape, group, "none", jnp.float32, seed=1)[0]
                np.testing.assert_allclose(np.asarray(q, np.float32) * np.asarray(scale), np.asarray(dense),
                                           atol=float(np.abs(np.asarray(dense)).max()) / 127)


@pytest.mark.slow  # (3 s: the script's run; its products' equality runs by default above)
def test_the_run_reports_every_case_and_pair(tmp_path):
    out = tmp_path / "gemm"
    assert gemm_probe.main(["--shape", "small", "--dtype", "float32", "--rows", "8", "32", "--calls", "2", "--reps", "1",
                            "--out", str(out)]) == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    cases = {(c["group"], c["quant"], c["rows"], c["form"]): c for c in rep["cases"]}
    assert len(cases) == len(gemm_probe.GROUPS) * len(gemm_probe.QUANTS) * 2 * len(gemm_probe.FORMS)
    for (group, quant, rows, form), c in cases.items():
        assert c["ms"] > 0 and c["weight_gbps"] == pytest.approx(c["weight_bytes"] / c["ms"] / 1e6)
        if form == "fused":
            assert c["max_diff_vs_separate"] < 1e-5
    # int8 holds a quarter of float32's bytes, and a scale per output channel.
    none, int8 = cases[("qkv", "none", 8, "fused")], cases[("qkv", "int8", 8, "fused")]
    d, o = gemm_probe.SHAPES["small"]["d_model"], sum(gemm_probe.widths(gemm_probe.SHAPES["small"], "qkv"))
    assert (none["weight_bytes"], int8["weight_bytes"]) == (4 * d * o, d * o + 4 * o)
    pairs = {(p["group"], p["quant"], p["rows"]): p for p in gemm_probe.pairs(rep)}
    p = pairs[("gate_up", "int8", 32)]
    a, b = cases[("gate_up", "int8", 32, "separate")], cases[("gate_up", "int8", 32, "fused")]
    assert p["fused_over_separate"] == pytest.approx(b["ms"] / a["ms"])
    assert p["int8_over_none"]["fused"] == pytest.approx(b["ms"] / cases[("gate_up", "none", 32, "fused")]["ms"])
    assert pairs[("qkv", "none", 8)]["int8_over_none"] is None
    assert "| gate_up | int8 | 32 |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").stat().st_size


@pytest.mark.slow  # (3 s: a benchmark script's run, as the others')
def test_a_probe_cut_short_keeps_the_pairs_it_finished(tmp_path, monkeypatch):
    """A lease part ends at its time limit, killed: the report is written after every pair, so
    the pairs timed before the kill are on disk, marked incomplete (here the third timing dies)."""
    monkeypatch.setattr(gemm_probe, "time_calls", killed_after(2, gemm_probe.time_calls))
    monkeypatch.setattr(gemm_probe, "copy_bandwidth", lambda: 1e10)
    out = tmp_path / "gemm"
    with pytest.raises(KeyboardInterrupt):
        gemm_probe.main(["--shape", "small", "--dtype", "float32", "--groups", "qkv", "--quant", "none",
                         "--rows", "8", "32", "--calls", "1", "--reps", "1", "--out", str(out)])
    rep = json.loads(out.with_suffix(".json").read_text())
    assert [(c["rows"], c["form"]) for c in rep["cases"]] == [(8, "separate"), (8, "fused")] and not rep["complete"]
    assert "(cut short after 2 cases)" in out.with_suffix(".md").read_text()

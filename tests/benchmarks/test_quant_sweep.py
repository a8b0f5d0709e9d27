"""benchmarks/quant_sweep.py: the quantized GEMM kernel's tilings timed against XLA's form of
the grouped product. What a lease reads from it (which tiling to make the default, and whether
the kernel should be a GPU's default at all) is only worth its device time if each tiling runs
the kernel under that tiling, a tiling that computes another product is not a candidate, and
the fastest named is the fastest of those that pass."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import quant_sweep  # noqa: E402
from tests.benchmarks._cut import docs_argv, killed_after  # noqa: E402
from dlm_jax.models import _quant_kernel  # noqa: E402
from dlm_jax.models._quant_kernel import DEFAULT_TILING, Tiling  # noqa: E402


def test_tilings_are_presets_or_key_value_lists():
    assert quant_sweep.tiling("default") == ("default", DEFAULT_TILING)
    assert quant_sweep.tiling("split4")[1] == Tiling(split=4)
    assert quant_sweep.tiling("m=32,n=64,split=2,warps=8,stages=2")[1] == Tiling(
        block_m=32, block_n=64, split=2, warps=8, stages=2)
    for bad, says in (("fast", "a preset"), ("n=wide", "a preset"), ("n=24", "block_n=24"), ("split=3", "split=3"),
                      ("warps=3", "warps=3")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            quant_sweep.tiling(bad)
    with pytest.raises(SystemExit):  # a tiling named twice would be one row over the other
        quant_sweep.main(["--tilings", "n64", "n64", "--stand-in", "--out", "/tmp/unused"])
    with pytest.raises(SystemExit):  # a mode the quantizer does not know
        quant_sweep.main(["--quant", "int3-g128", "--stand-in", "--out", "/tmp/unused"])


def test_the_fastest_named_is_the_fastest_within_the_margin():
    """A faster tiling whose product strays past the margin (a wrong kernel) is not chosen."""
    def row(us, diff=1e-3):
        return {"us": us, "max_diff": diff}

    case = {"forms": {"bf16": {"us": 20.0}, "xla": {"us": 40.0}, "pallas:default": row(30.0),
                      "pallas:split4": row(5.0, 0.5), "pallas:n64": row(24.0),
                      "pallas:warps8": {"error": "ValueError: shared memory"}}}
    quant_sweep.summarize(case)
    assert [case["forms"][n].get("pass") for n in case["forms"]] == [None, None, True, False, True, False]
    assert case["best"] == "pallas:n64"
    assert case["best_over_xla"] == pytest.approx(0.6) and case["best_over_default"] == pytest.approx(0.8)
    assert case["default_over_xla"] == pytest.approx(0.75) and case["best_over_bf16"] == pytest.approx(1.2)


@pytest.mark.slow  # (about 15 s in Pallas's interpreter)
def test_a_stand_in_sweep_reports_every_form_of_every_case(tmp_path):
    """docs/benchmarks.md's stand-in command, its --out here: every kernel of the small shape,
    both modes (one act-order, with zero points), XLA's form and two tilings, each tiling's
    product XLA's."""
    out = tmp_path / "qsweep"
    assert quant_sweep.main(docs_argv("benchmarks/quant_sweep.py", "--stand-in", out=str(out))) == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    assert rep["mode"] == "stand-in" and rep["complete"]
    assert [(c["kernel"], c["quant"], c["rows"]) for c in rep["cases"]] == [
        (k, q, 8) for k in ("qkvo", "gate_up", "down") for q in ("int4-g64", "uint4-g32-act")]
    for c in rep["cases"]:
        assert list(c["forms"]) == ["bf16", "xla", "pallas:default", "pallas:split4"]
        assert all(r["us"] > 0 for r in c["forms"].values())
        for n in ("pallas:default", "pallas:split4"):
            assert c["forms"][n]["pass"] and c["forms"][n]["max_diff"] < 1e-2
        assert c["best"] in c["forms"] and c["best_over_xla"] > 0
    # (the small shape's q kernel, 256 x 256 int4 in groups of 64: 32 KiB of weights, 4 KiB of scales)
    assert rep["cases"][0]["weight_bytes"] == 256 * 256 // 2 + 4 * 256 * 4
    assert "| qkvo | int4-g64 | 8 | pallas:split4 |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_shape_the_kernel_does_not_take_is_a_row_s_error_not_the_run_s(tmp_path, monkeypatch):
    """A mode the kernel refuses at a kernel's shape (here every shape: `fits` says no) leaves
    its tilings' rows an error and the others timed."""
    monkeypatch.setattr(_quant_kernel, "fits", lambda *a, **k: False)
    out = tmp_path / "qsweep"
    assert quant_sweep.main(["--shape", "small", "--stand-in", "--kernels", "qkvo", "--quant", "int8-g64",
                             "--rows", "4", "--layers", "1", "--calls", "1", "--reps", "1", "--tilings", "default",
                             "--out", str(out)]) == 0
    (case,) = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert "us" in case["forms"]["xla"] and "us" in case["forms"]["bf16"]
    assert case["forms"]["pallas:default"]["error"] == "int8-g64 [256, 256]: not a shape the kernel takes"
    assert "best" not in case


def test_a_sweep_cut_short_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    """A lease part ends at its time limit, killed: the report is written after every case,
    so what ran before the kill is on disk (here the second case dies instead)."""
    def one_case(args, rep, target, kernel, mode, m, *rest):  # (a case without its compiles)
        timed = {"us": 2.0, "weight_gbps": 1.0}
        case = {"kernel": kernel, "quant": mode, "rows": m,
                "forms": {"xla": timed, "pallas:default": {**timed, "us": 1.0, "max_diff": 0.0}}}
        quant_sweep.summarize(case)
        return case

    monkeypatch.setattr(quant_sweep, "one_case", killed_after(1, one_case))
    out = tmp_path / "qsweep"
    with pytest.raises(KeyboardInterrupt):
        quant_sweep.main(["--shape", "small", "--stand-in", "--out", str(out)])
    rep = json.loads(out.with_suffix(".json").read_text())
    assert [c["kernel"] for c in rep["cases"]] == ["qkvo"] and not rep["complete"]
    assert "(cut short after 1 cases)" in out.with_suffix(".md").read_text()


def test_the_unquantized_kernel_is_timed_against_xla_s_gemm(tmp_path):
    """`--quant none`: the bfloat16 weights in XLA's GEMM (the xla form) and in the kernel read as
    they are (no bf16 row: it would be the xla one again), its product XLA's within the margin."""
    out = tmp_path / "qsweep"
    assert quant_sweep.main(["--shape", "small", "--stand-in", "--kernels", "qkvo", "--quant", "none", "--rows", "4",
                             "--layers", "1", "--calls", "1", "--reps", "1", "--tilings", "default", "split2",
                             "--out", str(out)]) == 0
    (case,) = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert list(case["forms"]) == ["xla", "pallas:default", "pallas:split2"]
    assert all(r["pass"] and r["max_diff"] < 1e-2 for n, r in case["forms"].items() if n != "xla")
    assert case["weight_bytes"] == 256 * 256 * 2 and case["best"] in ("pallas:default", "pallas:split2")

"""benchmarks/kernel_sweep.py: the attention kernel's tilings timed against the split form.
What a lease would read from it (which tiling to make the default) is only worth its device
time if each tiling is the kernel under that tiling, a tiling that computes wrong attention is
not a candidate, and the fastest named is the fastest of those that pass."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_sweep  # noqa: E402
from tests.benchmarks._cut import docs_argv, killed_after  # noqa: E402
from dlm_jax.models._attention_kernel import DEFAULT_TILING, Tiling  # noqa: E402


def test_tilings_are_presets_or_key_value_lists():
    assert kernel_sweep.tiling("default") == ("default", DEFAULT_TILING)
    assert kernel_sweep.tiling("k128")[1] == Tiling(block_k=128)
    assert kernel_sweep.tiling("rows=32,stacked=64,k=128,warps=8,stages=2")[1] == Tiling(
        rows=32, stacked_rows=64, block_k=128, warps=8, stages=2)
    for bad, says in (("fast", "a preset"), ("k=twenty", "a preset"), ("k=24", "block_k=24"), ("warps=3", "warps=3")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            kernel_sweep.tiling(bad)
    with pytest.raises(SystemExit):  # a tiling named twice would be one row over the other
        kernel_sweep.main(["--tilings", "k32", "k32", "--stand-in", "--out", "/tmp/unused"])


def test_the_fastest_named_is_the_fastest_within_the_margins():
    """A faster tiling whose error strays past the margins (a wrong kernel) is not chosen."""
    def row(us, mean=1e-3, top=1e-2):
        return {"us_per_layer": us, "mean_error": mean, "max_error": top, "finite": True}

    case = {"forms": {"split": row(10.0), "pallas:default": row(8.0, 0.9e-3), "pallas:k32": row(4.0, 5e-3),
                      "pallas:k128": row(6.0), "pallas:warps8": {"error": "ValueError: shared memory"}}}
    kernel_sweep.summarize(case)
    assert [case["forms"][n]["pass"] for n in case["forms"]] == [True, True, False, True, False]
    assert case["best"] == "pallas:k128"
    assert case["best_over_split"] == pytest.approx(0.6) and case["best_over_default"] == pytest.approx(0.75)
    assert case["default_over_split"] == pytest.approx(0.8)


@pytest.mark.slow  # (about 10 s in Pallas's interpreter)
def test_a_stand_in_sweep_reports_every_form_of_every_case(tmp_path):
    """docs/benchmarks.md's stand-in command, its --out here."""
    out = tmp_path / "sweep"
    assert kernel_sweep.main(docs_argv("benchmarks/kernel_sweep.py", "--stand-in", out=str(out))) == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    assert rep["mode"] == "stand-in" and [(c["kind"], c["batch"]) for c in rep["cases"]] == [("dual", 2), ("prefix", 2)]
    for c in rep["cases"]:
        assert list(c["forms"]) == ["split", "pallas:default", "pallas:k32"]
        assert all(r["pass"] and r["us_per_layer"] > 0 for r in c["forms"].values())
        # both tilings compute the same attention (other blocks: float32 sums in other orders)
        assert c["forms"]["pallas:default"]["mean_error"] == pytest.approx(
            c["forms"]["pallas:k32"]["mean_error"], rel=0.05)
        assert c["best"] in c["forms"] and c["best_over_split"] > 0
    # (4 heads over 2 K/V heads of 16; the dual step reads 64 - 16 slots, keys and values in bfloat16)
    assert rep["cases"][0]["cache_bytes"] == 2 * 2 * 48 * 16 * 2 * 2
    assert "| small | 2 | prefix | pallas:default |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_sweep_cut_short_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    """A lease part ends at its time limit, killed: the report is written after every case,
    so what ran before the kill is on disk (here the second case dies instead)."""
    def one_case(args, rep, target, forms, shape, batch, kind, *rest):  # (a case without its compiles)
        row = {"us_per_layer": 1.0, "cache_gbps": 1.0, "mean_error": 1e-3, "max_error": 1e-2, "finite": True}
        case = {"shape": shape, "batch": batch, "kind": kind, "forms": {"split": row, "pallas:default": dict(row)}}
        kernel_sweep.summarize(case)
        return case

    monkeypatch.setattr(kernel_sweep, "one_case", killed_after(1, one_case))
    out = tmp_path / "sweep"
    with pytest.raises(KeyboardInterrupt):
        kernel_sweep.main(["--shape", "small", "--stand-in", "--batches", "1", "--out", str(out)])
    rep = json.loads(out.with_suffix(".json").read_text())
    assert [c["kind"] for c in rep["cases"]] == ["dual"] and not rep["complete"]
    assert "(cut short after 1 cases)" in out.with_suffix(".md").read_text()

"""`benchmarks/gpu_decide.py`: the lease's choice of the GPU's attention form and projections.

A lease measures the table once, in the form its `decide` part chose: a kernel chosen for its
speed though it computes wrong attention, or a choice made on noise, would be measured and
then made the default. The reports here are shaped as `gpu_step.py` and `attention_check.py`
write them (the fields the decision reads)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_decide  # noqa: E402

STEPS = [(1, "dual"), (8, "dual")]


def steps_report(times: dict[tuple[str, str], tuple[float, float] | str], shape: str = "llada-8b") -> dict:
    """A gpu_step.py report: per (attention, projections) the step ms at b1 and b8 dual, or an
    error (the variant's executor refused, as gpu_step.py records it)."""
    cases = []
    for (attention, projections), ms in times.items():
        if isinstance(ms, str):
            cases.append({"attention": attention, "quant": "none", "layers": None, "projections": projections,
                          "error": ms})
            continue
        for (batch, kind), t in zip(STEPS, ms):
            cases.append({"batch": batch, "kind": kind, "attention": attention, "quant": "none",
                          "layers": "unrolled", "projections": projections, "step_ms": t})
    cases.append({"batch": 1, "kind": "dual", "attention": "pallas", "quant": "int8", "layers": "unrolled",
                  "projections": "fused", "step_ms": 0.1})  # (another weight format: never a candidate)
    return {"shape": shape, "command": "benchmarks/gpu_step.py ...", "device": {"kind": "NVIDIA H200", "backend": "gpu"},
            "cases": cases}


def check_report(pallas_mean: float = 1.0e-3, shape: str = "llada-8b") -> dict:
    form = {"finite": True, "mean_error": 1.0e-3, "max_error": 1.0e-2, "blind_rows_mean_error": 1.0e-3}
    return {"command": "benchmarks/attention_check.py --out x", "pass": pallas_mean <= 1.15e-3,
            "margins": {"mean": 1.15, "max": 2.0},
            "cases": [{"shape": shape, "batch": b, "kind": k,
                       "forms": {"split": form, "pallas": form | {"mean_error": pallas_mean}}}
                      for b in (1, 8) for k in ("dual", "prefix")]}


def run(tmp_path: Path, steps: dict, check: dict | None, capsys) -> tuple[int, str, str, dict | None]:
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    argv = ["--steps", str(tmp_path / "steps.json"), "--out", str(tmp_path / "decide")]
    if check is not None:
        (tmp_path / "check.json").write_text(json.dumps(check))
        argv += ["--check", str(tmp_path / "check.json")]
    rc = gpu_decide.main(argv)
    out, err = capsys.readouterr()
    written = tmp_path / "decide.json"
    return rc, out, err, json.loads(written.read_text()) if written.exists() else None


FAST_KERNEL = {("split", "separate"): (7.0, 15.0), ("split", "fused"): (6.8, 14.5),
               ("pallas", "separate"): (6.0, 12.0), ("pallas", "fused"): (5.8, 11.6)}


def test_the_fastest_checked_variant_is_chosen(tmp_path, capsys):
    rc, out, _, d = run(tmp_path, steps_report(FAST_KERNEL), check_report(), capsys)
    assert rc == 0 and out == "ATTENTION=pallas PROJECTIONS=fused\n"
    best = next(v for v in d["variants"] if (v["attention"], v["projections"]) == ("pallas", "fused"))
    assert best["score"] == pytest.approx(((5.8 / 7.0) * (11.6 / 15.0)) ** 0.5)
    assert d["steps"] == ["b1 dual", "b8 dual"] and all(v["candidate"] for v in d["variants"])
    md = (tmp_path / "decide.md").read_text()
    assert "| pallas | fused | 5.80 | 11.60 |" in md and "Choice: pallas / fused" in md


def test_a_kernel_the_check_failed_or_never_ran_is_not_chosen_for_its_speed(tmp_path, capsys):
    rc, out, _, d = run(tmp_path, steps_report(FAST_KERNEL), check_report(pallas_mean=1.2e-3), capsys)
    assert rc == 0 and out == "ATTENTION=split PROJECTIONS=fused\n"  # (the next fastest: 3% under the baseline)
    pallas = [v for v in d["variants"] if v["attention"] == "pallas"]
    assert pallas and all(not v["candidate"] and v["why_not"].startswith("failed the attention check (b1 dual")
                          for v in pallas)
    for check in (None, check_report(shape="gqa-8b")):  # no check, or none at the steps' shape
        rc, out, _, d = run(tmp_path, steps_report(FAST_KERNEL), check, capsys)
        assert out == "ATTENTION=split PROJECTIONS=fused\n"
        assert {v["why_not"] for v in d["variants"] if v["attention"] == "pallas"} == {
            "no attention check" if check is None else "the attention check has no llada-8b case of pallas"}


def test_a_variant_within_the_margin_or_untimed_leaves_the_baseline(tmp_path, capsys):
    steps = steps_report({("split", "separate"): (7.0, 15.0), ("split", "fused"): (6.9, 14.7),  # 1.7% faster: noise
                          ("pallas", "separate"): "ConfigError: attention='pallas': ..."})
    steps["cases"] += [  # the kernel over fused projections: fast at batch 1, failed at 8
                       {"batch": 1, "kind": "dual", "attention": "pallas", "quant": "none", "layers": "unrolled",
                        "projections": "fused", "step_ms": 1.0},
                       {"batch": 8, "kind": "dual", "attention": "pallas", "quant": "none", "layers": "unrolled",
                        "projections": "fused", "error": "XlaRuntimeError: RESOURCE_EXHAUSTED"}]
    rc, out, _, d = run(tmp_path, steps, check_report(), capsys)
    assert rc == 0 and out == "ATTENTION=split PROJECTIONS=separate\n"
    why = {(v["attention"], v["projections"]): v.get("why_not") for v in d["variants"]}
    assert why[("pallas", "fused")] == "untimed: b8 dual (XlaRuntimeError: RESOURCE_EXHAUSTED)"
    assert why[("pallas", "separate")].startswith("untimed: b1 dual, b8 dual (ConfigError")
    assert "no candidate is 3% faster than the baseline" in d["reason"]


def test_without_a_timed_baseline_nothing_is_decided(tmp_path, capsys):
    rc, out, err, d = run(tmp_path, steps_report({("split", "separate"): "XlaRuntimeError: out of memory",
                                                  ("pallas", "fused"): (5.0, 10.0)}), check_report(), capsys)
    assert rc == 1 and out == "" and d["choice"] is None
    assert err == "gpu_decide: the baseline split/separate was not timed (XlaRuntimeError: out of memory): nothing decided\n"
    rc = gpu_decide.main(["--steps", str(tmp_path / "missing.json"), "--out", str(tmp_path / "none")])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and "no steps report" in err and not (tmp_path / "none.json").exists()

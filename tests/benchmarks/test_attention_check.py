"""benchmarks/attention_check.py on the CPU, with JAX's XLA attention standing in for cuDNN's
and the Pallas kernel in Pallas's interpreter.

A GPU lease runs it against cuDNN and Triton themselves before it times the "cudnn_split" and
"pallas" forms: the check is
only worth that device time if it passes a correct merge and fails a wrong one, and if its
report names every form with its errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import attention_check  # noqa: E402
from tests.benchmarks._cut import killed_after  # noqa: E402


@pytest.mark.slow  # (7 s; each form against the split one: tests/executors/test_in_place_attention.py, by default)
def test_the_forms_pass_against_float32_with_xla_standing_in_for_cudnn(tmp_path):
    out = tmp_path / "check"
    assert attention_check.main(["--shape", "small", "--batches", "1", "2", "--stand-in", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["pass"] and "standing in" in report["cudnn"] and "interpreter" in report["pallas"]
    assert report["shapes"] == {"small": [4, 2, 16]}  # (2 query heads a K/V head: one program's, in the kernel)
    assert [(c["batch"], c["kind"]) for c in report["cases"]] == [(1, "dual"), (1, "prefix"), (2, "dual"), (2, "prefix")]
    for case in report["cases"]:
        assert list(case["forms"]) == ["split", "cudnn", "cudnn_split", "pallas"]
        for form in case["forms"].values():
            assert form["finite"] and 0 < form["mean_error"] <= form["max_error"] < 0.05  # bfloat16, not float32
        # A row that sees no cache slot has only the window: cudnn_split's merge gives it the window's own output.
        assert case["forms"]["cudnn_split"]["blind_rows_mean_error"] == case["forms"]["cudnn"]["blind_rows_mean_error"]
    assert "| small | 2 | prefix | cudnn_split |" in out.with_suffix(".md").read_text()
    assert "| small | 2 | prefix | pallas |" in out.with_suffix(".md").read_text()


@pytest.mark.slow  # (5 s in the default pass's crowd; the verdict's own rules are checked below by default)
def test_a_wrong_merge_fails_the_check(tmp_path, monkeypatch):
    """Weights exp((lse - top) / 2) instead of exp(lse - top): the merged output strays, and
    the check exits 1 naming the failing steps."""
    from dlm_jax.models import _transformer

    right = _transformer.merge_attention

    def halved(parts):
        return right([(out, lse / 2) for out, lse in parts])

    monkeypatch.setattr(_transformer, "merge_attention", halved)
    jax.clear_caches()  # (the forms' traces from an earlier test would hold the right merge)
    out = tmp_path / "check"
    try:
        assert attention_check.main(["--shape", "small", "--batches", "1", "--stand-in", "--out", str(out)]) == 1
    finally:
        jax.clear_caches()  # (nor may a later test's trace keep the wrong one)
    report = json.loads(out.with_suffix(".json").read_text())
    assert not report["pass"] and not any(c["pass"] for c in report["cases"])
    assert "Result: FAIL" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("bad", ["nan", "error"])
def test_a_form_that_is_not_finite_or_fails_fails_the_verdict(bad):
    good = {"mean_error": 1e-3, "max_error": 1e-2, "blind_rows_mean_error": 1e-3, "finite": True}
    rows = {"split": good, "cudnn": good, "cudnn_split": dict(good)}
    assert attention_check.verdict(rows)
    rows["cudnn_split"] = {"error": "XlaRuntimeError: ..."} if bad == "error" else good | {"finite": False}
    assert not attention_check.verdict(rows)


def test_without_a_gpu_it_asks_for_the_stand_in_in_one_line(tmp_path, capsys):
    """On a CPU without `--stand-in` only the split form could run: a pass would say nothing
    about cuDNN, so the script stops (argparse's status 2) naming the way out."""
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU runs cuDNN's forms")
    with pytest.raises(SystemExit) as exit_:
        attention_check.main(["--shape", "small", "--out", str(tmp_path / "check")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("the cuDNN and Pallas forms need a GPU and JAX's backend here is 'cpu'; --stand-in runs "
                        "JAX's XLA attention in cuDNN's place and the kernel in Pallas's interpreter")
    assert not (tmp_path / "check.json").exists()


def test_a_check_cut_short_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    """A lease part ends at its time limit, killed: the report is written after every case, so
    what ran before the kill is on disk, marked incomplete (here the second case dies instead)."""
    monkeypatch.setattr(attention_check, "verdict", killed_after(1, attention_check.verdict))
    split = attention_check.forms()["split"]
    monkeypatch.setattr(attention_check, "forms", lambda: {"split": split})  # (one form a case: quicker)
    out = tmp_path / "check"
    with pytest.raises(KeyboardInterrupt):
        attention_check.main(["--shape", "small", "--batches", "1", "--stand-in", "--out", str(out)])
    report = json.loads(out.with_suffix(".json").read_text())
    assert [c["kind"] for c in report["cases"]] == ["dual"] and not report["complete"]
    assert "cut short: the 1 cases above only" in out.with_suffix(".md").read_text()

"""`benchmarks/logits_host.py` times every host path that works on a step's logits, and writes
its report atomically."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import logits_host  # noqa: E402


@pytest.mark.slow  # (5 s: a benchmark script's run, as the others')
def test_logits_host_reports_every_case(tmp_path):
    assert logits_host.main(["--vocab", "300", "--rows", "4", "--repeats", "1", "--out", str(tmp_path / "lh")]) == 0
    rep = json.loads((tmp_path / "lh.json").read_text())
    assert [c["case"] for c in rep["cases"]] == [name for name, *_ in logits_host.CASES]
    # an engine call of 8 requests: 8 device calls of [5, 1, R] answers, or one of [5, 8, R]
    call = rep["call"]
    assert (call["per_request_calls"], call["together_calls"]) == (8, 1)
    assert call["per_request_bytes"] == call["together_bytes"] == 8 * 5 * 4 * 4
    assert [c["host_bytes"] for c in rep["cases"]] == [0] + [4 * 300 * 4] * (len(logits_host.CASES) - 1)
    # beside the step, only the answers: [5, 1, R] int32 a proposal, [m, 1 + 2k] a record of m slots
    assert [c["device_bytes"] for c in rep["cases"]] == [0, 80, 80, 80, 80, 80, 4, 4 * 4 * 11, 4 * 4 * 11, 4 * 4 * 41]
    assert all(c["host_ms"] >= 0 and c["device_ms"] >= 0 for c in rep["cases"]) and rep["backend"] == "cpu"
    md = (tmp_path / "lh.md").read_text()
    assert all(f"| {name} |" in md for name, *_ in logits_host.CASES) and "vocabulary 300" in md
    assert "An engine call of 8 sampling requests" in md
    # ISD's acceptance of 3 drafts (stride 4): the verify step's 7 rows, or [6, 4] int32 answers (4: 3 padded)
    assert [c["case"] for c in rep["judge"]] == [name for name, *_ in logits_host.JUDGES]
    assert [(c["host_bytes"], c["device_bytes"]) for c in rep["judge"]] == [(7 * 300 * 4, 6 * 4 * 4)] * 4
    assert all(f"| {name} |" in md for name, *_ in logits_host.JUDGES) and "3 drafts (stride 4)" in md

"""benchmarks/generate_call.py on the shipped tiny model: the three ways decode the same answers,
and the engine at the model's limits is the large pool a generate call used to allocate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import generate_call  # noqa: E402
import pytest  # noqa: E402


@pytest.mark.slow
def test_one_run_times_the_three_ways_on_the_same_answers(tmp_path):
    out = tmp_path / "call"
    assert generate_call.main(["--models", "llada-tiny", "--prompts", "1", "--reps", "2", "--gen", "32",
                               "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    (case,) = report["cases"]
    assert case["same_tokens"] and set(case["seconds"]) == set(generate_call.WAYS)
    assert all(len(s) == 2 for s in case["all_seconds"].values())
    rows, slots = case["pool_at_limits"]
    assert rows > 1 and slots >= 512  # the old default: a pool far larger than one prompt's row
    assert case["generate_over_decode"] == case["seconds"]["generate"] / case["seconds"]["decode"]
    assert "| llada-tiny | 1 |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").stat().st_size

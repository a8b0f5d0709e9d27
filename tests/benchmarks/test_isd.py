"""`benchmarks/isd.py` runs end to end on a slice of the prompts and reports every target."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import isd  # noqa: E402


@pytest.mark.slow
def test_isd_benchmark_reports_its_targets(tmp_path):
    rows, single = isd.run(str(ROOT / "models" / "idlm-tiny"), 2, ["addition"], ["jax"], latency_n=1)
    targets = isd.targets(rows, single)
    assert targets["greedy_identical_everywhere"] is True
    assert {r["stride"] for r in rows} == {1, 2, 3, 4, 5}
    assert {r["relax"] for r in rows} == {0.0, 0.1, 0.2, 0.5, 1.0}
    assert [r["stride"] for r in single] == [1, 2, 3, 4, 5]
    assert all(1.0 <= r["tpf"] <= r["stride"] for r in rows)
    md = isd.markdown(rows, ["addition"], {"model": "idlm-tiny", "n": 2, "machine": {}}, single)
    assert md.count("| isd stride 4") >= 1 and "Single requests" in md
    isd.plot(rows, tmp_path / "isd.png")
    assert (tmp_path / "isd.png").stat().st_size > 0

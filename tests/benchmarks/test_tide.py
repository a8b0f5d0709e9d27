"""`benchmarks/tide.py` runs end to end on a slice of the prompts and reports every target."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tide  # noqa: E402


@pytest.mark.slow
def test_tide_benchmark_reports_its_targets(tmp_path):
    result = tide.run(str(ROOT / "models" / "moe-tiny"), 2, 1, ["sorting", "gsm_lite"], 64, 10.0, blocks=(32,),
                      thresholds=(0.95,))
    targets = result["targets"]
    assert targets["split_measured_tokens_identical"] is True
    assert set(targets["sparse_dispatch_3x"]) == {"mask block", "varied tokens"}
    assert 0.0 < targets["similarity_lag1"]["mean"] <= 1.0 + 1e-9
    (entry,) = result["settings"]
    assert [b["routed_resident"] for b in entry["budgets"]] == [4, 8, 16]
    for b in entry["budgets"]:  # every placement priced, tau* from the exhaustive solver
        assert set(b["rows"]) == {"tide (current)", "tide (previous)", "tau=1 (per-step)", "static", "random tau"}
        assert b["tau_star"] >= 1 and (b["d"] is None or 0.0 <= b["d"] <= 1.0)
    assert [r["io_factor"] for r in result["io_sweep"]] == list(tide.IO_FACTORS)
    md = tide.markdown(result, {"model": "moe-tiny", "machine": {}, "command": "test"})
    assert "## Split execution" in md and "## Targets" in md
    tide.plot(result, tmp_path / "tide.png")
    assert (tmp_path / "tide.png").stat().st_size > 0

"""`benchmarks/powerinfer_sim.py` runs end to end on a tiny sparse model: traces recorded from real
decodes, the Fig 14 ablation simulated for W = 1 and for dLLM windows, JSON + Markdown + PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["baseline", "+bundle", "+cache", "+pipeline", "+XPU"]


@pytest.mark.slow  # ~20 s: decodes, trains a predictor, simulates two traces
def test_powerinfer_sim_benchmark_runs_and_reports(tmp_path):
    from dlm_jax.testing import tiny_checkpoint

    model = tiny_checkpoint(tmp_path / "m", seed=1, ffn="reglu", ffn_hidden=256, max_seq_len=256)
    # a random model's FFN is ~half active per token: 50% of it in memory cannot hold one token's neurons
    out = tmp_path / "results" / "sim"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "powerinfer_sim.py"), "--model", str(model),
                    "--calibration", "1", "--n", "1", "--predictor-steps", "20", "--offload", "0.25", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=900)
    result = json.loads(out.with_suffix(".json").read_text())
    for regime in ("ar", "dllm"):
        runs = result["regimes"][regime]["runs"]
        assert [r["name"] for r in runs][:5] == STAGES and runs[5]["name"] == "+pipeline (matrix-level)"
        assert all(r["tokens_per_s"] > 0 and 0 <= r["io_share"] <= 1 and r["bytes_written"] == 0 for r in runs)
        assert runs[3]["tokens_per_s"] >= runs[5]["tokens_per_s"] * (1 - 1e-9)  # cluster-level >= matrix-level
    assert result["regimes"]["ar"]["trace"]["window_max"] == 1 and result["regimes"]["dllm"]["trace"]["window_max"] > 1
    md = out.with_suffix(".md").read_text()
    assert "Simulated, not measured" in md and "## dLLM windows" in md
    assert out.with_suffix(".png").stat().st_size > 0

"""`benchmarks/powerinfer.py` runs end to end on a tiny sparse model and reports every table:
the sparsity by window, the predictor, the throughput runs with their baselines and phone
projection, the accuracy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about a minute: exports five bundles
def test_powerinfer_benchmark_runs_and_reports(tmp_path):
    from dlm_jax.testing import tiny_checkpoint

    model = tiny_checkpoint(tmp_path / "m", seed=1, ffn="reglu", ffn_hidden=256, max_seq_len=256)
    out = tmp_path / "results" / "pi"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "powerinfer.py"), "--model", str(model), "--n", "1",
                    "--stats-n", "2", "--eval-n", "1", "--calibration", "2", "--predictor-steps", "20",
                    "--repeats", "2", "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=900)
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["sparsity"]["density"]) == {"1", "2", "4", "8", "16", "32"}
    kinds = {(r["kind"], r["budget"]) for r in result["runs"]}
    assert ("dense", 1.0) in kinds and {("engine", 1.0), ("llmflash", 1.0), ("mmap", 1.0)} <= kinds
    engine = next(r for r in result["runs"] if r["kind"] == "engine")
    assert engine["cold"]["misses"] + engine["cold"]["prefetched"] > 0 and engine["phone"]["s_per_token"] > 0
    assert all(len(r["seconds_runs"]) == 2 and r["seconds"] == min(r["seconds_runs"]) for r in result["runs"])
    assert next(r for r in result["runs"] if r["kind"] == "mmap")["tokens_equal_dense"] is True
    assert set(result["accuracy"]) == {"dense", "oracle", "predictor"}
    assert out.with_suffix(".png").stat().st_size > 0 and "## Throughput" in out.with_suffix(".md").read_text()
    assert not list(out.parent.glob("dlm-jax-powerinfer-*"))  # its bundles are removed

"""`benchmarks/npu_quant.py` runs end to end on a tiny model: every scheme exported as a
partitioned bundle, scored against the float32 bundle, sized and timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about a minute: exports four bundles
def test_npu_quant_benchmark_runs_and_reports(tmp_path):
    from dlm_jax.testing import tiny_checkpoint

    model = tiny_checkpoint(tmp_path / "m", seed=1, ffn="reglu", ffn_hidden=96, max_seq_len=256)
    out = tmp_path / "results" / "nq"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "npu_quant.py"), "--models", str(model), "--n", "1",
                    "--speed-n", "1", "--repeats", "1", "--out", str(out)], check=True, cwd=ROOT, capture_output=True,
                   timeout=900)
    rows = json.loads(out.with_suffix(".json").read_text())["models"][str(model)]
    assert list(rows) == ["float32, unpartitioned bundle", "float32", "int8 (LiteRT, whole model)", "int4 per channel (no outliers)",
                          "int4 + int8 outliers (1%)"]
    assert rows["float32"]["same_as_float"] == 1.0  # partitioned float32 decodes as the unpartitioned bundle
    assert rows["int4 + int8 outliers (1%)"]["npu_weight_bytes"] < rows["float32"]["npu_weight_bytes"] / 4
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert out.with_suffix(".png").stat().st_size > 0 and "NPU weights" in out.with_suffix(".md").read_text()

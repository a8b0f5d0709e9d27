"""`benchmarks/mesh.py --small`: every mesh decodes the one-device tokens, and the per-device
bytes it reports are the shards' (weights and K/V split by tp, the dense kernels evenly)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # (tests/executors/test_mesh.py checks mesh decodes in the default pass)
def test_small_run_reports_identical_tokens_and_split_memory(tmp_path):
    out = tmp_path / "mesh"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mesh.py"), "--small", "--tp", "1", "2", "8",
                           "--gen", "32", "--persistent-cache", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.with_suffix(".json").read_text())
    assert json.loads(proc.stdout) == rep  # the JSON printed is the JSON written
    assert out.with_suffix(".png").stat().st_size > 0
    md = out.with_suffix(".md").read_text()
    assert "not a speed claim" in md and "| tp=8 |" in md
    assert rep["environment"]["devices"] == 8 and rep["tp_skipped"] == []
    base, *meshes = rep["rows"]
    assert base["mesh"] is None and [r["tp"] for r in meshes] == [1, 2, 8]
    assert rep["identical"] is True
    for r in meshes:
        assert r["identical"] is True and r["tokens"] == base["tokens"] and r["nfe"] == base["nfe"]
        assert r["devices"] == r["tp"] and r["weights_bytes_total"] == base["weights_bytes_total"]
        # Each device holds 1/tp of every dense kernel, and 1/tp of the K/V heads.
        assert r["dense_kernel_ratio_min"] == r["dense_kernel_ratio_max"] == 1.0
        assert r["kv_bytes_min"] * r["tp"] == r["kv_bytes_max"] * r["tp"] == base["kv_bytes_max"]
        assert base["weights_bytes_max"] / r["tp"] <= r["weights_bytes_max"] < base["weights_bytes_max"] / r["tp"] * 1.2
        assert r["step_ms_median"] > 0 and r["compiles"] > 0
    assert len(base["tokens"]) <= 32 and base["nfe"] >= 1

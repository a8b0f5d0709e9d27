"""`benchmarks/engine_host.py` reports the engine's host time per request-step and per
submit, in fresh processes, and against an older commit's copy of the package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine_host  # noqa: E402


@pytest.fixture
def own_caches(tmp_path, monkeypatch):
    for name in ("JAX_COMPILATION_CACHE_DIR", "DLM_JAX_CACHE_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "xla"))


@pytest.mark.slow  # (6 s: a benchmark script's run, in the slow pass as the others are)
def test_engine_host_reports_each_batch(tmp_path, own_caches):
    assert engine_host.main(["--batches", "1", "2", "--repeats", "1", "--out", str(tmp_path / "eh")]) == 0
    rep = json.loads((tmp_path / "eh.json").read_text())
    assert [r["batch"] for r in rep["rows"]] == [1, 2] and rep["base"] is None
    for row in rep["rows"]:
        tree = row["tree"]
        # one token committed per step: every request takes gen_len steps
        assert tree["request_steps"] == row["batch"] * engine_host.GEN
        assert tree["host_us_per_request_step"] > 0 and tree["submit_ms"] > 0
        assert 0 < tree["host_share_of_tick"] < 1 and len(tree["tokens"]) == 1
        assert "base" not in row and "ratios" not in row
    md = (tmp_path / "eh.md").read_text()
    assert "| 1 | working tree |" in md and "| 2 | working tree |" in md and "over the base" not in md


@pytest.mark.slow
def test_engine_host_against_a_commit_decodes_the_same_tokens(tmp_path, own_caches):
    assert engine_host.main(["--base", "HEAD", "--batches", "2", "--repeats", "2", "--out", str(tmp_path / "eh")]) == 0
    row = json.loads((tmp_path / "eh.json").read_text())["rows"][0]
    assert row["same_tokens"] and row["base"]["request_steps"] == row["tree"]["request_steps"] == 2 * engine_host.GEN
    assert set(row["ratios"]) == {"host_us_per_request_step", "submit_ms"} and all(v > 0 for v in row["ratios"].values())
    assert "Working tree over the base" in (tmp_path / "eh.md").read_text()

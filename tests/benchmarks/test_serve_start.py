"""`benchmarks/serve_start.py`: a cold server's readiness, full against tiered, read off the real
server's ready line and /metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_start  # noqa: E402
from tests.benchmarks._cut import docs_argv  # noqa: E402


def test_the_ready_line_is_read_as_the_server_prints_it():
    assert serve_start.ready_counts("ready: 55 programs built in 43.8 s\n") == {
        "programs": 55, "warmup_seconds": 43.8, "quick": 0, "behind": 0}
    line = "ready: 13 programs built in 6.7 s (13 compiled quick: their full compiles build behind, 41 more build behind)"
    assert serve_start.ready_counts(line) == {"programs": 13, "warmup_seconds": 6.7, "quick": 13, "behind": 41}
    with pytest.raises(ValueError, match="not a ready line"):
        serve_start.ready_counts("serving on http://127.0.0.1:1")


@pytest.mark.slow  # (two servers of their own from empty compile caches: about 30 s)
def test_a_tiered_server_is_ready_sooner_answers_the_same_and_builds_the_rest_behind(tmp_path):
    """docs/benchmarks.md's small command, its --out here: reading the cache in place, the
    tiered server reports ready with fewer programs built than the full one, counts the ones it
    left behind, builds them all (no compile pending) and answers as the full one, both passes."""
    out = tmp_path / "start"
    argv = docs_argv("benchmarks/serve_start.py", "--requests 2", out=str(out))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_start.py"), *argv], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rep = json.loads(out.with_suffix(".json").read_text())
    full, tiered = rep["runs"]
    assert (full["compile"], tiered["compile"]) == ("full", "tiered")
    assert full["quick"] == full["behind"] == 0 and full["built_seconds"] is not None
    assert 0 < tiered["programs"] < full["programs"] and tiered["quick"] == tiered["programs"]
    assert tiered["behind"] > 0 and tiered["programs"] + tiered["behind"] <= full["programs"]
    assert tiered["built_seconds"] is not None and tiered["ready_seconds"] < tiered["built_seconds"]
    for r in (full, tiered):
        assert r["same_as_first_setting"] and r["second_pass_same"] and len(r["answers"]) == 2
        assert r["server_exit_code"] == 0 and r["server_log_tracebacks"] == 0
    md = out.with_suffix(".md").read_text()
    assert f"| tiered | split | {tiered['ready_seconds']:.1f} | {tiered['programs']} ({tiered['quick']} / " in md
    assert out.with_suffix(".png").stat().st_size > 0

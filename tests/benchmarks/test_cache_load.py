"""benchmarks/cache_load.py at a small shape: the processes it compares load every program
from the cache the first one filled (a variant that compiled instead would be timing a
compile), and its report gives each part of the wait per program and variant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # three processes, each loading the programs: about 6 s
def test_both_variants_load_every_program_from_the_filled_cache(tmp_path):
    out = tmp_path / "cache_load"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cache_load.py"), "--shape", "small",
                           "--at", "0", "1", "--repeats", "1", "--xla-cache", str(tmp_path / "xla"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rep = json.loads(out.with_suffix(".json").read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == rep
    # (read in place, both in the cache's 512 slots as their read bucket: JaxExecutor.read_bucket)
    assert [r["program"] for r in rep["programs"]] == ["prefix b1_w256_p512_r32", "prefix b1_w224_p512_r32"]
    for row in rep["programs"]:
        for v in ("once", "plain"):
            parts = [row[f"{v}_{k}"] for k in ("trace_s", "lower_s", "load_s")]
            assert all(p > 0 for p in parts) and abs(sum(parts) - row[f"{v}_total_s"]) < 1e-9
    assert abs(rep["once_over_plain"] - rep["totals"]["once_total_s"] / rep["totals"]["plain_total_s"]) < 1e-9
    assert "| all |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").stat().st_size > 0


def test_a_process_that_compiles_instead_of_loading_fails_the_run(tmp_path, monkeypatch):
    """A load that missed the cache is a compile: the run stops naming it, and writes nothing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cache_load

    def fake(args, variant):
        hit = variant != "plain"
        return {"variant": variant, "import_s": 0.1, "jax": "x", "device": "cpu: cpu",
                "programs": [{"program": "prefix b1_w32_p32_r32", "trace_s": 0.1, "lower_s": 0.1, "load_s": 0.1,
                              "hit": hit}]}

    monkeypatch.setattr(cache_load, "run_child", fake)
    out = tmp_path / "r"
    try:
        cache_load.main(["--shape", "small", "--repeats", "1", "--out", str(out)])
    except SystemExit as e:
        assert "plain process compiled prefix b1_w32_p32_r32" in str(e)
    else:
        raise AssertionError("a missed load was timed as a load")
    assert not out.with_suffix(".json").exists()

"""benchmarks/first_decode.py: the first decode of a fresh process, and later decodes of other
prompt lengths in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import first_decode  # noqa: E402
from tests.benchmarks._cut import docs_argv  # noqa: E402


@pytest.mark.slow  # (a process of its own: about 15 s from an empty cache)
def test_later_prompts_of_other_lengths_compile_only_their_new_windows(tmp_path):
    """docs/benchmarks.md's command, its --out and --xla-cache here: the in-place form on a
    CPU, a 128-token prompt first, then 40 and 200 tokens on the same 512 slots. Each later
    decode compiles its refresh's window (prompt + generation: 296 and 456 slots, window
    buckets 320 and 512, where the first decode's is 384) and at most a step the first decode
    skipped (a block it committed in its refresh); every step that reads the cache runs in
    read bucket 512 (`JaxExecutor.read_bucket`), where a read bucket a program compiled 3 and
    6. Then --render's report lists them."""
    out = tmp_path / "first"
    argv = docs_argv("benchmarks/first_decode.py", "--prompt-lens", out=str(out), xla_cache=str(tmp_path / "xla"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "first_decode.py"), *argv], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert run["attention"] == "split" and run["xla_cache_empty_at_start"] and run["same_tokens"]
    assert run["first_compiles"] > 2
    for x, window in zip(run["later"], ("w320", "w512")):
        assert x["nfe"] > 0 and x["seconds"] > 0
        assert f"b1_{window}_p0_r32" in x["new_buckets"] and x["compiles"] <= 2, x
        assert all("_p0_" in b or "_p512_" in b for b in x["new_buckets"]), x
    assert first_decode.main(["--render", str(out.with_suffix(".json")), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "prefix cache, - (split, prompt 128 first): 40: " in report and "200: " in report


@pytest.mark.slow  # (two processes of their own: about 20 s from an empty cache)
def test_a_tiered_first_decode_and_a_second_process_over_its_cache(tmp_path):
    """docs/benchmarks.md's tiered command, its --out and --xla-cache here, run twice: the
    first process decodes on quick programs, and in wider windows' programs, while the full
    compiles build behind, and keeps its tokens on the full ones; the second, over the cache
    the first filled, compiles no quick program (the full ones come from the cache by the
    first's markers)."""
    out = tmp_path / "tiered"
    argv = docs_argv("benchmarks/first_decode.py", "--compile", out=str(out), xla_cache=str(tmp_path / "xla"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(2):
        result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "first_decode.py"), *argv], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    cold, cache = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert cold["compile"] == cache["compile"] == "tiered"
    assert cold["xla_cache_empty_at_start"] and not cache["xla_cache_empty_at_start"]
    first, steps = cold["tiers_after_first"], cold["tiers_upgraded"]["full"]
    assert steps >= 5 and cold["tiers_upgraded"]["quick"] == 0 and cold["tiers_upgraded"]["pending"] == 0
    assert first["upgrades"] + first["behind"] + first["pending"] == steps
    assert first["quick"] + first["full"] <= 3 < steps and first["widened"] > 0  # (the prefix cache's narrower windows)
    assert cold["upgrades_done"] and cold["upgraded_same_tokens"] and cold["same_tokens"]
    assert cache["tiers_after_first"]["quick"] == cache["tiers_after_first"]["upgrades"] == 0
    assert cache["tiers_upgraded"]["full"] == steps and cache["tiers_upgraded"]["quick"] == 0
    assert cache["persistent_cache_hits"] >= cache["tiers_after_first"]["full"] > 0
    assert first_decode.main(["--render", str(out.with_suffix(".json")), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "Tiered compiles" in report
    assert f"| small | split | 0 / {cache['tiers_after_first']['full']} | " in report  # the second process's row


@pytest.mark.slow  # (a process of its own: about 10 s from an empty cache)
def test_an_engine_s_first_decode_compiles_its_programs_ahead(tmp_path):
    """docs/benchmarks.md's engine command (its environment too), its --out and --xla-cache
    here: the decodes run through an engine, which hands the programs of the request it admits
    to the background compile thread, so the steps wait for less than the compiles took (every
    compile, waited for in the decode's own thread, is at least its wait), with the tokens of
    the second decode, all compiled."""
    line = next(line for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
                if "benchmarks/first_decode.py" in line and "--path engine" in line)
    assert line.startswith("DLM_JAX_COMPILE_THREADS=1 ")
    out = tmp_path / "engine"
    argv = docs_argv("benchmarks/first_decode.py", "--path", out=str(out), xla_cache=str(tmp_path / "xla"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DLM_JAX_COMPILE_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "first_decode.py"), *argv], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert run["path"] == "engine" and run["xla_cache_empty_at_start"] and run["same_tokens"]
    assert run["first_compiles"] > 2 and run["nfe"] > 0
    assert 0 < run["first_compile_wait_seconds"] < run["first_compile_seconds"], run
    assert first_decode.main(["--render", str(out.with_suffix(".json")), "--out", str(tmp_path / "report")]) == 0
    assert "| 1 | engine | unrolled | full | empty |" in (tmp_path / "report.md").read_text()

"""Ctrl-C in every command: a real SIGINT in a subprocess ends `generate`, `run`, `eval`,
`export` and `demo` with one `interrupted` line on stderr and exit 130 (no traceback), and an
interrupted export (a bundle, a GGUF file, a bundle-cache export) leaves no partial output and no
temporary file or directory behind.

Where the signal lands matters (an export is only exposed once it writes), so most cases send it
from inside the process, at a chosen call: `_RUNNER` wraps one function to `os.kill` its own
process on its n-th call, then runs the CLI as its entry point. `generate` also takes one from
outside, as `timeout -s INT` would, once its first block has been printed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "llada-tiny"
BUCKET = "step_w32_p32_r32"

_RUNNER = """
import importlib, os, signal, sys
module, attr, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
owner = importlib.import_module(module)
*path, name = attr.split(".")
for part in path:
    owner = getattr(owner, part)
original, calls = getattr(owner, name), [0]
def interrupting(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth:
        os.kill(os.getpid(), signal.SIGINT)
    return original(*args, **kwargs)
setattr(owner, name, interrupting)
sys.argv = ["dlm-jax", *sys.argv[4:]]
from dlm_jax.frontends.cli import main
sys.exit(main())
"""
STEP = ("dlm_jax.runtime.decoder", "DecodeStats.record_step", 2)  # the second decode step
MANIFEST = ("dlm_jax._integrity", "write_manifest", 1)  # a bundle's files are in its temporary dir


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "DLM_JAX_EXECUTOR": "jax", **extra}


def _interrupt(tmp_path: Path, at: tuple[str, str, int], *argv: str, **env: str) -> subprocess.CompletedProcess:
    module, attr, nth = at
    return subprocess.run([sys.executable, "-c", _RUNNER, module, attr, str(nth), *argv], capture_output=True,
                          text=True, env=_env(tmp_path, **env), cwd=tmp_path, timeout=300)


def _assert_interrupted(done: subprocess.CompletedProcess, note: str = "") -> None:
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted") and note in last, done.stderr


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


@pytest.mark.slow  # (7 s; the other interrupts stay in the default pass)
def test_generate_ends_on_one_line_after_an_outside_sigint(tmp_path):
    """As `timeout -s INT 12 dlm-jax generate ...` does: the signal from another process, once
    the first block's text is out (one prompt streams its blocks as they commit)."""
    proc = subprocess.Popen([sys.executable, "-m", "dlm_jax.frontends.cli", "generate", "--model", str(TINY), "--prompt",
                             "564+894=", "--gen", "480", "--block", "32", "--preset", "llada", "--steps", "480"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(tmp_path), cwd=tmp_path)
    try:
        first = proc.stdout.read(1)  # the first committed block
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert first
    _assert_interrupted(subprocess.CompletedProcess(proc.args, proc.returncode, first + out, err.decode()))


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ("eval", "--model", str(TINY), "--task", "addition", "--n", "4", "--gen", "64"),
    ("demo", "--per-task", "2"),
], ids=["eval", "demo"])
def test_decoding_commands_end_on_one_line(tmp_path, argv):
    _assert_interrupted(_interrupt(tmp_path, STEP, *argv))


def test_export_leaves_no_partial_bundle(tmp_path):
    out = tmp_path / "out" / "bundle"
    done = _interrupt(tmp_path, MANIFEST, "export", "--model", str(TINY), "--out", str(out), "--buckets", BUCKET,
                      "--latency-repeats", "1")
    _assert_interrupted(done, f"{out} unchanged")
    assert _leftovers(out.parent) == []  # neither the bundle nor its temporary directory
    assert _leftovers(tmp_path / "tmp") == []


@pytest.mark.slow
def test_gguf_export_leaves_no_partial_file(tmp_path):
    out = tmp_path / "out" / "tiny.gguf"
    out.parent.mkdir()
    done = _interrupt(tmp_path, ("gguf", "GGUFWriter.write_tensors_to_file", 1), "export", "--model", str(TINY),
                      "--out", str(out), "--format", "gguf", "--quant", "q4_0")
    _assert_interrupted(done, f"{out} unchanged")
    assert _leftovers(out.parent) == []
    assert _leftovers(tmp_path / "tmp") == []


@pytest.mark.slow
def test_bundle_cache_export_leaves_no_partial_part_then_run_is_interrupted(tmp_path):
    """The bundle cache's export (the first LiteRT decode of a bucket) interrupted: the cache
    entry holds no part; then `run` over an exported bundle, interrupted mid-decode."""
    cache = tmp_path / "cache"
    done = _interrupt(tmp_path, MANIFEST, "generate", "--model", str(TINY), "--prompt", "564+894=",
                      "--executor", "litert", DLM_JAX_BUNDLE_CACHE=str(cache))
    _assert_interrupted(done)
    entries = [p for p in cache.iterdir() if p.is_dir()]
    assert entries and all(not any(p.name.startswith(("part-", ".")) for p in e.iterdir()) for e in entries), \
        [sorted(q.name for q in e.iterdir()) for e in entries]
    assert _leftovers(tmp_path / "tmp") == []

    bundle = tmp_path / "bundle"
    from dlm_jax.frontends.cli import main

    assert main(["export", "--model", str(TINY), "--out", str(bundle), "--for-prompts", "16", "--gen", "64",
                 "--latency-repeats", "1"]) == 0
    _assert_interrupted(_interrupt(tmp_path, STEP, "run", str(bundle), "--prompt", "564+894="))


def test_an_interrupt_python_drops_is_sent_again(tmp_path):
    """A KeyboardInterrupt raised inside a garbage-collector callback is dropped by Python
    ("Exception ignored in ..."; JAX runs one on every collection): the command sends SIGINT
    again until it has seen one, and says nothing of the dropped one."""
    code = ("import gc, os, signal, sys\n"
            "def once(phase, info):\n"
            "    if phase == 'start':\n"
            "        gc.callbacks.remove(once)\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        sum(range(10**6))  # the handler runs here, inside the callback\n"
            "import dlm_jax.runtime.decoder as d\n"
            "record = d.DecodeStats.record_step\n"
            "def step(*a, **k):\n"
            "    if not hasattr(step, 'armed'):\n"
            "        step.armed = gc.callbacks.append(once)\n"
            "        gc.collect()\n"
            "    return record(*a, **k)\n"
            "d.DecodeStats.record_step = step\n"
            f"sys.argv = ['dlm-jax', 'generate', '--model', {str(TINY)!r}, '--prompt', '564+894=', '--gen', '480',"
            " '--preset', 'llada', '--steps', '480']\n"
            "from dlm_jax.frontends.cli import main\n"
            "sys.exit(main())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path),
                          cwd=tmp_path, timeout=300)
    _assert_interrupted(done)
    assert "Exception ignored" not in done.stderr

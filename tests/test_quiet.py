"""The Python API is quiet: `dlm_jax.load(...).generate(...)` in a plain Python process prints
its result and nothing else, on stdout or stderr (LiteRT logs the accelerators it tears down at
exit, natively, after the program's last line), unless `DLM_JAX_NATIVE_LOGS=1` asks for the
native lines. Each case is a real subprocess: exit-time output cannot be seen any other way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "llada-tiny"
SCRIPT = ("import dlm_jax; m = dlm_jax.load({path!r}, executor={executor!r}); "
          "print(m.generate(['564+894=']).texts)")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One bundle cache for the module: the first LiteRT case exports llada-tiny's buckets."""
    return tmp_path_factory.mktemp("bundles")


def _run(code: str, tmp_path: Path, cache: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "DLM_JAX_NATIVE_LOGS"}
    environ.update(env, DLM_JAX_BUNDLE_CACHE=str(cache))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ,
                          cwd=tmp_path, timeout=300)


@pytest.mark.parametrize("executor", ["litert", pytest.param("auto", marks=pytest.mark.slow),
                                      pytest.param("jax", marks=pytest.mark.slow)])
def test_generate_prints_only_its_result(tmp_path, cache, executor):
    # litert exports into the fresh cache, in the process; auto then finds the buckets cached
    # and decodes with the LiteRT runner too (its background export is off in tests).
    done = _run(SCRIPT.format(path=str(TINY), executor=executor), tmp_path, cache)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['1458']\n"
    assert done.stderr == ""


def test_import_is_silent(tmp_path, cache):
    done = _run("import dlm_jax, dlm_jax.executors.runner, dlm_jax.tflite_export", tmp_path, cache)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_native_logs_come_back_when_asked_for(tmp_path, cache):
    """The variable brings LiteRT's teardown lines back (so the quiet case above is not quiet
    merely because LiteRT said nothing)."""
    done = _run(SCRIPT.format(path=str(TINY), executor="litert"), tmp_path, cache, DLM_JAX_NATIVE_LOGS="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['1458']\n"
    assert "DestroyAccelerator" in done.stderr


def test_python_still_reports_what_happens_at_shutdown(tmp_path, cache):
    """Only native writes are dropped at exit: a traceback and an exception ignored in a
    finaliser during shutdown still reach stderr."""
    code = (SCRIPT.format(path=str(TINY), executor="litert")
            + "\nclass D:\n    def __del__(self): raise RuntimeError('finaliser ran')\nd = D()\n"
            + "import atexit, sys; atexit.register(lambda: print('exit handler ran', file=sys.stderr))\n1/0")
    done = _run(code, tmp_path, cache)
    assert done.returncode == 1
    assert "ZeroDivisionError" in done.stderr
    assert "exit handler ran" in done.stderr
    assert "RuntimeError: finaliser ran" in done.stderr
    assert "DestroyAccelerator" not in done.stderr

"""Running a case in a fresh process over one copy of the package: the working tree's, or an
older commit's extracted with `git archive` (`before_after.py`, `engine_host.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def extract(commit: str, dest: str | Path) -> None:
    """`commit`'s `dlm_jax/` under `dest`."""
    archive = subprocess.run(["git", "archive", commit, "dlm_jax"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def run_case(code: str, args: list[str], pythonpath: str, **env: str) -> dict:
    """Run `code` (a script whose last line of output is JSON naming `dlm_jax.__file__` as
    "file") with `args` in a fresh process importing the package under `pythonpath`; its JSON."""
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=pythonpath, **env), cwd=tempfile.gettempdir())
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if not out["file"].startswith(pythonpath):
        raise RuntimeError(f"imported {out['file']}, not the copy under {pythonpath}")
    return out

"""What the benchmarks' tests share."""

from __future__ import annotations

from collections.abc import Callable


def killed_after(n: int, fn: Callable) -> Callable:
    """`fn`, its first `n` calls as they are, then KeyboardInterrupt: a lease part stopped by its
    time limit in the middle of a run."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) > n:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)

    return wrapped


def docs_argv(script: str, marker: str, **paths: str) -> list[str]:
    """The arguments of docs/benchmarks.md's one command line of `script` (e.g.
    "benchmarks/kernel_sweep.py") that holds `marker`, each `--name` in `paths` (underscores for
    dashes) given that value instead: a page's command, run as written but for where it writes."""
    import shlex
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
    (line,) = [line for line in page.read_text().splitlines() if script in line and marker in line]
    argv = shlex.split(line)
    argv = argv[argv.index(script) + 1:]
    for name, value in paths.items():
        argv[argv.index("--" + name.replace("_", "-")) + 1] = value
    return argv

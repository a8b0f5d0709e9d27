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

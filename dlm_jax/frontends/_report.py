"""One-line reporting for dlm-jax's command lines (`dlm-jax`, `python -m dlm_jax.frontends.lmeval`): argparse
errors, a user's mistake, a disk failure or Ctrl-C end in one line on stderr and an exit code,
never a traceback. Imports nothing of dlm-jax at module level, so any command module can use it."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `dlm-jax generate: error: ...` and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


_REDELIVER_SECONDS = 0.5
_command_over = threading.Event()  # set: stop sending SIGINT again (`_interrupts_redelivered`)


@contextlib.contextmanager
def _interrupts_redelivered():
    """Ctrl-C reaches the command even where Python drops it. A KeyboardInterrupt raised while
    a garbage-collector callback or a finaliser runs is printed as "Exception ignored in ..."
    and lost (JAX runs a callback on every collection, so a decode's Ctrl-C landed there about
    one time in four). While the command runs, SIGINT raises KeyboardInterrupt as usual and is
    sent again every half second until the command is over (`_dispatch` has caught it, or the
    command ended on its own); the dropped one is not reported."""
    global _command_over
    lock, done, pending = threading.Lock(), threading.Event(), threading.Event()
    _command_over = done

    def resend() -> None:
        while not done.wait(_REDELIVER_SECONDS):
            with lock:
                if not done.is_set():
                    os.kill(os.getpid(), signal.SIGINT)

    def handler(signum, frame):
        if done.is_set():
            return
        if not pending.is_set():
            pending.set()
            threading.Thread(target=resend, name="dlm-jax-sigint", daemon=True).start()
        raise KeyboardInterrupt

    def unraisable(info) -> None:
        if not issubclass(info.exc_type, KeyboardInterrupt):
            previous_hook(info)

    previous, previous_hook = signal.signal(signal.SIGINT, handler), sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        with lock:
            done.set()
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook


def report_errors(run: Callable[[], int], *, interrupted: str = "") -> int:
    """`run()`, with a user's mistake (CheckpointError, ConfigError: exit 2), a disk failure
    (OSError: 1) or Ctrl-C (130, "interrupted" + `interrupted`) reported in one line on stderr
    instead of a traceback, and warnings as one `warning:` line each."""
    from dlm_jax._errors import CheckpointError, ConfigError

    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *a, **k: print(f"warning: {_one_line(message)}", file=sys.stderr)
        try:
            return run()
        except (CheckpointError, ConfigError) as e:
            print(f"error: {_one_line(e)}", file=sys.stderr)
            return 2
        except OSError as e:  # the disk, not the program: name the path and the reason
            where = f"{e.filename}: " if e.filename else ""
            print(f"error: {where}{e.strerror or _one_line(e)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C: one line and the shell's code for SIGINT, no traceback
            _interrupt_seen()
            _close_progress_bars()
            print(f"interrupted{interrupted}", file=sys.stderr)
            return 130


def _interrupt_seen() -> None:
    """Stop `_interrupts_redelivered` from sending SIGINT again: the command has it."""
    _command_over.set()


def _close_progress_bars() -> None:
    """End any progress bar still drawn, so the interrupt line starts a line of its own."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()

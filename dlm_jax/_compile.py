"""Ahead-of-time compilation per bucket, a compile counter, and JAX's persistent cache.

`CompiledBuckets` keeps one `jax.stages.Compiled` per `BucketKey`; the key used to look an
executable up is the key it was stored under, so a second call never recompiles. AOT
executables also cannot silently retrace: a call with other shapes raises. `XlaCompileCounter`
counts every backend compilation in the process (JAX's own monitoring event), which is what
the "no compilation after warm-up" tests assert on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax

from dlm_jax.runtime.buckets import BucketKey

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class XlaCompileCounter:
    """Process-wide count of XLA backend compilations (from `jax.monitoring`)."""

    _count = 0
    _lock = threading.Lock()
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return

            def listener(event: str, duration: float, **_: Any) -> None:
                if event == _COMPILE_EVENT:
                    with cls._lock:
                        cls._count += 1

            jax.monitoring.register_event_duration_secs_listener(listener)
            cls._installed = True

    @classmethod
    def count(cls) -> int:
        cls.install()
        return cls._count


def enable_persistent_cache(directory: str | os.PathLike | None = None) -> Path:
    """Point JAX's persistent compilation cache at `directory` (default ~/.cache/dlm-jax/xla;
    `DLM_JAX_CACHE_DIR` overrides) and cache every executable, however fast it compiled."""
    path = Path(directory or os.environ.get("DLM_JAX_CACHE_DIR") or Path.home() / ".cache" / "dlm-jax" / "xla")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def enable_default_cache() -> None:
    """`enable_persistent_cache()` unless `DLM_JAX_CACHE_DIR=off` or the process already chose
    a cache directory (`jax_compilation_cache_dir`): a second process then loads the compiled
    buckets of the first instead of compiling them."""
    if os.environ.get("DLM_JAX_CACHE_DIR", "").lower() == "off" or jax.config.jax_compilation_cache_dir:
        return
    try:
        enable_persistent_cache()
    except OSError:
        pass


Build = Callable[[BucketKey], tuple[Callable[..., Any], tuple[Any, ...]]]


class CompiledBuckets:
    """One AOT-compiled executable per bucket key.

    `build(key)` returns the function to compile for that bucket and the abstract arguments
    (`jax.ShapeDtypeStruct`s or concrete arrays) to lower it with, and optionally the
    `jax.jit` keywords (`donate_argnums`). A key is any hashable, sortable value.
    """

    def __init__(self, build: Build):
        self._build = build
        self._executables: dict[BucketKey, jax.stages.Compiled] = {}
        self.compile_count = 0
        self.compile_seconds = 0.0
        XlaCompileCounter.install()

    def get(self, key: BucketKey) -> jax.stages.Compiled:
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            fn, specs, *options = self._build(key)  # options: jax.jit keywords (donation)
            exe = jax.jit(fn, **(options[0] if options else {})).lower(*specs).compile()
            self._executables[key] = exe
            self.compile_count += 1
            self.compile_seconds += time.perf_counter() - t0
        return exe

    def warmup(self, keys: Iterable[BucketKey]) -> int:
        """Compile every key not compiled yet; returns how many were compiled."""
        before = self.compile_count
        for key in keys:
            self.get(key)
        return self.compile_count - before

    def __contains__(self, key: BucketKey) -> bool:
        return key in self._executables

    @property
    def keys(self) -> list[BucketKey]:
        return sorted(self._executables)

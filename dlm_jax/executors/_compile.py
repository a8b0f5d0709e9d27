"""Ahead-of-time compilation per bucket, a compile counter, and JAX's persistent cache.

`CompiledBuckets` keeps one `jax.stages.Compiled` per `BucketKey`; the key used to look an
executable up is the key it was stored under, so a second call never recompiles. AOT
executables also cannot silently retrace: a call with other shapes raises. `XlaCompileCounter`
counts every backend compilation in the process (JAX's own monitoring event), which is what
the "no compilation after warm-up" tests assert on.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.buckets import BucketKey

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# XLA:CPU's copy insertion, without region analysis, copies a donated buffer twice when the
# program both reads it and updates it in place: the K/V cache of every decode step (read by
# the attention, then the window's rows scattered into it), two copies of the whole cache per
# step. With region analysis those copies go: at LLaDA-8B shape the batch-1 in-place step's
# compiled bytes fell from 1.23x to 1.17x the weights with the dual cache, 1.45x to 1.39x with
# the prefix cache (float32; `benchmarks/results/step_cost.md`); a 29M model's decodes on two
# cores took as long or up to 6% less.
# XLA:GPU's copy insertion does not add them (no copy kernel in the H200 profiles,
# `benchmarks/results/gpu_step.md`).
CPU_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


_TARGET: str | None = None  # `building_for`'s platform while it holds


def target_platform() -> str:
    """The platform the executors build their programs for: JAX's default backend ("cpu",
    "gpu", "tpu"), or the one `building_for` names while it holds."""
    return _TARGET or jax.default_backend()


@contextlib.contextmanager
def building_for(platform: str) -> Iterator[None]:
    """Executors built (and programs compiled) inside take the defaults of `platform` instead
    of the default backend's: for a compile-only client of another platform, such as XLA:GPU
    compiling for a GPU this machine does not have (`benchmarks/gpu_step.py --target`).
    Process-wide while it holds (compile threads see it too)."""
    global _TARGET
    before, _TARGET = _TARGET, platform
    try:
        yield
    finally:
        _TARGET = before


def jit_options(options: dict[str, Any] | None = None, platform: str | None = None) -> dict[str, Any]:
    """`jax.jit` keywords of a program the executors compile: `options` (donation, shardings)
    with `CPU_COMPILER_OPTIONS` added on a CPU (`platform`, default `target_platform()`)."""
    options = dict(options or {})
    if (platform or target_platform()) == "cpu":
        options["compiler_options"] = {**CPU_COMPILER_OPTIONS, **options.get("compiler_options", {})}
    return options


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


def jitted(build: Build, key: Any) -> tuple[Any, tuple[Any, ...]]:
    """(the `jax.jit` of `build(key)`'s function with its keywords and `jit_options`, the
    arguments to lower it with): what `CompiledBuckets` compiles, for a caller that times or
    inspects its trace, lowering or compile apart."""
    fn, specs, *options = build(key)  # options: jax.jit keywords (donation)
    return jax.jit(fn, **jit_options(options[0] if options else None)), specs

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def background_workers(*, backend: str | None = None) -> int:
    """Threads that compile ahead of use (`CompiledBuckets.prefetch`): `DLM_JAX_COMPILE_THREADS`,
    else by the cores (`backend`, where the step runs, changes nothing today; see below).
    XLA's compiler is mostly single-threaded per program, so each bucket compiled at once
    needs a core of its own.

    - CPU: a quarter of the cores, at most 4, none under 4 cores: the decode's steps run on
      the same cores, and a compile beside them only slows both (on 2 shared cores a llada-12m
      first decode took 20.5 s with none, 31.6 s with one, 25.6 s with two).
    - GPU / TPU: the same rule (4 on a 16-core GPU machine). Every core but two was tried: on
      one H200 (LLaDA-8B shape, bfloat16) a dual-cache first decode at batch 1 waited 13.9 s
      for its 3 programs, but a prefix-cache one (about 10 programs) had not finished after
      60 s, where 4 threads had taken 35.7 s: XLA:GPU autotunes each program on the device,
      so concurrent compiles queue there, and the first bucket the decode needs waits behind
      all the others. A later lease (commit ec3eae8, the cache read in place) waited 142 s on
      the same 4 threads for that decode's programs (`benchmarks/results/gpu.md`); the compile
      probe of `benchmarks/gpu_lease.sh` times them program by program, on 4 threads and on
      one. `DLM_JAX_COMPILE_THREADS` sets another number."""
    given = os.environ.get("DLM_JAX_COMPILE_THREADS")
    if given is not None:
        try:
            return max(0, int(given))
        except ValueError:
            raise ConfigError(f"DLM_JAX_COMPILE_THREADS={given!r} must be a whole number") from None
    return min(4, (os.cpu_count() or 1) // 4)


def _pool() -> ThreadPoolExecutor | None:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None and (workers := background_workers()):
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="dlm-jax-compile")
        return _POOL


class CompiledBuckets:
    """One AOT-compiled executable per bucket key.

    `build(key)` returns the function to compile for that bucket and the abstract arguments
    (`jax.ShapeDtypeStruct`s or concrete arrays) to lower it with, and optionally the
    `jax.jit` keywords (`donate_argnums`). A key is any hashable, sortable value.

    `prefetch(keys)` compiles keys in the background, in the order given; `get(key)` waits for
    its own key only (one not started yet is taken off the queue and compiled at once), and
    `wait_seconds` adds up how long callers waited. Thread-safe.
    """

    def __init__(self, build: Build):
        self._build = build
        self._executables: dict[BucketKey, jax.stages.Compiled] = {}
        self._pending: dict[BucketKey, Future] = {}  # queued or compiling
        self._lock = threading.Lock()
        self.compile_count = 0
        self.compile_seconds = 0.0
        self.wait_seconds = 0.0
        XlaCompileCounter.install()

    def _compile(self, key: BucketKey) -> jax.stages.Compiled:
        t0 = time.perf_counter()
        try:
            fn, specs = jitted(self._build, key)
            exe = fn.lower(*specs).compile()
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)  # a later get tries again (and raises there)
            raise
        with self._lock:
            self._executables[key] = exe
            self._pending.pop(key, None)
            self.compile_count += 1
            self.compile_seconds += time.perf_counter() - t0
        return exe

    def get(self, key: BucketKey) -> jax.stages.Compiled:
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        t0 = time.perf_counter()
        with self._lock:
            exe = self._executables.get(key)
            queued = self._pending.get(key) if exe is None else None
            mine = exe is None and (queued is None or queued.cancel())  # not started: compile it here
            if mine:
                queued = self._pending[key] = Future()  # other threads wait for this compile
                queued.set_running_or_notify_cancel()  # running: `cancel` leaves it (its result is set below)
        if mine:
            try:
                exe = self._compile(key)
            except BaseException as e:
                queued.set_exception(e)
                raise
            queued.set_result(exe)
        elif exe is None:
            exe = queued.result()
        with self._lock:
            self.wait_seconds += time.perf_counter() - t0
        return exe

    def prefetch(self, keys: Iterable[BucketKey]) -> None:
        """Queue every key neither compiled nor queued, in order, on the background threads."""
        pool = _pool()
        if pool is None:
            return
        with self._lock:
            for key in keys:
                if key not in self._executables and key not in self._pending:
                    self._pending[key] = pool.submit(self._compile, key)

    def cancel(self) -> None:
        """Drop the queued keys not started yet (those compiling finish)."""
        with self._lock:
            for key, fut in list(self._pending.items()):
                if fut.cancel():
                    del self._pending[key]

    def warmup(self, keys: Iterable[BucketKey]) -> int:
        """Compile every key not compiled yet; returns how many were compiled."""
        keys = list(dict.fromkeys(keys))
        new = sum(key not in self._executables for key in keys)
        for key in keys:
            self.get(key)
        return new

    def __contains__(self, key: BucketKey) -> bool:
        return key in self._executables

    @property
    def keys(self) -> list[BucketKey]:
        return sorted(self._executables)

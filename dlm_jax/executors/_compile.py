"""Ahead-of-time compilation per bucket, a compile counter, and JAX's persistent cache.

`CompiledBuckets` keeps one `jax.stages.Compiled` per `BucketKey`; the key used to look an
executable up is the key it was stored under, so a second call never recompiles. AOT
executables also cannot silently retrace: a call with other shapes raises. `XlaCompileCounter`
counts every backend compilation in the process (JAX's own monitoring event), which is what
the "no compilation after warm-up" tests assert on.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.buckets import BucketKey

log = logging.getLogger(__name__)

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


COMPILE_ENV = "DLM_JAX_COMPILE"
COMPILE_MODES = ("full", "tiered")

# The quick tier of a tiered compile: each platform's options that cut a program's compile
# most for the step time they cost. XLA:GPU autotunes each program's GEMMs and fusions on the
# device, which took most of a cold first decode's compiles on one H200 (LLaDA-8B shape, 10
# programs in 142 s; with GEMMs off Triton the compiles halved, `benchmarks/results/gpu.md`):
# the quick tier takes XLA's default kernels instead, and cuBLAS's GEMMs at its own heuristic's
# choice instead of Triton's GEMM fusions at default tiles. Compiled for an H200 on 2 CPU cores
# without autotuning, the 18 programs of a prefix-cache decode at batch 1 and 8 took 80.3 s
# that way against 120.3 s with Triton's GEMMs (a batch-1 prefix program 3.4-4.2 s against
# 6.0-7.9 s; `benchmarks/results/gpu_target_parts/h200_target_quick.md`); autotuned on one
# H200, cuBLAS's steps ran 0.4-23% slower than Triton's (`gpu_step.md`), and a tiered decode
# runs on the quick programs only until their full compiles replace them. On a CPU, LLVM at -O0: a 113M-parameter
# prefix-cache decode's step programs compiled in 3.6 s instead of 4.8 s on 2 cores (and ran
# slower; `benchmarks/results/first_decode_tiered.md`). No quick tier is known for a TPU: there
# a tiered compile compiles in full.
QUICK_OPTIONS: dict[str, dict[str, Any]] = {"cpu": {"xla_backend_optimization_level": 0},
                                            "gpu": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}}


def choose_compile(compile: str | None = None) -> str:
    """How the JAX executor compiles its step programs: `compile`, else `$DLM_JAX_COMPILE`,
    else "full". "tiered": a step program is first compiled quick (`QUICK_OPTIONS`) and
    replaced by its full compile, built on a background thread at the lowest priority, when
    that is ready (`CompiledBuckets`)."""
    from_env = compile is None and bool(os.environ.get(COMPILE_ENV))
    mode = compile or os.environ.get(COMPILE_ENV) or "full"
    if mode not in COMPILE_MODES:
        raise ConfigError(f"{COMPILE_ENV if from_env else 'compile'}={mode!r}: known {', '.join(COMPILE_MODES)}")
    return mode


def quick_options(platform: str | None = None) -> dict[str, Any] | None:
    """The quick tier's compiler options on `platform` (default `target_platform()`); None
    where none is known (a tiered compile compiles in full there)."""
    return QUICK_OPTIONS.get(platform or target_platform())


def _full_marker(lowered: Any) -> Path | None:
    """The file that says the full compile of `lowered` is in the persistent XLA cache (its
    name: a digest of the program's text, the platform, device kind and JAX's version), under
    the cache's directory; None without a persistent cache. A tiered compile whose program has
    one compiles it in full at once: a second process loads it from the cache."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory:
        return None
    device = jax.devices()[0]
    h = hashlib.sha256(lowered.as_text().encode())
    h.update(f"|{target_platform()}|{device.device_kind}|{jax.__version__}".encode())
    return Path(directory) / "dlm-jax-tiered" / h.hexdigest()


def _mark_full(marker: Path | None) -> None:
    if marker is None:
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # (a read-only cache: the next process compiles quick first again)


class _Upgrades:
    """The full compiles of a tiered compile's quick programs (and of the programs built
    behind, `CompiledBuckets.build_behind`), one at a time, in the order queued, on one
    background thread at the lowest CPU priority (a thread's nice value, on Linux), each
    started only once no other compile (`foreground`) has run for `QUIET_S` seconds: the programs a decode or a warm-up waits for compile first, without a full compile
    beside them. At exit, the queue is dropped and the compile under way finishes (it lands in
    the persistent cache). The queue holds its programs weakly: those of an executor gone are
    skipped."""

    QUIET_S = 0.25

    def __init__(self) -> None:
        self._queue: deque = deque()
        self._busy: Any = None  # the CompiledBuckets whose program is compiling
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._foreground = 0  # other compiles under way
        self._quiet_since = time.monotonic()

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """Mark a compile that a caller may wait for: no full compile starts meanwhile."""
        with self._cv:
            self._foreground += 1
        try:
            yield
        finally:
            with self._cv:
                self._foreground -= 1
                self._quiet_since = time.monotonic()
                self._cv.notify_all()

    def put(self, programs: CompiledBuckets, key: Any, job: Any) -> None:
        """Queue `programs._upgrade(key, job)`."""
        with self._cv:
            if self._stopping:
                return
            self._queue.append((weakref.ref(programs), key, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dlm-jax-upgrade", daemon=True)
                self._thread.start()
                atexit.register(self.stop)
            self._cv.notify_all()

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cv:
                while not self._stopping:
                    if self._queue and not self._foreground:
                        quiet = self._quiet_since + self.QUIET_S - time.monotonic()
                        if quiet <= 0:
                            break
                        self._cv.wait(quiet)
                    else:
                        self._cv.wait()
                if self._stopping:
                    return
                ref, key, job = self._queue.popleft()
                self._busy = programs = ref()
            if programs is None:
                continue
            try:
                programs._upgrade(key, job)
            except Exception:  # (`_upgrade` logs its own; the thread keeps serving the queue)
                log.exception("a tiered compile's full compile failed")
            finally:
                del programs
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()

    def _owners(self) -> list:
        return [p for p in [self._busy, *(ref() for ref, _, _ in self._queue)] if p is not None]

    def pending(self, programs: CompiledBuckets | None = None) -> int:
        """Full compiles queued or under way (of `programs`, default all)."""
        with self._cv:
            return sum(programs is None or p is programs for p in self._owners())

    def wait(self, programs: CompiledBuckets | None = None, timeout: float | None = None) -> bool:
        """Wait until no full compile (of `programs`, default any) is queued or under way."""
        with self._cv:
            return self._cv.wait_for(lambda: not any(programs is None or p is programs for p in self._owners()),
                                     timeout)

    def stop(self) -> None:
        """Drop the queue and wait for the compile under way (at exit: XLA's compiler may not
        be left running while the interpreter ends), saying so on stderr where there is one."""
        with self._cv:
            self._stopping = True
            self._queue.clear()
            self._cv.notify_all()
            if self._busy is not None:
                print("dlm-jax: exiting once the full compile under way ends (DLM_JAX_COMPILE=tiered; it goes to the "
                      "persistent cache)", file=sys.stderr, flush=True)
            self._cv.wait_for(lambda: self._busy is None)


UPGRADES = _Upgrades()


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

    `tiered`: each key is first compiled quick (`quick_options`: on a GPU without autotuning
    and with cuBLAS's GEMMs, on a CPU with LLVM at -O0) and its full compile queued on
    `UPGRADES`; once built, the full executable replaces the quick one, and the next `get`
    returns it (a call under way finishes on the quick one). A key whose full compile a
    process has put in the persistent cache before (`_full_marker`) is compiled in full at
    once, from the cache. `tier(key)` says which
    a key holds; `upgrade_count` counts the full compiles done behind quick ones.
    `build_behind(key)` queues there the full compile of a key nobody waits for (a caller runs
    its steps in another program meanwhile: `JaxExecutor`'s wider windows); `behind_count`
    counts those built. `upgrade_seconds`: that thread's seconds on both.
    """

    def __init__(self, build: Build, *, tiered: bool = False):
        self._build = build
        self.tiered = tiered
        self._executables: dict[BucketKey, jax.stages.Compiled] = {}
        self._tiers: dict[BucketKey, str] = {}
        self._pending: dict[BucketKey, Future] = {}  # queued or compiling
        self._lock = threading.Lock()
        self.compile_count = 0
        self.compile_seconds = 0.0
        self.wait_seconds = 0.0
        self.upgrade_count = 0
        self.upgrade_seconds = 0.0
        self.behind_count = 0
        self._behind: set = set()  # keys queued on UPGRADES by `build_behind`, not built yet
        XlaCompileCounter.install()

    def _compile(self, key: BucketKey) -> jax.stages.Compiled:
        t0 = time.perf_counter()
        try:
            with UPGRADES.foreground():
                fn, specs = jitted(self._build, key)
                lowered = fn.lower(*specs)
                quick = quick_options() if self.tiered else None
                marker = _full_marker(lowered) if quick is not None else None
                if quick is not None and not (marker is not None and marker.exists()):
                    exe, tier = lowered.compile(quick), "quick"
                else:
                    exe, tier = lowered.compile(), "full"
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)  # a later get tries again (and raises there)
            raise
        with self._lock:
            self._executables[key] = exe
            self._tiers[key] = tier
            self._pending.pop(key, None)
            self.compile_count += 1
            self.compile_seconds += time.perf_counter() - t0
        if tier == "quick":
            UPGRADES.put(self, key, (lowered, marker))
        return exe

    def _upgrade(self, key: BucketKey, job: tuple | None) -> None:
        """Compile `key`'s program in full (`UPGRADES`' thread) and put it in the quick one's
        place; `job` None: lower it first (`build_behind`: a key not compiled yet)."""
        t0 = time.perf_counter()
        with self._lock:
            done = self._tiers.get(key) == "full" or (job is None and key in self._pending)
            if done:  # (built in full meanwhile, or a caller now compiles it itself)
                self._behind.discard(key)
                return
        try:
            if job is None:
                fn, specs = jitted(self._build, key)
                lowered = fn.lower(*specs)
                marker = _full_marker(lowered) if self.tiered else None
            else:
                lowered, marker = job
            exe = lowered.compile()
        except Exception as e:  # (the quick program stays: it computes the same)
            log.warning("the full compile of %s failed%s: %s", key, "" if job is None else ", its quick compile stays", e)
            with self._lock:
                self._behind.discard(key)
            return
        _mark_full(marker)
        with self._lock:
            self._executables[key] = exe
            self._tiers[key] = "full"
            if job is None:
                self._behind.discard(key)
                self.behind_count += 1
            else:
                self.upgrade_count += 1
            self.upgrade_seconds += time.perf_counter() - t0

    def build_behind(self, key: BucketKey) -> bool:
        """Queue the full compile of `key` on `UPGRADES` (lowered there too), unless it is
        compiled, compiling, queued on the background threads or already queued there; True
        where queued now. A `get(key)` meanwhile compiles it in the caller's thread (quick,
        where tiered), and the full compile queued here then replaces that."""
        with self._lock:
            if key in self._executables or key in self._pending or key in self._behind:
                return False
            self._behind.add(key)
        UPGRADES.put(self, key, None)
        return True

    def held(self) -> list:
        """The keys compiled so far (any tier)."""
        with self._lock:
            return list(self._executables)

    def tier(self, key: BucketKey) -> str | None:
        """"quick" or "full": the compile `key` holds now (None: not compiled)."""
        return self._tiers.get(key)

    def wait_upgrades(self, timeout: float | None = None) -> bool:
        """Wait until every queued full compile of these programs is in place; False on `timeout`."""
        return UPGRADES.wait(self, timeout)

    @property
    def upgrades_pending(self) -> int:
        return UPGRADES.pending(self)

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

    def cancel(self, keys: Iterable[BucketKey] | None = None) -> None:
        """Drop the queued keys not started yet (those compiling finish): those of `keys`
        (default all), so that a caller drops what it queued and not another's. Queued full
        compiles stay queued: they replace programs this object holds."""
        with self._lock:
            for key in list(self._pending if keys is None else keys):
                fut = self._pending.get(key)
                if fut is not None and fut.cancel():
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

"""The default executor on a CPU: JAX now, the LiteRT runner once its bundle is cached.

The LiteRT runner decodes faster on a CPU (`benchmarks/results/peer.md`), but its buckets must
first be exported, which costs far more than JAX's compiles (minutes at 150M parameters where
JAX compiles in seconds). `AutoExecutor` never makes a decode wait for an export:

- a decode whose buckets the bundle cache holds runs on the LiteRT runner (`BundleCacheExecutor`);
- any other runs on the JAX executor (compiling what it reaches, as `executor="jax"` does), and
  when it ends, the buckets it lacked are exported by a background process at the lowest CPU
  priority (`nice 19`, so it takes only idle time), into the same cache entry (started after
  the decode, not beside it: on 2 cores a process starting beside a decode slowed its compiles);
- the choice is made once per decode, when it starts (`prefetch`), so one decode never mixes
  executors; a later decode whose buckets have been exported meanwhile runs on LiteRT. Both
  executors return the same tokens (`tests/executors`), so answers do not change when it switches.

The background export outlives the command that started it (a session of its own: Ctrl-C in the
terminal does not stop it), so the next process finds the buckets cached; it writes its log
beside the cache entry (`<entry>.export.log`). `DLM_JAX_BACKGROUND_EXPORT=0` turns it off:
decodes then run on JAX until the cache holds their buckets (`executor="litert"` exports in the
foreground). A model with no checkpoint directory on disk (built in memory) cannot be exported
by another process and always decodes on JAX here.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.step import BuildCounts, Capabilities, Executor, Progress, StepInputs, StepOutputs

BACKGROUND_ENV = "DLM_JAX_BACKGROUND_EXPORT"


@dataclasses.dataclass
class _Export:
    """What the background exports of one model's cache entry have been asked for and are doing
    (shared by an executor and its fork)."""

    source: str
    entry: Path | None = None
    job: subprocess.Popen | None = None
    wanted: set[BucketKey] = dataclasses.field(default_factory=set)
    started: int = 0  # background exports started by this process
    failed: int | None = None  # the exit status of one that failed: no more are started


def background_enabled() -> bool:
    return os.environ.get(BACKGROUND_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class AutoExecutor(Executor):
    """JAX for decodes whose buckets the bundle cache lacks (exported meanwhile in the
    background), the LiteRT runner for those it holds. `jax` and `litert` are the two
    executors over the same model; `source` its checkpoint directory ("" for none)."""

    def __init__(self, jax: Executor, litert, *, source: str | os.PathLike = "", _export: _Export | None = None):
        self.jax = jax
        self.litert = litert  # a dlm_jax.executors.bundle_cache.BundleCacheExecutor
        self._export = _export or _Export(str(source))
        self._current: Executor = jax
        self._held: set[BucketKey] = set()  # buckets seen in the cache entry
        self.decodes = {"jax": 0, "litert": 0}  # decodes each executor ran
        self._caps_of = self._caps = None  # the JAX executor's capabilities, and ours from them

    @property
    def capabilities(self) -> Capabilities:
        # (a decode may run on the LiteRT runner, whose logits come to the host: none kept on a device)
        caps = self.jax.capabilities
        if self._caps_of is not caps:  # made once per JAX executor's set, not per call
            self._caps, self._caps_of = dataclasses.replace(caps, logits_on=""), caps
        return self._caps

    @property
    def current(self) -> str:
        """Which executor runs the decode in progress (or ran the last one)."""
        return "litert" if self._current is self.litert else "jax"

    # --- the background export ---------------------------------------------------------------

    @property
    def exporting(self) -> bool:
        job = self._export.job
        return job is not None and job.poll() is None

    def _covered(self, keys: Sequence[BucketKey]) -> bool:
        """Does the cache entry hold every bucket of `keys`? (Reads the parts' bundle.json
        while any is missing; what was found stays found.)"""
        from dlm_jax.executors.bundle_cache import _covers

        if all(k in self._held for k in keys):
            return True
        if not self.litert.may_hold():
            return False  # no entry of this model at all: its weights are not hashed for the entry's name
        held = [k for ks in self.litert._scan().values() for k in ks]
        self._held.update(k for k in keys if _covers(held, k))
        return all(k in self._held for k in keys)

    def _want(self, keys: Sequence[BucketKey]) -> None:
        """Ask for `keys` to be cached: start a background export of those missing unless one is
        running (a later call starts the next one)."""
        self._export.wanted.update(keys)
        job = self._export.job
        if job is not None and job.poll():
            self._export.failed = job.returncode  # see the entry's .export.log
        if not background_enabled() or not self._export.source or self.exporting or self._export.failed:
            return
        missing = sorted(k for k in self._export.wanted if not self._covered([k]))
        self._export.wanted = set(missing)
        if missing:
            self._start(missing)

    def _start(self, keys: list[BucketKey]) -> None:
        from dlm_jax.runtime.step import signature_name

        entry = self.litert.path
        entry.parent.mkdir(parents=True, exist_ok=True)
        log = open(entry.parent / f"{entry.name}.export.log", "ab")  # noqa: SIM115 - the child keeps it
        cmd = [sys.executable, "-m", "dlm_jax.tflite_export.background", "--source", self._export.source,
               "--entry", str(entry), "--buckets", *(signature_name(k) for k in keys)]
        root = Path(__file__).resolve().parents[2]  # the folder that holds the dlm_jax package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        # The child lowers its own priority (a preexec_fn here would run Python between fork and
        # exec in a process with JAX's threads).
        self._export.job = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                            start_new_session=True)
        log.close()
        self._export.started += 1

    def wait_for_export(self, timeout: float | None = None) -> int | None:
        """Wait for the running background export (tests, benchmarks); its exit status."""
        job = self._export.job
        return None if job is None else job.wait(timeout)

    # --- the executor hooks --------------------------------------------------------------------

    def prepare(self, keys: Sequence[BucketKey]) -> None:
        self._want(keys)

    def warmup(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False) -> int:
        """Load the buckets from the cache if it holds them all, else compile them with JAX (and
        have the missing ones exported in the background)."""
        if self._covered(keys):
            return self.litert.warmup(keys, slots=slots, views=views)
        new = self.jax.warmup(keys, slots=slots, views=views)
        self._want(keys)  # after the compiles, which it would slow
        return new

    def warmup_engine(self, keys: Sequence[BucketKey], *, slots: int, rows: int, views: bool = False) -> int:
        """An engine's programs: loaded from the cache if it holds them all (its runs will take
        LiteRT, `session`), else compiled with JAX."""
        if self._covered(keys):
            return self.litert.warmup_engine(keys, slots=slots, rows=rows, views=views)
        return self.jax.warmup_engine(keys, slots=slots, rows=rows, views=views)

    def prefetch_engine(self, keys: Sequence[BucketKey], *, slots: int, rows: int,
                        views: bool = False) -> Callable[[], None]:
        """An engine admits requests: their calls' programs built ahead by the executor its run
        took (`session`)."""
        return self._current.prefetch_engine(keys, slots=slots, rows=rows, views=views)

    def prefetch(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False) -> Callable[[], None]:
        """A decode starts: run it on LiteRT if the cache holds all its buckets, else on JAX."""
        if self._covered(keys):
            self._current = self.litert
            self.litert.warmup(keys, slots=slots, views=views)  # opens the cached parts (no export)
            self.decodes["litert"] += 1
            return self.litert.prefetch(keys, slots=slots, views=views)
        self._current = self.jax
        self.decodes["jax"] += 1
        cancel = self.jax.prefetch(keys, slots=slots, views=views)

        def decode_ended() -> None:
            cancel()
            # Exported once the decode is over: a process starting beside it (importing JAX,
            # converting) slows its compiles even at the lowest priority (measured on 2 cores).
            self._want(keys)
        return decode_ended

    def session(self, keys: Sequence[BucketKey], *, slots: int = 0) -> Callable[[], None]:
        """An engine's run of requests starts: on LiteRT if the cache holds their buckets (at
        batch 1, the batch its calls then take: `engine_batches`), else on JAX; its missing
        buckets are exported in the background once the run ends."""
        if self._covered(keys):
            self._current = self.litert
            self.litert.warmup(keys, slots=slots)
            self.decodes["litert"] += 1
            return self.litert.session(keys, slots=slots)
        self._current = self.jax
        self.decodes["jax"] += 1
        return lambda: self._want(keys)

    @property
    def engine_batches(self) -> tuple[int, ...] | None:
        return self._current.engine_batches

    @property
    def engine_padding(self) -> str:
        return self._current.engine_padding

    @property
    def engine_replicas(self) -> int:
        return self._current.engine_replicas

    def open(self, config, positions, valid):
        return self._current.open(config, positions, valid)

    def step(self, inputs: StepInputs, *, timings: dict[str, float] | None = None) -> StepOutputs:
        return self._current.step(inputs, timings=timings)

    def fork(self) -> AutoExecutor:
        """The CPU path's twin: forks of both executors, sharing the background export."""
        return AutoExecutor(self.jax.fork(), self.litert.fork(), _export=self._export)

    def place(self, resident) -> int:
        return self._current.place(resident)

    def build_counts(self) -> BuildCounts:
        return self.jax.build_counts() + self.litert.build_counts()

    def set_progress(self, progress: Progress | None) -> None:
        self.jax.set_progress(progress)

    def close(self) -> None:
        self.jax.close()
        self.litert.close()

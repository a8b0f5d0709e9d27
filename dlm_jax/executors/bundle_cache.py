"""The bundle cache: a checkpoint decoded by the LiteRT runner, its buckets exported on first use.

On a CPU the LiteRT runner decodes faster than the JAX executor (`benchmarks/results/peer.md`:
faster in all 18 cases measured; XNNPACK packs each weight matrix into its kernels' layout
once, at load). `BundleCacheExecutor` makes it the executor of a checkpoint loaded with
`dlm_jax.load`: it offers every bucket the JAX executor offers and exports the ones a decode
needs the first time they are needed (`prepare` / `warmup`, which `Model.generate` calls
before decoding, export them all at once), like a persistent compilation cache. Later
processes open what is cached.

    model = dlm_jax.load("models/llada-tiny", executor="litert")
    model.generate("564+894=")          # first call: exports the buckets it needs, then decodes

The cache entry of a model is a directory of bundles (`part-<hash>`). An export converts only
the buckets no part holds, as a new part; then the entry is compacted: its parts are merged
into one bundle (`dlm_jax.tflite_export.merge`: the graphs side by side, each weight stored once), so
an entry holds one copy of the weights whatever the number of exports (one bundle grown by
`export --add` would convert all its buckets again on every addition; separate parts would
each hold a copy of the weights). The merged part replaces the old ones; a process that had
an old part open keeps decoding (its runner holds the model in memory), and one that finds a
part gone between listing and opening the entry lists it again. The entry is keyed by the
model (its config and the bytes of every parameter), the versions of the packages that write
and read it, and the source of the modules that define the exported graph, so a changed model
or program never reuses a stale bundle. Exports into one entry are serialised by a file lock
and written as `dlm-jax export` writes a bundle (a temporary directory renamed into place); a
damaged part is removed and exported again. The cache lives in `$DLM_JAX_BUNDLE_CACHE`, or
`~/.cache/dlm-jax/bundles`, and is kept within `$DLM_JAX_BUNDLE_CACHE_MB` (default 4096) by
evicting the least recently used entries after an export (`dlm_jax.tflite_export.cache_admin`, which
also serves `dlm-jax cache list` / `cache clear`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax.executors.runner import Bundle, LiteRTExecutor, native_stderr_captured
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.step import (BuildCounts, Capabilities, Executor, Progress, StepInputs, StepOutputs,
                                  signature_name)
from dlm_jax.tflite_export import cache_admin
from dlm_jax.tflite_export.cache_admin import CACHE_ENV, cache_root  # noqa: F401 (this module's public names)


def model_fingerprint(model) -> str:
    """A 16-hex-digit key of what a cached bundle holds: the model's config and parameters,
    the package versions and the source of the graph-defining modules."""
    from dlm_jax.executors import jax_executor as program
    from dlm_jax.models import _transformer
    from dlm_jax.models._params import get_params
    from dlm_jax.runtime import step
    from dlm_jax.tflite_export import _convert, bundle, merge

    h = hashlib.sha256()
    h.update(json.dumps({"config": model.config.to_dict(), "versions": bundle._versions()}, sort_keys=True).encode())
    # The modules whose source defines the exported graph: a change to any of them is a new entry.
    for module in (program, _transformer, step, _convert, bundle, merge):
        h.update(inspect.getsource(module).encode())
    for name, value in sorted(get_params(model).items()):
        value = np.ascontiguousarray(value)
        h.update(f"{name}:{value.dtype}:{value.shape}".encode())
        h.update(memoryview(value).cast("B"))
    return h.hexdigest()[:16]


def model_entries(model: str | os.PathLike, root: Path | None = None) -> list[cache_admin.Entry]:
    """The entries of the checkpoint at `model`: its fingerprint's (the model loaded and hashed
    as the cache hashes it), and any recording that directory as their source (entries of
    earlier versions of the package or of the model's files).

    Raises:
      CheckpointError: `model` is not a readable checkpoint.
    """
    from dlm_jax.checkpoint._io import load_pretrained

    try:
        fingerprint = model_fingerprint(load_pretrained(model, verify=False))
    except CheckpointError as e:
        raise CheckpointError(f"{model} is not a readable checkpoint ({e})") from None
    here = Path(model).resolve()
    return [e for e in cache_admin.entries(root) if e.fingerprint == fingerprint or Path(e.source).resolve() == here]


def _covers(keys: Sequence[BucketKey], key: BucketKey) -> bool:
    """A bundle runs `key` with the signature of that name or its full-logits twin."""
    return key in keys or dataclasses.replace(key, full_logits=True) in keys


class BundleCacheExecutor(Executor):
    """The LiteRT runner over a cached bundle of `model` (a Flax `Transformer`; `source`, its
    checkpoint directory, names the cache entry), exporting the buckets it
    lacks when they are first needed. Offers the JAX executor's buckets
    (`Capabilities.for_length`), so any decode the JAX executor runs, this one runs.

    `progress(stage, done, total)` reports an export as it converts (the CLI draws a bar);
    `exported` lists the buckets this executor added to the cache, `evicted` the entries
    (`cache_admin.Entry`) its exports evicted to keep the cache within its limit.

    Raises:
      ConfigError: `$DLM_JAX_BUNDLE_CACHE_MB` is not a size in MB."""

    prepares_ahead = True  # one export converts many buckets: take those of nearby prompt lengths too

    def __init__(self, model, *, source: str | os.PathLike = "", root: str | os.PathLike | None = None,
                 threads: int = 2, progress: Callable[[str, int, int], None] | None = None):
        self._model = model
        self.config = model.config
        self._source = str(source)
        self._root = Path(root or cache_root())
        self._limit = cache_admin.cache_limit()
        self.evicted: list[cache_admin.Entry] = []
        self._threads = threads
        self.progress = progress
        self._capabilities = Capabilities.for_length(self.config.max_seq_len)
        self._path: Path | None = None
        self.exported: list[BucketKey] = []
        self.export_seconds = 0.0
        self._runners: dict[Path, LiteRTExecutor] = {}  # part directory -> its runner
        self._route: dict[BucketKey, LiteRTExecutor] = {}  # bucket -> the runner that runs it

    @property
    def path(self) -> Path:
        """The cache entry of this model (a directory of bundles, `part-*`); hashed on first use."""
        if self._path is None:
            self._path = self._root / f"{self._name}-{model_fingerprint(self._model)}"
        return self._path

    @property
    def _name(self) -> str:
        return Path(self._source).name or "model"

    def may_hold(self) -> bool:
        """Whether the cache has any part of an entry named like this model's (without hashing
        its weights for the entry's key): False means it holds none of its buckets."""
        return self._path is not None or any(self._root.glob(f"{self._name}-*/part-*"))

    # An engine's calls take one row each: the cache then exports only the batch-1 buckets a
    # request's steps use (an export costs seconds per bucket), and a row's arithmetic is that
    # of its solo decode (batch invariance on LiteRT by construction).
    engine_batches = (1,)

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def parts_open(self) -> list[Path]:
        """The cached bundles this executor has opened (a part merged away since stays open)."""
        return sorted(self._runners)

    def _lock(self):
        """The lock that serialises exports into this model's entry, its compaction and its
        removal (across processes)."""
        return cache_admin.entry_lock(self.path)

    def _scan(self) -> dict[Path, list[BucketKey]]:
        """The readable parts of the entry and their buckets (from `bundle.json`; the files are
        checked when a part is opened)."""
        parts = {}
        for d in sorted(self.path.glob("part-*")):
            try:
                parts[d] = Bundle.open(d, verify=False).keys
            except CheckpointError:
                continue
        return parts

    def _export(self, keys: list[BucketKey], part: Path | None = None) -> None:
        """Export `keys` as one part (by default named after them)."""
        from dlm_jax.tflite_export.bundle import export_bundle

        with native_stderr_captured():  # the converter logs its start-up to the native stderr
            import litert_converter.converter_api_ext  # noqa: F401
        names = ",".join(signature_name(k) for k in keys)
        part = part or self.path / f"part-{hashlib.sha256(names.encode()).hexdigest()[:12]}"
        if part.exists():  # an unreadable part of that name: replace it
            shutil.rmtree(part)
        source = Path(self._source)
        source = str(source.resolve()) if self._source and source.exists() else self._source  # for `cache list`
        t0 = time.perf_counter()
        export_bundle(source, part, keys=keys, decode=DecodeConfig(), model=self._model,
                      latency_repeats=0, plan=False, progress=self.progress)
        self.export_seconds += time.perf_counter() - t0

    def _compact(self) -> None:
        """Merge the entry's parts into one bundle, its weights stored once, and remove them
        (under the entry's lock). A part that fails its check is left for `_ensure` to replace;
        a bundle the merge refuses is exported again with every bucket, as one part."""
        from dlm_jax.tflite_export.merge import merge_bundles

        parts = self._scan()
        if len(parts) < 2:
            return
        keys = sorted({k for v in parts.values() for k in v})
        names = ",".join(signature_name(k) for k in keys)
        merged = self.path / f"part-{hashlib.sha256(f'merged:{names}'.encode()).hexdigest()[:12]}"
        try:
            merge_bundles(sorted(parts), merged)
        except CheckpointError:  # a damaged part: opening it removes it and exports its buckets again
            return
        except ConfigError:
            self._export(keys, merged)
        for part in parts:
            if part != merged:
                cache_admin.remove_tree(part)

    def _export_missing(self, keys: Sequence[BucketKey]) -> dict[Path, list[BucketKey]]:
        """Export, as one new part, the buckets of `keys` no part holds, then compact the entry
        and keep the cache within its limit; the parts after it. Records a use of the entry."""

        def missing(parts: dict[Path, list[BucketKey]]) -> list[BucketKey]:
            return sorted({k for k in keys if not any(_covers(v, k) for v in parts.values())})

        parts = self._scan()
        cache_admin.touch(self.path)
        if missing(parts):
            with self._lock():
                parts = self._scan()  # another process may have exported them meanwhile
                todo = missing(parts)
                if todo:
                    self._export(todo)
                    self.exported.extend(todo)
                    self._compact()
                    parts = self._scan()
            if todo:
                self.evicted += cache_admin.evict(self._root, self._limit, keep=frozenset({self.path}))
        return parts

    def _open(self, part: Path) -> LiteRTExecutor | None:
        """A runner over `part`; None when the part vanished (compacted or evicted by another
        process since the entry was listed). A damaged part is removed, and CheckpointError raised."""
        try:
            return LiteRTExecutor(Bundle.open(part), accelerator="cpu", threads=self._threads)
        except (CheckpointError, FileNotFoundError) as e:
            if not part.exists():
                return None
            with self._lock():  # checked again under the lock: another process may have replaced it
                try:
                    Bundle.open(part)
                except CheckpointError:
                    shutil.rmtree(part, ignore_errors=True)
            raise e if isinstance(e, CheckpointError) else CheckpointError(f"{part}: {e}") from None

    def _ensure(self, keys: Sequence[BucketKey], *, retry: bool = True, rescans: int = 8) -> None:
        """Route every bucket of `keys` to an open part, exporting the ones no part holds (as a
        new part, then merged with the others: an export converts only what is new)."""
        need = [k for k in dict.fromkeys(keys) if k not in self._route]
        if not need:
            return
        parts = self._export_missing(need)
        for key in need:
            holding = [p for p, v in parts.items() if _covers(v, key)]
            opened = [p for p in holding if p in self._runners]
            # Fewest parts open: one already open, else the one holding most of this request.
            part = opened[0] if opened else max(holding, key=lambda p: sum(_covers(parts[p], k) for k in need))
            if part not in self._runners:
                try:
                    runner = self._open(part)
                except CheckpointError:  # a damaged part, removed: export its buckets again
                    if not retry:
                        raise
                    return self._ensure(keys, retry=False, rescans=rescans)
                if runner is None:  # gone meanwhile: list the entry again
                    if not rescans:
                        raise CheckpointError(f"{self.path}: its parts keep vanishing as they are opened "
                                              f"(another process removing the cache?)")
                    return self._ensure(keys, retry=retry, rescans=rescans - 1)
                self._runners[part] = runner
            self._route[key] = self._runners[part]

    def fork(self) -> BundleCacheExecutor:
        """A second executor over the same cache entry (the same lowered weights; runners of
        its own, one thread) for a second thread: the CPU refresh path of progressive
        revision."""
        twin = BundleCacheExecutor(self._model, source=self._source, root=self._root, threads=1,
                                   progress=self.progress)
        twin._path = self._path
        return twin

    def prepare(self, keys: Sequence[BucketKey]) -> None:
        """Export the buckets of `keys` the cache lacks, in one export."""
        self._export_missing(keys)

    def warmup(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False) -> int:
        """Export the buckets of `keys` the cache lacks (all in one export), then prepare each
        in its runner; returns how many were not prepared yet."""
        self._ensure(keys)
        return sum(self._route[k].warmup([k]) for k in dict.fromkeys(keys))

    def step(self, inputs: StepInputs, *, timings: dict[str, float] | None = None) -> StepOutputs:
        runner = self._route.get(inputs.key)
        if runner is None:
            self._ensure([inputs.key])
            runner = self._route[inputs.key]
        return runner.step(inputs, timings=timings)

    def set_progress(self, progress: Progress | None) -> None:
        self.progress = progress

    def build_counts(self) -> BuildCounts:
        """Buckets this executor exported (and their seconds), signatures its runners set up."""
        runners = sum((r.build_counts() for r in self._runners.values()), BuildCounts())
        return dataclasses.replace(runners, exports=len(self.exported), export_seconds=self.export_seconds)

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()

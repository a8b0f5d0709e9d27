"""The bundle cache's bookkeeping: where it lives, its entries, their size and last use, a size
limit kept by evicting the least recently used, and `dlm-jax cache list` / `cache clear`.

The cache (`dlm_jax.executors.bundle_cache`) holds one entry per model: `<root>/<name>-<fingerprint>/`,
a directory of bundles (`part-*`), beside it the file lock `<name>-<fingerprint>.lock` that
serialises exports into it (and its removal). Without a limit nothing would ever leave it, so:

- size: the bytes of the files under an entry, as `os.lstat` gives them (`st_size`, the
  apparent size `du --apparent-size` reports: the same on every file system, so a limit and
  a test can count on it; blocks add under 4 KiB per file). MB here is 10^6 bytes, as the
  other `MB` options of dlm-jax.
- last use: the entry directory's mtime. An executor touches it whenever a decode asks it for
  buckets it has not routed yet (`prepare` / `warmup`: once per `Model.generate`), never per
  step; an export and a compaction change it too.
- limit: `$DLM_JAX_BUNDLE_CACHE_MB` (default 4096). After an export, whole entries are
  evicted, least recently used first, until the cache is within it; never the entry of the
  executor that exported, and never one another process holds the lock of (it is being
  exported into: in use). 0 keeps only the entry in use.
- removal: under the entry's lock, the entry is renamed to a hidden sibling, then deleted, so
  no process ever scans a half-removed entry. A process decoding from a removed entry goes on
  (its runners hold the model in memory); one that needs more buckets exports them anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlm_jax._errors import ConfigError
from dlm_jax.executors.bundle_files import BUNDLE_FILE

CACHE_ENV = "DLM_JAX_BUNDLE_CACHE"
LIMIT_ENV = "DLM_JAX_BUNDLE_CACHE_MB"
DEFAULT_LIMIT_MB = 4096
MB = 1_000_000


def cache_root() -> Path:
    """Where cached bundles live: `$DLM_JAX_BUNDLE_CACHE`, or `~/.cache/dlm-jax/bundles`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dlm-jax" / "bundles")


def cache_limit() -> int:
    """The cache's size limit in bytes: `$DLM_JAX_BUNDLE_CACHE_MB` (default 4096 MB).

    Raises:
      ConfigError: the variable is not a number of MB >= 0.
    """
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT_MB * MB
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not mb >= 0:  # also NaN
        raise ConfigError(f"{LIMIT_ENV}={text!r} is not a size in MB (a number >= 0; default {DEFAULT_LIMIT_MB})")
    return int(mb * MB)


def lock_path(entry: Path) -> Path:
    return entry.parent / f"{entry.name}.lock"


@contextlib.contextmanager
def entry_lock(entry: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold the lock of `entry` (across processes) for the block; yields False, holding
    nothing, when `wait` is off and another process holds it. The lock file stays: removing
    it would let a process that opened it lock a file no one else sees."""
    path = lock_path(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def touch(entry: Path) -> None:
    """Record a use of `entry` (its mtime); a read-only cache records nothing."""
    with contextlib.suppress(OSError):
        os.utime(entry)


def tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (`lstat` sizes; files vanishing meanwhile count 0)."""
    total = 0
    for folder, dirs, files in os.walk(path):  # a link to a directory is listed in `dirs`, not followed
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def remove_tree(path: Path) -> None:
    """Rename `path` to a hidden sibling, then delete it: nothing half-removed is ever visible
    under its name."""
    hidden = Path(tempfile.mkdtemp(prefix=f".{path.name}.removed-", dir=path.parent))
    os.rmdir(hidden)
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One model's entry: its directory, the checkpoint it came from (the `source` its bundles
    record, else the directory name), size, parts, buckets and last use."""

    path: Path
    source: str
    fingerprint: str
    bytes: int
    parts: int
    buckets: int
    last_use: float

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.source, "fingerprint": self.fingerprint, "path": str(self.path),
                "mb": round(self.bytes / MB, 2), "bytes": self.bytes, "parts": self.parts,
                "buckets": self.buckets, "last_use": _iso(self.last_use)}


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def read_entry(path: Path) -> Entry | None:
    """The entry at `path`, or None if it vanished (removed by another process)."""
    source, buckets, parts = None, set(), 0
    for part in sorted(path.glob("part-*")):
        parts += 1
        try:
            meta = json.loads((part / BUNDLE_FILE).read_text(encoding="utf-8"))
            buckets.update(b["signature"] for b in meta["buckets"])
            source = source or meta.get("source") or None
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged or vanished part: still counted, as its bytes are
    try:
        last_use = path.stat().st_mtime
    except FileNotFoundError:
        return None
    name, _, fingerprint = path.name.rpartition("-")
    return Entry(path, source or name, fingerprint, tree_bytes(path), parts, len(buckets), last_use)


def entries(root: Path | None = None) -> list[Entry]:
    """The entries of the cache at `root` (default `cache_root()`), least recently used first."""
    root = Path(root or cache_root())
    if not root.is_dir():
        return []
    found = (read_entry(p) for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return sorted((e for e in found if e is not None), key=lambda e: (e.last_use, e.path.name))


def remove_entry(entry: Path, *, wait: bool = True) -> bool:
    """Remove `entry` under its lock; False when it is locked and `wait` is off, or gone."""
    with entry_lock(entry, wait=wait) as held:
        if not held or not entry.exists():
            return False
        remove_tree(entry)
        return True


def evict(root: Path, limit: int, *, keep: frozenset[Path] = frozenset()) -> list[Entry]:
    """Remove whole entries of the cache at `root`, least recently used first, until it holds
    at most `limit` bytes; never those in `keep` or one another process has locked. Returns
    the removed entries."""
    found = entries(root)
    total = sum(e.bytes for e in found)
    removed = []
    for e in found:
        if total <= limit:
            break
        if e.path in keep:
            continue
        if remove_entry(e.path, wait=False):
            total -= e.bytes
            removed.append(e)
    return removed


def describe(found: list[Entry], root: Path) -> dict[str, Any]:
    """`cache list --json`: the entries, their total and the limit."""
    total = sum(e.bytes for e in found)
    return {"root": str(root), "entries": [e.to_dict() for e in found], "total_mb": round(total / MB, 2),
            "limit_mb": round(cache_limit() / MB, 2), "limit_env": LIMIT_ENV}


def table(found: list[Entry], root: Path, model: str | None = None) -> str:
    """`cache list`: one line per entry (those of `model`), most recently used last, then the
    total and the limit."""
    rows = [("model", "fingerprint", "MB", "parts", "buckets", "last use")]
    rows += [(e.source, e.fingerprint, f"{e.bytes / MB:.1f}", str(e.parts), str(e.buckets), _iso(e.last_use))
             for e in found]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i in (2, 3, 4) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             .rstrip() for r in rows] if found else [f"no cached bundles{f' of {model}' if model else ''} in {root}"]
    lines.append(f"total {_mb(found)} in {_count(found)} of {root}; limit {cache_limit() / MB:g} MB (${LIMIT_ENV})")
    return "\n".join(lines)


def cleared(removed: list[Entry], root: Path) -> str:
    """`cache clear`: a line per removed entry, then the MB freed."""
    lines = [f"removed {e.source} {e.fingerprint} ({_mb([e])})" for e in removed]
    return "\n".join([*lines, f"freed {_mb(removed)} ({_count(removed)}) in {root}"])


def _mb(found: list[Entry]) -> str:
    return f"{sum(e.bytes for e in found) / MB:.1f} MB"


def _count(found: list[Entry]) -> str:
    return f"{len(found)} {'entry' if len(found) == 1 else 'entries'}"

"""File integrity and safe writes for everything dlm-jax writes.

A manifest (`manifest.json` by default) lists each file of an output with its size and sha256;
loaders verify it before trusting the bytes, so a flipped byte in a weight file names the file
instead of decoding silently. Big files (`SAMPLE_ABOVE`) also get the sha256 of a few chunks
spread over them, which a load checks instead of hashing every byte (`verify_manifest`); the
full sha256 stays in the entry, so `full=True` checks every byte, and manifests without the
sampled digest (written before it, or by an older dlm-jax) are hashed whole as before. Readers
that do not know the `sample` field ignore it: the format stays at version 1.

Checkpoints are verified with `editable=is_editable`: the text files people edit by hand
(config.json, tokenizer files, chat templates) warn once when they differ instead of refusing
the checkpoint, while weights stay strict; `dlm-jax manifest DIR` (`rewrite_manifest`)
records the edit.

Writes go to a temporary file in the destination's directory and are renamed into place, so
an interrupted write never leaves a half-written file; temporary files and directories get the
permissions the user's umask gives (`tempfile` makes them 0600 / 0700, which would leave a
finished checkpoint unreadable to the user's group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from dlm_jax._errors import CheckpointError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "dlm-jax-manifest"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20
_HASH_WORKERS = 8
# Files of at least SAMPLE_ABOVE bytes also get a digest of SAMPLE_CHUNKS chunks of
# SAMPLE_CHUNK_BYTES spread over the file, which loading checks instead of every byte: sha256
# runs at ~1.3 GB/s from a warm page cache here and 0.45-0.9 GB/s cold (1 GiB: 0.8 s warm,
# 1.1-2.3 s cold), so a 64 MiB file hashes in ~50 ms, unnoticed, while a 16 GB checkpoint
# would cost 13-35 s per load on two cores. 16 x 1 MiB hash in ~15 ms warm, ~35 ms cold,
# whatever the file's size.
SAMPLE_ABOVE = 64 << 20
SAMPLE_CHUNKS = 16
SAMPLE_CHUNK_BYTES = 1 << 20
# Suffixes of the files people edit by hand (`is_editable`).
TEXT_SUFFIXES = frozenset({".json", ".jinja", ".j2", ".txt", ".md", ".yaml", ".yml", ".toml", ".csv", ".tsv"})


def umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike, *, directory: bool = False) -> None:
    """Give `path` the mode a plain `open` / `mkdir` would have given it."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask())


def make_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A fresh directory in `parent` (same file system as the destination, so a rename is
    atomic), with umask permissions."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    apply_umask(tmp, directory=True)
    return tmp


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling path for a writer that opens files by name (gguf-py): renamed to
    `path` when the block ends, removed if it raises (nothing half-written)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Any]:
    """A binary file to write `path` through: a temporary sibling, synced and renamed into
    place when the block ends, removed if it raises (nothing half-written)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` to `path` through a temporary sibling and a rename."""
    with atomic_file(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 2) -> Path:
    return atomic_write(path, json.dumps(data, indent=indent, ensure_ascii=False) + "\n")


def _sample_spans(size: int, chunks: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the sampled chunks of a `size`-byte file: `chunks` chunks spread
    evenly from its first byte to its last (the safetensors header and the last tensor's tail
    included); the whole file when the chunks would cover it."""
    if chunks * chunk_bytes >= size:
        return [(0, size)]
    return [((size - chunk_bytes) * i // (chunks - 1), chunk_bytes) for i in range(chunks)]


def sample_digest(path: str | os.PathLike, chunks: int | None = None, chunk_bytes: int | None = None) -> str:
    """sha256 of the sampled chunks of a file (`_sample_spans`), the bytes in file order."""
    chunks = SAMPLE_CHUNKS if chunks is None else chunks
    chunk_bytes = SAMPLE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for offset, length in _sample_spans(os.fstat(f.fileno()).st_size, chunks, chunk_bytes):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def _sha256(path: str | os.PathLike) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest entry of one file: {"size": bytes, "sha256": hex digest}, and for a file of
    at least `SAMPLE_ABOVE` bytes also {"sample": {"chunks", "chunk_bytes", "sha256"}}, the
    digest of its sampled chunks, which loading checks instead of hashing every byte."""
    entry = _sha256(path)
    if entry["size"] >= SAMPLE_ABOVE:
        entry["sample"] = {"chunks": SAMPLE_CHUNKS, "chunk_bytes": SAMPLE_CHUNK_BYTES,
                           "sha256": sample_digest(path, SAMPLE_CHUNKS, SAMPLE_CHUNK_BYTES)}
    return entry


def is_editable(rel: str) -> bool:
    """Whether a file is one people edit by hand (a text file by its suffix: config.json,
    tokenizer files, chat templates, READMEs): with `verify_manifest(editable=is_editable)` a
    change to it warns instead of refusing the directory. Weights and other binary files are
    never editable: a changed byte there is corruption until shown otherwise."""
    return PurePosixPath(rel).suffix.lower() in TEXT_SUFFIXES


def rerecord_command(directory: str | os.PathLike) -> str:
    """The command that records a directory's files anew in its manifest."""
    return f"dlm-jax manifest {shlex.quote(str(directory))}"


def _map(fn: Callable[[Path], Any], paths: list[Path]) -> list[Any]:
    """`fn` over `paths`, side by side (hashlib releases the GIL): an 8B checkpoint is 16 GB."""
    workers = min(_HASH_WORKERS, os.cpu_count() or 1, len(paths))
    if workers <= 1:
        return [fn(p) for p in paths]
    with ThreadPoolExecutor(workers, thread_name_prefix="dlm-jax-hash") as pool:
        return list(pool.map(fn, paths))


def _listed(directory: Path, files: Iterable[str] | None, name: str) -> list[str]:
    if files is not None:
        return sorted(set(files))
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != name and not p.name.startswith(".")
                  and not p.name.endswith(".manifest.json"))


def _write_entries(directory: Path, entries: dict[str, dict], name: str) -> Path:
    return atomic_write_json(directory / name, {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                                                "files": entries})


def write_manifest(directory: str | os.PathLike, files: Iterable[str] | None = None, *,
                   name: str = MANIFEST_NAME) -> Path:
    """List `files` (paths relative to `directory`; default: every regular file below it but
    hidden ones and other manifests) with size and sha256 (and a sampled digest for big files,
    `file_digest`) in `directory/name`, atomically."""
    directory = Path(directory)
    listed = _listed(directory, files, name)
    return _write_entries(directory, dict(zip(listed, _map(file_digest, [directory / r for r in listed]))), name)


def read_manifest(directory: str | os.PathLike, *, name: str = MANIFEST_NAME) -> dict[str, dict] | None:
    """The manifest's file table, or None when `directory` has none."""
    path = Path(directory) / name
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        if data.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError("not a dlm-jax manifest")
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError(f"version {data.get('version')!r} is not {MANIFEST_VERSION}")
        for rel, entry in files.items():
            if not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str):
                raise ValueError(f"entry {rel!r} has no size and sha256")
            sample = entry.get("sample")
            if sample is not None and not (isinstance(sample.get("chunks"), int) and sample["chunks"] >= 2
                                           and isinstance(sample.get("chunk_bytes"), int)
                                           and sample["chunk_bytes"] >= 1 and isinstance(sample.get("sha256"), str)):
                raise ValueError(f"entry {rel!r} has a malformed sample")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt manifest ({e})") from None
    return files


_SKIP = "pass verify=False / --no-verify to load anyway"


def verify_manifest(directory: str | os.PathLike, *, name: str = MANIFEST_NAME,
                    required: bool = False, files: Iterable[str] | None = None, full: bool = False,
                    editable: Callable[[str], bool] | None = None, expected: Iterable[str] = ()) -> bool:
    """Check the files the manifest in `directory` lists (or only `files` of them) against it.
    Returns False when there is no manifest (an error if `required`).

    What a check reads: a file the manifest gives a sampled digest (every file of at least
    `SAMPLE_ABOVE` bytes in manifests written since it exists) is checked by size and the
    sha256 of its sampled chunks, a few MB whatever its size, since hashing all of a 16 GB
    checkpoint costs seconds to tens of seconds at every load; `full=True` hashes every byte
    of every file. Any other file (small ones, and every file of a manifest written before the
    sampled digests) is hashed whole. A size check catches truncation either way; a sampled
    check misses a flipped byte outside its chunks, which `full` catches.

    Args:
      editable: which files (relative paths) people edit by hand (`is_editable`); a listed one
        that is missing or differs, or one of `expected` that the manifest does not list, is
        reported in one warning that names the files and `rerecord_command`, and loads as it
        is. None: every file is strict (outputs nobody edits, such as bundles).
      expected: files (relative) the caller is going to read: one that exists but that the
        manifest does not list is a warning if editable, else an error (an unrecorded weight
        file would load unchecked).

    Raises:
      CheckpointError: naming the first strict file that is missing, of another size, whose
        bytes differ or that is not listed, and how to skip the check.
    """
    directory = Path(directory)
    table = read_manifest(directory, name=name)
    if table is None:
        if required:
            raise CheckpointError(f"{directory}: no {name} to verify the files against")
        return False
    lenient = editable or (lambda rel: False)
    notes: list[str] = []
    for rel in sorted(set(expected) - set(table)):
        if (directory / rel).is_file():
            if not lenient(rel):
                raise CheckpointError(f"{directory / rel}: not listed in {name} (record it with: "
                                      f"{rerecord_command(directory)}; or {_SKIP})")
            notes.append(f"{rel} is not listed in {name}")
    wanted = sorted(table) if files is None else sorted(set(files) & set(table))
    to_hash: list[str] = []
    for rel in wanted:  # the cheap checks first: a missing shard fails before any is hashed
        entry, path = table[rel], directory / rel
        if not path.is_file():
            if not lenient(rel):
                raise CheckpointError(f"{path}: listed in {name} but missing")
            notes.append(f"{rel} is listed in {name} but missing")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            if not lenient(rel):
                raise CheckpointError(f"{path}: truncated or modified ({size} bytes, {name} says "
                                      f"{entry['size']}; {_SKIP})")
            notes.append(f"{rel} differs from {name}")
            continue
        to_hash.append(rel)

    def check(rel: str) -> bool:
        entry, path = table[rel], directory / rel
        sample = entry.get("sample")
        if sample is None or full:
            return _sha256(path)["sha256"] == entry["sha256"]
        return sample_digest(path, sample["chunks"], sample["chunk_bytes"]) == sample["sha256"]

    for rel, same in zip(to_hash, _map(check, to_hash)):
        if same:
            continue
        if not lenient(rel):
            how = "" if full or "sample" not in table[rel] else "in its sampled chunks "
            raise CheckpointError(f"{directory / rel}: sha256 differs from {name} {how}(corrupt or modified; {_SKIP})")
        notes.append(f"{rel} differs from {name}")
    if notes:
        warnings.warn(f"{directory}: {'; '.join(notes)} (edited by hand?); loading as it is. To record the "
                      f"files as they are now: {rerecord_command(directory)}", UserWarning, stacklevel=2)
    return True


@dataclasses.dataclass(frozen=True)
class ManifestUpdate:
    """What `rewrite_manifest` recorded: the manifest, how many files, and the files whose
    entry changed, appeared or went away since the manifest before it."""

    path: Path
    files: int
    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line: `DIR/manifest.json: recorded N files (changed: a; added: b)`."""
        parts = [f"{what}: {', '.join(names)}" for what, names in
                 (("changed", self.changed), ("added", self.added), ("removed", self.removed)) if names]
        return f"{self.path}: recorded {self.files} files ({'; '.join(parts) or 'no change'})"


def rewrite_manifest(directory: str | os.PathLike, *, force: bool = False, name: str = MANIFEST_NAME) -> ManifestUpdate:
    """Record the current files of `directory` in its manifest (`dlm-jax manifest DIR`), after
    files were edited by hand: every regular file below it but hidden ones, other manifests and
    subdirectories holding a manifest of their own (adapters shipped beside a model are their own
    unit), atomically.

    A strict file (not `is_editable`: weights) whose bytes differ from the manifest it replaces is
    refused unless `force`: a weight file that changed unnoticed is more likely corrupt than
    edited, and recording it would make the corruption pass every later check. A corrupt old
    manifest is simply replaced.

    Raises:
      CheckpointError: `directory` is not a directory, or (without `force`) the strict files that
        changed, named.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such directory")
    try:
        old = read_manifest(directory, name=name) or {}
    except CheckpointError:
        old = {}
    units = [p.parent for p in directory.rglob(name) if p.parent != directory]
    listed = [rel for rel in _listed(directory, None, name)
              if not any((directory / rel).is_relative_to(unit) for unit in units)]
    entries = dict(zip(listed, _map(file_digest, [directory / r for r in listed])))
    changed = tuple(r for r in listed if r in old and (old[r].get("size"), old[r].get("sha256"))
                    != (entries[r]["size"], entries[r]["sha256"]))
    refused = [r for r in changed if not is_editable(r)]
    if refused and not force:
        raise CheckpointError(f"{directory}: {', '.join(refused)} changed since {name} recorded them, and a weight "
                              f"file that changed is likelier corrupt than edited: check, then pass --force "
                              f"(force=True) to record them as they are")
    path = _write_entries(directory, entries, name)
    return ManifestUpdate(path, len(entries), changed, tuple(r for r in listed if r not in old),
                          tuple(sorted(set(old) - set(entries))))


def manifest_name(path: str | os.PathLike) -> str:
    """The manifest beside a single-file output: `latency.json` -> `latency.manifest.json`."""
    return f"{Path(path).stem}.manifest.json"


def publish_dir(tmp: Path, dst: Path) -> None:
    """Finish a directory written at the temporary `tmp`: umask permissions on everything in
    it, a manifest, then `replace_dir` into `dst`."""
    for file in tmp.rglob("*"):
        apply_umask(file, directory=file.is_dir())
    write_manifest(tmp)
    replace_dir(tmp, dst)


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` to `dst`; an existing `dst` is swapped out, then removed."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.rmdir(old)
    os.replace(dst, old)
    try:
        os.replace(src, dst)
    except BaseException:
        os.replace(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)

"""File integrity and safe writes for everything dlm-jax writes.

A manifest (`manifest.json` by default) lists each file of an output with its size and sha256;
loaders verify it before trusting the bytes, so a flipped byte in a weight file names the file
instead of decoding silently. Writes go to a temporary file in the destination's directory and
are renamed into place, so an interrupted write never leaves a half-written file; temporary
files and directories get the permissions the user's umask gives (`tempfile` makes them 0600 /
0700, which would leave a finished checkpoint unreadable to the user's group).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dlm_jax._errors import CheckpointError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "dlm-jax-manifest"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20
_HASH_WORKERS = 8


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


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """{"size": bytes, "sha256": hex digest} of one file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _listed(directory: Path, files: Iterable[str] | None, name: str) -> list[str]:
    if files is not None:
        return sorted(set(files))
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != name and not p.name.startswith(".")
                  and not p.name.endswith(".manifest.json"))


def write_manifest(directory: str | os.PathLike, files: Iterable[str] | None = None, *,
                   name: str = MANIFEST_NAME) -> Path:
    """List `files` (paths relative to `directory`; default: every regular file below it but
    hidden ones and other manifests) with size and sha256 in `directory/name`, atomically."""
    directory = Path(directory)
    entries = {rel: file_digest(directory / rel) for rel in _listed(directory, files, name)}
    return atomic_write_json(directory / name, {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                                                "files": entries})


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
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt manifest ({e})") from None
    return files


def verify_manifest(directory: str | os.PathLike, *, name: str = MANIFEST_NAME,
                    required: bool = False, files: Iterable[str] | None = None) -> bool:
    """Check every file the manifest in `directory` lists (or only `files` of them) against its
    size and sha256. Returns False when there is no manifest (an error if `required`).

    Raises:
      CheckpointError: naming the first file that is missing, of another size or whose bytes
        differ, and how to skip the check.
    """
    directory = Path(directory)
    table = read_manifest(directory, name=name)
    if table is None:
        if required:
            raise CheckpointError(f"{directory}: no {name} to verify the files against")
        return False
    wanted = sorted(table) if files is None else sorted(set(files) & set(table))
    for rel in wanted:  # the cheap checks first: a missing shard fails before any is hashed
        entry, path = table[rel], directory / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {name} but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{path}: truncated or modified ({size} bytes, {name} says "
                                  f"{entry['size']}; pass verify=False / --no-verify to load anyway)")
    # Shards hashed side by side (hashlib releases the GIL): an 8B checkpoint is 16 GB of sha256.
    workers = min(_HASH_WORKERS, os.cpu_count() or 1, len(wanted))
    paths = [directory / rel for rel in wanted]
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="dlm-jax-verify") as pool:
            digests = list(pool.map(file_digest, paths))
    else:
        digests = [file_digest(p) for p in paths]
    for rel, path, digest in zip(wanted, paths, digests):
        if digest["sha256"] != table[rel]["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from {name} (corrupt or modified; "
                                  f"pass verify=False / --no-verify to load anyway)")
    return True


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

"""Hugging Face model ids (`org/name`, `org/name@revision`) as checkpoint locations.

`dlm_jax.load("org/name")` and `--model org/name` load the snapshot that the local Hugging Face
cache holds for that repository (`huggingface_hub.snapshot_download(local_files_only=True)`,
with the cache where `HF_HUB_CACHE` / `HF_HOME` / `XDG_CACHE_HOME` put it, read when called).
Nothing is ever downloaded here: loading a model is not the moment to fetch gigabytes, and
the machines dlm-jax targets are often offline. A model id not in the cache fails with one line
that gives the command that downloads it (`hf download org/name`, huggingface_hub's CLI).

Which strings are ids: an existing path always wins (a directory `org/name` below the working
directory loads as a directory); otherwise a `str` of the form `namespace/name` (one slash,
the characters the Hub allows, optionally `@revision`) is an id. A `Path` (or other PathLike)
is always a path. Anything else that does not exist is left to the loader's "no such checkpoint
directory" error. The snapshot directory is what loads, so whatever is keyed on the checkpoint
path (the bundle cache) is keyed per revision: a snapshot directory never changes.

Importing huggingface_hub costs about half a second; it happens only for strings that look
like ids and are not paths.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from dlm_jax._errors import CheckpointError

# namespace/name as the Hub allows them (huggingface_hub.utils.validate_repo_id: [\w.-], not
# starting or ending with '-' or '.', no '--' or '..', at most 96 characters each), then an
# optional "@revision" (a branch, tag or commit hash; branches may hold '/': refs/pr/1).
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[A-Za-z0-9_.][A-Za-z0-9_./-]{{0,255}}))?")


def parse_hub_id(text: object) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) when `text` is a string shaped like a Hub model id that is
    not an existing path, else None."""
    if not isinstance(text, str) or os.path.exists(text):
        return None
    match = _HUB_ID.fullmatch(text)
    if match is None:
        return None
    repo, revision = match["repo"], match["revision"]
    if "--" in repo or ".." in repo or repo.endswith(".git") or (revision and ".." in revision):
        return None
    return repo, revision


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub locates it (`HF_HUB_CACHE`, the older
    `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
    ~/.cache/huggingface/hub), read from the environment now rather than when huggingface_hub
    was imported, so a process that sets it after importing dlm-jax is followed."""
    env = os.environ
    where = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not where:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        where = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(where)))


def download_command(repo: str, revision: str | None = None) -> str:
    """The shell command that puts `repo` (at `revision`) into the cache."""
    cmd = f"hf download {shlex.quote(repo)}"
    return cmd + (f" --revision {shlex.quote(revision)}" if revision else "")


def _offline() -> bool:
    return any(os.environ.get(k, "").upper() in {"1", "ON", "YES", "TRUE"}
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def snapshot_path(repo: str, revision: str | None = None) -> Path:
    """The cached snapshot directory of the Hub model `repo` at `revision` (default: main).

    Raises:
      CheckpointError: one line: the model (or that revision of it) is not in the cache, and the
        command that downloads it.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    label = repo + (f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except HFValidationError as e:
        raise CheckpointError(f"{label}: no such checkpoint directory, nor a valid Hugging Face model id "
                              f"({e})") from None
    except LocalEntryNotFoundError as e:  # IncompleteSnapshotError too (a download cut short)
        repo_dir = cache / f"models--{repo.replace('/', '--')}"
        refs = sorted(p.name for p in (repo_dir / "refs").glob("*")) if (repo_dir / "refs").is_dir() else []
        if "incomplete" in str(e).lower():
            what = f"the cached snapshot of {label} in {cache} is incomplete"
        elif repo_dir.is_dir():
            what = (f"revision {revision or 'main'} of {repo} is not in the Hugging Face cache {cache}"
                    + (f" (cached: {', '.join(refs)})" if refs else ""))
        else:
            what = f"no such checkpoint directory, nor a model in the Hugging Face cache {cache}"
        hint = " (with HF_HUB_OFFLINE unset)" if _offline() else ""
        raise CheckpointError(f"{label}: {what}; download it with: {download_command(repo, revision)}{hint}") from None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The directory a checkpoint argument names: `path` itself, or, for a string shaped like
    a Hub model id that is not an existing path, its snapshot in the local Hugging Face cache
    (`snapshot_path`). A path that does not exist comes back as it is, for the loader's error."""
    hub = parse_hub_id(path)
    if hub is None:
        return Path(path)
    return snapshot_path(*hub)

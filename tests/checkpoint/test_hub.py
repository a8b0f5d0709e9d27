"""Hugging Face model ids (`org/name[@revision]`) load from the local Hugging Face cache
(`dlm_jax._hub`), in Python and on the command line; one not cached fails with one line that
gives the download command. No network: the cache is laid out by huggingface_hub's own helpers
(blobs named by their git / LFS hash, snapshot symlinks, refs, the tree listing) and checked
with `scan_cache_dir` and `snapshot_download(local_files_only=True)`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir, snapshot_download
from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision, _create_symlink, repo_folder_name

import dlm_jax
from dlm_jax import CheckpointError
from dlm_jax._hub import parse_hub_id, resolve_checkpoint
from dlm_jax.frontends.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "llada-tiny"
SMALL = ROOT / "models" / "llada-12m"
MAIN = "a" * 40  # commit hashes
OTHER = "b" * 40
REPO = "org/name"


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo: str, commit: str, src: Path, refs: tuple[str, ...] = ()) -> Path:
    """Put the files of `src` into the hub cache `cache` as the commit `commit` of the model
    `repo`, the way `hf download` does: each file a blob (LFS files named by their sha256,
    others by their git blob sha1), a relative symlink to it in snapshots/<commit>/, the tree
    listing, and refs/<ref> naming the commit."""
    storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
    tree = {}
    for file in sorted(p for p in src.iterdir() if p.is_file()):
        data = file.read_bytes()
        lfs = file.suffix == ".safetensors"
        etag = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = storage / "snapshots" / commit / file.name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=True)
        tree[file.name] = TreeCacheEntry(size=len(data), blob_id=_git_blob_sha1(data),
                                         lfs_sha256=etag if lfs else None, lfs_size=len(data) if lfs else None)
    write_tree_cache(str(storage), commit, tree)
    for ref in refs:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)
    return storage / "snapshots" / commit


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """A hub cache holding org/name: main = llada-tiny, the tag `small` = llada-12m; found
    through HF_HUB_CACHE."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, MAIN, TINY, refs=("main",))
    add_snapshot(cache, REPO, OTHER, SMALL, refs=("small",))
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_the_cache_is_laid_out_as_huggingface_hub_does(hub):
    info = scan_cache_dir(hub)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    revisions = {r.commit_hash: r for r in repo.revisions}
    assert set(revisions) == {MAIN, OTHER}
    assert revisions[MAIN].refs == frozenset({"main"}) and revisions[OTHER].refs == frozenset({"small"})
    assert {f.file_name for f in revisions[MAIN].files} == {p.name for p in TINY.iterdir() if p.is_file()}
    assert all(f.file_path.is_symlink() for f in revisions[MAIN].files)
    snapshot = hub / "models--org--name" / "snapshots" / MAIN
    assert snapshot_download(REPO, cache_dir=hub, local_files_only=True) == str(snapshot)


def test_a_model_id_decodes_as_its_directory(hub):
    snapshot = hub / "models--org--name" / "snapshots" / MAIN
    assert resolve_checkpoint(REPO) == snapshot
    cfg = dlm_jax.preset("frechet", gen_len=32)
    from_hub = dlm_jax.load(REPO, executor="jax").generate(["564+894="], cfg)
    from_dir = dlm_jax.load(str(TINY), executor="jax").generate(["564+894="], cfg)
    assert from_hub.texts == from_dir.texts == ["1458"]
    assert from_hub.token_ids == from_dir.token_ids


def test_revisions_and_what_counts_as_an_id(hub, tmp_path, monkeypatch):
    small_d = dlm_jax.load_config(str(SMALL))[0].d_model
    assert dlm_jax.load_config(REPO)[0].d_model != small_d
    assert dlm_jax.load_config(f"{REPO}@small")[0].d_model == small_d  # a tag
    assert dlm_jax.load_config(f"{REPO}@{OTHER}")[0].d_model == small_d  # a commit hash
    assert dlm_jax.load_config(f"{REPO}@main")[0].d_model == dlm_jax.load_config(REPO)[0].d_model
    with pytest.raises(CheckpointError, match=r"^org/name@v9: revision v9 of org/name is not in the Hugging Face "
                                              r"cache .*\(cached: main, small\); download it with: "
                                              r"hf download org/name --revision v9$"):
        dlm_jax.load_config(f"{REPO}@v9")
    # An existing directory always wins, and a Path is never an id.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(SMALL, tmp_path / "org" / "name")
    assert parse_hub_id(REPO) is None and resolve_checkpoint(REPO) == Path(REPO)
    assert dlm_jax.load_config(REPO)[0].d_model == small_d
    assert parse_hub_id(Path("other/model")) is None
    for not_an_id in ("a/b/c", "./x/y", "org--x/y", "x"):
        with pytest.raises(CheckpointError, match="no such checkpoint directory$"):
            dlm_jax.load_config(not_an_id)


def test_hf_home_is_honoured_when_read(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    add_snapshot(tmp_path / "home" / "hub", "org/other", MAIN, TINY, refs=("main",))
    assert resolve_checkpoint("org/other") == tmp_path / "home" / "hub" / "models--org--other" / "snapshots" / MAIN


def test_a_model_not_cached_says_how_to_download_it(hub, monkeypatch):
    with pytest.raises(CheckpointError) as e:
        dlm_jax.load("other/model", executor="jax")
    assert str(e.value) == (f"other/model: no such checkpoint directory, nor a model in the Hugging Face cache {hub}; "
                            f"download it with: hf download other/model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"hf download other/model \(with HF_HUB_OFFLINE unset\)$"):
        dlm_jax.load_pretrained("other/model")
    # A snapshot cut short (its tree listing names a file it lacks) is named as such.
    (hub / "models--org--name" / "snapshots" / MAIN / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"cached snapshot of org/name in .* is incomplete; download it with"):
        resolve_checkpoint(REPO)


def test_cli_model_ids(hub, capsys):
    assert main(["generate", "--model", REPO, "--prompt", "564+894=", "--executor", "jax"]) == 0
    assert capsys.readouterr().out.strip() == "1458"
    assert main(["inspect", "--model", f"{REPO}@small"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["d_model"] == dlm_jax.load_config(str(SMALL))[0].d_model


def test_cli_model_not_cached_is_one_line_and_exit_2(hub):
    env = {**os.environ, "HF_HUB_CACHE": str(hub)}
    done = subprocess.run([sys.executable, "-m", "dlm_jax.frontends.cli", "generate", "--model", "other/model",
                           "--prompt", "1+1="], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("dlm-jax generate: error: argument --model: other/model: "
                                  "no such checkpoint directory")
    assert done.stderr.rstrip().endswith("download it with: hf download other/model")


@pytest.mark.slow
def test_lora_adapters_load_by_model_id_too(hub):
    """`lora=` / `--lora` take a cached model id as well: ar-tiny and its R-ISD adapters as two
    Hub models decode as the two directories do."""
    add_snapshot(hub, "org/ar", MAIN, ROOT / "models" / "ar-tiny", refs=("main",))
    add_snapshot(hub, "org/ar-risd", OTHER, ROOT / "models" / "ar-tiny" / "risd", refs=("main",))
    cfg = dlm_jax.preset("isd", gen_len=32)
    by_id = dlm_jax.load("org/ar", lora="org/ar-risd", executor="jax").generate(["564+894="], cfg)
    by_dir = dlm_jax.load(ROOT / "models" / "ar-tiny", lora=ROOT / "models" / "ar-tiny" / "risd",
                          executor="jax").generate(["564+894="], cfg)
    assert by_id.token_ids == by_dir.token_ids
    assert main(["generate", "--model", "org/ar", "--lora", "org/ar-risd", "--prompt", "564+894=",
                 "--preset", "isd", "--gen", "32", "--executor", "jax"]) == 0


def test_lm_eval_takes_a_model_id_as_pretrained(hub):
    pytest.importorskip("lm_eval")
    from dlm_jax.frontends.lmeval import model_settings

    assert model_settings(REPO).pretrained == resolve_checkpoint(REPO) == hub / "models--org--name" / "snapshots" / MAIN
    with pytest.raises(CheckpointError, match="hf download other/model"):
        model_settings("other/model")

"""Saved checkpoints carry a manifest (size + sha256 of every file) that loading verifies, and
get the permissions the umask gives."""

import json
import os
import stat
import warnings

import numpy as np
import pytest

import dlm_jax
from dlm_jax import CheckpointError
from dlm_jax.checkpoint import verify_manifest, write_manifest
from dlm_jax.testing import tiny_config

from .hf_models import build

CFG = tiny_config()


@pytest.fixture
def ckpt(tmp_path):
    tok = dlm_jax.ByteTokenizer()
    return dlm_jax.save_pretrained(dlm_jax.init_model(tiny_config(tokenizer=tok)), tmp_path / "ckpt", tokenizer=tok)


def _files(path):
    return sorted(p.name for p in path.iterdir())


def test_manifest_lists_every_file_written(ckpt, tmp_path):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    assert _files(ckpt) == ["config.json", "manifest.json", "model.safetensors", "tokenizer_config.json"]
    size = (ckpt / "model.safetensors").stat().st_size
    assert manifest["files"]["model.safetensors"]["size"] == size
    assert verify_manifest(ckpt)
    sharded = dlm_jax.save_pretrained(dlm_jax.init_model(CFG), tmp_path / "sharded", max_shard_bytes=4000,
                                      extra_files={"generation_config.json": b'{"eos_token_id": 62}\n'})
    listed = sorted(json.loads((sharded / "manifest.json").read_text())["files"])
    assert listed == sorted(set(_files(sharded)) - {"manifest.json"})
    assert "model.safetensors.index.json" in listed and len(listed) > 4
    assert (sharded / "generation_config.json").read_bytes() == b'{"eos_token_id": 62}\n'
    for bad in ("config.json", "manifest.json", "sub/x.json"):
        with pytest.raises(CheckpointError, match="extra file"):
            dlm_jax.save_pretrained(dlm_jax.init_model(CFG), tmp_path / "bad", extra_files={bad: b"{}"})
    assert not (tmp_path / "bad").exists()


def test_flipped_weight_byte_is_caught(ckpt):
    before = dlm_jax.get_params(dlm_jax.load_pretrained(ckpt))
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's data: the file stays well-formed
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ckpt/model\.safetensors: sha256 differs from manifest\.json"):
        dlm_jax.load_pretrained(ckpt)
    # verify=False reads it anyway (and the change is real).
    after = dlm_jax.get_params(dlm_jax.load_pretrained(ckpt, verify=False))
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_hand_edited_text_files_warn_and_the_manifest_can_be_rewritten(ckpt):
    # A hand-edited tokenizer file loads with a warning (it used to be refused); weights stay strict
    # (tests/checkpoint/test_hand_edits.py has the rest).
    config = ckpt / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"tokenizer_class"', '"prompt_format": "chat", "tokenizer_class"'))
    with pytest.warns(UserWarning, match=r"tokenizer_config\.json differs from manifest\.json.*dlm-jax manifest"):
        dlm_jax.load_pretrained(ckpt)
    write_manifest(ckpt)  # after a deliberate edit, list the files anew
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dlm_jax.load_pretrained(ckpt)
    assert dlm_jax.load_tokenizer(ckpt).prompt_format == "chat"
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: listed in manifest\.json but missing"):
        dlm_jax.load_pretrained(ckpt)


def test_checkpoints_without_manifest_load_as_before(tmp_path):
    build("qwen3").save_pretrained(tmp_path)
    assert not (tmp_path / "manifest.json").exists()
    assert dlm_jax.load_pretrained(tmp_path, verify=True).config.qk_norm


@pytest.mark.parametrize("mask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_permissions_follow_the_umask(tmp_path, mask, dir_mode, file_mode):
    tok = dlm_jax.ByteTokenizer()
    old = os.umask(mask)
    try:
        path = dlm_jax.save_pretrained(dlm_jax.init_model(tiny_config(tokenizer=tok)), tmp_path / "m",
                                       tokenizer=tok, max_shard_bytes=4000)
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()}
        assert stat.S_IMODE(path.stat().st_mode) == dir_mode
        dlm_jax.save_pretrained(dlm_jax.init_model(CFG), path, overwrite=True)  # replaced: same modes
    finally:
        os.umask(old)
    assert len(modes) > 4 and set(modes.values()) == {file_mode}, modes
    assert stat.S_IMODE(path.stat().st_mode) == dir_mode
    assert {stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()} == {file_mode}
    assert _files(tmp_path) == ["m"]

"""Manifests (size + sha256 per file), atomic writes and umask permissions (`dlm_jax._integrity`)."""

import json
import os
import stat

import pytest

from dlm_jax import CheckpointError
from dlm_jax._integrity import (atomic_write, atomic_write_json, file_digest, make_temp_dir, manifest_name,
                                read_manifest, verify_manifest, write_manifest)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.json").write_text('{"x": 1}')
    (tmp_path / ".hidden").write_text("not listed")
    return tmp_path


def test_manifest_lists_files_and_verifies(folder):
    write_manifest(folder)
    table = read_manifest(folder)
    assert sorted(table) == ["a.bin", "sub/b.json"]
    assert table["a.bin"] == file_digest(folder / "a.bin") and table["a.bin"]["size"] == 2560
    assert verify_manifest(folder) is True
    write_manifest(folder)  # rewriting does not list the manifest itself
    assert sorted(read_manifest(folder)) == ["a.bin", "sub/b.json"]


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-1]), r"a\.bin: truncated or modified \(2559 bytes, manifest\.json says 2560"),
    (lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]), r"a\.bin: sha256 differs from manifest\.json"),
    (lambda p: p.unlink(), r"a\.bin: listed in manifest\.json but missing"),
])
def test_damage_names_the_file(folder, damage, message):
    write_manifest(folder)
    damage(folder / "a.bin")
    with pytest.raises(CheckpointError, match=message) as e:
        verify_manifest(folder)
    assert "verify=False / --no-verify" in str(e.value) or "missing" in str(e.value)
    assert verify_manifest(folder, files=["sub/b.json"])  # only the files asked for


def test_missing_and_corrupt_manifests(folder):
    assert verify_manifest(folder) is False and read_manifest(folder) is None
    with pytest.raises(CheckpointError, match="no manifest.json to verify"):
        verify_manifest(folder, required=True)
    (folder / "manifest.json").write_text(json.dumps({"format": "other", "files": {}}))
    with pytest.raises(CheckpointError, match=r"manifest\.json: corrupt manifest"):
        verify_manifest(folder)
    (folder / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="corrupt manifest"):
        read_manifest(folder)


def test_single_file_manifest_name(folder):
    assert manifest_name(folder / "latency.json") == "latency.manifest.json"
    write_manifest(folder, ["a.bin"], name=manifest_name(folder / "a.bin"))
    assert sorted(read_manifest(folder, name="a.manifest.json")) == ["a.bin"]
    write_manifest(folder)  # other manifests are not listed
    assert "a.manifest.json" not in read_manifest(folder)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_atomic_writes_and_temp_dirs_get_umask_permissions(tmp_path, mask):
    old = os.umask(mask)
    try:
        atomic_write(tmp_path / "f.txt", "text")
        atomic_write_json(tmp_path / "f.json", {"ü": [1]})
        temp = make_temp_dir(tmp_path, prefix=".t-")
    finally:
        os.umask(old)
    assert (tmp_path / "f.json").read_text(encoding="utf-8") == '{\n  "ü": [\n    1\n  ]\n}\n'
    for f in ("f.txt", "f.json"):
        assert stat.S_IMODE((tmp_path / f).stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(temp.stat().st_mode) == 0o777 & ~mask
    assert sorted(p.name for p in tmp_path.iterdir()) == [temp.name, "f.json", "f.txt"]  # no temporaries


def test_failed_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    atomic_write(tmp_path / "f", b"old")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "f", b"new")
    assert (tmp_path / "f").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]

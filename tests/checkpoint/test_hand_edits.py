"""Hand-edited checkpoints: a changed config.json or tokenizer file loads with one warning that
names it and `dlm-jax manifest DIR`; weight files stay strict, big ones checked by size and
sampled chunks (`verify="full"` / --verify-full: every byte); `dlm-jax manifest DIR` records
the edit (refusing a changed weight file without --force)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

import dlm_jax
from dlm_jax import CheckpointError, _integrity
from dlm_jax._integrity import read_manifest, rewrite_manifest, write_manifest
from dlm_jax.frontends.cli import main
from dlm_jax.testing import tiny_checkpoint

TINY = Path(__file__).resolve().parents[2] / "models" / "llada-tiny"


@pytest.fixture
def ckpt(tmp_path):
    return tiny_checkpoint(tmp_path / "ckpt")


@pytest.fixture
def sampled(monkeypatch):
    """Big-file sampling down to this test's sizes: files of 1000 bytes or more get a digest of
    4 chunks of 64 bytes."""
    monkeypatch.setattr(_integrity, "SAMPLE_ABOVE", 1000)
    monkeypatch.setattr(_integrity, "SAMPLE_CHUNKS", 4)
    monkeypatch.setattr(_integrity, "SAMPLE_CHUNK_BYTES", 64)


def _load_warnings(path, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dlm_jax.load_pretrained(path, **kwargs)
    return [str(w.message) for w in caught]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_edited_config_loads_with_one_warning(ckpt):
    config = ckpt / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()), indent=4))  # same settings, other bytes
    (msg,) = _load_warnings(ckpt)
    assert msg.startswith(f"{ckpt}: config.json differs from manifest.json (edited by hand?)")
    assert msg.endswith(f"dlm-jax manifest {ckpt}")
    assert "model.safetensors" not in msg


def test_edited_and_added_tokenizer_files_warn_once(ckpt):
    tok = ckpt / "tokenizer_config.json"
    tok.write_text(tok.read_text().replace('"tokenizer_class"', '"prompt_format": "chat", "tokenizer_class"'))
    (ckpt / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # read by the loader, not listed
    (ckpt / "notes.md").write_text("mine")  # not read by the loader, not listed: nothing to say
    (msg,) = _load_warnings(ckpt)
    assert "tokenizer_config.json differs from manifest.json" in msg
    assert "chat_template.jinja is not listed in manifest.json" in msg
    assert "notes.md" not in msg and f"dlm-jax manifest {ckpt}" in msg
    assert dlm_jax.load_tokenizer(ckpt).prompt_format == "chat"
    (ckpt / "chat_template.jinja").unlink()
    write_manifest(ckpt)
    (ckpt / "tokenizer_config.json").unlink()  # a listed text file gone: a warning too
    (msg,) = _load_warnings(ckpt)
    assert "tokenizer_config.json is listed in manifest.json but missing" in msg


def test_manifest_command_records_the_edit_then_loads_silently(ckpt, capsys):
    config = ckpt / "config.json"
    config.write_text(config.read_text() + "\n")
    (ckpt / "generation_config.json").write_text('{"eos_token_id": 258}\n')
    assert main(["manifest", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert out == (f"{ckpt}/manifest.json: recorded 4 files (changed: config.json; added: generation_config.json)\n")
    assert _load_warnings(ckpt) == []
    assert main(["manifest", str(ckpt)]) == 0
    assert capsys.readouterr().out.endswith("recorded 4 files (no change)\n")


def test_manifest_command_refuses_a_changed_weight_file_without_force(ckpt, capsys):
    _flip(ckpt / "model.safetensors", -3)
    before = (ckpt / "manifest.json").read_bytes()
    assert main(["manifest", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "model.safetensors changed since manifest.json" in err
    assert "--force" in err and (ckpt / "manifest.json").read_bytes() == before
    assert main(["manifest", "--force", str(ckpt)]) == 0
    assert "changed: model.safetensors" in capsys.readouterr().out
    dlm_jax.load_pretrained(ckpt)
    assert main(["manifest", str(ckpt / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_big_weight_files_get_a_sampled_digest_older_readers_ignore(ckpt, sampled):
    write_manifest(ckpt)
    table = read_manifest(ckpt)
    size = (ckpt / "model.safetensors").stat().st_size
    assert size > 1000 and table["model.safetensors"]["sample"]["chunks"] == 4
    assert table["model.safetensors"]["sha256"] == _integrity._sha256(ckpt / "model.safetensors")["sha256"]
    assert "sample" not in table["config.json"]  # small files: the full sha256 only
    assert json.loads((ckpt / "manifest.json").read_text())["version"] == 1  # same format, one field more


def test_a_flipped_byte_in_the_sampled_chunks_is_refused(ckpt, sampled):
    write_manifest(ckpt)
    _flip(ckpt / "model.safetensors", -3)  # the last chunk: inside the last tensor's data
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 differs from manifest\.json in its "
                                              r"sampled chunks \(corrupt or modified; pass verify=False"):
        dlm_jax.load_pretrained(ckpt)


def test_a_byte_between_the_chunks_needs_the_full_check(ckpt, sampled):
    write_manifest(ckpt)
    size = (ckpt / "model.safetensors").stat().st_size
    _flip(ckpt / "model.safetensors", (size - 64) // 6)  # between the first and second chunk
    assert _load_warnings(ckpt) == []  # what sampling gives up, for a load that reads a few chunks
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 differs from manifest\.json \(corrupt"):
        dlm_jax.load_pretrained(ckpt, verify="full")
    with pytest.raises(CheckpointError, match="sha256 differs"):
        _integrity.verify_manifest(ckpt, full=True)


def test_old_manifests_without_samples_hash_big_files_whole(ckpt, sampled):
    # The fixture's manifest was written before sampling was turned down: no sample fields.
    assert "sample" not in read_manifest(ckpt)["model.safetensors"]
    size = (ckpt / "model.safetensors").stat().st_size
    _flip(ckpt / "model.safetensors", (size - 64) // 6)
    with pytest.raises(CheckpointError, match="sha256 differs from manifest.json .corrupt"):
        dlm_jax.load_pretrained(ckpt)


def test_a_truncated_weight_file_is_refused(ckpt, sampled):
    write_manifest(ckpt)
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or modified"):
        dlm_jax.load_pretrained(ckpt)


def test_an_unlisted_weight_shard_is_refused(tmp_path):
    path = dlm_jax.save_pretrained(dlm_jax.init_model(dlm_jax.testing.tiny_config()), tmp_path / "sharded",
                                   max_shard_bytes=4000)
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    write_manifest(path, [f for f in read_manifest(path) if f != shards[-1]])
    with pytest.raises(CheckpointError, match=rf"{shards[-1]}: not listed in manifest\.json \(record it with: "
                                              rf"dlm-jax manifest .*; or pass verify=False"):
        dlm_jax.load_pretrained(path)
    assert rewrite_manifest(path).added == (shards[-1],)
    dlm_jax.load_pretrained(path)


def test_cli_warning_is_one_line_and_the_command_succeeds(tmp_path, capsys):
    ckpt = Path(shutil.copytree(TINY, tmp_path / "tiny"))
    config = ckpt / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()), indent=3) + "\n")
    assert main(["generate", "--model", str(ckpt), "--prompt", "564+894=", "--executor", "jax"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "1458"
    lines = [line for line in err.splitlines() if line.startswith("warning:")]
    assert lines == [f"warning: {ckpt}: config.json differs from manifest.json (edited by hand?); loading as it "
                     f"is. To record the files as they are now: dlm-jax manifest {ckpt}"]
    assert main(["manifest", str(ckpt)]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt", "564+894=", "--executor", "jax", "--verify-full"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "1458" and "warning:" not in err

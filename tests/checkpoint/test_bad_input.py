"""Bad checkpoints fail with an error naming the tensor, key or file; saving is atomic."""

import json
import os

import numpy as np
import pytest

import dlm_jax
from dlm_jax import CheckpointError, ConfigError
from dlm_jax.checkpoint import _io, load_file, save_file
from dlm_jax.testing import tiny_config

CFG = tiny_config()


@pytest.fixture
def ckpt(tmp_path):
    return dlm_jax.save_pretrained(dlm_jax.init_model(CFG), tmp_path / "ckpt")


@pytest.fixture
def qwen3(tmp_path):
    model = dlm_jax.init_model(CFG.replace(attention="causal", logit_shift=True, qk_norm=True))
    return dlm_jax.save_pretrained(model, tmp_path / "qwen3", family="qwen3")


def _edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        dlm_jax.load_pretrained(ckpt)


def test_unexpected_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model\.layers\.0\.mlp\.extra\.weight'\]"):
        dlm_jax.load_pretrained(ckpt)


def test_shape_mismatch(ckpt):
    _edit_config(ckpt, lambda c: c.update(ffn_hidden=24))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight.*shape"):
        dlm_jax.load_pretrained(ckpt)


def test_unknown_architecture(ckpt):
    _edit_config(ckpt, lambda c: c.update(model_type="gpt9", architectures=["Gpt9Model"]))
    with pytest.raises(ConfigError, match="unknown architecture.*gpt9.*Gpt9Model"):
        dlm_jax.load_pretrained(ckpt)


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        dlm_jax.load_pretrained(ckpt)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        dlm_jax.load_pretrained(ckpt)


def test_corrupted_header(ckpt):
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:24] = b"\xff" * 16
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header"):
        dlm_jax.load_pretrained(ckpt)
    data[0:8] = (10**12).to_bytes(8, "little")
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        dlm_jax.load_pretrained(ckpt)


def test_unknown_config_key(qwen3):
    _edit_config(qwen3, lambda c: c.update(flux_capacitor=True))
    with pytest.raises(ConfigError, match="flux_capacitor"):
        dlm_jax.load_pretrained(qwen3)
    assert dlm_jax.load_pretrained(qwen3, strict=False).config.qk_norm


@pytest.mark.parametrize("key, value", [("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
                                        ("hidden_act", "gelu"), ("use_sliding_window", True),
                                        ("attention_bias", True)])
def test_unsupported_config_value(qwen3, key, value):
    _edit_config(qwen3, lambda c: c.update({key: value}))
    with pytest.raises(ConfigError, match=key):
        dlm_jax.load_pretrained(qwen3)


def test_missing_or_invalid_config(ckpt, tmp_path):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        dlm_jax.load_pretrained(ckpt)
    os.remove(ckpt / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        dlm_jax.load_pretrained(ckpt)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        dlm_jax.load_pretrained(tmp_path / "nowhere")


def test_missing_weights_and_shards(tmp_path):
    model = dlm_jax.init_model(CFG)
    path = dlm_jax.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=4000)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard '{shard.name}', which does not exist"):
        dlm_jax.load_pretrained(path)
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor"):
        dlm_jax.load_pretrained(path)


def test_bad_override_names_field(ckpt):
    with pytest.raises(ConfigError, match="attention"):
        dlm_jax.load_pretrained(ckpt, attention="diagonal")
    with pytest.raises(ConfigError, match="colour"):
        dlm_jax.load_pretrained(ckpt, colour="red")


def test_failed_save_leaves_nothing_half_written(tmp_path, monkeypatch):
    model = dlm_jax.init_model(CFG)
    calls = {"n": 0}
    real = _io.save_file

    def flaky(tensors, path, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        real(tensors, path, **kw)

    monkeypatch.setattr(_io, "save_file", flaky)
    with pytest.raises(OSError, match="disk full"):
        dlm_jax.save_pretrained(model, tmp_path / "new", max_shard_bytes=4000)
    assert list(tmp_path.iterdir()) == []
    # An existing checkpoint survives a failed overwrite untouched.
    monkeypatch.setattr(_io, "save_file", real)
    path = dlm_jax.save_pretrained(model, tmp_path / "old")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    monkeypatch.setattr(_io, "save_file", flaky)
    calls["n"] = 0
    with pytest.raises(OSError):
        dlm_jax.save_pretrained(dlm_jax.init_model(CFG, seed=9), path, overwrite=True, max_shard_bytes=4000)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["old"]


def test_existing_path_and_unfit_family(ckpt, tmp_path):
    model = dlm_jax.load_pretrained(ckpt)
    with pytest.raises(CheckpointError, match="already exists"):
        dlm_jax.save_pretrained(model, ckpt)
    with pytest.raises(ConfigError, match="family 'qwen3' cannot store attention='bidirectional'"):
        dlm_jax.save_pretrained(model, tmp_path / "q", family="qwen3")
    assert not (tmp_path / "q").exists()
    with pytest.raises(ConfigError, match="unknown checkpoint family 'gguf'"):
        dlm_jax.save_pretrained(model, tmp_path / "g", family="gguf")

"""Bad checkpoints fail with an error naming the tensor, key or file; saving is atomic."""

import json
import os
import warnings

import numpy as np
import pytest

import dlm_jax
from dlm_jax import CheckpointError, ConfigError
from dlm_jax.checkpoint import _io, load_file, save_file, write_manifest
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
    """Edit the weights and list them anew in the manifest, as a deliberate edit would."""
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")
    write_manifest(path)


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    write_manifest(path)


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
    """The manifest names a truncated file; without it the safetensors reader still does."""
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or modified .*manifest\.json says"):
        dlm_jax.load_pretrained(ckpt)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        dlm_jax.load_pretrained(ckpt, verify=False)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        dlm_jax.load_pretrained(ckpt, verify=False)


def test_corrupted_header(ckpt):
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:24] = b"\xff" * 16
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 differs"):
        dlm_jax.load_pretrained(ckpt)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header"):
        dlm_jax.load_pretrained(ckpt, verify=False)
    data[0:8] = (10**12).to_bytes(8, "little")
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        dlm_jax.load_pretrained(ckpt, verify=False)


def test_unknown_config_key(qwen3):
    """Like transformers: unknown keys are ignored with one warning naming them and the file;
    strict=True refuses them."""
    _edit_config(qwen3, lambda c: c.update(flux_capacitor=True, train_max_sequence_length=4096))
    with pytest.warns(UserWarning) as caught:
        assert dlm_jax.load_pretrained(qwen3).config.qk_norm
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "['flux_capacitor', 'train_max_sequence_length']" in message and "config.json" in message
    with pytest.warns(UserWarning, match="flux_capacitor"):
        dlm_jax.load_config(qwen3)
    for load in (dlm_jax.load_pretrained, dlm_jax.load_config):
        with pytest.raises(ConfigError, match=r"unknown config keys \['flux_capacitor', 'train_max_sequence_length'\]"):
            load(qwen3, strict=True)
    _edit_config(qwen3, lambda c: c.pop("flux_capacitor") and c.pop("train_max_sequence_length"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a config with only known keys loads without a warning
        dlm_jax.load_config(qwen3)


@pytest.mark.parametrize("key, value", [("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
                                        ("hidden_act", "gelu"), ("use_sliding_window", True),
                                        ("attention_bias", True), ("mlp_bias", True),
                                        ("partial_rotary_factor", 0.5),
                                        ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.5}),
                                        ("final_logit_softcapping", 30.0), ("logits_scaling", 4.0),
                                        ("layer_types", ["sliding_attention", "full_attention"])])
@pytest.mark.parametrize("strict", [False, True])
def test_unsupported_config_value(qwen3, key, value, strict):
    """Keys that change the computation fail with the key named, also when unknown keys are
    only warned about."""
    _edit_config(qwen3, lambda c: c.update({key: value}))
    with pytest.raises(ConfigError, match=key):
        dlm_jax.load_pretrained(qwen3, strict=strict)


def test_missing_or_invalid_config(ckpt, tmp_path):
    (ckpt / "manifest.json").unlink()  # as in checkpoints transformers writes
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
    with pytest.raises(CheckpointError, match=f"{shard.name}: listed in manifest.json but missing"):
        dlm_jax.load_pretrained(path)
    with pytest.raises(CheckpointError, match=f"lists shard '{shard.name}', which does not exist"):
        dlm_jax.load_pretrained(path, verify=False)
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor"):
        dlm_jax.load_pretrained(path, verify=False)


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


@pytest.fixture
def llada(tmp_path):
    return dlm_jax.save_pretrained(dlm_jax.init_model(CFG.replace(tie_embeddings=False)), tmp_path / "llada",
                                   family="llada")


@pytest.mark.parametrize("key, value", [("activation_type", "swiglu"), ("activation_type", "gelu"),
                                        ("block_type", "sequential"), ("layer_norm_type", "default"),
                                        ("rope", False), ("alibi", True), ("include_bias", True),
                                        ("scale_logits", True), ("attention_layer_norm", True),
                                        ("input_emb_norm", True), ("clip_qkv", 8.0),
                                        ("layer_norm_with_affine", False)])
@pytest.mark.parametrize("strict", [False, True])
def test_unsupported_llada_config_value(llada, key, value, strict):
    _edit_config(llada, lambda c: c.update({key: value}))
    with pytest.raises(ConfigError, match=f"{key}={value!r} is not supported"):
        dlm_jax.load_pretrained(llada, strict=strict)


@pytest.mark.parametrize("key", ["activation_type", "block_type", "rope", "layer_norm_type"])
def test_llada_key_missing_means_lladas_default(llada, key):
    """LLaDA's code defaults to swiglu, a sequential block, no RoPE and a plain LayerNorm: a
    config without these keys asks for that, which is refused rather than guessed."""
    _edit_config(llada, lambda c: c.pop(key))
    with pytest.raises(ConfigError, match=f"{key} is missing"):
        dlm_jax.load_config(llada)


def test_llada_weight_tying_defaults_to_tied(llada):
    _edit_config(llada, lambda c: c.pop("weight_tying"))
    assert dlm_jax.load_config(llada)[0].tie_embeddings


def test_dots1_sliding_window_without_layer_types():
    """Dots1Config makes layers >= max_window_layers sliding when sliding_window is set."""
    from dlm_jax.checkpoint import get_family

    fam = get_family("dots1")
    cfg = CFG.replace(attention="causal", logit_shift=True, qk_norm=True, ffn="moe", router="sigmoid",
                      router_bias=True, n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16)
    data = fam.config_to_json(cfg)
    assert data["sliding_window"] is None  # so transformers does not slide either
    assert fam.config_from_json(data, source="c") == cfg
    with pytest.raises(ConfigError, match="sliding_window=16 with max_window_layers=1"):
        fam.config_from_json({**data, "sliding_window": 16, "max_window_layers": 1}, source="c")
    assert fam.config_from_json({**data, "sliding_window": 16, "max_window_layers": 2}, source="c") == cfg
    data.pop("sliding_window")  # transformers' default: 4096 from layer 62 on
    assert fam.config_from_json(data, source="c") == cfg

"""LoRA adapter files: PEFT's layout (checked against PEFT's documented key names, shapes and
merge rule; `peft` itself is not installed here), a manifest, and one-line errors for
adapters made on another base."""

import json

import numpy as np
import pytest

import dlm_jax
from dlm_jax import CheckpointError, ConfigError
from dlm_jax.checkpoint import load_adapted, load_adapters, load_file, save_adapters, save_file, write_manifest
from dlm_jax.techniques.isd import LoraSpec, attach_lora, lora_params, mask_rows_gate, set_lora_params
from dlm_jax.testing import tiny_checkpoint

SPEC = LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(base checkpoint, adapter directory, the adapted model)."""
    root = tmp_path_factory.mktemp("adapters")
    base = tiny_checkpoint(root / "base", attention="causal", logit_shift=True)
    model = attach_lora(dlm_jax.load_pretrained(base), SPEC, seed=1)
    rng = np.random.default_rng(0)
    set_lora_params(model, {k: rng.normal(size=v.shape).astype(np.float32) * 0.2 for k, v in lora_params(model).items()})
    return base, save_adapters(model, root / "risd", base=base, base_name="tiny-base"), model


def test_the_files_follow_peft_and_round_trip(saved):
    base, path, model = saved
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                     "manifest.json"]
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert {k: cfg[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "base_model_name_or_path": "tiny-base"}
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "o_proj", "q_proj", "v_proj"]
    base_manifest = json.loads((base / "manifest.json").read_text())["files"]
    assert cfg["dlm_jax"]["base_weights_sha256"] == {"model.safetensors": base_manifest["model.safetensors"]["sha256"]}
    assert cfg["dlm_jax"]["base_config"]["d_model"] == 32
    # PEFT: base_model.model.<module>.lora_A.weight [r, in_features], lora_B.weight [out_features, r]
    tensors = load_file(path / "adapter_model.safetensors")
    d, hkv_dh, f = 32, 16, 64
    shapes = {"self_attn.q_proj": (d, d), "self_attn.v_proj": (d, hkv_dh), "self_attn.o_proj": (d, d),
              "mlp.gate_proj": (d, f), "mlp.down_proj": (f, d)}
    want = {}
    for i in range(2):
        for module, (d_in, d_out) in shapes.items():
            want[f"base_model.model.model.layers.{i}.{module}.lora_A.weight"] = (4, d_in)
            want[f"base_model.model.model.layers.{i}.{module}.lora_B.weight"] = (d_out, 4)
    assert {k: v.shape for k, v in tensors.items()} == want
    loaded = load_adapted(base, path)
    for name, value in lora_params(model).items():
        np.testing.assert_array_equal(lora_params(loaded)[name], value)
    tokens = np.full((1, 10), 63, np.int32)
    tokens[0, :6] = np.arange(6)
    gate = mask_rows_gate(tokens, loaded.config.mask_token_id)
    np.testing.assert_array_equal(loaded(tokens, lora_gate=gate).logits, model(tokens, lora_gate=gate).logits)


def test_peft_merge_rule_gives_the_gated_models_outputs(saved, tmp_path):
    """PEFT merges an adapter as W + (lora_alpha / r) * lora_B @ lora_A on HF [out, in]
    weights: merged into the base's tensors, that is the adapted model with the gate at 1."""
    base, path, model = saved
    weights = load_file(base / "model.safetensors")
    scale = 8 / 4
    adapters = load_file(path / "adapter_model.safetensors")
    for key in [k for k in adapters if k.endswith("lora_A.weight")]:
        module = key[len("base_model.model."): -len(".lora_A.weight")]
        b = adapters[key.replace("lora_A", "lora_B")]
        weights[module + ".weight"] = weights[module + ".weight"] + scale * b @ adapters[key]
    merged = tmp_path / "merged"
    merged.mkdir()
    for f in base.iterdir():
        if f.name not in ("model.safetensors", "manifest.json"):
            (merged / f.name).write_bytes(f.read_bytes())
    save_file(weights, merged / "model.safetensors")
    tokens = np.arange(12, dtype=np.int32)[None]
    want = dlm_jax.load_pretrained(merged)(tokens).logits
    got = model(tokens, lora_gate=np.ones((1, 12), np.float32)).logits
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _one_line_config_error(fn, *needles):
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and "adapter_config.json" in msg, msg
    for needle in needles:
        assert needle in msg, msg


def test_adapters_for_another_base_fail_with_one_line(saved, tmp_path):
    base, path, _ = saved
    wide = tiny_checkpoint(tmp_path / "wide", attention="causal", logit_shift=True, d_model=64)
    _one_line_config_error(lambda: load_adapted(wide, path), "d_model=32 there, 64 in this model")
    other = tiny_checkpoint(tmp_path / "other", seed=9, attention="causal", logit_shift=True)
    _one_line_config_error(lambda: load_adapted(other, path), "sha256", "model.safetensors")
    # Without the base directory only shapes can be checked: another base of the same shapes loads.
    assert load_adapters(path, dlm_jax.load_pretrained(other)) is not None
    ffn = tiny_checkpoint(tmp_path / "ffn", attention="causal", logit_shift=True, ffn_hidden=48)
    _one_line_config_error(lambda: load_adapted(ffn, path), "ffn_hidden")


def test_bad_adapter_files_are_named(saved, tmp_path):
    base, path, model = saved
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    raw = bytearray((copy / "adapter_model.safetensors").read_bytes())
    raw[-3] ^= 0xFF
    (copy / "adapter_model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="adapter_model.safetensors: sha256 differs"):
        load_adapted(base, copy)
    # A tensor of a module this model lacks (an edited file, manifest rewritten): named.
    tensors = load_file(path / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 32), np.float32)
    save_file(tensors, copy / "adapter_model.safetensors")
    write_manifest(copy)
    _one_line_config_error(lambda: load_adapted(base, copy), "layers.7.self_attn.q_proj.lora_A")
    with pytest.raises(CheckpointError, match="already exists"):
        save_adapters(model, path, base=base)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_adapters(dlm_jax.load_pretrained(base), tmp_path / "none", base=base)

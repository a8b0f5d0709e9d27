"""`convert_checkpoint` and what a conversion must keep: EOS id lists, block_size, the
tokenizer and generation files (byte for byte), in every family that can hold them."""

import json

import numpy as np
import pytest

import dlm_jax
from dlm_jax import CheckpointError, ConfigError
from dlm_jax.checkpoint import FAMILIES, convert_checkpoint
from dlm_jax.testing import tiny_config

from .hf_models import build, logits, word_tokenizer

IDS = np.random.default_rng(1).integers(0, 96, (2, 9))
MOE = dict(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16)


def _fitting(name, **changes):
    """The tiny config with what family `name` implies (and needs), plus `changes`."""
    fam = FAMILIES[name]
    extra = MOE if fam.implied.get("ffn") == "moe" else {}
    return tiny_config(**{**extra, **fam.implied, **changes})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_keeps_eos_list_and_block_size_in_every_family(family):
    fam = FAMILIES[family]
    cfg = _fitting(family, eos_token_id=(60, 62), block_size=8)
    data = json.loads(json.dumps(fam.config_to_json(cfg)))
    assert data["eos_token_id"] == [60, 62] and data["block_size"] == 8
    back = fam.config_from_json(data, source="config.json")
    assert back.eos_token_id == (60, 62) and back.eos_ids == (60, 62) and back.block_size == 8
    assert back == cfg
    default = fam.config_to_json(cfg.replace(block_size=32))
    assert "block_size" not in default or family == "dlm_jax"  # HF files stay as they were


def _llama3_style(tmp_path):
    """A transformers Llama checkpoint whose eos_token_id is a list."""
    model = build("llama")
    model.config.eos_token_id = [90, 91]
    model.generation_config.eos_token_id = [90, 91]
    model.save_pretrained(tmp_path / "src")
    return model, tmp_path / "src"


def test_eos_list_survives_save_and_transformers_reads_it(tmp_path):
    import transformers

    model, src = _llama3_style(tmp_path)
    assert json.loads((src / "config.json").read_text())["eos_token_id"] == [90, 91]
    ours = dlm_jax.load_pretrained(src)
    assert ours.config.eos_token_id == (90, 91)
    for family in ("llama", "dlm_jax"):
        out = dlm_jax.save_pretrained(ours, tmp_path / family, family=family)
        assert dlm_jax.load_pretrained(out).config.eos_token_id == (90, 91)
    bidirectional = dlm_jax.load_pretrained(src, attention="bidirectional", logit_shift=False)
    out = dlm_jax.save_pretrained(bidirectional, tmp_path / "llada", family="llada")
    assert dlm_jax.load_pretrained(out).config.eos_token_id == (90, 91)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", attn_implementation="eager")
    assert list(reloaded.config.eos_token_id) == [90, 91]
    assert np.abs(logits(reloaded, IDS) - logits(model, IDS)).max() <= 1e-6


def _with_tokenizer_files(src):
    word_tokenizer(src)
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "mask_token": "<mask>",
                                                           "prompt_format": "chat"}, indent=1))
    (src / "special_tokens_map.json").write_text('{"eos_token": "<|endoftext|>"}')
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return ["chat_template.jinja", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
            "tokenizer_config.json"]


def test_convert_carries_files_byte_for_byte_and_round_trips(tmp_path):
    import transformers

    model, src = _llama3_style(tmp_path)
    carried = _with_tokenizer_files(src)
    native = convert_checkpoint(src, tmp_path / "native")
    for name in carried:
        assert (native / name).read_bytes() == (src / name).read_bytes(), name
    manifest = json.loads((native / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(["config.json", "model.safetensors", *carried])
    cfg = dlm_jax.load_config(native)[0]
    assert cfg.eos_token_id == (90, 91) and cfg.mask_token_id == 92  # from the tokenizer, now stored
    assert json.loads((native / "config.json").read_text())["mask_token_id"] == 92
    tok = dlm_jax.load_tokenizer(native)
    assert tok.prompt_format == "chat" and tok.mask_id == 92
    back = convert_checkpoint(native, tmp_path / "llama", family="llama")
    for name in carried:
        assert (back / name).read_bytes() == (src / name).read_bytes(), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    assert np.abs(logits(reloaded, IDS) - logits(model, IDS)).max() <= 1e-6
    with pytest.raises(CheckpointError, match="already exists"):
        convert_checkpoint(src, back, family="llama")
    assert convert_checkpoint(src, back, family="llama", overwrite=True) == back


def test_convert_keeps_block_size_or_refuses(tmp_path):
    tok = dlm_jax.ByteTokenizer(prompt_format="chat")
    cfg = _fitting("qwen3", block_size=8)
    src = dlm_jax.save_pretrained(dlm_jax.init_model(cfg), tmp_path / "src", tokenizer=tok)
    out = convert_checkpoint(src, tmp_path / "qwen3", family="qwen3")
    assert dlm_jax.load_config(out)[0] == cfg
    assert (out / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert dlm_jax.load_tokenizer(out).prompt_format == "chat"
    again = convert_checkpoint(out, tmp_path / "native")
    assert dlm_jax.load_pretrained(again).config == cfg
    # A block-causal model has no place in a causal family: refused, with the field, before writing.
    block = dlm_jax.save_pretrained(dlm_jax.init_model(cfg.replace(attention="block_causal")), tmp_path / "block")
    with pytest.raises(ConfigError, match="cannot store attention='block_causal'"):
        convert_checkpoint(block, tmp_path / "refused", family="qwen3")
    assert not (tmp_path / "refused").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block", "native", "qwen3", "src"]


def test_convert_checks_before_reading_weights(tmp_path):
    src = dlm_jax.save_pretrained(dlm_jax.init_model(tiny_config()), tmp_path / "src")
    data = bytearray((src / "model.safetensors").read_bytes())
    data[-2] ^= 1
    (src / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 differs"):
        convert_checkpoint(src, tmp_path / "out")
    with pytest.raises(ConfigError, match="family 'llama' cannot store attention='bidirectional'"):
        convert_checkpoint(src, tmp_path / "out", family="llama", verify=False)
    with pytest.raises(CheckpointError, match="already exists"):
        convert_checkpoint(src, src, verify=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert convert_checkpoint(src, tmp_path / "out", family="llada", verify=False).is_dir()

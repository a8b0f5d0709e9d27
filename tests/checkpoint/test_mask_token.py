"""A checkpoint whose config.json has no mask_token_id takes the one its tokenizer declares."""

import json

import pytest

import dlm_jax
from dlm_jax.testing import tiny_config

from .hf_models import build, word_tokenizer

MASK = 92


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    build("qwen2").save_pretrained(path)
    assert "mask_token_id" not in json.loads((path / "config.json").read_text())
    return path


@pytest.fixture
def ckpt(qwen2, tmp_path):
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((qwen2 / f).read_bytes())
    return tmp_path


def _write(path, name, data):
    (path / name).write_text(json.dumps(data))


@pytest.mark.parametrize("declare", ["tokenizer_config", "special_tokens_map", "added_token_dict"])
def test_mask_token_declared_by_the_tokenizer_fills_the_config(ckpt, declare):
    ids = word_tokenizer(ckpt)
    assert ids["<mask>"] == MASK
    if declare == "tokenizer_config":
        _write(ckpt, "tokenizer_config.json", {"mask_token": "<mask>", "eos_token": "<|endoftext|>"})
    elif declare == "special_tokens_map":
        _write(ckpt, "special_tokens_map.json", {"mask_token": {"content": "<mask>", "special": True}})
    else:  # older tokenizer_config.json: an AddedToken dict, the id from added_tokens_decoder
        _write(ckpt, "tokenizer_config.json", {
            "mask_token": {"__type": "AddedToken", "content": "<mask>"},
            "added_tokens_decoder": {str(MASK): {"content": "<mask>", "special": True}}})
    cfg, family = dlm_jax.load_config(ckpt)
    assert (family.name, cfg.attention, cfg.mask_token_id) == ("qwen2", "causal", MASK)
    assert dlm_jax.load_tokenizer(ckpt).mask_id == MASK
    assert dlm_jax.load_config(ckpt, mask_token_id=7)[0].mask_token_id == 7  # an override wins


def test_known_mask_token_added_to_tokenizer_json(ckpt):
    ids = word_tokenizer(ckpt, added=("<|endoftext|>", "<|mdm_mask|>"))
    assert dlm_jax.load_config(ckpt)[0].mask_token_id == ids["<|mdm_mask|>"]
    assert dlm_jax.load_pretrained(ckpt).config.mask_token_id == ids["<|mdm_mask|>"]


def test_no_mask_token_anywhere_loads_without_one(ckpt):
    word_tokenizer(ckpt, added=("<|endoftext|>",))
    _write(ckpt, "tokenizer_config.json", {"eos_token": "<|endoftext|>"})
    assert dlm_jax.load_pretrained(ckpt).config.mask_token_id is None
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer_config.json").unlink()
    assert dlm_jax.load_config(ckpt)[0].mask_token_id is None
    assert dlm_jax.load_config(ckpt, mask_token_id=95)[0].mask_token_id == 95


def test_config_mask_token_wins_and_out_of_range_is_not_used(ckpt):
    word_tokenizer(ckpt)
    _write(ckpt, "tokenizer_config.json", {"mask_token": "<mask>"})
    config = json.loads((ckpt / "config.json").read_text())
    _write(ckpt, "config.json", {**config, "mask_token_id": 94})
    assert dlm_jax.load_config(ckpt)[0].mask_token_id == 94
    _write(ckpt, "config.json", {**config, "vocab_size": 64})  # the tokenizer's 92 is past the table
    with pytest.warns(UserWarning, match="mask token id 92 is outside the embedding table"):
        assert dlm_jax.load_config(ckpt)[0].mask_token_id is None


def test_byte_tokenizer_checkpoint(tmp_path):
    tok = dlm_jax.ByteTokenizer()
    model = dlm_jax.init_model(tiny_config(tokenizer=tok, mask_token_id=None, attention="causal",
                                           logit_shift=True))
    path = dlm_jax.save_pretrained(model, tmp_path / "m", family="llama", tokenizer=tok)
    assert "mask_token_id" not in json.loads((path / "config.json").read_text())
    assert dlm_jax.load_config(path)[0].mask_token_id == tok.mask_id

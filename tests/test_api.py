"""`dlm_jax.load(path).generate(prompts, DecodeConfig(...))`: text, ids and stats."""

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ByteTokenizer, ConfigError, DecodeConfig, ModelConfig


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, ffn_hidden=64,
                      mask_token_id=tok.mask_id, eos_token_id=tok.eos_id, max_seq_len=128)
    path = dlm_jax.save_pretrained(dlm_jax.init_model(cfg), tmp_path_factory.mktemp("m") / "tiny", tokenizer=tok)
    return dlm_jax.load(path)


def test_generate_returns_text_ids_and_stats(handle):
    blocks = []
    res = handle.generate(["hello", "a longer prompt"], dlm_jax.preset("frechet", gen_len=16, block_len=8),
                          on_block=lambda i, texts: blocks.append((i, texts)))
    assert len(res.texts) == len(res.token_ids) == 2
    assert all(isinstance(t, str) for t in res.texts)
    assert [i for i, _ in blocks] == [0, 1]
    s = res.stats.to_dict()
    for key in ("nfe", "tokens_per_forward", "tokens_per_second", "first_block_seconds", "commit_histogram",
                "median_step_seconds", "median_host_seconds", "peak_rss_mb"):
        assert key in s
    assert sum(k * v for k, v in res.stats.commit_histogram.items()) == res.stats.tokens_committed == 32
    assert len(res.stats.step_seconds) == res.stats.nfe


def test_single_prompt_token_ids_and_chat(handle):
    tok = handle.tokenizer
    by_ids = handle.generate(tok.encode("hi"), DecodeConfig(gen_len=8, block_len=8))
    by_text = handle.generate("hi", DecodeConfig(gen_len=8, block_len=8))
    assert by_ids.token_ids == by_text.token_ids
    chat = handle.generate("hi", DecodeConfig(gen_len=8, block_len=8), chat=True)
    assert len(chat.texts) == 1


def test_presets_match_the_papers():
    assert dlm_jax.preset("fast-dllm") == DecodeConfig(cache="prefix", rule="threshold", threshold=0.9, block_len=32)
    assert dlm_jax.preset("frechet").delta == 0.25 and dlm_jax.preset("frechet").block_len == 32
    assert dlm_jax.preset("llada", gen_len=64).steps_per_block == 32
    with pytest.raises(ConfigError, match="unknown decode preset 'turbo'"):
        dlm_jax.preset("turbo")
    with pytest.raises(ConfigError, match="steps=8 applies to rule='topk' only"):
        DecodeConfig(rule="threshold", steps=8)


def test_over_long_prompt_names_the_limit(handle):
    with pytest.raises(ConfigError, match="exceeds the limit of 128"):
        handle.generate("x" * 120, DecodeConfig(gen_len=16, block_len=8))
    with pytest.raises(ConfigError, match="prompt 0 is empty"):
        handle.generate("", DecodeConfig(gen_len=8, block_len=8))
    assert np.isfinite(handle.decoder.max_tokens)

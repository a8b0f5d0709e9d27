"""`dlm_jax.load(path).generate(prompts, DecodeConfig(...))`: text, ids and stats."""

from pathlib import Path

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError, decode_config
from dlm_jax.testing import mock_model, tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    return dlm_jax.load(tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", max_seq_len=128))


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
    by_ids = handle.generate(tok.encode("hi"), decode_config(gen_len=8, block_len=8))
    by_text = handle.generate("hi", decode_config(gen_len=8, block_len=8))
    assert by_ids.token_ids == by_text.token_ids
    chat = handle.generate("hi", decode_config(gen_len=8, block_len=8), chat=True)
    assert len(chat.texts) == 1


def test_over_long_prompt_names_the_limit(handle):
    with pytest.raises(ConfigError, match="exceeds the limit of 128"):
        handle.generate("x" * 120, decode_config(gen_len=16, block_len=8))
    with pytest.raises(ConfigError, match="prompt 0 is empty"):
        handle.generate("", decode_config(gen_len=8, block_len=8))
    assert handle.decoder.max_tokens == 128


def test_any_executor_behind_the_api():
    """`Model` decodes over any Executor: here a scripted one, whose answer spells 'hello'."""
    answer = np.full(96, ord("!"))
    answer[5:10] = [ord(c) for c in "hello"]
    answer[10:] = dlm_jax.ByteTokenizer().eos_id
    handle = mock_model(answer=answer, confidence=np.full(96, 0.95))
    res = handle.generate("abcde", decode_config(gen_len=16, block_len=8))
    assert res.texts == ["hello"] and res.stats.nfe == 2 and handle.model is None


@pytest.mark.parametrize("model, prompt, preset", [
    ("ar-tiny", "sort: 37 44 13 33 47 48", "isd"),
    ("llada-tiny", "564+894=", "llada-cpp"),
])
def test_streamed_text_only_grows_and_ends_as_the_answer(model, prompt, preset):
    """A single-prompt `generate` streams what each block committed. Streaming every token the
    state held (drafts that ISD later rejects, visible tokens DPPR may still revise) printed
    `2333 333 43373333333 433 444` for an answer of `24 34 37 37 46 47`, with no error: each
    streamed text must extend the one before, and the last must be a prefix of the answer."""
    handle = dlm_jax.load(ROOT / "models" / model, executor="jax")
    texts = []
    result = handle.generate(prompt, dlm_jax.preset(preset, gen_len=32),
                             on_block=lambda i, t: texts.append(t[0]))
    assert texts, "no block was streamed"
    for before, after in zip([""] + texts, texts):
        assert after.startswith(before), (before, after)
    assert result.texts[0].startswith(texts[-1])

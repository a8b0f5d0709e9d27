"""`dlm_jax.Engine`, the text side of continuous batching: per-request options, stop strings,
streaming, cancellation and a background thread serving requests from other threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError, decode_config
from dlm_jax.testing import mock_model

EOS = dlm_jax.ByteTokenizer().eos_id


def _model(text: str, start: int = 5):
    """A scripted model whose generation after a prompt of `start` bytes spells `text`, then EOS."""
    answer = np.full(128, ord("!"))
    answer[start:start + len(text)] = [ord(c) for c in text]
    answer[start + len(text):] = EOS
    return mock_model(answer=answer, confidence=np.full(128, 0.95))


def test_stop_strings_end_a_request_and_are_left_out():
    model = _model("12\n34\n56")
    engine = dlm_jax.Engine(model, decode_config(gen_len=16, block_len=4), max_batch=2)
    stopped = engine.submit("abcde", stop=["\n"])
    plain = engine.submit("abcde")
    assert stopped.result().text == "12" and stopped.result().status == "stopped"
    assert plain.result().text == "12\n34\n56" and plain.result().status == "done"
    assert "".join(plain.stream()) == "12\n34\n56"
    assert stopped.result().stats.nfe < plain.result().stats.nfe  # it ended early, freeing its row


def test_streamed_pieces_join_to_the_result_and_arrive_in_blocks():
    model = _model("hello world!")
    engine = dlm_jax.Engine(model, decode_config(gen_len=16, block_len=4), max_batch=1)
    handle = engine.submit("abcde")
    pieces = list(handle.stream())
    assert "".join(pieces) == handle.result().text == "hello world!"
    assert len(pieces) >= 3  # one block of 4 at a time


def test_per_request_options_and_refusals():
    model = _model("hello")
    engine = dlm_jax.Engine(model, decode_config(gen_len=16, block_len=4), max_batch=2)
    short = engine.submit("abcde", {"gen_len": 8})
    assert short.result().text == "hello"
    assert len(short.request.output.sequences[0]) == 8
    with pytest.raises(ConfigError, match="unknown decode option"):
        engine.submit("abcde", {"gen_lenn": 8})
    with pytest.raises(ConfigError, match="exceeds"):
        engine.submit("x" * 200)
    with pytest.raises(dlm_jax.InputError, match="stop must be a list of non-empty strings"):
        engine.submit("abcde", stop=[""])


def test_a_cancelled_request_frees_its_row_for_the_next():
    model = _model("hello")
    engine = dlm_jax.Engine(model, decode_config(gen_len=32, block_len=4, threshold=1.0), max_batch=1)
    first = engine.submit("abcde")
    second = engine.submit("abcde")
    engine.step()
    first.cancel()
    engine.step()  # the cancel is seen here: the row goes to the waiting request
    assert first.result().status == "cancelled" and second.request.status == "running"
    assert second.result().text == "hello"


def test_a_background_engine_serves_requests_from_many_threads():
    model = _model("hello")
    engine = dlm_jax.Engine(model, decode_config(gen_len=16, block_len=4), max_batch=3)
    engine.start()
    texts = []

    def client():
        texts.append(engine.submit("abcde").result(timeout=60).text)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    engine.close()
    assert texts == ["hello"] * 8
    assert engine.stats.admitted == 8 and engine.stats.retired == {"done": 8}


@pytest.mark.slow  # (6 s)
def test_generate_sizes_its_engine_to_the_call(monkeypatch):
    """Every `Model.generate` call allocated and zeroed an engine cache as large as the model
    allows (64 rows of 512 slots for the shipped tiny model), one prompt or many: 60% of a
    one-prompt call's time (`benchmarks/results/generate_call.md`). A call's engine holds the
    batch bucket of its prompts (or `max_batch`) and rows as long as its longest request, and
    its answers stay the fixed-batch decode's."""
    from pathlib import Path

    from dlm_jax.runtime.engine import _eos_cut

    model = dlm_jax.load(Path(__file__).resolve().parents[1] / "models" / "llada-tiny", executor="jax")
    executor, shapes = model.decoder.executor, []
    real_open = executor.open
    monkeypatch.setattr(executor, "open", lambda cfg, pos, valid: shapes.append(pos.shape) or real_open(cfg, pos, valid))
    cfg = decode_config(gen_len=32, block_len=16, cache="dual", rule="threshold", threshold=0.9)
    prompts = ["1+2=", "33+4=", "5+66="]
    ids = [model.encode(p) for p in prompts]
    one = model.generate(prompts[:1], cfg)
    three = model.generate(prompts, cfg)
    assert shapes == [(1, len(ids[0]) + 32), (4, max(map(len, ids)) + 32)]
    fixed = [list(map(int, s[:_eos_cut(s, model.config.eos_ids)])) for s in model.decoder.decode(ids, cfg).sequences]
    assert one.token_ids == fixed[:1] and three.token_ids == fixed

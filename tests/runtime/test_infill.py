"""Infilling: a generation decoded between its prompt and a given suffix (`suffixes` of
`Decoder.decode` / `Model.generate`, `suffix` of `Engine.submit`).

The suffix sits in the slots right after the generation, in the prompt's state: fed, never
decoded. The reference is `transformers`: with LLaDA's sampler without a cache, every step is
a bidirectional forward over the prompt, the tokens committed so far, masks, and the suffix,
so each token's log-probability must be that forward's at the step that committed it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import dlm_jax
from dlm_jax._errors import ConfigError, InputError
from dlm_jax.frontends.cli import shipped_model
from dlm_jax.runtime.revision import NoRevision
from dlm_jax.runtime.state import DecodeState, TokenState
from tests.checkpoint.hf_models import build, llama_to_llada

from .test_logprobs import MASK, TOL, committing_distributions, fed_steps


def test_the_suffix_sits_after_the_generation_given_and_right_padded():
    state = DecodeState.create([[1, 2, 3], [4]], gen_len=4, batch=3, mask_id=9, vocab_size=10, tail=3,
                               suffixes=[[7, 8], [5, 6, 7]])
    assert (state.gen_start, state.gen_end, state.gen_len, state.total) == (3, 7, 4, 10)
    np.testing.assert_array_equal(state.tokens[:2, 7:], [[7, 8, 9], [5, 6, 7]])
    assert (state.status[:, 7:] == TokenState.PROMPT).all() and (state.status[:2, 3:7] == TokenState.MASK).all()
    np.testing.assert_array_equal(state.valid[:2, 7:], [[True, True, False], [True, True, True]])
    np.testing.assert_array_equal(state.positions[0, 3:9], [3, 4, 5, 6, 7, 8])  # right after the generation
    np.testing.assert_array_equal(state.positions[1, 3:], [1, 2, 3, 4, 5, 6, 7])  # (a left-padded prompt)
    np.testing.assert_array_equal(state.fed_tokens(slice(7, 10))[:2], [[7, 8, 9], [5, 6, 7]])
    assert not state.undecided(slice(7, 10)).any()


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("infill")
    llama = build("llama")
    llama.save_pretrained(tmp / "llama")
    llama_to_llada(tmp / "llama", tmp / "llada", mask_token_id=MASK)
    return llama, dlm_jax.load(tmp / "llada", executor="jax")


def test_every_step_sees_the_suffix_as_transformers_bidirectional_forward(llada, monkeypatch):
    llama, model = llada
    steps = fed_steps(monkeypatch)
    prompt, suffix = [5, 17, 42, 8, 60], [33, 71, 12]
    cfg = dlm_jax.preset("llada", gen_len=8, block_len=8, steps=8, logprobs=2)
    out = model.decoder.decode([prompt], cfg, suffixes=[suffix])
    ids, lp = out.sequences[0], out.logprobs[0]
    start = len(prompt)
    end = start + 8 + len(suffix)
    # The suffix right after the generation, then padding to the bucket of 8 slots
    # (`buckets.infill_slots`), which no step reads: the reference sees none of it.
    assert all(list(fed_tokens[0, start + 8:end]) == suffix and fed_tokens.shape[1] == start + 16
               for fed_tokens, _ in steps)
    decided = committing_distributions(llama, [(f[:, :end], s) for f, s in steps], start, len(ids))
    assert sorted(decided) == list(range(8))
    for j, ref in decided.items():
        assert abs(lp.logprob[j] - ref[ids[j]]) <= TOL, j
    # The suffix is read: the same prompt without it decodes other distributions.
    alone = model.decoder.decode([prompt], cfg).logprobs[0]
    assert np.abs(alone.logprob - lp.logprob).max() > 1e-3


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_schedules_compute_or_read_the_suffix_every_step(llada, monkeypatch, cache):
    """Prefix cache: every later step of a block computes the slots after it, the suffix among
    them; dual cache: every later step reads the suffix's K/V stored at the block's start."""
    _, model = llada
    plans = []
    from dlm_jax.runtime import scheduler as sched

    plan = sched.BlockScheduler.plan

    def spy(self, state, cursor):
        p = plan(self, state, cursor)
        if p is not None:
            plans.append((cursor.step, p))
        return p

    monkeypatch.setattr(sched.BlockScheduler, "plan", spy)
    prompt, suffix = [5, 17, 42, 8, 60], [33, 71, 12]
    out = model.decoder.decode([prompt], dlm_jax.preset("fast-dllm", gen_len=16, block_len=8, cache=cache,
                                                        threshold=0.999), suffixes=[suffix])
    tail = set(range(len(prompt) + 16, len(prompt) + 19))
    later = [p for step, p in plans if step > 0]
    assert later and all(tail <= set((p.window if cache == "prefix" else p.cached).tolist()) for p in later)
    assert all(p.store is not None and tail <= set(p.window.tolist()) for step, p in plans if step == 0)
    assert len(out.sequences[0]) == 16


@pytest.fixture(scope="module")
def tiny():
    return dlm_jax.load(shipped_model(), executor="jax")


PROMPTS = ["sort: 37 44 13 33 47 48", "sort: 1 5 3", "12+30="]


def test_infilled_requests_are_the_same_alone_and_batched(tiny):
    cfg = dlm_jax.preset("fast-dllm", gen_len=32, cache="dual")
    suffixes = [" 47 48", [], "2"]
    together = tiny.generate(PROMPTS, cfg, suffixes=suffixes)
    alone = [tiny.generate([p], cfg, suffixes=[s]).texts[0] for p, s in zip(PROMPTS, suffixes)]
    assert together.texts == alone
    plain = tiny.generate(PROMPTS[1], cfg)
    assert together.texts[1] == plain.texts[0]  # (an empty suffix is none)
    with dlm_jax.Engine(tiny, cfg) as engine:  # the Engine API, text suffix, one request
        assert engine.submit(PROMPTS[0], suffix=" 47 48").result().text == together.texts[0]


@pytest.mark.parametrize("preset,model_name,words", [
    ("llada-cpp", "llada-tiny", "does not go with the ProgressiveRevision revision policy"),
    ("mbsd", "llada-tiny", "needs a block schedule that reads the slots after its block"),
    ("isd", "idlm-tiny", "needs a bidirectional model: this one's attention is causal"),
])
def test_infilling_is_refused_where_no_generated_slot_reads_the_suffix(preset, model_name, words):
    model = dlm_jax.load(shipped_model(model_name), executor="jax")
    if preset == "mbsd":  # llada.cpp's speculative windows alone, without its revision policy
        cfg = dataclasses.replace(dlm_jax.preset("llada-cpp", gen_len=32), revision=NoRevision())
    else:
        cfg = dlm_jax.preset(preset, gen_len=32)
    with pytest.raises(ConfigError, match=words):
        model.generate(["1+1="], cfg, suffixes=["2"])


def test_bad_suffixes_are_refused_in_one_line(tiny):
    cfg = dlm_jax.preset("fast-dllm", gen_len=32)
    with pytest.raises(InputError, match="2 suffixes for 1 prompts"):
        tiny.generate(["1+1="], cfg, suffixes=["a", "b"])
    with pytest.raises(InputError, match="suffix 0 holds token id 99999"):
        tiny.decoder.decode([[1, 2]], cfg, suffixes=[[99999]])
    with pytest.raises(ConfigError, match=r"suffix \(200 tokens\)"):
        with dlm_jax.Engine(tiny, cfg, max_tokens=128) as engine:
            engine.submit("1+1=", suffix=[5] * 200)


@pytest.mark.slow  # (7 s: an export; infilling on the JAX executor stays in the default pass)
def test_the_litert_runner_infills_as_the_jax_executor(tiny, tmp_path, capsys):
    """A bundle exported for dual-cache decodes, run by `dlm-jax run --suffix-text`: the
    completions the JAX executor infills, token for token."""
    from dlm_jax.frontends.cli import main

    assert main(["export", "--model", str(shipped_model()), "--out", str(tmp_path / "b"), "--for-prompts", "40",
                 "--gen", "32", "--cache", "dual", "--latency-repeats", "1"]) == 0
    prompts, suffixes = ["sort: 37 44 13", "66+76="], [" 44", "2"]
    capsys.readouterr()
    assert main(["run", str(tmp_path / "b"), "--gen", "32", "--cache", "dual",
                 *[a for p, s in zip(prompts, suffixes) for a in ("--prompt", p, "--suffix-text", s)]]) == 0
    want = tiny.generate(prompts, dlm_jax.preset("fast-dllm", gen_len=32, cache="dual"), suffixes=suffixes).texts
    assert capsys.readouterr().out.split("\n")[:2] == want


@pytest.mark.slow  # (35 s: TIDE's probe and decode compile programs of their own)
def test_tides_calibration_probe_decodes_the_suffix_too(monkeypatch):
    """TIDE's tau='auto' calibrates from a probe decode of the request itself: an infilling
    request's probe decodes its suffix too (its steps' experts are the request's), through
    `Model.generate` and `Engine.submit` alike."""
    moe = dlm_jax.load(shipped_model("moe-tiny"), executor="jax")
    probes = []
    decode = moe.decoder.decode

    def spy(prompts, cfg, **kw):
        if cfg.placement.probe() is None and type(cfg.placement).__name__ != "NoPlacement":
            probes.append(kw.get("suffixes"))
        return decode(prompts, cfg, **kw)

    monkeypatch.setattr(moe.decoder, "decode", spy)
    cfg = dlm_jax.preset("fast-dllm", gen_len=16, block_len=8, experts="tide")
    suffix = moe.encode(" 44", chat=False)
    moe.generate(["sort: 44 13 37"], cfg, suffixes=[suffix])
    engine = dlm_jax.Engine(moe)
    engine.submit("sort: 44 13 37", cfg, suffix=suffix).result()
    assert probes == [[suffix], [suffix]]


def test_suffixes_of_other_lengths_share_their_programs(tiny):
    """The slots after a generation are a bucket of them (`buckets.infill_slots`; the slots past
    a request's suffix are padding no step reads, `test_every_step_sees_the_suffix...`), so a
    request whose suffix has another length runs the programs built for the first: it compiles
    nothing. Where the bucket does not fit under the engine's `max_tokens` but the suffix does,
    the slots are what fits: the request is not refused for its bucket."""
    from dlm_jax.executors._compile import XlaCompileCounter

    cfg = dlm_jax.preset("fast-dllm", gen_len=32, cache="prefix")
    tiny.generate([PROMPTS[0]], cfg, suffixes=[[5, 6, 7]])
    xla = XlaCompileCounter.count()
    again = tiny.generate([PROMPTS[0]], cfg, suffixes=[[5, 6, 7, 8, 9, 10]])
    assert XlaCompileCounter.count() == xla and again.stats.compiles == 0
    n = len(tiny.encode(PROMPTS[2]))
    with dlm_jax.Engine(tiny, cfg, max_tokens=n + 32 + 5) as engine:  # room for 5 slots, not 8
        assert engine.submit(PROMPTS[2], suffix=[5] * 5).result().status == "done"
        with pytest.raises(ConfigError, match=r"suffix \(6 tokens\)"):
            engine.submit(PROMPTS[2], suffix=[5] * 6)

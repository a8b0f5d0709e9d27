"""Token log-probabilities (decode option `logprobs`): each generated token's log-probability
under the distribution of the step that decided it, with that distribution's likeliest tokens.

The distribution is the model's over the vocabulary without the mask token, which no step
proposes. The reference is `transformers`: a tiny random Llama decoded left to right (each token's
distribution is the causal LM's next-token distribution given the tokens before it) and the
same weights in LLaDA's layout decoded by LLaDA's sampler without a cache (each step is a
bidirectional forward over the prompt, the tokens committed so far and masks elsewhere), the
inputs of every step read off the decode as it runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dlm_jax
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.state import DecodeState, TokenState
from dlm_jax.training.data import TASKS, make_split
from tests.checkpoint.hf_models import build, llama_to_llada, logits

MASK = 95
TOL = 1e-4  # float32 logits against transformers' (tests/checkpoint/test_parity.py's bound)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """Over the vocabulary without the mask token, which no step proposes (its logit is
    dropped before the softmax)."""
    x = np.array(x, np.float64)
    x[..., MASK] = -np.inf
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_left_to_right_logprobs_are_transformers_next_token_distribution(tmp_path):
    llama = build("llama")
    llama.save_pretrained(tmp_path)
    model = dlm_jax.load(tmp_path, executor="jax", mask_token_id=MASK)
    prompt = [5, 17, 42, 8]
    out = model.generate([prompt], dlm_jax.preset("ar", gen_len=8, logprobs=3))
    ids, lp = out.token_ids[0], out.logprobs[0]
    assert len(ids) == len(lp) == 8
    for t, token in enumerate(ids):
        ref = _log_softmax(logits(llama, np.asarray([prompt + ids[:t]]))[0, -1])
        assert abs(lp.logprob[t] - ref[token]) <= TOL, t
        assert list(lp.top_ids[t]) == list(np.argsort(-ref, kind="stable")[:3])
        np.testing.assert_allclose(lp.top_logprob[t], np.sort(ref)[::-1][:3], atol=TOL)


def fed_steps(monkeypatch) -> list:
    """Per step of the decodes that follow (logprobs on): [the tokens it was fed, the slots'
    states after it], read off the decode as it runs."""
    steps = []
    record, record_logprobs = DecodeState.record, DecodeState.record_logprobs

    def fed(self, *a):
        steps.append([self.fed_tokens(slice(None)).copy(), None])
        return record(self, *a)

    def after(self, *a):
        steps[-1][1] = self.status.copy()
        return record_logprobs(self, *a)

    monkeypatch.setattr(DecodeState, "record", fed)
    monkeypatch.setattr(DecodeState, "record_logprobs", after)
    return steps


def committing_distributions(llama, steps: list, start: int, n: int) -> dict[int, np.ndarray]:
    """Generated slot j -> the log-softmax of `transformers`' bidirectional forward over what
    the step that made it stable was fed (the first request's; generation from slot `start`)."""
    decided = {}
    for fed_tokens, status in steps:
        ref = _log_softmax(logits(llama, fed_tokens[:1], bidirectional=True)[0])
        for j in range(n):
            if j not in decided and status[0, start + j] == TokenState.STABLE:
                decided[j] = ref[start + j]
    return decided


def test_diffusion_logprobs_are_the_committing_steps_bidirectional_distribution(tmp_path, monkeypatch):
    llama = build("llama")
    llama.save_pretrained(tmp_path / "llama")
    llama_to_llada(tmp_path / "llama", tmp_path / "llada", mask_token_id=MASK)
    model = dlm_jax.load(tmp_path / "llada", executor="jax")
    steps = fed_steps(monkeypatch)
    prompt = [5, 17, 42, 8, 60]
    out = model.decoder.decode([prompt], dlm_jax.preset("llada", gen_len=8, block_len=8, steps=8, logprobs=2))
    ids, lp = out.sequences[0], out.logprobs[0]
    decided = committing_distributions(llama, steps, len(prompt), len(ids))
    assert sorted(decided) == list(range(8))
    for j, ref in decided.items():
        assert abs(lp.logprob[j] - ref[ids[j]]) <= TOL, j
        assert list(lp.top_ids[j]) == list(np.argsort(-ref, kind="stable")[:2])


PROMPTS = [e.prompt for task in ("addition", "sorting") for e in make_split(TASKS[task], 2, split="heldout", seed=0)]


@pytest.mark.parametrize("name, preset, extra", [
    ("llada-tiny", "fast-dllm", {}), ("llada-tiny", "fast-dllm-dual", {}), ("llada-tiny", "frechet", {}),
    ("llada-tiny", "fast-dllm", {"temperature": 0.7}),
    pytest.param("llada-tiny", "llada-cpp", {"refresh_rows": 0}, marks=pytest.mark.slow),
    pytest.param("idlm-tiny", "isd", {}, marks=pytest.mark.slow),
    pytest.param("idlm-tiny", "isd", {"temperature": 0.8}, marks=pytest.mark.slow)])
def test_recording_logprobs_changes_no_token(name, preset, extra, shipped):
    """Every shipped decoder decodes the same tokens and forwards with logprobs recorded, and
    every completion token has a finite log-probability no likelier than its distribution's top."""
    model = shipped(name)
    plain = model.generate(PROMPTS, dlm_jax.preset(preset, gen_len=32, **extra), seeds=[3, 4, 5, 6])
    got = model.generate(PROMPTS, dlm_jax.preset(preset, gen_len=32, logprobs=2, **extra), seeds=[3, 4, 5, 6])
    assert got.token_ids == plain.token_ids and got.stats.request_nfe == plain.stats.request_nfe
    for ids, lp in zip(got.token_ids, got.logprobs):
        assert len(lp) == len(ids) and np.isfinite(lp.logprob).all() and (lp.logprob <= 0).all()
        assert (lp.top_logprob[:, 0] >= lp.logprob - 1e-6).all()
        assert (np.diff(lp.top_logprob, axis=1) <= 0).all()
    assert plain.logprobs is None


@pytest.fixture(scope="module")
def shipped():
    from pathlib import Path

    models, root = {}, Path(__file__).resolve().parents[2] / "models"

    def get(name):
        if name not in models:
            models[name] = dlm_jax.load(root / name, executor="jax")
        return models[name]

    return get


def test_engine_requests_record_their_own_logprobs_and_bad_values_are_refused(shipped):
    """Beside requests without them, an engine request's logprobs are its solo decode's; a CPU
    path that revises tokens, or an out-of-range count, is refused with the option named."""
    model = shipped("llada-tiny")
    cfg = dlm_jax.preset("fast-dllm", gen_len=32)
    solo = model.generate(PROMPTS[:1], dlm_jax.preset("fast-dllm", gen_len=32, logprobs=1)).logprobs[0]
    with dlm_jax.Engine(model, cfg, max_batch=4) as engine:
        others = [engine.submit(p) for p in PROMPTS[1:]]
        mine = engine.submit(PROMPTS[0], {"logprobs": 1})
        done = mine.result()
        assert all(h.result().logprobs is None for h in others)
    np.testing.assert_array_equal(done.logprobs.logprob, solo.logprob)
    np.testing.assert_array_equal(done.logprobs.top_ids, solo.top_ids)
    with pytest.raises(ConfigError, match="refresh_rows=0"):
        model.generate(PROMPTS[:1], dlm_jax.preset("llada-cpp", gen_len=32, logprobs=0))
    with pytest.raises(ConfigError, match="logprobs=21"):
        dlm_jax.preset("fast-dllm", logprobs=21)

"""OpenAI's presence / frequency penalties and `logit_bias` in the proposer (decode options
`presence_penalty`, `frequency_penalty`; `Proposer.logit_bias`).

A diffusion decode's "text so far" is the tokens its generation has committed (visible or
final), wherever they sit. The bias is checked against `transformers`'
`SequenceBiasLogitsProcessor` (single-token sequences: an additive bias), the penalties
against OpenAI's documented formula, logit - c * frequency_penalty - (c > 0) * presence_penalty.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import dlm_jax
from dlm_jax._errors import ConfigError
from dlm_jax.frontends.cli import shipped_model
from dlm_jax.runtime.proposer import Proposer
from dlm_jax.runtime.state import DecodeState, TokenState
from dlm_jax.runtime.step import StepOutputs

V = 20


def penalty_state(vocab: int = V) -> DecodeState:
    """Two requests with committed, visible and draft tokens in their generations."""
    state = DecodeState.create([[1, 2, 3], [4, 5]], gen_len=6, batch=2, mask_id=vocab - 1, vocab_size=vocab)
    g = state.gen_start
    state.tokens[0, g:g + 4] = [7, 7, 9, 3]
    state.status[0, g:g + 4] = [TokenState.STABLE, TokenState.VISIBLE, TokenState.STABLE, TokenState.DRAFT]
    state.tokens[1, g:g + 2] = [9, 4]
    state.status[1, g:g + 2] = TokenState.STABLE
    return state


def test_adjusted_logits_are_openais_penalties_over_transformers_bias():
    state = penalty_state()
    logits = np.random.default_rng(0).normal(size=(2, 3, V)).astype(np.float32)
    bias = ((4, 2.5), (7, -100.0), (11, 0.75))
    p = Proposer(presence_penalty=0.5, frequency_penalty=0.3, logit_bias=bias)
    from transformers import SequenceBiasLogitsProcessor

    biased = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])(
        torch.zeros((6, 1), dtype=torch.long), torch.as_tensor(logits.reshape(6, V), dtype=torch.float64))
    counts = np.zeros((2, V))  # committed (visible or stable) generated tokens; drafts and prompts do not count
    counts[0, 7], counts[0, 9], counts[1, 9], counts[1, 4] = 2, 1, 1, 1
    want = biased.numpy().reshape(2, 3, V) - (0.3 * counts + 0.5 * (counts > 0))[:, None]
    np.testing.assert_allclose(p.adjusted(logits, state), want, rtol=0, atol=1e-12)
    out = StepOutputs(top_token=logits.argmax(-1).astype(np.int32), top_prob=np.zeros((2, 3), np.float32),
                      second_prob=np.zeros((2, 3), np.float32), entropy=np.zeros((2, 3), np.float32), logits=logits)
    proposal = p.propose(out, np.ones((2, 3), bool), state)
    assert (proposal.tokens == want.argmax(-1)).all() and (proposal.tokens != logits.argmax(-1)).any()
    probs = np.exp(want - want.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(proposal.confidence, probs.max(-1), rtol=1e-12)
    assert p.needs_logits and not Proposer().adjusts


def test_bias_and_penalties_steer_the_shipped_models_decode():
    model = dlm_jax.load(shipped_model(), executor="jax")
    prompt = "sort: 37 44 13 33 47 48"
    cfg = dlm_jax.preset("fast-dllm", gen_len=32)
    three = model.encode("3", chat=False)[-1]
    plain = model.generate([prompt], cfg).texts[0]
    assert "3" in plain

    def biased(b: float) -> str:
        proposer = dataclasses.replace(cfg.proposer, logit_bias=((three, b),))
        return model.generate([prompt], dataclasses.replace(cfg, proposer=proposer)).texts[0]

    assert "3" not in biased(-100.0) and set(biased(100.0)) == {"3"}
    assert model.generate([prompt], dlm_jax.preset("fast-dllm", gen_len=32, presence_penalty=0.0)).texts[0] == plain
    with pytest.raises(ConfigError, match="presence_penalty=3"):
        dlm_jax.preset("fast-dllm", presence_penalty=3)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        model.generate([prompt], dataclasses.replace(cfg, proposer=Proposer(logit_bias=((10**6, 1.0),))))


@pytest.mark.parametrize("digit", ["4", pytest.param("1", marks=pytest.mark.slow)])
def test_a_revision_never_brings_back_what_the_bias_rules_out(digit):
    """llada.cpp's DPPR re-predicts visible tokens (the window's probes, the CPU path's
    refresh) and revises those it now predicts otherwise: its predictions come from the same
    adjusted logits as the proposals, on the host and beside the step alike, so a banned token
    never returns (each of these tokens did, through a probe, before)."""
    model = dlm_jax.load(shipped_model(), executor="jax")
    prompts = ["sort: 37 44 13 33 47 48", "sort: 1 5 3 9 7", "sort: 9 8 7 6 5 4", "sort: 2 4 1 3 3"]
    revised = 0
    banned = model.encode(digit, chat=False)[-1]
    texts = {}
    for on in ("host", "device"):
        cfg = dlm_jax.preset("llada-cpp", gen_len=32, refresh_rows=4, logits_on=on)
        cfg = dataclasses.replace(cfg, proposer=dataclasses.replace(cfg.proposer, logit_bias=((banned, -100.0),)))
        out = model.generate(prompts, cfg)
        assert not any(digit in t for t in out.texts), (digit, on, out.texts)
        texts[on] = out.texts
        counters = out.stats.counters
        revised += counters.get("probe_revised", 0) + counters.get("refresh_revised", 0)
        assert counters.get("refresh_steps", 0) > 0
    assert texts["device"] == texts["host"]
    assert revised > 0

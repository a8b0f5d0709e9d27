"""Decoder behaviour beyond the reference algorithms: batching, logit shift, EOS, sampling,
compilation, bad input."""

import numpy as np
import pytest

from dlm_jax import ConfigError
from dlm_jax.program import JaxExecutor
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.decoder import BlockDecoder

from .test_reference_semantics import MASK, sharp_model

PROMPTS = [[5, 17, 3, 44, 9, 21, 30], [8, 1], [40, 41, 42, 43, 2]]
SETTINGS = [
    dict(cache="none", rule="topk", steps=16),
    dict(cache="prefix", rule="threshold", threshold=0.8),
    dict(cache="dual", rule="frechet", delta=0.25),
    dict(cache="prefix", rule="factor", factor=1.5, confidence="margin"),
]


@pytest.fixture(scope="module")
def decoder():
    model = sharp_model()
    return BlockDecoder(JaxExecutor(model), model.config)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s['cache']}-{s['rule']}")
def test_batch_invariance(decoder, setting):
    """A prompt decoded alone and inside a batch of differently sized prompts gives the same
    tokens (the published generators' scores move with batch size)."""
    cfg = DecodeConfig(gen_len=16, block_len=8, stop_on_eos_block=False, **setting)
    batched = decoder.decode(PROMPTS, cfg)
    for i, prompt in enumerate(PROMPTS):
        alone = decoder.decode([prompt], cfg)
        np.testing.assert_array_equal(batched.sequences[i], alone.sequences[0])
        assert batched.stats.request_nfe[i] == alone.stats.nfe


def test_sampling_is_seeded_per_request(decoder):
    cfg = DecodeConfig(gen_len=16, block_len=8, cache="prefix", rule="threshold", temperature=1.0,
                       stop_on_eos_block=False, seed=3)
    a = decoder.decode(PROMPTS, cfg, seeds=[3, 4, 5])
    b = decoder.decode([PROMPTS[1]], cfg, seeds=[4])
    np.testing.assert_array_equal(a.sequences[1], b.sequences[0])
    # The noise is real: other seeds give other samples.
    others = [decoder.decode([PROMPTS[1]], cfg.replace(temperature=4.0), seeds=[s]).sequences[0] for s in range(4)]
    assert any(not np.array_equal(others[0], o) for o in others[1:])


@pytest.mark.parametrize("attention, shift", [("causal", True), ("block_causal", False), ("block_causal", True)])
def test_caches_are_exact_when_attention_cannot_see_the_future(attention, shift):
    """With causal or block-causal attention (block = decode block) the prefix cache and the
    stale suffix of the dual cache change nothing: all cache modes give the same tokens (for
    block-causal only when decode blocks line up with attention blocks). With
    logit shift (Dream, I-DLM) row i predicts position i + 1, so the block's first slot is
    predicted from the last prompt token's row."""
    model = sharp_model(attention=attention, logit_shift=shift)
    dec = BlockDecoder(JaxExecutor(model), model.config)
    base = dict(gen_len=16, block_len=8, rule="threshold", threshold=0.7, stop_on_eos_block=False)
    prompt = PROMPTS[0] + [11]  # 8 tokens: decode blocks line up with the attention blocks
    none = dec.decode([prompt], DecodeConfig(cache="none", **base))
    for cache in ("prefix", "dual"):
        out = dec.decode([prompt], DecodeConfig(cache=cache, **base))
        np.testing.assert_array_equal(out.sequences[0], none.sequences[0])


def test_eos_block_ends_the_request(decoder, monkeypatch):
    eos = decoder.model_config.eos_token_id
    cfg = DecodeConfig(gen_len=24, block_len=8, cache="prefix", rule="threshold")
    first = decoder.decode([PROMPTS[0]], cfg.replace(stop_on_eos_block=False))
    # Pretend the model's first block was all EOS by prefilling it: the request stops there.
    real = decoder._predict

    def eos_first_block(out, rows, cand, c, rngs):
        x0, conf = real(out, rows, cand, c, rngs)
        return np.where(cand, eos, x0), conf

    monkeypatch.setattr(decoder, "_predict", eos_first_block)
    out = decoder.decode([PROMPTS[0]], cfg)
    assert (out.sequences[0] == eos).all()
    assert out.stats.nfe < first.stats.nfe


def test_no_compilation_after_warmup():
    from buckets._compile import XlaCompileCounter

    model = sharp_model(seed=1)
    executor = JaxExecutor(model)
    dec = BlockDecoder(executor, model.config)
    cfg = DecodeConfig(gen_len=32, block_len=8, cache="dual", rule="frechet")
    assert dec.warmup([len(PROMPTS[0])], cfg) == 2  # the full forward and the block window
    ours, xla = executor.compile_count, XlaCompileCounter.count()
    out = dec.decode([PROMPTS[0]], cfg)
    dec.decode([PROMPTS[0]], cfg)
    assert out.stats.nfe > 4
    assert executor.compile_count == ours
    assert XlaCompileCounter.count() == xla


def test_bad_input(decoder):
    cfg = DecodeConfig(gen_len=16, block_len=8)
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        decoder.decode([[1, 2], []], cfg)
    with pytest.raises(ConfigError, match=r"prompt \(90 tokens\) \+ gen_len \(16\) = 106 tokens exceeds the limit of 96"):
        decoder.decode([[1] * 90], cfg)
    with pytest.raises(ConfigError, match="block_len=5 must divide gen_len=16"):
        DecodeConfig(gen_len=16, block_len=5)
    with pytest.raises(ConfigError, match="rule='fastest'"):
        DecodeConfig(rule="fastest")
    with pytest.raises(ConfigError, match="cache='triple'"):
        DecodeConfig(cache="triple")


def test_defer_eos_ranks_eos_last(decoder):
    """LLaDA's confidence_eos_eot_inf: a position predicted as EOS gets confidence 0, so any
    rule commits it after every other candidate."""
    from dlm_jax.runtime.commit import TopKRule
    from dlm_jax.runtime.step import StepOutputs

    eos = decoder.model_config.eos_token_id
    top = np.array([[eos, 7, eos, 9]], np.int32)
    prob = np.array([[0.99, 0.6, 0.95, 0.5]], np.float32)
    out = StepOutputs(top_token=top, top_prob=prob, second_prob=prob / 4, entropy=1 - prob,
                      k_new=np.zeros(0), v_new=np.zeros(0))
    cand = np.ones((1, 4), bool)
    cfg = DecodeConfig(gen_len=8, block_len=4, rule="topk", cache="none")
    _, conf = decoder._predict(out, np.arange(4), cand, cfg, [None])
    _, deferred = decoder._predict(out, np.arange(4), cand, cfg.replace(defer_eos=True), [None])
    first_two = TopKRule(np.array([[2]]))
    assert first_two.select(conf, cand).tolist() == [[True, False, True, False]]
    assert first_two.select(deferred, cand).tolist() == [[False, True, False, True]]


def test_mask_token_is_never_proposed():
    """A model whose head favours the mask token would 'commit' masks forever (the block never
    finishes, no error). The program removes the mask logit before ranking."""
    import dlm_jax

    model = sharp_model(seed=2)
    params = dlm_jax.get_params(model)
    head = params["lm_head.kernel"].copy()
    head[:, MASK] = 50.0
    model = dlm_jax.model_from_params(model.config, {**params, "lm_head.kernel": head})
    dec = BlockDecoder(JaxExecutor(model), model.config)
    out = dec.decode([PROMPTS[0]], DecodeConfig(gen_len=16, block_len=8, cache="prefix", rule="threshold"))
    assert MASK not in out.sequences[0].tolist()

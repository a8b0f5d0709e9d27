"""Decoder behaviour on real (tiny, random) models: batching, logit shift, exact caches,
compilation, the mask token. Behaviour that needs no model is in test_loop.py (mock executor)."""

import numpy as np
import pytest

from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime import Decoder, decode_config
from dlm_jax.testing import MASK, sharp_model

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
    return Decoder(JaxExecutor(model), model.config)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s['cache']}-{s['rule']}")
def test_batch_invariance(decoder, setting):
    """A prompt decoded alone and inside a batch of differently sized prompts gives the same
    tokens (the published generators' scores move with batch size)."""
    cfg = decode_config(gen_len=16, block_len=8, stop_on_eos_block=False, **setting)
    batched = decoder.decode(PROMPTS, cfg)
    for i, prompt in enumerate(PROMPTS):
        alone = decoder.decode([prompt], cfg)
        np.testing.assert_array_equal(batched.sequences[i], alone.sequences[0])
        assert batched.stats.request_nfe[i] == alone.stats.nfe


def test_jax_executor_decodes_batches_past_eight(decoder):
    """The JAX executor compiles buckets on first use, so a batch of 9-64 prompts runs (padded to
    16, 32 or 64 rows), each answer the one its prompt gets alone; past 64 it refuses in one line."""
    from dlm_jax._errors import ConfigError

    cfg = decode_config(gen_len=8, block_len=8, cache="dual", rule="threshold", threshold=0.8,
                        stop_on_eos_block=False)
    prompts = [PROMPTS[i % 3] for i in range(17)]
    out = decoder.decode(prompts, cfg)
    assert out.stats.buckets and all(k.startswith("b32_") for k in out.stats.buckets), out.stats.buckets
    for i in range(3):
        np.testing.assert_array_equal(out.sequences[i], decoder.decode([PROMPTS[i]], cfg).sequences[0])
    with pytest.raises(ConfigError, match="65 exceeds the largest batch bucket \\(64\\)"):
        decoder.decode([PROMPTS[0]] * 65, cfg)


@pytest.mark.parametrize("attention, shift", [("causal", True), ("block_causal", False), ("block_causal", True)])
def test_caches_are_exact_when_attention_cannot_see_the_future(attention, shift):
    """With causal or block-causal attention (block = decode block) the prefix cache and the
    stale suffix of the dual cache change nothing: all cache modes give the same tokens (for
    block-causal only when decode blocks line up with attention blocks). With
    logit shift (Dream, I-DLM) row i predicts position i + 1, so the block's first slot is
    predicted from the last prompt token's row."""
    model = sharp_model(attention=attention, logit_shift=shift)
    dec = Decoder(JaxExecutor(model), model.config)
    base = dict(gen_len=16, block_len=8, rule="threshold", threshold=0.7, stop_on_eos_block=False)
    prompt = PROMPTS[0] + [11]  # 8 tokens: decode blocks line up with the attention blocks
    none = dec.decode([prompt], decode_config(cache="none", **base))
    for cache in ("prefix", "dual"):
        out = dec.decode([prompt], decode_config(cache=cache, **base))
        np.testing.assert_array_equal(out.sequences[0], none.sequences[0])


def test_no_compilation_after_warmup():
    from dlm_jax.buckets import XlaCompileCounter

    model = sharp_model(seed=1)
    executor = JaxExecutor(model)
    dec = Decoder(executor, model.config)
    cfg = decode_config(gen_len=32, block_len=8, cache="dual", rule="frechet")
    assert dec.warmup([len(PROMPTS[0])], cfg) == 2  # the full forward and the block window
    ours, xla = executor.compile_count, XlaCompileCounter.count()
    out = dec.decode([PROMPTS[0]], cfg)
    dec.decode([PROMPTS[0]], cfg)
    assert out.stats.nfe > 4
    assert executor.compile_count == ours
    assert XlaCompileCounter.count() == xla


def test_mask_token_is_never_proposed():
    """A model whose head favours the mask token would 'commit' masks forever (the block never
    finishes, no error). The program removes the mask logit before ranking."""
    import dlm_jax

    model = sharp_model(seed=2)
    params = dlm_jax.get_params(model)
    head = params["lm_head.kernel"].copy()
    head[:, MASK] = 50.0
    model = dlm_jax.model_from_params(model.config, {**params, "lm_head.kernel": head})
    dec = Decoder(JaxExecutor(model), model.config)
    out = dec.decode([PROMPTS[0]], decode_config(gen_len=16, block_len=8, cache="prefix", rule="threshold"))
    assert MASK not in out.sequences[0].tolist()


def test_kv_leave_the_device_never_and_densely_only_on_storing_steps():
    """The JAX executor's decode keeps the K/V on its device: the dense step (which returns
    them) is never called, and what comes back each step is the rows' predictions. Fed
    densely (`HostKVCache`, the LiteRT path), the window K/V come back only on the steps that
    store them: a prefix-cache decode fetches them at each block's first step."""
    from dlm_jax.runtime.kvcache import HostKVCache

    model = sharp_model()
    cfg = decode_config(gen_len=16, block_len=8, threshold=0.99)
    executor = JaxExecutor(model)
    dense_calls = []
    real = executor.step
    executor.step = lambda inputs, **kw: dense_calls.append(inputs) or real(inputs, **kw)
    out = Decoder(executor, model.config).decode([PROMPTS[0]], cfg)
    assert out.stats.nfe > 2 and not dense_calls
    rows = max(int(k.split("_r")[1].split("_")[0]) for k in out.stats.buckets)
    assert max(out.stats.d2h_bytes) <= 16 * rows  # four [1, R] predictions of 4 bytes

    executor = JaxExecutor(model)
    executor.open = lambda config, positions, valid: HostKVCache(executor, config, positions, valid)
    fetched = []
    real_step = executor.step

    def spy(inputs, *, timings=None):
        out = real_step(inputs)
        fetched.append((inputs.want.kv, out.k_new is not None))
        return out

    executor.step = spy
    out = Decoder(executor, model.config).decode([PROMPTS[0]], cfg)
    assert out.stats.nfe > 2
    assert [kv for kv, _ in fetched] == [got for _, got in fetched]
    assert sum(kv for kv, _ in fetched) == 2  # one per block

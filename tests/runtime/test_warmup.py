"""Warm-up covers every bucket a decode can reach: after `Decoder.warmup`, a decode compiles
nothing on the JAX executor (its own count and XLA's process-wide one) and exports nothing on
the bundle cache, for every preset and every registered scheduler; `DecodeStats` counts both.
"""

from __future__ import annotations

import numpy as np
import pytest

import dlm_jax
from dlm_jax.executors._compile import XlaCompileCounter
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime import Decoder, decode_config, preset
from dlm_jax.runtime.registry import SCHEDULERS

CAUSAL_ONLY = ("isd", "ar")  # causal, logit-shift schedules: tests/techniques/isd/test_isd.py
from dlm_jax.testing import sharp_model
import dataclasses

# Prompt sets of several lengths and batch sizes; each is warmed, then decoded.
PROMPT_SETS = [[[5, 17, 3, 44, 9, 21, 30], [8, 1], [40, 41, 42, 43, 2]], [[7] * 19], [[3, 4]]]
CONFIGS = {**{f"preset={name}": preset(name, gen_len=64) for name in sorted(dlm_jax.PRESETS)
                 if name not in CAUSAL_ONLY if name != "llada-cpp"},
           **{f"cache={name}": decode_config(cache=name, gen_len=64, block_len=16) for name in sorted(SCHEDULERS)
                 if name not in CAUSAL_ONLY and name != "mbsd"}}
# llada-cpp with its CPU path: a minute of cold compiles each (the main and the CPU path's buckets).
SLOW = {"cache=mbsd": decode_config(cache="mbsd", gen_len=64, block_len=16),  # its own buckets: 5 s
        "llada-cpp revision=none": preset("llada-cpp", gen_len=64, revision="none"),  # mbsd's buckets: 15 s cold
        "preset=llada-cpp": preset("llada-cpp", gen_len=64),
        "llada-cpp in_place": preset("llada-cpp", gen_len=64, revisit="in_place"),
        "llada-cpp sampled": preset("llada-cpp", gen_len=32, temperature=0.7)}  # every bucket again, with logits


@pytest.fixture(scope="module")
def decoder():
    model = sharp_model()
    return Decoder(JaxExecutor(model), model.config)


@pytest.mark.parametrize("name", [*CONFIGS, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW)])
def test_no_compile_after_warmup(decoder, name):
    cfg = {**CONFIGS, **SLOW}[name]
    for prompts in PROMPT_SETS:
        decoder.warmup([len(p) for p in prompts], cfg)
        xla = XlaCompileCounter.count()
        out = decoder.decode(prompts, cfg)
        assert XlaCompileCounter.count() == xla, f"{name}: XLA compiled during a warmed decode"
        assert out.stats.compiles == 0 and out.stats.exports == 0, (name, out.stats.buckets)
        assert out.stats.to_dict()["compiles"] == 0


def test_stats_count_the_compiles_of_an_unwarmed_decode():
    model = sharp_model(seed=3)  # a fresh executor: nothing compiled yet
    decoder = Decoder(JaxExecutor(model), model.config)
    out = decoder.decode([[5, 6, 7]], preset("llada-cpp", gen_len=32))
    assert out.stats.compiles >= len(out.stats.buckets) > 0  # every main bucket (and any CPU-path one)
    assert out.stats.compile_seconds > 0 and out.stats.exports == 0


@pytest.mark.slow  # llada-cpp's main and CPU-path buckets: about 15 s cold
def test_warmed_steps_may_run_in_a_larger_rows_bucket_with_the_same_tokens(decoder):
    """Warm-up prepares each window and cache size with its most rows; a step needing fewer
    runs there rather than compiling a smaller bucket, and decodes the same."""
    cfg = preset("llada-cpp", gen_len=64)
    prompts = PROMPT_SETS[0]
    decoder.warmup([len(p) for p in prompts], cfg)
    warm = decoder.decode(prompts, cfg)
    cold = Decoder(decoder.executor, decoder.model_config).decode(prompts, cfg)  # no preference
    for a, b in zip(warm.sequences, cold.sequences):
        np.testing.assert_array_equal(a, b)
    assert warm.stats.counters == cold.stats.counters and warm.stats.request_nfe == cold.stats.request_nfe


@pytest.mark.slow  # about 10 s: a bundle-cache export
def test_bundle_cache_exports_nothing_after_warmup(tmp_path, monkeypatch):
    from dlm_jax.executors.bundle_cache import BundleCacheExecutor

    monkeypatch.setenv("DLM_JAX_BUNDLE_CACHE", str(tmp_path))
    model = sharp_model()
    decoder = Decoder(BundleCacheExecutor(model, source="sharp"), model.config)
    for name in CONFIGS:
        cfg = dataclasses.replace(CONFIGS[name], gen_len=32)
        for prompts in PROMPT_SETS[:2]:
            decoder.warmup([len(p) for p in prompts], cfg)
            out = decoder.decode(prompts, cfg)
            assert out.stats.exports == 0 and out.stats.compiles == 0, (name, out.stats.buckets)

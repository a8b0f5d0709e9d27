"""The runtime reproduces the published decoders token for token and NFE for NFE.

Guards against the silent failure where a 'faster' decoder quietly decodes something else
(a cache window one slot off, a rule that commits the wrong prefix, a schedule that drifts):
outputs still look like text and no error is raised.
"""

import numpy as np
import pytest

import dlm_jax
from dlm_jax.program import JaxExecutor
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.decoder import BlockDecoder

from .reference import fast_dllm_generate, llada_generate

MASK = 63


def sharp_model(attention="bidirectional", seed=0, **extra):
    """A random model made position-sensitive and confident, so confidences spread over
    (0.5, 0.95) and differ between positions by far more than float noise: the mask token's
    embedding is zero (masked slots are pure attention read-outs), fast RoPE and sharp
    attention make those read-outs depend on position, and a scaled head sharpens them."""
    cfg = dlm_jax.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_hidden=64, attention=attention, block_size=8, mask_token_id=MASK,
                              eos_token_id=62, max_seq_len=96, rope_theta=4.0, **extra)
    params = dlm_jax.get_params(dlm_jax.init_model(cfg, seed=seed))
    scale = {"lm_head.kernel": 70.0, "q_proj": 8.0, "k_proj": 8.0}
    params = {k: v * next((f for key, f in scale.items() if key in k), 1.0) for k, v in params.items()}
    embedding = params["embed.embedding"].copy()
    embedding[MASK] = 0.0
    params["embed.embedding"] = embedding
    return dlm_jax.model_from_params(cfg, params)


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@pytest.fixture(scope="module")
def decoder(model):
    return BlockDecoder(JaxExecutor(model), model.config)


PROMPT = np.array([[5, 17, 3, 44, 9, 21, 30]])


@pytest.mark.parametrize("steps", [32, 10])
def test_vanilla_topk_equals_llada_generate(model, decoder, steps):
    ref, ref_nfe = llada_generate(model, PROMPT, steps=steps, gen_length=32, block_length=16, mask_id=MASK)
    out = decoder.decode([PROMPT[0].tolist()], DecodeConfig(gen_len=32, block_len=16, steps=steps, cache="none",
                                                             rule="topk", stop_on_eos_block=False))
    np.testing.assert_array_equal(out.sequences[0], ref[0, PROMPT.shape[1]:])
    assert out.stats.nfe == ref_nfe == steps


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("rule, params", [("threshold", {"threshold": 0.5}), ("threshold", {"threshold": 0.9}),
                                          ("factor", {"factor": 1.0}), ("factor", {"factor": 2.0})])
def test_cached_rules_equal_fast_dllm(model, decoder, cache, rule, params):
    ref, ref_nfe = fast_dllm_generate(model, PROMPT, gen_length=32, block_length=8, mask_id=MASK,
                                      cache=cache, **params)
    out = decoder.decode([PROMPT[0].tolist()], DecodeConfig(gen_len=32, block_len=8, cache=cache, rule=rule,
                                                             stop_on_eos_block=False, **params))
    np.testing.assert_array_equal(out.sequences[0], ref[0, PROMPT.shape[1]:])
    assert out.stats.nfe == ref_nfe
    # The rule is doing something: more than one token per step on average, fewer NFE than tokens.
    assert ref_nfe < 32

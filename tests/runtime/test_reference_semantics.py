"""The runtime reproduces the published decoders token for token and NFE for NFE.

Guards against the silent failure where a 'faster' decoder quietly decodes something else
(a cache window one slot off, a rule that commits the wrong prefix, a schedule that drifts):
outputs still look like text and no error is raised.

The references (`reference.py`) transcribe ML-GSAI/LLaDA `generate` and NVlabs/Fast-dLLM's
three generators with their top-k, threshold and (released) factor rules. The runtime decodes
prompts of different lengths in one left-padded batch; each request must equal the
reference run on its prompt alone.
"""

import numpy as np
import pytest

from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime import Decoder, decode_config
from dlm_jax.testing import MASK, sharp_model

from .reference import Forward, fast_dllm_generate, llada_generate

PROMPTS = [[5, 17, 3, 44, 9, 21, 30], [8, 1], [40, 41, 42, 43, 2]]
GEN = 32


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@pytest.fixture(scope="module")
def forward(model):
    return Forward(model)


@pytest.fixture(scope="module")
def decoder(model):
    return Decoder(JaxExecutor(model), model.config)


def _reference(forward, prompt, **kw):
    """The reference on one prompt (batch of one): (generated ids, nfe)."""
    p = np.array([prompt])
    x, nfe = fast_dllm_generate(forward, p, gen_length=GEN, mask_id=MASK, **kw)
    return x[0, p.shape[1]:], nfe


@pytest.mark.parametrize("steps, block", [(32, 16), (10, 16), (32, 32)])
def test_vanilla_topk_equals_llada_generate(forward, decoder, steps, block):
    out = decoder.decode(PROMPTS, decode_config(gen_len=GEN, block_len=block, steps=steps, cache="none",
                                                rule="topk", stop_on_eos_block=False))
    for r, prompt in enumerate(PROMPTS):
        ref, ref_nfe = llada_generate(forward, np.array([prompt]), steps=steps, gen_length=GEN,
                                      block_length=block, mask_id=MASK)
        np.testing.assert_array_equal(out.sequences[r], ref[0, len(prompt):])
        assert out.stats.request_nfe[r] == ref_nfe == steps
    assert out.stats.nfe == steps


RULES = {
    "topk": dict(rule="topk"),
    "topk-2-per-step": dict(rule="topk", steps=GEN // 2),
    "threshold-0.9": dict(rule="threshold", threshold=0.9),
    "threshold-0.5": dict(rule="threshold", threshold=0.5),
    "factor-1": dict(rule="factor", factor=1.0),
    "factor-2": dict(rule="factor", factor=2.0),
}


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", list(RULES))
def test_decoders_equal_fast_dllm(forward, decoder, cache, rule, block):
    setting = RULES[rule]
    ref_kw = {k: v for k, v in setting.items() if k != "rule"}
    out = decoder.decode(PROMPTS, decode_config(gen_len=GEN, block_len=block, cache=cache,
                                                stop_on_eos_block=False, **setting))
    for r, prompt in enumerate(PROMPTS):
        ref, ref_nfe = _reference(forward, prompt, block_length=block, cache=cache, **ref_kw)
        np.testing.assert_array_equal(out.sequences[r], ref, err_msg=f"prompt {r}")
        assert out.stats.request_nfe[r] == ref_nfe, f"prompt {r}"
    if not rule.startswith("topk"):
        # The rule is doing something: fewer forwards than tokens.
        assert max(out.stats.request_nfe) < GEN


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_batched_reference_equals_batched_decode(forward, decoder, cache):
    """Equal-length prompts batched as the released code batches them: the same tokens and
    the same number of batch forwards (a block runs until its slowest row is done)."""
    prompts = np.array([PROMPTS[0], [9, 8, 7, 6, 5, 4, 3]])
    ref, ref_nfe = fast_dllm_generate(forward, prompts, gen_length=GEN, block_length=16, mask_id=MASK,
                                      cache=cache, threshold=0.7)
    out = decoder.decode(prompts.tolist(), decode_config(gen_len=GEN, block_len=16, cache=cache, threshold=0.7,
                                                         stop_on_eos_block=False))
    np.testing.assert_array_equal(np.stack(out.sequences), ref[:, prompts.shape[1]:])
    assert out.stats.nfe == ref_nfe
    assert out.stats.request_nfe[0] != out.stats.request_nfe[1] or cache == "none"  # rows finish apart

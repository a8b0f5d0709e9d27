"""LLaDA's plain decoder: its transfer schedule and commit invariants."""

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError, ModelConfig
from dlm_jax._vanilla import generate_vanilla, num_transfer_tokens


def test_schedule_matches_llada_formula():
    # LLaDA: base = count // steps everywhere, +1 on the first (count % steps) steps.
    masked = np.zeros((2, 32), bool)
    masked[0, :32] = True
    masked[1, :7] = True
    np.testing.assert_array_equal(num_transfer_tokens(masked, 5), [[7, 7, 6, 6, 6], [2, 2, 1, 1, 1]])


@pytest.mark.parametrize("logit_shift", [False, True])
def test_one_commit_per_step_fills_every_mask(logit_shift):
    cfg = ModelConfig(vocab_size=30, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32,
                      mask_token_id=29, logit_shift=logit_shift)
    model = dlm_jax.init_model(cfg)
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    seen = []
    res = generate_vanilla(model, prompt, gen_len=8, steps=8, block_len=4,
                           on_block=lambda i, x: seen.append((x[:, 3:] == 29).sum(1).tolist()))
    assert res.nfe == 8
    assert seen == [[4, 4], [0, 0]]  # the first block is done before the second starts
    np.testing.assert_array_equal(res.tokens[:, :3], prompt)


def test_bad_lengths():
    cfg = ModelConfig(vocab_size=30, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32,
                      mask_token_id=29, max_seq_len=16)
    model = dlm_jax.init_model(cfg)
    with pytest.raises(ConfigError, match="block_len=3 must divide gen_len=8"):
        generate_vanilla(model, np.ones((1, 2)), gen_len=8, steps=8, block_len=3)
    with pytest.raises(ConfigError, match="exceeds max_seq_len=16"):
        generate_vanilla(model, np.ones((1, 12)), gen_len=8, steps=8, block_len=4)

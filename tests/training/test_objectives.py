"""Training objectives: masks, weighting and the auto-balanced loss, checked against direct
NumPy recomputations and the papers' definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.testing import tiny_config
from training.objectives import (EPS, autoregressive, get_objective, introspective, masked_diffusion,
                                 two_stream_mask)

V, MASK = 16, 15


class FixedLogits:
    """A stand-in model with hand-set logits that records its inputs."""

    def __init__(self, logits, **config):
        self.logits = jnp.asarray(logits, jnp.float32)
        self.config = tiny_config(vocab_size=V, mask_token_id=MASK, eos_token_id=None, **config)
        self.calls = []

    def __call__(self, tokens, **kw):
        self.calls.append((np.asarray(tokens), kw))
        b, t = tokens.shape
        return type("Out", (), {"logits": jnp.broadcast_to(self.logits[: t], (b, t, V))})


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def test_masked_diffusion_matches_llada_sft_loss():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 14, (3, 10)).astype(np.int32)
    prompt = np.zeros((3, 10), bool)
    prompt[:, :4] = True
    prompt[2, :7] = True
    model = FixedLogits(rng.normal(size=(10, V)) * 2)
    key = jax.random.key(7)
    loss, _ = masked_diffusion(model, {"tokens": jnp.asarray(tokens), "prompt_mask": jnp.asarray(prompt)}, key)
    # Recompute with the same draws: t per row, mask w.p. t on response tokens only.
    k_t, k_m = jax.random.split(key)
    t = np.asarray(jax.random.uniform(k_t, (3, 1), minval=EPS, maxval=1.0))
    masked = (np.asarray(jax.random.uniform(k_m, (3, 10))) < t) & ~prompt
    noisy = model.calls[0][0]
    assert (noisy[masked] == MASK).all() and (noisy[~masked] == tokens[~masked]).all()
    assert not (noisy[prompt] == MASK).any()
    logp = _log_softmax(model.logits)
    ce = -logp[np.arange(10)[None], tokens]
    ref = np.sum(ce * masked / t / (~prompt).sum(1, keepdims=True)) / 3
    assert float(loss) == pytest.approx(ref, rel=1e-5)


def test_two_stream_masks_follow_the_papers():
    t, b = 6, 2  # blocks {0,1} {2,3} {4,5}
    m = two_stream_mask(t, b, noisy_causal=True, clean_causal=True)  # I-DLM (Appendix E)
    noisy_self, noisy_clean, clean_noisy, clean_self = m[:t, :t], m[:t, t:], m[t:, :t], m[t:, t:]
    assert noisy_self[3, 2] and not noisy_self[2, 3] and not noisy_self[2, 1]  # causal within a block
    assert noisy_clean[2, 1] and not noisy_clean[2, 2] and not noisy_clean[3, 3]  # clean of earlier blocks
    assert not clean_noisy.any()
    np.testing.assert_array_equal(clean_self, np.tril(np.ones((t, t), bool)))
    bd = two_stream_mask(t, b, noisy_causal=False, clean_causal=False)  # BD3-LM / SDAR
    assert bd[2, 3] and bd[3, 2] and not bd[2, 4]  # bidirectional within a block only
    assert bd[t + 2, t + 3] and not bd[t + 1, t + 2]  # clean half block-causal


def test_introspective_auto_balance_and_shift():
    """loss = L_noisy + sg(L_noisy / L_clean) * L_clean: the value is 2 L_noisy and the
    gradient is grad L_noisy + (L_noisy / L_clean) grad L_clean."""
    cfg = tiny_config(vocab_size=V, mask_token_id=MASK, eos_token_id=None, n_layers=1, attention="causal",
                      logit_shift=True, block_size=4)
    model = dlm_jax.init_model(cfg, seed=1)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 14, (2, 8)), jnp.int32)
    batch = {"tokens": tokens, "prompt_mask": jnp.arange(8)[None, :].repeat(2, 0) < 3}
    from flax import nnx

    graphdef, state = nnx.split(model)

    def parts(s):
        _, m = introspective(nnx.merge(graphdef, s), batch, jax.random.key(0))
        return m["loss"], (m["noisy_ce"], m["clean_ce"])

    (loss, (n, c)), g = jax.value_and_grad(parts, has_aux=True)(state)
    assert float(loss) == pytest.approx(2 * float(n), rel=1e-6)
    g_n = jax.grad(lambda s: parts(s)[1][0])(state)
    g_c = jax.grad(lambda s: parts(s)[1][1])(state)
    ratio = float(n) / float(c)
    for a, bn, bc in zip(jax.tree.leaves(g), jax.tree.leaves(g_n), jax.tree.leaves(g_c)):
        np.testing.assert_allclose(a, bn + ratio * bc, rtol=1e-4, atol=1e-6)


def test_autoregressive_is_next_token_cross_entropy():
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 14, (2, 6)).astype(np.int32)
    model = FixedLogits(rng.normal(size=(6, V)), attention="causal", logit_shift=True)
    prompt = np.zeros((2, 6), bool)
    prompt[:, :2] = True
    loss, _ = autoregressive(model, {"tokens": jnp.asarray(tokens), "prompt_mask": jnp.asarray(prompt)}, None)
    logp = _log_softmax(model.logits)
    ce = -logp[np.arange(5)[None], tokens[:, 1:]]
    assert float(loss) == pytest.approx(ce[:, 1:].mean(), rel=1e-5)  # targets 2..5 are response


def test_objective_checks_the_model():
    cfg = tiny_config(vocab_size=V, mask_token_id=MASK, eos_token_id=None)
    with pytest.raises(ConfigError, match="objective 'introspective' needs model attention='causal'"):
        get_objective("introspective", cfg)
    with pytest.raises(ConfigError, match="unknown objective 'gan'"):
        get_objective("gan", cfg)

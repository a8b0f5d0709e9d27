"""Training objectives: masks, weighting and the auto-balanced loss, checked against direct
NumPy recomputations and the papers' definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.testing import tiny_config
from dlm_jax.training.objectives import (EPS, autoregressive, get_objective, introspective, masked_diffusion,
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

    @jax.jit  # one program: op by op, the three gradients took 7 s of compiles
    def grads(s):
        return (jax.value_and_grad(parts, has_aux=True)(s), jax.grad(lambda s: parts(s)[1][0])(s),
                jax.grad(lambda s: parts(s)[1][1])(s))

    ((loss, (n, c)), g), g_n, g_c = grads(state)
    assert float(loss) == pytest.approx(2 * float(n), rel=1e-6)
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


def _md_batch(seed=3, rows=4, length=24, prompt_len=6):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 14, (rows, length)).astype(np.int32)
    tokens[:, -5:] = 14  # an EOS-like fill: a special id of this toy vocabulary
    prompt = np.zeros((rows, length), bool)
    prompt[:, :prompt_len] = True
    return {"tokens": jnp.asarray(tokens), "prompt_mask": jnp.asarray(prompt)}


def test_clean_term_off_is_exactly_the_llada_loss():
    rng = np.random.default_rng(4)
    batch, key = _md_batch(), jax.random.key(11)
    old = FixedLogits(rng.normal(size=(24, V)))
    new = FixedLogits(np.asarray(old.logits))
    loss0, m0 = masked_diffusion(old, batch, key)
    loss1, m1 = get_objective("masked_diffusion", new.config, clean_loss_weight=0.0, corrupt_prob=0.2)(
        new, batch, key)
    assert float(loss0) == float(loss1) and set(m1) == {"loss", "masked_acc"}
    np.testing.assert_array_equal(old.calls[0][0], new.calls[0][0])  # same inputs: nothing corrupted


def test_clean_term_corrupts_only_visible_response_tokens():
    batch, key = _md_batch(rows=16, length=64), jax.random.key(5)
    tokens, prompt = np.asarray(batch["tokens"]), np.asarray(batch["prompt_mask"])
    model = FixedLogits(np.zeros((64, V)))
    regular = 14  # ids 14 (EOS fill) and 15 (mask) are specials here
    loss, m = masked_diffusion(model, batch, key, clean_loss_weight=0.5, corrupt_prob=0.3, regular_vocab=regular)
    noisy = model.calls[0][0]
    masked = noisy == MASK
    changed = (noisy != tokens) & ~masked
    assert not (masked & prompt).any() and not (changed & prompt).any()  # the prompt is never touched
    assert changed.sum() > 20  # ~30% of the visible response tokens
    assert (noisy[changed] < regular).all()  # random regular ids: never the mask id or a special
    assert (noisy[changed] != tokens[changed]).all()  # a corrupted position never holds its true token
    visible = ~prompt & ~masked
    assert 0.15 < changed.sum() / visible.sum() < 0.45
    # Uniform logits: every CE is log V, so clean_ce = log V and loss = md_loss + 0.5 log V.
    assert float(m["clean_ce"]) == pytest.approx(np.log(V), rel=1e-5)
    assert float(loss) == pytest.approx(float(m["md_loss"]) + 0.5 * np.log(V), rel=1e-5)
    assert {"clean_acc", "corrupt_acc", "md_loss", "clean_ce"} <= set(m)


def test_clean_term_weights_visible_cross_entropy():
    """With a weight > 0 the loss is md_loss + w * mean CE(true token) over visible response
    positions (corrupted ones included), and the accuracies split corrupted from intact."""
    rng = np.random.default_rng(6)
    batch, key = _md_batch(rows=6, length=32), jax.random.key(9)
    tokens, prompt = np.asarray(batch["tokens"]), np.asarray(batch["prompt_mask"])
    model = FixedLogits(rng.normal(size=(32, V)) * 3)
    loss, m = masked_diffusion(model, batch, key, clean_loss_weight=2.0, corrupt_prob=0.25, regular_vocab=14)
    noisy = model.calls[0][0]
    visible = ~prompt & (noisy != MASK)
    corrupted = visible & (noisy != tokens)
    logp = _log_softmax(model.logits)
    ce = -logp[np.arange(32)[None], tokens]
    assert float(m["clean_ce"]) == pytest.approx(ce[visible].mean(), rel=1e-5)
    assert float(loss) == pytest.approx(float(m["md_loss"]) + 2.0 * ce[visible].mean(), rel=1e-5)
    hit = np.asarray(model.logits).argmax(-1)[None] == tokens
    assert float(m["corrupt_acc"]) == pytest.approx(hit[corrupted].mean(), abs=1e-6)
    assert float(m["clean_acc"]) == pytest.approx(hit[visible & ~corrupted].mean(), abs=1e-6)


def test_clean_term_options_are_checked():
    cfg = tiny_config(vocab_size=V, mask_token_id=MASK, eos_token_id=None)
    with pytest.raises(ConfigError, match="corrupt_prob in"):
        get_objective("masked_diffusion", cfg, clean_loss_weight=1.0, corrupt_prob=0.0)
    causal = tiny_config(vocab_size=V, mask_token_id=MASK, eos_token_id=None, attention="causal", logit_shift=True)
    with pytest.raises(ConfigError, match="has no option"):
        get_objective("autoregressive", causal, clean_loss_weight=1.0, corrupt_prob=0.1)
    assert get_objective("autoregressive", causal, clean_loss_weight=0.0, corrupt_prob=0.0) is autoregressive


def test_clean_term_is_a_train_key_of_masked_diffusion_only():
    from dlm_jax.training.config import RunConfig

    model = {"vocab_size": 264, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64,
             "max_seq_len": 64, "mask_token_id": 259, "eos_token_id": 258}
    train = {"steps": 10, "batch_size": 2, "seq_len": 64, "warmup_steps": 1, "clean_loss_weight": 0.5,
             "corrupt_prob": 0.15}
    run = RunConfig.from_dict({"model": {**model, "attention": "bidirectional"},
                               "train": {**train, "objective": "masked_diffusion"}, "data": {"tasks": {"addition": 1}}})
    assert run.train.objective_options() == {"clean_loss_weight": 0.5, "corrupt_prob": 0.15}
    with pytest.raises(ConfigError, match=r"\[train\] objective 'autoregressive' has no option"):
        RunConfig.from_dict({"model": {**model, "attention": "causal", "logit_shift": True},
                             "train": {**train, "objective": "autoregressive"}, "data": {"tasks": {"addition": 1}}})
    with pytest.raises(ConfigError, match="corrupt_prob=1.0 in"):
        RunConfig.from_dict({"model": {**model, "attention": "bidirectional"},
                             "train": {**train, "objective": "masked_diffusion", "corrupt_prob": 1.0},
                             "data": {"tasks": {"addition": 1}}})

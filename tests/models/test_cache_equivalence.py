"""The decode-step contract: a window forwarded over an external K/V cache equals the
full-sequence forward on the same mask, for every attention mode and FFN kind.

Guards against the silent failure where a cached decode drifts from the model (wrong RoPE
positions in the cache, a mask offset by the cache length, GQA heads paired wrongly): the
tokens still look plausible and nothing errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlm_jax import padded_mask, visibility_from_positions
from dlm_jax.testing import tiny_model

MODES = ["bidirectional", "block_causal", "causal"]
FFNS = {
    "swiglu": {},
    "relu": {"ffn": "relu"},
    "moe_softmax": {"ffn": "moe", "n_experts": 4, "n_experts_per_tok": 2, "moe_ffn_hidden": 16,
                    "dense_layers": (0,)},
    "moe_sigmoid": {"ffn": "moe", "n_experts": 4, "n_experts_per_tok": 2, "moe_ffn_hidden": 16,
                    "n_shared_experts": 1, "router": "sigmoid", "router_bias": True,
                    "n_expert_groups": 2, "topk_groups": 1, "routed_scaling": 2.0},
}
T, BLOCK = 12, 4


def _model(attention: str, ffn: str, **extra):
    return tiny_model(seed=3, attention=attention, block_size=BLOCK, qk_norm=True, **{**FFNS[ffn], **extra})


@functools.partial(jax.jit, static_argnums=0)
def _jitted(graphdef, state, tokens, **arrays):
    return nnx.merge(graphdef, state)(tokens, **arrays)


def _forward(model, tokens, **arrays):
    """`model(tokens, **arrays)` as one jitted program (the executor's form): op by op, every
    primitive of every new shape compiles alone, the bulk of this file's time."""
    return _jitted(*nnx.split(model), tokens, **arrays)


def _tokens(b=2, t=T, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 40, (b, t)), jnp.int32)


def _window_over_cache(model, tokens, full, window, cached, mode):
    b = tokens.shape[0]
    q_pos = np.broadcast_to(window, (b, len(window)))
    k_pos = np.broadcast_to(np.concatenate([cached, window]), (b, len(cached) + len(window)))
    mask = visibility_from_positions(mode, q_pos, k_pos, block_size=BLOCK)
    return _forward(model, tokens[:, window], positions=jnp.asarray(q_pos), mask=jnp.asarray(mask),
                    k_cache=full.k[:, :, cached], v_cache=full.v[:, :, cached])


@pytest.mark.parametrize("mode, ffn", [
    pytest.param(mode, ffn,
                 marks=[pytest.mark.slow] if ffn in ("moe_softmax", "relu") or ffn.startswith("moe") and mode != "causal"
                 else [])
    for mode in MODES for ffn in FFNS])  # MoE: slow (3-8 s each) but causal moe_sigmoid, which covers MoE here
# (relu: slow; a dense FFN acts on each row alone whatever its activation, as swiglu's does by default)
# (softmax routing's forward is checked in the default pass against transformers: qwen3_moe, tests/checkpoint/test_parity.py)
def test_window_over_cache_equals_full_forward(mode, ffn):
    model = _model(mode, ffn)
    tokens = _tokens()
    full = _forward(model, tokens)
    # Prefix cache (Fast-dLLM prefix mode): cache 0..3, the window is everything after it.
    prefix, rest = np.arange(0, 4), np.arange(4, T)
    out = _window_over_cache(model, tokens, full, rest, prefix, mode)
    np.testing.assert_allclose(out.logits, full.logits[:, rest], atol=2e-5, rtol=0)
    np.testing.assert_allclose(out.k, full.k[:, :, rest], atol=2e-5, rtol=0)
    # Dual cache: prefix and suffix cached, only the middle block recomputed.
    window, cached = np.arange(4, 8), np.array([0, 1, 2, 3, 8, 9, 10, 11])
    out = _window_over_cache(model, tokens, full, window, cached, mode)
    np.testing.assert_allclose(out.logits, full.logits[:, window], atol=2e-5, rtol=0)
    np.testing.assert_allclose(out.v, full.v[:, :, window], atol=2e-5, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_prefix_kv_depends_on_later_tokens_only_when_bidirectional(mode):
    model = _model(mode, "swiglu")
    tokens = _tokens()
    full_k = _forward(model, tokens).k[:, :, :BLOCK]
    prefix_k = _forward(model, tokens[:, :BLOCK]).k
    same = np.allclose(prefix_k, full_k, atol=1e-5)
    assert same == (mode != "bidirectional")


@pytest.mark.parametrize("mode", MODES)
def test_logit_rows_select_rows(mode):
    # (an MoE model in one mode: the rows a step returns are picked after its experts; the
    # others a dense FFN, whose programs compile in a fraction of the time)
    model = _model(mode, "moe_sigmoid" if mode == "causal" else "swiglu")
    tokens = _tokens()
    rows = jnp.asarray([[5, 0, 11], [2, 2, 7]], jnp.int32)
    full = _forward(model, tokens).logits
    picked = _forward(model, tokens, logit_rows=rows).logits
    np.testing.assert_allclose(picked, np.take_along_axis(np.asarray(full), np.asarray(rows)[..., None], 1),
                               atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_left_padding_matches_unpadded_row(mode):
    model = _model(mode, "swiglu")
    short = _tokens(1, 7, seed=1)
    pad = 5
    padded = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), short], axis=1)
    valid = np.array([[False] * pad + [True] * 7])
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    mask = padded_mask(mode, valid, block_size=BLOCK)
    out = _forward(model, padded, positions=jnp.asarray(positions, jnp.int32), mask=jnp.asarray(mask)).logits
    np.testing.assert_allclose(out[:, pad:], _forward(model, short).logits, atol=2e-5, rtol=0)


def test_masks_follow_their_rules():
    from dlm_jax import attention_mask

    assert attention_mask("bidirectional", 4).all()
    np.testing.assert_array_equal(attention_mask("causal", 4), np.tril(np.ones((4, 4), bool)))
    bc = attention_mask("block_causal", 6, block_size=2)
    assert bc[1, 0] and bc[0, 1] and bc[2, 1] and not bc[1, 2] and bc[5, 0]


@pytest.mark.parametrize("ffn", ["swiglu", "moe_sigmoid"])
def test_bfloat16_compute_tracks_float32(ffn):
    """bf16 activations (fp32 softmax, norms and RoPE) stay close to the fp32 forward."""
    import dlm_jax

    model = _model("bidirectional", ffn)
    cfg16 = model.config.replace(dtype="bfloat16", param_dtype="bfloat16")
    model16 = dlm_jax.model_from_params(cfg16, dlm_jax.get_params(model))
    tokens = _tokens()
    ref = np.asarray(_forward(model, tokens).logits)
    out = _forward(model16, tokens)
    assert out.logits.dtype == jnp.float32 and out.k.dtype == jnp.bfloat16
    assert np.abs(np.asarray(out.logits) - ref).max() < 0.05 * np.abs(ref).max()

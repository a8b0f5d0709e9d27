"""Gated LoRA adapters (R-ISD): clean rows keep the base model's bits, adapters stay out of the
base weights, and a model without adapters (or without a gate) traces the base computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.techniques.isd import LoraParam, LoraSpec, attach_lora, lora_params, lora_spec, mask_rows_gate, remove_lora, set_lora_params
from dlm_jax.testing import MASK, tiny_model


def _random_adapters(model, seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    set_lora_params(model, {k: (rng.normal(size=v.shape) * scale).astype(np.float32)
                            for k, v in lora_params(model).items()})
    return model


def _causal(**kw):
    return tiny_model(attention="causal", logit_shift=True, **kw)


def _tokens(b=2, t=12, masked_from=7, seed=1):
    tokens = np.random.default_rng(seed).integers(0, 60, (b, t)).astype(np.int32)
    tokens[:, masked_from:] = MASK
    return jnp.asarray(tokens)


def test_a_gate_of_zero_keeps_the_base_models_bits():
    """Silent failure guarded: a clean row (gate 0) whose logits or K/V drift from the base
    model's by a rounding error breaks R-ISD's bit-for-bit lossless guarantee with no error."""
    base = _causal(seed=3)
    model = _random_adapters(attach_lora(_causal(seed=3), LoraSpec(rank=4, alpha=8), seed=1))
    tokens = _tokens()
    gate = mask_rows_gate(tokens, MASK)
    ref, out = base(tokens), model(tokens, lora_gate=gate)
    clean = ~np.asarray(tokens == MASK)  # [B, T]
    np.testing.assert_array_equal(np.asarray(ref.logits)[clean], np.asarray(out.logits)[clean])
    np.testing.assert_array_equal(np.asarray(ref.k)[:, clean], np.asarray(out.k)[:, clean])
    np.testing.assert_array_equal(np.asarray(ref.v)[:, clean], np.asarray(out.v)[:, clean])
    assert np.abs(np.asarray(ref.logits)[~clean] - np.asarray(out.logits)[~clean]).max() > 1e-3  # mask rows adapted
    # No gate, or adapters with a gate of zero everywhere: the base model's outputs, bit for bit.
    np.testing.assert_array_equal(ref.logits, model(tokens).logits)
    np.testing.assert_array_equal(ref.logits, model(tokens, lora_gate=jnp.zeros(tokens.shape)).logits)


@pytest.mark.slow  # about 10 s cold; the gated ISD decode test covers exactness in the default pass
def test_a_decode_window_with_a_base_cache_keeps_clean_rows_exact():
    """An ISD-style step: a base-model prefix cache, then a window [clean rows, mask rows] with
    an explicit strict-causal visibility; the clean rows' logits and K/V are the base's bits."""
    base = _causal(seed=5)
    model = _random_adapters(attach_lora(_causal(seed=5), LoraSpec(rank=2, alpha=4, targets=("q_proj", "o_proj",
                                                                                                  "up_proj"))))
    prompt = _tokens(t=6, masked_from=6, seed=2)
    cache = base(prompt)
    window = _tokens(t=5, masked_from=3, seed=4)  # pending, spec, spec, M, M
    positions = jnp.broadcast_to(jnp.arange(6, 11, dtype=jnp.int32), (2, 5))
    vis = jnp.asarray(np.concatenate([np.ones((5, 6), bool), np.tril(np.ones((5, 5), bool))], 1))[None].repeat(2, 0)
    kw = dict(positions=positions, mask=vis, k_cache=cache.k, v_cache=cache.v)
    ref = base(window, **kw)
    out = model(window, lora_gate=mask_rows_gate(window, MASK), **kw)
    np.testing.assert_array_equal(np.asarray(ref.logits)[:, :3], np.asarray(out.logits)[:, :3])
    np.testing.assert_array_equal(np.asarray(ref.k)[:, :, :3], np.asarray(out.k)[:, :, :3])
    assert not np.array_equal(np.asarray(ref.logits)[:, 3:], np.asarray(out.logits)[:, 3:])


def test_within_one_compiled_program_a_rows_gate_is_all_that_matters():
    """Under jit the bit-for-bit guarantee is per program: the same compiled step with the
    mask-row gate and with an all-zero gate (the base) gives clean rows the same bits."""
    model = _random_adapters(attach_lora(_causal(seed=6), LoraSpec(rank=4, alpha=8)))
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, t, g: nnx.merge(graphdef, s)(t, lora_gate=g).logits)
    tokens = _tokens(b=3, t=16, masked_from=9)
    gate = mask_rows_gate(tokens, MASK)
    gated, base = np.asarray(step(state, tokens, gate)), np.asarray(step(state, tokens, jnp.zeros_like(gate)))
    clean = ~np.asarray(tokens == MASK)
    np.testing.assert_array_equal(gated[clean], base[clean])
    assert not np.array_equal(gated[~clean], base[~clean])
    np.testing.assert_allclose(base, _causal(seed=6)(tokens).logits, rtol=1e-5, atol=1e-5)  # another program


def _ops(fn, *args) -> list[tuple[str, tuple[str, ...]]]:
    """The traced program as (primitive, output types) per equation (names of variables aside)."""
    return [(e.primitive.name, tuple(str(v.aval) for v in e.outvars)) for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]


def test_without_adapters_or_gate_the_traced_computation_is_the_base_models():
    tokens, gate = _tokens(), jnp.ones((2, 12), jnp.float32)
    base = _causal()
    g, params = nnx.split(base, nnx.Param)
    plain = _ops(lambda p, t: nnx.merge(g, p)(t).logits, params, tokens)
    # A gate without adapters is ignored: the same ops.
    assert _ops(lambda p, t, m: nnx.merge(g, p)(t, lora_gate=m).logits, params, tokens, gate) == plain
    adapted = attach_lora(_causal(), LoraSpec())
    g2, adapters, params2 = nnx.split(adapted, LoraParam, ...)
    assert _ops(lambda p, t: nnx.merge(g2, adapters, p)(t).logits, params2, tokens) == plain
    gated = _ops(lambda p, t, m: nnx.merge(g2, adapters, p)(t, lora_gate=m).logits, params2, tokens, gate)
    dots = lambda ops: sum(name == "dot_general" for name, _ in ops)  # noqa: E731
    assert dots(gated) == dots(plain) + 2 * 7 * 2  # two products per adapter, 7 adapters per layer


def test_adapters_stay_out_of_the_base_parameters(tmp_path):
    model = _causal(seed=2)
    base = dlm_jax.get_params(model)
    attach_lora(model, LoraSpec(rank=3, alpha=6, targets=("k_proj", "gate_proj")), seed=4)
    assert dlm_jax.get_params(model).keys() == base.keys()
    names = sorted(lora_params(model))
    assert names == sorted(f"layers.{i}.{o}.lora.{p}.lora_{ab}" for i in range(2)
                           for o, p in (("attn", "k_proj"), ("ffn", "gate_proj")) for ab in "ab")
    assert lora_params(model)["layers.0.attn.lora.k_proj.lora_a"].shape == (32, 3)  # [in, r]
    assert lora_params(model)["layers.0.attn.lora.k_proj.lora_b"].shape == (3, 16)  # [r, out], zero at first
    assert not lora_params(model)["layers.0.attn.lora.k_proj.lora_b"].any()
    assert lora_spec(model) == LoraSpec(rank=3, alpha=6, targets=("k_proj", "gate_proj"))
    _random_adapters(model)
    dlm_jax.save_pretrained(model, tmp_path / "m")  # the base weights only
    loaded = dlm_jax.load_pretrained(tmp_path / "m")
    assert lora_spec(loaded) is None
    for name, value in dlm_jax.get_params(loaded).items():
        np.testing.assert_array_equal(value, base[name])
    tokens = _tokens()
    np.testing.assert_array_equal(remove_lora(model)(tokens, lora_gate=mask_rows_gate(tokens, MASK)).logits,
                                  loaded(tokens).logits)


def test_fresh_adapters_change_nothing_and_the_program_flattens_them():
    from dlm_jax.executors.jax_executor import _is_kernel

    model = attach_lora(_causal(), LoraSpec(), seed=0)
    tokens = _tokens()
    np.testing.assert_array_equal(model(tokens, lora_gate=jnp.ones((2, 12))).logits, _causal()(tokens).logits)
    leaves, _ = jax.tree_util.tree_flatten_with_path(nnx.split(model)[1])
    lora = [(p, x) for p, x in leaves if any(getattr(k, "key", None) == "lora" for k in p)]
    assert len(lora) == 2 * 7 * 2 and not any(_is_kernel(p, x) for p, x in lora)
    assert sum(_is_kernel(p, x) for p, x in leaves) == 2 * 7 + 1  # the base kernels and the head, as before


def test_bad_specs_and_weights_are_named():
    with pytest.raises(ConfigError, match=r"self.rank=0"):
        LoraSpec(rank=0)
    with pytest.raises(ConfigError, match=r"unknown: \['w_proj'\]"):
        LoraSpec(targets=("q_proj", "w_proj"))
    with pytest.raises(ConfigError, match="alpha"):
        LoraSpec(alpha=-1.0)
    model = attach_lora(_causal(), LoraSpec(rank=2, targets=("v_proj",)))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        attach_lora(model, LoraSpec())
    params = lora_params(model)
    with pytest.raises(KeyError, match="missing"):
        set_lora_params(model, dict(list(params.items())[1:]))
    with pytest.raises(ValueError, match=r"has shape \(3, 3\)"):
        set_lora_params(model, {**params, next(iter(params)): np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match="lora_gate has shape"):
        model(_tokens(), lora_gate=jnp.ones((2, 5)))

"""The gated ReLU FFN (`reglu`) and the `ffn_active` step output: the FFN computes
down(relu(gate x) * up x), its neurons are exactly zero where the gate is not positive, and a
step asked for `ffn_active` returns which neurons each row activates, bit-packed, the same from
the JAX executor and from a `.tflite` LiteRT runs."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlm_jax._errors import ConfigError
from dlm_jax.executors.jax_executor import JaxExecutor, pack_bits
from dlm_jax.runtime import BucketKey
from dlm_jax.runtime.step import Capabilities, OutputRequest, output_specs, signature_name
from dlm_jax.testing import tiny_model
from tests.tflite_export.test_exportable import random_inputs
from dlm_jax.tflite_export import convert_signatures, decode_signature

from ai_edge_litert.interpreter import Interpreter  # noqa: E402

SPARSE = dict(ffn="reglu", ffn_hidden=72)  # 72 neurons: the last word holds 8 of them


def _unpack(packed: np.ndarray, n: int) -> np.ndarray:
    """The reference: little-endian bit order over the words' bytes (numpy's packbits)."""
    bits = np.unpackbits(np.ascontiguousarray(packed.astype("<i4")).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :n].astype(bool)


def _ffn_reference(block, x):
    p = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(block.ffn, nnx.Param))}
    gate = x @ p[("gate_proj", "kernel")]
    act = np.maximum(gate, 0.0)
    return (act * (x @ p[("up_proj", "kernel")])) @ p[("down_proj", "kernel")], act


def test_reglu_ffn_is_gated_relu_and_reports_its_activations():
    model = tiny_model(seed=1, **SPARSE)
    x = np.random.default_rng(0).standard_normal((3, 5, model.config.d_model)).astype(np.float32)
    out, act = model.layers[0].ffn(jnp.asarray(x))
    want, want_act = _ffn_reference(model.layers[0], x)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(act), want_act, rtol=1e-6, atol=1e-6)
    assert 0.2 < (np.asarray(act) > 0).mean() < 0.8  # a random ReLU gate: about half the neurons


def test_model_returns_activations_only_for_relu_family_ffns():
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 60, (2, 9)), jnp.int32)
    out = tiny_model(seed=2, **SPARSE)(tokens, ffn_act=True)
    assert out.ffn_act.shape == (2, 2, 9, 72) and float(out.ffn_act.min()) == 0.0
    assert tiny_model(seed=2)(tokens, ffn_act=True).ffn_act is None  # swiglu: no exact zeros
    relu = tiny_model(seed=2, ffn="relu")(tokens, ffn_act=True).ffn_act
    assert relu.shape == (2, 2, 9, 64)


@pytest.mark.parametrize("f", [1, 31, 32, 33, 72, 96])
def test_pack_bits_is_little_endian_words(f):
    active = np.random.default_rng(f).random((3, 2, f)) < 0.5
    active[..., -1] = True  # the last neuron (bit 31 of a full word when f % 32 == 0)
    packed = np.asarray(pack_bits(jnp.asarray(active)))
    assert packed.dtype == np.int32 and packed.shape == (3, 2, -(-f // 32))
    np.testing.assert_array_equal(_unpack(packed, f), active)
    if f % 32 == 0:
        assert (packed[..., -1] < 0).all()  # bit 31 is the sign bit


def test_step_returns_the_activity_of_every_layer_and_row():
    model = tiny_model(seed=3, **SPARSE)
    key = BucketKey(1, 8, 8, 8, ffn_active=True)
    assert signature_name(key) == "step_w8_p8_r8_act"
    assert dict((n, s) for n, s, _ in output_specs(model.config, key))["ffn_active"] == (2, 1, 8, 3)
    inputs = dataclasses.replace(random_inputs(model.config, key, seed=4), want=OutputRequest(ffn_active=True))
    exe = JaxExecutor(model)
    assert "ffn_active" in exe.capabilities.outputs
    got = exe.step(inputs)
    out = model(jnp.asarray(inputs.tokens), positions=jnp.asarray(inputs.positions),
                mask=jnp.asarray(inputs.visibility), k_cache=jnp.asarray(inputs.k_cache),
                v_cache=jnp.asarray(inputs.v_cache), ffn_act=True)
    np.testing.assert_array_equal(_unpack(got.ffn_active, 72), np.asarray(out.ffn_act) > 0)
    plain = exe.step(random_inputs(model.config, BucketKey(1, 8, 8, 8), seed=4))
    assert plain.ffn_active is None
    np.testing.assert_array_equal(plain.top_token, got.top_token)


def test_a_model_without_a_relu_ffn_refuses_the_activity():
    caps = JaxExecutor(tiny_model(seed=0)).capabilities
    assert "ffn_active" not in caps.outputs
    with pytest.raises(ConfigError, match="ReLU-family"):
        caps.select(batch=1, window=8, cache=8, rows=8, ffn_active=True)


def test_fixed_bucket_sets_serve_narrow_steps_from_activity_buckets():
    caps = Capabilities.from_keys([BucketKey(1, 8, 8, 8, ffn_active=True), BucketKey(1, 16, 8, 8)])
    assert "ffn_active" in caps.outputs
    assert caps.select(batch=1, window=8, cache=8, rows=8, ffn_active=True).ffn_active
    assert caps.select(batch=1, window=8, cache=8, rows=8) == BucketKey(1, 8, 8, 8, ffn_active=True)
    with pytest.raises(ConfigError):
        caps.select(batch=1, window=16, cache=8, rows=8, ffn_active=True)


def test_activity_signature_exports_and_litert_equals_jax():
    model = tiny_model(seed=5, **SPARSE)
    key = BucketKey(1, 8, 8, 8, ffn_active=True)
    graphdef, state = nnx.split(model)
    content = convert_signatures([decode_signature(graphdef, state, model.config, key)])
    inputs = random_inputs(model.config, key, seed=6)
    runner = Interpreter(model_content=content).get_signature_runner(signature_name(key))
    got = runner(**{n: getattr(inputs, n) for n in runner.get_input_details()})
    want = JaxExecutor(model).step(dataclasses.replace(inputs, want=OutputRequest(ffn_active=True)))
    np.testing.assert_array_equal(got["ffn_active"], want.ffn_active)
    np.testing.assert_array_equal(got["top_token"], want.top_token)

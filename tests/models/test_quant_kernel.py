"""The grouped quantized GEMM in Pallas (`dlm_jax.models._quant_kernel`), run in Pallas's
interpreter on the CPU: the product of NumPy's dequantised weights, the shapes it takes, and the
models' grouped products routed to it only where `$DLM_JAX_QUANT_KERNEL=pallas` asks on a GPU
(or the interpreter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax
from dlm_jax.models import _attention_kernel, _quant_kernel
from dlm_jax.models._quant_kernel import QUANT_KERNEL_ENV, fits, grouped_matmul
from dlm_jax.models.quant import quantize, quantize_kernel
from dlm_jax.testing import tiny_model


def numpy_product(x, q, scale, zero=None) -> np.ndarray:
    """x @ ((q - zero[g]) * scale[g]) in float64, each row i in group i // (I / G)."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    g = q.shape[0] // scale.shape[0]
    per_row = lambda a: np.repeat(np.asarray(a, np.float64), g, axis=0)  # noqa: E731
    w = (q - (per_row(zero) if zero is not None else 0.0)) * per_row(scale)
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ w


@pytest.mark.parametrize("mode, dtype, m, rows, cols", [
    ("int8-g16", jnp.float32, 5, 64, 48),  # (rows padded to a block of 16; 16-wide column blocks)
    ("int8-g32", jnp.float32, 70, 128, 32),  # (two blocks of 64 rows, the second padded)
    ("fp8-g32", jnp.float32, 3, 96, 64),
    ("int8-g16", jnp.bfloat16, 40, 64, 256)])  # (two blocks of 128 columns)
def test_kernel_is_the_product_of_the_dequantised_weights(mode, dtype, m, rows, cols):
    w = jax.random.normal(jax.random.key(0), (rows, cols))
    q, scale, _ = quantize_kernel(w, mode=mode)
    x = jax.random.normal(jax.random.key(1), (m, rows)).astype(dtype)
    with _attention_kernel.interpret():
        got = grouped_matmul(x, q, scale)
    assert got.shape == (m, cols) and got.dtype == jnp.float32
    want = numpy_product(x, q, scale)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2  # (bfloat16: the dequantised weights are rounded to it)
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * np.abs(want).max())


def test_kernel_subtracts_zero_points_and_keeps_leading_axes():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.integers(-100, 100, (128, 32)), jnp.int8)
    zero = jnp.asarray(rng.integers(-8, 8, (4, 32)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (4, 32)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 3, 128)), jnp.float32)
    with _attention_kernel.interpret():
        got = grouped_matmul(x, q, scale, zero)
    assert got.shape == (2, 3, 32)
    want = numpy_product(x.reshape(6, 128), q, scale, zero).reshape(2, 3, 32)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_shapes_it_does_not_take_are_refused():
    q8, s = jnp.zeros((64, 32), jnp.int8), jnp.ones((4, 32), jnp.float32)
    assert fits(q8, s)
    assert not fits(q8, jnp.ones((8, 32), jnp.float32))  # groups of 8: under Triton's 16-wide products
    assert not fits(jnp.zeros((64, 40), jnp.int8), jnp.ones((4, 40), jnp.float32))  # 40 columns
    assert not fits(jnp.zeros((64, 32), jnp.int4), s)  # JAX's int4: no Triton load
    assert not fits(q8, jnp.ones((32,), jnp.float32))  # per channel: XLA converts those inside its GEMMs
    assert not fits(q8, s, g_idx=jnp.zeros((64,), jnp.int32))  # act-order maps
    with pytest.raises(ValueError, match="the grouped kernel takes int8 / float8 weights"):
        grouped_matmul(jnp.zeros((2, 64)), jnp.zeros((64, 40), jnp.int8), jnp.ones((4, 40)))


def test_a_bad_switch_is_refused_in_one_line(monkeypatch):
    from dlm_jax._errors import ConfigError

    monkeypatch.setenv(QUANT_KERNEL_ENV, "triton")
    with pytest.raises(ConfigError, match=r"^DLM_JAX_QUANT_KERNEL='triton': expected xla or pallas$"):
        _quant_kernel.enabled()


def test_a_model_s_grouped_products_take_the_kernel_only_where_asked(monkeypatch):
    """Guards the switch: `$DLM_JAX_QUANT_KERNEL=pallas` routes every grouped dense product of a
    model (q/k/v/o, the FFN, the head) to the kernel where the program is a GPU's (here Pallas's
    interpreter stands in), with the logits of XLA's form; a CPU program ignores it."""
    model = quantize(tiny_model(seed=3), "int8-g16")
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 60, (2, 9)), jnp.int32)
    want = np.asarray(model(tokens).logits)
    calls = []
    traced = _quant_kernel.grouped_matmul
    monkeypatch.setattr(_quant_kernel, "grouped_matmul", lambda *a: calls.append(a[1].shape) or traced(*a))
    monkeypatch.setenv(QUANT_KERNEL_ENV, "pallas")
    np.testing.assert_array_equal(np.asarray(model(tokens).logits), want)  # a CPU program: XLA's form
    assert calls == []
    with _attention_kernel.interpret():
        got = np.asarray(model(tokens).logits)
    cfg = model.config
    assert len(calls) == cfg.n_layers * 7 + 1  # q, k, v, o, gate, up, down a layer and the head
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.delenv(QUANT_KERNEL_ENV)
    calls.clear()
    with _attention_kernel.interpret():
        np.testing.assert_array_equal(np.asarray(model(tokens).logits), want)  # not asked: XLA's form
    assert calls == []


def test_load_with_the_kernel_decodes_as_without(monkeypatch):
    """The shipped model quantized to int8-g16 at load decodes the same tokens with its grouped
    products in the kernel (interpreted) as in XLA's form."""
    model = dlm_jax.load("models/llada-tiny", quant="int8-g16", executor="jax")
    cfg = dlm_jax.decode_config(gen_len=16, block_len=16)
    want = model.generate("564+894=", cfg).token_ids
    calls = []
    traced = _quant_kernel.grouped_matmul
    monkeypatch.setattr(_quant_kernel, "grouped_matmul", lambda *a: calls.append(a[1].shape) or traced(*a))
    monkeypatch.setenv(QUANT_KERNEL_ENV, "pallas")
    with _attention_kernel.interpret():
        again = dlm_jax.load("models/llada-tiny", quant="int8-g16", executor="jax")
        assert again.generate("564+894=", cfg).token_ids == want
    assert calls  # (traced in the executor's programs)

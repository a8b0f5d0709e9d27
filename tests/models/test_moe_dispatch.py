"""Sparse expert dispatch: each row runs its k experts only, with the dense form's result
(every expert on every row, unselected ones weighted zero), in the model, under grad, and in
a `.tflite` that LiteRT runs with the JAX executor's outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax.models import _transformer as tr
from dlm_jax.models._transformer import (Routing, dense_experts, dispatch_experts, expert_capacities,
                                         expert_shapes)
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime import BucketKey
from dlm_jax.testing import tiny_model
from tests.tflite_export.test_exportable import assert_parity, random_inputs, run_litert
from dlm_jax.tflite_export import convert_signatures, decode_signature, tflite_op_names

from ai_edge_litert.interpreter import Interpreter  # noqa: E402

E, K, D, F = 8, 2, 16, 12
MOE = dict(ffn="moe", n_experts=E, n_experts_per_tok=K, moe_ffn_hidden=F, n_shared_experts=1,
           router="sigmoid", router_bias=True, n_expert_groups=2, topk_groups=1, routed_scaling=2.0)


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for s in [(E, D, F), (E, D, F), (E, F, D)]]


def _routing(n, seed=0, skew=None, pool=E):
    """Random distinct top-k per row among experts 0..pool-1; `skew` sends every row to expert
    `skew` (the busiest possible expert: load N)."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(pool)[:K] for _ in range(n)])
    if skew is not None:
        idx[:, 0] = skew
        idx[:, 1] = np.where(idx[:, 1] == skew, (skew + 1) % E, idx[:, 1])
    return Routing(jnp.asarray(idx, jnp.int32), jnp.asarray(rng.random((n, K)), jnp.float32))


def test_buffer_shapes_grow_from_the_mean_load_to_every_row_and_expert():
    assert expert_capacities(32, 4, 32) == (4, 6, 9, 14, 21, 32)
    assert expert_capacities(3, 2, 8) == (1, 2, 3)
    assert expert_capacities(1, 4, 32) == (1,)
    shapes = expert_shapes(32, 4, 32)
    assert set(shapes) == {(8, 32), (16, 32), (32, 32), *((32, c) for c in (4, 6, 9, 14, 21))}
    assert [u * c for u, c in shapes] == sorted(u * c for u, c in shapes) and shapes[-1] == (32, 32)


@pytest.mark.parametrize("n,skew,pool", [(1, None, E), (7, None, E), (32, None, E), (32, 3, E), (40, 0, E),
                                         (32, None, 2), (32, 1, 3), (5, None, 4)])
def test_dispatch_equals_dense(n, skew, pool):
    """Light and heavy loads, one expert taking every row (the largest capacity), and steps
    that use only a few experts (the gathered-weights buffers)."""
    x = jnp.asarray(np.random.default_rng(n).standard_normal((n, D)), jnp.float32)
    routing, w = _routing(n, seed=n, skew=skew, pool=pool), _weights()
    np.testing.assert_allclose(jax.jit(dispatch_experts)(x, routing, *w),
                               dense_experts(x, routing, *w), rtol=1e-5, atol=1e-6)


def test_every_expert_used_reads_the_weights_in_place_and_skips_misses():
    """A step whose rows use every expert and send each one row to one expert (the branch of all
    E experts over all N rows, which reads the weights where they lie, without a gathered copy):
    the dense form's result, an assignment of -1 (split execution's misses) contributing nothing."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((32, D)), jnp.float32)
    routing, w = _routing(32, seed=3, skew=3), _weights()
    assert set(np.asarray(routing.experts).ravel()) == set(range(E))
    missed = Routing(routing.experts.at[::3, 1].set(-1), routing.weights)
    for r in (routing, missed):
        got = jax.jit(dispatch_experts)(x, r, *w)
        np.testing.assert_allclose(got, dense_experts(x, r, *w), rtol=1e-5, atol=1e-6)


def test_dispatch_by_sorting_equals_dense(monkeypatch):
    """Above `_SORT_FREE_MAX` assignments the expert order comes from a sort (training)."""
    monkeypatch.setattr(tr, "_SORT_FREE_MAX", 8)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((24, D)), jnp.float32)
    routing, w = _routing(24, seed=1), _weights()
    np.testing.assert_allclose(dispatch_experts(x, routing, *w), dense_experts(x, routing, *w),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # (training's; the forward's equality runs by default)
def test_gradients_equal_dense():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((10, D)), jnp.float32)
    routing, w = _routing(10, seed=2), _weights()

    def loss(fn, x, weights, *w):
        return (fn(x, Routing(routing.experts, weights), *w) ** 2).sum()

    got = jax.jit(jax.grad(lambda *a: loss(dispatch_experts, *a), argnums=(0, 1, 2, 3, 4)))(x, routing.weights, *w)
    want = jax.jit(jax.grad(lambda *a: loss(dense_experts, *a), argnums=(0, 1, 2, 3, 4)))(x, routing.weights, *w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)


def test_top_k_matches_lax_top_k_with_ties():
    x = jnp.asarray([[3.0, 1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    np.testing.assert_array_equal(tr._top_k(x, 3), jax.lax.top_k(x, 3)[1])


def _model_logits(model, tokens, experts):
    original = tr.MoEFFN.__call__
    try:
        tr.MoEFFN.__call__ = lambda self, x, gate=None: original(self, x, gate, experts=experts)
        # One jit (the executor's form): op by op, each expert and capacity branch compiles alone.
        return np.asarray(jax.jit(lambda t: model(t).logits)(tokens))
    finally:
        tr.MoEFFN.__call__ = original


def test_model_logits_equal_dense_experts():
    model = tiny_model(seed=4, **MOE)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 24)), jnp.int32)
    np.testing.assert_allclose(_model_logits(model, tokens, dispatch_experts),
                               _model_logits(model, tokens, dense_experts), rtol=1e-5, atol=1e-5)


def test_moe_step_exports_and_litert_equals_jax():
    """Builtin ops only (the capacity choice is a tree of IFs: TFLite has no CASE or SORT)."""
    model = tiny_model(seed=5, **MOE)
    params = {n: v * (30.0 if n.startswith("lm_head") else 1.0) for n, v in dlm_jax.get_params(model).items()}
    model = dlm_jax.model_from_params(model.config, params)
    key = BucketKey(batch=1, window=8, cache=8, rows=8)
    graphdef, state = nnx.split(model)
    content = convert_signatures([decode_signature(graphdef, state, model.config, key)])
    used = set().union(*tflite_op_names(content).values())
    assert "IF" in used and not {op for op in used if op.startswith(("CUSTOM", "STABLEHLO_", "BUILTIN_"))}, used
    inputs = random_inputs(model.config, key, seed=3)
    assert_parity(run_litert(Interpreter(model_content=content), key, inputs), JaxExecutor(model).step(inputs))

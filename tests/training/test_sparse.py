"""Training an activation-sparse model: the L1 penalty on the FFN neuron activations joins the
loss (so the gradient pushes gate pre-activations down) and is logged with the share of active
neurons; it is refused for an FFN without exact zeros."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dlm_jax
from dlm_jax import ConfigError

from .test_loop import MODEL, run_config, small_dataset

SPARSE = {**MODEL, "ffn": "reglu"}


def _step(rate, lr=0.0):
    """One train step of a random sparse model on a fixed batch: (new params, metrics)."""
    from dlm_jax.training.loop import train_step
    from dlm_jax.training.objectives import get_objective

    run = run_config(SPARSE, steps=4, warmup_steps=1, activation_l1=rate)
    graphdef, params = nnx.split(dlm_jax.init_model(run.model, seed=0))
    tx = optax.sgd(lr)
    batch = {k: jax.numpy.asarray(v[:4]) for k, v in small_dataset().items()}
    new, _, metrics, finite = train_step(params, tx.init(params), batch, jax.random.key(0), graphdef=graphdef,
                                         objective=get_objective("masked_diffusion", run.model), tx=tx,
                                         activation_l1=rate)
    assert bool(finite)
    return graphdef, new, metrics


def _mean_activation(graphdef, params):
    tokens = jax.numpy.asarray(small_dataset()["tokens"][:4])
    return float(nnx.merge(graphdef, params)(tokens, ffn_act=True).ffn_act.mean())


@pytest.mark.slow  # about 10 s: the default suite keeps within its 5 minutes
def test_the_penalty_is_logged_and_its_gradient_lowers_the_activations():
    _, _, metrics = _step(0.5)
    _, _, plain = _step(0.0)
    assert 0.0 < float(metrics["activation_l1"]) < 1.0
    assert 0.2 < float(metrics["ffn_active"]) < 0.8  # a random ReLU gate: about half the neurons
    assert "activation_l1" not in plain and "ffn_active" not in plain
    np.testing.assert_allclose(float(metrics["loss"]), float(plain["loss"]), rtol=1e-6)  # same cross-entropy
    assert float(metrics["grad_norm"]) != float(plain["grad_norm"])  # the penalty is in the loss
    with_l1, without = _step(50.0, lr=0.05), _step(0.0, lr=0.05)
    assert _mean_activation(*with_l1[:2]) < 0.9 * _mean_activation(*without[:2])


@pytest.mark.parametrize("model, train, match", [
    (MODEL, {"activation_l1": 0.1}, "activation_l1 sparsifies a ReLU-family FFN"),
    (SPARSE, {"activation_l1": -1.0}, "activation_l1=-1.0 must be >= 0"),
])
def test_bad_sparsity_options_name_the_key(model, train, match):
    with pytest.raises(ConfigError, match=match):
        run_config(model, steps=4, warmup_steps=1, **train)

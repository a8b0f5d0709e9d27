"""Training a mixture-of-experts model: the expert biases move towards balanced loads instead
of being trained, a dense model's matching weights start an MoE run, and the options are
refused where they mean nothing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax import ConfigError

from .test_loop import MODEL, run_config, small_dataset

MOE = {**MODEL, "ffn": "moe", "n_experts": 8, "n_experts_per_tok": 2, "moe_ffn_hidden": 16,
       "n_shared_experts": 1, "router": "sigmoid", "router_bias": True}


def moe_config(model=MOE, **train):
    return run_config(model, **{"steps": 4, "warmup_steps": 1, **train})


def test_balance_moves_each_bias_by_the_rate_towards_the_mean_load():
    from dlm_jax.training.loop import balance_experts

    model = dlm_jax.init_model(moe_config().model, seed=0)
    _, old = nnx.split(model)
    new = jax.tree.map(lambda x: x + 0.5, old)  # an optimizer update of every parameter
    loads = jnp.asarray([[9.0, 1, 1, 1, 1, 1, 1, 1], [2.0, 2, 2, 2, 2, 2, 2, 2]])
    flat = dict(nnx.to_flat_state(balance_experts(old, new, loads, 0.01)))
    first = np.asarray(flat[("layers", 0, "ffn", "expert_bias")][...])
    np.testing.assert_allclose(first, [-0.01] + [0.01] * 7)  # from 0, not from the optimizer's 0.5
    np.testing.assert_allclose(np.asarray(flat[("layers", 1, "ffn", "expert_bias")][...]), 0.0)
    np.testing.assert_allclose(np.asarray(flat[("layers", 0, "ffn", "gate")][...]),
                               np.asarray(dict(nnx.to_flat_state(old))[("layers", 0, "ffn", "gate")][...]) + 0.5)


@pytest.mark.slow  # subprocesses / a training run: .ci/run runs the slow tests
def test_a_run_balances_its_experts_and_logs_the_load(tmp_path):
    from dlm_jax.training.loop import train

    result = train(moe_config(expert_bias_rate=0.01), tmp_path / "run", progress=False, dataset=small_dataset())
    params = dlm_jax.get_params(dlm_jax.load_pretrained(result.model_dir))
    for layer in range(2):
        bias = params[f"layers.{layer}.ffn.expert_bias"]
        # 4 steps of +-0.01 each (a tie leaves it): a multiple of 0.01, some moved
        np.testing.assert_allclose(np.round(bias / 0.01), bias / 0.01, atol=1e-4)
        assert np.abs(bias).max() > 0 and np.abs(bias).max() <= 0.04 + 1e-6
    logged = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"expert_max_load"' in logged


@pytest.mark.slow  # about 25 s: a one-step run
def test_init_partial_takes_the_matching_weights_of_a_dense_model(tmp_path):
    from dlm_jax.training.loop import train

    dense = dlm_jax.init_model(dataclasses.replace(moe_config().model, ffn="swiglu", n_experts=0, n_experts_per_tok=0,
                                                   moe_ffn_hidden=0, n_shared_experts=0, router="softmax",
                                                   router_bias=False), seed=7)
    dlm_jax.save_pretrained(dense, tmp_path / "dense", tokenizer=dlm_jax.ByteTokenizer())
    start = dlm_jax.get_params(dense)
    result = train(moe_config(steps=1, warmup_steps=0, init_from=str(tmp_path / "dense"), init_partial=True),
                   tmp_path / "run", progress=False, dataset=small_dataset())
    after = dlm_jax.get_params(dlm_jax.load_pretrained(result.model_dir))
    assert np.abs(after["layers.0.attn.q_proj.kernel"] - start["layers.0.attn.q_proj.kernel"]).max() < 3e-3
    assert "layers.0.ffn.gate" in after and "layers.0.ffn.gate_proj.kernel" not in after
    with pytest.raises(ConfigError, match="init_from=.*do not fit"):
        train(moe_config(init_from=str(tmp_path / "dense")), tmp_path / "strict", progress=False,
              dataset=small_dataset())


@pytest.mark.parametrize("model, train, match", [
    (MODEL, {"expert_bias_rate": 0.01}, "expert_bias_rate .* needs \\[model\\] ffn"),
    (MOE, {"expert_bias_rate": -1.0}, "expert_bias_rate=-1.0 must be >= 0"),
])
def test_bad_moe_options_name_the_key(model, train, match):
    with pytest.raises(ConfigError, match=match):
        moe_config(model, **train)

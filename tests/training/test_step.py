"""The train step on its own: one call equals the update computed by hand, it donates the
parameters and optimizer state (without donation an accelerator holds both copies during the
update, with no error anywhere), and its arrays live where `StepShardings` puts them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dlm_jax.models._params import init_model
from tests.training.test_loop import run_config, small_dataset
from dlm_jax.training.loop import StepShardings, build_mesh, make_optimizer, make_train_step
from dlm_jax.training.objectives import get_objective


@pytest.fixture(scope="module")
def setup():
    tc = run_config().train
    run = run_config()
    graphdef, params = nnx.split(init_model(run.model.replace(dtype=tc.compute_dtype, param_dtype="float32"),
                                            seed=tc.seed))
    objective = get_objective(tc.objective, run.model, **tc.objective_options())
    tx, _ = make_optimizer(tc)
    mesh = build_mesh(1, 1)
    shardings = StepShardings.for_mesh(mesh, tx, params)
    params = jax.device_put(params, shardings.params)
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
    batch = {k: jax.device_put(jnp.asarray(v[: tc.batch_size]), shardings.batch) for k, v in small_dataset().items()}
    step = make_train_step(graphdef=graphdef, objective=objective, tx=tx, shardings=shardings)
    return dict(graphdef=graphdef, params=params, opt_state=opt_state, objective=objective, tx=tx, mesh=mesh,
                shardings=shardings, batch=batch, rng=jax.random.key(3), step=step)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def test_one_step_equals_the_update_by_hand(setup):
    s = setup

    def by_hand(params, opt_state):  # the objective's loss and gradients, then the optax update
        (loss, metrics), grads = jax.value_and_grad(
            lambda p: s["objective"](nnx.merge(s["graphdef"], p), s["batch"], s["rng"]), has_aux=True)(params)
        updates, opt_state = s["tx"].update(grads, opt_state, params)
        return loss, metrics, grads, optax.apply_updates(params, updates), opt_state

    # One plain jit, no shardings or donation (op by op it is ~40 s on a cold compile cache).
    loss, metrics, grads, want, want_opt = jax.jit(by_hand)(s["params"], s["opt_state"])

    params, opt_state, got_metrics, finite = s["step"](_copy(s["params"]), _copy(s["opt_state"]), s["batch"], s["rng"])
    assert bool(finite)
    np.testing.assert_allclose(float(got_metrics["loss"]), float(loss), rtol=1e-5)
    np.testing.assert_allclose(float(got_metrics["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)
    assert set(got_metrics) == set(metrics) | {"grad_norm"}
    for got, ref in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((want, want_opt)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_the_step_donates_params_and_optimizer_state(setup):
    s = setup
    donated = len(jax.tree.leaves((s["params"], s["opt_state"])))
    text = s["step"].lower(s["params"], s["opt_state"], s["batch"], s["rng"]).as_text()
    args = text[text.index("func.func public @main("):].split("->", 1)[0]
    # Each donated leaf is aliased to its output: `tf.aliasing_output = <i>` on its argument.
    assert args.count("tf.aliasing_output") == donated
    n_args = len(jax.tree.leaves((s["params"], s["opt_state"], s["batch"], s["rng"])))
    aliased = [i for i in range(n_args) if "tf.aliasing_output" in args.split(f"%arg{i}:")[1].split("%arg")[0]]
    assert aliased == list(range(donated))  # params and opt_state, never the batch or the key
    # And the call really consumes them (donation is honoured on CPU too).
    params, opt_state = _copy(s["params"]), _copy(s["opt_state"])
    out = s["step"](params, opt_state, s["batch"], s["rng"])
    assert all(x.is_deleted() for x in jax.tree.leaves((params, opt_state)))
    assert not any(x.is_deleted() for x in jax.tree.leaves(s["batch"]))
    jax.block_until_ready(out)


def test_the_step_uses_the_given_shardings(setup):
    s = setup
    sh = s["shardings"]
    compiled = s["step"].lower(s["params"], s["opt_state"], s["batch"], s["rng"]).compile()
    (p_in, o_in, b_in, r_in), _ = compiled.input_shardings
    assert jax.tree.map(lambda x: x.spec, p_in) == jax.tree.map(lambda x: x.spec, sh.params)
    assert jax.tree.map(lambda x: x.spec, o_in) == jax.tree.map(lambda x: x.spec, sh.opt_state)
    assert all(x.spec == sh.batch.spec for x in jax.tree.leaves(b_in)) and r_in.spec == sh.replicated.spec
    # The rules shard some kernels over the model axis and the moments follow their parameters.
    specs = {x.spec for x in jax.tree.leaves(sh.params)}
    assert jax.sharding.PartitionSpec(None, "model") in specs
    mu = s["opt_state"][1][0].mu
    assert jax.tree.map(lambda x: x.sharding, mu) == sh.params
    params, opt_state, metrics, finite = s["step"](_copy(s["params"]), _copy(s["opt_state"]), s["batch"], s["rng"])
    assert jax.tree.map(lambda x: x.sharding, params) == sh.params
    assert jax.tree.map(lambda x: x.sharding, opt_state) == sh.opt_state
    assert all(x.sharding == sh.replicated for x in jax.tree.leaves((metrics, finite)))

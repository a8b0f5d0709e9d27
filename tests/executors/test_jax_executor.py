"""The decode program's output tail and the executors' per-phase step timings."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax
from dlm_jax.executors.jax_executor import top2
from dlm_jax.executors.runner import zero_inputs
from dlm_jax.runtime.buckets import BucketKey

ROOT = Path(__file__).resolve().parents[2]


def test_top2_is_lax_top_k_without_the_sort():
    import jax

    rng = np.random.default_rng(0)
    probs = rng.random((3, 5, 97)).astype(np.float32)
    probs[0, 0, [3, 40]] = 2.0  # a tie for first: the lower index wins, the runner-up equals it
    probs[1, 2, [7, 8, 9]] = 3.0
    values, idx = jax.lax.top_k(jnp.asarray(probs), 2)
    top, p1, p2 = top2(jnp.asarray(probs))
    np.testing.assert_array_equal(top, idx[..., 0])
    np.testing.assert_array_equal(p1, values[..., 0])
    np.testing.assert_array_equal(p2, values[..., 1])
    assert int(top[0, 0]) == 3 and float(p2[0, 0]) == 2.0


def test_step_outputs_follow_the_model_logits():
    """Kernels held transposed inside the executor change nothing: the step's top-1 token and
    probabilities are those of the model's own forward."""
    handle = dlm_jax.load(ROOT / "models" / "llada-tiny")
    key = BucketKey(1, 32, 0, 32)
    tokens = np.array([handle.encode("564+894=1458 and 17+25=42.............")[:32]], np.int32)
    rows = np.arange(32, dtype=np.int32)[None]
    x = dataclasses.replace(zero_inputs(handle.config, key), tokens=tokens, positions=rows, logit_rows=rows)
    out = handle.decoder.executor.step(x)
    logits = np.asarray(handle.model(tokens).logits, np.float64)
    logits[..., handle.config.mask_token_id] = -np.inf
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_array_equal(out.top_token, probs.argmax(-1))
    np.testing.assert_allclose(out.top_prob, probs.max(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.second_prob, np.sort(probs, -1)[..., -2], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("timed", [False, True])
def test_jax_step_timings_are_split_by_phase(timed):
    handle = dlm_jax.load(ROOT / "models" / "llada-tiny")
    x = zero_inputs(handle.config, BucketKey(1, 32, 32, 32))
    timings = {} if timed else None
    out = handle.decoder.executor.step(x, timings=timings)
    ref = handle.decoder.executor.step(x)
    np.testing.assert_array_equal(out.top_token, ref.top_token)
    np.testing.assert_array_equal(out.k_new, ref.k_new)
    if timed:
        assert set(timings) == {"h2d", "compute", "d2h"} and all(v >= 0 for v in timings.values())
        assert timings["compute"] > 0


@pytest.mark.parametrize("attention", ["bidirectional", "causal", "block_causal"])
def test_the_visibility_rule_is_the_same_on_the_host_and_the_device(attention):
    """The step contract's one visibility rule (`runtime.step.visibility`) runs on NumPy beside
    a dense executor and on `jax.numpy` inside the JAX executor's programs: an array-module
    difference (a broadcast, a dtype, a where) would give the two executors different
    attention with no error. Random steps, probes and hidden columns included."""
    import jax

    from dlm_jax.runtime.step import visibility
    from dlm_jax.testing import tiny_config

    cfg = tiny_config().replace(attention=attention, block_size=4)
    rng = np.random.default_rng(0)
    fn = jax.jit(lambda *a: visibility(jnp, cfg, *a))
    for _ in range(6):
        b, w, p = rng.integers(1, 4), rng.integers(1, 9), rng.integers(0, 12)
        args = (rng.integers(0, 24, (b, w)).astype(np.int32), rng.random((b, w)) < 0.8,
                rng.integers(0, 24, (b, p)).astype(np.int32), rng.random((b, p)) < 0.7,
                rng.random((b, w)) < 0.3,
                np.where(rng.random((b, w)) < 0.4, rng.integers(0, p + w, (b, w)), -1).astype(np.int32))
        host = visibility(np, cfg, *args)
        assert host.shape == (b, w, p + w) and host.dtype == bool
        np.testing.assert_array_equal(host, np.asarray(fn(*args)))


def test_an_executor_built_for_a_gpu_takes_a_gpus_defaults_on_a_cpu():
    """`building_for("gpu")` (what `benchmarks/gpu_step.py --target` compiles under) gives an
    executor built on this CPU the defaults it would take on a GPU: batched rows, the cache read
    in place, kernels as stored (a CPU holds them transposed) and no XLA:CPU compiler options;
    outside it, the CPU's again."""
    from dlm_jax.executors._compile import building_for, jit_options, target_platform
    from dlm_jax.executors.jax_executor import JaxExecutor
    from dlm_jax.models._params import _abstract_model
    from dlm_jax.testing import tiny_config

    cfg = tiny_config()
    assert target_platform() == "cpu"
    with building_for("gpu"):
        assert target_platform() == "gpu"
        gpu = JaxExecutor(_abstract_model.__wrapped__(cfg))
        assert "compiler_options" not in jit_options({"donate_argnums": (1,)})
    cpu = JaxExecutor(_abstract_model.__wrapped__(cfg))
    assert target_platform() == "cpu" and "compiler_options" in jit_options()
    assert (gpu.rows, gpu.attention, any(gpu._transposed)) == ("batched", "split", False)
    assert (cpu.rows, cpu.attention, any(cpu._transposed)) == ("each", "gather", True)


def test_a_gpu_default_falls_back_where_the_model_or_mesh_cannot_take_it(monkeypatch):
    """A lease's choice becomes `GPU_ATTENTION` / `GPU_PROJECTIONS`; a model or mesh the chosen
    form refuses (the kernel: a head dim it cannot load, a tp that splits a K/V head; cuDNN: a
    float32 model; fused projections: a mesh) gets the split form and separate projections by
    default instead of a refusal, and a TPU never takes a GPU's kernel. Asked for by name, each
    is still refused in one line."""
    from dlm_jax._errors import ConfigError
    from dlm_jax.executors import jax_executor
    from dlm_jax.executors._compile import building_for
    from dlm_jax.executors.jax_executor import JaxExecutor, default_attention, default_projections
    from dlm_jax.models._params import _abstract_model
    from dlm_jax.testing import tiny_config

    monkeypatch.setattr(jax_executor, "GPU_ATTENTION", "pallas")
    monkeypatch.setattr(jax_executor, "GPU_PROJECTIONS", "fused")
    ok, wide = tiny_config(head_dim=16), tiny_config(head_dim=24)
    with building_for("gpu"):
        assert default_attention(ok) == default_attention() == "pallas"
        assert default_attention(wide) == "split"
        assert default_attention(ok, mesh=f"tp={2 * ok.n_kv_heads}") == "split"
        assert default_projections() == "fused" and default_projections("tp=2") == "separate"
        executor = JaxExecutor(_abstract_model.__wrapped__(ok))
        assert (executor.attention, executor.projections) == ("pallas", "fused")
        executor = JaxExecutor(_abstract_model.__wrapped__(wide))
        assert (executor.attention, executor.projections) == ("split", "fused")
        with pytest.raises(ConfigError, match="^attention='pallas': the attention kernel takes head dims"):
            JaxExecutor(_abstract_model.__wrapped__(wide), attention="pallas")
        monkeypatch.setattr(jax_executor, "GPU_ATTENTION", "cudnn")
        assert default_attention(ok) == "split"  # (a float32 model)
        assert default_attention(dataclasses.replace(ok, dtype="bfloat16")) == "cudnn"
    with building_for("tpu"):
        monkeypatch.setattr(jax_executor, "GPU_ATTENTION", "pallas")
        assert default_attention(ok) == "split" and default_projections() == "separate"
    assert default_attention(ok) == "gather" and default_projections() == "separate"  # (this CPU)

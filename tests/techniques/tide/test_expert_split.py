"""Split expert execution (TIDE §3.3, lossless inference): a split MoE layer computes its resident
experts from expert slots in the compiled step and its misses on the NumPy CPU path; its
output matches the dense layer, the decoded tokens match the unsplit model's, and the slots
follow the placement policy, moving the experts it migrates."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.techniques.tide import split_experts
from dlm_jax.models._transformer import dense_experts
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime import preset
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.testing import sharp_model
from dlm_jax.runtime.registry import decode_config

MOE = dict(ffn="moe", n_experts=8, n_experts_per_tok=2, moe_ffn_hidden=16, n_shared_experts=1,
           router="sigmoid", router_bias=True, n_layers=3, dense_layers=(0,))
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def _pair(slots=3, layers=(1, 2)):
    """The model and a copy of it with `layers` split into `slots` expert slots."""
    whole = sharp_model(seed=2, **MOE)
    split = dlm_jax.model_from_params(whole.config, dlm_jax.get_params(whole))
    return whole, split, split_experts(split, layers, slots)


def test_split_layer_output_matches_the_dense_layer():
    whole, split, cpu = _pair(slots=3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, whole.config.d_model)), jnp.float32)
    for layer in (1, 2):
        want, routing = whole.layers[layer].ffn(x, experts=dense_experts)
        got, same = split.layers[layer].ffn(x)
        np.testing.assert_array_equal(same.experts, routing.experts)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert cpu[layer].assignments > 0  # some assignments missed the 3 slots


@pytest.mark.slow  # about 10 s: the default suite keeps within its 5 minutes
def test_split_decode_gives_the_unsplit_tokens_and_follows_the_policy():
    whole, split, cpu = _pair(slots=3)
    cfg = preset("fast-dllm", gen_len=16, block_len=8, threshold=0.7)
    base = Decoder(JaxExecutor(whole), whole.config).decode(PROMPTS, cfg)
    executor = JaxExecutor(split)
    assert executor.capabilities.expert_slots == 3
    placed = decode_config(cfg, experts="tide", tau="2", expert_budget=4, hits="previous_step")
    out = Decoder(executor, split.config).decode(PROMPTS, placed)
    for a, b in zip(out.sequences, base.sequences):
        np.testing.assert_array_equal(a, b)
    report = out.stats.placement
    assert report["migrations"] > 0
    # every migration the policy counts moved one expert's weights into a slot
    assert out.stats.counters["placement_bytes"] == report["migrations"] * cpu[1].expert_bytes
    assert sum(c.calls for c in cpu.values()) == 2 * out.stats.nfe  # the CPU path ran in both layers, every step


def test_split_execution_needs_matching_slots_and_previous_step_hits():
    _, split, _ = _pair(slots=3)
    decoder = Decoder(JaxExecutor(split), split.config)
    cfg = preset("fast-dllm", gen_len=8, block_len=8)
    with pytest.raises(ConfigError, match="does not fit the executor's 3 expert slots"):
        decoder.decode(PROMPTS, decode_config(cfg, experts="tide", tau="2", expert_budget=5, hits="previous_step"))
    with pytest.raises(ConfigError, match="use hits='previous_step'"):
        decoder.decode(PROMPTS, decode_config(cfg, experts="per-step", expert_budget=4))
    with pytest.raises(ConfigError, match="layer 0 is not an MoE layer"):
        split_experts(sharp_model(seed=2, **MOE), (0,), 2)


@pytest.mark.slow  # subprocesses / a training run: .ci/run runs the slow tests
def test_load_splits_every_moe_layer_and_the_cli_decodes_with_it(tmp_path):
    import json
    import subprocess
    import sys

    from dlm_jax.testing import tiny_checkpoint

    path = tiny_checkpoint(tmp_path / "moe", seed=1, **MOE)
    handle = dlm_jax.load(path, expert_slots=3)
    assert handle.decoder.executor.capabilities.expert_slots == 3
    assert [i for i, block in enumerate(handle.model.layers) if block.ffn.__dict__.get("cpu_experts")] == [1, 2]
    with pytest.raises(ConfigError, match="runs on the JAX executor"):
        dlm_jax.load(path, expert_slots=3, executor="litert")
    cmd = [sys.executable, "-m", "dlm_jax.frontends.cli", "generate", "--model", str(path), "--prompt-ids", "5,6,7", "--gen",
           "16", "--block", "8", "--expert-slots", "3", "--experts", "tide", "--tau", "2", "--expert-budget", "4",
           "--hits", "previous_step"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    plain = subprocess.run(cmd[:cmd.index("--expert-slots")], capture_output=True, text=True, timeout=300)
    assert done.stdout == plain.stdout  # the same tokens
    assert json.loads(done.stderr.strip().splitlines()[-1])["placement"]["tau"] == 2

"""Expert placement in the decode loop (TIDE §3.3): the `router_topk` step output, the
`ExpertPolicy` and its baselines, calibration (static sets, tau = auto) and the options'
errors. Placement is accounting: it must never change routing or tokens."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime import BucketKey, OutputRequest, preset
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.techniques.tide.experts import ExpertCosts, ExpertPlacement, ExpertPolicy, calibrate, static_sets
from dlm_jax.testing import sharp_model, tiny_checkpoint
from tests.tflite_export.test_exportable import random_inputs

MOE = dict(ffn="moe", n_experts=8, n_experts_per_tok=2, moe_ffn_hidden=16, n_shared_experts=1,
           router="sigmoid", router_bias=True, n_layers=3, dense_layers=(0,))
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.fixture(scope="module")
def model():
    return sharp_model(seed=2, **MOE)


@pytest.fixture(scope="module")
def decoder(model):
    return Decoder(JaxExecutor(model), model.config)


def _decode(decoder, **options):
    return decoder.decode(PROMPTS, preset("fast-dllm", gen_len=16, block_len=8, threshold=0.7, **options))


@pytest.mark.slow  # (over the default suite's 5-minute budget on 2 cores; .ci/run runs the slow tests)
def test_router_topk_is_the_models_routing_and_only_where_asked(model):
    key = BucketKey(batch=2, window=8, cache=8, rows=8, router_topk=True)
    inputs = dataclasses.replace(random_inputs(model.config, key, seed=1), want=OutputRequest(router_topk=True))
    out = JaxExecutor(model).step(inputs)
    # One jitted program: op by op, every primitive of the forward compiles alone.
    forward = jax.jit(lambda t, p, m, k, v: model(t, positions=p, mask=m, k_cache=k, v_cache=v,
                                                  router_topk=True).router_topk)
    want = forward(*(jnp.asarray(a) for a in (inputs.tokens, inputs.positions, inputs.visibility, inputs.k_cache,
                                               inputs.v_cache)))
    assert out.router_topk.shape == (2, 2, 8, 2)  # layers 1 and 2 (layer 0 is dense)
    np.testing.assert_array_equal(out.router_topk, np.asarray(want))
    plain = JaxExecutor(model).step(random_inputs(model.config, BucketKey(2, 8, 8, 8), seed=1))
    assert plain.router_topk is None
    np.testing.assert_array_equal(plain.top_token, out.top_token)


SETTINGS = [dict(experts="all"), dict(experts="per-step", expert_budget=3), dict(experts="static", expert_budget=2),
            dict(experts="random", expert_budget=4, expert_seed=3)]
SETTINGS += [dict(experts="tide", tau=str(tau), expert_budget=b, hits=h)
             for tau in (1, 2, 3, 16) for b in (2, 5) for h in ("current_step", "previous_step")]


def _options(decoder, setting):
    """A setting's decode options; a static placement's sets come from a calibration decode."""
    if setting["experts"] != "static":
        return setting
    trace = _decode(decoder, experts="all").stats.placement["trace"]
    b = setting["expert_budget"]
    return {"placement": ExpertPolicy(experts="static", expert_budget=b, static_sets=static_sets(trace, 2, b - 1))}


@pytest.mark.slow  # (over the default suite's 5-minute budget on 2 cores; .ci/run runs the slow tests)
def test_placement_is_lossless_and_never_changes_routing(decoder):
    """Tokens bit-identical to a decode without placement for every setting; the routing
    trace identical under every setting."""
    base = _decode(decoder)
    reference = _decode(decoder, experts="all").stats.placement["trace"]
    for setting in SETTINGS:
        out = _decode(decoder, **_options(decoder, setting))
        for a, b in zip(out.sequences, base.sequences):
            np.testing.assert_array_equal(a, b, err_msg=str(setting))
        trace = out.stats.placement["trace"]
        assert [len(b) for b in trace] == [len(b) for b in reference]
        for block, ref in zip(trace, reference):
            for s, r in zip(block, ref):
                np.testing.assert_array_equal(s, r)


@pytest.mark.slow  # (4 s)
def test_loop_accounting_replays_the_placement_over_its_trace(decoder, model):
    """The loop's totals are `ExpertPlacement`'s over the recorded trace, t restarting per
    block; padding rows (bucket and finished requests) carry no assignments."""
    for options in (dict(experts="tide", tau="2", expert_budget=3), dict(experts="per-step", expert_budget=4,
                                                                          hits="previous_step")):
        out = _decode(decoder, **options)
        report = out.stats.placement
        replay = ExpertPlacement(2, 8, options["expert_budget"] - 1, int(options.get("tau", 1)),
                                 options.get("hits", "current_step"), shared=1)
        for block in report["trace"]:
            for t, topk in enumerate(block):
                replay.step(t, topk)
        assert report["steps"] == replay.steps == out.stats.nfe
        assert (report["refreshes"], report["migrations"], report["misses"]) == (
            replay.refreshes, int(replay.migrations.sum()), int(replay.misses.sum()))
        live = sum(int((s >= 0).sum()) for block in report["trace"] for s in block)
        assert report["assignments"] == live
        assert live % 2 == 0 and live == 2 * sum(int((s[:, :, 0] >= 0).sum()) for b in report["trace"] for s in b)
        assert report["budget"] == options["expert_budget"]


def test_calibration_makes_static_sets_and_solves_tau(decoder, model):
    trace = _decode(decoder, experts="all").stats.placement["trace"]
    policy, _ = calibrate(ExpertPolicy(experts="static", expert_budget=3), trace, model.config)
    assert policy.static_sets == static_sets(trace, 2, 2)
    counts = [np.bincount(np.concatenate([s[layer].ravel() for b in trace for s in b]) + 1, minlength=9)[1:]
              for layer in range(2)]
    for layer, chosen in enumerate(policy.static_sets):  # the two most used experts of the layer
        assert sorted(chosen) == sorted(np.argsort(-counts[layer], kind="stable")[:2].tolist())
    auto = ExpertPolicy(experts="tide", expert_budget=3, tau="auto")
    free_io, info = calibrate(auto, trace, model.config, ExpertCosts(c_io=0.0, c_cpu=1e-6))
    assert free_io.tau == "1" and info["T"] >= 2
    free_cpu, info = calibrate(auto, trace, model.config, ExpertCosts(c_io=1e-3, c_cpu=0.0))
    assert free_cpu.tau == str(info["T"] - 1)
    assert ExpertCosts.profile(model.config, repeats=2).c_io > 0


@pytest.mark.slow  # subprocesses / a training run: .ci/run runs the slow tests
def test_generate_calibrates_tau_auto_and_static(tmp_path):
    path = tiny_checkpoint(tmp_path / "moe", seed=1, **MOE)
    handle = dlm_jax.load(path)
    assert type(handle.decoder.executor).__name__ == "JaxExecutor"  # auto: MoE decodes on JAX
    for options in (dict(experts="tide"), dict(experts="static", expert_budget=3)):
        out = handle.generate([[5, 6, 7]], preset("fast-dllm", gen_len=16, block_len=8, **options))
        report = out.stats.placement
        assert report["steps"] == out.stats.nfe and report["tau"] in (None, *range(1, 8))


@pytest.mark.parametrize("options, match", [
    (dict(experts="tide", tau="2", expert_budget=9), r"expert_budget=9 must be in \[2, 8\]"),
    (dict(experts="tide", tau="2", expert_budget=1), r"expert_budget=1 must be in \[2, 8\]"),
    (dict(experts="tide", tau="0"), "tau=0 must be an integer >= 1"),
    (dict(experts="tide", tau="x"), "tau='x' must be 'auto' or an integer"),
    (dict(experts="tide"), "tau='auto' is solved from a calibration decode"),
    (dict(experts="static"), "experts='static' needs static_sets"),
])
def test_bad_expert_options_name_the_problem(decoder, options, match):
    with pytest.raises(ConfigError, match=match):
        _decode(decoder, **options)


def test_expert_placement_needs_an_moe_model_and_router_outputs():
    dense = sharp_model(seed=0)
    with pytest.raises(ConfigError, match="the model has no MoE layers"):
        Decoder(JaxExecutor(dense), dense.config).decode(PROMPTS, preset("fast-dllm", gen_len=8, block_len=8,
                                                                         experts="per-step"))
    with pytest.raises(ConfigError, match="cannot return the routed experts"):
        dense_caps = JaxExecutor(dense).capabilities
        dense_caps.select(batch=1, window=8, cache=0, rows=8, router_topk=True)


@pytest.mark.slow  # subprocesses / a training run: .ci/run runs the slow tests
def test_cli_reports_the_placement(tmp_path):
    path = tiny_checkpoint(tmp_path / "moe", seed=1, **MOE)
    cmd = [sys.executable, "-m", "dlm_jax.frontends.cli", "generate", "--model", str(path), "--prompt", "1+2=", "--gen", "16",
           "--block", "8", "--experts", "per-step", "--expert-budget", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stderr.strip().splitlines()[-1])["placement"]
    assert report["experts"] == "per-step" and report["budget"] == 3 and report["tau"] == 1
    bad = subprocess.run(cmd[:-1] + ["30"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
        "error: expert_budget=30 must be in [2, 8]: above the 1 shared expert(s), always resident, and at most "
        "the 8 experts"]


@pytest.mark.slow  # subprocesses / a training run: .ci/run runs the slow tests
def test_eval_calibrates_once_and_sums_the_placement(tmp_path):
    from dlm_jax.training.evaluate import evaluate

    handle = dlm_jax.load(tiny_checkpoint(tmp_path / "moe", seed=1, vocab_size=264, **MOE))
    report = evaluate(handle, "sorting", preset("fast-dllm", gen_len=16, block_len=8, experts="tide",
                                                expert_budget=3), n=4, max_batch=2, progress=False)
    placed = report["placement"]
    assert isinstance(placed["tau"], int) and placed["experts"] == "tide" and "trace" not in placed
    assert 0 < placed["misses"] <= placed["assignments"]
    assert placed["steps"] >= 2 and placed["refreshes"] >= 1


def test_costs_for_a_target_link():
    cfg = sharp_model(seed=0, **MOE).config
    per_expert = 3 * cfg.d_model * cfg.moe_ffn_hidden * 4
    assert ExpertCosts.expert_bytes(cfg) == per_expert
    pcie = ExpertCosts.link(cfg, 25e9, 2e-6, "PCIe 4.0 x16")
    assert pcie.c_io == pytest.approx(per_expert / 25e9) and pcie.c_cpu == 2e-6
    with pytest.raises(ConfigError, match="must be finite and >= 0"):
        ExpertCosts(-1.0, 0.0)


@pytest.mark.slow  # subprocesses / a training run: .ci/run runs the slow tests
def test_a_bundle_exported_for_placement_runs_it_on_litert(tmp_path):
    """`export --experts ...` adds the routed experts to every bucket's signature; `run
    --experts ...` then places on LiteRT with the JAX executor's tokens and accounting."""
    path = tiny_checkpoint(tmp_path / "moe", seed=1, vocab_size=264, **MOE)
    flags = ["--gen", "16", "--block", "8", "--experts", "per-step", "--expert-budget", "3"]
    cli = [sys.executable, "-m", "dlm_jax.frontends.cli"]
    done = subprocess.run(cli + ["export", "--model", str(path), "--out", str(tmp_path / "bundle"), "--for-prompts", "4",
                                 *flags], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    ran = subprocess.run(cli + ["run", str(tmp_path / "bundle"), "--prompt-ids", "5,6,7", *flags], capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    jax_run = subprocess.run(cli + ["generate", "--model", str(path), "--prompt-ids", "5,6,7", *flags],
                             capture_output=True, text=True, timeout=300)
    assert ran.stdout == jax_run.stdout
    litert, jax_stats = (json.loads(r.stderr.strip().splitlines()[-1]) for r in (ran, jax_run))
    assert all(k.endswith("_topk") for k in litert["buckets"])
    assert litert["placement"] == jax_stats["placement"]

"""The LiteRT runner decodes exactly like the JAX executor: same tokens and NFE for every
cache mode and commit rule, batch 1 and 4, on both shipped models (bidirectional LLaDA-style
and causal I-DLM with logit shift), from a bundle written by `export_bundle`."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dlm_jax
from dlm_jax import CheckpointError, ConfigError
from dlm_jax.executors.runner import Bundle, load_bundle
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.tflite_export.bundle import _Sizes, export_bundle, parse_bucket, qualcomm_target
from dlm_jax.training.data import TASKS, make_split
from dlm_jax.runtime.registry import decode_config, decode_options

ROOT = Path(__file__).resolve().parents[2]
CACHES = ("none", "prefix", "dual")
RULES = ("topk", "threshold", "factor", "frechet")
BLOCK = {"llada-tiny": 16, "idlm-tiny": 4}


# Every cache mode and every rule at least once, at batch 1 (the full product, and batch 4, run
# with --runslow).
DIAGONAL = [("none", "topk"), ("prefix", "threshold"), ("dual", "factor"), ("prefix", "frechet"),
            ("dual", "topk")]


def configs(model: str, *, full: bool = True) -> list:
    """Every cache mode x commit rule (greedy), plus one sampled decode (logits buckets);
    `full=False`: the diagonal above plus the sampled one."""
    out = []
    for cache, rule in (itertools.product(CACHES, RULES) if full else DIAGONAL):
        extra = {"steps": 16} if rule == "topk" else {}
        out.append(dlm_jax.decode_config(cache=cache, rule=rule, gen_len=32, block_len=BLOCK[model], **extra))
    out.append(dlm_jax.decode_config(cache="prefix", rule="threshold", gen_len=32, block_len=BLOCK[model],
                                     temperature=1.0))
    return out


@pytest.fixture(scope="module", params=["llada-tiny", pytest.param("idlm-tiny", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    """(name, JAX model handle, runner handle, prompts) for one shipped model, its bundle
    holding exactly the buckets the test decodes need."""
    name = request.param
    jax_model = dlm_jax.load(ROOT / "models" / name)
    prompts = [jax_model.encode(ex.prompt) for t in TASKS for ex in make_split(TASKS[t], 2, split="heldout")]
    decoder = Decoder(_Sizes(jax_model.config), jax_model.config)
    keys = set()
    for cfg, batch in itertools.product(configs(name), (prompts[:1], prompts[:4])):
        keys |= set(decoder.bucket_keys([len(p) for p in batch], cfg))
    out = tmp_path_factory.mktemp("bundle") / name
    export_bundle(ROOT / "models" / name, out, keys=keys, decode=configs(name)[5], latency_repeats=1)
    return name, jax_model, load_bundle(out), prompts


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["diagonal", "product"])
@pytest.mark.parametrize("batch", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_runner_decodes_exactly_like_jax(pair, batch, full):
    name, jax_model, runner, prompts = pair
    if name != "llada-tiny" and not full:
        pytest.skip("the other shipped model runs the full product only (slow)")
    batch_prompts = prompts[:batch]
    for cfg in configs(name, full=full):
        want = jax_model.decoder.decode(batch_prompts, cfg)
        got = runner.decoder.decode(batch_prompts, cfg)
        label = f"{name} batch {batch} {decode_options(cfg)['cache']}/{decode_options(cfg)['rule']}"
        for w, g in zip(want.sequences, got.sequences):
            np.testing.assert_array_equal(g, w, err_msg=label)
        assert got.stats.nfe == want.stats.nfe and got.stats.request_nfe == want.stats.request_nfe, label
        assert got.stats.buckets == want.stats.buckets, label


def test_runner_step_timings_are_split_by_phase(pair):
    from dlm_jax.executors.runner import zero_inputs

    _, jax_model, runner, _ = pair
    key = min(runner.bundle.keys)
    timings = {}
    out = runner.decoder.executor.step(zero_inputs(jax_model.config, key), timings=timings)
    assert set(timings) == {"h2d", "compute", "d2h"} and timings["compute"] > 0 and out.top_token.shape[0] == key.batch


def test_bundle_layout_and_shared_weights(pair):
    name, jax_model, runner, _ = pair
    bundle = runner.bundle
    files = sorted(os.listdir(bundle.path))
    assert {"bundle.json", "model.tflite", "manifest.json", "latency.json", "plan.json"} <= set(files)
    assert not [f for f in files if f.startswith(".")]  # no temporary left behind
    meta = json.loads((bundle.path / "bundle.json").read_text())
    assert meta["prompt_format"] == jax_model.prompt_format == "chat"
    assert meta["config"] == jax_model.config.to_dict()
    assert runner.generate("564+894=", configs(name)[5]).texts == jax_model.generate("564+894=", configs(name)[5]).texts
    latency = json.loads((bundle.path / "latency.json").read_text())
    assert len(latency["entries"]) == len(meta["buckets"]) and all(e["median_ms"] > 0 for e in latency["entries"])


def test_the_bundle_lowering_plan_reloads_and_checks(pair):
    """plan.json holds, per signature, the NPU/CPU partition and a memory plan that passes
    the planner's own checker against the graph read back from the bundle's .tflite; and the
    NPU mixed-precision rule with each weight's outlier channels."""
    from dlm_jax.lowering.graph import read_tflite_graph
    from dlm_jax.techniques.lladacpp.somr import MemoryPlan, check_plan
    from dlm_jax.lowering.partition import partition

    bundle = pair[2].bundle
    plan = json.loads((bundle.path / "plan.json").read_text())
    content = bundle.model_path.read_bytes()
    assert sorted(plan["signatures"]) == sorted(b["signature"] for b in bundle.meta["buckets"])
    for name, entry in plan["signatures"].items():
        graph = read_tflite_graph(content, name)
        part = partition(graph, vocab_size=bundle.config.vocab_size)
        assert entry["partition"] == json.loads(json.dumps(part.to_dict()))
        check_plan(MemoryPlan.from_dict(entry["memory"]), graph.subgraph(part.npu_ops))
    npu = plan["npu_quantization"]
    assert npu["rule"]["name"] == "int4+int8-outliers" and npu["rule"]["fraction"] == 0.01
    assert all(len(w["outlier_channels"]) >= 1 for w in npu["weights"].values())


def test_buckets_share_one_copy_of_the_weights(tmp_path):
    """A bucket adds its graph, not the weights again: 1 -> 3 buckets grows the file by far
    less than one copy of the weights."""
    cfg = dlm_jax.decode_config(gen_len=32)
    keys = [parse_bucket(n) for n in ("step_w32_p32_r32", "step_w64_p32_r32", "step_w64_p0_r32")]
    one = export_bundle(ROOT / "models" / "llada-tiny", tmp_path / "one", keys=keys[:1], decode=cfg,
                        latency_repeats=1)
    three = export_bundle(ROOT / "models" / "llada-tiny", tmp_path / "one", keys=keys[1:], decode=cfg, add=True,
                          latency_repeats=1)
    weights = 4 * dlm_jax.param_count(dlm_jax.load_config(ROOT / "models" / "llada-tiny")[0])
    assert one.model_bytes > weights  # the weights are in there once
    assert three.keys == sorted(keys) and three.added == sorted(keys[1:])
    assert (three.model_bytes - one.model_bytes) / 2 < 0.05 * weights


def test_a_missing_bucket_is_named_with_the_way_to_add_it(tmp_path):
    cfg = dlm_jax.decode_config(gen_len=32)
    out = tmp_path / "b"
    export_bundle(ROOT / "models" / "llada-tiny", out, keys=[parse_bucket("step_w64_p0_r32")], decode=cfg,
                  latency_repeats=1)
    runner = load_bundle(out)
    assert runner.generate("564+894=", decode_config(cfg, cache="none", rule="topk", steps=32)).texts == ["1458"]
    with pytest.raises(ConfigError, match=r"holds a step of batch=1, window=32.*--add --for-prompts"):
        runner.generate("564+894=", cfg)  # prefix cache: window 32 over a cache
    with pytest.raises(ConfigError, match="already holds a bundle: pass --add"):
        export_bundle(ROOT / "models" / "llada-tiny", out, keys=[parse_bucket("step_w32_p32_r32")], decode=cfg)


def test_a_tampered_or_truncated_bundle_file_is_named(tmp_path):
    cfg = dlm_jax.decode_config(gen_len=32)
    out = tmp_path / "b"
    export_bundle(ROOT / "models" / "llada-tiny", out, keys=[parse_bucket("step_w64_p0_r32")], decode=cfg,
                  latency_repeats=1)
    model = out / "model.tflite"
    data = bytearray(model.read_bytes())
    data[len(data) // 3] ^= 0x01
    model.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.tflite: sha256 differs"):
        load_bundle(out)
    model.write_bytes(bytes(data[:1000]))
    with pytest.raises(CheckpointError, match="model.tflite: truncated or modified"):
        Bundle.open(out)
    with pytest.raises(CheckpointError, match="not a bundle"):
        Bundle.open(tmp_path)


def test_bad_bucket_names_and_targets_are_one_line_errors():
    with pytest.raises(ConfigError, match="not a signature name"):
        parse_bucket("w32p64")
    assert parse_bucket("step_w32_p64_r16_b4_full") == dlm_jax.runtime.BucketKey(4, 32, 64, 16, True)
    pytest.importorskip("ai_edge_litert.aot")
    if importable("ai_edge_litert_sdk_qualcomm"):
        pytest.skip("the Qualcomm SDK package is installed here")
    with pytest.raises(ConfigError, match="ai-edge-litert-sdk-qualcomm is not installed"):
        qualcomm_target("qualcomm-sm8750")


def importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.slow  # (5 s: two commands in processes of their own)
def test_cli_export_then_run_never_loads_jax(tmp_path):
    """`dlm-jax export` then `dlm-jax run` in fresh processes: the answer of `generate`, and
    the run process never imports JAX or Flax."""
    out = tmp_path / "bundle"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    export = subprocess.run([sys.executable, "-m", "dlm_jax.frontends.cli", "export", "--model", str(ROOT / "models" / "llada-tiny"),
                             "--out", str(out), "--for-prompts", "16", "--gen", "32", "--latency-repeats", "1"],
                            capture_output=True, text=True, env=env, cwd=ROOT)
    assert export.returncode == 0, export.stderr[-2000:]
    assert json.loads(export.stdout.splitlines()[-1])["buckets"] >= 2
    code = ("import sys; from dlm_jax.frontends.cli import main; rc = main(['run', sys.argv[1], '--prompt', '564+894=']); "
            "assert rc == 0; bad = [m for m in ('jax', 'flax', 'jaxlib') if m in sys.modules]; "
            "assert not bad, bad")
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[0] == "1458"
    gpu = subprocess.run([sys.executable, "-m", "dlm_jax.frontends.cli", "run", str(out), "--prompt", "1+1=", "--accelerator",
                          "gpu"], capture_output=True, text=True, env=env, cwd=ROOT)
    if gpu.returncode == 0:
        pytest.skip("this machine has a GPU LiteRT can use")
    assert gpu.returncode == 2
    errors = [line for line in gpu.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "accelerator 'gpu' is not available" in errors[0], gpu.stderr[-2000:]
    assert "Traceback" not in gpu.stderr


@pytest.mark.slow
def test_a_bundle_exported_for_llada_cpp_holds_every_bucket_it_needs(tmp_path):
    """Speculative windows and the CPU refresh path take many window and cache sizes; a bundle
    exported for the preset holds them all (`complete` plan shapes), and decodes as JAX does."""
    from dlm_jax.tflite_export.bundle import buckets_for_prompts

    jax_model = dlm_jax.load(ROOT / "models" / "llada-tiny")
    prompts = [jax_model.encode(ex.prompt) for t in TASKS for ex in make_split(TASKS[t], 3, split="heldout")]
    cfgs = [dlm_jax.preset("llada-cpp", gen_len=64, theta_stable=0.99),
            dlm_jax.preset("llada-cpp", gen_len=64, revisit="in_place", sliding=False)]
    keys = set()
    for cfg in cfgs:
        keys |= set(buckets_for_prompts(jax_model.config, cfg, max_prompt=max(map(len, prompts))))
    out = tmp_path / "bundle"
    export_bundle(ROOT / "models" / "llada-tiny", out, keys=sorted(keys), decode=cfgs[0], latency_repeats=0)
    runner = load_bundle(out)
    for cfg in cfgs:
        for p in prompts:
            want = jax_model.decoder.decode([p], cfg)
            got = runner.decoder.decode([p], cfg)
            np.testing.assert_array_equal(got.sequences[0], want.sequences[0])
            assert got.stats.nfe == want.stats.nfe

"""The default executor: the LiteRT runner over the bundle cache (`dlm_jax.executors.bundle_cache`) on a CPU.

It must decode exactly as the JAX executor does, export each bucket once per model (a second
process finds them), never reuse a bundle of other weights, survive a corrupt cache entry, and
be what `dlm_jax.load` and `dlm-jax generate` use when nothing is said.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.api import resolve_executor
from dlm_jax.models._params import model_from_params
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.executors.runner import Bundle
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.tflite_export.bundle import _Sizes
from dlm_jax.executors.bundle_cache import BundleCacheExecutor, model_fingerprint
from dlm_jax.training.data import TASKS, make_split

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "llada-tiny"
BIN = Path(sys.executable).parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "bundles"
    monkeypatch.setenv("DLM_JAX_BUNDLE_CACHE", str(root))
    return root


def test_auto_is_jax_then_the_litert_runner_on_a_cpu_and_jax_elsewhere(monkeypatch):
    cfg = dlm_jax.load_config(TINY)[0]
    monkeypatch.delenv("DLM_JAX_EXECUTOR")
    assert resolve_executor(None, cfg) == "jax-then-litert"  # this machine's JAX is CPU-only
    assert resolve_executor("auto", cfg.replace(dtype="bfloat16")) == "jax"
    monkeypatch.setattr("jax.default_backend", lambda: "gpu")
    assert resolve_executor("auto", cfg) == "jax"
    monkeypatch.setenv("DLM_JAX_EXECUTOR", "litert")
    assert resolve_executor(None, cfg) == "litert"
    with pytest.raises(ConfigError, match="unknown executor 'tpu'"):
        dlm_jax.load(TINY, executor="tpu")


@pytest.mark.slow  # (over the default suite's 5-minute budget on 2 cores; .ci/run runs the slow tests)
def test_the_cache_decodes_exactly_like_jax_and_exports_each_bucket_once(cache):
    prompts = [ex.prompt for t in TASKS for ex in make_split(TASKS[t], 2, split="heldout")]
    cfgs = [dlm_jax.decode_config(cache="prefix", gen_len=64), dlm_jax.decode_config(cache="dual", gen_len=64),
            dlm_jax.decode_config(cache="none", rule="topk", gen_len=32, steps=32)]
    jax_model = dlm_jax.load(TINY, executor="jax")
    assert isinstance(jax_model.executor, JaxExecutor)
    model = dlm_jax.load(TINY, executor="litert")
    assert isinstance(model.executor, BundleCacheExecutor) and model.model is not None
    for cfg in cfgs:
        for batch in (prompts[:1], prompts[:3]):
            want, got = jax_model.generate(batch, cfg), model.generate(batch, cfg)
            assert got.token_ids == want.token_ids and got.texts == want.texts
            # The engine's calls on the bundle cache take one row each (`engine_batches`): the
            # forwards each request took part in are JAX's, in batch-1 buckets of the same sizes.
            assert got.stats.request_nfe == want.stats.request_nfe
            assert {re.sub(r"^b[0-9]+_", "b1_", k) for k in want.stats.buckets} == set(got.stats.buckets)
    exported = list(model.executor.exported)
    assert exported and len(set(exported)) == len(exported)  # no bucket exported twice
    # Each decode first exported every bucket of its prompts up to 64 tokens.
    decoder = Decoder(_Sizes(model.config), model.config)
    assert set(decoder.bucket_keys([64], cfgs[0])) <= set(exported)
    # Each export is a part of its own holding only what was new: no bucket converted twice.
    held = [k for part in sorted(model.executor.path.glob("part-*")) for k in Bundle.open(part).keys]
    assert sorted(held) == sorted(exported)
    entries = [p for p in cache.iterdir() if p.is_dir()]
    assert [p.name for p in entries] == [f"llada-tiny-{model_fingerprint(model.model)}"]
    # Another process's load finds every bucket ready.
    again = dlm_jax.load(TINY, executor="litert")
    got = again.generate(prompts[:3], cfgs[1])
    assert again.executor.exported == [] and got.token_ids == jax_model.generate(prompts[:3], cfgs[1]).token_ids


def test_other_weights_are_another_entry_and_a_corrupt_entry_is_exported_again(cache, tmp_path):
    model = dlm_jax.load(TINY, executor="litert")
    cfg = dlm_jax.decode_config(cache="dual", gen_len=32)
    first = model.generate("564+894=", cfg)
    [part] = model.executor.parts_open
    params = dlm_jax.get_params(model.model)
    name = sorted(params)[0]
    params[name] = params[name] + np.float32(1e-3)
    other = model_from_params(model.config, params)
    assert model_fingerprint(other) != model_fingerprint(model.model)
    # Truncate the cached model file: the next load re-exports instead of running a broken graph.
    tflite = part / "model.tflite"
    tflite.write_bytes(tflite.read_bytes()[:1000])
    again = dlm_jax.load(TINY, executor="litert")
    got = again.generate("564+894=", cfg)
    assert again.executor.exported and got.token_ids == first.token_ids
    entry = model.executor.path
    assert not [p for p in entry.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.slow  # about 15 s: three CLI processes and a background export
def test_generate_uses_the_cache_without_flags(cache, tmp_path):
    """`dlm-jax generate` with no executor flag (and no DLM_JAX_EXECUTOR): the first run decodes
    with JAX and never waits for an export, which a background process makes; the next run
    decodes from the cached bundle, exports nothing and prints the same completion as JAX."""
    env = {k: v for k, v in os.environ.items() if k != "DLM_JAX_EXECUTOR"}
    env["DLM_JAX_BUNDLE_CACHE"] = str(cache)
    env["DLM_JAX_BACKGROUND_EXPORT"] = "1"
    cmd = [str(BIN / "dlm-jax"), "generate", "--model", str(TINY), "--prompt", "564+894=", "--gen", "32"]

    def run(*extra):
        result = subprocess.run(cmd + list(extra), env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        return result.stdout, json.loads(result.stderr.strip().splitlines()[-1])

    text, stats = run()
    assert stats["exports"] == 0
    deadline = time.time() + 600
    while not any("done:" in p.read_text() for p in cache.glob("*.export.log")):
        assert time.time() < deadline, "the background export did not finish"
        time.sleep(0.5)
    [entry] = [p for p in cache.iterdir() if p.is_dir()]
    parts = sorted(entry.glob("part-*/model.tflite"))
    assert len(parts) == 1
    stamp = parts[0].stat().st_mtime_ns
    again, again_stats = run()
    assert again == text and again_stats["exports"] == 0 and sorted(entry.glob("part-*/model.tflite")) == parts
    assert parts[0].stat().st_mtime_ns == stamp
    jax_text, jax_stats = run("--executor", "jax")
    assert jax_text == text and jax_stats["nfe"] == stats["nfe"]
    bad = subprocess.run(cmd + ["--executor", "tpu"], env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "invalid choice: 'tpu'" in bad.stderr and "Traceback" not in bad.stderr

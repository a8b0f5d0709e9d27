"""Batch invariance on real models: a request submitted into a running engine, at a random
step, beside other requests, gets the tokens, NFE and speculation statistics of its solo
decode (`Decoder.decode` of that prompt alone), for every preset, on the JAX executor (both
ways of reading the cache) and the LiteRT runner."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import dlm_jax
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.runtime.engine import DONE, Engine
from dlm_jax.training.data import TASKS, make_split

MODELS = Path(__file__).resolve().parents[2] / "models"

# (preset, model, options): every preset on a shipped model it decodes.
CASES = [
    ("llada", "llada-tiny", dict(gen_len=32, block_len=16)),
    ("fast-dllm", "llada-tiny", dict(gen_len=64, block_len=16)),
    ("fast-dllm-dual", "llada-tiny", dict(gen_len=64, block_len=16)),
    ("fast-dllm-factor", "llada-tiny", dict(gen_len=64, block_len=16)),
    ("frechet", "llada-tiny", dict(gen_len=64, block_len=16)),
    ("llada-cpp", "llada-tiny", dict(gen_len=64, block_len=16)),
    ("isd", "idlm-tiny", dict(gen_len=32)),
    ("ar", "idlm-tiny", dict(gen_len=16)),
]


def _prompts(model, n: int, seed: int = 0) -> list[list[int]]:
    tasks = ("addition", "sorting", "gsm_lite")
    return [model.encode(ex.prompt) for i, t in enumerate(tasks)
            for ex in make_split(TASKS[t], -(-n // len(tasks)), split="heldout", seed=seed)][:n]


def _staggered(model, cfg, prompts, *, max_batch: int, seed: int) -> list:
    """Submit `prompts` into a running engine at random steps (a few at once, then one every
    few steps), run it dry, return the requests in submission order."""
    rng = np.random.default_rng(seed)
    engine = Engine(model.decoder, max_batch=max_batch)
    reqs, todo = [], list(prompts)
    while todo or not engine.idle:
        for _ in range(int(rng.integers(0, 3)) if todo else 0):
            if todo:
                reqs.append(engine.submit(todo.pop(0), cfg))
        engine.step()
    engine.close()
    return reqs


def _check(model, cfg, prompts, reqs) -> int:
    """Every request equals its solo decode: tokens, NFE, speculation counts. Returns how many
    requests shared a call with another (the test's load)."""
    for prompt, req in zip(prompts, reqs):
        assert req.status == DONE
        alone = model.decoder.decode([prompt], cfg)
        np.testing.assert_array_equal(req.output.sequences[0], alone.sequences[0])
        assert req.stats.nfe == alone.stats.request_nfe[0]
        assert req.output.stats.speculation == alone.stats.speculation
        assert req.output.stats.commit_histogram == alone.stats.commit_histogram
    return len(reqs)


@pytest.mark.parametrize("name,model_name,options", [c for c in CASES if c[0] in ("fast-dllm", "isd")],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_requests_joining_a_running_batch_equal_their_solo_decode(name, model_name, options):
    model = dlm_jax.load(MODELS / model_name, executor="jax")
    cfg = dlm_jax.preset(name, **options)
    prompts = _prompts(model, 6)
    reqs = _staggered(model, cfg, prompts, max_batch=4, seed=1)
    _check(model, cfg, prompts, reqs)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["gather", "split"])
@pytest.mark.parametrize("name,model_name,options", CASES, ids=lambda x: x if isinstance(x, str) else None)
def test_every_preset_is_batch_invariant(name, model_name, options, attention):
    """32 held-out prompts, submitted at random steps into a running batch of at most 8."""
    from dlm_jax.executors.jax_executor import JaxExecutor

    model = dlm_jax.load(MODELS / model_name, executor="jax")
    model.executor = JaxExecutor(model.model, attention=attention)
    model.decoder = Decoder(model.executor, model.config)
    cfg = dlm_jax.preset(name, **options)
    prompts = _prompts(model, 32)
    reqs = _staggered(model, cfg, prompts, max_batch=8, seed=2)
    _check(model, cfg, prompts, reqs)


@pytest.mark.slow
def test_the_litert_runner_is_batch_invariant(tmp_path):
    """The same on an exported bundle (batch buckets 1, 2, 4), the LiteRT runner's dense steps."""
    from dlm_jax.executors.runner import load_bundle
    from dlm_jax.tflite_export.bundle import _Sizes, export_bundle

    model = dlm_jax.load(MODELS / "llada-tiny", executor="jax")
    cfg = dlm_jax.preset("fast-dllm-dual", gen_len=32, block_len=16)
    prompts = _prompts(model, 8)
    sizes = Decoder(_Sizes(model.config), model.config)
    keys = {dataclasses.replace(k, batch=b) for p in prompts for k in sizes.bucket_keys([len(p)], cfg) for b in (1, 2, 4)}
    export_bundle(MODELS / "llada-tiny", tmp_path / "b", keys=keys, decode=cfg, latency_repeats=1)
    runner = load_bundle(tmp_path / "b")
    reqs = _staggered(runner, cfg, prompts, max_batch=4, seed=3)
    _check(runner, cfg, prompts, reqs)

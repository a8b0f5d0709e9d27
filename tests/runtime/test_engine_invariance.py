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

pytestmark = pytest.mark.users_compile  # (invariance in the programs users run: XLA's optimisations reorder sums)

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
    # TIDE: expert placement refreshed per request, split execution (8 of the experts resident)
    ("frechet", "moe-tiny", dict(gen_len=32, block_len=16, placement="experts", hits="previous_step", tau=2)),
]
LOAD = {"moe-tiny": {"expert_slots": 8}}


def _prompts(model, n: int, seed: int = 0) -> list[list[int]]:
    tasks = ("addition", "sorting", "gsm_lite")
    return [model.encode(ex.prompt) for i, t in enumerate(tasks)
            for ex in make_split(TASKS[t], -(-n // len(tasks)), split="heldout", seed=seed)][:n]


def _staggered(model, cfg, prompts, *, max_batch: int, seed: int, engine: Engine | None = None) -> list:
    """Submit `prompts` into a running engine (a new one of `max_batch` rows, or `engine`) at
    random steps (a few at once, then one every few steps), run it dry, return the requests in
    submission order."""
    rng = np.random.default_rng(seed)
    engine = engine or Engine(model.decoder, max_batch=max_batch)
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


@pytest.fixture(scope="module")
def idlm():
    return dlm_jax.load(MODELS / "idlm-tiny", executor="jax")


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["gather", "split"])
@pytest.mark.parametrize("name,model_name,options", CASES, ids=lambda x: x if isinstance(x, str) else None)
def test_every_preset_is_batch_invariant(name, model_name, options, attention):
    """32 held-out prompts, submitted at random steps into a running batch of at most 8."""
    from dlm_jax.executors.jax_executor import JaxExecutor

    model = dlm_jax.load(MODELS / model_name, executor="jax", **LOAD.get(model_name, {}))
    model.executor = JaxExecutor(model.model, attention=attention)
    model.decoder = Decoder(model.executor, model.config)
    cfg = dlm_jax.preset(name, **options)
    prompts = _prompts(model, 32)
    reqs = _staggered(model, cfg, prompts, max_batch=8, seed=2)
    _check(model, cfg, prompts, reqs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fast-dllm-dual", "fast-dllm"])
def test_the_attention_kernel_is_batch_invariant(name, monkeypatch):
    """The same over dlm-jax's attention kernel (`attention="pallas"`, a GPU's candidate default;
    here in Pallas's interpreter, and llada-tiny's 4 query heads over 2 K/V heads stacked two a
    program): rows of other prompt lengths and progress beside a request, their reads padded to
    the cache's slots, leave its tokens as its solo decode's. (Row by row, `rows="each"`, the
    invariant mode: each row's kernel reads its own row of the engine's pooled cache.)"""
    from dlm_jax.executors.jax_executor import JaxExecutor
    from dlm_jax.models import _attention_kernel

    model = dlm_jax.load(MODELS / "llada-tiny", executor="jax")
    model.executor = JaxExecutor(model.model, attention="split")
    model.executor.attention = "pallas"  # (the constructor refuses it off a GPU)
    model.decoder = Decoder(model.executor, model.config)
    traced = []  # (batch, cache slots) of each kernel traced
    real = _attention_kernel.attend_kernel
    monkeypatch.setattr(_attention_kernel, "attend_kernel", lambda q, kc, *rest, **kw: (
        traced.append((q.shape[0], 0 if kc is None else kc.shape[2])) or real(q, kc, *rest, **kw)))
    cfg = dlm_jax.preset(name, gen_len=32, block_len=16)
    prompts = _prompts(model, 8)
    with _attention_kernel.interpret():
        engine = Engine(model.decoder, max_batch=4)
        reqs = _staggered(model, cfg, prompts, max_batch=4, seed=3, engine=engine)
        assert engine.stats.busy_rows > engine.stats.calls  # calls did share rows
        _check(model, cfg, prompts, reqs)
    assert {s for _, s in traced} >= {0, 512}, sorted(set(traced))  # refreshes and the pooled cache's steps


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


class _Recording(Engine):
    """An engine that keeps every output row it hands each request, by prompt."""

    def __init__(self, *args, log: dict, tag: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.log, self.tag = log, tag

    def _advance(self, req, out):
        if out is not None:
            self.log.setdefault((self.tag, tuple(req.prompt.tolist())), []).append(
                b"".join(getattr(out, f).tobytes() for f in ("top_token", "top_prob", "second_prob", "entropy")))
        return super()._advance(req, out)


def test_requests_joining_a_running_batch_decode_byte_for_byte_as_alone(idlm):
    """ISD (rows at their own places; 8-row windows, where the batched forward's low bits moved
    with the batch size in 57 of 59 steps): five requests, each decoded alone in the engine,
    then all submitted at random steps into its running batch of 4: every output of every step
    is the same bytes (`rows="each"`, the CPU default), and so are the tokens, NFE and ISD's
    acceptance counts. Every preset against `Decoder.decode`: `test_every_preset_is_batch_invariant`."""
    assert idlm.executor.rows == "each"
    cfg = dlm_jax.preset("isd", gen_len=16)
    prompts = _prompts(idlm, 5)
    log: dict = {}
    alone = []
    engine = _Recording(idlm.decoder, max_batch=4, log=log, tag="alone")
    for p in prompts:
        alone.append(engine.submit(p, cfg))
        engine.run()
    engine = _Recording(idlm.decoder, max_batch=4, log=log, tag="loaded")
    loaded = _staggered(idlm, cfg, prompts, max_batch=4, seed=1, engine=engine)
    assert engine.stats.busy_rows > engine.stats.calls  # calls did share rows
    for p, a, b in zip(prompts, alone, loaded):
        assert log[("alone", tuple(p))] == log[("loaded", tuple(p))]
        np.testing.assert_array_equal(a.output.sequences[0], b.output.sequences[0])
        assert a.stats.nfe == b.stats.nfe and a.output.stats.speculation == b.output.stats.speculation

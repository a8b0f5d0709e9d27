"""Decode state stays where the step runs (issue 35): on the JAX executor the K/V live in
device arrays the step updates in place, and each step hands the compiled program only its
plan (O(batch x window) plus 4 bytes per read slot), never K/V; the tokens are those of the
dense path, where the host gathers the K/V into every step (`HostKVCache`).

The transfer bound is checked on what actually reaches the compiled programs (a spy on the
executables: NumPy arguments are host-to-device copies, device arrays are not), not on the
cache's own accounting, which is checked against it.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax

import dlm_jax
from dlm_jax.executors.jax_executor import DeviceKVCache, JaxExecutor
from dlm_jax.runtime import Decoder, decode_config, preset
from dlm_jax.runtime.kvcache import HostKVCache
from dlm_jax.runtime.registry import SCHEDULERS

CAUSAL_ONLY = ("isd", "ar")  # causal, logit-shift schedules: tests/techniques/isd/test_isd.py
from dlm_jax.testing import sharp_model

PROMPTS = [[5, 17, 3, 44, 9, 21, 30], [8, 1]]
CONFIGS = {**{f"preset={name}": preset(name, gen_len=64) for name in sorted(dlm_jax.PRESETS)
                 if name not in CAUSAL_ONLY},
           **{f"cache={name}": decode_config(cache=name, gen_len=64, block_len=16) for name in sorted(SCHEDULERS)
                 if name not in CAUSAL_ONLY},
           "llada-cpp in_place": preset("llada-cpp", gen_len=64, revisit="in_place"),
           "llada-cpp sampled": preset("llada-cpp", gen_len=32, temperature=0.7)}
FAST = ("preset=fast-dllm-dual",)  # the default pass (tests/techniques/lladacpp runs DPPR on the device cache); every config with --runslow


def _params(names=sorted(CONFIGS)):
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in names]


class DenseJax(JaxExecutor):
    """The JAX executor fed as before issue 35: the host gathers the K/V into every step."""

    def open(self, config, positions, valid):
        return HostKVCache(self, config, positions, valid)

    def fork(self):
        twin = super().fork()
        twin.__class__ = DenseJax
        return twin


class Spy:
    """Records the host bytes (NumPy arguments) and device arguments of every program call."""

    def __init__(self, executor: JaxExecutor):
        self.calls: list[tuple[str, int, int]] = []  # (program kind, host bytes, device bytes)
        for kind in ("_resident", "_views", "_gathers", "_scatters"):
            programs = getattr(executor, kind)
            programs.get = self._wrap(kind, programs.get)

    def _wrap(self, kind, get):
        def spied_get(key):
            exe = get(key)

            def call(*args):
                leaves = [x for a in args for x in jax.tree.leaves(a)]
                host = sum(x.nbytes for x in leaves if isinstance(x, np.ndarray))
                device = sum(x.nbytes for x in leaves if isinstance(x, jax.Array))
                self.calls.append((kind, host, device))
                return exe(*args)

            return call

        return spied_get


@pytest.fixture(scope="module")
def model():
    return sharp_model()


def _kv_bytes_per_slot(cfg, batch: int) -> int:
    return 2 * cfg.n_layers * batch * cfg.n_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize


@pytest.mark.parametrize("name", _params())
def test_steps_send_their_plan_not_the_cache(model, name):
    cfg = CONFIGS[name]
    executor = JaxExecutor(model)
    decoder = Decoder(executor, model.config)
    spy = Spy(executor)
    fork = decoder.cpu_executor()
    fork_spy = Spy(fork.executor) if fork.threaded else None
    out = decoder.decode(PROMPTS, cfg)
    calls = spy.calls + (fork_spy.calls if fork.threaded else [])
    batch = executor.capabilities.batches.select(len(PROMPTS))
    per_slot = _kv_bytes_per_slot(model.config, batch)
    assert any(kind == "_resident" for kind, _, _ in calls), "no resident program ran"
    for kind, host, _ in calls:
        # Step plans: < 16 bytes per (row, window slot) + 4 per read slot. The widest window
        # and read set hold at most the whole sequence, whose K/V alone are far larger.
        total = max(len(p) for p in PROMPTS) + cfg.gen_len
        # (each batch row sends its own read list, probes and hidden columns: continuous
        # batching, docs/engine.md)
        assert host <= 24 * batch * 2 * total + 4 * batch * total + 64, (kind, host)
        assert host < per_slot * 12, f"{kind}: {host} host bytes, as much as the K/V of 12 slots"
    stats = out.stats
    assert stats.opened_bytes <= 5 * batch * executor.capacity(max(len(p) for p in PROMPTS) + cfg.gen_len)
    # The cache's own accounting is what the programs received.
    assert sum(stats.h2d_bytes) == sum(h for _, h, _ in calls)
    assert max(stats.d2h_bytes) <= batch * executor.capabilities.rows.largest * (16 + (
        4 * model.config.vocab_size if cfg.proposer.needs_logits else 0))


def test_dense_contract_moves_the_read_cache_every_step(model):
    """The control: fed from the host, a cached step sends the K/V it reads."""
    executor = DenseJax(model)
    out = Decoder(executor, model.config).decode(PROMPTS, preset("fast-dllm", gen_len=64))
    per_slot = _kv_bytes_per_slot(model.config, 2)
    assert max(out.stats.h2d_bytes) > 8 * per_slot


def test_the_cache_is_updated_in_place(model):
    executor = JaxExecutor(model)
    state = dlm_jax.runtime.DecodeState.create(PROMPTS, gen_len=16, batch=2, mask_id=model.config.mask_token_id,
                                               vocab_size=model.config.vocab_size, eos_ids=(), shift=0, seeds=[0, 0])
    cache = executor.open(model.config, state.positions, state.valid)
    assert isinstance(cache, DeviceKVCache)
    from dlm_jax.runtime.inputs import StepInputBuilder

    scheduler = decode_config(gen_len=16, block_len=8, cache="prefix").scheduler
    plan = scheduler.plan(state, scheduler.start(state))
    req = StepInputBuilder(model.config, executor.capabilities).build(plan, state, dlm_jax.runtime.OutputRequest())
    before = (*cache.k, *cache.v)
    assert len(cache.k) == len(cache.v) == model.config.n_layers  # one buffer per layer
    cache.step(req)
    assert all(x.is_deleted() for x in before), "the step copied the cache instead of updating it in place (donation)"
    written = np.asarray(cache.written)
    assert written[:, :state.total].all() and not written[:, state.total:].any()
    assert all(isinstance(x, jax.Array) for x in (*cache.k, *cache.v))


@pytest.mark.parametrize("name", _params())
def test_tokens_equal_the_dense_path(model, name):
    cfg = CONFIGS[name]
    prompts = [PROMPTS, [[7] * 19], [[3, 4], [9, 9, 9], [5]]]
    for batch in prompts if name not in FAST else prompts[:1]:
        seeds = list(range(len(batch)))
        dense = Decoder(DenseJax(model), model.config).decode(batch, cfg, seeds=seeds)
        resident = Decoder(JaxExecutor(model), model.config).decode(batch, cfg, seeds=seeds)
        for a, b in zip(dense.sequences, resident.sequences):
            np.testing.assert_array_equal(a, b)
        assert dense.stats.counters == resident.stats.counters, name
        assert dense.stats.request_nfe == resident.stats.request_nfe


def test_stored_rows_land_at_their_slots_and_nothing_else_moves():
    """`scatter_rows` against a NumPy loop: rows stored at their (cache row, slot), padding
    rows (`rows` -1) and unstored entries (`write` -1) dropped, every other slot untouched; the
    dropped entries take distinct slots past the cache, so the scatters may be declared
    unique (XLA:GPU stores each update instead of applying it atomically), and they are."""
    from dlm_jax.executors.jax_executor import scatter_rows

    rng = np.random.default_rng(3)
    layers, pool, heads, slots, dh, b, w = 2, 4, 2, 12, 3, 3, 5
    k = rng.standard_normal((layers, pool, heads, slots, dh)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    written = rng.random((pool, slots)) < 0.3
    k_new = rng.standard_normal((layers, b, w, heads, dh)).astype(np.float32)
    v_new = rng.standard_normal(k_new.shape).astype(np.float32)
    write = np.array([[4, 5, 6, -1, -1], [0, 2, 11, 7, 9], [1, 2, 3, 4, 5]], np.int32)
    rows = np.array([2, 0, -1], np.int32)  # batch row 2 is padding: stores nothing
    want_k, want_v, want_w = k.copy(), v.copy(), written.copy()
    for i in range(b):
        for j in range(w):
            if rows[i] >= 0 and write[i, j] >= 0:
                want_k[:, rows[i], :, write[i, j]] = k_new[:, i, j]
                want_v[:, rows[i], :, write[i, j]] = v_new[:, i, j]
                want_w[rows[i], write[i, j]] = True
    k, v = tuple(k), tuple(v)  # the cache's layers, each a buffer of its own
    got = jax.jit(scatter_rows)(k, v, written, k_new, v_new, write, rows)
    for a, e in zip((np.stack(got[0]), np.stack(got[1]), got[2]), (want_k, want_v, want_w)):
        np.testing.assert_array_equal(np.asarray(a), e)
    hlo = jax.jit(scatter_rows).lower(k, v, written, k_new, v_new, write, rows).as_text()
    scatters = [ln for ln in hlo.splitlines() if "stablehlo.scatter" in ln]
    assert len(scatters) == 2 * layers + 1 and all("unique_indices = true" in ln for ln in scatters), scatters

"""A pooled K/V cache: one cache whose rows hold the requests of a continuous batch, each step's
batch rows mapped to cache rows by `SlotStep.rows` (docs/architecture.md, the step contract).

The silent failures guarded here: a request's outputs or stored K/V changing with the batch
it was merged into (another request's row read, its slots misaligned by per-row `read` /
`probes` / `hide`, a padding row's reductions leaking); a padding row (`rows` -1, clipped to
row 0 by an index) writing into a live request's row; a row handed to a new request
(`KVCache.assign`) still showing its previous occupant's K/V; a read bucket padded with -1
changing an in-place step's outputs although the cache says `read_bucket_free`; and a CPU
path's snapshot written back into the wrong cache row.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.kvcache import HostKVCache
from dlm_jax.runtime.step import OutputRequest, SlotStep
from dlm_jax.testing import sharp_model

POOL = 4
FIELDS = ("top_token", "top_prob", "second_prob", "entropy", "logits")


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@dataclasses.dataclass
class Request:
    """One request's slot grid and two steps: a prompt forward storing the prompt, then a
    decode step reading it (its own read list and lengths, a probe row hiding a cache column
    and a window column) and storing one row."""

    slots: int
    prompt: int
    seed: int

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.slots, dtype=np.int32)

    def steps(self, key: BucketKey, vocab: int) -> tuple[SlotStep, SlotStep]:
        rng = np.random.default_rng(self.seed)
        w, p, r = key.window, key.cache, key.rows

        def make(window: np.ndarray, read: np.ndarray, write: np.ndarray, *, probe: bool) -> SlotStep:
            n = len(window)
            tokens = np.zeros((1, w), np.int32)
            tokens[0, :n] = rng.integers(0, vocab, n)
            pos = np.zeros((1, w), np.int32)
            pos[0, :n] = window
            valid = np.zeros((1, w), bool)
            valid[0, :n] = True
            rd = np.full((1, p), -1, np.int32)
            rd[0, :len(read)] = read
            probes, hide = np.zeros((1, w), bool), np.full((1, w), -1, np.int32)
            wr = np.full((1, w), -1, np.int32)
            wr[0, :len(write)] = write
            if probe:
                probes[0, n - 1] = True
                hide[0, 0] = 1  # a cache column
                hide[0, 1] = p + n - 2  # a window column
            rows = np.zeros((1, r), np.int32)
            rows[0, :n] = np.arange(n)
            return SlotStep(key=dataclasses.replace(key, batch=1), tokens=tokens, positions=pos, q_valid=valid,
                            read=rd, probes=probes, hide=hide, write=wr, logit_rows=rows,
                            want=OutputRequest(kv=False, logits=key.full_logits),
                            read_len=np.array([max(1, len(read) - self.seed % 3)], np.int32))

        prompt = np.arange(self.prompt)
        first = make(prompt, np.zeros(0, np.int32), prompt, probe=False)
        window = np.arange(self.prompt, min(self.slots, self.prompt + w - 2))
        read = rng.permutation(prompt).astype(np.int32)
        second = make(window, read, window[:1], probe=True)
        return first, second


A, B = Request(slots=30, prompt=12, seed=1), Request(slots=40, prompt=20, seed=2)


def merged(steps: list[SlotStep], rows: list[int], batch: int) -> SlotStep:
    """Batch-1 steps of one bucket merged into one step of `batch` rows (padding rows: `rows`
    -1, reading nothing; their `write` points at real slots, which must not be stored)."""
    pad = batch - len(steps)
    key = dataclasses.replace(steps[0].key, batch=batch)

    def cat(name: str, fill) -> np.ndarray:
        parts = [getattr(s, name) for s in steps]
        return np.concatenate(parts + [np.full((pad, *parts[0].shape[1:]), fill, parts[0].dtype)], axis=0)

    return SlotStep(key=key, tokens=cat("tokens", 7), positions=cat("positions", 3), q_valid=cat("q_valid", True),
                    read=cat("read", 0), probes=cat("probes", False), hide=cat("hide", -1),
                    write=cat("write", 2), logit_rows=cat("logit_rows", 0), want=steps[0].want,
                    read_len=cat("read_len", 5), rows=np.array(rows + [-1] * pad, np.int32))


def row(step: SlotStep, b: int, rows: int) -> SlotStep:
    """Batch row `b` of a step, alone (batch 1) on cache row `rows`."""
    one = lambda x: None if x is None else x[b:b + 1]  # noqa: E731
    return dataclasses.replace(step, key=dataclasses.replace(step.key, batch=1), tokens=one(step.tokens),
                               positions=one(step.positions), q_valid=one(step.q_valid), read=one(step.read),
                               probes=one(step.probes), hide=one(step.hide), write=one(step.write),
                               logit_rows=one(step.logit_rows), read_len=one(step.read_len),
                               rows=np.array([rows], np.int32))


def pad_read(step: SlotStep, cache: int) -> SlotStep:
    """`step` with its reads padded with -1 to a `cache` bucket (its window columns of `hide`
    move with the cache columns' end)."""
    p = step.read.shape[1]
    read = np.full((step.read.shape[0], cache), -1, np.int32)
    read[:, :p] = step.read
    hide = np.where(step.hide >= p, step.hide + cache - p, step.hide)
    return dataclasses.replace(step, key=dataclasses.replace(step.key, cache=cache), read=read, hide=hide)


def kv_rows(cache) -> tuple[np.ndarray, np.ndarray]:
    """[L, rows, S, Hkv, Dh] keys and values of either cache."""
    if isinstance(cache, HostKVCache):
        return cache.store.k, cache.store.v
    return np.stack(cache.k).swapaxes(2, 3), np.stack(cache.v).swapaxes(2, 3)


def open_cache(executor: JaxExecutor, host: bool, positions: np.ndarray, valid: np.ndarray):
    if host:  # the JAX executor's dense step under the NumPy cache every dense executor gets
        return HostKVCache(executor, executor.config, positions, valid)
    return executor.open(executor.config, positions, valid)


def solo(executor: JaxExecutor, host: bool, req: Request, steps) -> tuple[list, object]:
    cache = open_cache(executor, host, req.positions[None], np.ones((1, req.slots), bool))
    return [cache.step(s) for s in steps], cache


def pool_cache(executor: JaxExecutor, host: bool, slots: int):
    cache = open_cache(executor, host, np.zeros((POOL, slots), np.int32), np.zeros((POOL, slots), bool))
    cache.assign(3, A.positions, np.ones(A.slots, bool))
    cache.assign(1, B.positions, np.ones(B.slots, bool))
    return cache


def assert_same(x, y, b: int, what: str) -> None:
    for name in FIELDS:
        got, want = getattr(x, name), getattr(y, name)
        if want is not None:
            np.testing.assert_array_equal(got[b:b + 1], want, err_msg=f"{what}: {name}")


KEY = BucketKey(4, 32, 32, 32, full_logits=True)


def assert_close(x, y, b: int, what: str) -> None:
    np.testing.assert_array_equal(x.top_token[b:b + 1], y.top_token, err_msg=what)
    for name in FIELDS[1:]:
        if getattr(y, name) is not None:
            np.testing.assert_allclose(getattr(x, name)[b:b + 1], getattr(y, name), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{what}: {name}")


def alone(executor: JaxExecutor, host: bool, steps, at: int, slots: int):
    """A request alone in the batch-4 bucket of a pool (at cache row `at`, three padding rows)."""
    pool = pool_cache(executor, host, slots)
    return [pool.step(merged([s], [at], 4)) for s in steps], pool


# The NumPy cache's pool also runs under the engine's state machine (tests/runtime/test_engine.py).
@pytest.mark.parametrize("host", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["jax-cache", "numpy-cache"])
def test_merged_requests_give_their_solo_outputs_and_kv_bit_for_bit(model, host):
    """Gathered reads (the CPU's default on the JAX executor; `HostKVCache` over a dense step):
    two requests of other lengths at other places, each alone in the batch-4 bucket of a pool,
    against both merged into one batch-4 step (B in batch row 0, A in row 1, two padding rows)
    at cache rows 1 and 3: every output and the K/V stored bit for bit. Against each request
    on its own batch-1 cache (`executor.open`): the same tokens, the rest to float rounding
    (XLA's CPU GEMM is not batch-invariant: a [32, 32] x [32, 32] product differs in the last
    bit between batch 1 and batch 4)."""
    executor = JaxExecutor(model, attention="gather", rows="batched")
    vocab = model.config.vocab_size
    (a1, a2), (b1, b2) = A.steps(KEY, vocab), B.steps(KEY, vocab)
    solo_a, cache_a = solo(executor, host, A, (a1, a2))
    solo_b, cache_b = solo(executor, host, B, (b1, b2))
    slots = max(cache_a.slots, cache_b.slots)
    alone_a, pool_a = alone(executor, host, (a1, a2), 3, slots)
    alone_b, pool_b = alone(executor, host, (b1, b2), 1, slots)
    pool = pool_cache(executor, host, slots)
    outs = [pool.step(merged([b, a], [1, 3], 4)) for a, b in ((a1, b1), (a2, b2))]
    for i in range(2):
        assert_same(outs[i], _row(alone_a[i], 0), 1, f"A step {i}")
        assert_same(outs[i], _row(alone_b[i], 0), 0, f"B step {i}")
        assert_close(outs[i], solo_a[i], 1, f"A step {i} against its batch-1 cache")
        assert_close(outs[i], solo_b[i], 0, f"B step {i} against its batch-1 cache")
    k, v = kv_rows(pool)
    for req, own, cache, at in ((A, pool_a, cache_a, 3), (B, pool_b, cache_b, 1)):
        ka, va = kv_rows(own)
        np.testing.assert_array_equal(k[:, at], ka[:, at])
        np.testing.assert_array_equal(v[:, at], va[:, at])
        ks, vs = kv_rows(cache)
        np.testing.assert_allclose(k[:, at, :req.slots], ks[:, 0, :req.slots], rtol=1e-5, atol=1e-5)
    # Padding rows (rows -1, `write` pointing at slot 2) stored nothing: rows 0 and 2 stay empty.
    assert not k[:, [0, 2]].any() and not v[:, [0, 2]].any()


def _row(out, b: int):
    """Batch row `b` of a step's outputs."""
    return dataclasses.replace(out, **{n: getattr(out, n)[b:b + 1] for n in FIELDS if getattr(out, n) is not None})


def test_in_place_pool_merges_bit_for_bit_and_ignores_the_read_bucket(model):
    """In-place reads (an accelerator's default): each request alone in the pool's batch-4
    bucket against both merged in one step, and the merged step with its reads padded from a
    32 to a 64 bucket: every output and the K/V stored bit-identical (`read_bucket_free`); the
    same tokens as the gathered step on a request's own batch-1 cache."""
    executor = JaxExecutor(model, attention="split", rows="batched")
    vocab = model.config.vocab_size
    (a1, a2), (b1, b2) = A.steps(KEY, vocab), B.steps(KEY, vocab)
    alone_a, pool_a = alone(executor, False, (a1, a2), 3, 256)
    alone_b, pool_b = alone(executor, False, (b1, b2), 1, 256)
    pool, padded = pool_cache(executor, False, 256), pool_cache(executor, False, 256)
    assert pool.read_bucket_free
    for i, (a, b) in enumerate(((a1, b1), (a2, b2))):
        step = merged([b, a], [1, 3], 4)
        out, wide = pool.step(step), padded.step(pad_read(step, 64))
        for got, what in ((out, "merged"), (wide, "merged, read bucket 64")):
            assert_same(got, _row(alone_a[i], 0), 1, f"A step {i}: {what}")
            assert_same(got, _row(alone_b[i], 0), 0, f"B step {i}: {what}")
    for x, y, z, a, b in zip(kv_rows(pool), kv_rows(padded), kv_rows(pool_a), kv_rows(pool_b), kv_rows(pool)):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x[:, 3], z[:, 3])
        np.testing.assert_array_equal(x[:, 1], a[:, 1])
        assert not b[:, [0, 2]].any()
    gathered, _ = solo(JaxExecutor(model, attention="gather", rows="batched"), False, A, (a1, a2))
    assert_close(alone_a[1], gathered[1], 0, "in place on the pool vs gathered on its own cache")


@pytest.mark.parametrize("host", [False, True], ids=["jax-cache", "numpy-cache"])
def test_assign_forgets_the_previous_occupant(model, host):
    """Row 1 held request B (its prompt stored); handed to A, A's decode step reads slots B
    had written: the outputs are those of a pool whose row 1 never held anything."""
    executor = JaxExecutor(model, attention="gather", rows="batched")
    vocab = model.config.vocab_size
    (_, a2), (b1, _) = A.steps(KEY, vocab), B.steps(KEY, vocab)
    used = pool_cache(executor, host, 256)
    used.step(dataclasses.replace(b1, rows=np.array([1], np.int32)))
    assert kv_rows(used)[0][:, 1].any()
    used.assign(1, A.positions, np.ones(A.slots, bool))
    fresh = pool_cache(executor, host, 256)
    fresh.assign(1, A.positions, np.ones(A.slots, bool))
    step = dataclasses.replace(a2, rows=np.array([1], np.int32))
    assert_same(used.step(step), fresh.step(step), 0, "reused row vs fresh row")
    for x, y in zip(kv_rows(used), kv_rows(fresh)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # llada.cpp's CPU path on the engine: tests/runtime/test_engine_invariance.py (slow) too
@pytest.mark.parametrize("host", [False, True], ids=["jax-cache", "numpy-cache"])
def test_cpu_path_snapshot_and_write_into_a_pool_row(model, host):
    """A CPU path's step (`snapshot`: only written slots count, K/V kept) on a pool row, then
    `write(at=...)` into that row: the outputs and the row's K/V equal the solo cache's."""
    executor = JaxExecutor(model, attention="gather", rows="batched")
    vocab = model.config.vocab_size
    a1, a2 = A.steps(KEY, vocab)
    probe = dataclasses.replace(a2, want=OutputRequest(kv=True), written_only=True,
                                key=dataclasses.replace(a2.key, full_logits=False))
    slots = np.arange(A.prompt, A.prompt + 3)
    keep = np.array([[True, False, True]])
    _, cache = solo(executor, host, A, (a1,))
    ref = cache.snapshot(probe, executor)()
    cache.write(ref.kv, slots, keep)
    pool = pool_cache(executor, host, max(cache.slots, B.slots))
    pool.step(dataclasses.replace(a1, rows=np.array([3], np.int32)))
    got = pool.snapshot(dataclasses.replace(probe, rows=np.array([3], np.int32)), executor)()
    pool.write(got.kv, slots, keep, at=np.array([3]))
    assert_same(got, ref, 0, "snapshot")
    for x, y in zip(kv_rows(pool), kv_rows(cache)):
        np.testing.assert_array_equal(x[:, 3, :A.slots], y[:, 0, :A.slots])
        assert not x[:, [0, 2]].any()


def test_a_shared_read_list_is_the_per_row_form():
    """A [P] read list (and [W] probes / hide) is every batch row's own, broadcast."""
    key = BucketKey(2, 8, 8, 8)
    z = np.zeros((2, 8), np.int32)
    step = SlotStep(key=key, tokens=z, positions=z, q_valid=z > 0, read=np.arange(8, dtype=np.int32),
                    probes=np.zeros(8, bool), hide=np.full(8, -1, np.int32), write=z - 1, logit_rows=z)
    assert step.read.shape == (2, 8) and step.probes.shape == (2, 8) and step.hide.shape == (2, 8)
    np.testing.assert_array_equal(step.arrays()["rows"], [0, 1])

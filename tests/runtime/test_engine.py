"""The continuous-batching engine (`dlm_jax.runtime.engine`) over a scripted executor whose
predictions hash everything a row sees: requests arrive, finish and are cancelled at random
steps, at random batch sizes; rows and K/V slots are never shared, every request ends once,
and each finished request's tokens are its solo decode's (so no request read another's
slots)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dlm_jax._errors import ConfigError, InputError
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.runtime.engine import CANCELLED, DONE, ENDS, Engine, merge, split
from dlm_jax.runtime.registry import preset
from dlm_jax.runtime.step import Capabilities, StepOutputs
from dlm_jax.testing import ToyCausalExecutor, echo_kv, tiny_config

V = 5  # the toy's tokens 0..V-1; the tiny config's EOS (62) and mask (63) lie past them
_rng = np.random.default_rng(7)
CLEAN = np.log(_rng.dirichlet(np.ones(V), size=V))  # next token | last clean token
MASK_ROWS = np.log(_rng.dirichlet(np.ones(V), size=(V, 3)))  # | last clean token, distance
CFG = tiny_config(attention="causal", logit_shift=True, block_size=4)

# Requests of every schedule the toy decodes: options that change only a row (threshold,
# generation length, sampling, seed) and options that change the step's shape (cache mode,
# block length, logits for sampling) mixed in one engine.
OPTIONS = [
    ("fast-dllm", dict(block_len=4, threshold=0.5)),
    ("fast-dllm", dict(block_len=8, threshold=0.9)),
    ("fast-dllm-dual", dict(block_len=4, threshold=0.6)),
    ("llada", dict(block_len=4)),
    ("frechet", dict(block_len=4)),
    ("fast-dllm", dict(block_len=4, temperature=1.0)),
    ("isd", dict(stride=3)),
    ("ar", {}),
]


class Hashing(ToyCausalExecutor):
    """A scripted model whose every prediction hashes everything its row sees: the (token,
    position) of each visible key, cached or in the window, and the query's position; so a
    row that read one slot of another request, or missed one of its own, predicts otherwise.
    The top token is the hash mod V; its probability spreads over [0.2, 0.99)."""

    def step(self, inputs, *, timings=None):
        cfg = self.config
        b, w = inputs.tokens.shape
        key_tok = np.concatenate([inputs.k_cache[0, :, :, 0, 0], inputs.tokens], axis=1).astype(np.int64)
        key_pos = np.concatenate([inputs.v_cache[0, :, :, 0, 0], inputs.positions], axis=1).astype(np.int64)
        r = inputs.logit_rows.shape[1]
        seen = np.take_along_axis(inputs.visibility, inputs.logit_rows[:, :, None], axis=1)  # [B, R, P+W]
        weight = np.where(key_tok != cfg.mask_token_id, (key_tok + 1) * (key_pos + 3) % 9973, 5)  # [B, P+W]
        h = (np.einsum("brk,bk->br", seen.astype(np.int64), weight)
             + 7 * np.take_along_axis(inputs.positions, inputs.logit_rows, axis=1)) % 9973
        top = (h % V).astype(np.int32)
        prob = 0.2 + 0.79 * ((h // V) % 100) / 100.0
        logits = np.full((b, r, cfg.vocab_size), -np.inf)
        logits[..., :V] = np.log((1.0 - prob[..., None]) / (V - 1))
        np.put_along_axis(logits, top[..., None], np.log(prob)[..., None], axis=-1)
        second = (1.0 - prob) / (V - 1)
        entropy = -(prob * np.log(prob) + (1.0 - prob) * np.log(np.maximum(second, 1e-300)))
        out = {"top_token": top, "top_prob": prob.astype(np.float32), "second_prob": second.astype(np.float32),
               "entropy": entropy.astype(np.float32)}
        out.update(echo_kv(cfg, inputs))
        if inputs.want.logits:
            out["logits"] = logits.astype(np.float32)
        return StepOutputs.from_named(out)


def _decoder(executor_cls=None) -> Decoder:
    caps = Capabilities.for_length(CFG.max_seq_len, batches=(1, 2, 4, 8))
    return Decoder((executor_cls or Hashing)(CFG, clean=CLEAN, mask=MASK_ROWS, capabilities=caps), CFG)


_SOLO: dict = {}


def solo(prompt: tuple[int, ...], option: int, gen_len: int, seed: int) -> np.ndarray:
    """The request decoded alone by `Decoder.decode` (a fixed batch of one), cut at EOS."""
    key = (prompt, option, gen_len, seed)
    if key not in _SOLO:
        name, opts = OPTIONS[option]
        out = _decoder().decode([list(prompt)], preset(name, gen_len=gen_len, **opts), seeds=[seed])
        _SOLO[key] = out.sequences[0]
    return _SOLO[key]


class EngineMachine(RuleBasedStateMachine):
    @initialize(max_batch=st.integers(1, 5))
    def start(self, max_batch):
        self.engine = Engine(_decoder(), max_batch=max_batch)
        self.requests = []  # (request, prompt, option, gen_len, seed)
        self.ends: dict[int, int] = {}  # request id -> end events seen
        self.cancelled_at: dict[int, int] = {}  # request id -> engine tick when cancelled

    @rule(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=10), option=st.integers(0, len(OPTIONS) - 1),
          gen_len=st.sampled_from([8, 16]), seed=st.integers(0, 3))
    def submit(self, prompt, option, gen_len, seed):
        name, opts = OPTIONS[option]
        req = self.engine.submit(prompt, preset(name, gen_len=gen_len, **opts), seed=seed)
        self.requests.append((req, tuple(prompt), option, gen_len, seed))

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            self.engine.step()
        self._drain()

    @precondition(lambda self: any(not r.done for r, *_ in self.requests))
    @rule(data=st.data())
    def cancel(self, data):
        live = [r for r, *_ in self.requests if not r.done]
        req = data.draw(st.sampled_from(live))
        req.cancel()
        self.cancelled_at[req.id] = self.engine.stats.ticks
        self.engine.step()  # the next step retires it and frees its row
        assert req.status == CANCELLED or req.done
        assert req not in self.engine._running.values()
        self._drain()

    def _drain(self):
        for req, *_ in self.requests:
            while req._events:
                if req._events.popleft().end is not None:
                    self.ends[req.id] = self.ends.get(req.id, 0) + 1

    @invariant()
    def rows_are_not_shared(self):
        if not hasattr(self, "engine"):
            return
        running = self.engine._running
        assert len(running) <= self.engine.max_batch
        assert all(0 <= row < self.engine.max_batch and req._row == row and req.status == "running"
                   for row, req in running.items())
        assert len({id(r) for r in running.values()}) == len(running)

    @invariant()
    def each_request_ends_once(self):
        if not hasattr(self, "engine"):
            return
        for req, *_ in self.requests:
            assert self.ends.get(req.id, 0) == (1 if req.done else 0) or req._events

    @invariant()
    def finished_requests_equal_their_solo_decode(self):
        if not hasattr(self, "engine"):
            return
        for req, prompt, option, gen_len, seed in self.requests:
            if req.status == DONE and not getattr(req, "_checked", False):
                want = solo(prompt, option, gen_len, seed)
                np.testing.assert_array_equal(req.output.sequences[0], want)
                req._checked = True

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        self.engine.run()
        self._drain()
        for req, *_ in self.requests:
            assert req.status in ENDS
            assert self.ends.get(req.id, 0) == 1
        self.finished_requests_equal_their_solo_decode()
        self.engine.close()


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_a_request_that_cannot_be_served_is_refused_at_submit():
    """A prompt too long for a row, ids outside the vocabulary and options the model cannot
    decode are refused by `submit`, with the limit named, before the request takes a row."""
    engine = Engine(_decoder(), max_batch=2, max_tokens=40)
    with pytest.raises(ConfigError, match=r"prompt \(30 tokens\) \+ gen_len \(16\) = 46 tokens exceeds the "
                                          r"engine's 40 slots"):
        engine.submit([1] * 30, preset("fast-dllm", gen_len=16, block_len=4))
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        engine.submit([1, 99], preset("fast-dllm", gen_len=8, block_len=4))
    with pytest.raises(ConfigError, match="block_len=5 must divide gen_len=8"):
        engine.submit([1], preset("fast-dllm", gen_len=8, block_len=5))
    assert engine.idle and engine.stats.admitted == 0


def test_a_full_queue_refuses_at_submit():
    engine = Engine(_decoder(), max_batch=1, max_waiting=2)
    cfg = preset("fast-dllm", gen_len=8, block_len=4)
    for _ in range(2):
        engine.submit([1], cfg)
    with pytest.raises(ConfigError, match=r"queue is full \(2 requests waiting\)"):
        engine.submit([1], cfg)


def test_a_fault_outside_any_request_fails_those_it_reached_and_the_thread_serves_on():
    """Regression: an exception in a tick outside any one request's step (the executor failing
    to open the engine's cache, say) killed the background thread, and every request then
    waited forever. Now the requests it reached fail with the error and later ones are served."""
    dec = _decoder()
    real_open, fails = dec.executor.open, [True]

    def open_(*args):
        if fails.pop(0) if fails else False:
            raise MemoryError("no room for the cache")
        return real_open(*args)

    dec.executor.open = open_
    engine = Engine(dec, max_batch=2)
    engine.start()
    try:
        cfg = preset("fast-dllm", gen_len=8, block_len=4)
        first = engine.submit([1, 2], cfg)
        with pytest.raises(MemoryError, match="no room"):
            first.result(timeout=30)
        assert first.status == "failed"
        second = engine.submit([1, 2], cfg)
        alone = _decoder().decode([[1, 2]], cfg).sequences[0]
        np.testing.assert_array_equal(second.result(timeout=30), alone[:len(second.tokens())])
        assert len(second.tokens()) > 0
        assert second.status == DONE
    finally:
        engine.close()


def test_rows_are_reused_and_every_row_is_busy_while_requests_wait():
    """Eight requests through two rows: a row freed by one request takes the next at once, so
    while requests wait no call runs a padding row."""
    engine = Engine(_decoder(), max_batch=2)
    cfg = preset("fast-dllm-dual", gen_len=8, block_len=4, threshold=0.9)
    reqs = [engine.submit([1 + i % 3, 2], cfg) for i in range(8)]
    engine.run()
    assert all(r.status == DONE for r in reqs)
    assert engine.stats.admitted == 8
    assert {r._row for r in reqs} == {0, 1}
    for r in reqs:
        np.testing.assert_array_equal(r.output.sequences[0], solo(tuple(r.prompt.tolist()), 2, 8, 0))


def test_merge_and_split_keep_each_row():
    """A call merged from steps of several cache sizes pads each row's reads with -1 and moves
    its hidden window columns with them; splitting the outputs gives each step its own row."""
    import dataclasses

    from dlm_jax.runtime.buckets import BucketKey
    from dlm_jax.runtime.step import SlotStep, StepOutputs

    def step(p, w, hide_col):
        return SlotStep(key=BucketKey(1, w, p, 2), tokens=np.arange(w, dtype=np.int32)[None] + p,
                        positions=np.arange(w, dtype=np.int32)[None], q_valid=np.ones((1, w), bool),
                        read=np.arange(p, dtype=np.int32)[None], probes=np.zeros((1, w), bool),
                        hide=np.array([[hide_col] + [-1] * (w - 1)], np.int32), write=np.full((1, w), -1, np.int32),
                        logit_rows=np.zeros((1, 2), np.int32))

    a, b = step(8, 4, 8 + 1), step(16, 4, 3)  # a hides its window row 1; b a cache column
    m = merge([a, b], [5, 2], 4, mask_id=63)
    assert m.key == BucketKey(4, 4, 16, 2)
    assert m.rows.tolist() == [5, 2, -1, -1]
    assert m.read[0].tolist() == list(range(8)) + [-1] * 8 and m.read[2].tolist() == [-1] * 16
    assert m.hide[0, 0] == 16 + 1 and m.hide[1, 0] == 3
    assert m.read_len.tolist() == [8, 16, 0, 0]
    assert (m.tokens[2:] == 63).all() and not m.q_valid[2:].any() and (m.write[2:] == -1).all()
    out = StepOutputs(top_token=np.arange(8, dtype=np.int32).reshape(4, 2), top_prob=np.zeros((4, 2), np.float32),
                      second_prob=np.zeros((4, 2), np.float32), entropy=np.zeros((4, 2), np.float32))
    assert split(out, 1).top_token.tolist() == [[2, 3]]
    assert dataclasses.replace(split(out, 0)).top_token.shape == (1, 2)


class TwoReplicas(Hashing):
    engine_replicas = 2  # as a JAX executor on a dp=2 mesh


def test_requests_are_placed_by_replica_and_each_call_laid_out_per_replica(monkeypatch):
    """On an executor of two replicas (a mesh's dp) each request takes a row of the replica
    running fewer, and every call's batch splits in two equal chunks, chunk d holding replica
    d's requests first: the layout a per-replica step runs (`replica_local`); each request
    still decodes its solo tokens."""
    from dlm_jax.executors.jax_executor import replica_local
    from dlm_jax.runtime import engine as engine_mod

    calls = []

    def recorded(*args, **kwargs):
        calls.append(merge(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(engine_mod, "merge", recorded)
    engine = Engine(_decoder(TwoReplicas), max_batch=4)
    assert engine.replicas == 2
    jobs = [([1 + i % 3, 2, i % 2], i % 3, 8 if i % 2 else 16) for i in range(7)]
    reqs = [engine.submit(p, preset(OPTIONS[o][0], gen_len=g, **OPTIONS[o][1])) for p, o, g in jobs]
    engine.step()
    assert sorted(r._row for r in reqs[:4]) == [0, 1, 2, 3] and {reqs[0]._row, reqs[1]._row} == {0, 2}
    engine.run()
    assert all(r.status == DONE for r in reqs)
    for r, (p, o, g) in zip(reqs, jobs):
        np.testing.assert_array_equal(r.output.sequences[0], solo(tuple(p), o, g, 0))
    assert calls and all(c.key.batch % 2 == 0 and replica_local(c.rows, 4, 2) for c in calls)
    assert any((c.rows[c.key.batch // 2:] >= 0).any() and (c.rows[:c.key.batch // 2] >= 0).any() for c in calls)
    assert Engine(_decoder(TwoReplicas), max_batch=3).replicas == 1  # 3 rows split in no two equal replicas


def test_replica_local_rows():
    from dlm_jax.executors.jax_executor import replica_local

    assert replica_local(np.array([0, 1, -1, 2, -1, -1]), 4, 2)  # chunks [0 1 -1] and [2 -1 -1]
    assert not replica_local(np.array([0, 2, -1, 3]), 4, 2)  # cache row 2 is replica 1's
    assert not replica_local(np.array([-1, 0, 2, -1]), 4, 2)  # a padding row before a live one
    assert not replica_local(np.array([0, 1, 2]), 4, 2)  # 3 batch rows split in no two chunks
    assert replica_local(np.arange(8), 8, 4) and not replica_local(np.arange(8), 8, 1)

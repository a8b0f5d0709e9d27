"""The decode loop over a scripted executor (`dlm_jax.testing.MockExecutor`): commits that can
be worked out by hand, the plans each scheduler sends, warm-up, buckets, token and request
states, the K/V store, sampling and bad input. No model, no JAX."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlm_jax import ConfigError
from dlm_jax.runtime.kvcache import HostKVCache
from dlm_jax.runtime import (BucketKey, Capabilities, DecodeState, Decoder, KVStore, OutputRequest, Proposer,
                             RequestStatus, StepInputBuilder, StepOutputs, StepPlan, TokenState, confidence_scores,
                             decode_config)
from dlm_jax.testing import EOS, MockExecutor, tiny_config

CFG = tiny_config()
ANSWER = 10 + np.arange(CFG.max_seq_len) % 40  # the token each position is predicted to be


def mock(confidence, answer=ANSWER, capabilities=None, **overrides):
    cfg = tiny_config(**overrides) if overrides else CFG
    exe = MockExecutor(cfg, answer=answer, confidence=confidence, capabilities=capabilities)
    return exe, Decoder(exe, cfg)


def committed_per_step(exe, targets):
    """For each step, which of `targets` were fed as tokens (committed before that step)."""
    out = []
    for inputs in exe.calls:
        pos = list(inputs.positions[0])
        out.append([int(inputs.tokens[0, pos.index(t)] != CFG.mask_token_id) for t in targets])
    return out


def test_threshold_commits_worked_out_by_hand():
    """Prompt of 2, one block of 8 at positions 2..9 with confidences
    .95 .5 .92 .3 .99 .6 .7 .91: step 1 commits the four >= 0.9 (positions 2, 4, 6, 9); then
    nothing reaches 0.9, so each step commits the best one left: 8 (.7), 7 (.6), 3 (.5), 5 (.3)."""
    conf = np.zeros(CFG.max_seq_len)
    conf[2:10] = [0.95, 0.5, 0.92, 0.3, 0.99, 0.6, 0.7, 0.91]
    exe, dec = mock(conf)
    out = dec.decode([[1, 2]], decode_config(gen_len=8, block_len=8, cache="prefix", threshold=0.9))
    np.testing.assert_array_equal(out.sequences[0], ANSWER[2:10])
    assert out.stats.nfe == 5 and out.stats.commit_histogram == {4: 1, 1: 4}
    seen = committed_per_step(exe, range(2, 10))
    assert seen[1] == [1, 0, 1, 0, 1, 0, 0, 1]  # fed at step 2: what step 1 committed
    assert seen[2] == [1, 0, 1, 0, 1, 0, 1, 1]
    assert seen[4] == [1, 1, 1, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("cache, shapes", [
    # (window, cache, rows) live sizes; prompt 3 + 16 generated = 19 slots, blocks [3, 11) and [11, 19).
    ("none", {(19, 0, 8)}),
    ("prefix", {(19, 0, 8), (16, 3, 8), (8, 11, 8)}),
    ("dual", {(19, 0, 8), (8, 11, 8)}),
])
def test_each_scheduler_plans_what_it_states(cache, shapes):
    """The steps a decode runs are exactly the plan shapes the scheduler states for warm-up,
    in the buckets warm-up prepares; K/V are asked for only by steps that store them."""
    exe, dec = mock(np.full(CFG.max_seq_len, 0.5))
    cfg = decode_config(gen_len=16, block_len=8, cache=cache)
    assert cfg.scheduler.plan_shapes([3], 16, shift=0) == shapes
    assert dec.warmup([3], cfg) == len(exe.warmed) == len({exe.capabilities.select(
        batch=1, window=w, cache=p, rows=r) for w, p, r in shapes})
    dec.decode([[1, 2, 3]], cfg)
    assert {i.key for i in exe.calls} == exe.warmed
    stores = [i.want.kv for i in exe.calls]
    assert sum(stores) == (0 if cache == "none" else 2)
    assert all(i.k_cache.shape[2] == 0 for i, kv in zip(exe.calls, stores) if kv)  # full forwards


@settings(max_examples=300, deadline=None)
@given(cache=st.sampled_from(["none", "prefix", "dual"]), block=st.integers(1, 12), units=st.integers(1, 5),
       prompts=st.lists(st.integers(1, 40), min_size=1, max_size=4), align=st.booleans(),
       infill=st.integers(0, 9), shift=st.integers(0, 1))
def test_plan_shapes_counted_are_the_plans_shapes(cache, block, units, prompts, align, infill, shift):
    """`plan_shapes` counts each step's window, cache and rows from the block's bounds
    (`BlockScheduler._shape`, `window_lengths`: a warm-up asks for every prompt length a row
    holds) without building the slots: the same shapes as the plans a decode runs
    (`_plan`), over blocks aligned or not, prompts whose blocks sit apart, a suffix's slots
    and a logit shift."""
    sched = decode_config(gen_len=block * units, block_len=block, cache=cache).scheduler
    sched = dataclasses.replace(sched, align=align, infill=0 if align else infill)
    gen = block * units
    p_max = max(prompts)
    leads = sched._leads(prompts) if align else ()
    planned = {sched._plan(unit, step, p_max, p_max + gen + sched.overhang(), shift, leads=leads).shape
               for unit in range(sched._units(gen, leads)) for step in (0, 1)}
    assert sched.plan_shapes(prompts, gen, shift=shift) == planned


def test_a_schedule_with_a_window_of_its_own_plans_its_own_shapes():
    """A subclass that changes a cache mode's `window` (and not `window_lengths`) is not
    counted by its base's arithmetic: `plan_shapes` still gives its plans' shapes."""
    from dlm_jax.runtime.scheduler import DualCache

    @dataclasses.dataclass(frozen=True)
    class WiderDual(DualCache):  # each later step computes one more slot after its block
        def window(self, step, start, end, total):
            window, cached, store = super().window(step, start, min(end + 1, total) if step else end, total)
            return window, cached, store

    sched = WiderDual(block_len=4)
    planned = {sched._plan(unit, step, 5, 5 + 12, 0).shape for unit in range(3) for step in (0, 1)}
    assert sched.plan_shapes([5], 12, shift=0) == planned
    assert planned != DualCache(block_len=4).plan_shapes([5], 12, shift=0)  # (else nothing is checked)


def test_logit_shift_plans_predict_the_next_slot():
    """With logit shift, row i predicts slot i + 1: the block's first slot is predicted from
    the last prompt token's row, so the cached window starts one slot early."""
    exe, dec = mock(np.full(CFG.max_seq_len, 0.99), logit_shift=True, attention="causal")
    cfg = decode_config(gen_len=8, block_len=8, cache="dual", threshold=0.999)
    assert cfg.scheduler.plan_shapes([3], 8, shift=1) == {(11, 0, 8), (9, 2, 8)}
    out = dec.decode([[1, 2, 3]], cfg)
    np.testing.assert_array_equal(out.sequences[0], ANSWER[3:11])  # predicted position = row + 1
    second = exe.calls[1]
    assert second.positions[0, :9].tolist() == list(range(2, 11))
    assert second.logit_rows[0, :8].tolist() == list(range(8))


def test_states_after_a_decode_and_an_eos_stop():
    """Generated slots end STABLE; a block decoded entirely to EOS stops its request, whose
    later slots become EOS without further steps, while the other request runs on."""
    answer = ANSWER.copy()
    answer[2:6] = EOS  # request 0 (prompt 2): its first block is all EOS
    exe, dec = mock(np.full(CFG.max_seq_len, 0.95), answer=answer)
    cfg = decode_config(gen_len=12, block_len=4)
    blocks = []
    out = dec.decode([[1, 2], [3, 4, 5, 6]], cfg, on_block=lambda i, seqs: blocks.append(i))
    assert (out.sequences[0] == EOS).all()
    assert blocks == [0, 1, 2]
    assert out.stats.request_nfe[0] < out.stats.request_nfe[1]
    alone = mock(np.full(CFG.max_seq_len, 0.95), answer=answer)[1].decode([[1, 2]], cfg)
    assert alone.stats.nfe == 1 and (alone.sequences[0] == EOS).all()
    never = dec.decode([[1, 2]], decode_config(cfg, stop_on_eos_block=False))
    assert never.stats.nfe == 3 and (never.sequences[0][4:] != EOS).all()


def test_any_of_several_eos_ids_ends_a_request():
    """Llama-3 style `eos_token_id` lists: a block of mixed EOS ids stops the request (later
    slots take the first id), deferral scores each of them lowest, and the API cuts a
    completion at the first of any."""
    from dlm_jax.testing import mock_model

    answer = np.full(CFG.max_seq_len, ord("7"))
    answer[5:7] = 263  # prompt of 3: generated slots 3-4 '77', then EOS ids 263 / 258 only
    answer[7:11] = [258, 263, 258, 258]
    handle = mock_model(answer=answer, confidence=np.full(CFG.max_seq_len, 0.95), eos_token_id=[258, 263])
    assert handle.config.eos_ids == (258, 263)
    res = handle.generate([1, 2, 3], decode_config(gen_len=12, block_len=4))
    assert res.token_ids == [[55, 55]] and res.texts == ["77"]
    assert res.stats.nfe == 2  # the second block (all EOS ids) ends the request: no third step
    out = StepOutputs(top_token=np.array([[263, 7, 258, 9]], np.int32), top_prob=np.full((1, 4), 0.9, np.float32),
                      second_prob=np.full((1, 4), 0.01, np.float32), entropy=np.zeros((1, 4), np.float32))
    state = DecodeState.create([[1]], gen_len=4, batch=1, mask_id=259, vocab_size=264, eos_ids=(258, 263))
    deferred = Proposer(defer_eos=True).propose(out, np.ones((1, 4), bool), state).confidence
    assert deferred[0].tolist() == pytest.approx([0.0, 0.9, 0.0, 0.9])


def test_token_and_request_states():
    state = DecodeState.create([[7, 8, 9], [5]], gen_len=4, batch=4, mask_id=63, vocab_size=64, eos_ids=(EOS,))
    assert state.total == 7 and state.gen_start == 3 and state.n_requests == 2
    assert state.request.tolist() == [RequestStatus.RUNNING] * 2 + [RequestStatus.PADDING] * 2
    assert state.valid[1].tolist() == [False, False, True, True, True, True, True]
    assert state.positions[1, 2:].tolist() == [0, 1, 2, 3, 4]  # counted over real tokens
    slots = np.arange(3, 7)
    assert state.undecided(slots).tolist() == [[True] * 4, [True] * 4, [False] * 4, [False] * 4]
    chosen = np.array([[True, False, False, False]] * 4)
    state.commit(slots, chosen, np.full((4, 4), 11))
    assert state.status[0, 3] == TokenState.COMMITTED == TokenState.STABLE
    assert state.fed_tokens(slots)[0].tolist() == [11, 63, 63, 63]
    state.status[0, 4] = TokenState.CANDIDATE  # proposed, still invisible: fed as the mask
    state.tokens[0, 4] = 12
    assert state.fed_tokens(slots)[0].tolist() == [11, 63, 63, 63]
    assert state.undecided(slots)[0].tolist() == [False, True, True, True]
    state.status[0, 4] = TokenState.VISIBLE
    assert state.fed_tokens(slots)[0].tolist() == [11, 12, 63, 63]
    assert state.is_final(np.arange(0, 5))[0].tolist() == [True, True, True, True, False]


def test_store_versions_and_stability():
    store = KVStore(n_layers=1, batch=1, slots=6, n_kv_heads=1, head_dim=2)
    k = np.arange(12, dtype=np.float32).reshape(1, 1, 6, 1, 2)
    store.write(np.arange(6), k, k, stable=np.array([[True] * 3 + [False] * 3]))
    assert store.version.tolist() == [[1] * 6] and store.stable.tolist() == [[True] * 3 + [False] * 3]
    first, _ = store.gather(np.array([0, 2, 5]), 4)
    assert first.shape == (1, 1, 4, 1, 2) and first[0, 0, :, 0, 0].tolist() == [0, 4, 10, 0]
    assert store.gather(np.array([0, 2, 5]), 4)[0] is first  # unchanged slots and versions: reused
    store.write(np.array([2]), k[:, :, :1] + 100, k[:, :, :1], stable=True)
    again, _ = store.gather(np.array([0, 2, 5]), 4)
    assert again is not first and again[0, 0, 1, 0, 0] == 100 and store.version[0, 2] == 2


def test_inputs_are_never_reused_across_plans_with_equal_endpoints():
    """The silent failure: step inputs reused by a key of endpoints (first/last slot, count)
    would feed one plan's positions, visibility and cache to another plan with the same
    endpoints but other slots inside: plausible tokens, wrong model, no error."""
    state = DecodeState.create([list(range(1, 9))], gen_len=8, batch=1, mask_id=63, vocab_size=64)
    cache = HostKVCache(None, CFG, state.positions, state.valid)
    store = cache.store
    kv = np.random.default_rng(0).normal(size=(CFG.n_layers, 1, 16, CFG.n_kv_heads, CFG.head_dim)).astype(np.float32)
    store.write(np.arange(16), kv, kv, stable=True)
    builder = StepInputBuilder(CFG, Capabilities.for_length(CFG.max_seq_len))
    window, rows, targets = np.arange(8, 16), np.arange(8), np.arange(8, 16)
    a = StepPlan(window, np.array([0, 1, 2, 3, 7]), rows, targets, unit=0, step=1)
    b = StepPlan(window, np.array([0, 4, 5, 6, 7]), rows, targets, unit=0, step=1)  # same ends and count

    def inputs(plan):
        return cache._inputs(builder.build(plan, state, OutputRequest(kv=False)), kv=False)

    ia, ib = inputs(a), inputs(b)
    assert not np.array_equal(ia.k_cache, ib.k_cache)
    np.testing.assert_array_equal(ib.k_cache[:, :, :5], kv[:, :, [0, 4, 5, 6, 7]])
    # A write to a cached slot between two steps of one plan reaches the second step.
    store.write(np.array([4]), kv[:, :, :1] + 1, kv[:, :, :1], stable=True)
    ib2 = inputs(b)
    np.testing.assert_array_equal(ib2.k_cache[:, :, 1], kv[:, :, 0] + 1)
    # Same slots, same versions: the padded inputs are reused, not rebuilt.
    assert inputs(b).visibility is ib2.visibility


def test_fixed_bucket_sets_are_honoured_and_a_missing_bucket_is_named():
    """A LiteRT bundle runs a fixed set of buckets: the decoder picks from it, and a decode
    that needs a bucket the set lacks fails before its first step, naming the bucket it
    needs and the nearest one there is."""
    keys = [BucketKey(1, 32, 0, 8), BucketKey(1, 8, 32, 8)]  # a dual-cache bundle
    exe, dec = mock(np.full(CFG.max_seq_len, 0.5), capabilities=Capabilities.from_keys(keys))
    out = dec.decode([[1, 2, 3]], decode_config(gen_len=16, block_len=8, cache="dual"))
    assert {i.key for i in exe.calls} == set(keys) and out.stats.nfe > 2
    exe.calls.clear()
    with pytest.raises(ConfigError, match=r"no bucket of this executor holds a step of batch=1, window=16, "
                                          r"cache=3, rows=8 \(needs at least b1_w16_p3_r8\); nearest available: "
                                          r"b1_w32_p0_r8 \(2 buckets\)"):
        dec.decode([[1, 2, 3]], decode_config(gen_len=16, block_len=8, cache="prefix"))
    # The longest sequence a fixed set holds is its largest cache + window (8 + 32).
    with pytest.raises(ConfigError, match=r"= 46 tokens exceeds the limit of 40"):
        dec.decode([[1] * 30], decode_config(gen_len=16, block_len=8))
    with pytest.raises(ConfigError, match=r"cannot return logits \(needed for sampling"):
        dec.decode([[1, 2, 3]], decode_config(gen_len=8, block_len=8, temperature=1.0))
    assert not exe.calls  # nothing ran


def test_sampling_is_seeded_per_request():
    exe, dec = mock(np.full(CFG.max_seq_len, 0.3))
    cfg = decode_config(gen_len=16, block_len=8, temperature=1.0, stop_on_eos_block=False)
    prompts = [[5, 17, 3], [8, 1], [40, 41, 42, 43]]
    a = dec.decode(prompts, cfg, seeds=[3, 4, 5])
    b = dec.decode([prompts[1]], cfg, seeds=[4])
    np.testing.assert_array_equal(a.sequences[1], b.sequences[0])
    assert a.stats.request_nfe[1] == b.stats.nfe
    # The noise is real: other seeds give other samples, and greedy gives the script.
    others = [dec.decode([prompts[1]], cfg, seeds=[s]).sequences[0] for s in range(4)]
    assert any(not np.array_equal(others[0], o) for o in others[1:])
    greedy = dec.decode([prompts[1]], decode_config(cfg, temperature=0.0)).sequences[0]
    np.testing.assert_array_equal(greedy, ANSWER[2:18])


def test_confidence_kinds():
    top1 = np.array([[0.7, 0.4]])
    top2 = np.array([[0.2, 0.35]])
    ent = np.array([[0.5, 1.2]])
    np.testing.assert_allclose(confidence_scores("prob", top1, top2, ent), [[0.7, 0.4]])
    np.testing.assert_allclose(confidence_scores("margin", top1, top2, ent), [[0.5, 0.05]])
    np.testing.assert_allclose(confidence_scores("entropy", top1, top2, ent), [[-0.5, -1.2]])
    out = confidence_scores("prob", top1.astype(np.float32), None, None)
    assert out.dtype == np.float64 and out.shape == (1, 2)


def test_confidence_kind_errors():
    top1 = np.array([[0.7]])
    with pytest.raises(ConfigError, match="'topk_margin'"):
        confidence_scores("topk_margin", top1, top1, top1)
    with pytest.raises(ValueError, match="top2_prob"):
        confidence_scores("margin", top1, None, None)
    with pytest.raises(ValueError, match="entropy"):
        confidence_scores("entropy", top1, None, None)


def test_deferred_eos_ranks_eos_last():
    """LLaDA's confidence_eos_eot_inf: a slot proposed as EOS gets the lowest confidence,
    so any rule commits it after every other candidate."""
    out = StepOutputs(top_token=np.array([[EOS, 7, EOS, 9]], np.int32),
                      top_prob=np.array([[0.99, 0.6, 0.95, 0.5]], np.float32),
                      second_prob=np.full((1, 4), 0.01, np.float32), entropy=np.array([[0.1, 1.0, 0.2, 1.2]], np.float32))
    state = DecodeState.create([[1]], gen_len=4, batch=1, mask_id=63, vocab_size=64, eos_ids=(EOS,))
    cand = np.ones((1, 4), bool)
    plain = Proposer().propose(out, cand, state).confidence
    deferred = Proposer(defer_eos=True).propose(out, cand, state).confidence
    assert np.argsort(-plain[0], kind="stable")[:2].tolist() == [0, 2]
    assert np.argsort(-deferred[0], kind="stable")[:2].tolist() == [1, 3]
    ent = Proposer(defer_eos=True, confidence="entropy").propose(out, cand, state).confidence
    assert ent[0].tolist() == pytest.approx([-np.log(64), -1.0, -np.log(64), -1.2])


def test_a_rule_that_never_finishes_is_stopped():
    from dlm_jax.runtime.commit import PerStepRule

    class Lazy(PerStepRule):
        def select(self, confidence, candidates, *, step=0):
            return np.zeros_like(candidates)

    exe, dec = mock(np.full(CFG.max_seq_len, 0.5))
    with pytest.raises(RuntimeError, match="left unit 0 unfinished after 8 steps"):
        dec.decode([[1, 2]], decode_config(gen_len=8, block_len=8, rule=Lazy()))


def test_bad_input():
    exe, dec = mock(np.full(CFG.max_seq_len, 0.5))
    cfg = decode_config(gen_len=16, block_len=8)
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        dec.decode([[1, 2], []], cfg)
    with pytest.raises(ConfigError, match=r"prompt \(90 tokens\) \+ gen_len \(16\) = 106 tokens exceeds the limit of 96"):
        dec.decode([[1] * 90], cfg)
    with pytest.raises(ConfigError, match="no prompts given"):
        dec.decode([], cfg)
    with pytest.raises(ConfigError, match="16 exceeds the largest batch bucket"):
        dec.decode([[1]] * 16, cfg)
    assert not exe.calls

"""llada.cpp's decoding: multi-block speculative windows (`cache="mbsd"`), dual-path
progressive revision (`revision="dppr"`) with its CPU refresh path, selective logits skipping.

Exactness against the existing decoders runs on a real tiny model; the invariants (what
enters the K/V store, commit order, window motion, token-state moves, delayed merge) are
checked step by step on traces of real and scripted decodes."""

import dataclasses

import numpy as np
import pytest

from dlm_jax import ConfigError
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime import Decoder, TokenState, decode_config, preset
from dlm_jax.runtime.latency import PhoneCostModel
from dlm_jax.techniques.lladacpp.mbsd import SpeculativeWindow, latency_table, price
from dlm_jax.testing import MockExecutor, sharp_model, tiny_config
from dlm_jax.runtime.registry import decode_options

PROMPTS = [[5, 17, 3, 44, 9, 21, 30], [8, 1], [40, 41, 42, 43, 2]]
S = TokenState


@pytest.fixture(scope="module")
def decoder():
    model = sharp_model()
    return Decoder(JaxExecutor(model), model.config)


@dataclasses.dataclass(frozen=True)
class Traced(SpeculativeWindow):
    """The scheduler, keeping (plan, status, tokens, kv_token, window_start) before each step."""

    log: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    def plan(self, state, cursor):
        plan = super().plan(state, cursor)
        if plan is not None:
            self.log.append((plan, state.status.copy(), state.tokens.copy(), state.kv_token.copy(),
                             cursor.window_start, cursor.unit))
        return plan


def traced(**options):
    """A config whose scheduler is a `Traced` window with these flat options."""
    cfg = decode_config(cache="mbsd", **options)
    fields = {f.name: getattr(cfg.scheduler, f.name) for f in dataclasses.fields(SpeculativeWindow)}
    return dataclasses.replace(cfg, scheduler=Traced(**fields, log=[]))


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("rule", [dict(rule="threshold", threshold=0.7), dict(rule="topk", steps=16),
                                  dict(rule="frechet", delta=0.2)], ids=lambda r: r["rule"])
def test_mbsd_off_with_suffix_is_the_prefix_cache_decoder(decoder, rule):
    base = dict(gen_len=32, block_len=8, stop_on_eos_block=False, **rule)
    ref = decoder.decode(PROMPTS, decode_config(cache="prefix", **base))
    off = dict(sliding=False, trigger=0, suffix=True)
    for skip in (False, True):  # skipping stable rows changes no token
        out = decoder.decode(PROMPTS, decode_config(cache="mbsd", skip_stable=skip, **off, **base))
        for a, b in zip(out.sequences, ref.sequences):
            np.testing.assert_array_equal(a, b)
        assert out.stats.nfe == ref.stats.nfe and out.stats.request_nfe == ref.stats.request_nfe


def _semi_ar(decoder, prompt, *, gen_len, block_len, threshold):
    """Semi-autoregressive reference: each block decoded alone on the sequence cut at its
    end, with everything before it as the prompt (a prefix-cache decode of one block)."""
    seq, nfe = list(prompt), 0
    for _ in range(gen_len // block_len):
        out = decoder.decode([seq], decode_config(cache="prefix", gen_len=block_len, block_len=block_len,
                                                  threshold=threshold, stop_on_eos_block=False))
        seq += [int(t) for t in out.sequences[0]]
        nfe += out.stats.nfe
    return np.array(seq[len(prompt):]), nfe


def test_window_only_is_a_semi_ar_decoder_cut_at_the_block_end(decoder):
    for prompt in PROMPTS:
        ref, nfe = _semi_ar(decoder, prompt, gen_len=24, block_len=8, threshold=0.7)
        cfg = decode_config(cache="mbsd", sliding=False, trigger=0, gen_len=24, block_len=8, threshold=0.7,
                            stop_on_eos_block=False)
        out = decoder.decode([prompt], cfg)
        np.testing.assert_array_equal(out.sequences[0], ref)
        assert out.stats.nfe == nfe


def test_dppr_at_one_threshold_without_revision_is_the_threshold_rule(decoder):
    base = dict(gen_len=32, block_len=8, threshold=0.7, stop_on_eos_block=False)
    for cache in (dict(cache="prefix"), dict(cache="mbsd", trigger=2, skip_stable=False)):
        ref = decoder.decode(PROMPTS, decode_config(**cache, **base))
        out = decoder.decode(PROMPTS, decode_config(**cache, **base, revision="dppr", theta_stable=0.7,
                                                    revise=False, refresh_rows=0))
        for a, b in zip(out.sequences, ref.sequences):
            np.testing.assert_array_equal(a, b)
        assert out.stats.nfe == ref.stats.nfe
    # With theta_stable above the rule's threshold some commits stay visible instead.
    out = decoder.decode(PROMPTS, decode_config(**base, revision="dppr", theta_stable=0.99, refresh_rows=0))
    assert out.stats.counters["visible_made"] > 0


# --------------------------------------------------------------------------- invariants


def _check_trace(log, sequences, cfg, gen_start):
    sched = cfg.scheduler
    starts = [entry[4] for entry in log]
    assert starts == sorted(starts), "the window start moved left"
    statuses = [entry[1] for entry in log]
    for (plan, status, tokens, kv_token, start, unit) in log:
        lo = gen_start + unit * sched.block_len
        # Everything the step reads from the store was computed from a final or visible
        # token, never from a draft or a mask; only a visible token the CPU path has just
        # revised is read stale (it is refreshed first next).
        cached = plan.cached
        assert np.isin(status[:, cached], (S.PROMPT, S.VISIBLE, S.STABLE)).all()
        if sched.sliding:
            stale = kv_token[:, cached] != tokens[:, cached]
            assert (status[:, cached][stale] == S.VISIBLE).all()
            assert np.isin(kv_token[:, cached], tokens[:, cached][~stale]).all() or stale.any()
        # Nothing of a later block is committed while the current block is undecided.
        later = status[:, lo + sched.block_len:]
        assert not np.isin(later, (S.VISIBLE, S.STABLE)).any()
        # The window's first predicted slot is at or before the first undecided slot.
        undecided = np.isin(status[0, gen_start:], (S.MASK, S.CANDIDATE))
        if undecided.any():
            assert plan.window[0] <= gen_start + int(np.argmax(undecided))
        # Selective logits skipping: a stable slot never requests a prediction.
        if sched.skip_stable:
            assert not (status[:, plan.targets] == S.STABLE).all(axis=0).any()
        # Look-ahead (predicting past the window's own width) only fires in the block's late stage.
        todo = np.isin(status[0, lo:], (S.MASK, S.CANDIDATE, S.DRAFT))
        frontier = lo + int(np.argmax(todo)) if todo.any() else status.shape[1]
        if plan.targets.max() >= max(frontier, gen_start, plan.window[0]) + sched.w0:
            left = np.isin(status[:, lo:lo + sched.block_len], (S.MASK, S.CANDIDATE)).sum(axis=1).max()
            assert left <= sched.trigger
    return statuses


ALLOWED = {S.MASK: {S.MASK, S.CANDIDATE, S.DRAFT, S.VISIBLE, S.STABLE},
           S.CANDIDATE: {S.MASK, S.CANDIDATE, S.DRAFT, S.VISIBLE, S.STABLE},
           S.DRAFT: {S.DRAFT, S.MASK, S.VISIBLE, S.STABLE},
           S.VISIBLE: {S.VISIBLE, S.STABLE}, S.STABLE: {S.STABLE}, S.PROMPT: {S.PROMPT}}


@pytest.mark.parametrize("options", [
    dict(threshold=0.7, draft_threshold=0.7),
    dict(threshold=0.7, draft_threshold=0.7, revision="dppr", theta_stable=0.9),
    dict(threshold=0.7, draft_threshold=0.6, draft_input="mask", window_width=16, trigger=6),
    dict(threshold=0.7, revision="dppr", theta_stable=0.95, revisit="remask", refresh_rows=4, allowance=0.0),
], ids=["mbsd", "mbsd+dppr", "mask-drafts", "remask"])
def test_speculative_windows_keep_their_invariants(decoder, options):
    cfg = traced(gen_len=32, block_len=8, stop_on_eos_block=False, **options)
    out = decoder.decode([PROMPTS[0]], cfg)
    log = cfg.scheduler.log
    statuses = _check_trace(log, out.sequences, cfg, len(PROMPTS[0])) + []
    for before, after in zip(statuses, statuses[1:]):
        for a, b in zip(before.ravel(), after.ravel()):
            assert TokenState(b) in ALLOWED[TokenState(a)], f"{TokenState(a).name} -> {TokenState(b).name}"
    # Progress: every step leaves the current block with fewer undecided slots or finishes it.
    assert out.stats.nfe <= 32
    assert out.stats.counters["useful_rows"] <= out.stats.counters["window_rows"]


@dataclasses.dataclass(frozen=True)
class Widening(SpeculativeWindow):
    log: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    def looked_ahead(self, live, base, chosen):
        self.log.append((live, base, chosen))


def test_look_ahead_stays_within_the_latency_allowance():
    table = latency_table("phone")
    for allowance, widest in ((0.0, 32), (0.25, 64), (1.0, 96)):
        sched = Widening(block_len=32, trigger=4, allowance=allowance, max_window=256, log=[])
        cfg = tiny_config(max_seq_len=512)
        exe = MockExecutor(cfg, answer=np.arange(512) % 50, confidence=np.full(512, 0.5))
        dec = Decoder(exe, cfg)
        trace = dataclasses.replace(decode_config(gen_len=128, threshold=0.9), scheduler=sched)
        dec.decode([[1, 2, 3]], trace)
        assert sched.log and max(chosen for _, _, chosen in sched.log) == widest, (allowance, sched.log)
        for live, base, chosen in sched.log:
            assert base >= live and chosen >= base
            assert price(table, chosen, 0) <= (1 + allowance) * price(table, base, 0)
            if allowance == 0:
                assert chosen == base  # only the bucket's own padding is filled
    # The phone model the default table prices: memory-bound to one tile, then stepwise.
    npu = PhoneCostModel.npu()
    assert [npu.step_ms(w) for w in (8, 32, 64, 96, 128)] == pytest.approx([80.36, 80.36, 95.0, 142.49, 189.98],
                                                                          abs=0.01)
    assert PhoneCostModel.cpu().step_ms(32) == pytest.approx(4571.4, abs=0.1)


def test_no_look_ahead_means_the_window_never_leaves_the_block():
    cfg = tiny_config()
    exe = MockExecutor(cfg, answer=np.arange(96) % 50, confidence=np.full(96, 0.5))
    decoded = Decoder(exe, cfg).decode([[1, 2, 3]], decode_config(cache="mbsd", trigger=0, sliding=False,
                                                                   gen_len=32, block_len=8))
    assert decoded.stats.counters.get("drafts_made", 0) == 0
    for call in exe.calls:
        live = call.positions[0][call.visibility[0].any(axis=1)]  # the window's real rows
        first_row = call.positions[0, call.logit_rows[0, 0]]
        assert live.max() < first_row - (first_row - 3) % 8 + 8  # nothing past the block's end


class Forking(MockExecutor):
    """A mock whose fork (the CPU path) writes K/V marked +1000 and is more confident."""

    def __init__(self, config, marker=0, **kwargs):
        super().__init__(config, **kwargs)
        self.marker = marker
        self.twin = None

    def fork(self):
        self.twin = Forking(self.config, marker=1000, answer=self.answer, confidence=np.full(96, 0.97))
        return self.twin

    def step(self, inputs):
        out = super().step(inputs)
        if out.k_new is not None and self.marker:
            out = dataclasses.replace(out, k_new=out.k_new + self.marker)
        return out


def test_cpu_refresh_is_merged_at_the_step_boundary(monkeypatch):
    from dlm_jax.techniques.lladacpp import refresh

    submitted = []  # the main step each refresh was submitted before
    original = refresh.Refresher.submit

    def spy(self, state, store, plan):
        original(self, state, store, plan)
        if self._job is not None:
            submitted.append(len(exe.calls))

    monkeypatch.setattr(refresh.Refresher, "submit", spy)
    cfg = tiny_config()
    answer = np.arange(96) % 50
    exe = Forking(cfg, answer=answer, confidence=np.full(96, 0.8))  # commits stay visible (< 0.9)
    out = Decoder(exe, cfg).decode([[1, 2, 3]], decode_config(
        cache="mbsd", gen_len=32, block_len=8, threshold=0.7, revision="dppr", refresh_rows=4, trigger=0,
        stop_on_eos_block=False))
    assert exe.twin is not None and exe.twin.calls and submitted, "no refresh ran"
    assert out.stats.counters["refresh_promoted"] > 0
    # The first refresh runs beside main step s: s reads none of its K/V, s + 1 does.
    s = submitted[0]
    assert not (exe.calls[s].k_cache >= 1000).any()
    assert (exe.calls[s + 1].k_cache >= 1000).any()
    np.testing.assert_array_equal(out.sequences[0], answer[3:35])


def test_remask_refresh_scores_visible_slots_inside_the_window_without_writing_their_kv(monkeypatch):
    """With leave-one-out scoring and no probe rows in the window forwards, the CPU path picks
    visible slots inside the window too; their K/V stay the window's."""
    from dlm_jax.techniques.lladacpp import refresh
    from dlm_jax.runtime.kvstore import KVStore

    jobs, written, merging = [], [], []
    submit, merge, write = refresh.Refresher.submit, refresh.Refresher.merge, KVStore.write

    def spy_submit(self, state, store, plan):
        submit(self, state, store, plan)
        if self._job is not None:
            jobs.append((self._job.slots.copy(), int(plan.window[0])))

    def spy_merge(self, state, store):
        merging.append(True)
        try:
            return merge(self, state, store)
        finally:
            merging.pop()

    def spy_write(self, slots, k, v, **kw):
        if merging:
            written.append((np.asarray(slots).copy(), np.asarray(kw["rows"]).copy(), jobs[-1][1]))
        return write(self, slots, k, v, **kw)

    monkeypatch.setattr(refresh.Refresher, "submit", spy_submit)
    monkeypatch.setattr(refresh.Refresher, "merge", spy_merge)
    monkeypatch.setattr(KVStore, "write", spy_write)
    cfg = tiny_config()
    answer = np.arange(96) % 50
    exe = Forking(cfg, answer=answer, confidence=np.full(96, 0.8))  # commits stay visible (< 0.9)
    out = Decoder(exe, cfg).decode([[1, 2, 3]], decode_config(
        cache="mbsd", gen_len=32, block_len=8, threshold=0.7, revision="dppr", refresh_rows=4, trigger=0,
        revisit="remask", window_probes=0, stop_on_eos_block=False))
    assert any((slots >= start).any() for slots, start in jobs), "no visible slot refreshed inside the window"
    assert out.stats.counters["refresh_promoted"] > 0
    for slots, rows, start in written:  # only slots left of the window at submission get the CPU path's K/V
        assert not rows[:, slots >= start].any()
    np.testing.assert_array_equal(out.sequences[0], answer[3:35])


@pytest.mark.parametrize("layers", [1, 2])
def test_window_probes_are_leave_one_out_rows_that_no_other_row_sees(layers):
    """A probe row changes nothing the window's own rows compute, and (one layer, where the
    other slots' keys do not depend on the probed token) predicts exactly what the slot's own
    row predicts when the slot is fed the mask and hidden from every other row."""
    from dlm_jax.runtime.inputs import StepInputBuilder
    from dlm_jax.runtime.kvcache import HostKVCache
    from dlm_jax.runtime.scheduler import StepPlan
    from dlm_jax.runtime.state import DecodeState
    from dlm_jax.runtime.step import OutputRequest

    model = sharp_model(n_layers=layers)
    cfg, exe = model.config, JaxExecutor(model)
    state = DecodeState.create([PROMPTS[0]], gen_len=16, batch=1, mask_id=cfg.mask_token_id,
                               vocab_size=cfg.vocab_size)
    g = state.gen_start
    filled = g + np.array([0, 1, 2, 5])
    state.tokens[:, filled] = [11, 12, 13, 14]
    state.status[:, filled] = S.VISIBLE
    window, targets = np.arange(state.total), np.arange(g, state.total)
    plan = StepPlan(window=window, cached=np.arange(0), rows=targets, targets=targets, unit=0, step=0)
    probes = filled[[1, 3]]
    want = OutputRequest(kv=True, logits=False)
    cache = HostKVCache(exe, cfg, state.positions, state.valid)

    def dense(plan):  # the step's dense inputs, as a LiteRT bundle receives them
        return cache._inputs(StepInputBuilder(cfg, exe.capabilities).build(plan, state, want), kv=True)

    base_in = dense(plan)
    base = exe.step(base_in)
    out = exe.step(dense(dataclasses.replace(plan, probes=probes)))
    r, w = len(targets), len(window)
    np.testing.assert_array_equal(out.top_token[:, :r], base.top_token[:, :r])
    np.testing.assert_allclose(out.top_prob[:, :r], base.top_prob[:, :r], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.k_new[:, :, :w], base.k_new[:, :, :w], rtol=1e-5, atol=1e-5)
    assert not np.allclose(out.top_prob[:, r:r + 2], base.top_prob[:, probes - g], atol=1e-3), \
        "the probes predict what the in-place rows predict: they see their slot"
    if layers > 1:
        return
    p = base_in.k_cache.shape[2]
    for i, slot in enumerate(probes):
        tokens, vis = base_in.tokens.copy(), base_in.visibility.copy()
        tokens[:, slot] = cfg.mask_token_id
        vis[:, :, p + slot] = False
        vis[:, slot, p + slot] = True
        ref = exe.step(dataclasses.replace(base_in, tokens=tokens, visibility=vis))
        assert out.top_token[0, r + i] == ref.top_token[0, slot - g]
        np.testing.assert_allclose(out.top_prob[0, r + i], ref.top_prob[0, slot - g], rtol=1e-5, atol=1e-6)


def test_window_probes_re_score_visible_slots_and_the_cpu_path_takes_the_rest(monkeypatch):
    """With `revisit="remask"` each window forward probes the visible slots it predicts, up
    to `window_probes` (the least confident), and the CPU path never picks a slot the same
    step probes. A slot's second prediction is the confident one, so probing promotes."""
    from dlm_jax.techniques.lladacpp import refresh

    jobs = []
    submit = refresh.Refresher.submit

    def spy(self, state, store, plan):
        submit(self, state, store, plan)
        if self._job is not None:
            jobs.append((self._job.slots.copy(), plan.probes))

    monkeypatch.setattr(refresh.Refresher, "submit", spy)
    cfg = tiny_config()
    answer = np.arange(96) % 50
    seen = set()

    def confidence(inputs, predicted):  # a position's first prediction 0.8 (-> visible), later ones 0.95
        conf = np.array([[0.95 if int(q) in seen else 0.8 for q in row] for row in predicted])
        seen.update(int(q) for q in predicted.ravel())
        return conf

    counts = {}
    for probes in (0, 1, 32):
        seen.clear()
        jobs.clear()
        exe = Forking(cfg, answer=answer, confidence=confidence)
        out = Decoder(exe, cfg).decode([[1, 2, 3]], decode_config(
            cache="mbsd", gen_len=32, block_len=8, threshold=0.7, revision="dppr", refresh_rows=2, trigger=0,
            revisit="remask", window_probes=probes, stop_on_eos_block=False))
        np.testing.assert_array_equal(out.sequences[0], answer[3:35])
        counts[probes] = out.stats.counters
        for slots, probed in jobs:
            assert probed is None or not np.isin(slots, probed).any(), "the CPU path refreshed a probed slot"
    assert "probe_rows" not in counts[0] and counts[32]["probe_promoted"] > 0
    assert counts[1]["probe_rows"] < counts[32]["probe_rows"]
    assert counts[32].get("refresh_rows", 0) < counts[0]["refresh_rows"]


def test_the_preset_and_its_switches():
    cfg = preset("llada-cpp", gen_len=64)
    opts = decode_options(cfg)
    assert (opts["cache"], opts["revision"], opts["threshold"], opts["theta_stable"]) == ("mbsd", "dppr", 0.7, 0.9)
    assert opts["trigger"] == 4 and opts["skip_stable"] and opts["refresh_rows"] == 8
    assert opts["revisit"] == "remask" and opts["window_probes"] == 32
    for bad, match in [(dict(trigger=-1), r"trigger=-1 must be an integer >= 0"),
                       (dict(draft_input="maybe"), r"draft_input='maybe' is not one of"),
                       (dict(sliding=True, suffix=True), r"suffix=True needs sliding=False"),
                       (dict(latency="nowhere.json"), r"latency='nowhere.json' is neither"),
                       (dict(theta_stable=1.5), r"theta_stable=1.5 must be in"),
                       (dict(revisit="twice"), r"revisit='twice' is not one of")]:
        with pytest.raises(ConfigError, match=match):
            preset("llada-cpp", **bad)
    with pytest.raises(ConfigError, match=r"theta_stable=0.5 applies to revision='dppr' only"):
        decode_config(theta_stable=0.5)


def test_a_decode_keeps_no_step_inputs():
    """Peak memory a llada-cpp decode adds stays within a few K/V stores: the CPU path keeps
    no refresh inputs (cache arrays included) past their step. Before it did, this decode
    peaked at 2.9 MB against a 0.07 MB store."""
    import tracemalloc

    from dlm_jax.runtime import KVStore

    class Quiet(MockExecutor):  # the mock's own trace of calls kept out of the measurement
        def step(self, inputs, *, timings=None):
            out = super().step(inputs)
            self.calls.clear()
            return out

        def fork(self):
            return Quiet(self.config, answer=self.answer, confidence=self.confidence)

    cfg = tiny_config(max_seq_len=512)
    rng = np.random.default_rng(0)
    decoder = Decoder(Quiet(cfg, answer=rng.integers(3, 60, 512), confidence=rng.uniform(0.6, 0.95, 512)), cfg)
    decode = preset("llada-cpp", gen_len=256, stop_on_eos_block=False)
    decoder.decode([[1, 2, 3]], decode)  # first-use allocations outside the measurement
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = decoder.decode([[1, 2, 3]], decode)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    store = KVStore.for_model(cfg, 1, 3 + 256)
    assert out.stats.counters["refresh_steps"] > 30
    assert peak < 8 * (store.k.nbytes + store.v.nbytes) + 256 * 1024, peak

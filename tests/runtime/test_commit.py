"""Commit rules of the host runtime: hand-computed cases, invariants, the Frechet/factor
relations from Fast-dLLM++ (flat profiles agree; heterogeneous profiles only help Frechet),
the released factor rule against a transcription of Fast-dLLM's code, and each rule's unit
life (schedule, end-of-unit test)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dlm_jax import ConfigError
from dlm_jax.runtime.commit import (
    CommitRule,
    FactorRule,
    FrechetRule,
    PaperFactorRule,
    ThresholdRule,
    TopKRule,
    TopKSchedule,
    num_transfer_tokens,
)

FAST = settings(max_examples=150, deadline=None)


def _row(values, candidates=None):
    """One-row ([1, W] float64 confidence, [1, W] bool candidates); all candidates by default."""
    conf = np.array([values], dtype=np.float64)
    cand = np.ones_like(conf, bool) if candidates is None else np.array([candidates], bool)
    return conf, cand


def _committed(mask):
    """Committed positions of each row, as lists."""
    return [np.flatnonzero(r).tolist() for r in mask]


# ----------------------------------------------------------------------- references (loops)


def _ranked(conf_row, cand_row):
    """Candidate positions, highest confidence first, ties by lower position."""
    return sorted(np.flatnonzero(cand_row).tolist(), key=lambda i: (-conf_row[i], i))


def _ref_count(rule, conf_row, cand_row, step=0):
    """How many ranked candidates `rule` should commit, straight from the definitions."""
    ranked = _ranked(conf_row, cand_row)
    c = [float(conf_row[i]) for i in ranked]
    m = len(c)
    if m == 0:
        return ranked, 0
    if isinstance(rule, TopKRule):
        return ranked, min(int(rule.counts[0, step]), m)
    if isinstance(rule, ThresholdRule):
        return ranked, 1 + sum(1 for x in c[1:] if x >= rule.threshold)
    if isinstance(rule, PaperFactorRule):
        n = 0
        for k in range(1, m + 1):  # every n' <= n must pass
            if (k + 1) * (1 - c[k - 1]) < rule.factor:
                n = k
            else:
                break
        return ranked, max(n, 1)
    if isinstance(rule, FactorRule):
        return ranked, _released_factor_count(c, rule.factor)
    if isinstance(rule, FrechetRule):
        best = 0
        for k in range(1, m + 1):  # the largest n, not the first failure
            lower = max(0.0, 1.0 - sum(1.0 - x for x in c[:k]))
            if lower - (1 - c[k - 1]) > rule.delta:
                best = k
        return ranked, max(best, 1)
    raise AssertionError(rule)


def _released_factor_count(c, factor):
    """NVlabs/Fast-dLLM `get_transfer_index_dynamic`, transcribed for one row of sorted
    confidences c (its loop, its `threshs[0] = -1` and its `top_i` exception)."""
    threshs = [1 - factor / (n + 1) for n in range(1, len(c) + 1)]
    threshs[0] = -1
    for top_i in range(len(threshs)):
        if c[top_i] < threshs[top_i]:
            break
    if top_i == 0 or top_i == len(threshs) - 1:
        top_i += 1
    return top_i


def _frechet_gaps(c_sorted):
    """G_n for n = 1..m of a sorted (descending) confidence list."""
    c = np.asarray(c_sorted, dtype=np.float64)
    return np.maximum(0.0, 1.0 - np.cumsum(1.0 - c)) - (1.0 - c)


# ----------------------------------------------------------------------- schedule


def test_num_transfer_tokens_matches_llada():
    # LLaDA: base = count // steps everywhere, +1 on the first (count % steps) steps.
    masked = np.zeros((3, 32), bool)
    masked[0, :] = True  # 32 = 5 * 6 + 2
    masked[1, :7] = True  # 7 = 5 * 1 + 2
    masked[2, :3] = True  # 3 < 5 steps: the last two steps get nothing
    np.testing.assert_array_equal(
        num_transfer_tokens(masked, 5), [[7, 7, 6, 6, 6], [2, 2, 1, 1, 1], [1, 1, 1, 0, 0]])


@FAST
@given(hnp.arrays(bool, st.tuples(st.integers(1, 4), st.integers(1, 40))), st.integers(1, 12))
def test_num_transfer_tokens_properties(masked, steps):
    out = num_transfer_tokens(masked, steps)
    assert out.shape == (masked.shape[0], steps)
    np.testing.assert_array_equal(out.sum(axis=1), masked.sum(axis=1))
    assert (np.diff(out, axis=1) <= 0).all()  # extra tokens go to the first steps
    assert (out.max(axis=1) - out.min(axis=1) <= 1).all()


def test_num_transfer_tokens_bad_steps():
    with pytest.raises(ConfigError, match="steps=0"):
        num_transfer_tokens(np.ones((1, 4), bool), 0)


# ----------------------------------------------------------------------- hand-computed rules


def test_topk_commits_most_confident_with_lower_index_ties():
    conf, cand = _row([0.5, 0.8, 0.8, 0.9, 0.2], [True, True, True, False, True])
    rule = TopKRule(np.array([[1, 2, 9, 0]]))
    # position 3 is the most confident but not a candidate; 1 and 2 tie -> 1 first.
    assert _committed(rule.select(conf, cand, step=0)) == [[1]]
    assert _committed(rule.select(conf, cand, step=1)) == [[1, 2]]
    # more scheduled than candidates: commit them all, never position 3.
    assert _committed(rule.select(conf, cand, step=2)) == [[0, 1, 2, 4]]
    # LLaDA commits exactly counts[b, i]; a 0 commits nothing even with candidates left.
    assert _committed(rule.select(conf, cand, step=3)) == [[]]


def test_topk_per_row_counts():
    conf = np.array([[0.1, 0.9, 0.5], [0.3, 0.2, 0.4]])
    cand = np.ones_like(conf, bool)
    rule = TopKRule(num_transfer_tokens(np.array([[1, 1, 1], [1, 1, 0]], bool), 2))  # [[2, 1], [1, 1]]
    assert _committed(rule.select(conf, cand, step=0)) == [[1, 2], [2]]


def test_threshold_hand_examples():
    rule = ThresholdRule(0.9)
    assert _committed(rule.select(*_row([0.95, 0.5, 0.91]))) == [[0, 2]]
    # nothing reaches the threshold: only the top candidate commits.
    assert _committed(rule.select(*_row([0.3, 0.6, 0.5]))) == [[1]]
    # ties for the top: the lower position wins.
    assert _committed(rule.select(*_row([0.5, 0.7, 0.7]))) == [[1]]
    # exactly at the threshold commits (Fast-dLLM drops only confidence < threshold).
    assert _committed(rule.select(*_row([0.99, 0.9]))) == [[0, 1]]
    # a confident non-candidate is never committed (0.2 < 0.9 stays masked; 0.95 is the top);
    # an all-False row commits nothing.
    conf = np.array([[0.99, 0.2, 0.95], [0.99, 0.99, 0.99]])
    cand = np.array([[False, True, True], [False, False, False]])
    assert _committed(rule.select(conf, cand)) == [[2], []]


def test_paper_factor_hand_examples():
    # f = 1, sorted c = [0.99, 0.9, 0.6]:
    #   n=1: 2 * 0.01 = 0.02 < 1 ok;  n=2: 3 * 0.1 = 0.3 < 1 ok;  n=3: 4 * 0.4 = 1.6 -> stop.
    rule = PaperFactorRule(1.0)
    assert _committed(rule.select(*_row([0.6, 0.99, 0.9]))) == [[1, 2]]
    # f = 0.1, c = [0.5, 0.4]: n=1: 2 * 0.5 = 1.0, not < 0.1 -> the floor of one token.
    assert _committed(PaperFactorRule(0.1).select(*_row([0.4, 0.5]))) == [[1]]
    # strict '<': f = 0.5, c = [0.75, 0.75]: n=1: 2 * 0.25 = 0.5, not < 0.5 -> one token.
    assert _committed(PaperFactorRule(0.5).select(*_row([0.75, 0.75]))) == [[0]]
    # f = 0.51: n=1: 0.5 < 0.51 ok; n=2: 3 * 0.25 = 0.75 -> stop.
    assert _committed(PaperFactorRule(0.51).select(*_row([0.75, 0.75]))) == [[0]]
    assert _committed(PaperFactorRule(0.76).select(*_row([0.75, 0.75]))) == [[0, 1]]


def test_released_factor_hand_examples():
    """Fast-dLLM's code commits c_(n) >= 1 - f / (n + 1) scanned from n = 2, and all of them
    when only the last candidate fails: it decodes differently from the paper's rule."""
    # f = 1, c = [0.99, 0.9, 0.6]: n=2: 0.9 >= 1 - 1/3 ok; n=3: 0.6 < 0.75 fails, and it is the
    # last candidate -> all three commit (the paper's rule stops at two).
    assert _committed(FactorRule(1.0).select(*_row([0.6, 0.99, 0.9]))) == [[0, 1, 2]]
    # f = 1, c = [0.99, 0.5, 0.4, 0.3]: n=2: 0.5 < 0.667 fails, not the last -> one token.
    assert _committed(FactorRule(1.0).select(*_row([0.99, 0.5, 0.4, 0.3]))) == [[0]]
    # two candidates always both commit, whatever the factor: c = [0.9, 0.1].
    assert _committed(FactorRule(0.05).select(*_row([0.9, 0.1]))) == [[0, 1]]
    assert _committed(PaperFactorRule(0.05).select(*_row([0.9, 0.1]))) == [[0]]
    # '>=' on the bar: f = 0.5, c = [0.9, 0.875, 0.875, 0.1]: n=2: bar 1 - 0.5/3 = 0.8333 ok;
    # n=3: bar 0.875 exactly, passes; n=4: 0.1 fails at the last -> all four.
    assert _committed(FactorRule(0.5).select(*_row([0.9, 0.875, 0.875, 0.1]))) == [[0, 1, 2, 3]]
    # one candidate commits; none commits nothing.
    assert _committed(FactorRule(1.0).select(*_row([0.2]))) == [[0]]
    assert _committed(FactorRule(1.0).select(*_row([0.2], [False]))) == [[]]


def test_frechet_hand_examples():
    # delta = 0.25, c = [0.95, 0.9, 0.85, 0.3] (already sorted):
    #   n=1: L = 0.95,                 U = 0.05, G = 0.90 > 0.25 ok
    #   n=2: L = 1.85 - 1 = 0.85,      U = 0.10, G = 0.75 ok
    #   n=3: L = 2.70 - 2 = 0.70,      U = 0.15, G = 0.55 ok
    #   n=4: L = max(0, 3.0 - 3) = 0,  U = 0.70, G = -0.70 -> commit 3.
    rule = FrechetRule(0.25)
    assert _committed(rule.select(*_row([0.95, 0.9, 0.85, 0.3]))) == [[0, 1, 2]]
    # delta = 0.25, c = [0.99, 0.99, 0.99, 0.7]:
    #   n=4: L = 3.67 - 3 = 0.67, U = 0.30, G = 0.37 > 0.25 -> all 4 commit.
    #   The factor rule at f = 1 - delta = 0.75 stops at 3: n=4: 5 * 0.3 = 1.5 >= 0.75
    #   (n=3: 4 * 0.01 = 0.04 ok) -- the heterogeneity bonus of Fast-dLLM++.
    conf, cand = _row([0.7, 0.99, 0.99, 0.99])
    assert _committed(rule.select(conf, cand)) == [[0, 1, 2, 3]]
    assert _committed(PaperFactorRule(0.75).select(conf, cand)) == [[1, 2, 3]]
    # delta = 0, c = [1.0, 0.6]: n=2: L = 0.6, U = 0.4, G = 0.2 > 0 -> 2; factor f=1: 3 * 0.4 = 1.2 -> 1.
    conf, cand = _row([1.0, 0.6])
    assert _committed(FrechetRule(0.0).select(conf, cand)) == [[0, 1]]
    assert _committed(PaperFactorRule(1.0).select(conf, cand)) == [[0]]
    # delta = 0.5, c = [0.7, 0.6]: n=1: G = 0.7 - 0.3 = 0.4, not > 0.5 -> the floor of one token.
    assert _committed(FrechetRule(0.5).select(*_row([0.6, 0.7]))) == [[1]]


# ----------------------------------------------------------------------- properties


@st.composite
def _batches(draw, low=0.0, high=1.0):
    """(confidence [B, W] float64, candidates [B, W] bool) with B in 1..4, W in 1..40."""
    shape = draw(st.tuples(st.integers(1, 4), st.integers(1, 40)))
    conf = draw(hnp.arrays(np.float64, shape, elements=st.floats(low, high)))
    cand = draw(hnp.arrays(bool, shape))
    return conf, cand


@st.composite
def _rules(draw, width):
    kind = draw(st.sampled_from(["topk", "threshold", "factor", "factor_paper", "frechet"]))
    if kind == "topk":
        steps = draw(st.integers(1, 4))
        counts = draw(hnp.arrays(np.int64, (4, steps), elements=st.integers(1, max(width, 1))))
        return TopKRule(counts), draw(st.integers(0, steps - 1))
    if kind == "threshold":
        return ThresholdRule(draw(st.floats(0.01, 1.0))), 0
    if kind == "factor":
        return FactorRule(draw(st.floats(0.05, 3.0))), 0
    if kind == "factor_paper":
        return PaperFactorRule(draw(st.floats(0.05, 3.0))), 0
    return FrechetRule(draw(st.floats(0.0, 0.95))), 0


def _sized(rule, batch):
    """TopKRule counts are drawn for 4 rows; cut them to the batch."""
    return TopKRule(rule.counts[:batch]) if isinstance(rule, TopKRule) else rule


@FAST
@given(st.data())
def test_every_rule_commits_at_least_one_candidate_and_only_candidates(data):
    # Scores may be any reals (margin / entropy kinds), not just probabilities.
    conf, cand = data.draw(st.one_of(_batches(), _batches(-5.0, 5.0)))
    rule, step = data.draw(_rules(conf.shape[1]))
    rule = _sized(rule, conf.shape[0])
    out = rule.select(conf, cand, step=step)
    assert out.shape == cand.shape and out.dtype == np.bool_
    assert not (out & ~cand).any(), "committed a non-candidate"
    per_row = out.sum(axis=1)
    assert (per_row[cand.any(axis=1)] >= 1).all(), "a row with candidates committed nothing"
    assert (per_row[~cand.any(axis=1)] == 0).all()


@FAST
@given(st.data())
def test_rules_match_loop_references(data):
    conf, cand = data.draw(_batches())
    rule, step = data.draw(_rules(conf.shape[1]))
    rule = _sized(rule, conf.shape[0])
    out = rule.select(conf, cand, step=step)
    for b in range(conf.shape[0]):
        ranked, n = _ref_count(TopKRule(rule.counts[b:b + 1]) if isinstance(rule, TopKRule) else rule,
                               conf[b], cand[b], step)
        if isinstance(rule, (FactorRule, FrechetRule)):
            # Skip draws sitting on a decision boundary, where the loop and NumPy may round
            # differently (hypothesis likes such values).
            c = np.array([conf[b, i] for i in ranked])
            ks = np.arange(2, len(c) + 2)
            if isinstance(rule, PaperFactorRule):
                assume(np.all(np.abs(ks * (1 - c) - rule.factor) > 1e-9))
            elif isinstance(rule, FactorRule):
                pass  # the same float expression on both sides: no rounding gap
            else:
                assume(np.all(np.abs(_frechet_gaps(c) - rule.delta) > 1e-9))
        assert sorted(np.flatnonzero(out[b]).tolist()) == sorted(ranked[:n])


@FAST
@given(
    st.lists(st.tuples(st.integers(0, 97), st.integers(1, 40)), min_size=1, max_size=4),
    st.integers(0, 90),
    st.randoms(use_true_random=False),
)
def test_frechet_equals_factor_on_flat_profiles(rows, delta_pct, rnd):
    # (The paper's factor rule; the released one commits every candidate when only the
    # last fails, which the Frechet bound does not.)
    # All m candidates of a row share c = k / 97, delta = j / 100, factor = 1 - delta.
    # With u = 1 - c: Frechet G_n = max(0, 1 - n u) - u, factor F_n = 1 - (n + 1) u; they are
    # equal when 1 - n u >= 0 and both fail otherwise (G_n = -u <= 0 <= delta). The grid keeps
    # every condition >= 1 / 9700 away from its boundary (97 is prime, n + 1 <= 41), so there
    # is no rounding tie to filter: (n + 1)(97 - k) * 100 == 97 * (100 - j) has no solution.
    delta = delta_pct / 100
    width = 40
    conf = np.array([[rnd.random() for _ in range(width)] for _ in rows])  # non-candidates: noise
    cand = np.zeros_like(conf, bool)
    for b, (k, m) in enumerate(rows):
        pos = rnd.sample(range(width), m)
        cand[b, pos] = True
        conf[b, pos] = k / 97
    frechet = FrechetRule(delta).select(conf, cand)
    factor = PaperFactorRule(1 - delta).select(conf, cand)
    np.testing.assert_array_equal(frechet, factor)


@FAST
@given(_batches(), st.floats(0.0, 0.9))
def test_frechet_commits_at_least_what_factor_does(batch, delta):
    # Fast-dLLM++'s heterogeneity bonus: for sorted c with u_j = 1 - c_(j) (non-decreasing),
    #   G_n >= 1 - sum_{j<=n} u_j - u_n = F_n + B_n,  F_n = 1 - (n+1) u_n,  B_n = sum_{j<=n} (u_n - u_j) >= 0,
    # and F_n > delta is exactly the factor condition at f = 1 - delta. So wherever the factor
    # rule's condition holds, G_n > delta too. The "first failure vs largest n" difference does
    # not weaken this: Factor's count n_F satisfies its condition at n_F (or is the floor of 1),
    # so Frechet's largest n is >= n_F. Both take prefixes of the same ranking, hence the
    # committed sets are nested, which is the strong form asserted here.
    conf, cand = batch
    factor = 1 - delta
    for b in range(conf.shape[0]):
        c = np.array([conf[b, i] for i in _ranked(conf[b], cand[b])])
        assume(np.all(np.abs(np.arange(2, len(c) + 2) * (1 - c) - factor) > 1e-9))
    frechet_mask = FrechetRule(delta).select(conf, cand)
    factor_mask = PaperFactorRule(factor).select(conf, cand)
    assert not (factor_mask & ~frechet_mask).any()
    assert (frechet_mask.sum(axis=1) >= factor_mask.sum(axis=1)).all()


# ----------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ThresholdRule(0.0), r"ThresholdRule.threshold=0.0 must be in \(0, 1\]"),
        (lambda: ThresholdRule(1.5), r"ThresholdRule.threshold=1.5"),
        (lambda: ThresholdRule(float("nan")), r"ThresholdRule.threshold=nan"),
        (lambda: FactorRule(0.0), r"FactorRule.factor=0.0"),
        (lambda: FactorRule(-1.0), r"FactorRule.factor=-1.0"),
        (lambda: FactorRule(float("inf")), r"FactorRule.factor=inf"),
        (lambda: FrechetRule(-0.1), r"FrechetRule.delta=-0.1 must be in \[0, 1\)"),
        (lambda: FrechetRule(1.0), r"FrechetRule.delta=1.0"),
        (lambda: FrechetRule(True), r"FrechetRule.delta=True"),
        (lambda: TopKRule(np.array([1, 2])), r"TopKRule.counts shape=\(2,\)"),
        (lambda: TopKRule(np.array([[1.0, 2.0]])), r"TopKRule.counts dtype=float64"),
        (lambda: TopKRule(np.array([[1, -1]])), r"TopKRule.counts min=-1"),
    ],
)
def test_bad_parameters(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_topk_bad_step_and_rows():
    rule = TopKRule(np.array([[1, 1]]))
    conf, cand = _row([0.5, 0.6])
    with pytest.raises(ConfigError, match=r"step=2 must be in \[0, 2\)"):
        rule.select(conf, cand, step=2)
    with pytest.raises(ValueError, match="2 rows"):
        TopKRule(np.array([[1], [1]])).select(conf, cand)


def test_select_rejects_bad_inputs():
    rule = ThresholdRule()
    with pytest.raises(ValueError, match="bool"):
        rule.select(np.ones((1, 2)), np.ones((1, 2), int))
    with pytest.raises(ValueError, match="shape"):
        rule.select(np.ones((1, 2)), np.ones((1, 3), bool))
    with pytest.raises(ValueError, match="NaN"):
        rule.select(np.array([[np.nan, 0.5]]), np.ones((1, 2), bool))


def test_unit_life():
    """A rule owns its unit: LLaDA's schedule is built at the unit's start and ends the unit
    after its steps; the per-step rules end it when no candidate is left."""
    masked = np.array([[True] * 8, [True] * 5 + [False] * 3])
    schedule = TopKSchedule(steps=8)  # 8 steps over 2 units: 4 per unit
    unit = schedule.begin(masked, units=2)
    assert isinstance(unit, TopKRule) and unit.counts.tolist() == [[2, 2, 2, 2], [2, 1, 1, 1]]
    assert not unit.finished(3, np.zeros_like(masked)) and unit.finished(4, masked)
    assert unit.max_steps(8) == 4
    assert TopKSchedule().begin(masked, units=2).counts.shape == (2, 8)  # default: one per slot
    with pytest.raises(ConfigError, match=r"steps=6 must be a positive multiple of the number of blocks \(4\)"):
        TopKSchedule(steps=6).check(units=4)
    for rule in (ThresholdRule(), FactorRule(), PaperFactorRule(), FrechetRule()):
        assert isinstance(rule, CommitRule) and rule.begin(masked, units=2) is rule
        assert rule.finished(1, np.zeros_like(masked)) and not rule.finished(1, masked)
        assert rule.max_steps(8) == 8


def test_topk_counts_are_a_frozen_copy():
    counts = np.array([[1, 2]])
    rule = TopKRule(counts)
    counts[0, 0] = 5
    assert rule.counts.tolist() == [[1, 2]]
    with pytest.raises(ValueError):
        rule.counts[0, 0] = 3


def test_no_jax_import():
    # The host runtime must run where only NumPy (and LiteRT) is installed.
    code = "import sys, dlm_jax.runtime.commit; assert 'jax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)

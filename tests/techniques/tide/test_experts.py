"""TIDE expert placement (TIDE §3.3, Alg. 1), NumPy only: the refresh schedule within blocks, the
top-B-by-hits target and its tie rule, static / per-step / once-per-block limits, migrations
against Eq. 5 on synthetic drifting routing, the drift and miss-curve estimates, the tau
solver, and bad configurations."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from dlm_jax import ConfigError
from dlm_jax.techniques.tide.experts import (
    ExpertPlacement,
    cpu_cost,
    drift,
    io_cost,
    miss_curve,
    solve_tau,
)


def _topk(layers: list[list[int]]) -> np.ndarray:
    """Per layer, one expert id per token -> [L, N, 1] (rows padded with -1)."""
    n = max(len(ids) for ids in layers)
    return np.array([ids + [-1] * (n - len(ids)) for ids in layers], np.int32)[:, :, None]


def _reference_top_b(counts: np.ndarray, resident: set[int], budget: int) -> set[int]:
    """Top-B by hits, ties to resident experts, then lower id (written out plainly)."""
    order = sorted(range(len(counts)), key=lambda e: (-counts[e], e not in resident, e))
    return set(order[:budget])


def _random_trace(rng: np.random.Generator, blocks: int, steps: int, layers: int, tokens: int, k: int,
                  n_experts: int) -> list[list[np.ndarray]]:
    # A skewed router, so that hit counts tie sometimes and differ mostly.
    p = rng.dirichlet(np.full(n_experts, 0.3))
    return [[rng.choice(n_experts, size=(layers, tokens, k), p=p).astype(np.int32) for _ in range(steps)]
            for _ in range(blocks)]


def test_refresh_exactly_at_multiples_of_tau_within_each_block():
    rng = np.random.default_rng(0)
    trace = _random_trace(rng, blocks=3, steps=11, layers=2, tokens=6, k=2, n_experts=8)
    for tau in (1, 3, 4, 11, 20):
        placement = ExpertPlacement(2, 8, 3, tau)
        for block in trace:
            for t, topk in enumerate(block):
                before = placement.resident
                record = placement.step(t, topk)
                assert record.refresh == (t % tau == 0)
                if not record.refresh:
                    assert record.migrations.tolist() == [0, 0]
                    assert (placement.resident == before).all()
        assert placement.refreshes == 3 * math.ceil(11 / tau)


def test_refresh_sets_top_b_by_hits_with_tie_rule():
    placement = ExpertPlacement(1, 6, 2, 1, initial=np.array([[4, 5]]))
    # hits: 1 -> 3, 2 -> 1, 5 -> 1: expert 5 (resident) beats 2 on the tie.
    record = placement.step(0, _topk([[1, 1, 1, 2, 5]]))
    assert placement.resident.tolist() == [[1, 5]]
    assert record.migrations.tolist() == [1]
    assert record.misses.tolist() == [1] and record.hits.tolist() == [4] and record.unique.tolist() == [3]
    # A tie among non-resident experts goes to the lower id: 0 and 3 tie, 1 and 5 have no hits.
    placement.step(1, _topk([[3, 0]]))
    assert placement.resident.tolist() == [[0, 3]]
    # All tied at zero hits: the resident ones stay.
    record = placement.step(2, _topk([[-1]]))
    assert placement.resident.tolist() == [[0, 3]] and record.migrations.tolist() == [0]


@pytest.mark.parametrize("hits", ["current_step", "previous_step"])
def test_resident_set_matches_reference_after_every_refresh(hits):
    rng = np.random.default_rng(1)
    trace = _random_trace(rng, blocks=4, steps=9, layers=3, tokens=5, k=2, n_experts=10)
    placement = ExpertPlacement(3, 10, 4, 2, hits)
    resident = [set(range(4)) for _ in range(3)]
    previous = None
    for block in trace:
        for t, topk in enumerate(block):
            counts = np.stack([np.bincount(layer.ravel(), minlength=10) for layer in topk])
            ranking = counts if hits == "current_step" else previous
            record = placement.step(t, topk)
            if t % 2 == 0 and ranking is not None:
                target = [_reference_top_b(ranking[i], resident[i], 4) for i in range(3)]
                assert record.migrations.tolist() == [len(target[i] - resident[i]) for i in range(3)]
                resident = target
            assert [set(r.tolist()) for r in placement.resident] == resident
            assert placement.resident.shape == (3, 4)
            missed = [sum(int(counts[i, e]) for e in range(10) if e not in resident[i]) for i in range(3)]
            assert record.misses.tolist() == missed
            assert (record.misses + record.hits).tolist() == counts.sum(1).tolist()
            previous = counts


def test_previous_step_hits_carry_across_blocks_and_keep_the_first_placement():
    placement = ExpertPlacement(1, 4, 1, 2, "previous_step")
    assert not placement.step(0, _topk([[3, 3]])).refresh  # nothing before: the initial set stays
    assert placement.resident.tolist() == [[0]]
    placement.step(1, _topk([[2, 2, 2]]))
    record = placement.step(0, _topk([[1]]))  # a new block ranks by the last block's last step
    assert record.refresh and placement.resident.tolist() == [[2]]
    assert record.misses.tolist() == [1]


def test_static_never_migrates():
    rng = np.random.default_rng(2)
    trace = _random_trace(rng, blocks=3, steps=8, layers=2, tokens=6, k=2, n_experts=8)
    initial = np.array([[5, 1], [7, 6]])
    placement = ExpertPlacement(2, 8, 2, None, initial=initial, shared=1)
    for block in trace:
        for t, topk in enumerate(block):
            assert not placement.step(t, topk).refresh
    assert placement.refreshes == 0 and placement.migrations.tolist() == [0, 0]
    assert placement.resident.tolist() == [[1, 5], [6, 7]] and placement.shared == 1


def test_tau_one_is_per_step_accounting():
    rng = np.random.default_rng(3)
    trace = _random_trace(rng, blocks=3, steps=10, layers=2, tokens=4, k=2, n_experts=9)
    placement = ExpertPlacement(2, 9, 3, 1)
    expected = 0
    resident = [set(range(3)) for _ in range(2)]
    for block in trace:
        for t, topk in enumerate(block):
            record = placement.step(t, topk)
            counts = [np.bincount(layer.ravel(), minlength=9) for layer in topk]
            target = [_reference_top_b(counts[i], resident[i], 3) for i in range(2)]
            expected += sum(len(target[i] - resident[i]) for i in range(2))
            resident = target
            assert record.refresh
    assert int(placement.migrations.sum()) == expected


def test_tau_at_least_block_length_refreshes_once_per_block():
    rng = np.random.default_rng(4)
    trace = _random_trace(rng, blocks=4, steps=6, layers=1, tokens=5, k=2, n_experts=7)
    for tau in (6, 7, 100):
        placement = ExpertPlacement(1, 7, 2, tau)
        refreshes = [t for block in trace for t, s in enumerate(block) if placement.step(t, s).refresh]
        assert refreshes == [0, 0, 0, 0]


def _drifting_trace(rng, *, blocks, steps, budget, d, tau, noise):
    """One layer whose optimal set loses each expert with probability d per step to a
    never-seen expert. The optimal experts get 4 tokens each, `noise` other tokens one each,
    so the top-B by hits is exactly the optimal set. Returns (trace, the set `tau` steps
    before the first step), so that every refresh looks back exactly tau steps."""
    fresh = iter(range(budget, 10**6))
    current = list(range(budget))
    sets = []
    for _ in range(tau + blocks * steps):
        current = [next(fresh) if rng.random() < d else e for e in current]
        sets.append(current)
    n_experts = next(fresh)
    trace = []
    for b in range(blocks):
        block = []
        for t in range(steps):
            optimal = sets[tau + b * steps + t]
            others = rng.choice(n_experts, size=noise)
            ids = np.array([e for e in optimal for _ in range(4)] + [e for e in others if e not in optimal])
            block.append(ids.astype(np.int32)[None, :, None])
        trace.append(block)
    return trace, np.array([sets[0]]), n_experts


@pytest.mark.parametrize("tau", [1, 2, 4, 8])
def test_migrations_match_eq5_on_synthetic_drift(tau):
    rng = np.random.default_rng(10 + tau)
    blocks, steps, budget, d = 150, 32, 8, 0.1
    trace, initial, n_experts = _drifting_trace(rng, blocks=blocks, steps=steps, budget=budget, d=d, tau=tau,
                                                noise=3)
    placement = ExpertPlacement(1, n_experts, budget, tau, initial=initial)
    for block in trace:
        for t, topk in enumerate(block):
            placement.step(t, topk)
    assert placement.refreshes == blocks * math.ceil(steps / tau)
    expected = blocks * io_cost(tau, steps, budget, d, 1.0)
    assert abs(placement.migrations.sum() / expected - 1) < 0.05
    if tau == 1:
        assert abs(drift(trace, budget) / d - 1) < 0.05


def test_drift_and_miss_curve_on_hand_made_traces():
    # B = 2. Block 1: tops {0,1} -> {0,2} -> {0,2}; block 2: {3,4} -> {3,4}.
    block1 = [_topk([[0, 0, 1, 1]]), _topk([[0, 0, 2, 2, 1]]), _topk([[0, 0, 2, 2, 1, 3]])]
    block2 = [_topk([[3, 4]]), _topk([[4, 3, 3]])]
    trace = [block1, block2]
    assert drift(trace, 2) == pytest.approx(1 / 2 / 3)  # one move over 3 pairs of B = 2
    f = miss_curve(trace, 2, 3)
    # lag 0: each step against its own top: misses 0, 1, 2 of 4, 5, 6 / 0, 0 of 2, 3.
    miss0 = 3 / 20
    # lag 1: step 1 vs top{0,1}: 2 of 5; step 2 vs top{0,2}: 2 of 6; block 2: 0 of 3.
    miss1 = 4 / 14
    # lag 2: step 2 vs top{0,1}: 3 of 6.
    miss2 = 3 / 6
    assert f.tolist() == pytest.approx([0.0, miss0, (miss0 + miss1) / 2, (miss0 + miss1 + miss2) / 3])
    with pytest.raises(ConfigError, match="max_lag=4"):
        miss_curve(trace, 2, 4)
    with pytest.raises(ConfigError, match="at least 2 steps"):
        drift([[block1[0]], [block2[0]]], 2)


def test_drift_matches_a_plain_reference():
    rng = np.random.default_rng(7)
    trace = _random_trace(rng, blocks=3, steps=7, layers=2, tokens=4, k=2, n_experts=9)
    moved = pairs = 0
    for block in trace:
        tops = [set(), set()]
        for t, topk in enumerate(block):
            new = [_reference_top_b(np.bincount(topk[i].ravel(), minlength=9), tops[i], 3) for i in range(2)]
            if t:
                moved += sum(len(new[i] - tops[i]) for i in range(2))
                pairs += 2
            tops = new
    assert drift(trace, 3) == pytest.approx(moved / (pairs * 3))


def test_cost_model_is_eq5_and_eq6():
    assert io_cost(1, 32, 8, 0.25, 2.0) == pytest.approx(2.0 * 8 * 32 * 0.25)  # M(1) = B*T*d
    assert io_cost(4, 32, 8, 0.25, 1.0) == pytest.approx(8 * 32 / 4 * (1 - 0.75**4))
    f = np.array([0.0, 0.1, 0.2, 0.4])
    assert cpu_cost(3, 32, 8, f, 0.5) == pytest.approx(0.5 * 32 * 8 * 0.4)
    assert cpu_cost(np.array([1, 2]), 32, 8, f, 1.0).tolist() == pytest.approx([25.6, 51.2])


def test_solve_tau_is_the_exhaustive_argmin_and_has_the_limits():
    rng = np.random.default_rng(5)
    T, B = 16, 4
    for _ in range(20):
        f = np.concatenate([[0.0], np.sort(rng.random(T - 1))])  # non-decreasing
        d, c_io, c_cpu = rng.random(), rng.random(), rng.random()
        tau, table = solve_tau(T, B, d, f, c_io, c_cpu)
        costs = [c_io * (B * T / s) * (1 - (1 - d) ** s) + c_cpu * T * B * f[s] for s in range(1, T)]
        assert tau == 1 + int(np.argmin(costs))
        assert table.taus.tolist() == list(range(1, T)) and table.total.tolist() == pytest.approx(costs)
        assert table.total.tolist() == pytest.approx((table.io + table.cpu).tolist())
        assert solve_tau(T, B, d, f, 0.0, c_cpu)[0] == 1
        assert solve_tau(T, B, d, f, 1e-12, c_cpu)[0] == 1
        assert solve_tau(T, B, d, f, c_io, 0.0)[0] == T - 1
        assert solve_tau(T, B, d, f, c_io, 1e-12)[0] == T - 1
    # Ties go to the smaller tau: nothing drifts and nothing misses.
    assert solve_tau(T, B, 0.0, np.zeros(T), 1.0, 1.0)[0] == 1


def test_placement_never_mutates_routing():
    rng = np.random.default_rng(6)
    trace = _random_trace(rng, blocks=2, steps=5, layers=2, tokens=4, k=2, n_experts=6)
    trace[0][0][0, 0, 0] = -1
    copies = [[s.copy() for s in block] for block in trace]
    for hits in ("current_step", "previous_step"):
        placement = ExpertPlacement(2, 6, 2, 2, hits)
        for block in trace:
            for t, s in enumerate(block):
                placement.step(t, s)
    drift(trace, 2)
    miss_curve(trace, 2, 4)
    assert all((a == b).all() for x, y in zip(trace, copies, strict=True) for a, b in zip(x, y, strict=True))


@pytest.mark.parametrize("make, match", [
    (lambda: ExpertPlacement(2, 4, 5, 1), "budget=5"),
    (lambda: ExpertPlacement(2, 4, 0, 1), "budget=0"),
    (lambda: ExpertPlacement(2, 4, 2, 0), "tau=0"),
    (lambda: ExpertPlacement(2, 4, 2, 1, "global"), "hits='global'"),
    (lambda: ExpertPlacement(1, 4, 2, 1, initial=np.array([[1, 1]])), "repeated"),
    (lambda: ExpertPlacement(1, 4, 2, 1, initial=np.array([[1, 4]])), "initial ids"),
    (lambda: ExpertPlacement(1, 4, 2, 1).step(0, np.zeros((2, 1, 1), int)), "2 layers"),
    (lambda: ExpertPlacement(1, 4, 2, 1).step(0, np.full((1, 1, 1), 4)), "ids span"),
    (lambda: solve_tau(1, 2, 0.1, np.zeros(2), 1.0, 1.0), "T=1"),
    (lambda: solve_tau(8, 2, 1.5, np.zeros(8), 1.0, 1.0), "d=1.5"),
    (lambda: solve_tau(8, 2, 0.1, np.zeros(4), 1.0, 1.0), "f shape"),
])
def test_bad_configurations_raise_one_line_config_errors(make, match):
    with pytest.raises(ConfigError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_no_jax_import():
    # The host runtime must run where only NumPy (and LiteRT) is installed.
    code = "import sys, dlm_jax.techniques.tide.experts; assert 'jax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_upcoming_is_the_set_the_step_then_runs_with():
    """Previous-step hits and static placements know a step's resident sets before it runs
    (split execution places them ahead); current-step hits do not."""
    rng = np.random.default_rng(5)
    for hits, tau in (("previous_step", 2), ("previous_step", 1), ("current_step", None)):
        p = ExpertPlacement(2, 8, 3, tau, hits)
        for block in range(3):
            for t in range(5):
                ahead = p.upcoming(t)
                p.step(t, rng.integers(-1, 8, (2, 6, 2)))
                np.testing.assert_array_equal(p.resident, ahead)
    with pytest.raises(ConfigError, match="known only after the step"):
        ExpertPlacement(2, 8, 3, 2, "current_step").upcoming(0)

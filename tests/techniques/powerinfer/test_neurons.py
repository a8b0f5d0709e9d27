"""PowerInfer-2 neuron engine host runtime (PowerInfer-2 §4, §5), NumPy only: the `ffn_active` bit packing,
window-union activation statistics, the per-bucket hot/cold planner and its constraints, the
three-region neuron cache (LRU granularities, budget, staleness), and the predictors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from dlm_jax import ConfigError
from dlm_jax.techniques.powerinfer.neuron_cache import NeuronCache
from dlm_jax.techniques.powerinfer.neuron_plan import NeuronCosts, NeuronPlan, min_cache_neurons, plan_neurons
from dlm_jax.techniques.powerinfer.neurons import ActivationStats, pack_active, unpack_active
from dlm_jax.techniques.powerinfer.predictor import LowRankPredictor, OraclePredictor, recall_precision

# --------------------------------------------------------------------------- bit packing


@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 64, 70])
def test_pack_round_trips_and_matches_packbits_little_endian(n):
    rng = np.random.default_rng(n)
    active = rng.random((2, 3, 4, n)) < 0.5
    active[0, 0, 0] = True  # every bit of the row, bit 31 (the int32 sign bit) included when n >= 32
    packed = pack_active(active)
    words = -(-n // 32)
    assert packed.dtype == np.int32 and packed.shape == (2, 3, 4, words)
    assert np.array_equal(unpack_active(packed, n), active)
    ref = np.packbits(active, axis=-1, bitorder="little")
    ref = np.concatenate([ref, np.zeros(ref.shape[:-1] + (4 * words - ref.shape[-1],), np.uint8)], axis=-1)
    ref = np.ascontiguousarray(ref).view("<u4")
    assert np.array_equal(packed.view(np.uint32), ref)
    if n >= 32:
        assert packed[0, 0, 0, 0] == -1  # all 32 bits set
    if n % 32:  # padding bits are zero
        assert packed[0, 0, 0, -1] == (1 << (n % 32)) - 1


def test_pack_bit_positions():
    active = np.zeros(40, bool)
    active[[0, 31, 33]] = True
    packed = pack_active(active)
    assert packed.tolist() == [1 - 2**31, 1 << 1]  # bits 0 and 31 of word 0; bit 1 of word 1
    assert packed[0] < 0
    with pytest.raises(ConfigError):
        unpack_active(packed, 70)  # needs 3 words
    with pytest.raises(ConfigError):
        pack_active(active.astype(np.int32))


# --------------------------------------------------------------------------- statistics


def _hand_stats() -> ActivationStats:
    """L=1, F=3, B=2, W=5 with dead rows active everywhere (they must not count)."""
    active = np.zeros((1, 2, 5, 3), bool)
    live = np.array([[1, 0, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    active[0, :, :] = ~live[:, :, None]  # dead rows: every neuron "active"
    active[0, 0, 0, 0] = active[0, 0, 2, 1] = active[0, 0, 4, 2] = True
    active[0, 1, 0, 2] = active[0, 1, 2, 0] = True
    stats = ActivationStats(1, 3, windows=(1, 2, 4, 8))
    stats.add(active, live)
    return stats


def test_window_unions_over_consecutive_live_rows():
    stats = _hand_stats()
    assert stats.tokens == 7
    assert stats.token_hits.tolist() == [[2, 1, 2]]
    # w=2: b0 live rows (0,2) -> {0,1}, (3,4) -> {2}; b1 live rows (0,1) -> {2}, row 2 dropped
    assert stats.groups[2] == 3 and stats.hits[2].tolist() == [[1, 1, 2]]
    # w=4: b0 rows (0,2,3,4) -> {0,1,2}; b1 has 3 live rows: no group
    assert stats.groups[4] == 1 and stats.hits[4].tolist() == [[1, 1, 1]]
    assert stats.groups[1] == 7 and np.array_equal(stats.hits[1], stats.token_hits)
    assert stats.recorded_windows() == (1, 2, 4)
    np.testing.assert_allclose(stats.prob(2), [[1 / 3, 1 / 3, 2 / 3]])
    np.testing.assert_allclose(stats.density(4), [1.0])
    np.testing.assert_allclose(stats.token_density(), [5 / 21])
    with pytest.raises(ConfigError, match="no group of 8"):
        stats.prob(8)
    with pytest.raises(ConfigError):
        stats.prob(3)


def test_stats_packed_input_merge_and_json():
    stats = _hand_stats()
    active = np.zeros((1, 2, 5, 3), bool)
    active[0, 1, 1] = True
    again = ActivationStats(1, 3, windows=(1, 2, 4, 8))
    again.add_packed(pack_active(active))
    merged = stats.merge(again)
    assert merged.tokens == 17 and stats.tokens == 7  # merge leaves its inputs alone
    assert merged.hits[2].tolist() == [[1 + 1, 1 + 1, 2 + 1]] and merged.groups[2] == 3 + 4
    back = ActivationStats.from_dict(json.loads(json.dumps(merged.to_dict())))
    assert back.to_dict() == merged.to_dict()
    with pytest.raises(ConfigError):
        stats.merge(ActivationStats(1, 3))


def _skewed_stats(seed: int = 0, layers: int = 3, neurons: int = 64, steps: int = 12) -> ActivationStats:
    """Per layer a shuffled geometric spread of per-token rates in [0.02, 0.45], every row live."""
    rng = np.random.default_rng(seed)
    rates = 0.02 + 0.43 * np.exp(-np.arange(neurons) / 12)
    rates = np.stack([rng.permutation(rates) for _ in range(layers)])
    stats = ActivationStats(layers, neurons)
    for _ in range(steps):
        stats.add(rng.random((layers, 2, 32, neurons)) < rates[:, None, None, :])
    return stats


def test_density_non_decreasing_in_window():
    stats = _skewed_stats()
    dens = np.stack([stats.density(w) for w in stats.windows])  # [windows, L]
    assert (np.diff(dens, axis=0) >= 0).all()
    assert (dens[-1] > 0.7).all() and (dens[0] < 0.25).all()  # unions near dense at W = 32
    np.testing.assert_allclose(dens[0], stats.token_density())


# --------------------------------------------------------------------------- planner

NB = 8192
COSTS = NeuronCosts.measured(npu_bytes_per_s=56e9, cpu_bytes_per_s=43.9e9, io_bytes_per_s=4e9,
                             attention_fixed_seconds=10 * NB / 4e9, attention_seconds_per_row=NB / 4e9 / 4,
                             cpu_seconds_per_byte_row=1e-12)
BUCKETS = (1, 2, 4, 8, 16, 32)


def _check_plan(plan: NeuronPlan, stats: ActivationStats) -> None:
    costs = plan.costs
    prev = np.zeros(stats.n_layers, np.int64)
    total = stats.n_layers * stats.n_neurons
    min_cache = int(min_cache_neurons(stats, plan.prob_windows[plan.windows[0]]).sum()) * NB
    for w in plan.windows:
        hot = plan.hot[w]
        assert (hot >= prev).all()  # nested hot sets
        assert (costs.io_seconds((hot - prev) * NB) <= costs.attention_seconds(w) * (1 + 1e-12)).all()
        hot_bytes = int(hot.sum()) * NB
        cache_min = max(plan.cache_fraction_min * (total - hot.sum()) * NB, min_cache)
        assert plan.resident_bytes + hot_bytes + cache_min <= plan.budget_bytes
        assert plan.cache_capacity(w) == plan.budget_bytes - plan.resident_bytes - hot_bytes
        for layer in range(stats.n_layers):
            hs, cs = plan.hot_set(layer, w), plan.cold_set(layer, w)
            assert len(hs) == hot[layer] and sorted(np.concatenate([hs, cs]).tolist()) == list(range(stats.n_neurons))
        prev = hot
    assert plan.cache_bytes == plan.cache_capacity(plan.windows[-1])


def test_plan_constraints_and_json_round_trip():
    stats = _skewed_stats()
    plan = plan_neurons(stats, windows=BUCKETS, budget_bytes=10**9, resident_bytes=10**6, neuron_bytes=NB,
                        cost=COSTS)
    _check_plan(plan, stats)
    hot = np.stack([plan.hot[w] for w in BUCKETS])
    assert hot[0].sum() > 0 and (hot[-1] > hot[0]).all()  # the hot share grows with the window
    # order: hottest first at the largest window
    top = stats.prob(32)
    for layer in range(stats.n_layers):
        assert (np.diff(top[layer, plan.order[layer]]) <= 0).all()
    back = NeuronPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and back.costs == COSTS
    assert np.array_equal(back.hot_set(1, 3), plan.hot_set(1, 4))  # 3 rows run in bucket 4


def test_plan_splits_at_the_cost_balance_when_nothing_binds():
    stats = _skewed_stats(seed=1)
    free = NeuronCosts.measured(npu_bytes_per_s=56e9, cpu_bytes_per_s=20e9, io_bytes_per_s=math.inf,
                                attention_fixed_seconds=0.0)
    plan = plan_neurons(stats, windows=(1, 8), budget_bytes=10**12, resident_bytes=0, neuron_bytes=NB, cost=free,
                        cache_fraction_min=0.0)
    for layer in range(stats.n_layers):  # bucket 1: the argmin of max(T_npu, T_cpu) over every h
        p = stats.prob(1)[layer, plan.order[layer]]
        costs = [max(free.npu_seconds(h * NB, 1), free.cpu_seconds(p[h:].sum() * NB, 1)) for h in range(len(p) + 1)]
        assert plan.hot[1][layer] == int(np.argmin(costs))
        assert max(plan.npu_seconds[1][layer], plan.cpu_seconds[1][layer]) == pytest.approx(min(costs))


def test_unlimited_budget_and_slow_cpu_make_everything_hot():
    stats = _skewed_stats(seed=2)
    slow = NeuronCosts.measured(npu_bytes_per_s=56e9, cpu_bytes_per_s=1.0, io_bytes_per_s=math.inf,
                                attention_fixed_seconds=0.0)
    plan = plan_neurons(stats, windows=BUCKETS, budget_bytes=10**15, resident_bytes=0, neuron_bytes=NB, cost=slow)
    for w in BUCKETS:
        assert plan.hot[w].tolist() == [stats.n_neurons] * stats.n_layers
        assert len(plan.cold_set(0, w)) == 0


def test_memory_budget_caps_the_hot_sets():
    stats = _skewed_stats(seed=3)
    slow = NeuronCosts.measured(npu_bytes_per_s=56e9, cpu_bytes_per_s=1e9, io_bytes_per_s=math.inf,
                                attention_fixed_seconds=0.0)
    budget = 10**6 + 100 * NB
    plan = plan_neurons(stats, windows=BUCKETS, budget_bytes=budget, resident_bytes=10**6, neuron_bytes=NB, cost=slow)
    _check_plan(plan, stats)
    # the cap: 100 neurons of room less the minimum cold cache (it binds before the 10% cache share)
    assert plan.hot[32].sum() == 100 - min_cache_neurons(stats, 1).sum() < stats.n_layers * stats.n_neurons
    assert plan.cache_bytes >= 0.1 * (stats.n_layers * stats.n_neurons - plan.hot[32].sum()) * NB


def test_plan_order_ties_go_to_token_probability_then_index():
    stats = ActivationStats(1, 4, windows=(1, 2))
    active = np.zeros((1, 1, 2, 4), bool)
    active[0, 0, 0, 1] = True
    active[0, 0, 1, :2] = True  # P_2 = [1, 1, 0, 0], P_1 = [0.5, 1, 0, 0]
    stats.add(active)
    plan = plan_neurons(stats, windows=(2,), budget_bytes=10**9, resident_bytes=0, neuron_bytes=NB, cost=COSTS)
    assert plan.order.tolist() == [[1, 0, 2, 3]]


@pytest.mark.parametrize("make, match", [
    (lambda: ActivationStats(2, 4).add(np.zeros((1, 1, 2, 4), bool)), "must be bool"),
    (lambda: ActivationStats(1, 4).add(np.zeros((1, 1, 2, 4), bool), np.ones((1, 3), bool)), "live shape"),
    (lambda: ActivationStats(1, 4, windows=()), "at least one"),
    (lambda: plan_neurons(_skewed_stats(), windows=(1, 2), budget_bytes=10**9, resident_bytes=0, neuron_bytes=NB,
                          cost=COSTS, cache_fraction_min=1.0), "cache_fraction_min"),
    (lambda: plan_neurons(ActivationStats(1, 4), windows=(1,), budget_bytes=10**9, resident_bytes=0,
                          neuron_bytes=NB, cost=COSTS), "no recorded window"),
    (lambda: NeuronCosts(cpu_bytes_per_s=0.0), "cpu_bytes_per_s"),
    (lambda: NeuronCosts(attention_fixed_seconds=-1.0), "attention_fixed_seconds"),
    (lambda: NeuronCache(1, 4, 4, -1, 48), "capacity_bytes"),
    (lambda: NeuronCache(1, 4, 4, 100, 0), "neuron_bytes"),
    (lambda: LowRankPredictor([np.zeros((2, 1))], [np.zeros(2)], [np.zeros((1, 4))], [np.zeros(4)]), "shapes"),
])
def test_bad_configurations_raise_one_line_config_errors(make, match):
    with pytest.raises(ConfigError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_budget_below_the_resident_minimum_names_both_numbers():
    stats = _skewed_stats()
    resident = 5 * 10**6
    minimum = resident + int(min_cache_neurons(stats, 1).sum()) * NB
    budget = minimum - 1
    with pytest.raises(ConfigError) as info:
        plan_neurons(stats, windows=BUCKETS, budget_bytes=budget, resident_bytes=resident, neuron_bytes=NB,
                     cost=COSTS)
    message = str(info.value)
    assert f"memory budget {budget / 1e6:.2f} MB" in message and f"resident minimum {minimum / 1e6:.2f} MB" in message
    plan_neurons(stats, windows=BUCKETS, budget_bytes=minimum, resident_bytes=resident, neuron_bytes=NB, cost=COSTS)


# --------------------------------------------------------------------------- cache


def _values(layer, neurons, d=4):
    """Distinct rows per (layer, neuron, part): what a flash read of those neurons returns."""
    neurons = np.asarray(neurons, np.float32)
    return {p: np.repeat((1000 * layer + neurons + np.float32(0.1) * k)[:, None], d, axis=1)
            for k, p in enumerate(("gate", "up", "down"))}


def test_the_cache_is_a_neuron_lru():
    cache = NeuronCache(2, 16, 4, 3 * 48 + 10, 48)  # room for 3 neurons of 48 bytes
    assert cache.slots == 3
    assert cache.insert(0, [1, 2, 3], _values(0, [1, 2, 3])) == 3
    hit, slots = cache.lookup(0, [1])
    assert hit.all() and cache.rows(slots)["up"][0, 0] == np.float32(1.1)
    cache.insert(0, [4], _values(0, [4]))  # evicts 2, the least recently used
    hit, slots = cache.lookup(0, [2, 3, 4])
    assert hit.tolist() == [False, True, True]
    np.testing.assert_array_equal(cache.rows(slots)["down"][:, 0], np.float32([3.2, 4.2]))
    assert (cache.hits, cache.misses, cache.evictions) == (3, 1, 1)
    assert cache.insert(1, [10, 11, 12, 13, 14], _values(1, [10, 11, 12, 13, 14])) == 3  # keeps the last 3
    assert cache.lookup(1, [12, 13, 14])[0].all() and not cache.lookup(0, [1, 3, 4])[0].any()
    assert cache.bytes_in == (3 + 1 + 3) * 48 and cache.resident_bytes == 3 * 48


def test_invalidate_never_serves_stale_neurons():
    cache = NeuronCache(1, 8, 4, 10 * 48, 48)
    cache.insert(0, [1, 2], _values(0, [1, 2]))
    cache.invalidate()
    assert not cache.lookup(0, [1, 2])[0].any() and cache.resident_bytes == 0


def test_cache_never_exceeds_its_budget_or_serves_a_wrong_neuron():
    rng = np.random.default_rng(7)
    cache = NeuronCache(3, 64, 4, 40 * 48 + 47, 48)
    for _ in range(1500):
        layer = int(rng.integers(3))
        if rng.random() < 0.5:
            neurons = np.unique(rng.integers(0, 64, rng.integers(1, 60)))
            hit, _ = cache.lookup(layer, neurons)
            missing = neurons[~hit]
            stored = cache.insert(layer, missing, _values(layer, missing))
            assert stored == min(missing.size, 40)
        else:
            neurons = np.unique(rng.integers(0, 64, 10))
            hit, slots = cache.lookup(layer, neurons)
            want = _values(layer, neurons[hit])
            got = cache.rows(slots)
            for p in want:  # never stale: each slot holds the neuron the index says
                np.testing.assert_array_equal(got[p], want[p])
        if rng.random() < 0.01:
            cache.invalidate()
        assert cache.resident_bytes <= cache.capacity_bytes
        assert (cache.slot_of >= 0).sum() == (cache.owner[:, 0] >= 0).sum()
    assert cache.hits > 0 and cache.evictions > 0


# --------------------------------------------------------------------------- predictors


def test_low_rank_predictor_shapes_and_arrays_round_trip():
    pred = LowRankPredictor.init(2, 8, 16, 3, seed=1)
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    assert pred.predict(1, x).shape == (5, 16) and pred.predict(1, x).dtype == bool
    live = np.array([1, 0, 1, 1, 0], bool)
    assert np.array_equal(pred.predict_window(1, x, live), pred.predict(1, x)[live].any(0))
    assert pred.param_count() == 2 * (8 * 3 + 3 + 3 * 16 + 16)
    arrays = pred.to_arrays()
    assert sorted(arrays) == sorted(f"layers.{i}.{k}" for i in range(2) for k in ("w1", "b1", "w2", "b2"))
    back = LowRankPredictor.from_arrays(arrays)
    assert all(np.array_equal(arrays[k], v) for k, v in back.to_arrays().items())
    assert np.array_equal(back.predict(0, x), pred.predict(0, x))
    del arrays["layers.1.b2"]
    with pytest.raises(ConfigError, match="layers.1.b2"):
        LowRankPredictor.from_arrays(arrays)
    r = LowRankPredictor.rank_for(4096, 14336)
    assert r * (4096 + 1 + 14336) + 14336 <= 0.1 * 3 * 4096 * 14336 < (r + 1) * (4096 + 1 + 14336) + 14336


def test_predictor_threshold():
    logits = np.array([-2.0, 0.0, 1.0, 3.0], np.float32)  # sigmoid: 0.119, 0.5, 0.731, 0.953
    pred = LowRankPredictor([np.zeros((2, 1))], [np.zeros(1)], [np.zeros((1, 4))], [logits])
    x = np.ones((1, 2), np.float32)
    assert pred.predict(0, x).tolist() == [[False, False, True, True]]
    assert pred.predict(0, x, threshold=0.9).tolist() == [[False, False, False, True]]
    assert pred.predict(0, x, threshold=0.1).all()
    assert pred.predict(0, x, threshold=0.0).all() and not pred.predict(0, x, threshold=1.0).any()
    with pytest.raises(ConfigError):
        pred.predict(0, x, threshold=1.5)


def test_recall_precision_by_hand():
    assert recall_precision([1, 1, 0, 0, 1], [1, 0, 1, 0, 1]) == (2 / 3, 2 / 3)
    assert recall_precision([1, 0, 0, 0], [1, 1, 0, 0]) == (0.5, 1.0)
    assert recall_precision([0, 0], [0, 0]) == (1.0, 1.0)
    with pytest.raises(ConfigError):
        recall_precision([1], [1, 0])


def test_oracle_returns_exactly_the_truth():
    truth = np.random.default_rng(3).random((2, 4, 6)) < 0.4
    oracle = OraclePredictor(truth)
    x = np.zeros((4, 8), np.float32)
    for layer in range(2):
        assert np.array_equal(oracle.predict(layer, x), truth[layer])
        assert recall_precision(oracle.predict(layer, x), truth[layer]) == (1.0, 1.0)
    live = np.array([0, 1, 1, 0], bool)
    assert np.array_equal(oracle.predict_window(1, x, live), truth[1, 1:3].any(0))
    with pytest.raises(ConfigError):
        oracle.predict(0, x[:3])


def test_no_jax_import():
    # The host runtime must run where only NumPy (and LiteRT) is installed.
    code = ("import sys, dlm_jax.techniques.powerinfer.neurons, dlm_jax.techniques.powerinfer.neuron_plan, dlm_jax.techniques.powerinfer.neuron_cache, "
            "dlm_jax.techniques.powerinfer.predictor; assert 'jax' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)

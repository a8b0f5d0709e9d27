"""PowerInfer-2's neuron pipeline simulator (PowerInfer-2 §4.3; Fig 14 of §7.5) on small synthetic traces.

A simulator whose cluster-level pipeline could come out slower than the matrix-level one, or
whose I/O thread overlapped two requests on the single UFS queue, would report a Fig 14 ablation
that looks plausible and is wrong with no error anywhere: these tests pin the scheduling and the
byte accounting the ablation rests on.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dlm_jax._errors import ConfigError
from dlm_jax.techniques.powerinfer.pipeline import (ABLATION, CLUSTER, GATE, MATRIX, MATRIX_PIPELINE, SERIAL, ClusterWork, FlashLayout,
                               NeuronCacheModel, PhoneCosts, PipelineTrace, Schedule, Stage, TraceStep, WHOLE,
                               ablation, simulate, simulate_layer)

KB = 1024
GIO_STAGE, UDIO_STAGE = 1, 3  # dlm_jax.techniques.powerinfer.pipeline.GIO, UDIO


def synthetic_trace(seed: int = 0, *, layers: int = 2, neurons: int = 512, steps: int = 40, windows=(1,),
                    hot=(64,), density: float = 0.05, extra: float = 0.3, missed: float = 0.02) -> PipelineTrace:
    """Skewed (Pareto) per-neuron activation probabilities; each step's window of W rows
    activates a neuron if any row does; the predictor finds most of them (`missed` dropped) and
    adds false positives (`extra` x p). Steps cycle through `windows`; `hot[i]` neurons per
    layer are hot at bucket `windows[i]` (the most probable ones)."""
    rng = np.random.default_rng(seed)
    probs = np.sort(rng.pareto(1.2, (layers, neurons)), axis=1)[:, ::-1]
    probs = np.minimum(1.0, probs / probs.mean(1, keepdims=True) * density)
    order = np.stack([rng.permutation(neurons) for _ in range(layers)])  # order[l, rank] = neuron
    p = np.zeros((layers, neurons))
    np.put_along_axis(p, order, probs, axis=1)
    out = []
    for s in range(steps):
        w = windows[s % len(windows)]
        active = (rng.random((layers, w, neurons)) < p[:, None]).any(1)
        pred = (active & (rng.random((layers, neurons)) >= missed)) | (rng.random((layers, neurons)) < p * extra)
        out.append(TraceStep(w, tuple(np.flatnonzero(a).astype(np.int32) for a in pred),
                             tuple(np.flatnonzero(a).astype(np.int32) for a in active)))
    buckets = sorted(set(windows))
    return PipelineTrace(order, {w: [h] * layers for w, h in zip(buckets, hot)}, tuple(out), steps)


def hand_trace(steps: list[tuple[list[int], list[int]]], *, neurons: int = 16, hot: int = 0) -> PipelineTrace:
    """One layer, W = 1; each step (predicted ids, active ids)."""
    return PipelineTrace(np.arange(neurons)[None], {1: [hot]},
                         tuple(TraceStep(1, (np.array(p, np.int32),), (np.array(a, np.int32),)) for p, a in steps),
                         len(steps))


def random_clusters(rng: np.random.Generator, *, reads: bool = True) -> list[ClusterWork]:
    def io() -> tuple:
        if not reads or rng.random() < 0.4:
            return ()
        return tuple((4 * KB, float(rng.exponential(1.0))) for _ in range(rng.integers(1, 5)))

    def work() -> float:
        return float(rng.exponential(1.0)) * (rng.random() < 0.8)

    out = []
    for _ in range(rng.integers(1, 10)):
        if rng.random() < 0.2:  # a hot cluster on the NPU: loaded whole, dense, no predictor
            out.append(ClusterWork(0.0, io(), work(), (), work(), "npu"))
        else:
            out.append(ClusterWork(work(), io(), work(), io(), work()))
    return out


# --------------------------------------------------------------------------- the schedule

def test_cluster_level_never_slower_than_matrix_level_per_layer():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        clusters = random_clusters(rng)
        serial, matrix, cluster = (simulate_layer(clusters, s).makespan for s in (SERIAL, MATRIX, CLUSTER))
        assert cluster <= matrix * (1 + 1e-12) and matrix <= serial * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_cluster_level_never_slower_than_matrix_level_on_traces(seed):
    trace = synthetic_trace(seed, windows=(1, 4, 32), hot=(16, 48, 96), steps=30)
    for xpu in (False, True):
        m = simulate(trace, Stage("m", cache=True, schedule=MATRIX, xpu=xpu))
        c = simulate(trace, Stage("c", cache=True, schedule=CLUSTER, xpu=xpu))
        assert m.requests > 0 and m.flash_bytes == c.flash_bytes  # the same reads, scheduled differently
        assert c.seconds <= m.seconds * (1 + 1e-12)


def test_schedules_equal_when_nothing_is_on_flash():
    rng = np.random.default_rng(1)
    for _ in range(500):
        clusters = random_clusters(rng, reads=False)
        spans = [simulate_layer(clusters, s).makespan for s in (SERIAL, MATRIX, CLUSTER)]
        assert spans == pytest.approx([spans[0]] * 3, rel=1e-12)
    trace = synthetic_trace(2, windows=(1, 8), hot=(0, 0))
    runs = [simulate(trace, Stage(s.name, schedule=s), offload=0.0) for s in (SERIAL, MATRIX, CLUSTER)]
    assert runs[0].requests == 0 and runs[0].io_wait == 0
    assert [r.seconds for r in runs] == pytest.approx([runs[0].seconds] * 3, rel=1e-12)


def test_one_io_request_in_flight():
    trace = synthetic_trace(3, windows=(1, 16), hot=(32, 64))
    for stage in (*ABLATION, MATRIX_PIPELINE):
        run = simulate(trace, stage, log=True)
        assert len(run.events) == run.requests > 0
        events = sorted(run.events, key=lambda e: (e[5], e[6]))
        for a, b in zip(events, events[1:]):
            assert b[5] >= a[6] - 1e-12 * max(1.0, a[6]), (stage.name, a, b)
        assert sum(e[6] - e[5] for e in events) == pytest.approx(run.io_busy, rel=1e-9)


def test_cluster_level_moves_compute_to_in_memory_clusters():
    """Fig 6: with half the clusters on flash, the cluster-level pipeline hides I/O that the
    matrix-level one waits for."""
    clusters = [ClusterWork(0.05, ((4 * KB, 1.0),) * (k % 2), 0.5, ((4 * KB, 1.0),) * (k % 2), 0.5) for k in range(8)]
    serial, matrix, cluster = (simulate_layer(clusters, s) for s in (SERIAL, MATRIX, CLUSTER))
    assert serial.makespan == pytest.approx(0.4 + 4 + 4 + 4 + 4)  # nothing overlaps
    assert cluster.makespan < matrix.makespan < serial.makespan
    assert cluster.io_wait < matrix.io_wait < serial.io_wait == pytest.approx(8.0)
    assert cluster.cpu_busy == pytest.approx(matrix.cpu_busy) == pytest.approx(0.05 * 8 + 0.5 * 16)


# --------------------------------------------------------------------------- flash bytes

def test_layouts_at_the_virtual_width():
    int4, fp16, rows = FlashLayout.int4_bundle(4096), FlashLayout.fp16_bundle(4096), FlashLayout.int4_rows(4096)
    assert int4.neuron_bytes == 7680 and int4.bundle_bytes == 8 * KB  # 7.5 KB aligned to 8 KB
    assert int4.gate_reads == (4 * KB,) and int4.ud_reads == (4 * KB,) and int4.two_phase
    assert fp16.gate_reads == (24 * KB,) and fp16.ud_reads == () and fp16.neuron_bytes == 24 * KB
    assert rows.gate_reads == (4 * KB,) and rows.ud_reads == (4 * KB, 4 * KB) and not rows.two_phase


def test_two_phase_bytes():
    """Flash bytes = 4 KB x #predicted-and-uncached + 4 KB x #nonzero-gate-and-uncached (the
    predicted ones: a gate never computed reveals nothing)."""
    rng = np.random.default_rng(4)
    steps = []
    for _ in range(20):
        pred = np.flatnonzero(rng.random(64) < 0.2)
        active = np.flatnonzero(rng.random(64) < 0.15)
        steps.append((pred.tolist(), active.tolist()))
    trace = hand_trace(steps, neurons=64)
    run = simulate(trace, Stage("nothing cached", FlashLayout.int4_bundle), offload=1.0)
    predicted = sum(len(p) for p, _ in steps)
    nonzero = sum(len(np.intersect1d(p, a)) for p, a in steps)
    assert run.flash_bytes == 4 * KB * predicted + 4 * KB * nonzero
    assert run.requests == predicted + nonzero

    # with the cache: what was read stays, a neuron whose gate output was zero as its gate row only
    trace = hand_trace([([1, 2, 3], [1, 2]), ([1, 2, 3, 4], [1, 3, 4])])
    run = simulate(trace, Stage("cache", FlashLayout.int4_bundle, cache=True), offload=0.0, log=True)
    step2 = sorted((e[2], e[3], e[4]) for e in run.events if e[0] == 1)
    assert step2 == [(GIO_STAGE, 0, 4 * KB), (UDIO_STAGE, 0, 4 * KB), (UDIO_STAGE, 0, 4 * KB)]  # gate 4; up/down 3, 4
    assert run.flash_bytes == 4 * KB * (3 + 1) + 4 * KB * (2 + 2)
    assert (run.hits, run.lookups) == (2, 7)  # step 2: neurons 1 and 2 need no read


def test_fp16_layout_one_24kb_read_per_bundle():
    trace = synthetic_trace(5, windows=(1,), hot=(0,))
    run = simulate(trace, Stage("fp16", FlashLayout.fp16_bundle), offload=1.0, log=True)
    predicted = sum(a.size for s in trace.steps for a in s.predicted)
    assert run.requests == predicted and {(e[2], e[4]) for e in run.events} == {(GIO_STAGE, 24 * KB)}


def test_unbundled_baseline_reads_each_matrix():
    trace = hand_trace([([1, 2, 3], [1])])
    run = simulate(trace, ABLATION[0], offload=1.0)
    assert run.requests == 9 and run.flash_bytes == 9 * 4 * KB


# --------------------------------------------------------------------------- the cache

def test_cold_region_evicts_single_neurons_lru():
    cache = NeuronCacheModel(3 * 100, 100, gate_bytes=50)
    cache.resize(0)
    cache.insert(0, np.array([1, 2, 3]))
    assert cache.lookup(0, np.array([1])).tolist() == [WHOLE]  # 1 is now the most recent
    cache.insert(0, np.array([4]))  # evicts 2, the least recently used
    assert cache.lookup(0, np.array([1, 2, 3, 4])).tolist() == [WHOLE, 0, WHOLE, WHOLE]
    assert cache.evicted_neurons == 1 and cache.bytes_written == 0
    cache.insert(0, np.array([5, 6]), GATE)  # two gate rows (50 each) push out the least recent whole neuron
    assert cache.lookup(0, np.array([1, 3, 4, 5, 6])).tolist() == [0, WHOLE, WHOLE, GATE, GATE]
    assert cache.cold_used == 300 and cache.evicted_neurons == 2


def test_hot_region_evicts_whole_clusters_lru():
    cache = NeuronCacheModel(20 * 100, 100)
    cache.resize(8 * 100)  # two clusters of 4
    a, b, c = (0, 0, 4), (0, 4, 8), (1, 0, 4)
    assert not cache.hot_hit(a, 4) and not cache.hot_hit(b, 4)
    assert cache.hot_hit(a, 4)  # a is now the most recent
    assert not cache.hot_hit(c, 4)  # evicts b, all four neurons of it
    assert cache.evicted_clusters == 1 and set(cache.hot) == {a, c}
    assert cache.hot_hit(a, 4) and not cache.hot_hit(b, 4)
    assert cache.bytes_written == 0


def test_resize_keeps_the_total_budget():
    cache = NeuronCacheModel(10 * 100, 100)
    cache.resize(4 * 100)
    cache.hot_hit((0, 0, 2), 2)
    cache.hot_hit((0, 2, 4), 2)
    cache.insert(0, np.arange(10, 16))  # fills the cold region (6)
    assert cache.hot_bytes + cache.cold_bytes == cache.budget_bytes
    cache.resize(8 * 100)  # a larger bucket: the cold region gives up its 4 least recent neurons
    assert cache.hot_bytes + cache.cold_bytes == cache.budget_bytes and len(cache.cold) == 2
    assert cache.lookup(0, np.arange(10, 16)).tolist() == [0] * 4 + [WHOLE] * 2
    cache.resize(2 * 100)  # a smaller bucket: the least recent hot cluster goes
    assert cache.hot_bytes + cache.cold_bytes == cache.budget_bytes and list(cache.hot) == [(0, 2, 4)]
    assert cache.bytes_written == 0


def test_simulation_writes_nothing_to_flash():
    trace = synthetic_trace(6, windows=(1, 32), hot=(16, 64), steps=60)
    for stage in ABLATION:
        run = simulate(trace, stage)
        assert run.bytes_written == 0 and run.flash_bytes > 0
    assert 0 < run.hits < run.lookups


# --------------------------------------------------------------------------- the ablation

def test_ablation_order_on_a_representative_trace():
    """Fig 14's order: baseline < +bundle < +cache < +pipeline < +XPU (reported, not forced: a
    trace where a step does not help would show here)."""
    trace = synthetic_trace(7, layers=4, neurons=1024, steps=200, hot=(64,))
    runs = ablation(trace)
    speeds = [r.tokens_per_s for r in runs]
    assert [r.name for r in runs] == ["baseline", "+bundle", "+cache", "+pipeline", "+XPU"]
    assert all(a < b for a, b in zip(speeds, speeds[1:])), dict(zip([r.name for r in runs], speeds))
    assert runs[0].io_share > runs[3].io_share  # the pipeline takes I/O off the critical path
    assert runs[2].hits / runs[2].lookups > runs[1].hits / runs[1].lookups


# --------------------------------------------------------------------------- inputs

def test_trace_round_trips_through_json():
    trace = synthetic_trace(8, windows=(1, 8), hot=(4, 12), steps=5)
    back = PipelineTrace.from_dict(json.loads(json.dumps(trace.to_dict())))
    assert back.to_dict() == trace.to_dict()
    assert simulate(back, ABLATION[4]).seconds == simulate(trace, ABLATION[4]).seconds
    cold = trace.cold_predicted(0, 0)
    assert not np.isin(cold, trace.hot_set(0, 0)).any()


@pytest.mark.parametrize("call, named", [
    (lambda t: simulate(t, ABLATION[0], threads=0), "threads=0"),
    (lambda t: simulate(t, ABLATION[0], cluster=0), "cluster=0"),
    (lambda t: simulate(t, ABLATION[0], offload=1.5), "offload=1.5"),
    (lambda t: NeuronCacheModel(-1, 100), "budget_bytes=-1"),
    (lambda t: NeuronCacheModel(100, 100).resize(200), "200"),
    (lambda t: PhoneCosts(d_model=0), "d_model=0"),
    (lambda t: PhoneCosts(cpu_bandwidth=-1.0), "cpu_bandwidth=-1.0"),
    (lambda t: Schedule("bad", ((0, 2), (1, 3, 4))), "(0, 2)"),
    (lambda t: ClusterWork(unit="gpu"), "'gpu'"),
    (lambda t: hand_trace([([99], [])]), "[0, 16)"),
    (lambda t: PipelineTrace(t.order, t.hot, (TraceStep(64, t.steps[0].predicted, t.steps[0].active),), 1), "64"),
])
def test_bad_input_names_the_value(call, named):
    trace = synthetic_trace(9, windows=(1,), hot=(4,), steps=2)
    with pytest.raises(ConfigError, match=None) as e:
        call(trace)
    assert named in str(e.value) and isinstance(e.value, ValueError)

"""PowerInfer-2's neuron pipeline as a discrete-event simulation priced with the paper's phone
figures, and its Fig 14 ablation (PowerInfer-2 §4.3, §4.4, §7.5; NumPy only).

This is a model, not a measurement: the *decisions* (which neurons each decode step's
predictor selects, whose gate output is truly non-zero, which neurons are hot) come from traces
recorded on a tiny model; the *times* come from PowerInfer-2's OnePlus 12 figures (§2.3; UFS 4.0
through `dlm_jax.lowering.costs.UfsModel`; DRAM 43.9 / 56 / 59.6 GB/s for CPU / NPU / both) with each traced
neuron priced as a neuron of a *virtual* width (default d_model 4096: an INT4 bundle of 7.5 KB
aligned to 8 KB, read as two 4 KB halves; FP16 24 KB in one read). No phone ran any of it.

Axes: L layers, F neurons per layer (gate row, up row, down column), W live rows of a decode
window (its bucket: the smallest planned size >= W), K clusters of a layer.

A layer's neurons are cut into clusters (hot ones first, in the planner's order); each cluster
goes through Pred -> GIO -> GC -> UDIO -> UDC (PowerInfer-2 §4.3). Modelling choices (ours; the
paper does not specify them):
- the N compute threads split a cluster's rows between them, so the pool acts as one preemptive
  server at N threads' speed (saturating at `saturating_threads`); priority = (stage, cluster).
  Work that can be split this finely is what makes "equal when nothing is on flash" exact;
- one I/O thread issues one request at a time (the single UFS queue) in a fixed order: every
  GIO in cluster order, then every UDIO; a request waits for its cluster's previous stage;
- a `Schedule` is a partition of the stages into barrier groups: serial (no pipeline: every
  stage of every cluster before the next stage), matrix-level (Gate matrix | Up/Down matrix),
  cluster-level (no barrier). NPU clusters (+XPU) run their own dense graph outside the barriers;
- CPU compute per byte = W / 43.9 GB/s (bandwidth-bound at W = 1 as in Tab 2; each further row
  one more pass, which puts W = 32 within 1.4x of the 8 tok/s dense CPU prefill); NPU per byte =
  max(1 / 56 GB/s, ceil(W/32) 32-row tiles at 770 tok/s of a 4.5e9 B model) (derived by us from
  PowerInfer-2 §2.3.1);
  with +XPU both together stream at most 59.6 GB/s;
- attention: `attention_fraction` x the layer's FFN bytes (FFN ~80% of the parameters,
  PowerInfer-2 §2.1), before the FFN, on the CPU pool (on the NPU with +XPU); the predictor: `predictor_fraction` of
  each predicted-over neuron's bytes (our choice: <= 10% of the FFN);
- memory holds (1 - offload) of the FFN. Without the neuron cache that is a static share of each
  layer's neurons (the lowest indices: no activation statistics); with it, a hot region of the
  planner's hot clusters (cluster LRU, sequential loads) and a cold region of single neurons
  (neuron LRU) holding bundles read whole; nothing is ever written back.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.techniques.powerinfer._neuron_memory import GATE, WHOLE, FlashLayout, NeuronCacheModel, PhoneCosts, StaticMemory
from dlm_jax.techniques.powerinfer._pipeline_trace import PipelineTrace, TraceStep, _at_least

__all__ = ["ABLATION", "CLUSTER", "GATE", "MATRIX", "MATRIX_PIPELINE", "SERIAL", "STAGES", "WHOLE", "ClusterWork",
           "FlashLayout", "LayerRun", "NeuronCacheModel", "PhoneCosts", "PipelineTrace", "Schedule", "SimResult",
           "Stage", "StaticMemory", "TraceStep", "ablation", "simulate", "simulate_layer"]

PRED, GIO, GC, UDIO, UDC = range(5)
STAGES = ("Pred", "GIO", "GC", "UDIO", "UDC")
_IO = (GIO, UDIO)
Read = tuple[int, float]  # one I/O request: (bytes, seconds)


# --------------------------------------------------------------------------- one layer's schedule

@dataclasses.dataclass(frozen=True)
class ClusterWork:
    """One cluster's five stages (`stage(s)`, s = PRED .. UDC): compute seconds at the unit's full
    speed (pred on the CPU pool; gate and ud on `unit`, "cpu" or "npu") and I/O requests
    (bytes, seconds) through the single queue (gate_reads at GIO, ud_reads at UDIO)."""

    pred: float = 0.0
    gate_reads: tuple[Read, ...] = ()
    gate: float = 0.0
    ud_reads: tuple[Read, ...] = ()
    ud: float = 0.0
    unit: str = "cpu"

    def __post_init__(self) -> None:
        if self.unit not in ("cpu", "npu"):
            raise ConfigError(f"ClusterWork.unit={self.unit!r} must be 'cpu' or 'npu'")

    def stage(self, s: int) -> Any:
        return (self.pred, self.gate_reads, self.gate, self.ud_reads, self.ud)[s]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`groups` partitions the five stages, in order: a CPU cluster's stage of group g starts
    only after every CPU cluster finished all stages of the groups before g."""

    name: str
    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if tuple(s for g in self.groups for s in g) != tuple(range(5)) or not all(self.groups):
            raise ConfigError(f"Schedule {self.name!r} groups={self.groups} must split stages 0..4 in order")

    @property
    def group_of(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) for _ in g)


SERIAL = Schedule("serial", ((PRED,), (GIO,), (GC,), (UDIO,), (UDC,)))
MATRIX = Schedule("matrix-level", ((PRED, GIO, GC), (UDIO, UDC)))
CLUSTER = Schedule("cluster-level", ((PRED, GIO, GC, UDIO, UDC),))


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """makespan; seconds each compute unit and the I/O thread were busy; io_wait: seconds only
    the I/O thread was busy (flash on the critical path); events: (stage, cluster, bytes, start,
    end) per request, when logged."""

    makespan: float
    cpu_busy: float
    npu_busy: float
    io_busy: float
    io_wait: float
    events: tuple[tuple[int, int, int, float, float], ...] = ()


def simulate_layer(clusters: Sequence[ClusterWork], schedule: Schedule, *, log: bool = False) -> LayerRun:
    """Run one layer's clusters: each compute unit serves its ready stages by priority (stage,
    cluster), preemptively; the I/O thread serves GIO then UDIO requests in cluster order.

    Why cluster-level <= matrix-level: Pred, GIO and GC outrank everything after them on both
    servers, and every GIO is ready before any UDIO can be (the Preds finish first), so that part
    runs identically in both; the rest only starts earlier without the barrier (UDIOs in the same
    order, each as early or earlier), and a work-conserving server never finishes later when its
    work arrives earlier. With no reads both pools never idle and finish with their work."""
    n, group = len(clusters), schedule.group_of
    barred = [c.unit == "cpu" for c in clusters]
    todo = [[s for s in range(5) if clusters[k].stage(s)] for k in range(n)]  # a zero stage is done when reached
    left = [0] * len(schedule.groups)
    for k in range(n):
        for s in todo[k]:
            left[group[s]] += barred[k]
    pos, remaining = [0] * n, [0.0] * n
    waiting = {k for k in range(n) if todo[k]}
    heaps: dict[str, list[tuple[int, int]]] = {"cpu": [], "npu": []}
    io_seq = [(s, k) for s in _IO for k in range(n) if clusters[k].stage(s)]
    ptr, io_task, io_end, t = 0, None, 0.0, 0.0
    busy = {"cpu": 0.0, "npu": 0.0, "io": 0.0, "wait": 0.0}
    events: list[tuple[int, int, int, float, float]] = []
    ready_io: set[int] = set()

    def finish(k: int) -> None:
        left[group[todo[k][pos[k]]]] -= barred[k]
        pos[k] += 1
        if pos[k] < len(todo[k]):
            waiting.add(k)

    def settle() -> None:
        level = next((g for g, c in enumerate(left) if c), len(left))
        for k in [k for k in waiting if not (barred[k] and group[todo[k][pos[k]]] > level)]:
            waiting.discard(k)
            s = todo[k][pos[k]]
            if s in _IO:
                ready_io.add(k)
            else:
                remaining[k] = clusters[k].stage(s)
                heapq.heappush(heaps["cpu" if s == PRED else clusters[k].unit], (s, k))

    settle()
    while waiting or ready_io or io_task or any(heaps.values()):
        if io_task is None and ptr == len(io_seq) and _no_cross_unit(clusters, todo, pos):
            rest = _rest(clusters, todo, pos, remaining, {k for h in heaps.values() for _, k in h})
            busy["cpu"], busy["npu"] = busy["cpu"] + rest["cpu"], busy["npu"] + rest["npu"]
            t += max(rest.values())  # no read left: each pool works through its rest without idling
            break
        if io_task is None and ptr < len(io_seq) and io_seq[ptr][1] in ready_io:
            io_task, ptr = io_seq[ptr], ptr + 1
            ready_io.discard(io_task[1])
            start = t
            for nbytes, sec in clusters[io_task[1]].stage(io_task[0]):
                if log:
                    events.append((io_task[0], io_task[1], nbytes, start, start + sec))
                start += sec
            io_end = start
        ends = [t + remaining[h[0][1]] for h in heaps.values() if h] + ([io_end] if io_task else [])
        if not ends:
            raise RuntimeError(f"pipeline stalled at t={t} (schedule {schedule.name})")
        t_next = min(ends)
        dt = t_next - t
        computing = False
        for unit, h in heaps.items():
            if h:
                computing = True
                busy[unit] += dt
                k = h[0][1]
                if t + remaining[k] <= t_next:
                    heapq.heappop(h)
                    finish(k)
                else:
                    remaining[k] -= dt
        if io_task is not None:
            busy["io"] += dt
            busy["wait"] += 0.0 if computing else dt
            if io_end <= t_next:
                finish(io_task[1])
                io_task = None
        t = t_next
        settle()
    return LayerRun(t, busy["cpu"], busy["npu"], busy["io"], busy["wait"], tuple(events))


def _no_cross_unit(clusters: Sequence[ClusterWork], todo: list[list[int]], pos: list[int]) -> bool:
    """No NPU cluster still waits on a CPU stage (its Pred)."""
    return all(c.unit == "cpu" or PRED not in todo[k][pos[k]:] for k, c in enumerate(clusters))


def _rest(clusters: Sequence[ClusterWork], todo: list[list[int]], pos: list[int], remaining: list[float],
          started: set[int]) -> dict[str, float]:
    """Each unit's compute seconds still to do."""
    rest = {"cpu": 0.0, "npu": 0.0}
    for k, c in enumerate(clusters):
        for j in range(pos[k], len(todo[k])):
            s = todo[k][j]
            rest["cpu" if s == PRED else c.unit] += remaining[k] if j == pos[k] and k in started else c.stage(s)
    return rest


# --------------------------------------------------------------------------- a whole trace

@dataclasses.dataclass(frozen=True)
class Stage:
    """One configuration of the ablation: the flash layout (a `FlashLayout` constructor of the
    virtual width), the neuron cache on or off, the schedule, hot clusters on the NPU or not."""

    name: str
    layout: Callable[[int], FlashLayout] = FlashLayout.int4_bundle
    cache: bool = False
    schedule: Schedule = SERIAL
    xpu: bool = False


ABLATION = (Stage("baseline", FlashLayout.int4_rows),
            Stage("+bundle", FlashLayout.int4_bundle),
            Stage("+cache", FlashLayout.int4_bundle, cache=True),
            Stage("+pipeline", FlashLayout.int4_bundle, cache=True, schedule=CLUSTER),
            Stage("+XPU", FlashLayout.int4_bundle, cache=True, schedule=CLUSTER, xpu=True))
MATRIX_PIPELINE = Stage("+pipeline (matrix-level)", FlashLayout.int4_bundle, cache=True, schedule=MATRIX)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """A trace under one stage: simulated seconds (x layer_repeat), the tokens decoded, busy
    seconds (compute: CPU pool + NPU, attention included), io_wait (only flash busy: Tab 4's I/O
    share of the critical path), flash bytes and requests, the predicted neurons served from
    memory without a read (hits) of all predicted (lookups), bytes written back to flash (none:
    evicted weights are dropped), and, when logged, one (step, layer, stage, cluster, bytes,
    start, end) per I/O request."""

    name: str
    seconds: float
    tokens: int
    compute_busy: float
    io_busy: float
    io_wait: float
    flash_bytes: int
    requests: int
    hits: int
    lookups: int
    bytes_written: int = 0
    events: tuple[tuple[int, int, int, int, int, float, float], ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def io_share(self) -> float:
        return self.io_wait / self.seconds if self.seconds > 0 else 0.0

    @property
    def compute_share(self) -> float:
        return 1.0 - self.io_share

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "events"}
        return {**d, "tokens_per_s": self.tokens_per_s, "compute_share": self.compute_share,
                "io_share": self.io_share, "hit_rate": self.hits / self.lookups if self.lookups else None}


def _layer_work(trace: PipelineTrace, step: TraceStep, layer: int, stage: Stage, layout: FlashLayout, memory: Any,
                costs: PhoneCosts, cpu_b: float, npu_b: float, cluster: int,
                read: Callable[[int, str], float]) -> tuple[list[ClusterWork], float, int, int]:
    """The layer's clusters (hot first, in order), the weight bytes its compute streams, and of
    the predicted neurons those served without a read and all of them; updates `memory`
    (lookups first, then what was read is stored)."""
    f, rep, nb = trace.n_neurons, costs.neuron_repeat, layout.neuron_bytes * costs.neuron_repeat
    order = trace.order[layer] if stage.cache else np.arange(f)
    h = int(trace.hot[trace.bucket(step.window)][layer]) if stage.cache else 0
    pred, act = np.zeros(f, bool), np.zeros(f, bool)
    pred[step.predicted[layer]], act[step.active[layer]] = True, True
    pred, act = pred[order], act[order]  # by position in `order`
    starts = np.r_[np.arange(0, h, cluster), np.arange(h, f, cluster)]
    sizes = np.diff(np.r_[starts, f])
    n_pred = np.add.reduceat(pred.astype(np.int64), starts).tolist()
    n_up = np.add.reduceat((pred & act).astype(np.int64), starts).tolist()  # predicted, gate non-zero
    cold = h + np.flatnonzero(pred[h:])  # positions of the predicted cold neurons
    held = memory.lookup(layer, order[cold])
    if layout.two_phase:  # the gate where it is not held; up/down where the gate fires and they are not held
        gate_miss, ud_miss = held < GATE, act[cold] & (held < WHOLE)
    else:
        gate_miss = ud_miss = held < WHOLE
    per = [np.bincount(np.searchsorted(starts, cold[m], side="right") - 1, minlength=starts.size).tolist()
           for m in (gate_miss, ud_miss)]
    gate_reads = tuple((b, read(b, "random")) for b in layout.gate_reads)
    ud_reads = tuple((b, read(b, "random")) for b in layout.ud_reads)
    work, streamed, hits = [], 0.0, 0
    for k, (lo, n) in enumerate(zip(starts.tolist(), sizes.tolist())):
        if lo < h:  # a hot cluster: loaded whole (one sequential read) when needed and not resident
            load = n * rep * layout.bundle_bytes
            gio = () if not (stage.xpu or n_pred[k]) or memory.hot_hit((layer, lo, lo + n), n) else \
                ((load, read(load, "sequential")),)
            hits += 0 if gio else n_pred[k]
            if stage.xpu:  # dense on the NPU, no predictor
                work.append(ClusterWork(0.0, gio, n * rep * layout.gate_bytes * npu_b, (),
                                        n * rep * layout.ud_bytes * npu_b, "npu"))
                streamed += n * nb
                continue
            udio = ()
        else:
            gio, udio = gate_reads * (per[0][k] * rep), ud_reads * (per[1][k] * rep)
        gate, ud = n_pred[k] * rep * layout.gate_bytes * cpu_b, n_up[k] * rep * layout.ud_bytes * cpu_b
        work.append(ClusterWork(costs.predictor_fraction * n * nb * cpu_b, gio, gate, udio, ud))
        streamed += (n_pred[k] * layout.gate_bytes + n_up[k] * layout.ud_bytes) * rep
    memory.insert(layer, order[cold[ud_miss]], WHOLE)
    memory.insert(layer, order[cold[gate_miss & ~ud_miss]], GATE)  # only two-phase reads leave a gate alone
    return work, float(streamed), hits + int((~gate_miss & ~ud_miss).sum()), sum(n_pred)


def simulate(trace: PipelineTrace, stage: Stage, *, costs: PhoneCosts = PhoneCosts(), offload: float = 0.5,
             threads: int = 4, cluster: int = 128, log: bool = False) -> SimResult:
    """Decode `trace` under `stage` with `offload` of the FFN on flash (the rest in memory),
    `threads` compute threads and clusters of `cluster` neurons. Layers run one after another:
    attention, then the FFN's clusters (`simulate_layer`)."""
    _at_least("threads", threads, 1)
    _at_least("cluster", cluster, 1)
    if not (isinstance(offload, (int, float)) and 0.0 <= offload <= 1.0):
        raise ConfigError(f"offload={offload!r} must be a fraction in [0, 1]")
    layout = stage.layout(costs.d_model)
    n_l, f, rep = trace.n_layers, trace.n_neurons, costs.neuron_repeat
    nb = layout.neuron_bytes * rep
    keep = int(round((1.0 - offload) * f))
    memory = NeuronCacheModel(keep * n_l * nb, nb, gate_bytes=layout.gate_bytes * rep) if stage.cache \
        else StaticMemory([keep] * n_l)
    span = n_l * f * rep * layout.bundle_bytes  # the flash file: the random reads' range
    prices: dict[tuple[int, str], float] = {}

    def read(size: int, pattern: str) -> float:
        if (size, pattern) not in prices:
            prices[(size, pattern)] = costs.ufs.read_seconds(size, pattern, span)
        return prices[(size, pattern)]

    seconds = compute = io = wait = 0.0
    flash = requests = hits = lookups = 0
    events: list[tuple[int, int, int, int, int, float, float]] = []
    attention_bytes = costs.attention_fraction * f * nb
    for i, step in enumerate(trace.steps):
        cpu_b, npu_b = costs.cpu_seconds_per_byte(step.window, threads), costs.npu_seconds_per_byte(step.window)
        if stage.cache:
            memory.resize(int(trace.hot[trace.bucket(step.window)].sum()) * nb)
        for layer in range(n_l):
            work, streamed, hit, looked = _layer_work(trace, step, layer, stage, layout, memory, costs, cpu_b, npu_b,
                                                      cluster, read)
            hits, lookups = hits + hit, lookups + looked
            run = simulate_layer(work, stage.schedule, log=log)
            attention = attention_bytes * (npu_b if stage.xpu else cpu_b)
            ffn = max(run.makespan, (streamed / costs.both_bandwidth) if stage.xpu else 0.0)
            events += [(i, layer, s, k, b, seconds + attention + a, seconds + attention + e)
                       for s, k, b, a, e in run.events]
            seconds += attention + ffn
            compute += attention + run.cpu_busy + run.npu_busy
            io, wait = io + run.io_busy, wait + run.io_wait
            flash += sum(b for c in work for b, _ in c.gate_reads + c.ud_reads)
            requests += sum(len(c.gate_reads) + len(c.ud_reads) for c in work)
    r = costs.layer_repeat
    return SimResult(stage.name, seconds * r, trace.tokens, compute * r, io * r, wait * r, flash * r, requests * r,
                     hits, lookups, memory.bytes_written, tuple(events))


def ablation(trace: PipelineTrace, *, costs: PhoneCosts = PhoneCosts(), offload: float = 0.5, threads: int = 4,
             cluster: int = 128, stages: Sequence[Stage] = ABLATION) -> list[SimResult]:
    """Fig 14's ablation (PowerInfer-2 §7.5) on `trace`: each stage from a fresh memory."""
    return [simulate(trace, s, costs=costs, offload=offload, threads=threads, cluster=cluster) for s in stages]

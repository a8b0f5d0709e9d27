"""PowerInfer-2's hot/cold neuron planner, host side (NumPy only; PowerInfer-2 §5 gives its inputs
and outputs, the split rule is our choice: docs/techniques/powerinfer.md): from the activation
statistics of `neurons.ActivationStats`, per decode window bucket, which neurons of each FFN
layer are *hot* (run dense, resident) and which *cold* (run sparse, read through
`neuron_cache.NeuronCache`), under a memory budget and a cost model.

Axes: L FFN layers, F neurons per layer, W rows of a decode window (its bucket).

- `NeuronCosts`: the planner's cost model (NPU, CPU, flash and attention times).
- `plan_neurons`, `NeuronPlan`, `min_cache_neurons`: the offline planner and its plan.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.techniques.powerinfer.neurons import ActivationStats, _int, _windows

# Our model of an 8B Q4_0 decode step, derived from the papers' phone figures (4.5e9 B of weights,
# 32 layers), FFN ~80% of the parameters (PowerInfer-2 §2.1); rows are priced in 32-row NPU tiles,
# (8/7) x rows / (tok/s) each.
_MODEL_BYTES, _MODEL_LAYERS, _ATTN_SHARE = 4.5e9, 32, 0.2


@dataclasses.dataclass(frozen=True)
class NeuronCosts:
    """The planner's cost model as numbers. Every time is for one FFN layer; bytes are weight
    bytes (a neuron bundle is `neuron_bytes`).

    npu_bytes_per_s: NPU DRAM bandwidth during matmul (56 GB/s, PowerInfer-2 §2.3.1).
    cpu_bytes_per_s: CPU DRAM bandwidth during matmul (43.9 GB/s, same source).
    io_bytes_per_s: flash bandwidth of the hot-neuron prefetch, sequential reads (UFS 4.0
      4 GB/s at 512 KB, PowerInfer-2 §2.3.2).
    npu_seconds_per_byte_tile: NPU compute per weight byte per 32-row tile ((8/7) x 32 rows /
      770 tok/s over the 4.5e9 B of the 8B model: derived by us from PowerInfer-2 §2.3.1).
    cpu_seconds_per_byte_row: CPU compute per weight byte per row ((8/7) / 8 tok/s / 4.5e9 B,
      derived likewise).
    attention_fixed_seconds, attention_seconds_per_row: one layer's attention for a window of
      W rows takes fixed + per_row x W; defaults: the non-FFN 20% of the 8B model's bytes at
      the NPU bandwidth over its 32 layers, and 0 per row (the NPU is memory-bound for
      W <= 32 in that derived model).

    T_npu(h, W) = h x bytes x max(1/npu_bytes_per_s, ceil(W/32) x npu_seconds_per_byte_tile);
    T_cpu(n, W) = n x bytes x (1/cpu_bytes_per_s + W x cpu_seconds_per_byte_row), n active cold
    neurons; T_io(bytes) = bytes / io_bytes_per_s. Bandwidths may be inf (free).
    """

    npu_bytes_per_s: float = 56e9
    cpu_bytes_per_s: float = 43.9e9
    io_bytes_per_s: float = 4e9
    npu_seconds_per_byte_tile: float = 32 * (8 / 7) / 770 / _MODEL_BYTES
    cpu_seconds_per_byte_row: float = (8 / 7) / 8 / _MODEL_BYTES
    attention_fixed_seconds: float = _ATTN_SHARE * _MODEL_BYTES / 56e9 / _MODEL_LAYERS
    attention_seconds_per_row: float = 0.0
    source: str = "phone (PowerInfer-2 §2.3 figures)"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "source":
                continue
            positive = f.name.endswith("bytes_per_s")
            if not isinstance(v, numbers.Real) or math.isnan(v) or (v <= 0 if positive else v < 0) \
                    or (not positive and math.isinf(v)):
                raise ConfigError(f"{f.name}={v!r} must be {'> 0 (inf: free)' if positive else 'finite and >= 0'}")

    @classmethod
    def phone(cls) -> NeuronCosts:
        """The OnePlus 12 figures of PowerInfer-2 §2.3 priced at an 8B model (the defaults)."""
        return cls()

    @classmethod
    def measured(cls, *, npu_bytes_per_s: float, cpu_bytes_per_s: float, io_bytes_per_s: float,
                 attention_fixed_seconds: float, attention_seconds_per_row: float = 0.0,
                 npu_seconds_per_byte_tile: float = 0.0, cpu_seconds_per_byte_row: float = 0.0,
                 source: str = "measured on this machine") -> NeuronCosts:
        """Numbers measured here (the dense path's bandwidth standing in for the NPU's)."""
        return cls(npu_bytes_per_s=npu_bytes_per_s, cpu_bytes_per_s=cpu_bytes_per_s, io_bytes_per_s=io_bytes_per_s,
                   npu_seconds_per_byte_tile=npu_seconds_per_byte_tile,
                   cpu_seconds_per_byte_row=cpu_seconds_per_byte_row, attention_fixed_seconds=attention_fixed_seconds,
                   attention_seconds_per_row=attention_seconds_per_row, source=source)

    def npu_seconds(self, nbytes: Any, window: int) -> Any:
        per_byte = max(1.0 / self.npu_bytes_per_s, -(-window // 32) * self.npu_seconds_per_byte_tile)
        return np.asarray(nbytes, np.float64) * per_byte

    def cpu_seconds(self, nbytes: Any, window: int) -> Any:
        return np.asarray(nbytes, np.float64) * (1.0 / self.cpu_bytes_per_s + window * self.cpu_seconds_per_byte_row)

    def io_seconds(self, nbytes: Any) -> Any:
        return np.asarray(nbytes, np.float64) / self.io_bytes_per_s

    def attention_seconds(self, window: int) -> float:
        return self.attention_fixed_seconds + self.attention_seconds_per_row * window


def _frozen(a: Any, dtype: Any) -> np.ndarray:
    a = np.array(a, dtype)
    a.flags.writeable = False
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class NeuronPlan:
    """Which neurons are hot per window bucket (our split rule; PowerInfer-2 §5 leaves it open).

    windows: the planned buckets W, ascending.
    order: [L, F] int64, each layer's neurons hottest first; the first hot[W][l] of row l are
      hot at bucket W (dense, resident in the cache's hot region), the rest cold (sparse, read
      through the cold region). hot[W] is non-decreasing in W, so hot sets are nested.
    hot: W -> [L] int64 hot counts.
    budget_bytes: the memory budget; resident_bytes: non-FFN bytes (attention, embeddings,
      K/V; the cache's fixed region); neuron_bytes: one bundle (gate + up + down row).
    cache_bytes: the cold cache at the largest bucket (the least any bucket leaves it).
    cache_fraction_min, costs: the planner's inputs; tokens: tokens of the statistics;
    prob_windows: W -> the recorded window whose P_w priced bucket W.
    npu_seconds, cpu_seconds: W -> [L] the chosen split's T_npu and T_cpu (expected).
    """

    windows: tuple[int, ...]
    order: np.ndarray
    hot: dict[int, np.ndarray]
    budget_bytes: int
    neuron_bytes: int
    resident_bytes: int
    cache_bytes: int
    cache_fraction_min: float
    costs: NeuronCosts
    tokens: int
    prob_windows: dict[int, int]
    npu_seconds: dict[int, np.ndarray]
    cpu_seconds: dict[int, np.ndarray]

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", _frozen(self.order, np.int64))
        for name, dtype in (("hot", np.int64), ("npu_seconds", np.float64), ("cpu_seconds", np.float64)):
            object.__setattr__(self, name, {int(w): _frozen(v, dtype) for w, v in getattr(self, name).items()})

    def bucket(self, window: int) -> int:
        """The smallest planned bucket holding `window` rows."""
        for w in self.windows:
            if window <= w:
                return w
        raise ConfigError(f"window={window!r} exceeds the largest planned bucket {self.windows[-1]}")

    def hot_set(self, layer: int, window: int) -> np.ndarray:
        """The hot neurons of `layer` for a window of `window` rows (its bucket's), hottest first."""
        return self.order[layer, :self.hot[self.bucket(window)][layer]]

    def cold_set(self, layer: int, window: int) -> np.ndarray:
        return self.order[layer, self.hot[self.bucket(window)][layer]:]

    def hot_bytes(self, window: int) -> int:
        """All layers' hot bytes at `window`'s bucket (the cache's hot region capacity)."""
        return int(self.hot[self.bucket(window)].sum()) * self.neuron_bytes

    def cache_capacity(self, window: int) -> int:
        """The cold region's bytes at `window`'s bucket."""
        return self.budget_bytes - self.resident_bytes - self.hot_bytes(window)

    def to_dict(self) -> dict:
        def per_w(d: dict) -> dict:
            return {str(w): v.tolist() for w, v in d.items()}
        return {"windows": list(self.windows), "order": self.order.tolist(), "hot": per_w(self.hot),
                "budget_bytes": self.budget_bytes, "neuron_bytes": self.neuron_bytes,
                "resident_bytes": self.resident_bytes, "cache_bytes": self.cache_bytes,
                "cache_fraction_min": self.cache_fraction_min, "costs": dataclasses.asdict(self.costs),
                "tokens": self.tokens, "prob_windows": {str(w): v for w, v in self.prob_windows.items()},
                "npu_seconds": per_w(self.npu_seconds), "cpu_seconds": per_w(self.cpu_seconds)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NeuronPlan:
        def per_w(x: Mapping[str, Any]) -> dict:
            return {int(w): v for w, v in x.items()}
        return cls(tuple(d["windows"]), np.asarray(d["order"], np.int64), per_w(d["hot"]), d["budget_bytes"],
                   d["neuron_bytes"], d["resident_bytes"], d["cache_bytes"], d["cache_fraction_min"],
                   NeuronCosts(**d["costs"]), d["tokens"], per_w(d["prob_windows"]), per_w(d["npu_seconds"]),
                   per_w(d["cpu_seconds"]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NeuronPlan) and self.to_dict() == other.to_dict()


def _allocate(cost: np.ndarray, lo: np.ndarray, hi: np.ndarray, cap: int) -> np.ndarray:
    """Per layer the h in [lo, hi] minimizing cost[l, h] with sum(h) <= cap (sum(lo) <= cap):
    the argmin of cost + lam * h with the least lam in [0, lam_max] that fits, by bisection
    (h(lam) is non-increasing; at lam_max every layer takes lo), then layers whose choice at the
    bisection's lower end still fits take it, one at a time. Ties go to the smaller h."""
    hs = np.arange(cost.shape[1])
    c = np.where((hs < lo[:, None]) | (hs > hi[:, None]), np.inf, cost)

    def pick(lam: float) -> np.ndarray:
        return np.argmin(c + lam * hs, axis=1)

    h = pick(0.0)
    if h.sum() <= cap:
        return h
    finite = c[np.isfinite(c)]
    lam_lo, lam_hi = 0.0, float(finite.max() - finite.min()) + 1.0
    for _ in range(64):
        mid = 0.5 * (lam_lo + lam_hi)
        lam_lo, lam_hi = (lam_lo, mid) if pick(mid).sum() <= cap else (mid, lam_hi)
    h, more = pick(lam_hi), pick(lam_lo)  # several layers may switch at the same price
    for layer in np.flatnonzero(more > h):
        if h.sum() + more[layer] - h[layer] <= cap:
            h[layer] = more[layer]
    return h


def min_cache_neurons(stats: ActivationStats, window: int) -> np.ndarray:
    """[L] the minimum cold cache of `plan_neurons`: one window's expected active neurons with
    every neuron cold, sum_i P_window[l, i] rounded up, at least 1 per layer."""
    return np.maximum(1, np.ceil(stats.prob(window).sum(1) - 1e-9)).astype(np.int64)


def plan_neurons(stats: ActivationStats, *, windows: Sequence[int], budget_bytes: int, resident_bytes: int,
                 neuron_bytes: int, cost: NeuronCosts, cache_fraction_min: float = 0.1) -> NeuronPlan:
    """Our split rule (PowerInfer-2 §5 names the inputs, not the rule): per window bucket W, each
    layer's hot set is a prefix of its neurons
    ordered by P at the largest bucket (ties: P_1, then the lower index), of the size h_W
    minimizing max(T_npu(h_W, W), T_cpu(E[#active cold], W)), E[#active cold] = the sum of P_W
    over the cold neurons (P_W: the nearest recorded window <= W), subject to
      - memory: all layers' hot bytes + resident_bytes + a cold cache of at least
        max(cache_fraction_min x the cold bytes, the minimum cache) <= budget_bytes;
      - prefetch: per layer T_io(bytes of neurons not hot at the previous smaller bucket; all at
        the smallest) <= T_attention(W), so a step up one bucket hides its loads under attention;
      - h_W >= h at the previous bucket (nested hot sets).
    Layers share the memory cap through one price per hot neuron (`_allocate`).

    The minimum cache is `min_cache_neurons` at the smallest bucket; a budget below
    resident_bytes + that raises ConfigError. A budget too small for cache_fraction_min with
    every neuron cold plans all cold (the cache takes what is left)."""
    buckets = _windows("windows", windows)
    budget = _int("budget_bytes", budget_bytes, 0)
    resident = _int("resident_bytes", resident_bytes, 0)
    nb = _int("neuron_bytes", neuron_bytes, 1)
    if not 0.0 <= cache_fraction_min < 1.0:
        raise ConfigError(f"cache_fraction_min={cache_fraction_min!r} must be in [0, 1)")
    recorded = stats.recorded_windows()
    source = {}
    for w in buckets:
        below = [r for r in recorded if r <= w]
        if not below:
            raise ConfigError(f"bucket {w} has no recorded window <= {w} (recorded: {recorded})")
        source[w] = below[-1]
    n_layers, n_neurons = stats.n_layers, stats.n_neurons
    top, p1 = stats.prob(source[buckets[-1]]), stats.token_prob()
    index = np.arange(n_neurons)
    order = np.stack([np.lexsort((index, -p1[i], -top[i])) for i in range(n_layers)])

    min_cache = int(min_cache_neurons(stats, source[buckets[0]]).sum()) * nb
    if budget < resident + min_cache:
        raise ConfigError(f"memory budget {budget / 1e6:.2f} MB is below the resident minimum "
                          f"{(resident + min_cache) / 1e6:.2f} MB (resident {resident / 1e6:.2f} MB + minimum cold "
                          f"cache {min_cache / 1e6:.2f} MB: one window's expected active neurons at bucket "
                          f"{buckets[0]}, >= 1 per layer)")
    room, total = budget - resident, n_layers * n_neurons
    cap = (room - min_cache) // nb
    if cache_fraction_min > 0:  # H nb + frac (total - H) nb <= room
        cap = min(cap, math.floor((room - cache_fraction_min * total * nb) / ((1 - cache_fraction_min) * nb)))
    cap = int(min(max(cap, 0), total))

    hs = np.arange(n_neurons + 1)
    prev = np.zeros(n_layers, np.int64)
    hot, npu, cpu = {}, {}, {}
    for w in buckets:
        p = np.take_along_axis(stats.prob(source[w]), order, axis=1)
        cold = np.concatenate([np.cumsum(p[:, ::-1], axis=1)[:, ::-1], np.zeros((n_layers, 1))], axis=1)
        t_npu = np.broadcast_to(cost.npu_seconds(hs * nb, w), cold.shape)
        t_cpu = cost.cpu_seconds(cold * nb, w)
        step = n_neurons  # neurons one layer may prefetch under its attention
        if not math.isinf(cost.io_bytes_per_s):
            step = min(step, math.floor(cost.attention_seconds(w) * cost.io_bytes_per_s / nb + 1e-9))
        h = _allocate(np.maximum(t_npu, t_cpu), prev, np.minimum(n_neurons, prev + step), cap)
        hot[w], npu[w] = h, t_npu[0, h]
        cpu[w] = np.take_along_axis(t_cpu, h[:, None], axis=1)[:, 0]
        prev = h
    return NeuronPlan(buckets, order, hot, budget, nb, resident, room - int(prev.sum()) * nb,
                      float(cache_fraction_min), cost, stats.tokens, source, npu, cpu)

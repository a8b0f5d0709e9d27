"""PowerInfer-2's neuron engine for activation-sparse FFNs, host side: activation statistics,
the hot/cold neuron planner, the three-region neuron cache and the activation predictors
(NumPy only; SPECS 4).

Neuron i of an FFN layer is the bundle (gate row i, up row i, down column i). It is *active*
for a token iff relu(gate_i . x) > 0, and for a decode window of W live rows iff it is active
for at least one of them (a dLLM window behaves like the paper's batch of W [P §2.2 fn 1]).
*Hot* neurons run dense (the NPU in the paper) and stay resident; *cold* ones run sparse (the
CPU) on the neurons the predictor selects, read through the neuron cache.

Axes: L FFN layers, F neurons per layer, B batch rows, W rows of a decode window (its bucket),
D model width, r predictor rank. Step outputs carry `ffn_active` bit-packed [L, B, W, ceil(F/32)].

- `pack_active`, `unpack_active`: the bit packing of `ffn_active`.
- `ActivationStats`: per-token and per-window activation probabilities (the Fig 2 analog).
- `NeuronCosts`, `plan_neurons`, `NeuronPlan`: the offline planner (SPECS 4.5 [S]).
- `NeuronCache`: the fixed / hot (cluster LRU) / cold (neuron LRU) regions [P §4.2].
- `LowRankPredictor`, `OraclePredictor`, `recall_precision`: which cold neurons to load.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.placement import PlacementPolicy

DEFAULT_WINDOWS = (1, 2, 4, 8, 16, 32)  # SPECS 4.7: the Fig 2 analog's window sizes
_SHIFTS = np.arange(32, dtype=np.uint32)


def _int(name: str, value: Any, lo: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{name}={value!r} must be an integer >= {lo}")
    return int(value)


def _windows(name: str, windows: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted({_int(f"{name} entry", w, 1) for w in windows}))
    if not out:
        raise ConfigError(f"{name}={tuple(windows)!r} must name at least one window size")
    return out


# --------------------------------------------------------------------------- bit packing

def pack_active(active: Any) -> np.ndarray:
    """bool [..., F] -> int32 [..., ceil(F/32)]: bit j (value 1 << j; bit 31 is the sign bit)
    of word w is neuron 32*w + j; the padding bits of the last word are 0. The bytes equal
    `np.packbits(active, axis=-1, bitorder="little")` read as little-endian uint32."""
    active = np.asarray(active)
    if active.dtype != bool or active.ndim < 1:
        raise ConfigError(f"active dtype={active.dtype} ndim={active.ndim} must be bool [..., F]")
    n = active.shape[-1]
    words = -(-n // 32)
    padded = np.zeros(active.shape[:-1] + (words * 32,), np.uint32)
    padded[..., :n] = active
    bits = padded.reshape(active.shape[:-1] + (words, 32)) << _SHIFTS
    return bits.sum(-1, dtype=np.uint32).view(np.int32)  # distinct powers of two: the sum is an OR


def unpack_active(packed: Any, n_neurons: int) -> np.ndarray:
    """int32 [..., ceil(F/32)] (as `pack_active` writes it) -> bool [..., F], F = n_neurons."""
    n = _int("n_neurons", n_neurons, 0)
    packed = np.asarray(packed)
    if packed.dtype not in (np.int32, np.uint32) or packed.ndim < 1 or packed.shape[-1] != -(-n // 32):
        raise ConfigError(f"packed shape={packed.shape} dtype={packed.dtype} must be int32 [..., {-(-n // 32)}] "
                          f"for {n} neurons")
    words = np.ascontiguousarray(packed).view(np.uint32)
    bits = (words[..., None] >> _SHIFTS) & np.uint32(1)
    return bits.reshape(packed.shape[:-1] + (-1,))[..., :n].astype(bool)


# --------------------------------------------------------------------------- statistics

class ActivationStats:
    """Recorded activations: per layer and neuron, the probability of being active for a token
    (P_1) and for a window of w consecutive live rows, w in `windows` (P_w; Fig 2's analog).

    Window statistics are cut from each added step: per batch row b its live rows in order,
    in consecutive groups of w (the remainder dropped); a group activates a neuron if any of
    its rows does. P_w = union hits / groups. All layers see the same rows, so the token and
    group counts are shared by the layers.
    """

    def __init__(self, n_layers: int, n_neurons: int, *, windows: Sequence[int] = DEFAULT_WINDOWS) -> None:
        self.n_layers = _int("n_layers", n_layers, 1)
        self.n_neurons = _int("n_neurons", n_neurons, 1)
        self.windows = _windows("windows", windows)
        self.tokens = 0
        self.token_hits = np.zeros((self.n_layers, self.n_neurons), np.int64)  # [L, F]
        self.groups = {w: 0 for w in self.windows}
        self.hits = {w: np.zeros((self.n_layers, self.n_neurons), np.int64) for w in self.windows}

    def add(self, active: Any, live: Any = None) -> None:
        """One step's activations: `active` bool [L, B, W, F]; `live` bool [B, W] (None: all
        rows), the rows that count (bucket padding and finished requests excluded)."""
        active = np.asarray(active)
        if active.dtype != bool or active.ndim != 4 or active.shape[0] != self.n_layers \
                or active.shape[3] != self.n_neurons:
            raise ConfigError(f"active shape={active.shape} dtype={active.dtype} must be bool "
                              f"[{self.n_layers}, B, W, {self.n_neurons}]")
        shape = active.shape[1:3]
        live = np.ones(shape, bool) if live is None else np.asarray(live)
        if live.shape != shape or live.dtype != bool:
            raise ConfigError(f"live shape={live.shape} dtype={live.dtype} must be bool {list(shape)}")
        self.tokens += int(live.sum())
        self.token_hits += active[:, live].sum(1)
        for b in range(shape[0]):
            rows = active[:, b, np.flatnonzero(live[b])]  # [L, n, F]
            for w in self.windows:
                g = rows.shape[1] // w
                if g:
                    self.groups[w] += g
                    self.hits[w] += rows[:, :g * w].reshape(self.n_layers, g, w, -1).any(2).sum(1)

    def add_packed(self, packed: Any, live: Any = None) -> None:
        """`add` for the step output `ffn_active` as it comes: int32 [L, B, W, ceil(F/32)]."""
        self.add(unpack_active(packed, self.n_neurons), live)

    def recorded_windows(self) -> tuple[int, ...]:
        """The window sizes with at least one recorded group."""
        return tuple(w for w in self.windows if self.groups[w])

    def prob(self, window: int) -> np.ndarray:
        """[L, F] float64: P_w, the share of recorded w-row groups that activated each neuron."""
        if window not in self.groups:
            raise ConfigError(f"window={window!r} is not a recorded window size {self.windows}")
        if not self.groups[window]:
            raise ConfigError(f"no group of {window} consecutive live rows was recorded")
        return self.hits[window] / self.groups[window]

    def token_prob(self) -> np.ndarray:
        """[L, F] float64: P_1, the share of recorded tokens that activated each neuron."""
        if not self.tokens:
            raise ConfigError("no token was recorded")
        return self.token_hits / self.tokens

    def density(self, window: int) -> np.ndarray:
        """[L]: the mean share of a layer's neurons active for a w-row window (Fig 2's y axis)."""
        return self.prob(window).mean(1)

    def token_density(self) -> np.ndarray:
        """[L]: the mean share of a layer's neurons active per token (1 - per-token sparsity)."""
        return self.token_prob().mean(1)

    def merge(self, other: ActivationStats) -> ActivationStats:
        """A new accumulator holding both's counts (neither is changed)."""
        if (other.n_layers, other.n_neurons, other.windows) != (self.n_layers, self.n_neurons, self.windows):
            raise ConfigError(f"cannot merge stats of [L={other.n_layers}, F={other.n_neurons}, windows="
                              f"{other.windows}] into [L={self.n_layers}, F={self.n_neurons}, windows={self.windows}]")
        out = ActivationStats(self.n_layers, self.n_neurons, windows=self.windows)
        out.tokens = self.tokens + other.tokens
        out.token_hits = self.token_hits + other.token_hits
        for w in self.windows:
            out.groups[w] = self.groups[w] + other.groups[w]
            out.hits[w] = self.hits[w] + other.hits[w]
        return out

    def to_dict(self) -> dict:
        """JSON-friendly counts (`from_dict` inverts)."""
        return {"n_layers": self.n_layers, "n_neurons": self.n_neurons, "windows": list(self.windows),
                "tokens": self.tokens, "token_hits": self.token_hits.tolist(),
                "groups": {str(w): g for w, g in self.groups.items()},
                "hits": {str(w): h.tolist() for w, h in self.hits.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ActivationStats:
        out = cls(d["n_layers"], d["n_neurons"], windows=d["windows"])
        out.tokens = int(d["tokens"])
        out.token_hits = np.asarray(d["token_hits"], np.int64).reshape(out.n_layers, out.n_neurons)
        for w in out.windows:
            out.groups[w] = int(d["groups"][str(w)])
            out.hits[w] = np.asarray(d["hits"][str(w)], np.int64).reshape(out.n_layers, out.n_neurons)
        return out


# --------------------------------------------------------------------------- planner

# SPECS 0.4 [R]: the 8B Q4_0 decode-step model (4.5e9 B of weights, 32 layers), FFN ~80% of the
# parameters [P PI-2 §2.1]; rows are priced in 32-row NPU tiles, (8/7) x rows / (tok/s) each.
_MODEL_BYTES, _MODEL_LAYERS, _ATTN_SHARE = 4.5e9, 32, 0.2


@dataclasses.dataclass(frozen=True)
class NeuronCosts:
    """The planner's cost model as numbers. Every time is for one FFN layer; bytes are weight
    bytes (a neuron bundle is `neuron_bytes`).

    npu_bytes_per_s: NPU DRAM bandwidth during matmul (56 GB/s, SPECS 0.4 [P PI-2 §2.3.1]).
    cpu_bytes_per_s: CPU DRAM bandwidth during matmul (43.9 GB/s, same source).
    io_bytes_per_s: flash bandwidth of the hot-neuron prefetch, sequential reads (UFS 4.0
      4 GB/s at 512 KB, SPECS 0.4 [P PI-2 §2.3.2]).
    npu_seconds_per_byte_tile: NPU compute per weight byte per 32-row tile ((8/7) x 32 rows /
      770 tok/s over the 4.5e9 B of the 8B model, SPECS 0.4 [R]).
    cpu_seconds_per_byte_row: CPU compute per weight byte per row ((8/7) / 8 tok/s / 4.5e9 B,
      SPECS 0.4 [R]).
    attention_fixed_seconds, attention_seconds_per_row: one layer's attention for a window of
      W rows takes fixed + per_row x W; defaults: the non-FFN 20% of the 8B model's bytes at
      the NPU bandwidth over its 32 layers, and 0 per row (the NPU is memory-bound for
      W <= 32, SPECS 0.4 [R]).

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
    source: str = "phone (SPECS 0.4)"

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
        """SPECS 0.4's OnePlus 12 / 8B figures (the defaults)."""
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
    """Which neurons are hot per window bucket (SPECS 4.5 [S]).

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
    """SPECS 4.5 [S]: per window bucket W, each layer's hot set is a prefix of its neurons
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


# --------------------------------------------------------------------------- cache

class NeuronCache:
    """PowerInfer-2's cold-neuron cache [P §4.2]: single neurons, least recently used out, in
    `capacity_bytes` (each neuron costs `neuron_bytes`), the weights held in slabs (one row
    per slot for each part: gate row, up row, down column) so a step gathers its cached
    neurons with one index per part, not a Python loop over neurons.

    PowerInfer-2's other two regions are not in here: the fixed region (attention weights,
    K/V) and the hot clusters are the NPU programs' constants, resident for the whole decode
    (a sparse bundle's hot sets are prefixes of one order, so the largest bucket's holds the
    others': nothing to evict at a bucket change).

    Evicted weights are discarded (the flash copy is the truth; nothing is written back).
    `invalidate()` empties the cache (other weights: nothing stale is ever served).

    Counters: hits, misses, evictions, bytes_in (bytes stored).
    """

    def __init__(self, n_layers: int, n_neurons: int, d_model: int, capacity_bytes: int, neuron_bytes: int, *,
                 parts: Sequence[str] = ("gate", "up", "down"), dtype: Any = np.float32) -> None:
        self.n_layers = _int("n_layers", n_layers, 1)
        self.n_neurons = _int("n_neurons", n_neurons, 1)
        self.neuron_bytes = _int("neuron_bytes", neuron_bytes, 1)
        self.capacity_bytes = _int("capacity_bytes", capacity_bytes, 0)
        self.slots = self.capacity_bytes // self.neuron_bytes
        self.parts = tuple(parts)
        self.slabs = {p: np.zeros((self.slots, _int("d_model", d_model, 1)), dtype) for p in self.parts}
        self.hits = self.misses = self.evictions = self.bytes_in = 0
        self.invalidate()

    def invalidate(self) -> None:
        """Forget everything."""
        self.slot_of = np.full((self.n_layers, self.n_neurons), -1, np.int64)  # [L, F] -> slot or -1
        self.owner = np.full((self.slots, 2), -1, np.int64)  # slot -> (layer, neuron) or -1
        self.last_use = np.full(self.slots, -1, np.int64)  # slot -> clock of its last use (-1: free)
        self.clock = 0

    @property
    def resident_bytes(self) -> int:
        return int((self.owner[:, 0] >= 0).sum()) * self.neuron_bytes

    def lookup(self, layer: int, neurons: Any) -> tuple[np.ndarray, np.ndarray]:
        """(hit mask [n] over `neurons`, the hits' slots); the hits become most recently used."""
        neurons = np.asarray(neurons, np.int64)
        slots = self.slot_of[layer, neurons]
        hit = slots >= 0
        self.clock += 1
        self.last_use[slots[hit]] = self.clock
        self.hits += int(hit.sum())
        self.misses += int((~hit).sum())
        return hit, slots[hit]

    def rows(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Each part's rows of `slots` (copies)."""
        return {p: self.slabs[p][slots] for p in self.parts}

    def insert(self, layer: int, neurons: Any, values: Mapping[str, np.ndarray]) -> int:
        """Store `neurons` (not cached; `values[part]` [n, D] each) in free slots, else in the
        least recently used ones (evicting them); when more arrive than the cache holds, the
        last that fit are kept. Returns how many were stored."""
        neurons = np.asarray(neurons, np.int64)
        keep = min(neurons.size, self.slots)
        if keep == 0:
            return 0
        neurons = neurons[neurons.size - keep:]
        free = np.flatnonzero(self.owner[:, 0] < 0)
        if free.size < keep:
            used = np.flatnonzero(self.owner[:, 0] >= 0)
            victims = used[np.argpartition(self.last_use[used], keep - free.size - 1)[:keep - free.size]]
            self.slot_of[self.owner[victims, 0], self.owner[victims, 1]] = -1
            self.evictions += victims.size
            free = np.concatenate([free, victims])
        slots = free[:keep]
        self.clock += 1
        self.owner[slots] = np.stack([np.full(keep, layer), neurons], axis=1)
        self.slot_of[layer, neurons] = slots
        self.last_use[slots] = self.clock
        for p in self.parts:
            self.slabs[p][slots] = values[p][values[p].shape[0] - keep:]
        self.bytes_in += keep * self.neuron_bytes
        return keep


class ActivationPredictor(Protocol):
    """Which neurons of a layer the rows of `x` [N, D] activate (bool [N, F])."""

    def predict(self, layer: int, x: Any, threshold: float = 0.5) -> np.ndarray: ...

    def predict_window(self, layer: int, x: Any, live: Any = None, threshold: float = 0.5) -> np.ndarray: ...


def _union(rows: np.ndarray, live: Any) -> np.ndarray:
    if live is not None:
        live = np.asarray(live, bool)
        if live.shape != rows.shape[:1]:
            raise ConfigError(f"live shape={live.shape} must be [{rows.shape[0]}]")
        rows = rows[live]
    return rows.any(0)


class LowRankPredictor:
    """SPECS 4.2 [S]: per layer P(active) = sigmoid(W2 relu(W1 x + b1) + b2), rank r, trained
    with BCE on recorded activations (elsewhere); a neuron is predicted active when
    P > threshold. Arrays per layer: w1 [D, r], b1 [r], w2 [r, F], b2 [F] (float32)."""

    _NAMES = ("w1", "b1", "w2", "b2")

    def __init__(self, w1: Sequence[Any], b1: Sequence[Any], w2: Sequence[Any], b2: Sequence[Any]) -> None:
        if not len(w1) == len(b1) == len(w2) == len(b2) >= 1:
            raise ConfigError(f"predictor layers: w1 {len(w1)}, b1 {len(b1)}, w2 {len(w2)}, b2 {len(b2)} "
                              f"must agree and be >= 1")
        self.w1, self.b1, self.w2, self.b2 = ([np.asarray(a, np.float32) for a in arrs] for arrs in (w1, b1, w2, b2))
        self.d_model, self.rank = self.w1[0].shape if self.w1[0].ndim == 2 else (-1, -1)
        self.n_neurons = self.b2[0].shape[0] if self.b2[0].ndim == 1 else -1
        d, r, f = self.d_model, self.rank, self.n_neurons
        for i, arrs in enumerate(zip(self.w1, self.b1, self.w2, self.b2)):
            shapes = tuple(a.shape for a in arrs)
            if shapes != ((d, r), (r,), (r, f), (f,)) or min(d, r, f) < 1:
                raise ConfigError(f"predictor layer {i} shapes {shapes} must be w1 [D, r], b1 [r], w2 [r, F], b2 [F] "
                                  f"with D, r, F of layer 0 ({d}, {r}, {f})")

    @property
    def n_layers(self) -> int:
        return len(self.w1)

    @classmethod
    def init(cls, n_layers: int, d_model: int, n_neurons: int, rank: int, *, seed: int = 0) -> LowRankPredictor:
        """Random (He-scaled) weights and zero biases, a starting point for training."""
        rng = np.random.default_rng(seed)
        n, d, f, r = (_int(k, v, 1) for k, v in (("n_layers", n_layers), ("d_model", d_model),
                                                    ("n_neurons", n_neurons), ("rank", rank)))
        return cls([rng.standard_normal((d, r)) * math.sqrt(2 / d) for _ in range(n)], [np.zeros(r)] * n,
                   [rng.standard_normal((r, f)) * math.sqrt(2 / r) for _ in range(n)], [np.zeros(f)] * n)

    @staticmethod
    def rank_for(d_model: int, n_neurons: int, fraction: float = 0.1) -> int:
        """The largest rank whose layer's parameters are <= `fraction` of the FFN layer's
        3 D F (SPECS 4.2 [S]: predictor <= 10% of the FFN), at least 1."""
        return max(1, math.floor((fraction * 3 * d_model * n_neurons - n_neurons) / (d_model + 1 + n_neurons)))

    def logits(self, layer: int, x: Any) -> np.ndarray:
        """[N, F] float32 pre-sigmoid scores of the rows `x` [N, D]."""
        x = np.asarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != self.d_model:
            raise ConfigError(f"x shape={x.shape} must be [N, {self.d_model}]")
        return np.maximum(x @ self.w1[layer] + self.b1[layer], 0) @ self.w2[layer] + self.b2[layer]

    def predict(self, layer: int, x: Any, threshold: float = 0.5) -> np.ndarray:
        """bool [N, F]: sigmoid(logits) > threshold (compared as logits > logit(threshold))."""
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"threshold={threshold!r} must be in [0, 1]")
        with np.errstate(divide="ignore"):
            cut = np.log(threshold) - np.log1p(-threshold)
        return self.logits(layer, x) > cut

    def predict_window(self, layer: int, x: Any, live: Any = None, threshold: float = 0.5) -> np.ndarray:
        """bool [F]: neurons predicted active for any live row of the window `x` [W, D]."""
        return _union(self.predict(layer, x, threshold), live)

    def param_count(self) -> int:
        return sum(a.size for arrs in (self.w1, self.b1, self.w2, self.b2) for a in arrs)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """{"layers.{i}.{w1,b1,w2,b2}": array} (safetensors names)."""
        return {f"layers.{i}.{k}": getattr(self, k)[i] for i in range(self.n_layers) for k in self._NAMES}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> LowRankPredictor:
        n = len({name.split(".")[1] for name in arrays if name.startswith("layers.")})
        try:
            return cls(*([arrays[f"layers.{i}.{k}"] for i in range(n)] for k in cls._NAMES))
        except KeyError as e:
            raise ConfigError(f"predictor arrays lack {e.args[0]!r} (have {sorted(arrays)})") from None


class OraclePredictor:
    """The true activations as a predictor (lossless tests): `update` with a step's bool
    [L, N, F]; `predict(layer, x)` returns its layer's [N, F] (x only fixes N)."""

    def __init__(self, active: Any = None) -> None:
        self._active: np.ndarray | None = None
        if active is not None:
            self.update(active)

    def update(self, active: Any) -> None:
        active = np.asarray(active)
        if active.dtype != bool or active.ndim != 3:
            raise ConfigError(f"active shape={active.shape} dtype={active.dtype} must be bool [L, N, F]")
        self._active = active

    def predict(self, layer: int, x: Any, threshold: float = 0.5) -> np.ndarray:
        if self._active is None:
            raise ConfigError("OraclePredictor has no activations: call update(active) first")
        if len(x) != self._active.shape[1]:
            raise ConfigError(f"x has {len(x)} rows, the recorded activations {self._active.shape[1]}")
        return self._active[layer].copy()

    def predict_window(self, layer: int, x: Any, live: Any = None, threshold: float = 0.5) -> np.ndarray:
        return _union(self.predict(layer, x, threshold), live)


def recall_precision(pred: Any, true: Any) -> tuple[float, float]:
    """(recall, precision) of a predicted bool mask against the true one (same shape): recall
    = |pred & true| / |true|, precision = |pred & true| / |pred|; each 1.0 when its
    denominator is 0 (nothing to find / nothing claimed)."""
    pred, true = np.asarray(pred, bool), np.asarray(true, bool)
    if pred.shape != true.shape:
        raise ConfigError(f"pred shape={pred.shape} and true shape={true.shape} differ")
    tp = int((pred & true).sum())
    n_true, n_pred = int(true.sum()), int(pred.sum())
    return (tp / n_true if n_true else 1.0), (tp / n_pred if n_pred else 1.0)


@dataclasses.dataclass(frozen=True)
class NeuronTrace(PlacementPolicy):
    """A placement policy that moves nothing and records which FFN neurons each step's window
    activates (the step output `ffn_active`): the decode's `ActivationStats`, over the window
    rows of every step (bucket padding and probe rows excluded), reported as
    `DecodeStats.placement["stats"]`. The planner's and the Fig 2 analog's input."""

    windows: tuple[int, ...] = DEFAULT_WINDOWS

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset({"ffn_active"})

    def validate(self, model: Any, capabilities: Any) -> None:
        if "ffn_active" not in capabilities.outputs:
            raise ConfigError("recording neuron activity needs an executor that returns ffn_active: a model with "
                              "a ReLU-family FFN (ffn = relu or reglu) on the JAX executor")

    def begin(self, state: Any, model: Any) -> ActivationStats:
        return ActivationStats(model.n_layers, model.ffn_hidden, windows=self.windows)

    def after_step(self, record: ActivationStats, state: Any, plan: Any, outputs: Any) -> None:
        packed = np.asarray(outputs.ffn_active)
        live = np.zeros(packed.shape[1:3], bool)
        live[:, :len(plan.window)] = True
        record.add_packed(packed, live)

    def end(self, record: ActivationStats, state: Any) -> dict:
        return {"stats": record}


def decode_statistics(model, prompts: Sequence[Sequence[int]], decode, *, windows=None) -> ActivationStats:
    """Activation statistics of decoding `prompts` with `decode` (one at a time) with the
    `dlm_jax.Model` `model` (the JAX executor): every step's
    `ffn_active` over its live window rows (`runtime.neurons.NeuronTrace`)."""
    policy = NeuronTrace(windows=tuple(windows or DEFAULT_WINDOWS))
    cfg = decode.replace(placement=policy)
    stats = None
    for ids in prompts:
        got = model.decoder.decode([list(ids)], cfg).stats.placement["stats"]
        stats = got if stats is None else stats.merge(got)
    return stats

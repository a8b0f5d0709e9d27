"""The phone `dlm_jax.techniques.powerinfer.pipeline` prices (our model, built from PowerInfer-2's
§2.3 figures): DRAM bandwidths, the virtual neuron's flash layouts (INT4 bundle, FP16 bundle,
unbundled rows), and memory without and with PowerInfer-2's neuron cache (NumPy only)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.techniques.powerinfer._pipeline_trace import _at_least
from dlm_jax.lowering.costs import UfsModel


# --------------------------------------------------------------------------- prices

@dataclasses.dataclass(frozen=True, kw_only=True)
class PhoneCosts:
    """PowerInfer-2's OnePlus 12 figures (§2.3) and the virtual model they price.

    ufs: flash reads (random within the flash file's range; sequential for hot clusters).
    cpu_bandwidth / npu_bandwidth / both_bandwidth: DRAM during matmul, CPU / NPU / both at once
      (PowerInfer-2 §2.3.1). The CPU pool streams a weight byte for W rows in W / cpu_bandwidth (at
      `saturating_threads` threads; fewer threads, proportionally slower: our assumption).
    npu_tile_seconds_per_byte: NPU compute per weight byte per 32-row tile (770 tok/s dense 7B
      prefill over an 8B Q4_0 model's 4.5e9 B: derived by us from PowerInfer-2 §2.3.1).
    predictor_fraction: predictor bytes per neuron it covers, as a share of the neuron's (our
      choice: a predictor within 10% of the FFN); attention_fraction: a layer's attention bytes
      as a share of its FFN's (FFN ~80% of the parameters, PowerInfer-2 §2.1, gives 0.25).
    d_model: the virtual width of every traced neuron; neuron_repeat / layer_repeat: virtual
      neurons per traced neuron and layers per traced layer (1: the traced model's shape).
    """

    ufs: UfsModel = UfsModel()
    cpu_bandwidth: float = 43.9e9
    npu_bandwidth: float = 56e9
    both_bandwidth: float = 59.6e9
    npu_tile_seconds_per_byte: float = 32 * (8 / 7) / 770 / 4.5e9
    saturating_threads: int = 4
    predictor_fraction: float = 0.1
    attention_fraction: float = 0.25
    d_model: int = 4096
    neuron_repeat: int = 1
    layer_repeat: int = 1

    def __post_init__(self) -> None:
        for name in ("cpu_bandwidth", "npu_bandwidth", "both_bandwidth", "npu_tile_seconds_per_byte"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"PhoneCosts.{name}={getattr(self, name)!r} must be > 0")
        for name in ("predictor_fraction", "attention_fraction"):
            _at_least(f"PhoneCosts.{name}", getattr(self, name), 0, integer=False)
        for name in ("saturating_threads", "d_model", "neuron_repeat", "layer_repeat"):
            _at_least(f"PhoneCosts.{name}", getattr(self, name), 1)

    def cpu_seconds_per_byte(self, window: int, threads: int) -> float:
        """The pool of `threads` compute threads streaming one weight byte for W rows."""
        return window / self.cpu_bandwidth * self.saturating_threads / min(threads, self.saturating_threads)

    def npu_seconds_per_byte(self, window: int) -> float:
        return max(1 / self.npu_bandwidth, -(-window // 32) * self.npu_tile_seconds_per_byte)


@dataclasses.dataclass(frozen=True)
class FlashLayout:
    """One neuron on flash and in memory. gate_reads / ud_reads: request bytes per loaded neuron
    at GIO / UDIO; two_phase: UDIO only for neurons whose gate output is non-zero (else for every
    loaded neuron); gate_bytes / ud_bytes: what the compute streams; bundle_bytes: on flash."""

    name: str
    gate_reads: tuple[int, ...]
    ud_reads: tuple[int, ...]
    two_phase: bool
    gate_bytes: int
    ud_bytes: int
    bundle_bytes: int

    @property
    def neuron_bytes(self) -> int:
        """One neuron in memory (gate + up + down)."""
        return self.gate_bytes + self.ud_bytes

    @staticmethod
    def _int4_matrix(d_model: int) -> int:
        return d_model // 2 + d_model // 8  # int4 weights + fp16 scales: 2 KB + 0.5 KB at 4096

    @classmethod
    def int4_bundle(cls, d_model: int = 4096) -> FlashLayout:
        """PowerInfer-2 §4.4: 7.5 KB aligned to 8 KB, two halves: gate first, up/down after (two-phase)."""
        m = cls._int4_matrix(d_model)
        bundle = -(-3 * m // 8192) * 8192
        return cls("int4-bundle", (bundle // 2,), (bundle // 2,), True, m, 2 * m, bundle)

    @classmethod
    def fp16_bundle(cls, d_model: int = 4096) -> FlashLayout:
        """PowerInfer-2 §4.4: 3 x 8 KB at 4096, one 24 KB read per bundle."""
        return cls("fp16-bundle", (6 * d_model,), (), False, 2 * d_model, 4 * d_model, 6 * d_model)

    @classmethod
    def int4_rows(cls, d_model: int = 4096) -> FlashLayout:
        """No bundling: gate, up and down rows each read on their own (4 KB requests)."""
        m = cls._int4_matrix(d_model)
        row = -(-m // 4096) * 4096
        return cls("int4-rows", (row,), (row, row), False, m, 2 * m, 3 * row)


# --------------------------------------------------------------------------- memory

GATE, WHOLE = 1, 2  # what memory holds of a neuron: its gate row (a two-phase read's first half), or all of it


class StaticMemory:
    """No neuron cache: the first `resident[l]` neurons (by index) of layer l stay in memory."""

    def __init__(self, resident: Sequence[int]) -> None:
        self.resident = np.asarray(resident, np.int64)
        self.bytes_written = 0

    def resize(self, hot_bytes: int) -> None:
        pass

    def hot_hit(self, key: tuple[int, int, int], n_neurons: int) -> bool:
        return False

    def lookup(self, layer: int, neurons: np.ndarray) -> np.ndarray:
        """int8 [n]: WHOLE for a resident neuron, else 0."""
        return np.where(np.asarray(neurons) < self.resident[layer], WHOLE, 0).astype(np.int8)

    def insert(self, layer: int, neurons: np.ndarray, part: int = WHOLE) -> None:
        pass


class NeuronCacheModel:
    """PowerInfer-2's hot and cold regions (PowerInfer-2 §4.2) in `budget_bytes`: the hot region holds whole
    clusters (each neuron `neuron_bytes`), least recently used out; the cold region single
    neurons, least recently used out: a neuron read whole (`neuron_bytes`) or, after a two-phase
    read whose gate output was zero, its gate row only (`gate_bytes`; our choice); `resize(hot_bytes)`
    moves the boundary, the total staying `budget_bytes`. Evicted weights are dropped:
    `bytes_written` stays 0."""

    def __init__(self, budget_bytes: int, neuron_bytes: int, *, gate_bytes: int | None = None) -> None:
        _at_least("budget_bytes", budget_bytes, 0)
        _at_least("neuron_bytes", neuron_bytes, 1)
        self.budget_bytes, self.neuron_bytes = int(budget_bytes), int(neuron_bytes)
        self.part_bytes = {GATE: int(neuron_bytes if gate_bytes is None else gate_bytes), WHOLE: self.neuron_bytes}
        _at_least("gate_bytes", self.part_bytes[GATE], 1)
        self.hot: OrderedDict[tuple[int, int, int], int] = OrderedDict()  # (layer, lo, hi) -> neurons
        self.cold: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, neuron) -> GATE or WHOLE
        self.hot_bytes = self.cold_used = 0
        self.evicted_neurons = self.evicted_clusters = self.bytes_written = 0

    @property
    def cold_bytes(self) -> int:
        return self.budget_bytes - self.hot_bytes

    def _used_hot(self) -> int:
        return sum(self.hot.values()) * self.neuron_bytes

    def _fit(self) -> None:
        while self.hot and self._used_hot() > self.hot_bytes:
            self.hot.popitem(last=False)
            self.evicted_clusters += 1
        while self.cold and self.cold_used > self.cold_bytes:
            self.cold_used -= self.part_bytes[self.cold.popitem(last=False)[1]]
            self.evicted_neurons += 1

    def resize(self, hot_bytes: int) -> None:
        """Hot region `hot_bytes`, cold region the rest of the budget (a bucket change)."""
        if not 0 <= hot_bytes <= self.budget_bytes:
            raise ConfigError(f"hot region {hot_bytes} B must be within the budget of {self.budget_bytes} B")
        self.hot_bytes = int(hot_bytes)
        self._fit()

    def hot_hit(self, key: tuple[int, int, int], n_neurons: int) -> bool:
        """Whether the hot cluster `key` is resident (then most recently used); a miss stores it."""
        if key in self.hot:
            self.hot.move_to_end(key)
            return True
        if n_neurons * self.neuron_bytes <= self.hot_bytes:
            self.hot[key] = n_neurons
            self._fit()  # the new cluster fits alone and is the most recent: older ones go
        return False

    def lookup(self, layer: int, neurons: np.ndarray) -> np.ndarray:
        """int8 [n]: what the cold region holds of each neuron (0, GATE, WHOLE); those held
        become most recently used."""
        held = np.zeros(len(neurons), np.int8)
        for i, n in enumerate(neurons.tolist()):
            part = self.cold.get((layer, n))
            if part:
                self.cold.move_to_end((layer, n))
                held[i] = part
        return held

    def insert(self, layer: int, neurons: np.ndarray, part: int = WHOLE) -> None:
        """Store `part` of neurons just read (most recent), evicting the least recently used."""
        for n in neurons.tolist():
            self.cold_used += self.part_bytes[part] - self.part_bytes.get(self.cold.pop((layer, n), 0), 0)
            self.cold[(layer, n)] = part
        self._fit()

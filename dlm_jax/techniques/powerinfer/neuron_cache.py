"""PowerInfer-2's cold-neuron cache, host side (NumPy only; PowerInfer-2 §4.2): `NeuronCache`
holds single FFN neurons (gate row, up row, down column) read from flash, least recently used
out. The paper's other two regions (fixed, hot) are the NPU programs' constants (see the class).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dlm_jax.techniques.powerinfer.neurons import _int


class NeuronCache:
    """PowerInfer-2's cold-neuron cache (PowerInfer-2 §4.2): single neurons, least recently used out, in
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
        """Store `neurons` (`values[part]` [n, D] each; those already cached are skipped, so a
        read-ahead landing after a demand read of the same neuron stores nothing twice) in free
        slots, else in the least recently used ones (evicting them); when more arrive than the
        cache holds, the last that fit are kept. Returns how many were stored."""
        neurons = np.asarray(neurons, np.int64)
        new = self.slot_of[layer, neurons] < 0
        if not new.all():
            neurons = neurons[new]
            values = {p: np.asarray(values[p])[new] for p in self.parts}
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

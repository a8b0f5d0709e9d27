"""PowerInfer-2's CPU path for the cold neurons of a sparse bundle (PowerInfer-2 §4.1.2-§4.4; NumPy only):
the predictor, the neuron cache and the flash reads between a sparse bundle's layer programs
(`dlm_jax.executors.partitioned` runs the programs and calls this after each layer).

Memory has three regions (PowerInfer-2 §4.2 has fixed, hot and cold ones; ours differ, see
docs/techniques/powerinfer.md):

- pinned: the hot clusters, constants of each layer's NPU program, resident for the whole
  decode (a sparse bundle's hot sets are prefixes of one order, so a bucket change evicts
  nothing), with attention and the head;
- prefetch: when a decode starts from an empty cache, the cold neurons the calibration
  statistics rate most likely to fire (P(active) at the largest window, across layers) are
  read ahead on the reader thread as background reads, layer 0 first, which run only while no
  step waits for a miss, and land in the cache as they arrive, so later steps find them
  resident instead of missing one by one (`prefetch`; needs the reader thread; the reads are
  counted like any other);
- LRU: every other cold neuron a window needs, kept in the neuron-level LRU (`NeuronCache`),
  which the prefetched neurons share: they are the first evicted when unused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dlm_jax._errors import ConfigError


@dataclasses.dataclass
class ColdCounters:
    steps: int = 0
    neurons: int = 0  # cold neurons computed (summed over layers and steps)
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    requests: int = 0
    prefetched: int = 0  # neurons read ahead into the cache (their bytes are in bytes_read)
    cold_total: int = 0  # cold neurons available (summed over layers and steps)
    true_active: int = 0  # with `audit`: cold neurons the window truly activates ...
    found: int = 0  # ... and those of them the predictor picked (recall = found / true_active)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def prefetch_order(prob: np.ndarray, order: np.ndarray, first_cold: np.ndarray, slots: int) -> list[np.ndarray]:
    """The prefetch region's content for `slots` cached neurons: per layer, the cold neurons
    `order[l, first_cold[l]:]` (the plan's order, hottest first; a sparse bundle's flash file
    lays them out in it) cut after the first k_l, where the k_l share `slots` as the top cold
    `prob` [L, F] (P(active)) over all layers do, never-active neurons left out. So each
    layer's read-ahead is one run of consecutive positions on flash."""
    prob = np.asarray(prob, np.float64)
    order = np.asarray(order, np.int64)
    if prob.shape != order.shape or np.shape(first_cold) != prob.shape[:1]:
        raise ConfigError(f"prefetch prob {prob.shape}, order {order.shape} and first_cold {np.shape(first_cold)} "
                          f"must agree ([L, F], [L, F], [L])")
    cands = [order[i, int(first_cold[i]):] for i in range(order.shape[0])]
    scores = np.concatenate([prob[i, c] for i, c in enumerate(cands)])
    layer_of = np.concatenate([np.full(c.size, i) for i, c in enumerate(cands)])
    top = np.argsort(-scores, kind="stable")[:max(0, slots)]
    top = top[scores[top] > 0]  # never-seen neurons are not worth a read
    counts = np.bincount(layer_of[top], minlength=len(cands))
    return [np.asarray(c[:k], np.int64) for c, k in zip(cands, counts)]


def cached_neuron_bytes(kind: str, d_model: int) -> int:
    """What one neuron takes in the cold path's cache: float32 rows of each part (gate, up,
    down; relu: up, down), whatever the flash file's dtype."""
    return 4 * (2 if kind == "relu" else 3) * d_model


class ColdPath:
    """Per layer and step: the neurons the window activates (`predictor.predict_window` over the
    FFN input rows; `oracle=True` computes the true gates from every cold neuron's gate row,
    held resident: tests and the accuracy bound only) among the layer's cold neurons at this
    window; those in the neuron cache are computed at once, the misses are read from the flash
    file (one positioned read per run of consecutive bundles) in `chunk` sized groups on the
    reader thread, each computed as it arrives while the next is read (`pipeline`), then cached
    (LRU, within `cache_bytes`). The result is their FFN output,
    sum_i down_i * relu(gate_i . x) * (up_i . x). `prefetch` (per layer, neuron ids;
    `prefetch_order`): read ahead whenever the cache starts empty. `reader`: what reads the
    misses (default a `FlashReader` of the flash file; the benchmark's baselines pass others
    with its `read`). `audit`: also hold every gate row and count how many of the truly
    active cold neurons the predictor found (`counters.found / counters.true_active`: its
    recall on real windows)."""

    def __init__(self, flash_path, *, order: np.ndarray, hot: dict[int, np.ndarray], cache_bytes: int,
                 predictor=None, oracle: bool = False, pipeline: bool = True, chunk: int = 32, direct: bool = True,
                 on_note=None, reader=None, audit: bool = False, prefetch: list[np.ndarray] | None = None):
        from dlm_jax.techniques.powerinfer.flash import FlashFile, read_all
        from dlm_jax.techniques.powerinfer.flash_io import FlashReader, ReaderThread
        from dlm_jax.techniques.powerinfer.neuron_cache import NeuronCache

        if predictor is None and not oracle:
            raise ConfigError("the cold path needs an activation predictor or oracle=True")
        self.flash = FlashFile.open(flash_path)
        header = self.flash.header
        self.kind = header.kind
        self.order = np.asarray(order)
        self.hot = {int(w): np.asarray(h) for w, h in hot.items()}
        self.windows = sorted(self.hot)
        self.neuron_bytes = header.bundle_bytes
        self.parts = ("up", "down") if header.kind == "relu" else ("gate", "up", "down")
        self.cache = NeuronCache(header.layers, max(header.neurons), header.d_model, cache_bytes,
                                 cached_neuron_bytes(header.kind, header.d_model), parts=self.parts)
        self.predictor = predictor
        self.reader = reader if reader is not None else FlashReader(self.flash, direct=direct, on_note=on_note)
        self.thread = ReaderThread(self.reader) if pipeline else None
        self.chunk = chunk
        self.counters = ColdCounters()
        if prefetch is not None and len(prefetch) != header.layers:
            raise ConfigError(f"prefetch lists {len(prefetch)} layers, the flash file {header.layers}")
        self.prefetch = None if prefetch is None else [np.asarray(p, np.int64) for p in prefetch]
        self._ahead: dict[int, list] | None = None  # layer -> reads in flight, after a cold start
        # oracle: every neuron's activating row (the gate; relu: up), resident
        self.oracle = oracle
        self._gates = [(layer["up"] if layer.get("gate") is None else layer["gate"]).astype(np.float32)
                       for layer in read_all(self.flash)] if oracle or audit else None
        self._cold = {}  # (layer, window) -> bool [F], the layer's cold neurons at that window

    def reset(self) -> None:
        """Start cold: an empty neuron cache (prefetched again at the next step), zero counters."""
        self._drain()
        self.cache.invalidate()
        self.counters = ColdCounters()

    def close(self) -> None:
        self._drain()
        if self.thread is not None:
            self.thread.close()
        self.reader.close()

    def _drain(self) -> None:
        """Cancel the reads ahead still queued and wait for the one in flight (dropped)."""
        for futures in (self._ahead or {}).values():
            for fut in futures:
                if not fut.cancel():
                    fut.result()
        self._ahead = None

    def read_ahead(self, *, wait: bool = False) -> None:
        """After a cold start (an empty cache), queue the prefetch region's reads as background
        reads, layer by layer, in small groups (a group in flight delays a miss until it
        completes); each layer's land in the cache at its next step. The first step after a
        cold start calls this; `wait`: also wait until every read is done (tests, or a caller
        with time to spare before decoding)."""
        if self._ahead is None:
            self._ahead = {}
            if self.prefetch is not None and self.thread is not None and not self.cache.resident_bytes:
                step = max(1, self.chunk // 2)
                for layer, ids in enumerate(self.prefetch):
                    self._ahead[layer] = [self.thread.submit(layer, ids[i:i + step], background=True)
                                          for i in range(0, ids.size, step)]
        if wait:
            for futures in self._ahead.values():
                for fut in futures:
                    fut.exception()  # waits; a failed read raises when it lands

    def _land(self, layer: int) -> None:
        """Put the layer's finished reads ahead into the cache (never waits)."""
        pending = self._ahead.get(layer) if self._ahead else None
        if not pending:
            return
        left = []
        for fut in pending:
            if not fut.done():
                left.append(fut)
                continue
            got = fut.result()
            self.counters.bytes_read += got.bytes_read
            self.counters.requests += got.requests
            self.counters.prefetched += self.cache.insert(layer, got.neurons, {"gate": got.gate, "up": got.up,
                                                                               "down": got.down.T})
        self._ahead[layer] = left

    def is_cold(self, layer: int, window: int) -> np.ndarray:
        w = next((x for x in self.windows if x >= window), self.windows[-1])
        mask = self._cold.get((layer, w))
        if mask is None:
            mask = np.ones(self.order.shape[1], bool)
            mask[self.order[layer, :int(self.hot[w][layer])]] = False
            self._cold[(layer, w)] = mask
        return mask

    def active(self, layer: int, x: np.ndarray) -> np.ndarray:
        """bool [F]: the neurons some row of `x` [N, D] activates (predicted, or true)."""
        if self.oracle:
            return (x @ self._gates[layer].T > 0).any(axis=0)
        return self.predictor.predict_window(layer, x)

    def _compute(self, x: np.ndarray, gate, up, down) -> np.ndarray:
        u = x @ up.T
        act = np.maximum(u, 0) if gate is None else np.maximum(x @ gate.T, 0) * u
        return act @ down

    def __call__(self, layer: int, window: int, x: np.ndarray) -> np.ndarray:
        """The cold neurons' FFN output [N, D] for the FFN inputs `x` [N, D] of layer `layer` in
        a (tiled) window of `window` rows."""
        if layer == 0 and self._ahead is None:
            self.read_ahead()
        cold = self.is_cold(layer, window)
        picked = self.active(layer, x) & cold
        need = np.flatnonzero(picked)
        c = self.counters
        if self._gates is not None and not self.oracle:
            truth = (x @ self._gates[layer].T > 0).any(axis=0) & cold
            c.true_active += int(truth.sum())
            c.found += int((truth & picked).sum())
        c.steps += layer == 0
        c.cold_total += int(cold.sum())
        c.neurons += need.size
        self._land(layer)
        y = np.zeros_like(x)
        if need.size == 0:
            return y
        hit, slots = self.cache.lookup(layer, need)
        misses = need[~hit]
        c.hits += int(hit.sum())
        c.misses += misses.size
        futures = []
        if misses.size:
            groups = [misses[i:i + self.chunk] for i in range(0, misses.size, self.chunk)]
            if self.thread is not None:
                futures = [self.thread.submit(layer, g) for g in groups]
            else:
                futures = [_Done(self.reader.read(layer, g)) for g in groups]
        if slots.size:
            rows = self.cache.rows(slots)
            y += self._compute(x, rows.get("gate"), rows["up"], rows["down"])
        for fut in futures:
            got = fut.result()
            c.bytes_read += got.bytes_read
            c.requests += got.requests
            down = got.down.T  # [n, D]
            y += self._compute(x, got.gate, got.up, down)
            self.cache.insert(layer, got.neurons, {"gate": got.gate, "up": got.up, "down": down})
        return y


class _Done:
    """A finished read in the shape of a future (the unpipelined path)."""

    def __init__(self, value):
        self._value = value

    def result(self):
        return self._value

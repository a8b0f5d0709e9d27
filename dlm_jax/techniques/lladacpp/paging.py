"""Paging-only baseline for the memory planner (llada.cpp Tab. 7's comparison row: replacement
kept, graph-guided mapping and pipelined staging off).

The KV cache stays resident, as in the plan. Everything else shares one NPU-visible pool,
allocated first-fit with no knowledge of the graph: an activation is mapped when its op
writes it and released after its last reader; a weight is mapped whole when an op needs it
and stays mapped until evicted, least recently used first, when an allocation finds no
contiguous hole. A miss loads the weight synchronously (the NPU waits: transfer plus mapping
cost, no prefetch, no chunking). The run fails when an op's allocation finds no hole even
after every weight it does not itself read has been evicted: its working set, or the
fragmentation around the tensors it pins, exceeds what the pool can map. Several steps run
back to back (the LRU state carries over); the last one is reported.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections import OrderedDict
from typing import Any

from dlm_jax.lowering.costs import CostModel
from dlm_jax.lowering.graph import StepGraph


@dataclasses.dataclass(frozen=True)
class PagingResult:
    ok: bool
    reason: str  # why it failed ("" when ok)
    failed_op: int  # `Op.index` of the op that could not be mapped, -1 when ok
    va_budget: int
    step_s: float
    compute_s: float
    stall_s: float  # synchronous weight loads
    loads: int
    loaded_bytes: int
    op_stall_s: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))


class _Pool:
    """First-fit allocator over [base, limit); blocks are kept sorted by offset."""

    def __init__(self, base: int, limit: int) -> None:
        self.base, self.limit = base, limit
        self.starts: list[int] = []
        self.blocks: dict[Any, tuple[int, int]] = {}
        self.owner: dict[int, Any] = {}

    def _holes(self):
        prev = self.base
        for start in self.starts:
            yield prev, start
            prev = start + self.blocks[self.owner[start]][1]
        yield prev, self.limit

    def alloc(self, key: Any, size: int) -> bool:
        for lo, hi in self._holes():
            if hi - lo >= size:
                bisect.insort(self.starts, lo)
                self.blocks[key], self.owner[lo] = (lo, size), key
                return True
        return False

    def free(self, key: Any) -> None:
        start, _ = self.blocks.pop(key)
        self.starts.remove(start)
        del self.owner[start]

    def largest_hole(self) -> int:
        return max(hi - lo for lo, hi in self._holes())

    def free_bytes(self) -> int:
        return self.limit - self.base - sum(size for _, size in self.blocks.values())


class _Failed(Exception):
    pass


def paging_only(graph: StepGraph, *, va_budget: int, cost: CostModel = CostModel(), alignment: int = 4096,
                inline_bytes: int = 1024, steps: int = 2) -> PagingResult:
    """Run `steps` steps of `graph` under LRU paging in `va_budget` bytes; the last one counts."""
    size = lambda t: -(-max(graph.tensors[t].nbytes, 1) // alignment) * alignment  # noqa: E731
    kv = {t for t in graph.lifetimes() if graph.tensors[t].kind == "kv"}
    kv_bytes = sum(size(t) for t in kv)
    exec_s = [cost.exec_time(graph, op) for op in graph.ops]
    if kv_bytes > va_budget:
        return _failed(f"the KV cache ({kv_bytes} B) alone exceeds the VA budget", -1, va_budget, exec_s)
    pool = _Pool(kv_bytes, va_budget)
    lru: OrderedDict[Any, None] = OrderedDict()
    live = {t: span for t, span in graph.lifetimes().items() if t not in kv}
    ending: dict[int, list[int]] = {}
    for t, (_, last) in live.items():
        ending.setdefault(last, []).append(t)
    try:
        for _ in range(steps):
            stats = _step(graph, pool, lru, live, ending, exec_s, size, cost, inline_bytes)
    except _Failed as failure:
        op_index, reason = failure.args
        return _failed(reason, op_index, va_budget, exec_s)
    stall, loads, loaded = stats
    return PagingResult(True, "", -1, va_budget, sum(exec_s) + sum(stall), sum(exec_s), sum(stall), loads, loaded,
                        tuple(stall))


def _failed(reason: str, op_index: int, va_budget: int, exec_s: list[float]) -> PagingResult:
    return PagingResult(False, reason, op_index, va_budget, float("inf"), sum(exec_s), float("inf"), 0, 0, ())


def _step(graph, pool: _Pool, lru, live, ending, exec_s, size, cost: CostModel, inline_bytes: int):
    stall = [0.0] * len(graph.ops)
    loads = loaded = 0
    for t in graph.inputs:
        if t in live:
            _map(pool, lru, ("act", t), size(t), set(), graph.ops[0].index, graph.tensors[t].name)
    for pos, op in enumerate(graph.ops):
        keys = {}
        for t in graph.weights(op):
            if graph.tensors[t].nbytes >= inline_bytes:
                buffer = graph.tensors[t].buffer
                keys[("w", buffer if buffer >= 0 else -1 - t)] = t
        for key, t in keys.items():
            if key in lru:
                lru.move_to_end(key)
                continue
            _map(pool, lru, key, size(t), set(keys), op.index, graph.tensors[t].name)
            lru[key] = None
            stall[pos] += cost.transfer_time(graph.tensors[t].nbytes)
            loads, loaded = loads + 1, loaded + graph.tensors[t].nbytes
        for t in op.outputs:
            if t in live and ("act", t) not in pool.blocks:
                _map(pool, lru, ("act", t), size(t), set(keys), op.index, graph.tensors[t].name)
        for t in ending.get(pos, ()):
            if ("act", t) in pool.blocks:
                pool.free(("act", t))
    return stall, loads, loaded


def _map(pool: _Pool, lru, key, nbytes: int, pinned: set, op_index: int, name: str) -> None:
    """Allocate `key`, evicting least recently used weights outside `pinned` until a hole fits."""
    while not pool.alloc(key, nbytes):
        victim = next((k for k in lru if k not in pinned), None)
        if victim is None:
            raise _Failed(op_index, f"op {op_index} cannot map {name} ({nbytes} B): largest hole "
                                    f"{pool.largest_hole()} B, {pool.free_bytes()} B free after evicting "
                                    "every weight it does not read")
        del lru[victim]
        pool.free(victim)

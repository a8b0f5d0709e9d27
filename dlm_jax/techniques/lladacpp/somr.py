"""Swap-optimized memory planner: where every tensor of a step lives in NPU-visible memory
(llada.cpp §3.4 SOMR; the paper gives the objective, the placement procedure below is ours:
docs/techniques/lladacpp.md).

Long-lived data (weights, KV cache) stay visible across steps; short-lived data
(activations, step inputs and outputs) share one scratch region by lifetime (non-overlapping
live ranges share offsets, greedy by size). When the VA budget cannot hold every weight,
weights are demoted op by op, greedily by (not next to a demoted op, slack, size) where an
op's slack is the NPU time since the previous weight-carrying op minus its transfer time, so
resident and staged ops alternate and transfers hide under resident compute. Demoted
payloads stream through two alternating staging slots (a payload larger than a slot streams
in slot-sized chunks); the k-th staged chunk is prefetched when the chunk that last used its
slot (k-2) has been consumed. An event simulation (one host staging engine, transfers in
graph order) gives each op's exposed stall and the step time.

VA layout, offsets from 0: [KV cache][resident weight regions][scratch][slot 0][slot 1].
Weights under `inline_bytes` (shapes, axes, scalars, tiny tables) are compiled into the NPU
graph, not mapped. MB = 2**20 bytes. The plan is data: `MemoryPlan.to_json` / `from_json`,
verified by `check_plan`; `dlm_jax.techniques.lladacpp.paging.paging_only` is the baseline it is compared with.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dlm_jax._errors import ConfigError
from dlm_jax.techniques.lladacpp._plan_check import PlanError, check_plan
from dlm_jax.lowering.costs import MB, CostModel
from dlm_jax.lowering.graph import JsonText, StepGraph, ceil_to

__all__ = ["MB", "DEFAULT_STAGING_BYTES", "CostModel", "MemoryPlan", "PlanError", "Region", "ScratchEntry",
           "Staged", "Timeline", "check_plan", "plan_bundle", "plan_memory", "simulate"]

DEFAULT_STAGING_BYTES = 256 * MB  # fixed in llada.cpp's Fig. 13c
DEFAULT_ALIGNMENT = 4096
DEFAULT_INLINE_BYTES = 1024
DEFAULT_MAPPING_BYTES = 256 * MB


@dataclasses.dataclass(frozen=True)
class Region:
    """One NPU mapping: `tensors` are (tensor index, absolute offset)."""

    mapping: int
    offset: int
    size: int
    tensors: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class ScratchEntry:
    tensor: int
    offset: int  # absolute
    size: int
    first: int  # op positions of its live range
    last: int


@dataclasses.dataclass(frozen=True)
class Staged:
    """One staged chunk, `seq`-th in consumption order: `nbytes` of the `tensors` read by the
    op at position `op`, in slot `slot`, prefetched once chunk `prefetch_after` has been
    consumed (-1: at step start)."""

    seq: int
    op: int
    chunk: int
    chunks: int
    tensors: tuple[int, ...]
    nbytes: int
    slot: int
    prefetch_after: int


@dataclasses.dataclass(frozen=True)
class Timeline:
    step_s: float
    compute_s: float
    stall_s: float  # exposed: the NPU waits for a staged payload
    staging_s: float  # every transfer, hidden or not
    op_stall_s: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class MemoryPlan(JsonText):
    signature: str
    op_index: tuple[int, ...]  # `Op.index` of the planned ops, in order
    va_budget: int
    alignment: int
    weight_budget: int  # bytes of weights kept resident at most
    inline_bytes: int
    kv: Region
    resident: tuple[Region, ...]
    scratch_offset: int
    scratch_bytes: int
    scratch: tuple[ScratchEntry, ...]
    slots: tuple[int, ...]
    slot_bytes: int
    staged: tuple[Staged, ...]
    demoted: tuple[int, ...]  # op positions whose weights are staged
    cost: CostModel
    timeline: Timeline

    @property
    def va_used(self) -> int:
        return self.slots[-1] + self.slot_bytes if self.slots else self.scratch_offset + self.scratch_bytes

    @property
    def resident_weight_bytes(self) -> int:
        return sum(r.size for r in self.resident)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryPlan:
        d = dict(data)

        def region(r: dict[str, Any]) -> Region:
            return Region(r["mapping"], r["offset"], r["size"], tuple(tuple(x) for x in r["tensors"]))

        d["op_index"], d["slots"], d["demoted"] = tuple(d["op_index"]), tuple(d["slots"]), tuple(d["demoted"])
        d["kv"], d["resident"] = region(d["kv"]), tuple(region(r) for r in d["resident"])
        d["scratch"] = tuple(ScratchEntry(**e) for e in d["scratch"])
        d["staged"] = tuple(Staged(**{**s, "tensors": tuple(s["tensors"])}) for s in d["staged"])
        d["cost"] = CostModel.from_dict(d["cost"])
        d["timeline"] = Timeline(**{**d["timeline"], "op_stall_s": tuple(d["timeline"]["op_stall_s"])})
        return cls(**d)



def align(n: int, alignment: int) -> int:
    return ceil_to(n, alignment)


def _mb(n: float) -> str:
    return f"{n / MB:.1f} MB" if n >= MB else f"{n / MB:.3g} MB"


def pack_scratch(graph: StepGraph, alignment: int) -> tuple[dict[int, int], int, dict[int, tuple[int, int]]]:
    """Offsets (from 0) of every short-lived tensor by greedy-by-size interval packing:
    tensors whose live ranges overlap never share bytes. Returns (offsets, peak, lifetimes)."""
    live = {t: span for t, span in graph.lifetimes().items() if graph.tensors[t].kind != "kv"}
    order = sorted(live, key=lambda t: (-graph.tensors[t].nbytes, live[t][0], t))
    placed: list[tuple[int, int, int, int]] = []  # offset, end, first, last
    offsets: dict[int, int] = {}
    peak = 0
    for t in order:
        size, (first, last) = align(max(graph.tensors[t].nbytes, 1), alignment), live[t]
        busy = sorted((o, e) for o, e, born, dies in placed if born <= last and first <= dies)
        offset = 0
        for o, e in busy:
            if offset + size <= o:
                break
            offset = max(offset, e)
        offsets[t] = offset
        placed.append((offset, offset + size, first, last))
        peak = max(peak, offset + size)
    return offsets, peak, live


def _bkey(graph: StepGraph, t: int) -> int:
    """One key per allocation: tensors sharing a constant buffer share it."""
    buffer = graph.tensors[t].buffer
    return buffer if buffer >= 0 else -1 - t


class _Weights:
    """Long-lived weights grouped per op position, with aligned sizes per allocation."""

    def __init__(self, graph: StepGraph, inline_bytes: int, alignment: int) -> None:
        self.per_op: dict[int, list[int]] = {}  # position -> allocation keys
        self.size: dict[int, int] = {}
        self.tensors: dict[int, list[int]] = {}  # key -> tensor indices
        self.users: dict[int, set[int]] = {}
        for pos, op in enumerate(graph.ops):
            for t in graph.weights(op):
                if graph.tensors[t].nbytes < inline_bytes:
                    continue
                key = _bkey(graph, t)
                self.size[key] = align(graph.tensors[t].nbytes, alignment)
                self.tensors.setdefault(key, [])
                if t not in self.tensors[key]:
                    self.tensors[key].append(t)
                if key not in self.per_op.setdefault(pos, []):
                    self.per_op[pos].append(key)
                self.users.setdefault(key, set()).add(pos)

    def op_bytes(self, pos: int) -> int:
        return sum(self.size[k] for k in self.per_op.get(pos, ()))


def _chunks(nbytes: int, slot_bytes: int) -> list[int]:
    if slot_bytes <= 0:
        return [nbytes]
    full, rest = divmod(nbytes, slot_bytes)
    return [slot_bytes] * full + ([rest] if rest else [])


def demote(weights: _Weights, exec_s: list[float], cost: CostModel, budget: int, slot_bytes: int) -> list[int]:
    """Op positions whose weights leave the resident set, picked greedily by (not adjacent
    to an already demoted op, slack, size) until the resident weights fit `budget`."""
    wpos = sorted(weights.per_op)
    remaining = {k: len(u) for k, u in weights.users.items()}
    resident = sum(weights.size.values())
    slack, prev = {}, 0
    for pos in wpos:
        transfer = sum(cost.transfer_time(c) for c in _chunks(weights.op_bytes(pos), slot_bytes))
        slack[pos] = sum(exec_s[prev:pos]) - transfer
        prev = pos
    neighbours = {p: {wpos[i - 1] if i else None, wpos[i + 1] if i + 1 < len(wpos) else None}
                  for i, p in enumerate(wpos)}
    demoted: set[int] = set()
    while resident > budget:
        pick = max((p for p in wpos if p not in demoted),
                   key=lambda p: (not (neighbours[p] & demoted), slack[p], weights.op_bytes(p), -p))
        demoted.add(pick)
        for key in weights.per_op[pick]:
            remaining[key] -= 1
            resident -= weights.size[key] if remaining[key] == 0 else 0
    return sorted(demoted)


def _stage(graph: StepGraph, weights: _Weights, demoted: list[int], slot_bytes: int) -> list[Staged]:
    """Slot-sized chunks of each demoted op's payload (weights no resident op keeps), in
    consumption order, alternating slots."""
    items: list[Staged] = []
    down = set(demoted)
    for pos in demoted:
        keys = [k for k in weights.per_op[pos] if weights.users[k] <= down]
        reads = set(graph.ops[pos].inputs)
        tensors = [next(t for t in weights.tensors[k] if t in reads) for k in keys]
        spans, start = [], 0
        for k, t in zip(keys, tensors):
            spans.append((start, start + graph.tensors[t].nbytes, t))
            start += graph.tensors[t].nbytes
        pieces, lo = _chunks(start, slot_bytes), 0
        for j, size in enumerate(pieces):
            hi = lo + size
            inside = tuple(t for a, b, t in spans if a < hi and lo < b)
            seq = len(items)
            items.append(Staged(seq, pos, j, len(pieces), inside, size, seq % 2, seq - 2 if seq >= 2 else -1))
            lo = hi
    return items


def simulate(exec_s: list[float], staged: list[Staged] | tuple[Staged, ...], cost: CostModel) -> Timeline:
    """Event simulation of one step: ops run back to back on the NPU; a staged op's chunks
    each take an equal share of its time and wait for their transfer; transfers run one at a
    time on the host, each issued when its slot is released."""
    by_op: dict[int, list[Staged]] = {}
    for item in staged:
        by_op.setdefault(item.op, []).append(item)
    done: dict[int, float] = {}
    stall = [0.0] * len(exec_s)
    now = engine = staging = 0.0
    for pos, e in enumerate(exec_s):
        items = by_op.get(pos)
        if not items:
            now += e
            continue
        for item in items:
            issue = done[item.prefetch_after] if item.prefetch_after >= 0 else 0.0
            transfer = cost.transfer_time(item.nbytes)
            engine = max(issue, engine) + transfer
            staging += transfer
            stall[pos] += max(0.0, engine - now)
            now = max(now, engine) + e / len(items)
            done[item.seq] = now
    return Timeline(now, sum(exec_s), sum(stall), staging, tuple(stall))


def plan_memory(graph: StepGraph, *, va_budget: int | None = None, weight_budget: int | None = None,
                staging_bytes: int = DEFAULT_STAGING_BYTES, cost: CostModel = CostModel(),
                alignment: int = DEFAULT_ALIGNMENT, inline_bytes: int = DEFAULT_INLINE_BYTES,
                mapping_bytes: int = DEFAULT_MAPPING_BYTES) -> MemoryPlan:
    """Plan `graph` (ops in execution order) into `va_budget` bytes of NPU-visible memory, or
    with at most `weight_budget` bytes of resident weights (the VA budget is then whatever the
    layout needs). With neither, every weight is resident and no staging is reserved.

    Raises:
      ConfigError: the budget cannot hold the KV cache + scratch + staging (both numbers named).
    """
    if va_budget is not None and weight_budget is not None:
        raise ConfigError("give va_budget or weight_budget, not both")
    if min(va_budget or 0, weight_budget or 0, staging_bytes) < 0 or alignment <= 0:
        raise ConfigError(f"budgets must be >= 0 and alignment > 0: va_budget={va_budget}, "
                          f"weight_budget={weight_budget}, staging_bytes={staging_bytes}, alignment={alignment}")
    weights = _Weights(graph, inline_bytes, alignment)
    total_weights = sum(weights.size.values())
    if va_budget is None and weight_budget is None:
        staging_bytes = 0
    slot_bytes = staging_bytes // 2 // alignment * alignment
    if staging_bytes and not slot_bytes:
        raise ConfigError(f"staging budget {staging_bytes} B cannot hold two {alignment} B-aligned slots")
    offsets, scratch_bytes, live = pack_scratch(graph, alignment)
    kv = sorted(t for t in graph.lifetimes() if graph.tensors[t].kind == "kv")
    kv_bytes = sum(align(graph.tensors[t].nbytes, alignment) for t in kv)
    fixed = kv_bytes + scratch_bytes + 2 * slot_bytes
    if va_budget is None:
        weight_budget = min(weight_budget if weight_budget is not None else total_weights, total_weights)
        va_budget = fixed + weight_budget
    elif va_budget < fixed:
        raise ConfigError(f"VA budget {_mb(va_budget)} is smaller than the KV cache {_mb(kv_bytes)} + scratch "
                          f"{_mb(scratch_bytes)} + staging {_mb(2 * slot_bytes)} ({_mb(fixed)} in all)")
    weight_budget = max(0, min(va_budget - fixed, total_weights)) if weight_budget is None else weight_budget
    exec_s = [cost.exec_time(graph, op) for op in graph.ops]
    demoted = demote(weights, exec_s, cost, weight_budget, slot_bytes)
    if demoted and not slot_bytes:
        raise ConfigError(f"{len(demoted)} ops need their weights staged but the staging budget is 0")
    staged = _stage(graph, weights, demoted, slot_bytes)
    kv_region, resident, scratch_offset = _layout(graph, weights, set(demoted), kv, alignment, mapping_bytes)
    scratch = tuple(ScratchEntry(t, scratch_offset + offsets[t], align(max(graph.tensors[t].nbytes, 1), alignment),
                                 *live[t]) for t in sorted(offsets))
    slot0 = scratch_offset + scratch_bytes
    slots = (slot0, slot0 + slot_bytes) if slot_bytes else ()
    return MemoryPlan(graph.signature, tuple(op.index for op in graph.ops), int(va_budget), alignment,
                      int(weight_budget), inline_bytes, kv_region, resident, scratch_offset, scratch_bytes, scratch,
                      slots, slot_bytes, tuple(staged), tuple(demoted), cost, simulate(exec_s, staged, cost))


def _layout(graph: StepGraph, weights: _Weights, demoted: set[int], kv: list[int], alignment: int,
            mapping_bytes: int) -> tuple[Region, tuple[Region, ...], int]:
    """The KV region at 0, then resident weights packed in consumption order into regions of
    at most `mapping_bytes` (one larger tensor gets its own); returns where scratch starts."""
    offset, kv_tensors = 0, []
    for t in kv:
        kv_tensors.append((t, offset))
        offset += align(graph.tensors[t].nbytes, alignment)
    kv_region = Region(0, 0, offset, tuple(kv_tensors))
    regions: list[Region] = []
    start, members = offset, []
    for key in dict.fromkeys(k for pos in sorted(weights.per_op) for k in weights.per_op[pos]):
        if weights.users[key] <= demoted:
            continue
        if members and offset + weights.size[key] - start > mapping_bytes:
            regions.append(Region(len(regions) + 1, start, offset - start, tuple(members)))
            start, members = offset, []
        members += [(t, offset) for t in weights.tensors[key]]
        offset += weights.size[key]
    if members:
        regions.append(Region(len(regions) + 1, start, offset - start, tuple(members)))
    return kv_region, tuple(regions), offset


def plan_bundle(content: bytes, config, keys, *, va_budget: int | None = None,
                staging_bytes: int = DEFAULT_STAGING_BYTES, cost: CostModel = CostModel(),
                alignment: int = DEFAULT_ALIGNMENT) -> dict[str, Any]:
    """The lowering plan of a multi-signature `.tflite` (what an exporter stores next to it):
    per bucket signature its NPU/CPU partition and the memory plan of its NPU ops."""
    from dlm_jax.lowering.graph import read_tflite_graph
    from dlm_jax.lowering.partition import partition
    from dlm_jax.runtime.step import signature_name

    out: dict[str, Any] = {"format": "dlm-jax-lowering-plan", "version": 1, "signatures": {}}
    for key in keys:
        name = signature_name(key)
        graph = read_tflite_graph(content, name)
        part = partition(graph, vocab_size=config.vocab_size)
        plan = plan_memory(graph.subgraph(part.npu_ops), va_budget=va_budget, staging_bytes=staging_bytes,
                           cost=cost, alignment=alignment)
        out["signatures"][name] = {"key": dataclasses.asdict(key), "partition": part.to_dict(),
                                   "memory": plan.to_dict()}
    return out

"""Which device runs each op of a bucket's step: the NPU/CPU split of llada.cpp as data.

NPU (llada.cpp §2.2, §4): the dense matmuls (FULLY_CONNECTED, BATCH_MATMUL), attention,
norms and the elementwise ops between them. CPU (the host): the output projection over the
selected rows (the LM head: the last matmul feeding the top-k tail), the gather of those
logit rows, the sampling tail (mask select, softmax, top-k, entropy) and the embedding lookup
(a table read with no dense compute, so its [vocab, d_model] table never takes NPU-visible
memory; our choice). Sparse KV refresh is not part of a step program: it is the CPU-path
program (DPPR's second executor over R_cpu rows), listed in `programs`.

Per device the partition counts ops, FLOPs (NPU matmuls padded to 32-row tiles: a
[ceil32(M), K] x [K, N] product) and the weights its ops read, and lists the tensors that
cross between devices (graph inputs come from the host, graph outputs go to it).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dlm_jax.lowering.graph import MATMUL_OPS, TILE, JsonText, Op, StepGraph, op_flops

TARGETS = ("npu", "cpu")
NORM_OPS = frozenset({"RMS_NORM", "MEAN", "RSQRT", "SQRT"})
TAIL_ANCHORS = frozenset({"TOPK_V2", "ARG_MAX"})
PROGRAMS = (("decode_step", "npu+cpu", "this signature: NPU body, CPU head over the selected rows"),
            ("sparse_refresh", "cpu", "DPPR CPU-path refresh of unstable rows (R_cpu buckets), a separate program"))


@dataclasses.dataclass(frozen=True)
class DeviceLoad:
    ops: int
    flops: int  # NPU: matmuls padded to 32-row tiles
    flops_unpadded: int
    weight_bytes: int


@dataclasses.dataclass(frozen=True)
class Crossing:
    """A tensor written on `src` and read on `dst`."""

    tensor: int
    name: str
    nbytes: int
    src: str
    dst: str


@dataclasses.dataclass(frozen=True)
class Partition(JsonText):
    """`devices` and `roles` are per op position; `lm_head` is an `Op.index` (None if the
    graph has none)."""

    signature: str
    target: str
    op_index: tuple[int, ...]
    devices: tuple[str, ...]
    roles: tuple[str, ...]
    lm_head: int | None
    npu: DeviceLoad
    cpu: DeviceLoad
    boundary: tuple[Crossing, ...]
    programs: tuple[tuple[str, str, str], ...] = PROGRAMS

    @property
    def npu_ops(self) -> tuple[int, ...]:
        return tuple(i for i, d in zip(self.op_index, self.devices) if d == "npu")

    @property
    def cpu_ops(self) -> tuple[int, ...]:
        return tuple(i for i, d in zip(self.op_index, self.devices) if d == "cpu")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Partition:
        d = dict(data)
        for name in ("op_index", "devices", "roles"):
            d[name] = tuple(d[name])
        d["npu"], d["cpu"] = DeviceLoad(**d["npu"]), DeviceLoad(**d["cpu"])
        d["boundary"] = tuple(Crossing(**c) for c in d["boundary"])
        d["programs"] = tuple(tuple(p) for p in d["programs"])
        return cls(**d)



def _consumers(graph: StepGraph) -> dict[int, list[int]]:
    users: dict[int, list[int]] = {}
    for pos, op in enumerate(graph.ops):
        for t in dict.fromkeys(op.inputs):
            users.setdefault(t, []).append(pos)
    return users


def _descendants(graph: StepGraph, users: dict[int, list[int]], tensors: list[int]) -> set[int]:
    """Positions of every op downstream of `tensors`."""
    seen: set[int] = set()
    stack = [p for t in tensors for p in users.get(t, ())]
    while stack:
        pos = stack.pop()
        if pos not in seen:
            seen.add(pos)
            stack += [p for t in graph.ops[pos].outputs for p in users.get(t, ())]
    return seen


def _ancestors(graph: StepGraph, producer: dict[int, int], pos: int) -> set[int]:
    seen: set[int] = set()
    stack = [pos]
    while stack:
        p = stack.pop()
        if p not in seen:
            seen.add(p)
            stack += [producer[t] for t in graph.ops[p].inputs if t in producer]
    return seen


def _is_matmul(graph: StepGraph, op: Op) -> bool:
    return op.opcode in MATMUL_OPS and bool(graph.weights(op))


def find_lm_head(graph: StepGraph, *, vocab_size: int | None = None) -> int | None:
    """Position of the LM head: the last weight matmul upstream of the top-k tail whose weight
    has at least `vocab_size` rows (default: the tail's input width). Without a tail, the last
    weight matmul with exactly `vocab_size` rows."""
    producer = graph.producers()
    anchor = next((p for p, op in enumerate(graph.ops) if op.opcode in TAIL_ANCHORS), None)
    if anchor is not None:
        vocab = vocab_size or graph.tensors[graph.ops[anchor].inputs[0]].shape[-1]
        upstream = _ancestors(graph, producer, anchor)
        fits = [p for p in sorted(upstream) if _is_matmul(graph, graph.ops[p])
                and graph.tensors[graph.weights(graph.ops[p])[0]].shape[0] >= vocab]
        return fits[-1] if fits else None
    if vocab_size is None:
        return None
    fits = [p for p, op in enumerate(graph.ops)
            if _is_matmul(graph, op) and graph.tensors[graph.weights(op)[0]].shape[0] == vocab_size]
    return fits[-1] if fits else None


def _roles(graph: StepGraph, lm_head: int | None) -> list[str]:
    """Role of each op; CPU roles are `embedding`, `logit_rows`, `lm_head`, `sampling`."""
    users, producer = _consumers(graph), graph.producers()
    roles = [_npu_role(graph, op) for op in graph.ops]
    for pos, op in enumerate(graph.ops):
        if op.opcode in ("GATHER", "GATHER_ND") and graph.tensors[op.inputs[0]].kind == "weight":
            for p in _ancestors(graph, producer, pos):
                roles[p] = "embedding"
    rows = [t for t in graph.inputs if graph.tensors[t].name.endswith("logit_rows")]
    for p in _descendants(graph, users, rows):
        roles[p] = "logit_rows"
    if lm_head is not None:
        for p in _descendants(graph, users, list(graph.ops[lm_head].outputs)):
            roles[p] = "sampling"
        roles[lm_head] = "lm_head"
    return roles


def _npu_role(graph: StepGraph, op: Op) -> str:
    if op.opcode in MATMUL_OPS:
        return "matmul" if graph.weights(op) else "attention"
    if op.opcode == "SOFTMAX":
        return "attention"
    return "norm" if op.opcode in NORM_OPS else "elementwise"


CPU_ROLES = frozenset({"embedding", "logit_rows", "lm_head", "sampling"})


def partition(graph: StepGraph, *, target: str = "npu", vocab_size: int | None = None) -> Partition:
    """Assign every op of `graph` to "npu" or "cpu" (`target="cpu"`: everything on the CPU,
    the CPU-only baseline)."""
    if target not in TARGETS:
        raise ValueError(f"partition target {target!r} is not one of {TARGETS}")
    lm_head = find_lm_head(graph, vocab_size=vocab_size)
    roles = _roles(graph, lm_head)
    devices = ["cpu" if target == "cpu" or role in CPU_ROLES else "npu" for role in roles]
    return Partition(graph.signature, target, tuple(op.index for op in graph.ops), tuple(devices), tuple(roles),
                     None if lm_head is None else graph.ops[lm_head].index,
                     _load(graph, devices, "npu"), _load(graph, devices, "cpu"), _boundary(graph, devices))


def _load(graph: StepGraph, devices: list[str], device: str) -> DeviceLoad:
    ops = [op for op, d in zip(graph.ops, devices) if d == device]
    tile = TILE if device == "npu" else 1
    weights = dict.fromkeys(w for op in ops for w in graph.weights(op))
    return DeviceLoad(len(ops), sum(op_flops(graph, op, tile=tile) for op in ops),
                      sum(op_flops(graph, op) for op in ops), graph.weight_bytes(weights))


def _boundary(graph: StepGraph, devices: list[str]) -> tuple[Crossing, ...]:
    src = {t: "cpu" for t in graph.inputs}
    for op, d in zip(graph.ops, devices):
        src.update({t: d for t in op.outputs})
    dst: dict[int, set[str]] = {t: {"cpu"} for t in graph.outputs}
    for op, d in zip(graph.ops, devices):
        for t in op.inputs:
            if graph.tensors[t].kind != "weight":
                dst.setdefault(t, set()).add(d)
    out = []
    for t in sorted(dst):
        for d in sorted(dst[t] - {src.get(t, "cpu")}):
            tensor = graph.tensors[t]
            out.append(Crossing(t, tensor.name, tensor.nbytes, src.get(t, "cpu"), d))
    return tuple(out)

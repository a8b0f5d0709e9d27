"""`check_plan`: the rules a memory plan (`dlm_jax.techniques.lladacpp.somr.MemoryPlan`) must keep, checked
against the graph it was made for. Each failure raises `PlanError` naming the rule:

- `graph`: the plan lists exactly the graph's ops.
- `budget`: the layout ends within the VA budget; resident weights within the weight budget.
- `coverage`: every mapped weight an op reads is resident or staged for that op; every
  short-lived tensor has a scratch range covering its live range; every KV tensor is resident.
- `overlap`: no two tensors (or a tensor and a staging slot) that are live at the same op
  share an address.
- `slot size`: a staged chunk fits its slot.
- `slot alternation`: consecutive staged chunks use different slots.
- `slot occupancy`: a chunk is prefetched only after the previous chunk in its slot has been
  consumed, and before its own consumer runs (it holds the slot from prefetch to last use).
"""

from __future__ import annotations

from typing import Any

from dlm_jax.lowering.graph import StepGraph


class PlanError(ValueError):
    """A memory plan breaks one of its rules; the message names the rule."""


def _fail(rule: str, detail: str) -> None:
    raise PlanError(f"plan rule {rule!r} broken: {detail}")


def check_plan(plan: Any, graph: StepGraph) -> None:
    """Raise `PlanError` if `plan` breaks a rule (module docstring); return None if not."""
    if plan.op_index != tuple(op.index for op in graph.ops):
        _fail("graph", f"the plan covers {len(plan.op_index)} ops, the graph has {len(graph.ops)} "
                       "(or their order differs)")
    _check_budget(plan)
    _check_coverage(plan, graph)
    _check_overlap(plan, graph)
    _check_slots(plan)


def _check_budget(plan: Any) -> None:
    if plan.va_used > plan.va_budget:
        _fail("budget", f"the layout ends at {plan.va_used} B, past the VA budget {plan.va_budget} B")
    if plan.resident_weight_bytes > plan.weight_budget:
        _fail("budget", f"{plan.resident_weight_bytes} B of resident weights exceed the weight budget "
                        f"{plan.weight_budget} B")


def _check_coverage(plan: Any, graph: StepGraph) -> None:
    resident = {t for region in plan.resident for t, _ in region.tensors}
    staged: dict[int, set[int]] = {}
    for item in plan.staged:
        staged.setdefault(item.op, set()).update(item.tensors)
    for pos, op in enumerate(graph.ops):
        for t in graph.weights(op):
            if graph.tensors[t].nbytes >= plan.inline_bytes and t not in resident and t not in staged.get(pos, ()):
                _fail("coverage", f"weight {t} ({graph.tensors[t].name}) read by op {op.index} is neither "
                                  "resident nor staged for it")
    scratch = {e.tensor: e for e in plan.scratch}
    kv = {t for t, _ in plan.kv.tensors}
    for t, (first, last) in graph.lifetimes().items():
        if graph.tensors[t].kind == "kv":
            if t not in kv:
                _fail("coverage", f"KV tensor {t} ({graph.tensors[t].name}) is not in the resident KV region")
            continue
        e = scratch.get(t)
        if e is None or e.first > first or e.last < last or e.size < graph.tensors[t].nbytes:
            _fail("coverage", f"tensor {t} ({graph.tensors[t].name}) live over ops {first}..{last} has no "
                              "scratch range covering it")


def _blocks(plan: Any, graph: StepGraph) -> list[tuple[int, int, int, int, Any, str]]:
    """(start, end, first, last, allocation key, label) of every placed range."""
    whole = len(graph.ops) - 1
    out = []
    for region in (plan.kv, *plan.resident):
        for t, offset in region.tensors:
            buffer = graph.tensors[t].buffer
            out.append((offset, offset + graph.tensors[t].nbytes, 0, whole, ("buf", buffer) if buffer >= 0 else t,
                        f"tensor {t}"))
    for e in plan.scratch:
        out.append((e.offset, e.offset + e.size, e.first, e.last, e.tensor, f"tensor {e.tensor}"))
    for i, offset in enumerate(plan.slots):
        out.append((offset, offset + plan.slot_bytes, 0, whole, f"slot{i}", f"staging slot {i}"))
    return out


def _check_overlap(plan: Any, graph: StepGraph) -> None:
    blocks = sorted(_blocks(plan, graph), key=lambda b: (b[0], b[1]))
    active: list[tuple[int, int, int, int, Any, str]] = []
    for block in blocks:
        start, end, first, last, key, label = block
        active = [a for a in active if a[1] > start]
        for a in active:
            if a[4] != key and a[2] <= last and first <= a[3] and end > start:
                _fail("overlap", f"{a[5]} [{a[0]}, {a[1]}) and {label} [{start}, {end}) share addresses while "
                                 f"both live at op position {max(first, a[2])}")
        active.append(block)


def _check_slots(plan: Any) -> None:
    last_in_slot: dict[int, Any] = {}
    for k, item in enumerate(plan.staged):
        if item.seq != k or (k and item.op < plan.staged[k - 1].op):
            _fail("slot occupancy", f"staged chunk {k} is out of consumption order")
        if item.slot not in range(len(plan.slots)) or item.nbytes > plan.slot_bytes:
            _fail("slot size", f"staged chunk {k} ({item.nbytes} B) does not fit slot {item.slot} "
                               f"({plan.slot_bytes} B, {len(plan.slots)} slots)")
        if k and item.slot == plan.staged[k - 1].slot:
            _fail("slot alternation", f"staged chunks {k - 1} and {k} both use slot {item.slot}")
        if not item.prefetch_after < k:
            _fail("slot occupancy", f"staged chunk {k} is prefetched after chunk {item.prefetch_after}, "
                                    "not before its own use")
        prev = last_in_slot.get(item.slot)
        if prev is not None and item.prefetch_after < prev.seq:
            _fail("slot occupancy", f"staged chunk {k} is prefetched into slot {item.slot} while chunk "
                                    f"{prev.seq} still occupies it (until its op position {prev.op} runs)")
        last_in_slot[item.slot] = item

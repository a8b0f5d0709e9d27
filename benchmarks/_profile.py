"""The costliest kernels of a `jax.profiler` trace, shared by `gpu_step.py` (per compiled step)
and `gpu.py --profile` (per step of a whole decode)."""

from __future__ import annotations

import glob
import os
import re
from typing import Any

# What a kernel does, from its name (XLA:GPU's fusion names, cuBLAS's nvjet / cutlass kernels,
# cuDNN's attention; on a CPU, XLA's op names, its dots in YNNPACK / XNNPACK fusions), first
# match wins: where a step's time goes besides the GEMMs that read the weights. "gemm" holds every matrix product XLA emits as one,
# the split attention's score and value products among them; "attention" is a fused kernel's
# (cuDNN's, or dlm-jax's Pallas attention kernel: a Triton custom call in the HLO,
# `dlm_jax_attention` on the device; its grouped quantized GEMM, `dlm_jax_grouped_matmul`, is a
# "gemm", by its name in the HLO's metadata, `hlo_kernels`).
KINDS = (("attention", re.compile(r"fmha|flash|sdpa|cudnn|attention|pallas_call|xla\.gpu\.triton", re.I)),
         ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|onednn|ynn_fusion|xnn_fusion|"
                             r"\bdot|_dot|^dot", re.I)),
         ("data movement", re.compile(r"scatter|gather|copy|memcpy|memset|dynamic[-_]update[-_]slice|"
                                      r"dynamic[-_]slice|concatenate|transpose", re.I)))


def kernel_kind(name: str) -> str:
    """`KINDS`' name for a kernel, else "other" (elementwise and reduction fusions: norms,
    RoPE, softmax, activations)."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def top_kernels(trace_dir: str, steps: int, n: int = 10) -> dict[str, Any]:
    """The `n` costliest device kernels of a profile (`jax.profiler` trace in `trace_dir`) over
    `steps` steps: name, calls and ms per step, share of all kernel time. A trace without a
    device plane (a CPU backend) counts the host's XLA ops instead (`source` says which)."""
    from jax.profiler import ProfileData

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {"error": "no profile written"}
    data = ProfileData.from_file(paths[0])
    totals: dict[str, list[float]] = {}
    device = [p for p in data.planes if p.name.startswith("/device:")]
    for plane in device or [p for p in data.planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if device and not line.name.startswith("Stream"):
                continue  # "XLA Modules" / "XLA Ops" lines repeat the kernels' time
            for ev in line.events:
                stats = dict(ev.stats)
                if not device and "hlo_op" not in stats:
                    continue
                t = totals.setdefault(ev.name, [0.0, 0])
                t[0] += ev.duration_ns
                t[1] += 1
    whole = sum(t for t, _ in totals.values())
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    kinds: dict[str, float] = {}
    for name, (t, _) in totals.items():
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + t
    return {"kernel_ms_per_step": whole / 1e6 / steps, "source": "device" if device else "host CPU ops",
            "kernels": len(totals),
            "kinds": [{"kind": k, "ms_per_step": t / 1e6 / steps, "share": t / whole if whole else None}
                      for k, t in sorted(kinds.items(), key=lambda kv: -kv[1])],
            "top": [{"kernel": k[:160], "ms_per_step": t / 1e6 / steps, "calls_per_step": c / steps,
                     "share": t / whole if whole else None} for k, (t, c) in top]}


def kernel_table(profile: dict[str, Any]) -> list[str]:
    """A profile's costliest kernels (`top_kernels`'s "top") as markdown table lines, then all
    its kernels' time by kind (a profile that has it)."""
    lines = ["| kernel | ms / step | calls / step | share |", "|---|---:|---:|---:|"] + [
        f"| `{k['kernel'][:90]}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.1f} | "
        f"{'-' if k['share'] is None else format(k['share'], '.1%')} |" for k in profile["top"]]
    if profile.get("kinds"):
        lines += ["", f"All {profile['kernels']} kernels by kind: " + ", ".join(
            f"{k['kind']} {k['ms_per_step']:.3f} ms ({'-' if k['share'] is None else format(k['share'], '.1%')})"
            for k in profile["kinds"]) + "."]
    return lines


# An optimized HLO module's text (`Compiled.as_text()`): the kernels one execution launches.
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([\w-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"body=%?([\w.-]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}"
                       r"|true_computation=%?([\w.-]+), false_computation=%?([\w.-]+))")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_GEMM = re.compile(r'"kind":"__triton_(nested_)?gemm_fusion"|__cublas|__cudnn\$?matmul|dlm_jax_grouped_matmul')
_CALLS = re.compile(r"calls=%?([\w.-]+)")
_NAME = re.compile(r"%[\w.-]+")
_DETAILS = re.compile(r", (metadata|backend_config|frontend_attributes)=.*$")
# Ops that launch nothing themselves: buffers, views, control flow (a loop's body is counted
# as often as it runs, where XLA knows its trip count).
_NO_KERNEL = frozenset({"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "while", "conditional",
                        "call", "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id"})


def _array_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        bits = 8 if dtype == "pred" else 16 if dtype == "bf16" else 8 if dtype.startswith("f8") else int(dtype[1:])
        total += (n * bits + 7) // 8  # (s4 / u4: two a byte, as XLA:GPU packs them)
    return total


def _elements(shape: str) -> list[str]:
    """A tuple shape's top-level elements (`(a, (b, c), d)` -> `a`, `(b, c)`, `d`)."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(shape[start:i].strip())
            start = i + 1
    return parts + [shape[start:-1].strip()]


def hlo_kernels(text: str) -> dict[str, Any]:
    """The kernels one execution of a compiled program launches, read from its optimized HLO
    (`Compiled.as_text()`), the entry computation's ops and each loop body's times its known
    trip count: how many in all and by kind (`kernel_kind` of the fusion's name, a custom
    call's target), and the bytes each kind writes (its outputs' sizes), the largest outputs
    apart; and how many of the GEMMs are distinct (`distinct_gemms`: fusions whose bodies
    differ beyond their names, which XLA:GPU's autotuner tunes one by one, where identical
    ones share one tuning). A compile-only view of the step's launches, for a GPU this machine
    lacks (`gpu_step.py --target`); a device profile counts the kernels that ran. A conditional
    counts as its costliest branch (by the bytes it writes): one branch runs, which one is the
    data's choice (an MoE layer's expert forms, `dispatch_experts`), so the count is a step's
    most.

    An asynchronous pair is one kernel: an `async-start` counts as the op it wraps (its called
    computation's root: a scanned step's slice of a layer's weights out of the stack, for one),
    and a `fusion-start` (the same pair as `Compiled.as_text()` prints it) as its fused
    computation, each writing that op's output, not the start's tuple, which also holds the
    operands it passes through; a `copy-start` writes its destination; `-done` ops launch
    nothing."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            current = comps.setdefault(m.group(2), [])
            if m.group(1):
                entry = m.group(2)
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append(m.groups())
    gemms: set[tuple] = set()

    def signature(op: str, shape: str, rest: str) -> tuple:
        """A GEMM as the autotuner tells GEMMs apart: its fusion's body (or the call itself),
        names and metadata left out."""
        called = _CALLS.search(rest)
        body = comps.get(called.group(1), []) if op == "fusion" and called else []
        return (shape, op, _NAME.sub("%", _DETAILS.sub("", rest)) if not body else "",
                tuple((s, o, _NAME.sub("%", _DETAILS.sub("", r))) for _, s, o, r in body))

    def visit(name: str, times: int, kinds: dict[str, list[int]], largest: list, depth: int = 0) -> None:
        for inst, shape, op, rest in comps.get(name, []):
            if op == "while" and depth < 8:
                body = _BODY.search(rest)
                trips = _TRIPS.search(rest)
                if body:
                    visit(body.group(1), times * (int(trips.group(1)) if trips else 1), kinds, largest, depth + 1)
                continue
            if op == "conditional" and depth < 8 and (found := _BRANCHES.search(rest)):
                names = [b.strip().lstrip("%") for b in found.group(1).split(",")] if found.group(1) else \
                    [found.group(2), found.group(3)]
                branches = []
                for branch in names:
                    sub: tuple[dict[str, list[int]], list] = ({}, [])
                    visit(branch, times, *sub, depth + 1)
                    branches.append((sum(b for _, b in sub[0].values()), sub))
                _, (sub_kinds, sub_largest) = max(branches, key=lambda b: b[0])
                for kind, (c, b) in sub_kinds.items():
                    count = kinds.setdefault(kind, [0, 0])
                    count[0] += c
                    count[1] += b
                largest.extend(sub_largest)
                continue
            if op in _NO_KERNEL or op.endswith("-done"):
                continue
            called = _CALLS.search(rest)
            if op == "async-start" and called and comps.get(called.group(1)):
                inst, shape, op, rest = comps[called.group(1)][-1]  # (the root: what it runs, what it writes)
            elif op == "fusion-start" and called:  # (the same, as `Compiled.as_text()` prints it)
                inst, shape, op = called.group(1), _elements(shape)[1], "fusion"  # ((operands), output, context)
            elif op == "copy-start":
                shape = _elements(shape)[0]  # (destination, source, context)
            target = _TARGET.search(rest)
            label = target.group(1) if target else inst
            kind = "gemm" if _GEMM.search(rest) else kernel_kind(label if op in ("fusion", "custom-call") else op)
            if kind == "gemm":
                gemms.add(signature(op, shape, rest))
            size = _array_bytes(shape)
            count = kinds.setdefault(kind, [0, 0])
            count[0] += times
            count[1] += times * size
            largest.append((size, label, shape[:80]))

    kinds: dict[str, list[int]] = {}
    largest: list[tuple[int, str, str]] = []
    if entry is not None:
        visit(entry, 1, kinds, largest)
    largest.sort(reverse=True)
    return {"kernels": sum(c for c, _ in kinds.values()), "distinct_gemms": len(gemms),
            "by_kind": {k: {"kernels": c, "bytes_written": b} for k, (c, b) in sorted(kinds.items())},
            "largest_outputs": [{"bytes": s, "kernel": n, "shape": sh} for s, n, sh in largest[:5]]}

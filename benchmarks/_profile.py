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
# (cuDNN's).
KINDS = (("attention", re.compile(r"fmha|flash|sdpa|cudnn|attention", re.I)),
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

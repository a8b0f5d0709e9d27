"""The costliest kernels of a `jax.profiler` trace, shared by `gpu_step.py` (per compiled step)
and `gpu.py --profile` (per step of a whole decode)."""

from __future__ import annotations

import glob
import os
from typing import Any


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
    return {"kernel_ms_per_step": whole / 1e6 / steps, "source": "device" if device else "host CPU ops",
            "top": [{"kernel": k[:160], "ms_per_step": t / 1e6 / steps, "calls_per_step": c / steps,
                     "share": t / whole if whole else None} for k, (t, c) in top]}


def kernel_table(profile: dict[str, Any]) -> list[str]:
    """A profile's costliest kernels (`top_kernels`'s "top") as markdown table lines."""
    return ["| kernel | ms / step | calls / step | share |", "|---|---:|---:|---:|"] + [
        f"| `{k['kernel'][:90]}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.1f} | "
        f"{'-' if k['share'] is None else format(k['share'], '.1%')} |" for k in profile["top"]]

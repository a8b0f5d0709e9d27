"""This CPU's limits, measured in the run that uses them: fp32 GEMM throughput and memory
bandwidth (both noisy on a shared machine: each is the best of several repeats); and
`warm_page_cache`, so that load timings start from files in memory."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_peak(n: int = 1024, repeats: int = 20, threads: int = 2) -> dict[str, Any]:
    """fp32 [n, n] x [n, n] GFLOP/s with NumPy's BLAS and, when installed, PyTorch's (MKL or
    oneDNN); `gflops` is the faster, the limit the steps are held against."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    flops = 2 * n**3
    out: dict[str, Any] = {"n": n, "numpy_gflops": round(flops / _best(lambda: a @ b, repeats) / 1e9, 1)}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(threads)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        with torch.inference_mode():
            out["torch_gflops"] = round(flops / _best(lambda: ta @ tb, repeats) / 1e9, 1)
    out["gflops"] = max(v for k, v in out.items() if k.endswith("_gflops"))
    return out


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> dict[str, Any]:
    """GB/s of a large NumPy copy (bytes read + bytes written)."""
    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    return {"mib": mib, "copy_gbps": round(2 * src.nbytes / _best(lambda: np.copyto(dst, src), repeats) / 1e9, 2)}


def machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "python": platform.python_version()}


def warm_page_cache(path: Path, pattern: str = "*") -> int:
    """Read every file of `path` matching `pattern` once; returns the bytes read."""
    total = 0
    for file in sorted(path.glob(pattern)):
        if file.is_file():
            with open(file, "rb") as f:
                while chunk := f.read(64 << 20):
                    total += len(chunk)
    return total

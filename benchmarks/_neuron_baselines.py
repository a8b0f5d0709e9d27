"""The PowerInfer-2 benchmark's baselines for the cold FFN of a sparse bundle (exported with no
hot neurons, so every neuron is cold), under the same memory budget as the neuron engine.

- LLMFlash-like (`MatrixReader`): each needed neuron is loaded on demand from the FFN stored
  as plain matrices (gate, up, down^T, row-major): one read per matrix and run of consecutive
  neurons (no bundling: a neuron costs three reads), synchronously (no pipelining), kept in
  the same LRU neuron cache.
- llama.cpp-like (`MmapColdPath`): the dense FFN computed from a memory-mapped weight file; the
  budget is what stays in the page cache: after each layer the pages beyond the budget's share
  of that layer are dropped (`madvise` + `posix_fadvise` DONTNEED), so the next step faults
  them back in from the disk, as mmap does when the weights do not fit.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np

from dlm_jax.techniques.powerinfer.flash import read_all
from dlm_jax.techniques.powerinfer.flash_io import NeuronBundles, _runs

ALIGN = 4096


def write_matrices(flash_path, out: Path) -> dict:
    """The flash file's FFN as one file of plain matrices: per layer gate [F, D] (relu: none),
    up [F, D], down^T [F, D], float32 row-major, each matrix starting on a 4 KiB boundary.
    Returns the layout {(layer, part): offset} plus shapes."""
    layers = read_all(flash_path)
    layout, offset = {}, 0
    with open(out, "wb") as f:
        for i, layer in enumerate(layers):
            for part in ("gate", "up", "down"):
                if part not in layer or layer[part] is None:
                    continue
                m = np.ascontiguousarray(layer[part].T if part == "down" else layer[part], np.float32)
                layout[(i, part)] = offset
                f.write(m.tobytes())
                offset += m.nbytes
                pad = -offset % ALIGN
                f.write(b"\0" * pad)
                offset += pad
    d = layers[0]["up"].shape[1]
    return {"layout": layout, "d_model": d, "neurons": [layer["up"].shape[0] for layer in layers],
            "parts": [p for p in ("gate", "up", "down") if layers[0].get(p) is not None]}


class MatrixReader:
    """`read(layer, neurons)` like `FlashReader`'s, from `write_matrices`' file with O_DIRECT:
    per matrix, one aligned read per run of consecutive neurons."""

    def __init__(self, path: Path, info: dict):
        self.path = path
        self.info = info
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        self.bytes_read = 0
        self.requests = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        os.close(self.fd)

    def _rows(self, offset: int, first: int, count: int, row_bytes: int) -> np.ndarray:
        start = offset + first * row_bytes
        lo, hi = start // ALIGN * ALIGN, -(-(start + count * row_bytes) // ALIGN) * ALIGN
        buf = mmap.mmap(-1, hi - lo)
        os.preadv(self.fd, [buf], lo)
        with self._lock:
            self.bytes_read += hi - lo
            self.requests += 1
        rows = np.frombuffer(buf, np.float32, count * row_bytes // 4, start - lo).reshape(count, -1).copy()
        buf.close()
        return rows

    def read(self, layer: int, neurons) -> NeuronBundles:
        ids = np.asarray(neurons, np.int64)
        d = self.info["d_model"]
        row = d * 4
        order = np.argsort(ids)
        sorted_ids = ids[order]
        before = (self.bytes_read, self.requests)
        parts = {}
        for part in self.info["parts"]:
            got = np.concatenate([self._rows(self.info["layout"][(layer, part)], first, count, row)
                                  for first, count in _runs(sorted_ids)])
            back = np.empty_like(got)
            back[order] = got
            parts[part] = back
        return NeuronBundles(layer=layer, neurons=ids, gate=parts.get("gate"), up=parts["up"], down=parts["down"].T,
                             bytes_read=self.bytes_read - before[0], requests=self.requests - before[1])


class MmapColdPath:
    """The dense FFN of every layer from a memory-mapped `write_matrices` file, keeping
    `fraction` of each layer's pages resident (see the module docstring). Same call as
    `ColdPath`: the FFN output [N, D] of the FFN inputs `x` [N, D]."""

    def __init__(self, path: Path, info: dict, fraction: float):
        self.info = info
        self.fraction = fraction
        self.fd = os.open(path, os.O_RDONLY)
        self.map = mmap.mmap(self.fd, 0, prot=mmap.PROT_READ)
        self.counters = type("Counters", (), {"to_dict": lambda s: {}})()
        d = info["d_model"]
        self.views = {}
        for (layer, part), offset in info["layout"].items():
            f = info["neurons"][layer]
            self.views[(layer, part)] = np.frombuffer(self.map, np.float32, f * d, offset).reshape(f, d)

    def close(self) -> None:
        self.views.clear()
        self.map.close()
        os.close(self.fd)

    def _drop(self, layer: int) -> None:
        d = self.info["d_model"]
        for part in self.info["parts"]:
            offset = self.info["layout"][(layer, part)]
            size = self.info["neurons"][layer] * d * 4
            keep = int(size * self.fraction) // mmap.PAGESIZE * mmap.PAGESIZE
            lo = -(-(offset + keep) // mmap.PAGESIZE) * mmap.PAGESIZE
            hi = -(-(offset + size) // mmap.PAGESIZE) * mmap.PAGESIZE
            if hi > lo:
                self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                os.posix_fadvise(self.fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def __call__(self, layer: int, window: int, x: np.ndarray) -> np.ndarray:
        up = x @ self.views[(layer, "up")].T
        gate = self.views.get((layer, "gate"))
        act = np.maximum(up, 0) if gate is None else np.maximum(x @ gate.T, 0) * up
        y = act @ self.views[(layer, "down")]
        self._drop(layer)
        return y


def process_read_bytes() -> int:
    """Bytes this process has caused to be fetched from storage (`/proc/self/io` read_bytes:
    page-cache misses, mmap faults and O_DIRECT reads alike); -1 where it is not available."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1

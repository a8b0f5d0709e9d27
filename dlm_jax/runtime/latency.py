"""Latency tables: median step latency per bucket, as JSON and as a plot (NumPy only).

The table is what schedulers consult to price a window (llada.cpp's adaptive lookahead): the
cost of a step is stepwise in the bucket size, not linear in the live token count.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlm_jax._errors import CheckpointError
from dlm_jax._integrity import atomic_write, atomic_write_json, manifest_name, verify_manifest, write_manifest


@dataclasses.dataclass(frozen=True)
class LatencyEntry:
    window: int
    cache: int
    batch: int
    rows: int
    median_ms: float
    p10_ms: float
    p90_ms: float


@dataclasses.dataclass
class LatencyTable:
    device: str
    model: dict[str, Any]
    entries: list[LatencyEntry]

    def lookup(self, window: int, cache: int = 0, batch: int = 1) -> float:
        """Median ms of the smallest profiled bucket that holds (window, cache, batch); a
        table profiled at one cache size only (a cost model) prices every cache with it."""
        if len({e.cache for e in self.entries}) == 1:
            cache = 0
        fits = [e for e in self.entries if e.window >= window and e.cache >= cache and e.batch >= batch]
        if not fits:
            raise KeyError(f"no profiled bucket holds window={window}, cache={cache}, batch={batch}")
        return min(fits, key=lambda e: (e.window, e.cache, e.batch)).median_ms

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "model": self.model,
                "entries": [dataclasses.asdict(e) for e in self.entries]}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table as JSON (atomically) with its manifest, `<stem>.manifest.json`."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, self.to_dict())
        write_manifest(path.parent, [path.name], name=manifest_name(path))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, verify: bool = True) -> LatencyTable:
        """Read a table; with `verify`, check it against its manifest when it has one."""
        path = Path(path)
        if verify and path.exists():
            verify_manifest(path.parent, name=manifest_name(path), files=[path.name])
        try:
            data = json.loads(Path(path).read_text())
            return cls(data["device"], data["model"], [LatencyEntry(**e) for e in data["entries"]])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: not a latency table ({e})") from None

    def plot(self, path: str | os.PathLike) -> Path:
        """PNG of median latency against window bucket, one line per cache bucket."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for cache in sorted({e.cache for e in self.entries}):
            pts = sorted((e.window, e.median_ms, e.p10_ms, e.p90_ms) for e in self.entries if e.cache == cache)
            w, med, lo, hi = zip(*pts)
            ax.step(w, med, where="pre", marker="o", label=f"cache {cache}")
            ax.fill_between(w, lo, hi, step="pre", alpha=0.2)
        ax.set_xlabel("window bucket (tokens)")
        ax.set_ylabel("median step latency (ms)")
        ax.set_title(f"decode step latency per bucket ({self.device})")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(path)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        plt.close(fig)
        return atomic_write(path, png.getvalue())


@dataclasses.dataclass(frozen=True)
class PhoneCostModel:
    """A decode step's latency on a phone, from published device figures (a plausibility
    model for pricing decode traces, not a measurement):

        t(W) = fixed + max(weight_bytes / bandwidth, ceil_tile(W) * flop_factor / throughput)

    memory-bound (streaming the weights once) up to about one tile, then stepwise in `tile`
    token tiles. Defaults: an 8B Q4_0 model (4.5 bits per weight) on a Snapdragon 8 Gen 3
    NPU: 56 GB/s DRAM bandwidth during matmul and 770 tokens/s of dense INT4 prefill
    (PowerInfer-2 §2.3.1), 32-token HMX tiles (llada.cpp §2.2). `cpu()` gives the same
    phone's CPU (43.9 GB/s, 8 tokens/s). Every parameter is data: pass others to model
    another device."""

    name: str = "npu"
    weight_bytes: float = 4.5e9
    bandwidth: float = 56e9  # bytes/s
    throughput: float = 770.0  # tokens/s, dense prefill
    tile: int = 32
    flop_factor: float = 8 / 7  # the prefill figure's tokens per tile-slot
    fixed_ms: float = 0.0

    @classmethod
    def npu(cls, **changes: Any) -> PhoneCostModel:
        return cls(**changes)

    @classmethod
    def cpu(cls, **changes: Any) -> PhoneCostModel:
        return cls(**{"name": "cpu", "bandwidth": 43.9e9, "throughput": 8.0, **changes})

    def step_ms(self, window: int) -> float:
        """Latency (ms) of one step over `window` query tokens."""
        tiles = -(-max(int(window), 1) // self.tile) * self.tile
        return self.fixed_ms + 1e3 * max(self.weight_bytes / self.bandwidth, tiles * self.flop_factor / self.throughput)

    def table(self, windows: Sequence[int]) -> LatencyTable:
        """The model as a `LatencyTable` over these window sizes (cache 0, batch 1)."""
        entries = [LatencyEntry(int(w), 0, 1, int(w), *(3 * [self.step_ms(w)])) for w in sorted(set(windows))]
        return LatencyTable(f"phone cost model ({self.name})", dataclasses.asdict(self), entries)

"""Phone-scale prices for ops and staging transfers, used to plan and simulate the NPU-visible
memory of a step (the papers' own numbers where they exist, our choices where they don't; each
parameter below says which).

An NPU op costs `op_overhead + max(FLOPs(32-token tiles) / throughput, bytes / bandwidth)`:
stepwise in 32-row tiles, memory-bound at small windows (an 8B Q4_0 step lands near the
~80 ms that `dlm_jax.runtime.latency.PhoneCostModel`, our model derived from the same figures,
gives at W <= 32). A staging transfer of one payload into an NPU-visible slot costs
`map_cost + bytes * map_cost_per_mb / MB + bytes / staging_bandwidth`. Every parameter is
explicit; none of those marked as our choice is a paper number.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlm_jax.lowering.graph import Op, StepGraph, op_flops

MB = 2 ** 20
VIEW_OPS = frozenset({"SLICE", "STRIDED_SLICE", "GATHER", "GATHER_ND"})  # read only what they write


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Attributes:
      npu_flops_per_s: dense NPU throughput; default 770 tok/s of dense 7B INT4 prefill
        (PowerInfer-2 §2.3.1) x 2 FLOPs per parameter x 7e9 parameters (our arithmetic).
      npu_bandwidth: DRAM bandwidth during NPU matmuls, 56 GB/s (PowerInfer-2 §2.3.1).
      staging_bandwidth: host copy of a payload into a staging slot: the CPU-only DRAM
        bandwidth 43.9 GB/s (PowerInfer-2 §2.3.1) halved for read + write (our choice).
      map_cost_s: fixed cost to prepare a buffer descriptor and validate its NPU VA mapping,
        per transfer (our choice: llada.cpp §2.3 names the cost, gives no number).
      map_cost_per_mb_s: mapping cost per MB (2**20 bytes) on top (our choice).
      op_overhead_s: fixed launch cost per NPU op (our choice).
      tile: NPU matmul row tile (HMX 32x32, llada.cpp §2.2).
    """

    npu_flops_per_s: float = 2 * 7e9 * 770
    npu_bandwidth: float = 56e9
    staging_bandwidth: float = 43.9e9 / 2
    map_cost_s: float = 200e-6
    map_cost_per_mb_s: float = 0.0
    op_overhead_s: float = 0.0
    tile: int = 32

    def __post_init__(self) -> None:
        for name in ("npu_flops_per_s", "npu_bandwidth", "staging_bandwidth", "tile"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CostModel.{name}={getattr(self, name)} must be > 0")
        for name in ("map_cost_s", "map_cost_per_mb_s", "op_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name}={getattr(self, name)} must be >= 0")

    def op_bytes(self, graph: StepGraph, op: Op) -> int:
        """Bytes an op moves: its weights plus its activations in and out (a view op reads
        only the part it writes)."""
        outs = sum(graph.tensors[t].nbytes for t in op.outputs)
        if op.opcode in VIEW_OPS:
            return 2 * outs
        weights = graph.weight_bytes(graph.weights(op))
        ins = sum(graph.tensors[t].nbytes for t in dict.fromkeys(op.inputs) if graph.tensors[t].kind != "weight")
        return weights + ins + outs

    def exec_time(self, graph: StepGraph, op: Op) -> float:
        """Seconds the NPU spends on `op`."""
        compute = op_flops(graph, op, tile=self.tile) / self.npu_flops_per_s
        return self.op_overhead_s + max(compute, self.op_bytes(graph, op) / self.npu_bandwidth)

    def transfer_time(self, nbytes: int) -> float:
        """Seconds to stage `nbytes` into a slot (one mapping)."""
        if nbytes <= 0:
            return 0.0
        return self.map_cost_s + nbytes / MB * self.map_cost_per_mb_s + nbytes / self.staging_bandwidth

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        return cls(**data)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UfsModel:
    """UFS 4.0 read time (our model of PowerInfer-2's figures):
    `read_seconds(size, pattern, range_bytes, core)` = request / BW, the request at least 4 KB,
    BW log-linearly interpolated in the request size between the quoted points (clamped outside
    them): sequential 450 MB/s at 4 KB to 4 GB/s at 512 KB; random 3.5 GB/s at 512 KB, and at
    4 KB 1 GB/s within a 128 MB range falling to 850 MB/s within 512 MB (log-linear in the range
    between) or, per issuing core at 128 MB, big 1,076.10 / mid 1,007.95 / little 761.87 MB/s
    (PowerInfer-2 §2.3.2, Tab 1, Fig 3b). One command queue: reads serialize (`serial_seconds`)."""

    min_request: int = 4096
    seq_4k: float = 450e6
    seq_512k: float = 4e9
    rand_512k: float = 3.5e9
    rand_4k_128mb: float = 1e9
    rand_4k_512mb: float = 850e6
    rand_4k_core: tuple[tuple[str, float], ...] = (("big", 1076.10e6), ("mid", 1007.95e6), ("little", 761.87e6))

    def bandwidth(self, size: int, pattern: str = "random", range_bytes: int = 128 * MB, core: str | None = None) -> float:
        import math

        if pattern not in ("random", "sequential"):
            raise ValueError(f"pattern={pattern!r} is not random or sequential")
        request = max(int(size), self.min_request)
        if pattern == "sequential":
            lo, hi = self.seq_4k, self.seq_512k
        else:
            hi = self.rand_512k
            if core is not None:
                cores = dict(self.rand_4k_core)
                if core not in cores:
                    raise ValueError(f"core={core!r} is not one of {sorted(cores)}")
                lo = cores[core]
            else:
                t = min(1.0, max(0.0, math.log(max(range_bytes, 128 * MB) / (128 * MB)) / math.log(4)))
                lo = _log_lerp(self.rand_4k_128mb, self.rand_4k_512mb, t)
        t = min(1.0, max(0.0, math.log(request / 4096) / math.log(512 / 4)))
        return _log_lerp(lo, hi, t)

    def read_seconds(self, size: int, pattern: str = "random", range_bytes: int = 128 * MB,
                     core: str | None = None) -> float:
        request = max(int(size), self.min_request)
        return request / self.bandwidth(request, pattern, range_bytes, core)

    def serial_seconds(self, sizes, pattern: str = "random", range_bytes: int = 128 * MB) -> float:
        """Reads through the one command queue: their times add up."""
        return sum(self.read_seconds(s, pattern, range_bytes) for s in sizes)


def _log_lerp(lo: float, hi: float, t: float) -> float:
    """exp((1 - t) log lo + t log hi), exactly `lo` and `hi` at the ends."""
    import math

    return lo if t <= 0 else hi if t >= 1 else math.exp((1 - t) * math.log(lo) + t * math.log(hi))

"""Phone-scale prices for ops and staging transfers, used to plan and simulate the NPU-visible
memory of a step (SPECS 0.4: the papers' own numbers where they exist, [S] where they don't).

An NPU op costs `op_overhead + max(FLOPs(32-token tiles) / throughput, bytes / bandwidth)`:
stepwise in 32-row tiles, memory-bound at small windows (an 8B Q4_0 step lands near the
~80 ms of the [R] model at W <= 32). A staging transfer of one payload into an NPU-visible
slot costs `map_cost + bytes * map_cost_per_mb / MB + bytes / staging_bandwidth`. Every
parameter is explicit; none of the [S] ones is a paper number.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowering.graph import Op, StepGraph, op_flops

MB = 2 ** 20
VIEW_OPS = frozenset({"SLICE", "STRIDED_SLICE", "GATHER", "GATHER_ND"})  # read only what they write


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Attributes:
      npu_flops_per_s: dense NPU throughput; default 770 tok/s of dense 7B INT4 prefill
        [P PowerInfer-2 §2.3.1] x 2 FLOPs per parameter x 7e9 parameters [R].
      npu_bandwidth: DRAM bandwidth during NPU matmuls, 56 GB/s [P PowerInfer-2 §2.3.1].
      staging_bandwidth: host copy of a payload into a staging slot: the CPU-only DRAM
        bandwidth 43.9 GB/s [P PowerInfer-2 §2.3.1] halved for read + write [S].
      map_cost_s: fixed cost to prepare a buffer descriptor and validate its NPU VA mapping,
        per transfer [S] (llada.cpp names the cost, gives no number).
      map_cost_per_mb_s: mapping cost per MB (2**20 bytes) on top [S].
      op_overhead_s: fixed launch cost per NPU op [S].
      tile: NPU matmul row tile (HMX 32x32 [P llada.cpp §2.2]).
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

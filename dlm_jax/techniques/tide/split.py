"""Split expert execution (TIDE): a split MoE layer's compiled step computes its resident
experts from S expert slots and hands the other assignments (misses) to a NumPy CPU path,
whose result is added at the layer's output.

`split_experts` turns chosen MoE layers of a model into that form, in place: their routed
expert weights become S-slot buffers (the parameters the compiled step holds), an
`ExpertSlotMap` [E] gives each expert's slot (-1: not resident) and a `CpuExperts` keeps every
expert's weights on the host and computes the misses (a `jax.pure_callback`: the step calls
it between its ops, on the host, where XLA runs it beside the slots' work, which does not
depend on it). The executor that holds the slots moves experts in and out between steps
(`JaxExecutor.place`) as the placement policy decides. Tokens are those of the unsplit model
up to float summation order: placement decides where an assignment runs, never which.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlm_jax._errors import ConfigError
from dlm_jax.models._transformer import ExpertSlotMap, MoEFFN, Transformer


class CpuExperts:
    """Every routed expert of one layer on the host ([E, D, F] gate / up, [E, F, D] down,
    float32) and the CPU path over them. Counts what it computed (`calls`, `assignments`)."""

    def __init__(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray):
        self.gate, self.up, self.down = (np.asarray(w, np.float32) for w in (gate, up, down))
        self.calls = 0
        self.assignments = 0

    @property
    def expert_bytes(self) -> int:
        """One expert's weights as the slots hold them (float32)."""
        return self.gate[0].nbytes + self.up[0].nbytes + self.down[0].nbytes

    def __call__(self, x: np.ndarray, experts: np.ndarray, weights: np.ndarray, missed: np.ndarray) -> np.ndarray:
        """[N, D] in x's dtype (the dtype the step's callback declares): the sum over each
        row's missed assignments of weight x expert(row), computed in float32."""
        dtype = np.asarray(x).dtype
        x = np.asarray(x, np.float32)
        out = np.zeros_like(x)
        rows, cols = np.nonzero(np.asarray(missed))
        ids = np.asarray(experts)[rows, cols]
        w = np.asarray(weights, np.float32)[rows, cols]
        for e in np.unique(ids):
            pick = ids == e
            r = rows[pick]
            g = x[r] @ self.gate[e]
            h = (g / (1.0 + np.exp(-g))) * (x[r] @ self.up[e])
            np.add.at(out, r, w[pick, None] * (h @ self.down[e]))
        self.calls += 1
        self.assignments += len(rows)
        return out.astype(dtype)


def split_experts(model: Transformer, layers: Sequence[int], slots: int,
                  initial: np.ndarray | None = None) -> dict[int, CpuExperts]:
    """Split the MoE layers `layers` of `model` in place, `slots` resident experts each (at
    first experts 0..S-1, or `initial` [len(layers), S]); returns each layer's `CpuExperts`."""
    cfg = model.config
    if not 1 <= slots <= cfg.n_experts:
        raise ConfigError(f"slots={slots} must be in [1, {cfg.n_experts}]")
    from dlm_jax.models._scan import StackedLayers

    if isinstance(model.layers, StackedLayers):  # (its blocks are rebuilt per call: the split would be lost)
        raise ConfigError("split expert execution of a model whose layers are stacked for a scan (layers='scan') is "
                          "not supported: split before building its executor, or use layers='unrolled'")
    if getattr(model, "quant", None) is not None:
        raise ConfigError(f"split expert execution of a model weight-only quantized (quant={model.quant!r}) is not "
                          f"supported: its CPU path computes over float weights; split a model loaded without quant")
    out = {}
    for j, i in enumerate(layers):
        if not (0 <= i < cfg.n_layers and cfg.is_moe_layer(i)):
            raise ConfigError(f"layer {i} is not an MoE layer of this model")
        ffn: MoEFFN = model.layers[i].ffn
        if ffn.slot_of is not None:
            raise ConfigError(f"layer {i} is already split")
        cpu = CpuExperts(ffn.gate[...], ffn.up[...], ffn.down[...])
        resident = np.arange(slots) if initial is None else np.asarray(initial[j])
        slot_of = np.full(cfg.n_experts, -1, np.int32)
        slot_of[resident] = np.arange(slots, dtype=np.int32)
        dtype = ffn.gate[...].dtype
        ffn.gate, ffn.up, ffn.down = (nnx.Param(jnp.asarray(w[resident], dtype)) for w in (cpu.gate, cpu.up, cpu.down))
        ffn.slot_of = ExpertSlotMap(jnp.asarray(slot_of))
        ffn.cpu_experts = cpu
        out[i] = cpu
    return out

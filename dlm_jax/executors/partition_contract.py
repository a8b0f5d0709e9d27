"""The partitioned bundle's programs: what runs on the NPU, what on the CPU, and their tensors
(NumPy only; the exporter in `dlm_jax.tflite_export.partition` builds them, `dlm_jax.executors.partitioned`
runs them).

A decode step of bucket (B, W, P, R) is split as llada.cpp splits it (llada.cpp §2.2, §4):

- CPU, NumPy: the embedding lookup (a table read, no dense compute) and, between the layers
  of a sparse bundle, the cold FFN neurons (PowerInfer-2's CPU path over a neuron cache).
- NPU: the transformer body, tile-aligned: rows padded to a multiple of 32 (the HMX tile), the
  FFN width too (zero neurons). A dense bundle has one body program per (B, ceil32(W), P):
  every layer. A sparse bundle has one program per layer: attention, then the layer's hot
  neurons, which returns the FFN input for the CPU's cold neurons.
- CPU, LiteRT: the head over the requested rows (final norm, LM head, the top-2 / entropy
  tail), one program per (B, R), the rows gathered by the host.

The NPU programs are `model.tflite` (what an NPU compiler, e.g. the Qualcomm AOT target,
compiles), the CPU programs `cpu.tflite`.

Program names and tensors:

    npu_w{Wt}_p{P}[_b{B}]        hidden [B,Wt,D], positions [B,Wt], visibility [B,Wt,P+Wt],
                                 k_cache, v_cache [L,B,P,Hkv,Dh] (none when P == 0)
                                 -> hidden [B,Wt,D], k_new, v_new [L,B,Wt,Hkv,Dh]
    npu_l{i}_w{Wt}_p{P}[_b{B}]   the same inputs with layer i's cache [B,P,Hkv,Dh]
                                 -> hidden (residual + attention + hot FFN), ffn_in [B,Wt,D],
                                    k_new, v_new [B,Wt,Hkv,Dh]
    head_r{R}[_b{B}][_full]      rows [B,R,D] -> top_token, top_prob, second_prob, entropy [B,R]
                                 (+ logits [B,R,V] with _full)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.buckets import BucketKey

TILE = 32
PARTITION_VERSION = 1


def tiled(n: int) -> int:
    """`n` rounded up to the NPU tile (32)."""
    return -(-n // TILE) * TILE


def _suffix(batch: int) -> str:
    return "" if batch == 1 else f"_b{batch}"


def body_name(batch: int, window: int, cache: int, layer: int | None = None) -> str:
    """The NPU program of a tiled window (`layer`: one layer of a sparse bundle)."""
    part = "" if layer is None else f"_l{layer}"
    return f"npu{part}_w{window}_p{cache}{_suffix(batch)}"


def head_name(batch: int, rows: int, full_logits: bool) -> str:
    return f"head_r{rows}{_suffix(batch)}" + ("_full" if full_logits else "")


def body_inputs(config: ModelConfig, batch: int, window: int, cache: int,
                layer: int | None = None) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of a body program's inputs, in argument order."""
    b, w, p = batch, window, cache
    kv = (b, p, config.n_kv_heads, config.head_dim) if layer is not None else \
        (config.n_layers, b, p, config.n_kv_heads, config.head_dim)
    out = [("hidden", (b, w, config.d_model), config.dtype), ("positions", (b, w), "int32"),
           ("visibility", (b, w, p + w), "bool")]
    if p:
        out += [("k_cache", kv, config.dtype), ("v_cache", kv, config.dtype)]
    return out


def body_outputs(layer: int | None = None) -> list[str]:
    """A body program's outputs (`layer`: one layer of a sparse bundle)."""
    return ["hidden", "k_new", "v_new"] if layer is None else ["hidden", "ffn_in", "k_new", "v_new"]


def head_outputs(full_logits: bool) -> list[str]:
    return ["top_token", "top_prob", "second_prob", "entropy"] + (["logits"] if full_logits else [])


@dataclasses.dataclass(frozen=True)
class Programs:
    """The programs a set of decode buckets needs: body keys (B, Wt, P) and head keys (B, R, full)."""

    bodies: tuple[tuple[int, int, int], ...]
    heads: tuple[tuple[int, int, bool], ...]

    @classmethod
    def for_keys(cls, keys: list[BucketKey]) -> Programs:
        for k in keys:
            if k.router_topk or k.ffn_active:
                raise ConfigError(f"bucket {k}: a partitioned bundle returns neither routed experts nor neuron "
                                  "activity (export without --partition for those)")
        bodies = sorted({(k.batch, tiled(k.window), k.cache) for k in keys})
        heads = sorted({(k.batch, k.rows, k.full_logits) for k in keys})
        return cls(tuple(bodies), tuple(heads))


def check_partitionable(config: ModelConfig) -> None:
    """Refuse models whose residual width is not whole tiles (every supported family's is;
    zero-padding it would change RMSNorm's mean; the FFN width is padded, the attention
    projections are left to the NPU compiler), and MoE models (their partition is the expert
    split, not this one)."""
    if config.ffn == "moe":
        raise ConfigError("a partitioned bundle of an MoE model is not supported (its experts split by "
                          "`--expert-slots` instead)")
    if config.d_model % TILE:
        raise ConfigError(f"cannot partition a model whose d_model={config.d_model} is not a multiple of the "
                          f"{TILE}-wide NPU tile")


def describe(programs: Programs, config: ModelConfig, *, sparse: bool, extra: dict[str, Any] | None = None) -> dict:
    """`bundle.json`'s "partition" entry."""
    layers = list(range(config.n_layers)) if sparse else [None]
    return {"version": PARTITION_VERSION, "tile": TILE, "sparse": sparse,
            "npu": [body_name(b, w, p, i) for b, w, p in programs.bodies for i in layers],
            "cpu": [head_name(b, r, f) for b, r, f in programs.heads] + ["embedding (NumPy)"]
            + (["cold FFN neurons (NumPy)"] if sparse else []),
            **(extra or {})}

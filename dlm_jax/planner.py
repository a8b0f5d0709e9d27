"""What a checkpoint needs per device on a decode mesh, from its config alone (no weights loaded).

`plan(config, devices=8, memory_gib=80)` lists every mesh `MeshShape(tp, ep, dp)` of that many
devices that the model's heads and experts allow (`MeshShape.check`), each with its bytes per
device (`MeshPlan`), and picks one (`Plan.pick`); `check_fits` refuses a mesh before a checkpoint
loads. The figures follow the partition rules the JAX executor shards by
(`dlm_jax._partition`: `leaf_axes` for parameters, `cache_axes` for the K/V cache), so the
weight and K/V bytes are exact for that executor; activations are an estimate
(`activation_bytes_per_device`). `docs/mesh.md` describes the command, `dlm-jax plan`.

Axes: L layers, B batch rows, Hkv K/V heads, S cache slots, Dh head width, W window, V vocabulary.

Only `param_shapes` (the parameters' shapes from an abstract build of the model) imports JAX;
everything else here is arithmetic on the config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from dlm_jax._config import ModelConfig, act_order
from dlm_jax._errors import ConfigError
from dlm_jax._partition import (MESH_AXES, MeshShape, cache_axes, kv_heads_split, leaf_axes, logical_axes,
                                split_factor)

GIB = 2**30
FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# JAX preallocates this share of a GPU's memory for its arrays by default (overridden by
# $XLA_PYTHON_CLIENT_MEM_FRACTION); the rest is left to the runtime and other libraries.
DEFAULT_FRACTION = 0.75
WINDOW = 32  # one block of 32 positions: the window (and logit rows) of a step the estimate assumes
_LAYER = re.compile(r"^layers\.\d+\.")


def full_name(mesh: MeshShape) -> str:
    """`tp=1,ep=4,dp=2`: every axis, also those of size 1 (`str(mesh)` leaves them out)."""
    return ",".join(f"{ax}={getattr(mesh, ax)}" for ax in MESH_AXES)


def usable_fraction() -> float:
    """The share of a device's memory a decode may use: $XLA_PYTHON_CLIENT_MEM_FRACTION if set,
    else 0.75, JAX's default GPU preallocation."""
    text = os.environ.get(FRACTION_ENV)
    if text is None or not text.strip():
        return DEFAULT_FRACTION
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ConfigError(f"{FRACTION_ENV}={text!r} must be a number in (0, 1]")
    return value


def cache_slots(config: ModelConfig, context: int) -> int:
    """The slots S of the JAX executor's K/V cache for a decode of `context` positions
    (`JaxExecutor.capacity`): a power of two from 256 that holds them, capped at the largest
    cache bucket (`cache_buckets(max_seq_len)`)."""
    from dlm_jax.runtime.buckets import cache_buckets  # NumPy only

    top = cache_buckets(config.max_seq_len).largest
    size = max(256, 1 << max(context - 1, 0).bit_length())
    return size if size <= top else max(top, context)


def _grouped(config: ModelConfig, quant: str | None, quant_float: frozenset[str] = frozenset()) -> Counter:
    """(name with its layer index as `*`, shape, dtype) -> how many parameters have them: the
    rules do not read the layer index, so each group is split alike (and a 100B MoE's ~500
    parameters become ~30 groups)."""
    from dlm_jax.models._params import param_shapes  # (imports JAX)

    return Counter((_LAYER.sub("layers.*.", name), tuple(s.shape), np.dtype(s.dtype).name)
                   for name, s in param_shapes(config, quant=quant, quant_float=quant_float).items())


def _weights(config: ModelConfig, groups: Counter, mesh: MeshShape, quant: str | None
             ) -> tuple[int, tuple[str, ...]]:
    """(bytes per device, names whose rule splits a dimension the mesh does not divide), the
    weights quantized to `quant` (act-order: `ACT_ORDER_RULES`' whole scales)."""
    total, replicated = 0, []
    logical = mesh.axes_for(config)
    act = act_order(quant)
    for (name, shape, dtype), count in groups.items():
        spec = leaf_axes(name, shape, logical, act_order=act)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        total += count * nbytes // split_factor(spec, mesh.sizes)  # a split dimension divides exactly
        wanted = logical_axes(name, len(shape), act_order=act)
        if any(ax is not None and logical.get(ax, (None, 1))[1] > 1 and got is None
               for ax, got in zip(wanted, spec)):
            replicated.append(name)
    return total, tuple(sorted(replicated))


def weight_bytes_per_device(config: ModelConfig, mesh: MeshShape | str, *, quant: str | None = None,
                            quant_float: frozenset[str] = frozenset()) -> int:
    """The parameter bytes each device of `mesh` holds: every parameter of `param_shapes` (in its
    stored dtype; `quant`: int8 / fp8 kernels and their float32 scales, but the weights named in
    `quant_float`) divided by how many ways `leaf_axes` splits it."""
    return _weights(config, _grouped(config, quant, quant_float), MeshShape.parse(mesh), quant)[0]


def _local_rows(mesh: MeshShape, batch: int) -> int:
    """The cache rows (and batch rows) one device holds: batch / dp where dp divides the batch
    (`cache_axes`), else all of them."""
    return batch // mesh.dp if mesh.dp > 1 and batch % mesh.dp == 0 else batch


def kv_bytes_per_device(config: ModelConfig, mesh: MeshShape | str, *, batch: int, context: int) -> int:
    """The JAX executor's K/V cache bytes on each device of `mesh` for `batch` rows of `context`
    positions: keys and values [L, B, Hkv, S, Dh] in the compute dtype (`config.dtype`), S =
    `cache_slots(config, context)`, split as `cache_axes` says (heads over tp, rows over dp where
    dp divides them), plus the slots' positions (int32) and validity (bool), each [B, S] and whole
    on every device, and their written flags (bool [B, S], rows over dp as the K/V's)."""
    mesh = MeshShape.parse(mesh)
    slots = cache_slots(config, context)
    axes = cache_axes(mesh, batch, config)
    shape = (config.n_layers, batch, config.n_kv_heads, slots, config.head_dim)
    kv = 2 * int(np.prod(shape, dtype=np.int64)) * np.dtype(config.dtype).itemsize // split_factor(axes, mesh.sizes)
    rows = batch // mesh.dp if axes[1] == "dp" else batch
    return kv + batch * slots * (4 + 1) + rows * slots


def _part(n: int, ways: int) -> int:
    """`n` split `ways` ways where that divides it (`leaf_axes`' rule), else whole."""
    return n // ways if ways > 1 and n % ways == 0 else n


def activation_bytes_per_device(config: ModelConfig, mesh: MeshShape | str, *, batch: int, context: int,
                                quant: str | None = None) -> int:
    """An estimate of the largest intermediates live on one device during one step, for a window
    of one block (`WINDOW` = 32 positions) per row and as many logit rows, over a cache of
    `cache_slots(config, context)` slots, the rows of one device (`batch / dp` where dp divides
    the batch). It counts one layer at a time (XLA frees a layer's intermediates before the
    next) and sums, in the compute dtype unless said:
    - the residual stream in and out (float32) and the layer's q, k, v rows and attention output;
    - the attention scores and probabilities over the S slots and the window (float32);
    - the larger FFN of the model's layers: a dense layer's gate, up and product rows; an MoE
      layer's dispatch at the larger of its two largest branches (`dispatch_experts`): every
      local expert's gate, up and product rows, their weights read where they lie (quantized:
      dequantised whole, in the compute dtype), or the most experts under half whose weights it
      gathers (a quarter: in the stored dtype, or the compute dtype when quantized) and their
      rows; plus the shared experts' rows;
    - the step's logit rows over the whole vocabulary (float32).
    Not counted: XLA's scratch buffers, the compiled programs, TIDE's expert slots."""
    mesh = MeshShape.parse(mesh)
    cfg = config
    it = np.dtype(cfg.dtype).itemsize
    rows = _local_rows(mesh, batch)
    n = rows * WINDOW
    heads = _part(cfg.n_heads, mesh.tp)
    kv_heads = cfg.n_kv_heads // mesh.tp if kv_heads_split(mesh, cfg) else cfg.n_kv_heads
    span = cache_slots(cfg, context) + WINDOW
    attention = (n * (heads + 2 * kv_heads) * cfg.head_dim * it + n * heads * cfg.head_dim * 4
                 + 2 * rows * heads * WINDOW * span * 4)
    ffn = 0
    if any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
        ffn = 3 * n * _part(cfg.ffn_hidden, mesh.tp) * it
    if cfg.moe_layers:
        experts = _part(cfg.n_experts, mesh.ep)
        width = _part(cfg.moe_ffn_hidden, mesh.tp)
        weights = 3 * cfg.d_model * width * (it if quant else np.dtype(cfg.param_dtype).itemsize)  # an expert's
        few = max((u for u in {max(1, experts // 4), max(1, experts // 2)} if 2 * u < experts), default=0)
        dispatch = max((experts * weights if quant else 0) + 3 * n * experts * width * it,  # every expert, in place
                       few * weights + 3 * n * few * width * it)  # the most gathered (a quarter)
        shared = 3 * n * _part(cfg.n_shared_experts * cfg.moe_ffn_hidden, mesh.tp) * it
        ffn = max(ffn, dispatch + shared)
    residual = 2 * n * cfg.d_model * 4
    logits = rows * WINDOW * cfg.vocab_size * 4
    return int(residual + attention + ffn + logits)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """One mesh's bytes per device: `weights` (exact), `kv` (exact: the JAX executor's cache),
    `activations` (an estimate, `activation_bytes_per_device`); `fits`: their total is within
    `usable` bytes; `replicated`: parameters (layer index as `*`) whose rule names a mesh axis
    that does not divide them, so every device holds them whole, and `K/V rows` where dp does
    not divide the batch."""

    mesh: MeshShape
    weights: int
    kv: int
    activations: int
    usable: int
    replicated: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def to_dict(self) -> dict[str, Any]:
        return {"mesh": full_name(self.mesh), **self.mesh.sizes, "weights_bytes": self.weights,
                "kv_bytes": self.kv, "activation_bytes": self.activations, "total_bytes": self.total,
                "fits": self.fits, "replicated": list(self.replicated)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every mesh of `devices` devices the model allows (`meshes`, in (tp, ep, dp) order), the
    meshes refused with their one-line reason (`refused`), and what they were planned for."""

    config: ModelConfig
    devices: int
    memory_gib: float
    fraction: float
    batch: int
    context: int
    quant: str | None
    parameters: int
    meshes: tuple[MeshPlan, ...]
    refused: tuple[tuple[MeshShape, str], ...]
    seconds: float

    @property
    def usable(self) -> int:
        """Bytes a decode may use on each device."""
        return int(self.memory_gib * GIB * self.fraction)

    @property
    def slots(self) -> int:
        return cache_slots(self.config, self.context)

    @property
    def fitting(self) -> tuple[MeshPlan, ...]:
        return tuple(m for m in self.meshes if m.fits)

    @property
    def pick(self) -> MeshPlan | None:
        """Among the meshes that fit: the most data-parallel replicas the batch keeps busy (dp
        dividing the batch: a replica without rows of its own only repeats another's work),
        then the fewest tp (less communication per layer), then the fewest ep; None if none
        fits."""
        fitting = self.fitting
        busy = lambda m: m.mesh.dp if self.batch % m.mesh.dp == 0 else 0  # noqa: E731
        return min(fitting, key=lambda m: (-busy(m), -m.mesh.dp, m.mesh.tp, m.mesh.ep)) if fitting else None

    @property
    def smallest(self) -> MeshPlan:
        """The mesh needing the least memory per device."""
        return min(self.meshes, key=lambda m: m.total)

    def to_dict(self) -> dict[str, Any]:
        pick = self.pick
        return {"parameters": self.parameters, "devices": self.devices, "memory_gib": self.memory_gib,
                "fraction": self.fraction, "usable_bytes": self.usable, "batch": self.batch,
                "context": self.context, "cache_slots": self.slots, "kv_dtype": self.config.dtype,
                "param_dtype": self.config.param_dtype, "quant": self.quant,
                "meshes": [m.to_dict() for m in self.meshes],
                "refused": [{"mesh": full_name(m), "reason": why} for m, why in self.refused],
                "pick": full_name(pick.mesh) if pick else None, "seconds": round(self.seconds, 3)}


def _meshes(devices: int) -> list[MeshShape]:
    """Every (tp, ep, dp) with tp * ep * dp == devices, in (tp, ep, dp) order."""
    out = []
    for tp in range(1, devices + 1):
        for ep in range(1, devices // tp + 1):
            if devices % (tp * ep) == 0:
                out.append(MeshShape(tp=tp, ep=ep, dp=devices // (tp * ep)))
    return out


def _check_request(config: ModelConfig, *, batch: int, context: int) -> None:
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ConfigError(f"batch={batch!r} must be a whole number >= 1")
    if not isinstance(context, int) or isinstance(context, bool) or not 1 <= context <= config.max_seq_len:
        raise ConfigError(f"context={context!r} must be in [1, {config.max_seq_len}] (the model's max_seq_len)")


def _mesh_plan(config: ModelConfig, groups: Counter, mesh: MeshShape, *, usable: int, batch: int, context: int,
               quant: str | None) -> MeshPlan:
    weights, replicated = _weights(config, groups, mesh, quant)
    if mesh.dp > 1 and batch % mesh.dp:
        replicated += (f"K/V rows (dp={mesh.dp} does not divide batch {batch})",)
    if mesh.tp > 1 and not kv_heads_split(mesh, config):
        replicated += (f"K/V heads (tp={mesh.tp} does not divide the {config.n_kv_heads} K/V heads: each device "
                       f"holds them all)",)
    return MeshPlan(mesh, weights, kv_bytes_per_device(config, mesh, batch=batch, context=context),
                    activation_bytes_per_device(config, mesh, batch=batch, context=context, quant=quant),
                    usable, replicated)


def plan(config: ModelConfig, *, devices: int, memory_gib: float, batch: int = 1, context: int | None = None,
         quant: str | None = None, quant_float: frozenset[str] = frozenset()) -> Plan:
    """Plan `config` on `devices` devices of `memory_gib` GiB each, of which the `usable_fraction`
    counts, for `batch` rows of `context` positions (default: the model's max_seq_len); `quant`:
    weights quantized so (but those named in `quant_float`: a pre-quantized checkpoint's float
    kernels, `dlm_jax.models.quant.quantize`'s keep)."""
    t0 = time.perf_counter()
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ConfigError(f"devices={devices!r} must be a whole number >= 1")
    if not memory_gib > 0:
        raise ConfigError(f"memory={memory_gib!r} GiB per device must be > 0")
    context = config.max_seq_len if context is None else context
    _check_request(config, batch=batch, context=context)
    fraction = usable_fraction()
    usable = int(memory_gib * GIB * fraction)
    groups = _grouped(config, quant, frozenset(quant_float))
    meshes, refused = [], []
    for mesh in _meshes(devices):
        try:
            mesh.check(config, devices=devices)  # as `dlm_jax.load` checks it
        except ConfigError as e:
            refused.append((mesh, str(e)))
            continue
        meshes.append(_mesh_plan(config, groups, mesh, usable=usable, batch=batch, context=context, quant=quant))
    plain = groups if quant is None else _grouped(config, None)
    parameters = sum(count * int(np.prod(shape, dtype=np.int64)) for (_, shape, _), count in plain.items())
    return Plan(config, devices, float(memory_gib), fraction, batch, context, quant, parameters, tuple(meshes),
                tuple(refused), time.perf_counter() - t0)


def check_fits(config: ModelConfig, mesh: MeshShape | str, *, memory_bytes: int, batch: int, context: int,
               quant: str | None = None, quant_float: frozenset[str] = frozenset()) -> MeshPlan:
    """`mesh`'s plan, refusing in one line (ConfigError) a mesh the model's heads or experts do not
    allow or whose bytes per device exceed `memory_bytes` (what each device has for the decode)."""
    mesh = MeshShape.parse(mesh)
    mesh.check(config)
    _check_request(config, batch=batch, context=context)
    p = _mesh_plan(config, _grouped(config, quant, frozenset(quant_float)), mesh, usable=memory_bytes, batch=batch,
                   context=context, quant=quant)
    if not p.fits:
        raise ConfigError(
            f"mesh {full_name(mesh)} does not fit: it needs {_size(p.total)} per device (weights {_size(p.weights)}, "
            f"K/V {_size(p.kv)}, activations {_size(p.activations)} for batch {batch}, context {context}) and a "
            f"device has {_size(memory_bytes)}")
    return p


def read_config(path: str | os.PathLike, *, strict: bool = False) -> tuple[ModelConfig, str]:
    """(config, family name) of a checkpoint directory, a Hugging Face id in the local cache (as
    `load_config` resolves it) or a `config.json` file of any family this project reads; `strict`
    refuses keys the loader does not use (as `load_config`)."""
    from dlm_jax.checkpoint._families import family_for
    from dlm_jax.checkpoint._io import load_config

    p = Path(path)
    if p.is_file():
        source = str(p)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{source}: not a JSON config ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: not a JSON object")
        family = family_for(data, source=source)
        return family.config_from_json(data, source=source, strict=strict), family.name
    config, family = load_config(path, strict=strict)
    return config, family.name


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_plan(plan_: Plan, *, model: str = "") -> str:
    """The plan as the `plan` command prints it: the model, the assumptions, one row per mesh
    (GiB per device, MiB where every mesh needs under 1 GiB), the meshes refused, the pick (or
    what the smallest mesh needs) and the time taken."""
    cfg = plan_.config
    unit, scale = ("GiB", GIB) if max(m.total for m in plan_.meshes) >= GIB else ("MiB", 2**20)
    quant = f", weights quantized to {plan_.quant}" if plan_.quant else ""
    lines = [f"model: {model or 'config'} ({_count(plan_.parameters)} parameters, {cfg.param_dtype} weights{quant})",
             f"devices: {plan_.devices} x {plan_.memory_gib:g} GiB, {plan_.usable / GIB:.4g} GiB usable each "
             f"(fraction {plan_.fraction:g}: ${FRACTION_ENV}, else JAX's default GPU preallocation 0.75)",
             f"decode: batch {plan_.batch}, context {plan_.context} ({plan_.slots} cache slots), K/V in {cfg.dtype}, "
             f"activations for a window of {WINDOW}",
             f"{'mesh':<16}{'weights':>9}{'K/V':>9}{'act':>9}{'total':>9}  fits  ({unit} per device)"]
    for m in plan_.meshes:
        row = (f"{full_name(m.mesh):<16}{m.weights / scale:>9.2f}{m.kv / scale:>9.2f}{m.activations / scale:>9.2f}"
               f"{m.total / scale:>9.2f}  {'yes' if m.fits else 'no':<4}")
        lines.append((row + (f"  replicated: {', '.join(m.replicated)}" if m.replicated else "")).rstrip())
    if plan_.refused:
        lines.append(f"refused (the model's heads or experts do not divide them; --json gives the reasons): "
                     f"{' '.join(full_name(m) for m, _ in plan_.refused)}")
    pick = plan_.pick
    if pick is not None:
        lines.append(f"pick: {full_name(pick.mesh)}")
    else:
        low = plan_.smallest
        lines.append(f"nothing fits: the smallest need is {low.total / scale:.2f} {unit} per device "
                     f"({full_name(low.mesh)}), {plan_.usable / scale:.2f} {unit} usable")
    lines.append(f"planned in {plan_.seconds:.2f} s")
    return "\n".join(lines)

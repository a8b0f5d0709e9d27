"""Partition rules and mesh shapes: which axis of each parameter a device mesh splits, shared by
training (`dlm_jax.training.loop`), the JAX executor's mesh decoding
(`dlm_jax.executors.sharding`) and the planner (`dlm_jax.planner`). No JAX here: the planner
reads a config and these rules alone, and the command line checks a mesh before JAX loads.

Logical axes: `MODEL` (tensor parallel: query heads, FFN neurons, vocabulary rows), `KV_HEADS`
(the K/V heads: tensor parallel too where the mesh's tp divides them, else whole on every
device, each device computing every K/V head for its query heads) and `EXPERT` (expert
parallel: the routed experts of an MoE layer). A mesh maps each to one of its axes: training's
mesh has `data` and `model` (no expert axis: experts are split over `model` by their neurons,
as before), decoding's has `dp`, `ep` and `tp` (`MeshShape.axes_for`).

The rules are Megatron's: column-parallel q/k/v and FFN in-projections (each device holds whole
heads, whole neurons), row-parallel o and down projections (their products summed over the
axis), a vocabulary-parallel embedding and output head, routed experts split by expert over
`EXPERT` and by neuron over `MODEL`. A parameter no rule names, or a dimension the axis does
not divide, is replicated (`leaf_axes`): the norms, the router, the biases of row-parallel
layers, quantization scales of row-parallel kernels.

An act-order quantized model (GPTQ's `desc_act`, `dlm_jax.models.quant`: each input row's
group read from a map `g_idx` [I]) splits its row-parallel kernels' maps as their rows, and
keeps those kernels' grouped scales and zero points whole on every device (`ACT_ORDER_RULES`):
a device's share of rows may belong to any group. (The maps of column-parallel kernels are
whole on every device, their scales split as the output channels, as without act-order.)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from dlm_jax._errors import ConfigError

MODEL, EXPERT, KV_HEADS = "model", "expert", "kv_heads"

_COL = r"(kernel|qkernel)$"
PARTITION_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"attn\.q_proj\." + _COL, (None, MODEL)),
    (r"attn\.q_proj\.(bias|scale|zero)$", (MODEL,)),
    (r"attn\.q_proj\.(scale|zero)$", (None, MODEL)),  # grouped [G, O] (`dlm_jax.models.quant`; uint4 zeros alike)
    (r"attn\.(k|v)_proj\." + _COL, (None, KV_HEADS)),
    (r"attn\.(k|v)_proj\.(bias|scale|zero)$", (KV_HEADS,)),
    (r"attn\.(k|v)_proj\.(scale|zero)$", (None, KV_HEADS)),
    (r"attn\.o_proj\." + _COL, (MODEL, None)),
    (r"attn\.o_proj\.(scale|zero)$", (MODEL, None)),  # grouped: its groups of input rows split as the rows
    (r"(ffn|shared)\.(gate|up)_proj\." + _COL, (None, MODEL)),
    (r"(ffn|shared)\.(gate|up)_proj\.(scale|zero)$", (MODEL,)),
    (r"(ffn|shared)\.(gate|up)_proj\.(scale|zero)$", (None, MODEL)),
    (r"(ffn|shared)\.down_proj\." + _COL, (MODEL, None)),
    (r"(ffn|shared)\.down_proj\.(scale|zero)$", (MODEL, None)),
    (r"ffn\.(gate|up)$", (EXPERT, None, MODEL)),
    (r"ffn\.(gate|up)_(scale|zero)$", (EXPERT, MODEL)),
    (r"ffn\.(gate|up)_(scale|zero)$", (EXPERT, None, MODEL)),
    (r"ffn\.down$", (EXPERT, MODEL, None)),
    (r"ffn\.down_(scale|zero)$", (EXPERT, None)),
    (r"ffn\.down_(scale|zero)$", (EXPERT, MODEL, None)),
    (r"lm_head\." + _COL, (None, MODEL)),
    (r"lm_head\.(scale|zero)$", (MODEL,)),
    (r"lm_head\.(scale|zero)$", (None, MODEL)),
    (r"embed\.embedding$", (MODEL, None)),
)
_ROW_PARALLEL = r"(attn\.o_proj|(ffn|shared)\.down_proj)\."
ACT_ORDER_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (_ROW_PARALLEL + r"g_idx$", (MODEL,)),  # each device's rows' groups
    (_ROW_PARALLEL + r"(scale|zero)$", (None, None)),  # every group's [G, O], whole
    (r"ffn\.(gate|up)_g_idx$", (EXPERT, None)),  # routed experts' maps [E, I]
    (r"ffn\.down_g_idx$", (EXPERT, MODEL)),
    (r"ffn\.down_(scale|zero)$", (EXPERT, None, None)),  # [E, G, O]: each expert's groups whole
)


def param_name(path: Sequence) -> str:
    """The dotted name (`layers.0.attn.q_proj.kernel`) of a parameter's pytree path (JAX's key
    objects, or plain strings and ints); an nnx Variable's trailing `value` is left out."""
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return ".".join(parts[:-1] if parts and parts[-1] == "value" else parts)


_STACKED = "layers.block."  # a scanned stack's parameters (`dlm_jax.models._scan.StackedLayers`): [L, ...]


def logical_axes(name: str, ndim: int, *, act_order: bool = False) -> tuple[str | None, ...]:
    """The logical axis of each dimension of parameter `name` (None: not split), by the first
    rule whose pattern matches and whose rank is `ndim`; a scanned stack's parameter
    (`layers.block.*`) by its layer's rule after its leading [L] axis, never split. (A weight-only
    quantized kernel's scales are [O] per output channel or [G, O] grouped, each with its rules;
    `act_order`: a model quantized with act-order groups, whose `ACT_ORDER_RULES` come first.)"""
    if name.startswith(_STACKED) or f".{_STACKED}" in name:
        return (None, *logical_axes(name.replace(_STACKED, "layers.0.", 1), ndim - 1, act_order=act_order))
    for pattern, spec in (ACT_ORDER_RULES + PARTITION_RULES) if act_order else PARTITION_RULES:
        if len(spec) == ndim and re.search(pattern, name):
            return spec
    return (None,) * ndim


def leaf_axes(name: str, shape: Sequence[int], axes: Mapping[str, tuple[str, int]], *,
              transposed: bool = False, act_order: bool = False) -> tuple[str | None, ...]:
    """The mesh axis splitting each dimension of parameter `name` of `shape` on a mesh whose
    logical axes map to (mesh axis, size) in `axes` (a logical axis absent splits
    nothing; one of size 1 is named, as training's one-device mesh names `model`); a dimension
    the size does not divide stays whole. `transposed`: a 2-D leaf held
    [out, in] (the JAX executor's CPU layout), whose rule is read reversed; `act_order` as in
    `logical_axes`."""
    logical = logical_axes(name, len(shape), act_order=act_order)
    if transposed:
        logical = logical[::-1]
    out = []
    for dim, ax in zip(shape, logical):
        mesh_axis, size = axes.get(ax, (None, 1)) if ax is not None else (None, 1)
        out.append(mesh_axis if mesh_axis is not None and dim % size == 0 else None)
    return tuple(out)


def split_factor(spec: Sequence[str | None], sizes: Mapping[str, int]) -> int:
    """How many ways a leaf with mesh axes `spec` is split (its bytes per device: total / this)."""
    n = 1
    for ax in spec:
        if ax is not None:
            n *= sizes[ax]
    return n


MESH_AXES = ("tp", "ep", "dp")  # as `--mesh` spells them
MESH_ORDER = ("dp", "ep", "tp")  # the device grid's order: tp innermost (neighbouring devices)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A decode mesh: `tp` tensor-parallel (heads, neurons, vocabulary), `ep` expert-parallel
    (routed experts), `dp` data-parallel replicas (the K/V cache's rows and a step's batch rows).
    It takes tp * ep * dp devices."""

    tp: int = 1
    ep: int = 1
    dp: int = 1

    @classmethod
    def parse(cls, text: str | Mapping[str, int] | MeshShape) -> MeshShape:
        """`tp=N[,ep=M][,dp=K]` (any order; a missing axis is 1; `;` separates axes too, for
        lm-eval's model args, which split at commas), a mapping of the same, or a `MeshShape`;
        anything else is refused in one line."""
        if isinstance(text, MeshShape):
            return text
        if isinstance(text, Mapping):
            items = list(text.items())
        else:
            items = []
            for part in str(text).replace(" ", "").replace(";", ",").split(","):
                if not part:
                    continue
                key, eq, value = part.partition("=")
                if not eq:
                    raise ConfigError(f"mesh {text!r}: {part!r} is not axis=size (axes: {', '.join(MESH_AXES)})")
                items.append((key, value))
            if not items:
                raise ConfigError(f"mesh {text!r}: give at least one axis, e.g. tp=2")
        sizes: dict[str, int] = {}
        for key, value in items:
            if key not in MESH_AXES:
                raise ConfigError(f"mesh {text!r}: unknown axis {key!r}; known: {', '.join(MESH_AXES)}")
            if key in sizes:
                raise ConfigError(f"mesh {text!r}: axis {key} given twice")
            whole = (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, str) and value.isdigit())
            if not whole or int(value) < 1:
                raise ConfigError(f"mesh {text!r}: {key}={value!r} must be a whole number >= 1")
            sizes[key] = int(value)
        return cls(**sizes)

    def __post_init__(self) -> None:
        for ax in MESH_AXES:
            v = getattr(self, ax)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"mesh {ax}={v!r} must be a whole number >= 1")

    @property
    def size(self) -> int:
        return self.tp * self.ep * self.dp

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "ep": self.ep, "dp": self.dp}

    def axes_for(self, config) -> dict[str, tuple[str, int]]:
        """The logical axes of `PARTITION_RULES` on this mesh for a model of `config`
        (`leaf_axes`'s `axes`): K/V heads over tp where tp divides them, else whole."""
        return {MODEL: ("tp", self.tp), EXPERT: ("ep", self.ep),
                KV_HEADS: ("tp", self.tp) if kv_heads_split(self, config) else (None, 1)}

    def __str__(self) -> str:
        return ",".join(f"{ax}={getattr(self, ax)}" for ax in MESH_AXES
                        if getattr(self, ax) > 1 or ax == "tp")

    def check(self, config, *, devices: int | None = None, expert_slots: int | None = None) -> None:
        """Refuse, in one line naming the axis and the sizes, a mesh that does not divide the
        model's query heads (tp), its routed experts or expert slots (ep), or that needs more
        than `devices` devices. (A tp the K/V heads do not divide keeps them whole on every
        device: `kv_heads_split`. Weight-only quantized kernels split as their float ones, their
        scales along the output axis: the rules above.)"""
        if self.tp > 1 and config.n_heads % self.tp:
            raise ConfigError(f"mesh tp={self.tp} does not divide the model's {config.n_heads} attention heads "
                              f"(n_heads)")
        if self.ep > 1:
            if not config.n_experts:
                raise ConfigError(f"mesh ep={self.ep}: the model has no routed experts to split (ffn={config.ffn!r})")
            if config.n_experts % self.ep:
                raise ConfigError(f"mesh ep={self.ep} does not divide the model's {config.n_experts} routed experts")
            if expert_slots is not None and expert_slots % self.ep:
                raise ConfigError(f"mesh ep={self.ep} does not divide the {expert_slots} expert slots "
                                  f"(expert_slots) of each split layer")
        if devices is not None and self.size > devices:
            raise ConfigError(f"mesh {self} needs {self.size} devices (tp*ep*dp = {self.tp}*{self.ep}*{self.dp}); "
                              f"{devices} available")


def kv_heads_split(mesh: MeshShape, config) -> bool:
    """Whether `mesh` splits the model's K/V heads over tp (tp divides them); else each device
    holds and computes every K/V head (a tp past a grouped-query model's K/V heads)."""
    return mesh.tp > 1 and config.n_kv_heads % mesh.tp == 0


def cache_axes(mesh: MeshShape, rows: int, config) -> tuple[str | None, ...]:
    """The mesh axes of a K/V cache [L, rows, Hkv, S, Dh] of a model of `config`: K/V heads over
    tp (where tp divides them, `kv_heads_split`; else whole), rows over dp (where dp divides
    them; a step of fewer rows keeps them whole)."""
    return (None, "dp" if mesh.dp > 1 and rows % mesh.dp == 0 else None,
            "tp" if kv_heads_split(mesh, config) else None, None, None)

"""What a program is traced for, read while it is traced: the mesh its routed experts are split
over (`expert_mesh`, set by the JAX executor around every program it traces on a mesh) and the
mesh a kernel's `shard_map` runs on (`traced_mesh`). A leaf module (JAX alone), so that the
model's modules and its kernels (`dlm_jax.models._quant_kernel`) read it without importing each
other."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar, value) -> Iterator[None]:
    """`var` set to `value` inside the context (what a trace inside it reads), reset after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


# The mesh the routed experts are split over while a program is traced, how routed rows reach
# their experts there, and how the parameters are placed on it (`expert_mesh`): None on one device.
_EXPERT_MESH = contextvars.ContextVar("dlm_jax_expert_mesh", default=None)
# How an expert-parallel step brings rows to their experts (`sharded_experts`): "psum" (every
# device computes its own experts for all rows, the partial outputs summed) or "all_to_all"
# (each device's share of the rows sent to the experts' devices and the results sent back).
EXPERT_EXCHANGES = ("psum", "all_to_all")


@contextlib.contextmanager
def expert_mesh(mesh, exchange: str = "psum", placed: tuple | None = None) -> Iterator[None]:
    """Trace MoE layers inside this context with their routed experts split over `mesh` (a
    `jax.sharding.Mesh` with axes "ep" and "tp", as the partition rules split them:
    `dlm_jax._partition`), computed by `sharded_experts` with `exchange`. The executor traces
    every program on a mesh inside it, so it also names the mesh that the attention kernel's
    `shard_map` runs on (`traced_mesh`), and, as `placed`, how it placed the parameters there
    (`traced_placement`)."""
    if exchange not in EXPERT_EXCHANGES:
        raise ValueError(f"unknown expert exchange {exchange!r}; known: {', '.join(EXPERT_EXCHANGES)}")
    with _scoped(_EXPERT_MESH, (mesh, exchange, placed)):
        yield


def traced_mesh():
    """The mesh of the program being traced (`expert_mesh`: the executor traces every program on
    a mesh inside it), or None on one device. Inside a `shard_map` already manual over some of
    its axes (the executor's per-replica steps, manual over "dp"), the abstract mesh of that
    context: a `shard_map` nested there splits over the other axes (`_attention_kernel.free_axes`)."""
    on_mesh = _EXPERT_MESH.get()
    if on_mesh is None:
        return None
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else on_mesh[0]


def traced_placement() -> tuple | None:
    """How the program being traced has its parameters placed on `traced_mesh`: (the logical
    axes `dlm_jax._partition.leaf_axes` takes, whether act-order rules apply), as
    `dlm_jax.executors.sharding.MeshPlacement.leaf` placed them; None on one device or where the
    tracer did not say (a kernel's `shard_map` over a parameter needs its shards' specs:
    `dlm_jax.models._quant_kernel.sharded`)."""
    on_mesh = _EXPERT_MESH.get()
    return None if on_mesh is None else on_mesh[2]

"""Where the JAX executor's arrays live on a device mesh (`JaxExecutor(mesh=...)`).

The mesh is `jax.sharding.Mesh` over tp * ep * dp devices with axes ("dp", "ep", "tp")
(`dlm_jax._partition.MeshShape`). Parameters are split by the partition rules training uses
(`dlm_jax._partition.leaf_axes`), the K/V cache (a [rows, Hkv, S, Dh] per layer) by its K/V heads over tp
and its rows over dp (`cache_axes`), a step's per-row inputs by their batch rows over dp, and
everything else (the slot positions, validity, what each step returns) is replicated. The
compiled programs take these shardings as their in/out shardings and XLA's SPMD partitioner
inserts the collectives: the row-parallel projections' all-reduce, the vocabulary-parallel
embedding's and head's reductions; the MoE layers' routed experts run under `shard_map`
(`dlm_jax.models._transformer.sharded_experts`).

Several processes (`jax.distributed.initialize`): each drives its own devices of the one mesh
and runs the same host loop on the same inputs (every decision of the host runtime is a
deterministic function of the step outputs, which are replicated), so nothing but the compiled
programs' collectives crosses processes. Host arrays enter as global arrays built from each
process's identical copy (`put`), and outputs are read from the local replica (`fetch`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dlm_jax._partition import MESH_ORDER, MeshShape, cache_axes, leaf_axes


class MeshPlacement:
    """The mesh of a `MeshShape` over `devices` (default: all of `jax.devices()`, every process's)
    and the sharding of each kind of array the executor holds or sends."""

    def __init__(self, shape: MeshShape, devices: Sequence | None = None, *, config=None):
        devices = list(jax.devices() if devices is None else devices)
        if shape.size > len(devices):
            from dlm_jax._errors import ConfigError

            raise ConfigError(f"mesh {shape} needs {shape.size} devices (tp*ep*dp); {len(devices)} available "
                              f"({devices[0].platform})")
        self.shape = shape
        self.config = config  # the model's (`for_model`): whether tp splits its K/V heads
        self.act_order = False  # its weights quantized with act-order groups (`for_model`'s quant)
        grid = np.asarray(devices[: shape.size], dtype=object).reshape([getattr(shape, ax) for ax in MESH_ORDER])
        self.mesh = Mesh(grid, MESH_ORDER)
        self.replicated = NamedSharding(self.mesh, P())
        self.processes = len({d.process_index for d in grid.flat})

    def __repr__(self) -> str:
        return f"MeshPlacement({self.shape}, {self.mesh.devices.size} devices)"

    def for_model(self, config, quant: str | None = None) -> MeshPlacement:
        """This placement for a model of `config` (set once; another model's is refused), its
        weights quantized to `quant` (an act-order mode's row-parallel scales stay whole:
        `dlm_jax._partition.ACT_ORDER_RULES`)."""
        from dlm_jax._config import act_order

        if self.config is not None and self.config != config:
            raise ValueError("this MeshPlacement is for another model's config")
        self.config = config
        self.act_order = act_order(quant)
        return self

    def leaf(self, name: str, shape: Sequence[int], *, transposed: bool = False) -> NamedSharding:
        """A parameter's sharding (`leaf_axes` of the shared rules)."""
        axes = self.shape.axes_for(self.config)
        return NamedSharding(self.mesh, P(*leaf_axes(name, shape, axes, transposed=transposed,
                                                     act_order=self.act_order)))

    def cache(self, rows: int) -> NamedSharding:
        """One layer's K or V [rows, Hkv, S, Dh] (`cache_axes` without the layer axis)."""
        return NamedSharding(self.mesh, P(*cache_axes(self.shape, rows, self.config)[1:]))

    def rows(self, rows: int) -> NamedSharding:
        """A cache's per-row array [rows, S] (whether each slot holds K/V): rows over dp, as the
        K/V's (`cache`)."""
        return NamedSharding(self.mesh, P(cache_axes(self.shape, rows, self.config)[1]))

    def batch(self, shape: Sequence[int]) -> NamedSharding:
        """A step's per-row array [B, ...]: rows over dp where dp divides B, else replicated."""
        dp = self.shape.dp
        if dp > 1 and len(shape) and shape[0] % dp == 0:
            return NamedSharding(self.mesh, P("dp"))
        return self.replicated

    def spec(self, spec: jax.ShapeDtypeStruct, sharding: NamedSharding | None = None) -> jax.ShapeDtypeStruct:
        """`spec` with a sharding (default: replicated)."""
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding or self.replicated)

    def put(self, x, sharding: NamedSharding | None = None) -> jax.Array:
        """A host (or single-device) array as a global array of `sharding` (default: replicated).
        With several processes, each builds its devices' shards from its own copy of `x`, which
        every process holds alike (the same deterministic host loop)."""
        sharding = sharding or self.replicated
        if self.processes == 1:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    @staticmethod
    def fetch(x: jax.Array) -> np.ndarray:
        """A replicated output as a host array, read from a replica on this process's devices."""
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(x.addressable_data(0))

    def per_device_bytes(self, arrays) -> dict:
        """{device: bytes of `arrays`' shards on it} (what each device of the mesh holds)."""
        out: dict = {}
        for a in arrays:
            for shard in a.addressable_shards:
                out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
        return out


_COLLECTIVE = re.compile(r"\s(all-reduce|all-to-all|all-gather|reduce-scatter|collective-permute)(-start)?\(")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8}


def collective_bytes(hlo: str) -> dict[str, dict[str, int]]:
    """{kind: {"ops": n, "bytes": output bytes}} of the collectives in a compiled program's HLO
    text (`jax.stages.Compiled.as_text()`, after SPMD partitioning): what one pass of the
    program moves between the devices of its mesh, per kind."""
    out: dict[str, dict[str, int]] = {}
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m is None or "=" not in line[:m.start()]:
            continue
        shapes = line[line.index("=") + 1:m.start()]  # the op's output shape(s): `%name = <shapes> op(`
        size = sum(_DTYPE_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                   for t, dims in _SHAPE.findall(shapes))
        entry = out.setdefault(m.group(1), {"ops": 0, "bytes": 0})
        entry["ops"] += 1
        entry["bytes"] += size
    return out


def device_memory(placement: MeshPlacement) -> int | None:
    """The bytes each device of the mesh can hold: the smallest `bytes_limit` JAX's allocator
    reports for this process's devices of the mesh (GPU, TPU); on a CPU, whose host devices share
    the machine's memory, that memory divided among them; None where neither is known."""
    mine = [d for d in placement.mesh.devices.flat if d.process_index == jax.process_index()]
    limits = []
    for d in mine:
        try:
            stats = d.memory_stats()
        except Exception:  # backends without allocator statistics
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    if limits:
        return min(limits)
    if mine and mine[0].platform == "cpu":
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
        return ram // len(mine)
    return None


def join_processes(coordinator: str, *, num_processes: int, process_id: int) -> None:
    """Join a run of several processes that decode on one mesh (`jax.distributed.initialize`;
    before JAX starts its backends): `coordinator` is process 0's HOST:PORT. On a CPU the
    processes' collectives go through gloo."""
    if process_id < 0 or process_id >= num_processes:
        from dlm_jax._errors import ConfigError

        raise ConfigError(f"process id {process_id} must be in 0 .. {num_processes - 1}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)

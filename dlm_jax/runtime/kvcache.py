"""Decode state that stays where the step runs (NumPy only).

The K/V of a decode belong to its executor: `Executor.open` returns a `KVCache` that holds
them (device arrays for the JAX executor, NumPy arrays beside a LiteRT interpreter) with the
decode's slot positions and validity, uploaded once. The host runtime keeps what it decides
with (token states, which slots hold K/V from which token) and tells the cache, per step, by
index which slots the step reads, which window rows it writes where, and which rows' K/V it
keeps for later: a `SlotStep` (`runtime.step`, the step contract). What crosses to the executor each step is that plan (token ids,
positions, flags, slot indices); what comes back is what the proposer reads.

  KVCache        the protocol: `step` (read, compute, write in place), `snapshot` (read now,
                 run later, possibly on a fork on another thread: the CPU path), `write`
                 (store a snapshot's K/V at the step boundary), `close`.
  HostKVCache    the cache of any executor with a dense step (`Executor.step(StepInputs)`:
                 the LiteRT runner, the bundle cache, test mocks): NumPy K/V gathered into the
                 step's `k_cache`/`v_cache` inputs, which the executor then copies into its own
                 buffers (LiteRT: `dlm_jax.executors.runner._Signature.run` says why). Those per-step
                 copies of the read slots are what this design leaves (the bytes handed over
                 are counted in `Transfers.h2d`); the JAX executor's cache
                 (`dlm_jax.executors.jax_executor.DeviceKVCache`) has neither.

Axes: B batch rows, S slots of the decode, W window bucket, P read bucket, R logit rows,
L layers, Hkv K/V heads, Dh head width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax.runtime.hooks import HookBase
from dlm_jax.runtime.kvstore import KVStore
from dlm_jax.runtime.step import SlotStep, StepInputs, StepOutputs, slot_visibility


@dataclasses.dataclass
class Transfers:
    """Bytes between the host and where the step runs: `opened` when a decode's cache was made
    (its slot positions and validity, once), then per step the bytes handed to the compiled
    step (`h2d`) and read back (`d2h`)."""

    opened: int = 0
    h2d: list[int] = dataclasses.field(default_factory=list)
    d2h: list[int] = dataclasses.field(default_factory=list)

    def add(self, h2d: int, d2h: int) -> None:
        self.h2d.append(int(h2d))
        self.d2h.append(int(d2h))

    @property
    def h2d_bytes(self) -> int:
        return self.opened + sum(self.h2d)

    @property
    def d2h_bytes(self) -> int:
        return sum(self.d2h)


Snapshot = Callable[[], StepOutputs]  # runs a step over the K/V as they were read


class KVCache(HookBase):
    """The K/V of one decode, held by its executor. The decoder calls `step` every step; a
    revision policy's CPU path calls `snapshot` before a main step (reading the K/V as they are
    then) and `write` at the step boundary; `close` after the decode. `transfers` counts the
    bytes each step moved."""

    HOOKS = ("step", "snapshot", "write", "close")
    transfers: Transfers

    def step(self, req: SlotStep, *, timings: dict[str, float] | None = None) -> StepOutputs:
        """Run `req`: read its slots, compute, store its rows' K/V at `req.write`; return what
        the host reads (the rows' logits only if asked; `kv` only if `req.want.kv`)."""
        raise NotImplementedError

    def snapshot(self, req: SlotStep, executor: Any) -> Snapshot:
        """Read `req`'s slots now; the returned callable runs the step over them on `executor`
        (this cache's executor or its fork), from any thread, and returns the outputs with
        the rows' K/V kept (`kv`) for `write`. Nothing is stored."""
        raise NotImplementedError

    def write(self, kv: Any, slots: np.ndarray, rows: np.ndarray) -> None:
        """Store the K/V of window rows 0..n-1 of a snapshot's outputs (`kv`) at `slots` [n],
        in the batch rows `rows` [B, n] bool."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the decode's K/V (default: nothing; dropped with the cache)."""
        return None


class HostKVCache(KVCache):
    """The K/V of a decode in NumPy beside an executor that takes them as dense step inputs.
    Each step gathers the read slots into `k_cache`/`v_cache` (reused while those slots are
    unchanged) and builds the visibility on the host; the window K/V that come back are stored
    at the written slots."""

    def __init__(self, executor: Any, config: ModelConfig, positions: np.ndarray, valid: np.ndarray):
        self.executor = executor
        self.config = config
        self.positions = positions
        self.valid = valid
        b, s = positions.shape
        self.store = KVStore.for_model(config, b, s)
        self.transfers = Transfers()
        self._vis: tuple[Any, np.ndarray] | None = None  # (geometry, visibility)

    def _visibility(self, req: SlotStep) -> np.ndarray:
        if req.geometry is not None and self._vis is not None and self._vis[0] == req.geometry:
            return self._vis[1]
        written = self.store.written if req.written_only else None
        vis = slot_visibility(self.config, req, self.positions, self.valid, written)
        if req.geometry is not None:
            self._vis = (req.geometry, vis)
        return vis

    def _inputs(self, req: SlotStep, *, kv: bool) -> StepInputs:
        read = req.read
        used = np.flatnonzero(read >= 0)
        n = int(used[-1]) + 1 if len(used) else 0  # past the last read slot: padding
        # Excluded slots (-1) inside the list take any slot's K/V: nobody sees them.
        k_cache, v_cache = self.store.gather(np.maximum(read[:n], 0), req.key.cache)
        return StepInputs(tokens=req.tokens, positions=req.positions, visibility=self._visibility(req),
                          k_cache=k_cache, v_cache=v_cache, logit_rows=req.logit_rows,
                          want=dataclasses.replace(req.want, kv=kv), lora_gate=req.lora_gate)

    def step(self, req: SlotStep, *, timings: dict[str, float] | None = None) -> StepOutputs:
        writes = req.write >= 0
        inputs = self._inputs(req, kv=bool(writes.any()))
        out = self.executor.step(inputs) if timings is None else self.executor.step(inputs, timings=timings)
        if writes.any():
            rows = np.flatnonzero(writes.any(axis=0))
            self.store.write_at(req.write[:, rows], out.k_new[:, :, rows], out.v_new[:, :, rows])
        self.transfers.add(sum(a.nbytes for a in inputs.arrays()), _nbytes(out))
        return dataclasses.replace(out, k_new=None, v_new=None)

    def snapshot(self, req: SlotStep, executor: Any) -> Snapshot:
        inputs = self._inputs(req, kv=True)
        self.transfers.add(sum(a.nbytes for a in inputs.arrays()), 0)

        def run() -> StepOutputs:
            out = executor.step(inputs)
            return dataclasses.replace(out, k_new=None, v_new=None, kv=(out.k_new, out.v_new))

        return run

    def write(self, kv: Any, slots: np.ndarray, rows: np.ndarray) -> None:
        k, v = kv
        n = len(slots)
        self.store.write(slots, k[:, :, :n], v[:, :, :n], stable=False, rows=rows)


def _nbytes(out: StepOutputs) -> int:
    return sum(getattr(out, f.name).nbytes for f in dataclasses.fields(out)
               if isinstance(getattr(out, f.name), np.ndarray))

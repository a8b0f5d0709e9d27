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
                 (store a snapshot's K/V at the step boundary), `close`; for a pool (one
                 cache whose rows hold the requests of a continuous batch, each step's
                 batch rows mapped to cache rows by `SlotStep.rows`): `assign` (a row
                 handed to a new request), `slots`, `read_bucket_free`.
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

    def more(self, h2d: int, d2h: int) -> None:
        """Bytes of the last step's further exchanges (its logits' answers, `DeviceLogits`)."""
        if not self.h2d:
            self.add(0, 0)
        self.h2d[-1] += int(h2d)
        self.d2h[-1] += int(d2h)

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

    HOOKS = ("step", "snapshot", "write", "close", "assign", "slots", "read_bucket_free")
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

    def write(self, kv: Any, slots: np.ndarray, rows: np.ndarray, *, at: np.ndarray | None = None) -> None:
        """Store the K/V of window rows 0..n-1 of a snapshot's outputs (`kv`) at `slots` [n],
        in the batch rows `rows` [B, n] bool; batch row b goes to cache row `at[b]` [B] (-1:
        nowhere; None: cache row b)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the decode's K/V (default: nothing; dropped with the cache)."""
        return None

    def assign(self, row: int, positions: np.ndarray, valid: np.ndarray) -> None:
        """Cache row `row` now holds a new request: its slot `positions` [S'] int and `valid`
        [S'] bool, S' <= `slots` (the slots past S' invalid). Every K/V entry of the row is
        forgotten, so nothing of its previous occupant can be read."""
        raise NotImplementedError(f"{type(self).__name__} cannot hand a row to a new request (no pooled cache)")

    @property
    def slots(self) -> int:
        """The slots per row this cache holds (a pooled request's S' at most)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how many slots a row holds")

    @property
    def read_bucket_free(self) -> bool:
        """True when a batch row's outputs are bit for bit independent of the read bucket P
        (a step padded with -1 reads to a larger P computes the same), so steps of different
        P may be merged into one call. Default False."""
        return False


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

    @property
    def slots(self) -> int:
        return self.positions.shape[1]

    def assign(self, row: int, positions: np.ndarray, valid: np.ndarray) -> None:
        n = len(positions)
        if n > self.slots or len(valid) != n:
            raise ValueError(f"a request of {n} slots (valid: {len(valid)}) does not fit a cache row of {self.slots}")
        # Copies: the arrays the cache was opened with may be the caller's.
        self.positions = np.array(self.positions)
        self.valid = np.array(self.valid)
        self.positions[row] = 0
        self.positions[row, :n] = positions
        self.valid[row] = False
        self.valid[row, :n] = valid
        self.store.forget(row)
        self._vis = None

    def _pooled(self, req: SlotStep) -> bool:
        return req.rows is not None and not (len(req.rows) == self.positions.shape[0]
                                             and np.array_equal(req.rows, np.arange(len(req.rows))))

    def _visibility(self, req: SlotStep) -> np.ndarray:
        if req.geometry is not None and self._vis is not None and self._vis[0] == req.geometry:
            return self._vis[1]
        positions, valid, written = self.positions, self.valid, self.store.written if req.written_only else None
        if self._pooled(req):
            r = np.maximum(req.rows, 0)
            live = (req.rows >= 0)[:, None]
            positions, valid = positions[r], valid[r] & live
            written = None if written is None else written[r] & live
        vis = slot_visibility(self.config, req, positions, valid, written)
        if req.geometry is not None:
            self._vis = (req.geometry, vis)
        return vis

    def _inputs(self, req: SlotStep, *, kv: bool) -> StepInputs:
        read = req.read  # [B, P]
        used = np.flatnonzero((read >= 0).any(axis=0))
        n = int(used[-1]) + 1 if len(used) else 0  # past the last read slot: padding
        # Excluded slots (-1) inside the list take any slot's K/V: nobody sees them.
        if not self._pooled(req) and (read[:, :n] == read[:1, :n]).all():
            # One list for every row (every decode's own steps): gathered as one slice copy.
            k_cache, v_cache = self.store.gather(np.maximum(read[0, :n], 0), req.key.cache)
        else:
            k_cache, v_cache = self.store.gather(np.maximum(read[:, :n], 0), req.key.cache, rows=req.cache_rows())
        return StepInputs(tokens=req.tokens, positions=req.positions, visibility=self._visibility(req),
                          k_cache=k_cache, v_cache=v_cache, logit_rows=req.logit_rows,
                          want=dataclasses.replace(req.want, kv=kv), lora_gate=req.lora_gate)

    def step(self, req: SlotStep, *, timings: dict[str, float] | None = None) -> StepOutputs:
        writes = req.write >= 0
        if req.rows is not None:
            writes = writes & (req.rows >= 0)[:, None]  # a padding row writes nothing
        inputs = self._inputs(req, kv=bool(writes.any()))
        out = self.executor.step(inputs) if timings is None else self.executor.step(inputs, timings=timings)
        if writes.any():
            rows = np.flatnonzero(writes.any(axis=0))
            self.store.write_at(np.where(writes, req.write, -1)[:, rows], out.k_new[:, :, rows], out.v_new[:, :, rows],
                                at=req.rows)
        self.transfers.add(sum(a.nbytes for a in inputs.arrays()), _nbytes(out))
        return dataclasses.replace(out, k_new=None, v_new=None)

    def snapshot(self, req: SlotStep, executor: Any) -> Snapshot:
        inputs = self._inputs(req, kv=True)
        self.transfers.add(sum(a.nbytes for a in inputs.arrays()), 0)

        def run() -> StepOutputs:
            out = executor.step(inputs)
            return dataclasses.replace(out, k_new=None, v_new=None, kv=(out.k_new, out.v_new))

        return run

    def write(self, kv: Any, slots: np.ndarray, rows: np.ndarray, *, at: np.ndarray | None = None) -> None:
        k, v = kv
        n = len(slots)
        if at is None and k.shape[1] == self.store.k.shape[1]:
            self.store.write(slots, k[:, :, :n], v[:, :, :n], stable=False, rows=rows)
        else:
            at = np.arange(k.shape[1]) if at is None else at
            self.store.write_rows(slots, k, v, keep=rows, at=at)


def _nbytes(out: StepOutputs) -> int:
    return sum(getattr(out, f.name).nbytes for f in dataclasses.fields(out)
               if isinstance(getattr(out, f.name), np.ndarray))

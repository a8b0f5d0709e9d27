"""Decode state that stays where the step runs (NumPy only).

The K/V of a decode belong to its executor: `Executor.open` returns a `KVCache` that holds
them (device arrays for the JAX executor, NumPy arrays beside a LiteRT interpreter) with the
decode's slot positions and validity, uploaded once. The host runtime keeps what it decides
with (token states, which slots hold K/V from which token) and tells the cache, per step, by
index which slots the step reads, which window rows it writes where, and which rows' K/V it
keeps for later: a `SlotStep`. What crosses to the executor each step is that plan (token ids,
positions, flags, slot indices); what comes back is what the proposer reads.

  SlotStep       one step as indices: window tokens and positions, the slots it reads, the
                 slots its rows' K/V are written to, leave-one-out rows, the rows predicted.
  KVCache        the protocol: `step` (read, compute, write in place), `snapshot` (read now,
                 run later, possibly on a fork on another thread: the CPU path), `write`
                 (store a snapshot's K/V at the step boundary), `close`.
  HostKVCache    the cache of any executor with a dense step (`Executor.step(StepInputs)`:
                 the LiteRT runner, the bundle cache, test mocks): NumPy K/V gathered into the
                 step's `k_cache`/`v_cache` inputs, which the executor then copies into its own
                 buffers (LiteRT: `dlm_jax.runner._Signature.run` says why). Those per-step
                 copies of the read slots are what this design leaves (the bytes handed over
                 are counted in `Transfers.h2d`); the JAX executor's cache
                 (`dlm_jax.program.DeviceKVCache`) has neither.
  slot_visibility  the attention mask of a `SlotStep` (the JAX executor builds the same one
                 on the device).

Axes: B batch rows, S slots of the decode, W window bucket, P read bucket, R logit rows,
L layers, Hkv K/V heads, Dh head width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._masks import leave_one_out, visibility_from_positions
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.hooks import HookBase
from dlm_jax.runtime.kvstore import KVStore
from dlm_jax.runtime.step import OutputRequest, StepInputs, StepOutputs


@dataclasses.dataclass(frozen=True, eq=False)
class SlotStep:
    """One step of a decode, as indices into the decode's [B, S] slot grid, padded to `key`.

    tokens, positions: [B, W] the window rows' inputs (padding rows: anything).
    q_valid: [B, W] bool, rows that are real (not bucket padding, not left padding).
    read: [P] int32 slots whose stored K/V the step reads, in order (-1: none, padding).
    read_len: [B] int32, how many of `read`'s columns each batch row reads (a row's cache
      length when rows hold caches of different lengths, ISD); None: all of them.
    probes: [W] bool, leave-one-out rows: no other row sees their keys.
    hide: [W] int32 key column (0..P+W, cache columns first) a row may not see (-1: none).
    write: [B, W] int32 the slot each window row's K/V are stored to, per batch row (-1: not
      stored).
    logit_rows: [B, R] int32 rows whose predictions are returned.
    want: `logits` asks for the rows' logits; `kv` keeps the rows' K/V (`StepOutputs.kv`) for
      a later `KVCache.write` instead of storing them now.
    written_only: read slots count only in the batch rows that have stored them (the CPU
      path); otherwise wherever the row is valid.
    geometry: equal numbers mark steps of one decode whose arrays other than tokens and write
      are identical (a cache may reuse what it built from them); None: no reuse.
    """

    key: BucketKey
    tokens: np.ndarray
    positions: np.ndarray
    q_valid: np.ndarray
    read: np.ndarray
    probes: np.ndarray
    hide: np.ndarray
    write: np.ndarray
    logit_rows: np.ndarray
    want: OutputRequest = OutputRequest(kv=False)
    written_only: bool = False
    geometry: int | None = None
    read_len: np.ndarray | None = None
    lora_gate: np.ndarray | None = None  # [B, W] float32 (`StepInputs.lora_gate`), for a gated executor

    def lengths(self) -> np.ndarray:
        """[B] int32 `read_len`, all of `read` where it is None."""
        if self.read_len is not None:
            return self.read_len
        return np.full(self.tokens.shape[0], len(self.read), np.int32)

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-step arrays a device receives, by name."""
        return {"tokens": self.tokens, "positions": self.positions, "q_valid": self.q_valid, "read": self.read,
                "read_len": self.lengths(), "probes": self.probes, "hide": self.hide, "write": self.write,
                "logit_rows": self.logit_rows, **({} if self.lora_gate is None else {"lora_gate": self.lora_gate})}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())


def mask_rows_gate(tokens: np.ndarray, mask_id: int) -> np.ndarray:
    """`SlotStep.lora_gate` of window `tokens` [B, W]: 1.0 on rows fed the mask (R-ISD's
    proposal rows, and bucket padding), 0.0 on rows fed a token (base weights only)."""
    return (tokens == mask_id).astype(np.float32)


def slot_visibility(config: ModelConfig, req: SlotStep, positions: np.ndarray, valid: np.ndarray,
                    written: np.ndarray | None = None) -> np.ndarray:
    """[B, W, P+W] bool: what each row of `req` may attend to, from the decode's slot
    `positions` / `valid` [B, S] (and `written` [B, S] for `req.written_only`).

    Cache columns are the read slots (a row sees them by the attention rule where the slot is
    valid); window columns are the rows themselves (seen where real). A probe row's key is seen
    by that row only; `hide` takes one more column from a row."""
    read = req.read
    ok = read >= 0
    idx = np.where(ok, read, 0)
    k_pos = np.concatenate([np.where(ok, positions[:, idx], 0), req.positions], axis=1)
    k_ok = ok & valid[:, idx]
    if req.read_len is not None:
        k_ok = k_ok & (np.arange(len(read))[None, :] < req.read_len[:, None])
    if req.written_only:
        k_ok = k_ok & written[:, idx]
    k_ok = np.concatenate([k_ok, req.q_valid], axis=1)
    vis = visibility_from_positions(config.attention, req.positions, k_pos, k_ok, block_size=config.block_size)
    probes = np.flatnonzero(req.probes)
    leave_one_out(vis, probes, req.hide[probes], k_offset=len(read))
    rows = np.flatnonzero((req.hide >= 0) & ~req.probes)  # a hidden column on a row that is no probe
    vis[:, rows, req.hide[rows]] = False
    return vis


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

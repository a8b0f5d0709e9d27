"""The host K/V store: per-slot keys and values with versions (NumPy only).

The store owns the K/V of every slot of the [B, S] grid that a step has written. Each write
bumps the written slots' version numbers and marks each entry stable (computed from a final
token: prompt or committed) or revisable (computed from a mask, a draft or a visible token
that may still change). Steps read the store by exact slot lists; a gathered, padded cache is
reused only while the slots and their versions are exactly those it was built from.

Axes: L layers, B batch rows, S slots, Hkv key/value heads, Dh head width, n a slot list,
P a cache bucket.
"""

from __future__ import annotations

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax.runtime.state import as_index


class KVStore:
    def __init__(self, n_layers: int, batch: int, slots: int, n_kv_heads: int, head_dim: int,
                 dtype: str = "float32"):
        shape = (n_layers, batch, slots, n_kv_heads, head_dim)
        self.k = np.zeros(shape, dtype)  # [L, B, S, Hkv, Dh]
        self.v = np.zeros(shape, dtype)
        self.version = np.zeros((batch, slots), np.int64)  # [B, S], 0 = never written
        self.stable = np.zeros((batch, slots), bool)  # [B, S], False = revisable or unwritten
        self.writes = 0  # writes so far: while unchanged, no version has changed
        self._memo: tuple | None = None  # (slots, size, writes, versions, (k, v)) of the last gather

    @classmethod
    def for_model(cls, config: ModelConfig, batch: int, slots: int) -> KVStore:
        return cls(config.n_layers, batch, slots, config.n_kv_heads, config.head_dim, config.dtype)

    @property
    def written(self) -> np.ndarray:
        """[B, S] bool, slots holding K/V."""
        return self.version > 0

    def write(self, slots: np.ndarray, k: np.ndarray, v: np.ndarray, *, stable: np.ndarray | bool,
              rows: np.ndarray | None = None) -> None:
        """Store k, v [L, B, n, Hkv, Dh] (extra entries past n, a bucket's padding, are
        ignored) at `slots` [n] of every row; `stable` is [B, n] bool or one bool. With
        `rows` [B, n] bool, only those entries are written."""
        n = len(slots)
        if rows is not None:
            keep = rows[None, :, :, None, None]
            k = np.where(keep, k[:, :, :n], self.k[:, :, slots])
            v = np.where(keep, v[:, :, :n], self.v[:, :, slots])
            self.version[:, slots] += rows
            self.stable[:, slots] = np.where(rows, stable, self.stable[:, slots])
        else:
            self.version[:, slots] += 1
            self.stable[:, slots] = stable
        self.k[:, :, slots] = k[:, :, :n]
        self.v[:, :, slots] = v[:, :, :n]
        self.writes += 1

    def write_at(self, slots: np.ndarray, k: np.ndarray, v: np.ndarray, *, at: np.ndarray | None = None) -> None:
        """Store k, v [L, B, n, Hkv, Dh] at per-row `slots` [B, n] (-1: not stored), as
        revisable entries, batch row b into store row `at[b]` (-1: nowhere; None: row b).
        Rows that store nothing are untouched."""
        keep = slots >= 0
        if at is not None:
            keep &= (np.asarray(at) >= 0)[:, None]
        b, j = np.nonzero(keep)
        if not len(b):
            return
        s = slots[b, j]
        r = b if at is None else np.asarray(at)[b]
        self.k[:, r, s] = k[:, b, j]
        self.v[:, r, s] = v[:, b, j]
        self.version[r, s] += 1
        self.stable[r, s] = False
        self.writes += 1

    def write_rows(self, slots: np.ndarray, k: np.ndarray, v: np.ndarray, *, keep: np.ndarray,
                   at: np.ndarray) -> None:
        """Store k, v [L, B, n, Hkv, Dh] (entries past n ignored) at `slots` [n] of store rows
        `at` [B] (-1: a batch row stored nowhere), where `keep` [B, n] bool, as revisable
        entries: a snapshot's K/V written back into a pooled store."""
        b, j = np.nonzero(np.asarray(keep, bool) & (np.asarray(at)[:, None] >= 0))
        if not len(b):
            return
        r, s = np.asarray(at)[b], np.asarray(slots)[j]
        self.k[:, r, s] = k[:, b, j]
        self.v[:, r, s] = v[:, b, j]
        self.version[r, s] += 1
        self.stable[r, s] = False
        self.writes += 1

    def forget(self, row: int) -> None:
        """Row `row` holds nothing: its K/V zeroed, its entries unwritten (a pooled store's row
        handed to a new request; nothing of the previous one can be read)."""
        self.k[:, row] = 0
        self.v[:, row] = 0
        self.version[row] = 0
        self.stable[row] = False
        self.writes += 1
        # Versions restart at 0, so a memo built before could match again: drop it.
        self._memo = None

    def gather(self, slots: np.ndarray, size: int, *, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(k, v) [L, B, size, Hkv, Dh] of `slots`, zero-padded to `size` >= n: [n] read by
        every row of the store, or [B', n] per batch row from store rows `rows` [B'] (-1: a
        padding row, zeros; None: row b is store row b). The last result is reused when the
        slots, rows and their versions are unchanged; do not write into it."""
        slots = np.asarray(slots)
        if slots.ndim == 2 or rows is not None:
            return self._gather_rows(slots, size, rows)
        memo = self._memo
        if memo is not None and memo[0] == slots.tobytes() and memo[1] == size:
            if memo[2] == self.writes or memo[3] == self.version[:, slots].tobytes():
                return memo[4]
        self._memo = (slots.tobytes(), size, self.writes, self.version[:, slots].tobytes(),
                      (self._take(self.k, slots, size), self._take(self.v, slots, size)))
        return self._memo[4]

    def _gather_rows(self, slots: np.ndarray, size: int, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        batch = slots.shape[0] if slots.ndim == 2 else len(rows)
        rows = np.arange(batch) if rows is None else np.asarray(rows)
        slots = np.ascontiguousarray(np.broadcast_to(slots, (batch, slots.shape[-1])))
        n = slots.shape[1]
        if n > size:
            raise ValueError(f"{n} cached slots do not fit a cache bucket of {size}")
        r = np.maximum(rows, 0)[:, None]
        # The memo key holds the rows (and a padding row's -1), and the versions of every
        # (row, slot) pair read: a write or a `forget` anywhere else keeps it.
        tag = ("rows", slots.tobytes(), rows.tobytes())
        memo = self._memo
        versions = self.version[r, slots].tobytes()
        if memo is not None and memo[0] == tag and memo[1] == size and (memo[2] == self.writes or memo[3] == versions):
            return memo[4]
        live = (rows >= 0)[None, :, None, None, None]
        out = []
        for x in (self.k, self.v):
            got = np.zeros(x.shape[:1] + (batch, size) + x.shape[3:], x.dtype)
            # x[:, r, slots]: [L, B', n, Hkv, Dh], the (row, slot) pairs
            got[:, :, :n] = np.where(live, x[:, r, slots], 0)
            out.append(got)
        self._memo = (tag, size, self.writes, versions, tuple(out))
        return self._memo[4]

    @staticmethod
    def _take(x: np.ndarray, slots: np.ndarray, size: int) -> np.ndarray:
        n = len(slots)
        if n > size:
            raise ValueError(f"{n} cached slots do not fit a cache bucket of {size}")
        out = np.zeros(x.shape[:2] + (size,) + x.shape[3:], x.dtype)
        out[:, :, :n] = x[:, :, as_index(slots)]  # a run of slots is one slice copy, no gather
        return out

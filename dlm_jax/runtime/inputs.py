"""Step requests from a plan: the plan's slots as indices, padded to the executor's bucket
(NumPy only).

Tokens and the write targets are rebuilt every step. Positions, validity, the read slots,
leave-one-out rows and logit rows depend only on the decode's state (its positions and
padding never change) and the plan's slot lists, so they are reused, under one `geometry`
number, while the state and the window, cached and row lists are exactly the same. No K/V
pass through here: the executor's `KVCache` holds them. Nothing is keyed on a range's
endpoints.

Axes: B batch rows, W window bucket, P cache bucket, R row bucket.
"""

from __future__ import annotations

import dataclasses

import itertools
from collections.abc import Set

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax.runtime.buckets import BucketKey, pad_axis
from dlm_jax.runtime.scheduler import StepPlan
from dlm_jax.runtime.state import DecodeState
from dlm_jax.runtime.step import Capabilities, OutputRequest, SlotStep, mask_rows_gate


_GEOMETRY = itertools.count(1)  # unique across builders: a cache never mistakes one for another


class StepInputBuilder:
    """Builds the padded `StepInputs` of each plan of one decode.

    `prefer`: buckets already prepared (warmed). A step runs in the cheapest of them that
    holds it and has the bucket's window and cache size the executor would pick, even where
    its rows bucket is larger than the step needs (the extra rows are padding), so that a
    warmed decode never waits for a build; otherwise in the bucket the executor picks."""

    def __init__(self, config: ModelConfig, capabilities: Capabilities, *, prefer: Set[BucketKey] = frozenset()):
        self.config = config
        self.capabilities = capabilities
        self._static: tuple | None = None  # (key, (positions, visibility, logit_rows))
        self._empty: dict = {}
        self._by_size: dict[tuple, list[BucketKey]] = {}  # (batch, window, cache, logits) -> preferred keys
        for k in prefer:
            self._by_size.setdefault((k.batch, k.window, k.cache, k.full_logits, k.router_topk, k.ffn_active),
                                     []).append(k)
        for keys in self._by_size.values():
            keys.sort(key=lambda k: k.rows)
        self._memo: dict[tuple, BucketKey] = {}
        self._want: tuple | None = None  # (an OutputRequest, it without K/V)

    def key(self, plan: StepPlan, batch: int, want: OutputRequest) -> BucketKey:
        shape = (batch, *plan.shape, want.logits, want.router_topk, want.ffn_active)
        key = self._memo.get(shape)
        if key is None:
            _, w, p, r, logits, topk, active = shape
            key = self.capabilities.select(batch=batch, window=w, cache=p, rows=r, logits=logits, router_topk=topk,
                                           ffn_active=active)
            held = self._by_size.get((key.batch, key.window, key.cache, key.full_logits, key.router_topk,
                                      key.ffn_active), ())
            key = next((k for k in held if k.rows >= r), key)
            self._memo[shape] = key
        return key

    def build(self, plan: StepPlan, state: DecodeState, want: OutputRequest) -> SlotStep:
        """The step of `plan` as indices, padded to its bucket: window tokens and positions,
        the read slots, where the stored rows go (`plan.store`, `plan.store_rows`)."""
        key = self.key(plan, state.batch, want)
        if plan.offset is not None:
            return self._build_ragged(plan, state, key, want)
        tokens = state.fed_tokens(plan.window_index)
        if plan.probes is not None and len(plan.probes):
            tokens = np.concatenate([tokens, self._probe_tokens(plan, state, tokens)], axis=1)
        tokens = pad_axis(tokens.astype(np.int32, copy=False), key.window, axis=1, value=state.mask_id)
        # The state (held, so compared by identity) fixes positions and padding.
        probes = b"" if plan.probes is None else plan.probes.tobytes()
        static_key = (state, key, plan.window.tobytes(), plan.cached.tobytes(), plan.rows.tobytes(), probes)
        if self._static is None or self._static[0] != static_key:
            self._static = (static_key, self._static_inputs(plan, state, key), next(_GEOMETRY))
        (positions, q_valid, read, is_probe, hide, logit_rows), geometry = self._static[1], self._static[2]
        return SlotStep(key=key, tokens=tokens, positions=positions, q_valid=q_valid, read=read, probes=is_probe,
                        hide=hide, write=self._write(plan, state, key, plan.window), logit_rows=logit_rows,
                        want=self._no_kv(want), geometry=geometry,
                        read_len=self._lengths(plan), lora_gate=self._gate(tokens, state))

    def _no_kv(self, want: OutputRequest) -> OutputRequest:
        """`want` without K/V outputs (made once per decode: `dataclasses.replace` is slow)."""
        if self._want is None or self._want[0] is not want:
            self._want = (want, dataclasses.replace(want, kv=False))
        return self._want[1]

    def _write(self, plan: StepPlan, state: DecodeState, key: BucketKey, window: np.ndarray) -> np.ndarray:
        """[B, W] the slot each stored window row's K/V go to (`plan.store`, `plan.store_rows`),
        -1 elsewhere; `window` is the window's slots, [w] shared or [B, w] per batch row."""
        if plan.store is None or not len(plan.store):
            return self._no_write(state.batch, key.window)
        write = self._no_write(state.batch, key.window).copy()
        stored = np.broadcast_to(window[..., plan.store], (state.batch, len(plan.store)))
        write[:, plan.store] = stored if plan.store_rows is None else np.where(plan.store_rows, stored, -1)
        return write

    def _gate(self, tokens: np.ndarray, state: DecodeState) -> np.ndarray | None:
        """`lora_gate` for an executor that takes one (`mask_rows_gate`)."""
        return mask_rows_gate(tokens, state.mask_id) if "lora_gate" in self.capabilities.inputs else None

    @staticmethod
    def _lengths(plan: StepPlan) -> np.ndarray | None:
        return None if plan.cache_len is None else np.asarray(plan.cache_len, np.int32)

    def _build_ragged(self, plan: StepPlan, state: DecodeState, key: BucketKey, want: OutputRequest) -> SlotStep:
        """A plan whose batch rows sit at their own `offset`s: every per-row array is gathered
        along its row; nothing is reused between steps (the offsets move every step)."""
        if plan.probes is not None and len(plan.probes):
            raise ValueError("a plan with per-row offsets cannot carry leave-one-out probes")
        slots = plan.window_index  # [B, w]
        tokens = pad_axis(state.fed_tokens(slots), key.window, axis=1, value=state.mask_id)
        positions = pad_axis(np.take_along_axis(state.positions, slots, axis=1), key.window, axis=1).astype(np.int32)
        q_valid = pad_axis(np.take_along_axis(state.valid, slots, axis=1), key.window, axis=1, value=False)
        read = _rows(pad_axis(plan.cached.astype(np.int32), key.cache, axis=0, value=-1), state.batch)
        rows = pad_axis(plan.rows, key.rows, axis=0)
        logit_rows = np.ascontiguousarray(np.broadcast_to(rows, (state.batch, key.rows)).astype(np.int32))
        return SlotStep(key=key, tokens=tokens, positions=positions, q_valid=q_valid, read=read,
                        probes=np.zeros((state.batch, key.window), bool),
                        hide=np.full((state.batch, key.window), -1, np.int32),
                        write=self._write(plan, state, key, slots),
                        logit_rows=logit_rows, want=self._no_kv(want),
                        read_len=self._lengths(plan), lora_gate=self._gate(tokens, state))

    @staticmethod
    def _window_rows(plan: StepPlan, slots: np.ndarray) -> np.ndarray:
        """The window row of each slot (-1: not in the window)."""
        order = np.argsort(plan.window, kind="stable")
        i = np.minimum(np.searchsorted(plan.window, slots, sorter=order), len(order) - 1)
        return np.where(plan.window[order[i]] == slots, order[i], -1)

    def _probe_rows(self, plan: StepPlan, state: DecodeState) -> np.ndarray:
        """[D] the window rows whose queries the probes duplicate."""
        return self._window_rows(plan, plan.probes - state.shift)

    def _probe_tokens(self, plan: StepPlan, state: DecodeState, fed: np.ndarray) -> np.ndarray:
        if state.shift:  # the predicting row keeps its own token; only the probed slot is hidden
            return fed[:, self._probe_rows(plan, state)]
        return np.full((state.batch, len(plan.probes)), state.mask_id, fed.dtype)

    def _static_inputs(self, plan: StepPlan, state: DecodeState, key: BucketKey):
        win, cached = plan.window, plan.cached
        w, d = len(win), 0 if plan.probes is None else len(plan.probes)
        src = self._probe_rows(plan, state) if d else np.zeros(0, int)
        q_slots = np.concatenate([win, win[src]])
        positions = pad_axis(state.positions[:, q_slots], key.window, axis=1).astype(np.int32, copy=False)
        q_valid = pad_axis(state.valid[:, q_slots], key.window, axis=1, value=False)
        read = pad_axis(cached.astype(np.int32), key.cache, axis=0, value=-1)
        is_probe = np.zeros(key.window, bool)
        hide = np.full(key.window, -1, np.int32)
        if d:
            is_probe[w:w + d] = True
            own = self._window_rows(plan, plan.probes)
            hide[w:w + d] = np.where(own >= 0, key.cache + own, -1)
        rows = pad_axis(np.concatenate([plan.rows, np.arange(w, w + d)]), key.rows, axis=0)
        logit_rows = np.ascontiguousarray(np.broadcast_to(rows, (state.batch, key.rows)).astype(np.int32))
        b = state.batch
        return positions, q_valid, _rows(read, b), _rows(is_probe, b), _rows(hide, b), logit_rows

    def _no_write(self, batch: int, width: int) -> np.ndarray:
        if (batch, width) not in self._empty:
            self._empty[(batch, width)] = np.full((batch, width), -1, np.int32)
        return self._empty[(batch, width)]


def _rows(shared: np.ndarray, batch: int) -> np.ndarray:
    """[batch, n] contiguous copies of a list every batch row of one decode shares (the step
    contract's per-row `read`, `probes`, `hide`)."""
    return np.ascontiguousarray(np.broadcast_to(shared, (batch, len(shared))))

"""The CPU path of dual-path progressive revision: sparse refresh of visible tokens that
have left the window, beside the main step, merged at the step boundary (NumPy only).

One refresh is one step of a second executor (the main one's `fork()`, which reads the same
weights; the main executor itself, run in turn, when it cannot fork) whose queries are the
selected visible slots at their positions, fed their current tokens, over every stored K/V
entry except those slots' own (they are recomputed). With `revisit="remask"` each slot also
gets a duplicate query fed the mask, which sees neither the slot's entry nor its token row:
its prediction is the leave-one-out score. The remask CPU path also picks visible slots still
inside the window that the window's own probe rows leave out (scored only: their K/V come from
the window). Outputs: a new top token and probability per slot (-> promote, revise)
and the K/V of the slots left of the window, computed from the tokens fed (-> the store; a
slot whose token the refresh replaced keeps a stale entry and is refreshed first next time).

Axes: B batch rows, n refreshed slots, W window bucket, P cache bucket.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax.runtime.buckets import pad_axis
from dlm_jax.runtime.cpu_path import CpuExecutor, CpuPath
from dlm_jax.runtime.kvcache import KVCache
from dlm_jax.runtime.proposer import Proposer, predicted
from dlm_jax.runtime.state import DecodeState, TokenState
from dlm_jax.runtime.step import OutputRequest, SlotStep, StepOutputs, mask_rows_gate

_VISIBLE = int(TokenState.VISIBLE)


@dataclasses.dataclass
class _Job:
    slots: np.ndarray  # [n]
    fed: np.ndarray  # [B, n] the tokens fed (the slots' identities at submission)
    scored: np.ndarray  # [B, n] bool, (row, slot) pairs that were visible at submission
    left: np.ndarray  # [n] bool, slots left of the main window at submission (their K/V are written)
    result: concurrent.futures.Future | StepOutputs  # with the rows' K/V kept where the step ran (`kv`)


class Refresher(CpuPath):
    """The CPU path of one decode: `submit` before a main step, `merge` after it. It keeps
    no step inputs past the step that used them.

    `cpu.executor` runs the refresh steps: on a thread of its own when `cpu.threaded`, in
    turn otherwise."""

    def __init__(self, policy, config: ModelConfig, cpu: CpuExecutor, proposer: Proposer | None = None):
        self.policy = policy
        # Predictions under the proposer's penalties and bias: the refresh then returns its
        # rows' logits (on this executor's host) and re-predicts from them (`predicted`).
        self.proposer = proposer if proposer is not None and proposer.adjusts else None
        self.scoring = policy.scoring
        self.config = config
        self.executor = cpu.executor
        self.capabilities = cpu.executor.capabilities
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "dlm-refresh") if cpu.threaded else None
        self._job: _Job | None = None

    def select(self, state: DecodeState, before: int, skip: np.ndarray | None = None) -> np.ndarray:
        """Up to `refresh_rows` tracked visible slots left of `before` (the main window's
        start; its end with `revisit="remask"`), but not `skip` (slots the window probes):
        stale K/V first, then the lowest last confidence, then the lowest position."""
        run = state.active
        vis = (state.status[:, :before] == _VISIBLE) & run[:, None]
        if skip is not None and len(skip):
            vis[:, skip[skip < before]] = False
        slots = np.flatnonzero(vis.any(axis=0))
        if not len(slots):
            return slots
        stale = ((state.kv_token[:, slots] != state.tokens[:, slots]) & vis[:, slots]).any(axis=0)
        conf = np.where(vis[:, slots], np.nan_to_num(state.confidence[:, slots], nan=0.0), np.inf).min(axis=0)
        order = np.lexsort((slots, conf, ~stale))
        return np.sort(slots[order[:self.policy.refresh_rows]])

    def submit(self, state: DecodeState, cache: KVCache, plan) -> None:
        """Start a refresh from the state and K/V as they are now (before the main step)."""
        start = int(plan.window[0])
        slots = self.select(state, self.scoring.refresh_end(plan), plan.probes)
        if not len(slots):
            return
        run = cache.snapshot(self._request(state, slots), self.executor)
        scored = (state.status[:, slots] == _VISIBLE) & state.active[:, None]
        fed = state.tokens[:, slots].copy()
        state.count("refresh_steps")
        state.count("refresh_rows", len(slots))
        result = self._pool.submit(run) if self._pool else run()
        self._job = _Job(slots, fed, scored, slots < start, result)

    def _request(self, state: DecodeState, slots: np.ndarray) -> SlotStep:
        """Queries at `slots` fed their tokens (and, with remask, a mask row per slot that
        does not see the slot's own token row), over every stored entry but the slots' own."""
        n, b = len(slots), state.batch
        copies = self.scoring.refresh_copies  # 2: a duplicate mask row per slot scores it
        rows = copies * n
        cached = np.flatnonzero((state.kv_token >= 0).any(axis=0))
        key = self.capabilities.select(batch=b, window=rows, cache=len(cached), rows=rows,
                                       logits=self.proposer is not None)
        tokens = state.tokens[:, slots]
        tokens = np.concatenate([tokens] + [np.full_like(tokens, state.mask_id)] * (copies - 1), axis=1)
        read = pad_axis(np.where(np.isin(cached, slots), -1, cached).astype(np.int32), key.cache, axis=0, value=-1)
        probes = np.zeros(key.window, bool)
        hide = np.full(key.window, -1, np.int32)
        if copies > 1:  # mask row n + i sees neither slot i's token row nor (above) its entry
            probes[n:2 * n] = True
            hide[n:2 * n] = key.cache + np.arange(n)
        logit_rows = np.broadcast_to(pad_axis(np.arange(rows), key.rows, axis=0), (b, key.rows)).astype(np.int32)
        tokens = pad_axis(tokens.astype(np.int32), key.window, axis=1, value=state.mask_id)
        return SlotStep(key=key, tokens=tokens,
                        positions=pad_axis(np.tile(state.positions[:, slots], (1, copies)), key.window,
                                           axis=1).astype(np.int32),
                        q_valid=pad_axis(np.ones((b, rows), bool), key.window, axis=1, value=False), read=read,
                        probes=probes, hide=hide, write=np.full((b, key.window), -1, np.int32),
                        logit_rows=np.ascontiguousarray(logit_rows),
                        want=OutputRequest(kv=True, logits=self.proposer is not None), written_only=True,
                        lora_gate=mask_rows_gate(tokens, state.mask_id) if "lora_gate" in self.capabilities.inputs
                        else None)

    def merge(self, state: DecodeState, cache: KVCache) -> None:
        """Apply the pending refresh (the step boundary). Slots whose token or state changed
        since the refresh started are left alone."""
        job, self._job = self._job, None
        if job is None:
            return
        out = job.result.result() if isinstance(job.result, concurrent.futures.Future) else job.result
        n, slots = len(job.slots), job.slots
        q = n * (self.scoring.refresh_copies - 1)  # the rows that score
        top, prob = out.top_token[:, q:q + n], out.top_prob[:, q:q + n].astype(np.float64)
        if self.proposer is not None:
            top, prob = predicted(self.proposer, out.logits[:, q:q + n], state)
        unchanged = job.scored & (state.status[:, slots] == _VISIBLE) & (state.tokens[:, slots] == job.fed)
        self.policy.rescore(state, slots, unchanged, top=top, prob=prob, counter="refresh")
        write = unchanged & job.left[None, :]  # K/V computed from the token fed; a revised slot stays stale
        if write.any():
            cache.write(out.kv, slots, write)
            state.stored(slots, job.fed, write)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

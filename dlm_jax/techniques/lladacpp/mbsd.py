"""Multi-block speculative decoding (llada.cpp §3.2): a window that slides past committed
tokens and looks ahead into later blocks when the current one is nearly done (NumPy only).

A *block* is the unit of left-to-right commitment; the *window* is what one step computes
and may reach past the current block. Future-block slots in the window are *drafts*: they
are denoised and keep a tentative token and confidence, but never enter the K/V store and
are never committed before their block is current; then they are re-evaluated against the
commit criterion.

`SpeculativeWindow` is the scheduler. Each switch works alone:

  sliding     the window starts at the first slot whose K/V are not yet stored from its
              final or visible token and keeps its width `window_width`, so it enters the
              next block as the current one commits from the left. A committed token stays
              in the window one more forward, which stores its K/V computed from the token
              itself, then leaves it to the cache. The window always reaches the commit
              frontier (the first slot still masked, invisible or draft), and a full width
              past it when the latency table says the wider window costs at most (1 +
              `allowance`) times the base one (on a phone's 32-token tiles, the lag rows
              are nearly free; on a CPU they are not). Off: the window starts at the block, whose
              first step is a full forward that refreshes the store (Fast-dLLM's prefix
              cache).
  trigger     adaptive look-ahead: when the current block has at most `trigger` undecided
              slots, the window is filled to its bucket (free work) and grown bucket by
              bucket while the latency table says a step costs at most (1 + `allowance`)
              times the base bucket and the window stays within `max_window` (the memory
              budget). 0: off.
  suffix      compute every slot after the window too (Fast-dLLM's prefix cache keeps the
              masked suffix as context); off: the window only (llada.cpp).
  draft_input `token`: a draft is fed to later forwards as its token (it conditions the
              rest), scored in place, accepted when its block becomes current if its
              in-place confidence passes `draft_threshold`, else returned to MASK; `mask`:
              a draft stays invisible (fed as the mask, a CANDIDATE with its token) and its
              block's rule decides it like any masked slot.
  skip_stable selective logits skipping: stable slots never request a prediction.

With sliding off, `trigger=0` and `suffix=True`, it is the prefix-cache decoder step for
step; with `suffix=False`, a semi-autoregressive decoder that cuts the sequence at the block's
end.

Latency tables: `latency="phone"` prices windows with `PhoneCostModel.npu()` (stepwise in
32-token tiles, memory-bound up to one tile); a path reads a `dlm-jax profile` table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.buckets import window_buckets
from dlm_jax.runtime.latency import LatencyTable, PhoneCostModel
from dlm_jax.runtime.proposer import Proposal
from dlm_jax.runtime.scheduler import BlockScheduler, Cursor, PlanShape, StepPlan
from dlm_jax.runtime.state import DecodeState, TokenState

# How a draft is fed to later forwards -> whether it is visible (DRAFT) or not (CANDIDATE).
DRAFT_INPUTS: dict[str, bool] = {"token": True, "mask": False}
# Latency tables by name (anything else is a path to a profiled `latency.json`).
LATENCY_MODELS = {"phone": PhoneCostModel.npu, "phone-npu": PhoneCostModel.npu, "phone-cpu": PhoneCostModel.cpu}
_DRAFT, _CANDIDATE, _MASK = int(TokenState.DRAFT), int(TokenState.CANDIDATE), int(TokenState.MASK)
_STABLE = int(TokenState.STABLE)
_FEEDS_FINAL = np.array([True, False, False, False, True, True])  # prompt, visible, stable
# Slots a look-ahead prediction may (re)draft, by whether drafts are visible: by TokenState value.
_DRAFTABLE = {True: np.array([False, True, True, True, False, False]),  # MASK, DRAFT, CANDIDATE
              False: np.array([False, True, False, True, False, False])}  # MASK, CANDIDATE


@functools.lru_cache(maxsize=8)
def latency_table(source: str) -> LatencyTable:
    """The table named by a scheduler's `latency` option: `phone` (the NPU cost model),
    `phone-cpu`, or a path to a profiled `latency.json`."""
    if source in LATENCY_MODELS:
        return LATENCY_MODELS[source]().table(window_buckets(4096).sizes)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"latency={source!r} is neither 'phone', 'phone-cpu' nor a latency table file "
                          f"(write one with `dlm-jax profile`)")
    return LatencyTable.load(path)


def price(table: LatencyTable, window: int, cache: int) -> float:
    """ms of a window in the table: the profiled cache bucket that holds `cache`, or the
    largest profiled one."""
    try:
        return table.lookup(window, cache)
    except KeyError:
        return table.lookup(window, max(e.cache for e in table.entries))


@dataclasses.dataclass(frozen=True)
class SpeculativeWindow(BlockScheduler):
    HOOKS = ("looked_ahead",)
    infills = False  # (its windows slide over the generation's masks: no given suffix)

    window_width: int = dataclasses.field(default=0, metadata={"help": "sliding window width (0: the block length)"})
    sliding: bool = dataclasses.field(default=True, metadata={"help": "slide the window past stored commits"})
    trigger: int = dataclasses.field(
        default=4, metadata={"help": "look ahead when the block has at most this many undecided slots (0: off)"})
    allowance: float = dataclasses.field(
        default=0.25, metadata={"help": "look-ahead latency allowance over the base bucket"})
    latency: str = dataclasses.field(
        default="phone", metadata={"help": "look-ahead latency table: phone, phone-cpu or a latency.json"})
    max_window: int = dataclasses.field(default=128, metadata={"help": "widest window look-ahead may grow to"})
    suffix: bool = dataclasses.field(default=False, metadata={"help": "also compute the masked suffix"})
    draft_input: str = dataclasses.field(
        default="token", metadata={"help": "feed drafts as their token or keep them masked",
                                   "choices": tuple(DRAFT_INPUTS)})
    draft_threshold: float = dataclasses.field(
        default=0.9, metadata={"help": "confidence a draft needs to be kept and accepted"})
    skip_stable: bool = dataclasses.field(
        default=True, metadata={"help": "selective logits skipping: stable slots request no prediction"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("window_width", "trigger", "max_window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{name}={v!r} must be an integer >= 0")
        a = self.allowance
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a) or a < 0:
            raise ConfigError(f"allowance={a!r} must be a finite number >= 0")
        t = self.draft_threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t <= 1:
            raise ConfigError(f"draft_threshold={t!r} must be in (0, 1]")
        if self.draft_input not in DRAFT_INPUTS:
            raise ConfigError(f"draft_input={self.draft_input!r} is not one of {tuple(DRAFT_INPUTS)}")
        if self.sliding and self.suffix:
            raise ConfigError("suffix=True needs sliding=False (a sliding window computes the window only)")
        if self.align:
            raise ConfigError("align=True: speculative windows start at the generation, not at aligned blocks")
        if self.trigger or self.sliding:
            latency_table(self.latency)  # a bad table fails here, not mid-decode

    @property
    def w0(self) -> int:
        return self.window_width or self.block_len

    def for_model(self, model: ModelConfig) -> SpeculativeWindow:
        """This schedule as it is: its windows slide from the generation's first slot, whatever
        a block-causal model's blocks (`BlockScheduler.align` is not implemented here)."""
        return self

    # -- planning ---------------------------------------------------------------------------

    def plan(self, state: DecodeState, cursor: Cursor) -> StepPlan | None:
        if cursor.unit >= self.units(state.gen_len) or not state.active.any():
            return None
        run = state.active
        lo = state.gen_start + cursor.unit * self.block_len
        hi = lo + self.block_len
        total, shift = state.total, state.shift
        first_step = cursor.step == 0
        if self.sliding:
            ready = state.kv_ready()[run]
            frontier = int(np.where(ready.all(axis=1), total, np.argmin(ready, axis=1)).min())
            todo = np.isin(state.status[run, lo:], (_MASK, _CANDIDATE, _DRAFT))
            g = lo + int(np.where(todo.any(axis=1), np.argmax(todo, axis=1), total - lo).min())  # commit frontier
            start = max(cursor.window_start, frontier)
            if g - start > self.w0:
                # A visible token revised at every step never gets K/V of its own token:
                # rather than grow the window, leave it to the cache (stale, for the refresh
                # path) once it lags the commit frontier by a whole window.
                written = state.kv_token[run] >= 0
                unwritten = int(np.where(written.all(axis=1), total, np.argmin(written, axis=1)).min())
                start = max(start, min(g - self.w0, unwritten))
                state.count("window_forced")
            cursor.window_start = start
            a = max(start, state.gen_start)  # the first slot the window predicts
            w_lo = min(start, a - shift)
            p_hi = min(total, max(a + self.w0, g + 1))  # the window keeps its width ...
            if g + self.w0 > p_hi and self._affordable(state, w_lo, g + self.w0 - w_lo):
                p_hi = min(total, g + self.w0)  # ... or reaches a full width past the frontier
                state.count("window_extended")
        else:
            a, p_hi = lo, hi
            w_lo = 0 if first_step else lo - shift
        p_hi = self._look_ahead(state, lo, hi, w_lo, p_hi, run)
        w_hi = total if self.suffix else p_hi
        window = np.arange(w_lo, w_hi)
        status = state.status[:, w_lo:w_hi]
        targets = np.arange(a, p_hi)
        if self.skip_stable:
            final = (state.status[:, a:p_hi] == _STABLE) | ~run[:, None]
            targets = targets[~final.all(axis=0)]
        rows = targets - shift - w_lo
        store = store_rows = None
        if self.sliding or first_step:
            feeds = _FEEDS_FINAL[status] & run[:, None]
            if self.sliding:
                keep = feeds.any(axis=0)
            else:  # the block's full forward stores every slot it may read later
                keep = np.ones(len(window), bool)
            store = np.flatnonzero(keep)
            store_rows = _FEEDS_FINAL[status[:, store]] | (status[:, store] == _MASK)
        return StepPlan(window=window, cached=np.arange(w_lo), rows=rows, targets=targets, unit=cursor.unit,
                        step=cursor.step, store=store, store_rows=store_rows,
                        current=(targets >= lo) & (targets < hi), unit_slots=np.arange(lo, hi))

    def _affordable(self, state: DecodeState, w_lo: int, width: int) -> bool:
        """Whether a window of `width` slots costs at most (1 + allowance) times one of the
        base width, by the latency table."""
        sizes = window_buckets(max(state.total, self.max_window)).sizes
        table = latency_table(self.latency)
        bucket = next((s for s in sizes if s >= width), None)
        if bucket is None or bucket > self.max_window:
            return False
        base = next(s for s in sizes if s >= self.w0)
        return price(table, bucket, w_lo) <= (1 + self.allowance) * price(table, base, w_lo)

    def _look_ahead(self, state: DecodeState, lo: int, hi: int, w_lo: int, p_hi: int, run: np.ndarray) -> int:
        """The end of the predicted range after adaptive look-ahead."""
        if not self.trigger:
            return p_hi
        undecided = np.isin(state.status[run, lo:hi], (_MASK, _CANDIDATE)).sum(axis=1).max()
        if undecided > self.trigger:
            return p_hi
        state.count("lookahead_steps")
        table = latency_table(self.latency)
        sizes = window_buckets(max(state.total, self.max_window)).sizes
        live = p_hi - w_lo
        base = next(s for s in sizes if s >= live)
        chosen, budget = base, (1 + self.allowance) * price(table, base, w_lo)
        for size in sizes:
            if size <= base:
                continue
            if size > self.max_window or w_lo + size > state.total or price(table, size, w_lo) > budget:
                break
            chosen = size
        self.looked_ahead(live, base, chosen)
        return min(state.total, max(p_hi, w_lo + chosen))

    def looked_ahead(self, live: int, base: int, chosen: int) -> None:
        """Hook: a look-ahead grew a window of `live` slots (bucket `base`) to `chosen`."""

    # -- drafts -----------------------------------------------------------------------------

    def settle(self, state: DecodeState, plan: StepPlan, proposal: Proposal, cursor: Cursor) -> np.ndarray:
        """Draft bookkeeping after a step, before the commits: future-block slots passing
        `draft_threshold` become drafts (or keep being ones), failing drafts return to MASK,
        and the current block's drafts are re-evaluated. Returns [B, R] bool, the accepted
        drafts (committed with the proposed token, like the rule's choices)."""
        tgt = plan.target_index
        status = state.status[:, tgt]
        run = state.active[:, None]
        passing = proposal.confidence >= self.draft_threshold
        draft = (status == _DRAFT) & run
        current = plan.current[None, :]
        accepted = draft & current & passing
        if accepted.any():
            same = accepted & (proposal.tokens == state.tokens[:, tgt])
            state.count("drafts_accepted", int(same.sum()))
            state.count("drafts_replaced", int((accepted & ~same).sum()))
        failed = draft & ~passing
        if failed.any():
            state.count("drafts_reverted", int(failed.sum()))
            state.demote(tgt, failed)
        future = ~current & run & passing
        visible = DRAFT_INPUTS[self.draft_input]
        made = _DRAFT if visible else _CANDIDATE  # the state a draft is kept in
        new = future & _DRAFTABLE[visible][status]
        state.count("drafts_made", int((new & (status != made) & (status != _DRAFT)).sum()))
        state.draft(tgt, new, proposal.tokens, visible=visible)
        return accepted

    # -- shapes -----------------------------------------------------------------------------

    def plan_shapes(self, prompt_lens: Sequence[int], gen_len: int, *, shift: int) -> set[PlanShape]:
        """Every shape a decode can take, at bucket granularity: windows of each bucket width up
        to the widest (the lagging slide, or `max_window` with look-ahead) over every cache
        size the window can start at, and the first windows over no cache. Not tight: some of
        them a given decode never reaches, and warm-up prepares them all."""
        p_max = max(prompt_lens)
        total = p_max + gen_len
        sizes = window_buckets(max(total, self.max_window)).sizes
        if not self.sliding:  # a full forward from slot 0 at each block start, then from the block
            starts = {p_max + u * self.block_len - shift for u in range(self.units(gen_len))}
            reach = next(s for s in sizes if s >= self.block_len + shift)
            widest = max(reach, self.max_window if self.trigger else reach)
            shapes = {PlanShape(s, 0, min(s, gen_len + shift)) for s in sizes if s < total} | {
                PlanShape(total, 0, gen_len + shift)}
            for c in starts:
                top = total - c if self.suffix else min(widest, total - c)
                shapes |= {PlanShape(min(s, top), c, min(s, top)) for s in sizes if s < top} | {PlanShape(top, c, top)}
            return shapes
        lag = next(s for s in sizes if s >= min(2 * self.w0, total))
        widest = total if self.suffix else max(lag, self.max_window if self.trigger else lag)
        first = next((s for s in sizes if s >= p_max + widest), total)
        shapes = {PlanShape(s, 0, min(s, gen_len + shift)) for s in sizes if s <= min(first, total)}
        for c in range(max(p_max - shift, 0), total):
            shapes |= {PlanShape(min(s, total - c), c, min(s, total - c)) for s in sizes if s <= widest}
        return shapes

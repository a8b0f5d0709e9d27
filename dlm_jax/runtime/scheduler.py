"""Schedulers: which slots each decode step computes, reads from the K/V store, predicts and
stores, and when a request is done (NumPy only).

A scheduler looks at the `DecodeState` and returns the next `StepPlan`, or None when decoding
is over. It also states, for warm-up, every plan shape it can produce for a prompt length, so
all buckets are compiled before the first step. A scheduler decodes the generation in commit
units (blocks); the commit rule says when a unit is finished and `advance` moves on.

Today's schedules are block-wise (Fast-dLLM's semi-autoregressive blocks):
  NoCache      LLaDA: the whole sequence every step, nothing stored.
  PrefixCache  Fast-dLLM prefix cache: a full forward at each block's first step stores every
               slot's K/V; later steps compute the block and everything after it over the
               cached prefix.
  DualCache    Fast-dLLM dual cache: as PrefixCache, but later steps compute the block only,
               over the cached prefix and suffix.

Writing a new scheduler: subclass `Scheduler` and implement `units`, `plan`, `advance` and
`plan_shapes`; `start` and `settle` have defaults. `plan` must only name slots of the state's
grid; `advance` is told whether the commit rule finished the unit and moves the decode's
`Cursor` (the scheduler's own state, made by `start`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.hooks import HookBase
from dlm_jax.runtime.state import DecodeState, Index, TokenState, as_index

if TYPE_CHECKING:
    from dlm_jax.runtime.proposer import Proposal


class PlanShape(NamedTuple):
    """Live sizes of a plan: window slots, cached slots, predicted rows."""

    window: int
    cached: int
    rows: int


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """One step. Slot arrays index the state's [B, S] grid and are shared by every row.

    window: [W] slots fed as queries, in window-row order.
    cached: [P] slots whose K/V are read from the store.
    rows: [R] window rows whose predictions are wanted ...
    targets: [R] ... and the slot each predicts (row's slot + the logit shift).
    unit, step: the commit unit and the step within it.
    store: [n] window rows whose K/V are written to the store (None: none).
    store_rows: [B, n] bool, which of the store's entries are written (None: all); entries
      computed from drafts never are.
    current: [R] bool, the targets in the current commit unit (None: all of them); the
      others are look-ahead rows (drafts), which the rule never commits. [B, R] when the
      batch rows' units sit at different slots (aligned blocks of prompts of several lengths).
    unit_slots: the slots of the current commit unit (None: the targets, those `current`
      where it is given); a rule begins and finishes the unit over these.
    probes: [D] targets also scored leave-one-out (None: none): each gets a query row after
      the window, at the position of the row that predicts it, fed the mask (the row's token
      under a logit shift), that sees what that row sees except the probed slot and that no
      other row sees. Its prediction is requested after the `rows`'; its K/V are never stored.
    offset: [B] int, per batch row (None: 0): row b's window, targets, stored and unit slots
      are the lists above plus offset[b], so requests of one batch can sit at different
      places of their generations (ISD, left to right); `cached` is shared.
    cache_len: [B] int (None: all): row b reads the first cache_len[b] slots of `cached`.
    """

    window: np.ndarray
    cached: np.ndarray
    rows: np.ndarray
    targets: np.ndarray
    unit: int
    step: int
    store: np.ndarray | None = None
    store_rows: np.ndarray | None = None
    current: np.ndarray | None = None
    unit_slots: np.ndarray | None = None
    probes: np.ndarray | None = None
    offset: np.ndarray | None = None
    cache_len: np.ndarray | None = None

    def slots(self, rel: np.ndarray) -> Index:
        """The slots of a list of this plan's (window, target, unit) slots in every batch row:
        the list itself (a slice when a run), or [B, n] with the rows' offsets added."""
        if self.offset is None:
            return as_index(rel)
        return rel[None, :] + self.offset[:, None]

    @property
    def shape(self) -> PlanShape:
        d = 0 if self.probes is None else len(self.probes)
        return PlanShape(len(self.window) + d, len(self.cached), len(self.rows) + d)

    @functools.cached_property
    def target_index(self) -> Index:
        """`targets` as a slice when they are a run of slots (faster state access); [B, R]
        per batch row with an `offset`."""
        return self.slots(self.targets)

    @functools.cached_property
    def window_index(self) -> Index:
        return self.slots(self.window)

    @functools.cached_property
    def unit_index(self) -> Index:
        """The current unit's slots (as a slice when a run)."""
        return self.target_index if self.unit_slots is None else self.slots(self.unit_slots)

    def unit_undecided(self, state: DecodeState) -> np.ndarray:
        """[B, n] bool: the undecided slots of each batch row's current unit (`unit_index`;
        without `unit_slots`, the targets `current` marks for that row)."""
        undecided = state.undecided(self.unit_index)
        if self.unit_slots is None and self.current is not None:
            return undecided & self.current
        return undecided


@dataclasses.dataclass
class Cursor:
    """Where one decode is: the scheduler's own state, made by `Scheduler.start` and moved by
    its `advance` (a scheduler object is shared by decodes; its cursor is not)."""

    unit: int = 0  # the current commit unit (block)
    step: int = 0  # steps taken in it
    window_start: int = 0  # a sliding scheduler: the first slot its window may hold
    answer: Any = None  # the answer to this step's `Scheduler.ask` (None: it asked nothing)


class Scheduler(HookBase):
    """Which slots each step computes, reads, predicts and stores. The decoder calls, per
    decode: `start`; then per step `plan`, (after the rule's choice) `ask`, `settle`, and
    `advance`; `units` and `plan_shapes` before it (checks and warm-up)."""

    HOOKS = ("units", "start", "plan", "ask", "settle", "advance", "plan_shapes", "overhang", "validate",
             "wants_logits", "reads_logits", "warm_asks", "report", "for_model", "with_infill", "infilled")
    # The commit rule (a `registry.RULES` name) this schedule decides with, or None: any rule.
    # A schedule that accepts its own proposals in `settle` (ISD) takes the rule `NoCommit`.
    commit_rule: ClassVar[type | None] = None

    def units(self, gen_len: int) -> int:
        """Commit units in a generation of `gen_len` (raises ConfigError if it cannot split it)."""
        raise NotImplementedError

    def start(self, state: DecodeState) -> Cursor:
        """The cursor of a new decode (default: unit 0, step 0)."""
        return Cursor()

    def plan(self, state: DecodeState, cursor: Cursor) -> StepPlan | None:
        """The next step, or None when no request is left to decode."""
        raise NotImplementedError

    def settle(self, state: DecodeState, plan: StepPlan, proposal: Proposal, cursor: Cursor) -> np.ndarray | None:
        """After a step's proposals, before its commits: look-ahead bookkeeping (drafts).
        Returns [B, R] bool, extra slots of the current unit to commit with the rule's
        (accepted drafts), or None (default). A schedule that verifies its drafts (ISD) may
        replace `proposal.tokens` where it commits a token it drew itself (a correction)."""
        return None

    def ask(self, state: DecodeState, plan: StepPlan, proposal: Proposal, cursor: Cursor) -> Any:
        """After a step's proposals, before `settle`: a question `settle` needs answered about
        the step's logits kept on the device (a `runtime.step.LogitsAsk`: the decode's driver
        answers it, beside the other requests' of its call, into `cursor.answer`), or None
        (default)."""
        return None

    def warm_asks(self, proposer: Any, shapes: Sequence[tuple[int, int]], logits_like: Any, *,
                  gen_len: int = 0) -> list:
        """The questions `ask` may put to the logits of steps of `shapes` (batch, logit rows),
        for decodes with `proposer` generating `gen_len` tokens, over stand-in logits
        (`logits_like(batch, rows)`), so that a warm-up builds the programs that answer them
        (`runtime.decoder.warm_logits`); default none."""
        return []

    def overhang(self) -> int:
        """Slots past the generation this schedule's windows may reach (look-ahead rows fed
        as masks, or the rest of an aligned last block, decoded; nothing is emitted there);
        default 0."""
        return 0

    def for_model(self, model: ModelConfig) -> Scheduler:
        """The schedule that decodes `model` (default: this one); the decoder asks before
        anything else, so a schedule may fit its blocks to the model's (`BlockScheduler`)."""
        return self

    def with_infill(self, n: int) -> Scheduler:
        """This schedule with `n` slots after the generation holding each request's given
        suffix (infilling: the generation is decoded between the prompt and the suffix, which
        every step may read); 0: none. Default: refused for n > 0."""
        if n:
            raise ConfigError(f"a suffix (infilling) needs a block schedule that reads the slots after its block "
                              f"(cache none, prefix or dual); {type(self).__name__} does not")
        return self

    def infilled(self) -> int:
        """How many slots after the generation hold given suffixes (`with_infill`); default 0."""
        return 0

    def validate(self, config: Any, model: ModelConfig) -> None:
        """Raise ConfigError if this schedule cannot decode `model` with the other strategies of
        `config` (a `DecodeConfig`); default: anything goes."""
        return None

    def wants_logits(self) -> bool:
        """Whether steps must return the rows' logits whatever the proposer needs (default no)."""
        return False

    def reads_logits(self, proposer: Any = None) -> bool:
        """Whether `settle` reads the proposal's logits on the host when the step returned them,
        for decodes with `proposer` (they then come back whole: `Proposer.logits_on` "device" is
        refused; default: where it wants them)."""
        return self.wants_logits()

    def report(self, cursor: Cursor) -> dict[str, Any]:
        """What this schedule measured over a decode, for `DecodeStats` (default nothing)."""
        return {}

    def advance(self, state: DecodeState, cursor: Cursor, unit_done: bool) -> None:
        """After a step: move the cursor, end requests (EOS), mark the last unit done."""
        raise NotImplementedError

    def plan_shapes(self, prompt_lens: Sequence[int], gen_len: int, *, shift: int) -> set[PlanShape]:
        """Every plan shape a decode of a batch with these prompt lengths can produce, each with
        the most rows it can predict at that window and cache size (warm-up prepares a bucket
        for each; a fixed bundle holds them)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class BlockScheduler(Scheduler):
    """Semi-autoregressive blocks of `block_len` slots, decoded left to right; the window of
    each step comes from `window` (one subclass per cache mode).

    Attributes:
      block_len: slots per block (a commit unit); must divide the generation length.
      stop_on_eos_block: a block decoded entirely to EOS ends its request (later slots EOS).
      align: blocks sit at multiples of `block_len` of each request's absolute positions, as
        the attention blocks of a block-causal model do (`for_model` sets it from
        `ModelConfig.block_align`; LLaDA2.0's generator decodes so): a request's first block
        is the rest of the block its prompt ends in (the whole next one when the prompt fills
        its last), and its last runs to the block's end past the generation (slots decoded,
        never emitted; `overhang`). Requests of other prompt lengths keep their own blocks in
        one batch. Off: blocks start at the generation's first slot.
    """

    block_len: int = dataclasses.field(default=32, metadata={"help": "block length (slots per commit unit)"})
    stop_on_eos_block: bool = dataclasses.field(
        default=True, metadata={"help": "a block decoded entirely to EOS ends its request"})
    align: bool = dataclasses.field(
        default=False, metadata={"option": False, "help": "blocks at absolute multiples of block_len"})
    # Slots after the generation holding the requests' given suffixes (infilling; the longest
    # suffix's length): set by the decoder from the suffixes it is given (`with_infill`).
    infill: int = dataclasses.field(default=0, metadata={"option": False})
    infills: ClassVar[bool] = True  # whether its windows may read given slots after the generation

    def __post_init__(self) -> None:
        if not isinstance(self.block_len, int) or isinstance(self.block_len, bool) or self.block_len <= 0:
            raise ConfigError(f"block_len={self.block_len!r} must be a positive integer")

    def for_model(self, model: ModelConfig) -> BlockScheduler:
        """Aligned blocks when they are the model's attention blocks (a block-causal model
        whose block size is `block_len`); otherwise this schedule as it is."""
        if self.align or model.block_align != self.block_len:
            return self
        return dataclasses.replace(self, align=True)

    def overhang(self) -> int:
        return self.block_len - 1 if self.align else self.infill  # an aligned last block runs to its end

    def with_infill(self, n: int) -> BlockScheduler:
        if n == self.infill:
            return self
        if n and not self.infills:
            return super().with_infill(n)
        if n and self.align:
            raise ConfigError("a suffix (infilling) needs a bidirectional model: this one's blocks are block-causal "
                              "(aligned blocks), so no generated slot sees the slots after it")
        return dataclasses.replace(self, infill=int(n))

    def infilled(self) -> int:
        return self.infill

    def units(self, gen_len: int) -> int:
        if gen_len % self.block_len:
            raise ConfigError(f"block_len={self.block_len} must divide gen_len={gen_len}")
        return gen_len // self.block_len

    def _leads(self, prompt_lens: Sequence[int]) -> tuple[int, ...]:
        """Per request, how many prompt slots its first block holds: aligned, its prompt length
        modulo `block_len`, or a whole block for a prompt that fills its last block beside one
        that does not (its first block is all prompt, its blocks those it decodes alone); all 0
        when no prompt ends inside a block, and unaligned."""
        lead = [int(n) % self.block_len for n in prompt_lens] if self.align else []
        if not any(lead):
            return (0,) * len(prompt_lens)
        return tuple(a or self.block_len for a in lead)

    def _state_leads(self, state: DecodeState) -> tuple[int, ...]:
        """`_leads` of the state's requests (each prompt's length is the absolute position of its
        first generated slot); () unaligned."""
        if not self.align:
            return ()
        return self._leads(state.positions[:state.n_requests, state.gen_start].tolist())

    def _units(self, gen_len: int, leads: Sequence[int]) -> int:
        """Blocks a decode runs: one more than `units` when prompts end inside a block."""
        return self.units(gen_len) + (1 if any(leads) else 0)

    def window(self, step: int, start: int, end: int, total: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """(window slots, cached slots, store the window's K/V) for step `step` of a block
        whose window computes slots [start, end - shift) of `total` slots: its predicting rows
        (aligned, after the prompt's slots in the block, which are computed too)."""
        raise NotImplementedError

    def window_lengths(self, step: int, start: int, end: int, total: int) -> tuple[int, int]:
        """How many window slots and cached slots `window` gives, for `plan_shapes` (a warm-up
        asks for every prompt length a row holds); the cache modes here count them without
        building the slots."""
        window, cached, _ = self.window(step, start, end, total)
        return len(window), len(cached)

    def _plan(self, unit: int, step: int, gen_start: int, total: int, shift: int,
              state: DecodeState | None = None, leads: Sequence[int] = ()) -> StepPlan:
        """The plan of a step; when the requests' blocks sit at different slots (`leads`), with
        the `state`, which targets are each one's block."""
        lo_lead, hi_lead = (min(leads), max(leads)) if leads else (0, 0)
        window, cached, rows, targets, store = self._geometry(unit, min(step, 1), gen_start, total, shift,
                                                              lo_lead, hi_lead)
        current = None
        if lo_lead != hi_lead and state is not None:
            lead = np.full(state.batch, lo_lead)
            lead[:len(leads)] = leads
            first = gen_start + unit * self.block_len - lead  # [B] each request's block
            current = (targets >= first[:, None]) & (targets < first[:, None] + self.block_len)
        return StepPlan(window=window, cached=cached, rows=rows, targets=targets, unit=unit, step=step, store=store,
                        current=current)

    # Every step after a block's first has the same slots: built once per block, read-only.
    @functools.lru_cache(maxsize=256)
    def _geometry(self, unit: int, step: int, gen_start: int, total: int, shift: int, lo_lead: int = 0,
                  hi_lead: int = 0) -> tuple:
        # Targets: every generated slot of some request's block (each starts `lead` before the
        # unit's). The window starts with the earliest block: a prompt's slots in the block its
        # generation starts in attend to the slots decoded after them (block-causal), so their
        # K/V change with every commit there and are computed, never read from the store.
        start = gen_start + unit * self.block_len - hi_lead
        lo = max(gen_start, start)
        hi = gen_start + (unit + 1) * self.block_len - lo_lead
        window, cached, store = self.window(step, max(start - shift, 0), hi, total)
        first = lo - shift - int(window[0])  # window row predicting slot lo; windows are ranges
        arrays = (window, cached, np.arange(first, first + hi - lo), np.arange(lo, hi),
                  np.arange(len(window)) if store else None)
        for a in arrays:
            if a is not None:
                a.flags.writeable = False
        return arrays

    def _shape(self, unit: int, step: int, gen_start: int, total: int, shift: int, lo_lead: int = 0,
               hi_lead: int = 0) -> PlanShape:
        """`_plan(...).shape` (this class's plans carry no probes), from `_geometry`'s bounds and
        `window_lengths`, without the plan's slots."""
        start = gen_start + unit * self.block_len - hi_lead
        lo = max(gen_start, start)
        hi = gen_start + (unit + 1) * self.block_len - lo_lead
        w, c = self.window_lengths(min(step, 1), max(start - shift, 0), hi, total)
        return PlanShape(w, c, max(0, hi - lo))

    def plan(self, state: DecodeState, cursor: Cursor) -> StepPlan | None:
        leads = self._state_leads(state)
        if cursor.unit >= self._units(state.gen_len, leads) or not state.active.any():
            return None
        return self._plan(cursor.unit, cursor.step, state.gen_start, state.total, state.shift, state, leads)

    def advance(self, state: DecodeState, cursor: Cursor, unit_done: bool) -> None:
        if not unit_done:
            cursor.step += 1
            return
        leads = self._state_leads(state)
        lead = np.zeros(state.batch, int)
        lead[:len(leads)] = leads
        for a in sorted(set(leads)) or [0]:  # requests whose blocks sit alike
            rows = state.active & (lead == a)
            lo = max(state.gen_start, state.gen_start + cursor.unit * self.block_len - a)
            hi = min(state.gen_start + (cursor.unit + 1) * self.block_len - a, state.gen_end)
            visible = int((state.status[rows, lo:hi] == TokenState.VISIBLE).sum())
            if visible:  # tokens a block finished with below the stable bar (llada.cpp Fig. 13b)
                state.count("visible_at_block_end", visible)
            if self.stop_on_eos_block:
                state.stop_at_eos(np.arange(lo, hi), rows=rows)
        cursor.unit += 1
        cursor.step = 0
        if cursor.unit == self._units(state.gen_len, leads):
            state.finish()

    def plan_shapes(self, prompt_lens: Sequence[int], gen_len: int, *, shift: int) -> set[PlanShape]:
        """Each block's first step and its later steps (all alike within a block)."""
        p_max = max(prompt_lens)
        leads = self._leads(prompt_lens) if self.align else ()
        total = p_max + gen_len + self.overhang()
        if not _counts_its_windows(type(self)):
            return {self._plan(unit, step, p_max, total, shift, leads=leads).shape
                    for unit in range(self._units(gen_len, leads)) for step in (0, 1)}
        lo_lead, hi_lead = (min(leads), max(leads)) if leads else (0, 0)
        return {self._shape(unit, step, p_max, total, shift, lo_lead, hi_lead)
                for unit in range(self._units(gen_len, leads)) for step in (0, 1)}


@functools.cache
def _counts_its_windows(cls: type) -> bool:
    """Whether `BlockScheduler._shape` gives `cls`'s plans' shapes: its plans and geometry are
    `BlockScheduler`'s, and its `window_lengths` counts its own `window` (defined beside it, or
    the default, which calls it), not a base class's form of another window."""
    def owner(name: str) -> type:
        return next(c for c in cls.__mro__ if name in c.__dict__)

    return (cls._plan is BlockScheduler._plan and cls._geometry is BlockScheduler._geometry
            and owner("window_lengths") in (BlockScheduler, owner("window")))


def _full(total: int, store: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    return np.arange(total), np.arange(0), store


@dataclasses.dataclass(frozen=True)
class NoCache(BlockScheduler):
    """LLaDA: the whole sequence every step."""

    def window(self, step: int, start: int, end: int, total: int):
        return _full(total, store=False)

    def window_lengths(self, step: int, start: int, end: int, total: int) -> tuple[int, int]:
        return total, 0


@dataclasses.dataclass(frozen=True)
class PrefixCache(BlockScheduler):
    """Fast-dLLM prefix cache: a full forward at each block start fills the store; later steps
    compute the block and everything after it over the cached prefix."""

    def window(self, step: int, start: int, end: int, total: int):
        if step == 0:
            return _full(total, store=True)
        return np.arange(start, total), np.arange(start), False

    def window_lengths(self, step: int, start: int, end: int, total: int) -> tuple[int, int]:
        return (total, 0) if step == 0 else (max(0, total - start), max(0, start))


@dataclasses.dataclass(frozen=True)
class DualCache(BlockScheduler):
    """Fast-dLLM dual cache: prefix and suffix stored at block start; later steps compute only
    the block."""

    def window(self, step: int, start: int, end: int, total: int):
        if step == 0:
            return _full(total, store=True)
        return np.arange(start, end), np.concatenate([np.arange(start), np.arange(end, total)]), False

    def window_lengths(self, step: int, start: int, end: int, total: int) -> tuple[int, int]:
        return (total, 0) if step == 0 else (max(0, end - start), max(0, start) + max(0, total - end))

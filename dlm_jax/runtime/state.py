"""Decode state: every slot of the [B, S] request grid and every request (NumPy only).

A decode holds B requests (a batch bucket; rows past the real requests are padding) on S
slots: the longest prompt, left-aligned so every request's generation starts at the same
slot `gen_start`, then `gen_len` generated slots. Per slot the state keeps the token id, a
`TokenState`, the last confidence the decoder computed for it, its absolute position
(counted over the row's real tokens, so a left-padded row decodes exactly as it would
alone) and whether it is a real slot. Per request it keeps a `RequestStatus` and its
sampling generator. Where the decode is (the commit unit, the step in it, a window's start)
is the scheduler's own cursor (`scheduler.Cursor`), not part of this state.

The state owns its token-state transitions; every other module moves slots through them, and
each checks that every slot it moves is in a state that move takes (`MOVES`), raising
`StateError` otherwise and changing nothing:

  draft(visible=True)   MASK / CANDIDATE / DRAFT -> DRAFT (a look-ahead token fed to later steps)
  draft(visible=False)  MASK / CANDIDATE -> CANDIDATE (a look-ahead token kept invisible)
  demote                DRAFT / CANDIDATE -> MASK (a draft that failed its re-evaluation)
  commit                MASK / CANDIDATE / DRAFT -> STABLE (final)
  make_visible          MASK / CANDIDATE / DRAFT -> VISIBLE (llada.cpp's IV -> V)
  promote               VISIBLE -> STABLE (V -> S)
  revise                VISIBLE -> VISIBLE with another token
  stop_at_eos           any generated slot of a stopped request -> STABLE EOS
So IV -> V -> S, or IV -> S; nothing returns from V or S to IV.

Axes: B batch rows, S slots, n a list of slots. Slot lists may be index arrays or, for
ascending runs, slices (`as_index`); both select the same slots in every batch row. A [B, n]
index array is a list per batch row (requests at different places: ISD, left to right).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence

import numpy as np

from dlm_jax.runtime.step import LogprobsAsk, answer, is_device_logits


class TokenState(enum.IntEnum):
    """What a slot holds. Fed as its token: PROMPT, DRAFT, VISIBLE, STABLE; fed as the mask
    token: MASK, CANDIDATE."""

    PROMPT = 0  # given by the request (left padding too, with `valid` False)
    MASK = 1  # undecided
    DRAFT = 2  # a tentative token of a block that is not current yet (speculative windows)
    CANDIDATE = 3  # proposed but still invisible (llada.cpp's IV state)
    VISIBLE = 4  # fed as its token; identity and K/V may still be revised (llada.cpp's V)
    STABLE = 5  # final (llada.cpp's S)
    COMMITTED = 5  # today's decoders commit straight to the stable state


_FEEDS_TOKEN = np.array([True, False, True, False, True, True])  # by TokenState value
_UNDECIDED = np.array([False, True, False, True, False, False])
_FINAL = np.array([True, False, False, False, False, True])
_FED_FINAL = np.array([True, False, False, False, True, True])  # prompt, visible, stable: cacheable
_COMMITTED = np.array([False, False, False, False, True, True])  # visible or stable
_FEEDS_TOKEN_OR_CANDIDATE = _FEEDS_TOKEN | (np.arange(6) == TokenState.CANDIDATE)  # slots that hold a token
_STABLE = int(TokenState.STABLE)  # plain ints on the hot path (enum attribute access is slow)
_VISIBLE, _DRAFT, _CANDIDATE, _MASK = (int(TokenState.VISIBLE), int(TokenState.DRAFT), int(TokenState.CANDIDATE),
                                       int(TokenState.MASK))


Index = np.ndarray | slice  # a slot list, or an ascending run of slots as a slice


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One request's generated tokens' log-probabilities: `logprob` [n] of each token under
    the distribution of the step that decided it (NaN: none recorded), `top_ids` / `top_logprob`
    [n, k] that distribution's k likeliest tokens, likeliest first."""

    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprob: np.ndarray

    def __len__(self) -> int:
        return len(self.logprob)

    def __getitem__(self, index: slice) -> TokenLogprobs:
        return TokenLogprobs(self.logprob[index], self.top_ids[index], self.top_logprob[index])


@dataclasses.dataclass
class SlotLogprobs:
    """Per slot of a [B, S] grid: the token id recorded (-1: none), its log-probability, and
    the `top` likeliest tokens of the same distribution (`DecodeState.record_logprobs`)."""

    token: np.ndarray  # [B, S] int32
    logprob: np.ndarray  # [B, S] float32
    top_ids: np.ndarray  # [B, S, k] int32
    top_logprob: np.ndarray  # [B, S, k] float32

    @classmethod
    def empty(cls, shape: tuple[int, int], top: int) -> SlotLogprobs:
        return cls(np.full(shape, -1, np.int32), np.full(shape, np.nan, np.float32),
                   np.zeros((*shape, top), np.int32), np.full((*shape, top), np.nan, np.float32))

    def ask(self, chosen: np.ndarray, tokens: np.ndarray, logits) -> LogprobsAsk:
        """What `record` needs computed beside the step when `logits` stay there (`DeviceLogits`)."""
        b, i = np.nonzero(chosen)
        return LogprobsAsk(logits, b, i, tokens[b, i], self.top_ids.shape[-1])

    def record(self, slots: Index, chosen: np.ndarray, tokens: np.ndarray, logits: np.ndarray,
               answered: tuple[np.ndarray, ...] | None = None) -> None:
        """Keep, at the `chosen` [B, n] slots, `tokens` [B, n] and their log-softmax under
        `logits` [B, n, V] (float64 on the host), with the `top` likeliest (ties: lower id).
        Logits kept on the device are worked on there, in float32: `answered` is the answer to
        `ask` (None: asked and answered here)."""
        b, i = np.nonzero(chosen)
        tok = tokens[b, i]
        where = (b, slots[b, i]) if isinstance(slots, np.ndarray) and slots.ndim == 2 else \
            (b, np.arange(self.token.shape[1])[slots][i])
        self.token[where] = tok
        k = self.top_ids.shape[-1]
        if is_device_logits(logits):  # only the answers come back
            if answered is None:
                answered = answer([self.ask(chosen, tokens, logits)])[0]
            self.logprob[where], self.top_ids[where], self.top_logprob[where] = answered
            return
        z = np.asarray(logits[b, i], np.float64)
        z = z - z.max(-1, keepdims=True)
        z = z - np.log(np.exp(z).sum(-1, keepdims=True))
        self.logprob[where] = z[np.arange(len(tok)), tok]
        if k:  # the k largest in O(V) per slot (a full sort of a 100k-token vocabulary is not), then ranked
            some = np.argpartition(-z, k - 1, axis=-1)[:, :k] if k < z.shape[-1] else np.argsort(-z, axis=-1)
            values = np.take_along_axis(z, some, -1)
            rank = np.lexsort((some, -values), axis=-1)
            self.top_ids[where] = np.take_along_axis(some, rank, -1)
            self.top_logprob[where] = np.take_along_axis(values, rank, -1)

    def at(self, row: int, slots: slice, tokens: np.ndarray) -> TokenLogprobs:
        """Row `row`'s records at `slots`, NaN where the slot's token is now another than the
        one recorded (`tokens`: the slots' tokens now)."""
        stale = self.token[row, slots] != tokens
        return TokenLogprobs(np.where(stale, np.nan, self.logprob[row, slots]), self.top_ids[row, slots].copy(),
                             np.where(stale[:, None], np.nan, self.top_logprob[row, slots]))


def take(x: np.ndarray, slots: Index) -> np.ndarray:
    """`x[:, slots]` of a [B, S] array; `slots` may also be [B, n], a list per batch row."""
    if isinstance(slots, np.ndarray) and slots.ndim == 2:
        return x[_row_index(len(x)), slots]  # (np.take_along_axis, without its overhead)
    return x[:, slots]


@functools.lru_cache(maxsize=64)
def _row_index(batch: int) -> np.ndarray:
    """[B, 1] the batch rows, to index a [B, n] slot list with."""
    rows = np.arange(batch)[:, None]
    rows.flags.writeable = False
    return rows


def put(x: np.ndarray, slots: Index, values: np.ndarray) -> None:
    """`x[:, slots] = values` of a [B, S] array; `slots` may also be [B, n]."""
    if isinstance(slots, np.ndarray) and slots.ndim == 2:
        x[_row_index(len(x)), slots] = values  # (broadcast to [B, n]: np.put_along_axis, without its overhead)
    else:
        x[:, slots] = values


def as_index(slots: np.ndarray) -> Index:
    """`slots` as a basic slice when they are an ascending run (views, no gather), else as
    they are. Every entry is checked: equal endpoints do not make a range. The answer for a
    read-only array (a schedule's slots, made once and shared by its steps) is kept with it."""
    frozen = isinstance(slots, np.ndarray) and not slots.flags.writeable and slots.base is None
    if frozen and (seen := _RUNS.get(id(slots))) is not None and seen[0] is slots:
        return seen[1]
    n = len(slots)
    out = slots
    if n and int(slots[-1]) - int(slots[0]) == n - 1 and (n < 2 or bool((np.diff(slots) == 1).all())):
        out = slice(int(slots[0]), int(slots[0]) + n)
    if frozen:
        if len(_RUNS) >= 4096:
            _RUNS.clear()
        _RUNS[id(slots)] = (slots, out)  # (the array kept too: its id is not reused meanwhile)
    return out


_RUNS: dict[int, tuple[np.ndarray, Index]] = {}  # id of a read-only array -> (it, `as_index` of it)


class StateError(RuntimeError):
    """A token-state move the state does not allow (a strategy's bug)."""


_N = len(TokenState.__members__) - 1  # COMMITTED is an alias
_IV = ("MASK", "CANDIDATE", "DRAFT")
# Each transition method: (the states it moves from, the state it moves to).
MOVES: dict[str, tuple[tuple[str, ...], str]] = {
    "commit": (_IV, "STABLE"), "make_visible": (_IV, "VISIBLE"), "promote": (("VISIBLE",), "STABLE"),
    "revise": (("VISIBLE",), "VISIBLE"), "draft": (_IV, "DRAFT"), "draft_invisible": (("MASK", "CANDIDATE"), "CANDIDATE"),
    "demote": (("DRAFT", "CANDIDATE"), "MASK")}
_FROM = {move: np.isin(np.arange(_N), [TokenState[a] for a in src]) for move, (src, _) in MOVES.items()}
TRANSITIONS = np.zeros((_N, _N), bool)  # [from, to]: every move some transition method makes
for _src, _to in MOVES.values():
    TRANSITIONS[[TokenState[a] for a in _src], TokenState[_to]] = True


class RequestStatus(enum.IntEnum):
    PADDING = 0  # a row that only fills the batch bucket
    RUNNING = 1
    DONE = 2  # every generated slot decided
    STOPPED = 3  # ended early at an all-EOS block; its remaining slots hold EOS


_RUNNING = int(RequestStatus.RUNNING)


@dataclasses.dataclass(eq=False)
class DecodeState:
    tokens: np.ndarray  # [B, S] int32 token ids (the mask id where nothing is proposed)
    status: np.ndarray  # [B, S] int8 TokenState
    confidence: np.ndarray  # [B, S] float64 last confidence computed (NaN: never scored)
    positions: np.ndarray  # [B, S] int32 absolute positions
    valid: np.ndarray  # [B, S] bool, False at left padding
    request: np.ndarray  # [B] int8 RequestStatus
    gen_start: int  # first generated slot
    mask_id: int
    vocab_size: int
    eos_ids: tuple[int, ...] = ()  # ids that end a generation (any of them)
    shift: int = 0  # 1 for logit-shift models: window row i predicts slot i + 1
    rngs: list = dataclasses.field(default_factory=list)  # per row: np.random.Generator or None
    kv_token: np.ndarray | None = None  # [B, S] int32, the id each stored K/V entry was computed from (-1: none)
    tail: int = 0  # slots past the generation: a schedule's look-ahead rows sit there, nothing is emitted
    counters: dict = dataclasses.field(default_factory=dict)  # event counts of schedulers and policies
    logprobs: SlotLogprobs | None = None  # each slot's log-probabilities, when the decode records them

    def track_logprobs(self, top: int) -> None:
        """Record, from now on, each slot's token log-probability and its `top` likeliest
        alternatives (`record_logprobs`)."""
        self.logprobs = SlotLogprobs.empty(self.tokens.shape, top)

    def record_logprobs(self, slots: Index, scored: np.ndarray, logits: np.ndarray,
                        answered: tuple[np.ndarray, ...] | None = None) -> None:
        """After a step's moves: the `scored` [B, n] slots (undecided or revisable when the
        step ran) that now hold a token take its log-probability under this step's
        distribution, softmax(`logits` [B, n, V]) at temperature 1, with the distribution's
        likeliest tokens. A slot still masked keeps nothing yet; a slot no step scores again
        keeps what it had. `answered`: the answer to `logprobs_ask` when the logits stayed on
        the device (None: asked and answered here)."""
        held = scored & _FEEDS_TOKEN_OR_CANDIDATE[take(self.status, slots)]
        if not held.any():
            return
        self.logprobs.record(slots, held, take(self.tokens, slots), logits, answered)

    def logprobs_ask(self, slots: Index, scored: np.ndarray, logits) -> LogprobsAsk | None:
        """What `record_logprobs` needs computed beside the step, for the decode's driver to
        answer (`runtime.step.answer`), when the step kept its `logits` there; None when they
        are on the host or no slot is recorded."""
        held = scored & _FEEDS_TOKEN_OR_CANDIDATE[take(self.status, slots)]
        if not is_device_logits(logits) or not held.any():
            return None
        return self.logprobs.ask(held, take(self.tokens, slots), logits)

    def committed_counts(self, vocab: int) -> np.ndarray:
        """[B, vocab] float64: how many of each row's generated slots hold each token, visible or
        final (a decode's text so far, for OpenAI's penalties)."""
        ids = self.committed_ids()
        b, i = np.nonzero(ids >= 0)
        counts = np.zeros((self.batch, vocab))
        np.add.at(counts, (b, ids[b, i]), 1.0)
        return counts

    def committed_ids(self) -> np.ndarray:
        """[B, G] int32: each row's generated slots' tokens where committed (visible or final),
        -1 elsewhere (`committed_counts` as a list, for counting beside the step)."""
        gen = slice(self.gen_start, self.gen_end)
        return np.where(_COMMITTED[self.status[:, gen]], self.tokens[:, gen], -1).astype(np.int32)

    def token_logprobs(self, row: int, n: int | None = None) -> TokenLogprobs:
        """Request `row`'s first `n` generated slots' records (all of them by default)."""
        slots = slice(self.gen_start, self.gen_end if n is None else self.gen_start + n)
        return self.logprobs.at(row, slots, self.tokens[row, slots])

    def __post_init__(self) -> None:
        if self.kv_token is None:
            self.kv_token = np.full(self.tokens.shape, -1, np.int32)

    def stored(self, slots: Index, fed: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Note that the K/V store now holds, at `slots`, entries computed from the ids `fed`
        [B, n] (only where `rows` [B, n] is True, when given)."""
        put(self.kv_token, slots, fed if rows is None else np.where(rows, fed, take(self.kv_token, slots)))

    def kv_ready(self) -> np.ndarray:
        """[B, S] bool: slots whose token is final or visible and whose stored K/V were
        computed from that very token (a sliding window may leave them to the cache)."""
        return _FED_FINAL[self.status] & (self.kv_token == self.tokens)

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to the event counter `name` (reported in `DecodeStats.counters`)."""
        self.counters[name] = self.counters.get(name, 0) + int(n)

    @classmethod
    def create(cls, prompts: Sequence[Sequence[int]], *, gen_len: int, batch: int, mask_id: int,
               vocab_size: int, eos_ids: Sequence[int] = (), shift: int = 0, seeds: Sequence[int] | None = None,
               tail: int = 0, suffixes: Sequence[Sequence[int]] | None = None) -> DecodeState:
        """Left-align `prompts` on a [batch, max prompt + gen_len + tail] grid; rows past
        `len(prompts)` are padding. `seeds` seed each request's generator (default 0). The
        `tail` slots after the generation are masks a schedule may feed or decode (`Scheduler.overhang`),
        or, with `suffixes` (infilling), each request's suffix: given tokens right after its
        generation (prompt state, never decoded), the rest of the tail right padding."""
        n = len(prompts)
        lens = [len(p) for p in prompts]
        p_max = max(lens)
        total = p_max + gen_len + tail
        tokens = np.full((batch, total), mask_id, dtype=np.int32)
        valid = np.zeros((batch, total), dtype=bool)
        for r, prompt in enumerate(prompts):
            tokens[r, p_max - lens[r]:p_max] = np.asarray(prompt, dtype=np.int32)
            valid[r, p_max - lens[r]:] = True
        status = np.full((batch, total), TokenState.MASK, dtype=np.int8)
        status[:, :p_max] = TokenState.PROMPT
        if suffixes is not None:
            if len(suffixes) != n or max(map(len, suffixes), default=0) > tail:
                raise ValueError(f"{len(suffixes)} suffixes for {n} prompts, or one longer than the tail ({tail})")
            end = p_max + gen_len
            status[:, end:] = TokenState.PROMPT
            valid[:, end:] = False
            for r, suffix in enumerate(suffixes):
                tokens[r, end:end + len(suffix)] = np.asarray(suffix, dtype=np.int32)
                valid[r, end:end + len(suffix)] = True
        positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
        request = np.full(batch, RequestStatus.PADDING, dtype=np.int8)
        request[:n] = RequestStatus.RUNNING
        seeds = list(seeds) if seeds is not None else [0] * n
        if len(seeds) != n:
            raise ValueError(f"{len(seeds)} seeds for {n} prompts")
        rngs = [np.random.default_rng(s) for s in seeds] + [None] * (batch - n)
        return cls(tokens=tokens, status=status, confidence=np.full((batch, total), np.nan),
                   positions=positions, valid=valid, request=request, gen_start=p_max,
                   mask_id=mask_id, vocab_size=vocab_size, eos_ids=tuple(eos_ids), shift=shift, rngs=rngs, tail=tail)

    # -- shape ------------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def total(self) -> int:
        """S, the number of slots."""
        return self.tokens.shape[1]

    @property
    def gen_len(self) -> int:
        return self.total - self.gen_start - self.tail

    @property
    def gen_end(self) -> int:
        """The slot after the last generated one (where the tail starts)."""
        return self.total - self.tail

    @property
    def n_requests(self) -> int:
        return int((self.request != RequestStatus.PADDING).sum())

    @property
    def active(self) -> np.ndarray:
        """[B] bool, requests still decoding."""
        return self.request == _RUNNING

    # -- per-slot views ---------------------------------------------------------------------

    def fed_tokens(self, slots: Index) -> np.ndarray:
        """[B, n] the ids a forward sees at `slots`: the token, or the mask id where the slot
        is undecided or invisible."""
        return np.where(_FEEDS_TOKEN[take(self.status, slots)], take(self.tokens, slots),
                        self.mask_id).astype(np.int32, copy=False)

    def undecided(self, slots: Index) -> np.ndarray:
        """[B, n] bool: MASK or CANDIDATE slots of running requests (what a commit rule may
        commit)."""
        return _UNDECIDED[take(self.status, slots)] & self.active[:, None]

    def is_final(self, slots: Index) -> np.ndarray:
        """[B, n] bool: slots whose token will not change (prompt or stable)."""
        return _FINAL[take(self.status, slots)]

    # -- updates ----------------------------------------------------------------------------

    def record(self, slots: Index, scored: np.ndarray, confidence: np.ndarray) -> None:
        """Keep `confidence` [B, n] as the last confidence of the `scored` [B, n] slots."""
        put(self.confidence, slots, np.where(scored, confidence, take(self.confidence, slots)))

    def _move(self, slots: Index, chosen: np.ndarray, to: int, tokens: np.ndarray | None, move: str) -> None:
        """Move the `chosen` [B, n] slots to state `to` (giving them `tokens` [B, n] when
        given), after checking that each is in a state `move` takes (`MOVES`)."""
        status = take(self.status, slots)
        if not chosen.any():
            return
        allowed = _FROM[move][status]
        if not allowed[chosen].all():
            b, i = np.argwhere(chosen & ~allowed)[0]
            slot = slots[b, i] if isinstance(slots, np.ndarray) and slots.ndim == 2 else np.arange(self.total)[slots][i]
            raise StateError(f"{move}: request {b} slot {slot} is {TokenState(status[b, i]).name}, which "
                             f"cannot move to {TokenState(to).name}")
        if tokens is not None:
            put(self.tokens, slots, np.where(chosen, tokens, take(self.tokens, slots)))
        put(self.status, slots, np.where(chosen, to, status))

    def commit(self, slots: Index, chosen: np.ndarray, tokens: np.ndarray) -> None:
        """Commit the `chosen` [B, n] undecided slots to their `tokens` [B, n]: final."""
        self._move(slots, chosen, _STABLE, tokens, "commit")

    def make_visible(self, slots: Index, chosen: np.ndarray, tokens: np.ndarray) -> None:
        """Commit the `chosen` [B, n] undecided slots to their `tokens`, still revisable
        (fed to later steps as their token)."""
        self._move(slots, chosen, _VISIBLE, tokens, "make_visible")

    def promote(self, slots: Index, chosen: np.ndarray) -> None:
        """Make the `chosen` [B, n] visible slots final."""
        self._move(slots, chosen, _STABLE, None, "promote")

    def revise(self, slots: Index, chosen: np.ndarray, tokens: np.ndarray) -> None:
        """Give the `chosen` [B, n] visible slots other `tokens`; they stay visible."""
        self._move(slots, chosen, _VISIBLE, tokens, "revise")

    def draft(self, slots: Index, chosen: np.ndarray, tokens: np.ndarray, *, visible: bool) -> None:
        """Give the `chosen` [B, n] slots a tentative token: a DRAFT fed to later steps
        (`visible`), or a CANDIDATE still fed as the mask."""
        self._move(slots, chosen, _DRAFT if visible else _CANDIDATE, tokens, "draft" if visible else "draft_invisible")

    def demote(self, slots: Index, chosen: np.ndarray) -> None:
        """Return the `chosen` [B, n] drafts to MASK."""
        self._move(slots, chosen, _MASK, np.full(chosen.shape, self.mask_id, self.tokens.dtype), "demote")

    def stop_at_eos(self, slots: np.ndarray, *, rows: np.ndarray | None = None) -> np.ndarray:
        """End the running requests (of `rows` [B] bool, when given) whose `slots` all hold an
        EOS id: every later slot becomes a stable EOS (the first id). Returns [B] bool, the
        rows stopped."""
        if not self.eos_ids or len(slots) == 0:
            return np.zeros(self.batch, bool)
        done = self.active & self.is_eos(self.tokens[:, slots]).all(axis=1)
        if rows is not None:
            done &= rows
        self.stop_after(done, np.full(self.batch, np.max(slots)))
        return done

    def is_eos(self, tokens: np.ndarray) -> np.ndarray:
        """Elementwise: `tokens` that are one of the EOS ids."""
        if len(self.eos_ids) == 1:
            return tokens == self.eos_ids[0]
        return np.isin(tokens, self.eos_ids)

    def stop_after(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """End the running requests `rows` [B] bool whose last token sits at `slots` [B]: every
        later generated slot becomes a stable EOS (the first id; the mask id without EOS ids)."""
        fill = self.eos_ids[0] if self.eos_ids else self.mask_id
        for b in np.flatnonzero(rows & self.active):
            after = int(slots[b]) + 1
            self.tokens[b, after:self.gen_end] = fill
            self.status[b, after:self.gen_end] = TokenState.STABLE
            self.request[b] = RequestStatus.STOPPED

    def finish(self, rows: np.ndarray | None = None) -> None:
        """Mark every running request done (or those of `rows` [B] bool)."""
        self.request[self.active if rows is None else self.active & rows] = RequestStatus.DONE

    def sequences(self) -> list[np.ndarray]:
        """Per request, its `gen_len` generated ids (mask ids where undecided)."""
        return [self.tokens[r, self.gen_start:self.gen_end].copy() for r in range(self.n_requests)]

    def final_beyond(self, row: int, n: int) -> bool:
        """Whether request `row`'s final prefix (`final_prefixes`) is longer than `n` tokens, given
        that it was `n` long: its slot n is final now (one look instead of the whole row)."""
        return n < self.gen_len and bool(_FINAL[self.status[row, self.gen_start + n]])

    def final_prefixes(self) -> list[np.ndarray]:
        """Per request, its generated ids up to the first slot that is not final: what no later
        step can change (drafts, and visible tokens a revision may replace, are not), so a
        stream of these only ever grows."""
        start = self.gen_start
        final = _FINAL[self.status[:self.n_requests, start:self.gen_end]]
        ends = np.where(final.all(axis=1), final.shape[1], np.argmin(final, axis=1)).tolist()
        return [self.tokens[r, start:start + n].copy() for r, n in enumerate(ends)]

"""Introspective strided decoding (I-DLM's ISD) and left-to-right decoding of causal models
with a logit shift: a schedule and an acceptance rule (NumPy only).

Stride N is the most tokens one forward can emit. Each request sits at its own place: its
cache holds the K/V of slots [0, c) and its last emitted token, pending, sits at slot c. A
step feeds, per request (I-DLM §3.2, App. F):

  prompt (the first step)  [prompt ..., M x (N-1)]    the last prompt row predicts t0
  cold start (NP)          [forced, M x (N-1)]         row 0 predicts the next token
  verify (P)               [pending, spec_0..spec_{N-2}, M x (N-1)]   2N-1 rows

Row i predicts the token after it (logit shift): the anchors (pending, spec_0 ..) give the
model's own causal distribution at each draft, the mask rows propose the next N-1 drafts.
`Acceptance` judges the drafts left to right; the first rejected one is replaced by a
correction drawn from the residual, and the step ends there (the next step is a cold start);
if all are accepted, the last anchor gives a bonus token and the mask rows' proposals become
the next drafts. Every step emits at least one token per request. Stride 1 is plain
left-to-right decoding (one row, no drafts), the reference ISD must equal.

Where K/V go: each step stores, in place, the rows whose tokens may be kept (pending and the
drafts); the request's cache length moves past the accepted ones only (`StepPlan.cache_len`),
so a rejected draft's entry lies past the cache, is never read, and is overwritten by the next
step (the released code's "trim": `advance = 1 + accepted`). Mask rows are never stored.
After every step a request's cache holds exactly its prompt and emitted tokens but the last.

Modes (I-DLM §3.2, §3.3, §4.3; docs/techniques/isd.md; `Proposer` fixes temperature / top-k /
top-p, the same filter the left-to-right decoder samples from):
  T = 0            accept a draft iff it is the anchor's argmax; the correction is the argmax:
                   the output is greedy left-to-right decoding.
  T > 0, exact     argmax drafts are judged with q = one-hot (accept with probability p(draft),
                   correction from p without the draft); with `proposal="sample"` drafts are
                   drawn from q and judged by min(1, p/q), correction from max(0, p - q). Both
                   give the model's own sampling distribution.
  verify="softmax_q"  argmax drafts judged by min(1, p/q) with q the proposing row's softmax:
                   the released code's rule, not exact at T > 0.
  relax > 0        the ratio is multiplied by (1 + relax) (the released code's alpha_c =
                   1 / (1 + relax)); lossy. At T = 0 a draft is also accepted when its T = 1
                   probability is within a factor (1 + relax) of the argmax's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.commit import NoCommit
from dlm_jax.runtime.proposer import Proposal, Proposer, sampling_probs
from dlm_jax.runtime.revision import NoRevision
from dlm_jax.runtime.scheduler import Cursor, PlanShape, Scheduler, StepPlan
from dlm_jax.runtime.state import DecodeState, RequestStatus
from dlm_jax.runtime.step import JudgeAsk, is_device_logits

VERIFY: tuple[str, ...] = ("exact", "softmax_q")
PROPOSALS: tuple[str, ...] = ("argmax", "sample")
_NONE = np.zeros(0, np.int64)
_NONE.flags.writeable = False


def _t1(logits: np.ndarray) -> np.ndarray:
    """The untempered, unfiltered distribution (softmax) of `logits` [..., V]."""
    return sampling_probs(logits, 1.0)


def _draw(rng: np.random.Generator, probs: np.ndarray) -> int:
    """One token from `probs` [V] (inverse CDF on one uniform)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def renewal_tpf(alpha: Sequence[float]) -> float:
    """Tokens per forward of ISD's mechanics at per-position acceptance `alpha` [N-1] (alpha_i:
    the chance draft i is accepted once the ones before it were; I-DLM App. B, in the renewal
    form, our derivation, which follows ISD's mechanics):
    a cycle is one cold start (1 token) and verify steps up to the first rejection; a full
    accept emits N, a rejection after k accepted drafts k + 1."""
    alpha = [float(a) for a in alpha]
    n = len(alpha) + 1
    cum = np.cumprod([1.0] + alpha)  # A_0 .. A_{N-1}
    a = cum[-1]
    if a >= 1.0:
        return float(n)
    reject_k = sum(k * cum[k] * (1 - alpha[k]) for k in range(n - 1)) / (1 - a)
    tokens = 1 + n * a / (1 - a) + reject_k + 1
    return float(tokens / (1 + 1 / (1 - a)))


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """ISD's acceptance rule: which of a request's drafts the model's own anchors accept, and
    the token emitted after them (see the module docstring for the modes).

    Attributes:
      verify: "exact" (distribution-exact at every temperature) or "softmax_q" (the released
        code's ratio with the proposing row's softmax; inexact at T > 0).
      proposal: "argmax" drafts, or "sample" (drafts drawn from the mask rows' filtered
        distribution).
      relax: >= 0; the acceptance ratio is multiplied by (1 + relax) (0: strict, lossless).
    """

    verify: str = "exact"
    proposal: str = "argmax"
    relax: float = 0.0

    def __post_init__(self) -> None:
        if self.verify not in VERIFY:
            raise ConfigError(f"verify={self.verify!r} is not one of {VERIFY}")
        if self.proposal not in PROPOSALS:
            raise ConfigError(f"proposal={self.proposal!r} is not one of {PROPOSALS}")
        r = self.relax
        if not isinstance(r, numbers.Real) or isinstance(r, bool) or not math.isfinite(r) or r < 0:
            raise ConfigError(f"relax={r!r} must be a finite number >= 0 (0: strict)")

    @property
    def exact(self) -> bool:
        """Whether the rule reproduces the model's own sampling distribution."""
        return self.verify == "exact" and self.relax == 0

    @property
    def one_hot(self) -> bool:
        """Argmax drafts judged as drawn from a one-hot q."""
        return self.verify == "exact" and self.proposal == "argmax"

    def drafts_need_logits(self, temperature: float) -> bool:
        """Whether judging a draft needs the distribution it was proposed from."""
        return temperature > 0 and not self.one_hot

    def judge(self, drafts: np.ndarray, anchors: np.ndarray, sampler: Proposer, rng: np.random.Generator | None,
              p_logits: np.ndarray | None, q_logits: np.ndarray | None) -> tuple[int, int]:
        """(accepted drafts j, the token after them) for one request.

        drafts: [k] the drafts, in order. anchors: [k + 1] the sampler's token at each anchor
        row (its argmax at T = 0, a draw from its filtered distribution at T > 0); anchor i
        predicts draft i, anchor k the bonus. p_logits: [k + 1, V] the anchors' logits;
        q_logits: [k, V] the logits each draft was proposed from (needed where
        `drafts_need_logits`, and for `relax` at T = 0)."""
        return self._decide(drafts, anchors, sampler.temperature, rng,
                            _OnHost(self, drafts, anchors, sampler, p_logits, q_logits))

    def judge_answered(self, drafts: np.ndarray, anchors: np.ndarray, sampler: Proposer,
                       rng: np.random.Generator | None, judged: tuple[np.ndarray, ...] | None) -> tuple[int, int]:
        """`judge` from what the device computed of the logits (`runtime.step.JudgeAsk`'s
        answer for these drafts: p and q at each draft, their untempered probabilities, the
        residual's draw; None where the rule needs none of it): the same rule in float32, each
        rejection's token drawn beside the step (not from `rng`, which gives the acceptances)."""
        return self._decide(drafts, anchors, sampler.temperature, rng, _Answered(judged))

    def _decide(self, drafts: np.ndarray, anchors: np.ndarray, t: float, rng: np.random.Generator | None,
                dist: _OnHost | _Answered) -> tuple[int, int]:
        k = len(drafts)
        if k == 0:
            return 0, int(anchors[0])
        if t == 0 or (self.one_hot and self.relax == 0):
            # Greedy, or argmax drafts under one-hot q, strict: accept iff the anchor's own token
            # (its argmax, or its draw from p) is the draft, or (relaxed at T = 0) its
            # untempered probability is close enough; the first that is not is the correction
            # (a draw from p conditioned on not being the draft).
            near = (1 + self.relax) * dist.p1_drafts() >= dist.p1_anchors() if t == 0 and self.relax > 0 else None
            for i in range(k):
                if drafts[i] != anchors[i] and (near is None or not near[i]):
                    return i, int(anchors[i])
            return k, int(anchors[k])
        for i in range(k):
            q_s = 1.0 if self.one_hot else dist.q(i)
            ratio = math.inf if q_s <= 0 else (1 + self.relax) * dist.p(i) / q_s
            if rng.random() < min(1.0, ratio):
                continue
            return i, dist.rejected(i, rng)
        return k, int(anchors[k])


class _OnHost:
    """What `Acceptance._decide` asks of the distributions, from the logits on the host
    (float64; each computed when first asked)."""

    def __init__(self, rule: Acceptance, drafts, anchors, sampler: Proposer, p_logits, q_logits):
        self.rule, self.drafts, self.anchors, self.sampler = rule, drafts, anchors, sampler
        self.p_logits, self.q_logits = p_logits, q_logits

    def p1_drafts(self) -> np.ndarray:
        k = len(self.drafts)
        return self._p1[np.arange(k), self.drafts]

    def p1_anchors(self) -> np.ndarray:
        k = len(self.drafts)
        return self._p1[np.arange(k), self.anchors[:k]]

    @functools.cached_property
    def _p1(self) -> np.ndarray:
        return _t1(self.p_logits[:len(self.drafts)])

    @functools.cached_property
    def _p(self) -> np.ndarray:
        s = self.sampler
        return sampling_probs(self.p_logits[:len(self.drafts)], s.temperature, s.top_k, s.top_p)

    @functools.cached_property
    def _q(self) -> np.ndarray:
        s = self.sampler
        return sampling_probs(self.q_logits, s.temperature, s.top_k, s.top_p)

    def p(self, i: int) -> float:
        return self._p[i, int(self.drafts[i])]

    def q(self, i: int) -> float:
        return self._q[i, int(self.drafts[i])]

    def rejected(self, i: int, rng: np.random.Generator) -> int:
        """The correction after draft i's rejection: from max(0, p - q) (drafts drawn from q),
        or from p without the draft (one-hot q); from p where that leaves nothing."""
        p = self._p[i]
        if self.rule.one_hot:
            residual = p.copy()
            residual[int(self.drafts[i])] = 0.0
        else:
            residual = np.maximum(p - self._q[i], 0.0)
        return _draw(rng, residual if residual.sum() > 0 else p)


class _Answered:
    """What `Acceptance._decide` asks of the distributions, from the device's answers."""

    def __init__(self, judged: tuple[np.ndarray, ...] | None):
        self.judged = judged

    def p1_drafts(self) -> np.ndarray:
        return self.judged[2].astype(np.float64)

    def p1_anchors(self) -> np.ndarray:
        return self.judged[3].astype(np.float64)

    def p(self, i: int) -> float:
        return float(self.judged[0][i])

    def q(self, i: int) -> float:
        return float(self.judged[1][i])

    def rejected(self, i: int, rng: np.random.Generator) -> int:
        return int(self.judged[5][i])


@dataclasses.dataclass
class StridedCursor(Cursor):
    """Where each request of a strided decode is (`Strided.start` makes it)."""

    cache: np.ndarray = dataclasses.field(default_factory=lambda: _NONE)  # [B] slot of the pending token
    drafting: np.ndarray = dataclasses.field(default_factory=lambda: _NONE)  # [B] bool: drafts follow it
    prefilled: bool = False
    draft_logits: np.ndarray | None = None  # [B, N-1, V] logits the drafts were proposed from
    # Kept on the device instead (`DeviceLogits`): the step's view that proposed the drafts,
    # and where each row's drafts' rows start in it [B]
    draft_view: Any = None
    draft_at: np.ndarray = dataclasses.field(default_factory=lambda: _NONE)
    draft_ids: np.ndarray | None = None  # [B, G] ids committed at that step (its penalties adjusted q there)
    ended: np.ndarray | None = None  # [B] slot of the last token of a request that ended this step (-1)
    counts: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Strided(Scheduler):
    """The mechanics shared by `Strided` (ISD) and `LeftToRight` (stride 1)."""

    commit_rule: ClassVar[type | None] = NoCommit
    name: ClassVar[str] = "isd"

    @property
    def n(self) -> int:
        raise NotImplementedError

    @property
    def acceptance(self) -> Acceptance:
        return Acceptance()

    @property
    def measure_iar(self) -> bool:
        return False

    def units(self, gen_len: int) -> int:
        return gen_len + 1  # the prompt's step, then at least one token a step

    def overhang(self) -> int:
        return 2 * self.n - 1  # a request pending at the last slot still feeds a full window

    def wants_logits(self) -> bool:
        return self.measure_iar or self.acceptance.relax > 0

    def _judges(self) -> bool:
        """Whether the rule reads more of the logits than the anchors' tokens: it judges a draft
        by p / q (`proposal="sample"`, `verify="softmax_q"`), relaxes, or measures the IAR (the
        strict exact rule over argmax drafts needs only the anchors' tokens and the mask rows'
        argmax, `Proposal.argmax`)."""
        rule = self.acceptance
        return self.measure_iar or rule.relax > 0 or not rule.one_hot

    def _asks(self, temperature: float) -> bool:
        """Whether judging at `temperature` needs more of the logits than the anchors' tokens
        (with the logits on the device: a `JudgeAsk` each step with drafts)."""
        return self.acceptance.relax > 0 or self.measure_iar or self.acceptance.drafts_need_logits(temperature)

    def _keeps_q(self, temperature: float) -> bool:
        """Whether judging at `temperature` needs the logits the drafts were proposed from."""
        return self.acceptance.drafts_need_logits(temperature) or self.measure_iar

    def reads_logits(self, proposer: Any = None) -> bool:
        """Never: logits kept on the device are judged there (`ask`), after the proposer's
        penalties and bias as the host judges them (p with the ids committed at this step, q
        with those committed at the step that proposed the draft)."""
        return False

    def validate(self, config: Any, model: ModelConfig) -> None:
        n = self.n
        if model.attention != "causal" or not model.logit_shift:
            what = f"{model.attention} attention" + ("" if model.logit_shift else " without a logit shift")
            raise ConfigError(f"cache={self.name!r} decodes causal models with a logit shift (I-DLM, "
                              f"autoregressive); this model has {what}")
        if n > model.block_size + 1:
            raise ConfigError(f"stride {n} needs a model trained with noisy blocks of {n - 1} masks; this model "
                              f"was trained with {model.block_size} (block_size), so strides up to "
                              f"{model.block_size + 1}")
        if not isinstance(config.revision, NoRevision):
            raise ConfigError(f"cache={self.name!r} revises nothing: it takes revision='none'")

    def start(self, state: DecodeState) -> StridedCursor:
        b = state.batch
        counts = {"stride": self.n, "steps": 0, "tokens": 0, "emitted": 0, "query_rows": 0, "accept_histogram": {},
                  "verified": [0] * (self.n - 1), "accepted": [0] * (self.n - 1), "iar_sum": 0.0, "iar_count": 0}
        return StridedCursor(cache=np.full(b, state.gen_start - 1, np.int64), drafting=np.zeros(b, bool),
                             ended=np.full(b, -1, np.int64), counts=counts, draft_at=np.zeros(b, np.int64))

    # -- plans ------------------------------------------------------------------------------

    def plan(self, state: DecodeState, cursor: StridedCursor) -> StepPlan | None:
        if not state.active.any():
            return None
        n = self.n
        if not cursor.prefilled:  # the prompt, and N-1 mask rows after it: a cold start from its last token
            g = state.gen_start
            rows = np.arange(g - 1, g + n - 1)
            return StepPlan(window=np.arange(g + n - 1), cached=_NONE, rows=rows, targets=rows + 1, unit=cursor.unit,
                            step=0, store=np.arange(g), unit_slots=_NONE)
        active = state.active
        drafting = cursor.drafting & active
        width = 2 * n - 1 if drafting.any() else n
        rel = np.arange(width)
        store_rows = np.zeros((state.batch, n), bool)
        store_rows[:, 0] = active  # pending or forced: emitted, kept
        store_rows[:, 1:] = drafting[:, None]  # the drafts: kept if accepted (the cache length says)
        c = cursor.cache
        return StepPlan(window=rel, cached=np.arange(int(c[active].max())), rows=rel, targets=rel + 1,
                        unit=cursor.unit, step=0, store=np.arange(n), store_rows=store_rows, unit_slots=_NONE,
                        offset=c.copy(), cache_len=np.where(active, c, 0))

    def plan_shapes(self, prompt_lens: Sequence[int], gen_len: int, *, shift: int) -> set[PlanShape]:
        """The prompt's step, then cold-start (N rows) and verify (2N-1 rows) windows over every
        cache length the generation passes."""
        p, n = max(prompt_lens), self.n
        shapes = {PlanShape(p + n - 1, 0, n)}
        for c in range(p, p + gen_len):
            shapes.add(PlanShape(n, c, n))
            if n > 1:
                shapes.add(PlanShape(2 * n - 1, c, 2 * n - 1))
        return shapes

    def warm_asks(self, proposer: Any, shapes: Sequence[tuple[int, int]], logits_like: Any, *,
                  gen_len: int = 0) -> list[JudgeAsk]:
        """`ask`'s questions at each step shape that can verify drafts (2N-1 rows or more), for
        each count of its rows with drafts (padded to the same powers of two as a call's), with
        drafts proposed in each step shape that can propose them (of any batch: an engine's
        requests may have drafted in calls of other sizes), with `proposer`'s penalties (over a
        generation of `gen_len`) and bias."""
        rule, t, k = self.acceptance, proposer.temperature, self.n - 1
        penalized = bool(proposer.presence_penalty or proposer.frequency_penalty)
        if not k or not self._asks(t):
            return []
        q_shapes = sorted({(bb, r) for bb, r in shapes if r >= k + 1}) if self._keeps_q(t) else [None]
        asks = []
        for batch, rows in shapes:
            if rows < 2 * k + 1 or (p := logits_like(batch, rows)) is None:
                continue
            # Requests with drafts, one for each count of drafts a call pads to (a power of two).
            requests = {1 << max(0, j * k - 1).bit_length(): j for j in range(batch, 0, -1)}.values()
            for j, q_shape in itertools.product(requests, q_shapes):
                m = j * k
                b, i = np.repeat(np.arange(j), k), np.tile(np.arange(k), j)
                q = None if q_shape is None else logits_like(*q_shape)
                ids = np.full((m, max(1, gen_len)), -1, np.int32) if penalized else None
                asks.append(JudgeAsk(p, b=b, i=i, tokens=np.zeros(m, np.int32), anchors=np.zeros(m, np.int32),
                                     seeds=np.zeros(m, np.uint32), use_q=np.full(m, not rule.one_hot),
                                     temperature=np.full(m, t, np.float32), top_k=np.full(m, proposer.top_k, np.int32),
                                     top_p=np.full(m, proposer.top_p, np.float32), q=q,
                                     qb=None if q is None else b % q.shape[0], qi=None if q is None else i + 1,
                                     count_ids=ids, q_count_ids=ids, presence=proposer.presence_penalty,
                                     frequency=proposer.frequency_penalty, bias=proposer.logit_bias))
        return asks

    # -- after the step ---------------------------------------------------------------------

    def ask(self, state: DecodeState, plan: StepPlan, proposal: Proposal, cursor: StridedCursor) -> JudgeAsk | None:
        """With the logits on the device, what judging this step's drafts needs of them beyond
        the anchors' tokens (relaxed, p / q and IAR rules: `Acceptance.judge_answered`), for
        every request with drafts at once, in batch order (`settle` reads their answers so);
        each request that may reject at T > 0 draws one seed for its rejection's token from its
        own generator. None where nothing is needed."""
        rule, sampler = self.acceptance, proposal.sampler or Proposer()
        t = sampler.temperature
        if not is_device_logits(proposal.logits) or not cursor.prefilled or not self._asks(t):
            return None
        k = self.n - 1
        rows = np.flatnonzero(cursor.drafting & state.active)
        if not len(rows) or not k:
            return None
        at = (cursor.cache[rows] + 1)[:, None] + np.arange(k)  # each row's drafts' slots
        seeds = np.zeros(len(rows), np.uint32)
        for j, b in enumerate(rows):
            if t > 0 and state.rngs[b] is not None:
                seeds[j] = state.rngs[b].integers(0, 2 ** 32, dtype=np.uint32)
        m = len(rows) * k
        q = cursor.draft_view
        penalized = bool(sampler.presence_penalty or sampler.frequency_penalty)
        ids = np.repeat(state.committed_ids()[rows], k, axis=0) if penalized else None
        q_ids = (np.repeat(cursor.draft_ids[rows], k, axis=0) if penalized and q is not None
                 and cursor.draft_ids is not None else None)
        return JudgeAsk(proposal.logits, b=np.repeat(rows, k), i=np.tile(np.arange(k), len(rows)),
                        tokens=np.take_along_axis(state.tokens[rows], at, axis=1).ravel().astype(np.int32),
                        anchors=proposal.tokens[rows, :k].ravel().astype(np.int32), seeds=np.repeat(seeds, k),
                        use_q=np.full(m, not rule.one_hot), temperature=np.full(m, t, np.float32),
                        top_k=np.full(m, sampler.top_k, np.int32), top_p=np.full(m, sampler.top_p, np.float32),
                        q=q, qb=None if q is None else np.repeat(rows, k),
                        qi=None if q is None else (cursor.draft_at[rows][:, None] + np.arange(k)).ravel(),
                        count_ids=ids, q_count_ids=q_ids, presence=sampler.presence_penalty,
                        frequency=sampler.frequency_penalty, bias=sampler.logit_bias)

    def settle(self, state: DecodeState, plan: StepPlan, proposal: Proposal, cursor: StridedCursor) -> np.ndarray:
        """Judge each request's drafts, pick the token after them, draft the next ones. Returns
        [B, R] the rows whose predicted slot is emitted (their tokens in `proposal.tokens`)."""
        n, rule, sampler = self.n, self.acceptance, proposal.sampler or Proposer()
        counts = cursor.counts
        b_all, r_all = proposal.tokens.shape
        emit = np.zeros((b_all, r_all), bool)
        demote = np.zeros((b_all, r_all), bool)
        draft = np.zeros((b_all, r_all), bool)
        draft_tokens = self._draft_tokens(proposal, sampler)
        logits = proposal.logits
        on_device = is_device_logits(logits)
        keep_q = logits is not None and self._keeps_q(sampler.temperature)
        next_q = (np.zeros((b_all, n - 1, logits.shape[-1]), np.float32) if keep_q and n > 1 and not on_device
                  else None)
        prompt_step = not cursor.prefilled
        # The ids committed now adjusted this step's logits (the proposer's penalties): those
        # that adjust the q of the drafts it proposes, when the device judges them next step.
        ids_now = (state.committed_ids() if on_device and keep_q and n > 1
                   and (sampler.presence_penalty or sampler.frequency_penalty) else None)
        cursor.ended[:] = -1
        judged_at = 0  # where the next request's drafts start in `cursor.answer` (`ask`'s order)
        for b in np.flatnonzero(state.active):
            c = int(cursor.cache[b])
            k = n - 1 if cursor.drafting[b] and not prompt_step else 0
            drafts = state.tokens[b, c + 1:c + 1 + k]
            q_logits = None if cursor.draft_logits is None else cursor.draft_logits[b]
            if on_device:
                judged = None
                if k and cursor.answer is not None:
                    judged = tuple(x[judged_at:judged_at + k] for x in cursor.answer)
                    judged_at += k
                j, token = rule.judge_answered(drafts, proposal.tokens[b, :k + 1], sampler, state.rngs[b], judged)
                iar = None if judged is None or cursor.draft_view is None else (judged[2], judged[4])
            else:
                j, token = rule.judge(drafts, proposal.tokens[b, :k + 1], sampler, state.rngs[b],
                                      None if logits is None else logits[b, :k + 1], q_logits)
                iar = None
                if self.measure_iar and logits is not None and q_logits is not None and k:
                    reached = np.arange(min(j + 1, k))
                    iar = (_t1(logits[b, :len(reached)])[reached, drafts[reached]],
                           _t1(q_logits[:len(reached)])[reached, drafts[reached]])
            emitted = np.append(drafts[:j], token)
            proposal.tokens[b, :j + 1] = emitted  # the accepted drafts (not the anchors' draws), then the token
            # A request ends at its first EOS, or at the end of its generation.
            eos = np.flatnonzero(state.is_eos(emitted))
            keep = min(int(eos[0]) + 1 if len(eos) else j + 1, state.gen_end - 1 - c)
            emit[b, :keep] = True
            demote[b, j + 1:k] = True  # drafts after the correction
            if keep < j + 1 or len(eos) or c + keep >= state.gen_end - 1:
                cursor.ended[b] = c + keep
            if not prompt_step:
                self._count(counts, k, j, keep, iar)
            cursor.cache[b] = min(c + j + 1, state.gen_end - 1)  # past the end: the request has ended
            cursor.drafting[b] = j == k and n > 1
            if cursor.drafting[b]:
                draft[b, k + 1:k + n] = True
                cursor.draft_at[b] = k + 1
                if next_q is not None:
                    next_q[b] = logits[b, k + 1:k + n]
        cursor.draft_logits = next_q
        cursor.draft_view = logits if keep_q and on_device and n > 1 else None
        cursor.draft_ids = ids_now
        tgt = plan.target_index
        state.demote(tgt, demote)
        state.draft(tgt, draft, draft_tokens, visible=True)
        return emit

    def _draft_tokens(self, proposal: Proposal, sampler: Proposer) -> np.ndarray:
        """The mask rows' proposals: their argmax, or (`proposal="sample"`) the sampler's draw."""
        if self.acceptance.proposal == "sample" or proposal.logits is None or sampler.temperature == 0:
            return proposal.tokens.copy()
        if proposal.argmax is not None:  # (drawn beside the step: the logits stayed there)
            return proposal.argmax.copy()
        return proposal.logits.argmax(-1).astype(np.int32)

    def _count(self, counts: dict, k: int, j: int, keep: int, iar: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Count a request's step; `iar`: the untempered p and q of its drafts up to the first
        rejected (the IAR's terms, where it is measured)."""
        counts["steps"] += 1
        counts["tokens"] += keep
        counts["emitted"] += j + 1
        counts["query_rows"] += 2 * self.n - 1 if k else self.n
        if not k:
            return
        counts["accept_histogram"][j] = counts["accept_histogram"].get(j, 0) + 1
        for i in range(min(j + 1, k)):
            counts["verified"][i] += 1
            counts["accepted"][i] += i < j
        if self.measure_iar and iar is not None:
            reached = min(j + 1, k)
            p1, q1 = (np.asarray(x[:reached], np.float64) for x in iar)
            counts["iar_sum"] += float(np.minimum(1.0, p1 / np.maximum(q1, 1e-300)).sum())
            counts["iar_count"] += reached

    def advance(self, state: DecodeState, cursor: StridedCursor, unit_done: bool) -> None:
        cursor.prefilled = True
        ended = cursor.ended >= 0
        if ended.any():
            last = np.where(ended, cursor.ended, 0)
            eos = ended & state.is_eos(np.take_along_axis(state.tokens, last[:, None], axis=1)[:, 0])
            state.stop_after(eos, last)
            state.finish(ended & (state.request == RequestStatus.RUNNING))
        cursor.unit += 1
        cursor.step = 0

    def report(self, cursor: StridedCursor) -> dict[str, Any]:
        return cursor.counts


@dataclasses.dataclass(frozen=True)
class Strided(_Strided):
    """I-DLM's introspective strided decoding (see the module docstring).

    Attributes:
      stride: N, the most tokens a forward emits (2N-1 query rows a verify step); the model
        must have been trained with noisy blocks of at least N-1 masks (`block_size`).
      verify, proposal, relax: the acceptance rule (`Acceptance`).
      iar: also measure the introspective acceptance rate (fetches the rows' logits at T = 0).
    """

    stride: int = dataclasses.field(default=4, metadata={"help": "ISD stride N: at most N tokens per forward"})
    verify: str = dataclasses.field(default="exact", metadata={
        "help": "ISD acceptance: exact, or softmax_q (the released code's ratio; inexact at T > 0)",
        "choices": VERIFY})
    proposal: str = dataclasses.field(default="argmax", metadata={
        "help": "ISD drafts: the mask rows' argmax, or a sample", "choices": PROPOSALS})
    relax: float = dataclasses.field(default=0.0, metadata={
        "help": "ISD relaxed acceptance: ratio x (1 + relax); 0 = lossless, > 0 lossy"})
    iar: bool = dataclasses.field(default=False, metadata={
        "help": "ISD: measure the introspective acceptance rate (needs the rows' logits)"})

    def __post_init__(self) -> None:
        s = self.stride
        if not isinstance(s, numbers.Integral) or isinstance(s, bool) or s < 1:
            raise ConfigError(f"stride={s!r} must be an integer >= 1")
        object.__setattr__(self, "_rule", Acceptance(self.verify, self.proposal, self.relax))

    @property
    def n(self) -> int:
        return self.stride

    @property
    def acceptance(self) -> Acceptance:
        return self._rule

    @property
    def measure_iar(self) -> bool:
        return self.iar


@dataclasses.dataclass(frozen=True)
class LeftToRight(_Strided):
    """Plain left-to-right (autoregressive) decoding of a causal, logit-shift model: one row a
    step, the pending token, whose prediction is the next token (stride 1 of `Strided`, with
    the same EOS handling). Greedy at T = 0, else sampled with the proposer's filter."""

    name: ClassVar[str] = "ar"

    @property
    def n(self) -> int:
        return 1

"""llada.cpp's dual-path progressive revision (DPPR), a revision policy (NumPy only).

`ProgressiveRevision` is llada.cpp's dual-path progressive revision (§3.3). Generated slots
move through three states: IV (invisible: MASK or CANDIDATE, fed as the mask), V (VISIBLE: fed
as its token, its identity and K/V may still change) and S (STABLE: final). What the commit
rule commits leaves IV: to S when its confidence reaches `theta_stable`, else to V. So with
the threshold rule at 0.7 (`preset("llada-cpp")`) a slot becomes visible at 0.7 and stable at
0.9, the paper's defaults; the rule's at-least-one commit is the paper's "promote the most
confident IV slot" progress rule. V and S slots both feed later steps; the K/V of V slots are
stored as revisable entries, those of S slots as stable ones. A block is finished when it has
no IV slot left. States only move IV -> V -> S or IV -> S; V never returns to IV.

Revisiting V slots:
  in the window  with `revise` and `revisit="in_place"`, every window forward re-scores the V
                 slots it predicts (they keep requesting logits; S slots do not): the same
                 token at >= theta_stable becomes S; another token at >= theta_visible
                 replaces it (a revision).
  CPU path       `refresh_rows` > 0: V slots that have left the window (tracked in the
                 cache) are re-scored by a second executor ("CPU path": small row buckets,
                 its own thread when the executor can `fork`, the same weights) with the same
                 rules, and their K/V recomputed from their current token. Up to
                 `refresh_rows` slots per step, stale K/V first, then the lowest confidence,
                 then the lowest position. A refresh is started at the beginning of a step
                 from the state as it then is, and merged at the step's end (delayed merge):
                 the step it runs beside never reads it.
`revisit="remask"` scores a filled slot from a duplicate query at its position whose input is
the mask and which cannot see the slot itself (leave-one-out): for models whose clean
positions were never trained (a masked-diffusion loss alone), whose in-place confidence says
little. With `revise`, each window forward appends such a probe row (`StepPlan.probes`) for up
to `window_probes` of the V slots it predicts (lowest confidence first) and applies the same
rules to their predictions; the CPU path re-scores, with duplicate rows of its own, the V
slots left behind and those inside the window that got no probe.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.cpu_path import CpuExecutor, CpuPath
from dlm_jax.runtime.revision import RevisionPolicy
from dlm_jax.runtime.scheduler import PlanShape, StepPlan
from dlm_jax.runtime.state import DecodeState, TokenState
from dlm_jax.techniques.lladacpp.refresh import Refresher

if TYPE_CHECKING:
    from dlm_jax.runtime.proposer import Proposal, Proposer

_VISIBLE, _STABLE = int(TokenState.VISIBLE), int(TokenState.STABLE)


def _unit(name: str, value: float, *, closed_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not ((0 <= value) if closed_low else (0 < value)) or value > 1:
        raise ConfigError(f"{name}={value!r} must be in {'[0' if closed_low else '(0'}, 1]")


class Scoring:
    """How a filled (visible) slot is scored: the decisions that differ between scoring a
    slot in place and leave-one-out."""

    in_window: bool  # window forwards score the visible slots they predict from their own rows
    probes: bool  # window forwards carry leave-one-out probe rows
    refresh_copies: int  # CPU-path query rows per refreshed slot (the last copy's prediction scores)

    def refresh_end(self, plan: StepPlan) -> int:
        """The CPU path refreshes visible slots left of this slot."""
        raise NotImplementedError


class InPlace(Scoring):
    """A slot's own row, fed its token, scores it."""

    in_window, probes, refresh_copies = True, False, 1

    def refresh_end(self, plan: StepPlan) -> int:
        return int(plan.window[0])  # the window scores its own


class LeaveOneOut(Scoring):
    """A duplicate query at the slot's position, fed the mask and blind to the slot, scores
    it (`revisit="remask"`)."""

    in_window, probes, refresh_copies = False, True, 2

    def refresh_end(self, plan: StepPlan) -> int:
        return int(plan.window.max()) + 1  # also what the window's probes leave out


SCORINGS: dict[str, Scoring] = {"in_place": InPlace(), "remask": LeaveOneOut()}


@dataclasses.dataclass(frozen=True)
class ProgressiveRevision(RevisionPolicy):
    theta_stable: float = dataclasses.field(
        default=0.9, metadata={"help": "confidence that makes a committed token stable (DPPR)"})
    theta_visible: float = dataclasses.field(
        default=0.7, metadata={"help": "confidence a new prediction needs to replace a visible token"})
    revise: bool = dataclasses.field(
        default=True, metadata={"help": "window forwards re-score visible tokens (in_place only)"})
    refresh_rows: int = dataclasses.field(
        default=8, metadata={"help": "visible tokens the CPU path refreshes per step (0: off)"})
    revisit: str = dataclasses.field(
        default="in_place", metadata={"help": "how a filled token is scored", "choices": tuple(SCORINGS)})
    window_probes: int = dataclasses.field(
        default=32, metadata={"help": "visible tokens a window forward re-scores by leave-one-out probe rows "
                                      "(remask only; 0: the CPU path alone re-scores them)"})

    def __post_init__(self) -> None:
        _unit("theta_stable", self.theta_stable)
        _unit("theta_visible", self.theta_visible)
        for name in ("refresh_rows", "window_probes"):
            r = getattr(self, name)
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise ConfigError(f"{name}={r!r} must be an integer >= 0")
        if self.revisit not in SCORINGS:
            raise ConfigError(f"revisit={self.revisit!r} is not one of {tuple(SCORINGS)}")

    @property
    def scoring(self) -> Scoring:
        return SCORINGS[self.revisit]

    def commit(self, state: DecodeState, plan: StepPlan, proposal: Proposal, committed: np.ndarray) -> None:
        """IV -> S at `theta_stable`, else IV -> V."""
        if not committed.any():
            return
        tgt, conf = plan.target_index, proposal.confidence
        low = committed & (conf < self.theta_stable)
        state.count("visible_made", int(low.sum()))
        state.count("stable_made", int((committed & ~low).sum()))
        state.commit(tgt, committed & ~low, proposal.tokens)
        state.make_visible(tgt, low, proposal.tokens)

    def after_step(self, state: DecodeState, plan: StepPlan, proposal: Proposal, committed: np.ndarray) -> None:
        if self.revise and self.scoring.in_window:
            tgt = plan.target_index
            v = (state.status[:, tgt] == _VISIBLE) & ~committed & state.active[:, None]
            if v.any():
                self.rescore(state, tgt, v, top=proposal.tokens, prob=proposal.confidence, counter="window")

    @property
    def probing(self) -> bool:
        """Whether window forwards carry leave-one-out probe rows."""
        return self.scoring.probes and self.revise and self.window_probes > 0

    def probe(self, state: DecodeState, plan: StepPlan) -> tuple[StepPlan, np.ndarray | None]:
        """The plan with probe rows for up to `window_probes` of the V slots it predicts
        (lowest confidence first), and [B, D] which (row, probe) pairs are visible now."""
        if not self.probing:
            return plan, None
        tgt = plan.targets
        vis = (state.status[:, tgt] == _VISIBLE) & state.active[:, None]
        cols = np.flatnonzero(vis.any(axis=0))
        if not len(cols):
            return plan, None
        if len(cols) > self.window_probes:
            conf = np.where(vis[:, cols], np.nan_to_num(state.confidence[:, tgt][:, cols], nan=0.0), np.inf)
            cols = np.sort(cols[np.lexsort((cols, conf.min(axis=0)))[:self.window_probes]])
        return dataclasses.replace(plan, probes=tgt[cols]), vis[:, cols]

    def after_probes(self, state: DecodeState, plan: StepPlan, probed: np.ndarray, *, top: np.ndarray,
                     prob: np.ndarray) -> None:
        """Apply the probes' predictions ([B, D]) to the slots that were visible when the
        step was planned and still are."""
        scored = probed & (state.status[:, plan.probes] == _VISIBLE)
        self.rescore(state, plan.probes, scored, top=top, prob=prob.astype(np.float64), counter="probe")

    def rescore(self, state: DecodeState, slots, scored: np.ndarray, *, top: np.ndarray, prob: np.ndarray,
                counter: str) -> tuple[np.ndarray, np.ndarray]:
        """Apply a new prediction (`top`, `prob` [B, n]) to the `scored` visible slots:
        the same token at >= theta_stable -> S; another token at >= theta_visible replaces
        it. Returns ([B, n] promoted, [B, n] revised)."""
        same = top == state.tokens[:, slots]
        promote = scored & same & (prob >= self.theta_stable)
        revise = scored & ~same & (prob >= self.theta_visible)
        state.record(slots, scored, np.where(same, prob, 1.0 - prob))
        if promote.any():
            state.promote(slots, promote)
            state.count(f"{counter}_promoted", int(promote.sum()))
        if revise.any():
            state.revise(slots, revise, top)
            state.count(f"{counter}_revised", int(revise.sum()))
        return promote, revise

    def plan_shapes(self, prompt_lens: Sequence[int], gen_len: int, *, shift: int,
                    window_shapes: set[PlanShape]) -> set[PlanShape]:
        """Every window shape widened by 1 to `window_probes` probe rows, when probing."""
        if not self.probing:
            return set()
        return {PlanShape(w + d, c, r + d) for w, c, r in window_shapes for d in range(1, self.window_probes + 1)}

    def cpu_shapes(self, prompt_lens: Sequence[int], gen_len: int) -> set[PlanShape]:
        """The refresh steps: 1 to `refresh_rows` slots (times the scoring's copies) over
        every cache size."""
        if not self.refresh_rows:
            return set()
        copies = self.scoring.refresh_copies
        return {PlanShape(copies * n, c, copies * n) for n in range(1, self.refresh_rows + 1)
                for c in range(0, max(prompt_lens) + gen_len + 1)}

    def cpu_path(self, executor: Callable[[], CpuExecutor], config: ModelConfig,
                 proposer: Proposer | None = None) -> CpuPath | None:
        """The CPU path of one decode (None when refresh is off)."""
        if not self.refresh_rows:
            return None
        return Refresher(self, config, executor(), proposer)

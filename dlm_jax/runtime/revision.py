"""Revision policies: after each step's commits, revisit earlier decisions (NumPy only).

A policy sees the state after the commit rule ran and may change token states (demote,
promote, revise identities) and ask for refresh work. `NoRevision`, the default, leaves every
decision as committed.

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
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.state import DecodeState, TokenState

if TYPE_CHECKING:
    from dlm_jax.runtime.proposer import Proposal
    from dlm_jax.runtime.scheduler import StepPlan

REVISITS = ("in_place", "remask")
_VISIBLE, _STABLE = int(TokenState.VISIBLE), int(TokenState.STABLE)


@runtime_checkable
class RevisionPolicy(Protocol):
    def after_step(self, state: DecodeState, plan: StepPlan, proposal: Proposal, committed: np.ndarray) -> None:
        """Called once per step after the commits (`committed` [B, R] over `plan.targets`)."""
        ...


@dataclasses.dataclass(frozen=True)
class NoRevision:
    """Committed tokens are final."""

    def after_step(self, state: DecodeState, plan: StepPlan, proposal: Proposal, committed: np.ndarray) -> None:
        return None


def _unit(name: str, value: float, *, closed_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not ((0 <= value) if closed_low else (0 < value)) or value > 1:
        raise ConfigError(f"{name}={value!r} must be in {'[0' if closed_low else '(0'}, 1]")


@dataclasses.dataclass(frozen=True)
class ProgressiveRevision:
    theta_stable: float = dataclasses.field(
        default=0.9, metadata={"help": "confidence that makes a committed token stable (DPPR)"})
    theta_visible: float = dataclasses.field(
        default=0.7, metadata={"help": "confidence a new prediction needs to replace a visible token"})
    revise: bool = dataclasses.field(
        default=True, metadata={"help": "window forwards re-score visible tokens (in_place only)"})
    refresh_rows: int = dataclasses.field(
        default=8, metadata={"help": "visible tokens the CPU path refreshes per step (0: off)"})
    revisit: str = dataclasses.field(
        default="in_place", metadata={"help": "how a filled token is scored", "choices": REVISITS})
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
        if self.revisit not in REVISITS:
            raise ConfigError(f"revisit={self.revisit!r} is not one of {REVISITS}")

    def after_step(self, state: DecodeState, plan: StepPlan, proposal: Proposal, committed: np.ndarray) -> None:
        tgt = plan.target_index
        conf, tokens = proposal.confidence, proposal.tokens
        if committed.any():
            low = committed & (conf < self.theta_stable)
            state.count("visible_made", int(low.sum()))
            state.count("stable_made", int((committed & ~low).sum()))
            state.status[:, tgt] = np.where(low, _VISIBLE, state.status[:, tgt])
        if self.revise and self.revisit == "in_place":
            v = (state.status[:, tgt] == _VISIBLE) & ~committed & state.active[:, None]
            if v.any():
                self.rescore(state, tgt, v, tokens, conf, counter="window")

    @property
    def probing(self) -> bool:
        """Whether window forwards carry leave-one-out probe rows."""
        return self.revisit == "remask" and self.revise and self.window_probes > 0

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

    def after_probes(self, state: DecodeState, plan: StepPlan, probed: np.ndarray, top: np.ndarray,
                     prob: np.ndarray) -> None:
        """Apply the probes' predictions ([B, D]) to the slots that were visible when the
        step was planned and still are."""
        scored = probed & (state.status[:, plan.probes] == _VISIBLE)
        self.rescore(state, plan.probes, scored, top, prob.astype(np.float64), counter="probe")

    def probe_shapes(self, shapes: set) -> set:
        """Every shape of `shapes` widened by 1 to `window_probes` probe rows (for a fixed
        bundle), when probing."""
        from dlm_jax.runtime.scheduler import PlanShape

        if not self.probing:
            return set()
        return {PlanShape(w + d, c, r + d) for w, c, r in shapes for d in range(1, self.window_probes + 1)}

    def rescore(self, state: DecodeState, slots, scored: np.ndarray, top: np.ndarray, prob: np.ndarray,
                *, counter: str) -> tuple[np.ndarray, np.ndarray]:
        """Apply a new prediction (`top`, `prob` [B, n]) to the `scored` visible slots:
        the same token at >= theta_stable -> S; another token at >= theta_visible replaces
        it. Returns ([B, n] promoted, [B, n] revised)."""
        same = top == state.tokens[:, slots]
        promote = scored & same & (prob >= self.theta_stable)
        revise = scored & ~same & (prob >= self.theta_visible)
        state.confidence[:, slots] = np.where(scored, np.where(same, prob, 1.0 - prob), state.confidence[:, slots])
        if promote.any():
            state.status[:, slots] = np.where(promote, _STABLE, state.status[:, slots])
            state.count(f"{counter}_promoted", int(promote.sum()))
        if revise.any():
            state.tokens[:, slots] = np.where(revise, top, state.tokens[:, slots])
            state.count(f"{counter}_revised", int(revise.sum()))
        return promote, revise

    def plan_shapes(self, prompt_lens, gen_len: int, *, shift: int, complete: bool = False) -> set:
        """The CPU path's step shapes (refresh rows over every cache size), when `complete`;
        otherwise none (compiled or exported on first use)."""
        from dlm_jax.runtime.scheduler import PlanShape

        if not complete or not self.refresh_rows:
            return set()
        rows = self.refresh_rows * (2 if self.revisit == "remask" else 1)
        total = max(prompt_lens) + gen_len
        return {PlanShape(rows, c, rows) for c in range(0, total + 1, 32)} | {PlanShape(rows, total, rows)}

    def refresher(self, decoder):
        """The CPU path of one decode (None when refresh is off)."""
        if not self.refresh_rows:
            return None
        from dlm_jax.runtime.refresh import Refresher

        return Refresher(self, decoder)

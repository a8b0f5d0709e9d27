"""Revision policies: after each step's commits, revisit earlier decisions (NumPy only).

A policy sees the state after the commit rule ran and may change token states (demote,
promote, revise identities), add probe rows to a step and run a CPU path beside the main
steps (`runtime.cpu_path`). `NoRevision`, the default, leaves every decision as committed.
llada.cpp's dual-path progressive revision is the technique built on this seam
(`dlm_jax.techniques.lladacpp.dppr`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax.runtime.cpu_path import CpuExecutor, CpuPath
from dlm_jax.runtime.hooks import HookBase
from dlm_jax.runtime.scheduler import PlanShape, StepPlan
from dlm_jax.runtime.state import DecodeState

if TYPE_CHECKING:
    from dlm_jax.runtime.proposer import Proposal, Proposer


class RevisionPolicy(HookBase):
    """Revisits earlier decisions. The decoder calls, per decode: `cpu_path` (once, before
    the first step) and `plan_shapes` (warm-up); per step: `probe` (may add probe rows to
    the plan), then after the executor and the rule: `commit` (applies the rule's choices),
    `after_step`, `after_probes` (when the plan had probes). Defaults: commits are final,
    nothing else happens."""

    HOOKS = ("commit", "probe", "after_step", "after_probes", "plan_shapes", "cpu_shapes", "cpu_path")

    def commit(self, state: DecodeState, plan: StepPlan, proposal: Proposal, committed: np.ndarray) -> None:
        """Apply the rule's choices (`committed` [B, R] over `plan.targets`); default: final."""
        state.commit(plan.target_index, committed, proposal.tokens)

    def probe(self, state: DecodeState, plan: StepPlan) -> tuple[StepPlan, np.ndarray | None]:
        """The plan with extra rows for this policy, and what `after_probes` needs to read
        their predictions (None: no probes; the default)."""
        return plan, None

    def after_step(self, state: DecodeState, plan: StepPlan, proposal: Proposal, committed: np.ndarray) -> None:
        """After the commits (`committed` [B, R] over `plan.targets`); default nothing."""
        return None

    def after_probes(self, state: DecodeState, plan: StepPlan, probed: np.ndarray, *, top: np.ndarray,
                     prob: np.ndarray) -> None:
        """The probe rows' predictions (`top`, `prob` [B, D]) for what `probe` returned."""
        return None

    def plan_shapes(self, prompt_lens: Sequence[int], gen_len: int, *, shift: int,
                    window_shapes: set[PlanShape]) -> set[PlanShape]:
        """Shapes this policy adds to the scheduler's `window_shapes` (probe rows, the CPU
        path's steps); default none."""
        return set()

    def cpu_shapes(self, prompt_lens: Sequence[int], gen_len: int) -> set[PlanShape]:
        """The shapes of the CPU path's steps (run on its own executor); default none."""
        return set()

    def cpu_path(self, executor: Callable[[], CpuExecutor], config: ModelConfig,
                 proposer: Proposer | None = None) -> CpuPath | None:
        """The CPU path of one decode (default: none). `executor()` returns the executor it
        runs on (the main one's fork, made once per decoder, or the main one); `proposer` the
        decode's, whose penalties and bias its predictions honour (`proposer.predicted`)."""
        return None


@dataclasses.dataclass(frozen=True)
class NoRevision(RevisionPolicy):
    """Committed tokens are final."""

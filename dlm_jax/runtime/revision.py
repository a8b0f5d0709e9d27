"""Revision policies: after each step's commits, revisit earlier decisions (NumPy only).

A policy sees the state after the commit rule ran and may change token states (demote,
promote, revise identities) and ask for refresh work. llada.cpp's dual-path progressive
revision is one; `NoRevision`, the default, leaves every decision as committed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from dlm_jax.runtime.state import DecodeState

if TYPE_CHECKING:
    from dlm_jax.runtime.proposer import Proposal
    from dlm_jax.runtime.scheduler import StepPlan


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

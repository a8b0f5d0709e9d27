"""Placement policies: which parts of the model the executor keeps where its compiled step
runs, decided between steps from what the steps report (NumPy only).

TIDE's interval expert refresh (`dlm_jax.techniques.tide`: hit counters from the router's
choices, the resident experts refreshed every tau steps of a block, misses on a CPU path) is
the policy built on this seam. (PowerInfer-2's neuron placement is decided offline, and its
cold neurons are fetched inside the partitioned executor: it needs no policy here.) A policy
decides; the executor holds the tensors. Placement never changes what a
step computes, only where, so tokens are the same under every policy.

The decoder calls `validate` (the model's config and the executor's capabilities, before
anything runs), then per decode:
`begin` (before the first step), which returns the decode's own placement record (policies
are frozen configs shared by decodes; the record holds what one decode changes); per step:
`before_step` (after the plan, before the executor runs it; what it returns, if not None, goes
to `Executor.place`) and `after_step` (with the step's outputs); `end` after the last step, whose dict goes to `DecodeStats.placement`. `outputs`
names the optional step outputs the policy reads (`router_topk`). A policy that must be
calibrated first returns, from `probe`, the policy to run a probe decode of the same prompts
with, and makes its calibrated self from that decode's report (`calibrated`; `Model.generate`
does this). `NoPlacement`, the default, keeps everything where the executor put it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlm_jax._config import ModelConfig
from dlm_jax.runtime.hooks import HookBase
from dlm_jax.runtime.scheduler import StepPlan
from dlm_jax.runtime.state import DecodeState
from dlm_jax.runtime.step import Capabilities, StepOutputs


class PlacementPolicy(HookBase):
    HOOKS = ("outputs", "validate", "begin", "before_step", "after_step", "end", "probe", "calibrated")

    @property
    def outputs(self) -> frozenset[str]:
        """The optional step outputs this policy reads (default none)."""
        return frozenset()

    def validate(self, model: ModelConfig, capabilities: Capabilities) -> None:
        """Raise ConfigError (one line) if this policy cannot place `model`'s parts on an
        executor of these `capabilities`."""
        return None

    def begin(self, state: DecodeState, model: ModelConfig) -> Any:
        """A decode of `model` starts (its requests and slots are in `state`); returns its record."""
        return None

    def before_step(self, record: Any, state: DecodeState, plan: StepPlan) -> Any:
        """The step `plan` is about to run; what the executor should hold for it
        (`Executor.place`), or None to keep what it holds."""
        return None

    def after_step(self, record: Any, state: DecodeState, plan: StepPlan, outputs: StepOutputs) -> None:
        """The step ran; `outputs` holds what it returned."""
        return None

    def end(self, record: Any, state: DecodeState) -> dict:
        """The decode is over: what it reports (`DecodeStats.placement`)."""
        return {}

    def probe(self) -> PlacementPolicy | None:
        """The policy of a probe decode this one must be calibrated from first (None: ready)."""
        return None

    def calibrated(self, report: dict, model: ModelConfig) -> PlacementPolicy:
        """This policy calibrated from a probe decode's `DecodeStats.placement` `report`."""
        return self


@dataclasses.dataclass(frozen=True)
class NoPlacement(PlacementPolicy):
    """Everything stays where the executor put it."""

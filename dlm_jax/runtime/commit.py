"""Commit rules: which undecided slots of the current commit unit a decode step commits.

A decode step scores every undecided slot of the unit with a confidence (the proposer's
`confidence_scores`) and a commit rule picks the slots whose proposed token is kept.
Every rule works on the same arrays:

  confidence: [B, W] float, one score per slot of the unit (row b = request b);
    only entries where `candidates` is True are read.
  candidates: [B, W] bool, the undecided slots of the unit that may be committed.
  returns:    [B, W] bool, the slots to commit this step.

Invariants shared by every rule: a committed slot is always a candidate; a row with no
candidates commits nothing; a row with at least one candidate commits at least one slot
(for `TopKRule` only when its scheduled count for the step is >= 1, exactly as in LLaDA).
Candidates are ranked by confidence, highest first, with ties broken by the lower position
index (a stable sort on -confidence), so every rule commits a prefix of that ranking.

A rule also owns its unit's life: `begin(candidates, units=...)` returns the rule to use for
a unit that starts with these candidates (a fixed schedule is built there), and
`finished(steps, remaining)` says when the unit is done. Every rule derives from
`CommitRule`, whose defaults give the common answers (`PerStepRule`): the same rule every
unit, done when no candidate is left.

Rules:
  TopKSchedule   LLaDA's low-confidence remasking: a fixed number of steps per unit, split
                 evenly (`TopKRule` is the rule of one unit).
  ThresholdRule  Fast-dLLM's confidence threshold.
  FactorRule     Fast-dLLM's factor rule as released (`get_transfer_index_dynamic`).
  PaperFactorRule  the factor rule as the paper states it, (n + 1) * (1 - c_(n)) < factor.
  FrechetRule    Fast-dLLM++'s Frechet lower bound rule, G_n > delta.
  NoCommit       nothing: the schedule accepts its own proposals (ISD, left to right).

NumPy only: this module is part of the host runtime and must not import JAX.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.hooks import HookBase

__all__ = [
    "CommitRule",
    "FactorRule",
    "FrechetRule",
    "NoCommit",
    "PaperFactorRule",
    "PerStepRule",
    "ThresholdRule",
    "TopKRule",
    "TopKSchedule",
    "num_transfer_tokens",
]

# --------------------------------------------------------------------------- schedule


def num_transfer_tokens(masked: np.ndarray, steps: int) -> np.ndarray:
    """LLaDA's `get_num_transfer_tokens`: split each row's masked count evenly over `steps`.

    Every step gets `count // steps` tokens and the first `count % steps` steps one more.

    Args:
      masked: [B, block] bool, the masked positions of a block before its first step.
      steps: number of decode steps for the block (>= 1).

    Returns:
      [B, steps] int64; row b sums to the number of masked positions of row b.
    """
    if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"num_transfer_tokens steps={steps!r} must be a positive integer")
    masked = np.asarray(masked)
    if masked.ndim != 2:
        raise ValueError(f"masked must be [B, block], got shape {masked.shape}")
    count = masked.astype(bool).sum(axis=1).astype(np.int64)  # [B]
    base = count // steps
    remainder = count % steps
    extra = np.arange(steps)[None, :] < remainder[:, None]  # [B, steps]
    return base[:, None] + extra.astype(np.int64)


# --------------------------------------------------------------------------- helpers


def _check_inputs(confidence: np.ndarray, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate and normalise ([B, W] float64 confidence, [B, W] bool candidates)."""
    confidence = np.asarray(confidence, dtype=np.float64)
    candidates = np.asarray(candidates)
    if confidence.ndim != 2:
        raise ValueError(f"confidence must be [B, W], got shape {confidence.shape}")
    if candidates.shape != confidence.shape:
        raise ValueError(f"candidates shape {candidates.shape} != confidence shape {confidence.shape}")
    if candidates.dtype != np.bool_:
        raise ValueError(f"candidates must be a bool mask, got dtype {candidates.dtype}")
    if np.isnan(confidence[candidates]).any():
        raise ValueError("confidence is NaN at a candidate position")
    return confidence, candidates


def _rank(confidence: np.ndarray, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank each row's candidates by confidence, highest first, ties by lower position.

    Returns:
      order: [B, W] int, positions in rank order; the row's candidates come first.
      sorted_conf: [B, W] float64, confidence in rank order (only the first m_b are candidates).
      m: [B] int, number of candidates per row.
    """
    # lexsort: the last key is primary -> candidates first, then -confidence, then (stable)
    # lower position index. Non-candidates never interleave with candidates, even at +-inf.
    order = np.lexsort((-confidence, ~candidates), axis=-1)
    sorted_conf = confidence[np.arange(len(order))[:, None], order]
    m = candidates.sum(axis=1)
    return order, sorted_conf, m


def _commit_prefix(order: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Commit the first n[b] ranked positions of each row. order: [B, W]; n: [B] -> [B, W] bool."""
    width = order.shape[1]
    out = np.empty(order.shape, dtype=bool)  # (each row's order is a permutation: every entry set)
    out[np.arange(len(order))[:, None], order] = np.arange(width)[None, :] < n[:, None]  # rank < n
    return out


def _at_least_one(n: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Clamp per-row counts to [1, m] where a row has candidates, 0 where it has none."""
    return np.where(m > 0, np.minimum(np.maximum(n, 1), np.maximum(m, 1)), 0)  # (np.clip, without its overhead)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------- rules


class CommitRule(HookBase):
    """Picks the slots a decode step commits (see the module docstring for the contract).

    The decoder calls `check` (when a config is built), then per unit `begin` at its first
    step, and per step `select`, `finished` and `max_steps` (a loop guard). A rule defines
    `select`; the other hooks default to a rule that decides every step afresh (the same rule
    for every unit, done when no candidate is left, at most one step per slot since it commits
    at least one, any generation). A misspelt or misdeclared hook in a subclass is refused when
    its class is defined (`HookBase`).
    """

    HOOKS = ("begin", "select", "finished", "max_steps", "check")

    def begin(self, candidates: np.ndarray, *, units: int) -> CommitRule:
        """The rule for a unit whose candidates at its first step are `candidates` [B, W];
        `units` is the number of units in the generation. Default: this rule."""
        return self

    def select(self, confidence: np.ndarray, candidates: np.ndarray, *, step: int = 0) -> np.ndarray:
        """confidence: [B, W] float; candidates: [B, W] bool; step: the step within the unit.
        Returns [B, W] bool, a subset of `candidates`."""
        raise NotImplementedError

    def finished(self, steps: int, remaining: np.ndarray) -> bool:
        """Whether the unit is done after `steps` steps with `remaining` [B, W] candidates.
        Default: when no candidate is left."""
        return not remaining.any()

    def max_steps(self, width: int) -> int:
        """An upper bound on the steps a unit of `width` slots takes (a loop guard). Default:
        `width`, one step per slot."""
        return width

    def check(self, *, units: int, gen_len: int | None = None) -> None:
        """Raise ConfigError if the rule cannot decode a generation of `gen_len` tokens in
        `units` units. Default: any generation."""
        return None


class PerStepRule(CommitRule):
    """The unit life of a rule that decides every step afresh: the same rule for every unit,
    done when no candidate is left, at most one step per slot (it commits at least one); that
    is `CommitRule`'s defaults."""


@dataclasses.dataclass(frozen=True, eq=False)
class TopKRule(CommitRule):
    """LLaDA's low-confidence remasking: at step i commit the counts[b, i] most confident
    candidates of row b (ties: lower position first; LLaDA's `torch.topk` leaves ties unspecified).

    Exactly min(counts[b, i], n_candidates[b]) positions are committed, as in LLaDA, so a row
    commits nothing at a step whose count is 0; the "at least one per row with candidates"
    invariant holds only where counts[b, step] >= 1 (always true for the schedule from
    `num_transfer_tokens` as long as the block is not finished early).

    Attributes:
      counts: [B, steps] non-negative int, e.g. `num_transfer_tokens(masked, steps)`.
        Stored as a read-only copy; equality is by identity (the field is an array).
    """

    counts: np.ndarray

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts)
        if counts.ndim != 2 or counts.shape[1] < 1:
            raise ConfigError(f"TopKRule.counts shape={counts.shape} must be [B, steps] with steps >= 1")
        if not np.issubdtype(counts.dtype, np.integer):
            raise ConfigError(f"TopKRule.counts dtype={counts.dtype} must be an integer dtype")
        if (counts < 0).any():
            raise ConfigError(f"TopKRule.counts min={int(counts.min())} must be >= 0")
        counts = counts.astype(np.int64, copy=True)
        counts.flags.writeable = False
        object.__setattr__(self, "counts", counts)

    def select(self, confidence: np.ndarray, candidates: np.ndarray, *, step: int = 0) -> np.ndarray:
        """Commit the counts[:, step] most confident candidates of each row -> [B, W] bool."""
        confidence, candidates = _check_inputs(confidence, candidates)
        steps = self.counts.shape[1]
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or not 0 <= step < steps:
            raise ConfigError(f"TopKRule.select step={step!r} must be in [0, {steps})")
        if self.counts.shape[0] != confidence.shape[0]:
            raise ValueError(
                f"TopKRule.counts has {self.counts.shape[0]} rows but confidence has {confidence.shape[0]}")
        order, _, m = _rank(confidence, candidates)
        n = np.minimum(self.counts[:, step], m)
        return _commit_prefix(order, n)

    def begin(self, candidates: np.ndarray, *, units: int) -> TopKRule:
        return self

    def finished(self, steps: int, remaining: np.ndarray) -> bool:
        """LLaDA runs exactly the scheduled number of steps."""
        return steps >= self.counts.shape[1]

    def max_steps(self, width: int) -> int:
        return self.counts.shape[1]

    def check(self, *, units: int, gen_len: int | None = None) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class TopKSchedule(CommitRule):
    """LLaDA's schedule: `steps` denoising steps over the whole generation, the same number
    in each unit, and in each unit's step i the `num_transfer_tokens` count of the unit's
    candidates at its start (`TopKRule`).

    Attributes:
      steps: total steps; None = one per generated slot (each unit gets its width).
    """

    steps: int | None = dataclasses.field(
        default=None, metadata={"help": "total denoising steps (default: one per generated token)"})

    def __post_init__(self) -> None:
        s = self.steps
        if s is not None and (not isinstance(s, numbers.Integral) or isinstance(s, bool) or s <= 0):
            raise ConfigError(f"steps={s!r} must be a positive integer")

    def check(self, *, units: int, gen_len: int | None = None) -> None:
        if self.steps is not None and self.steps % units:
            raise ConfigError(f"steps={self.steps} must be a positive multiple of the number of blocks ({units})")
        if self.steps is not None and gen_len is not None and self.steps > gen_len:
            # Later steps would commit nothing: each one a full forward for no token.
            raise ConfigError(f"steps={self.steps} exceeds gen_len={gen_len}: at most one step per "
                              f"generated token")

    def begin(self, candidates: np.ndarray, *, units: int) -> TopKRule:
        self.check(units=units)
        per_unit = candidates.shape[1] if self.steps is None else self.steps // units
        return TopKRule(num_transfer_tokens(candidates, per_unit))

    def select(self, confidence: np.ndarray, candidates: np.ndarray, *, step: int = 0) -> np.ndarray:
        raise TypeError("TopKSchedule selects through the TopKRule that begin() returns for each unit")

    def finished(self, steps: int, remaining: np.ndarray) -> bool:
        raise TypeError("TopKSchedule finishes units through the TopKRule that begin() returns")

    def max_steps(self, width: int) -> int:
        return width if self.steps is None else self.steps


@dataclasses.dataclass(frozen=True)
class NoCommit(PerStepRule):
    """Commits nothing itself: for a schedule that accepts its own proposals in `settle` (ISD,
    left to right), whose plans name no slot the rule could take."""

    def select(self, confidence: np.ndarray, candidates: np.ndarray, *, step: int = 0) -> np.ndarray:
        return np.zeros(np.shape(candidates), bool)


@dataclasses.dataclass(frozen=True)
class ThresholdRule(PerStepRule):
    """Fast-dLLM's threshold rule: the most confident candidate of a row always commits;
    every other candidate commits iff its confidence >= threshold.

    Meant for `prob` confidences; with `entropy` (scores <= 0) it commits one token per step.

    Attributes:
      threshold: in (0, 1].
    """

    threshold: float = dataclasses.field(default=0.9, metadata={"help": "confidence threshold (Fast-dLLM)"})

    def __post_init__(self) -> None:
        t = self.threshold
        if not _real(t) or not 0 < t <= 1:
            raise ConfigError(f"ThresholdRule.threshold={t!r} must be in (0, 1]")

    def select(self, confidence: np.ndarray, candidates: np.ndarray, *, step: int = 0) -> np.ndarray:
        """Commit the top candidate plus every candidate at or above the threshold -> [B, W] bool."""
        confidence, candidates = _check_inputs(confidence, candidates)
        order, sorted_conf, m = _rank(confidence, candidates)
        # Candidates at or above the threshold form a prefix of the ranking.
        valid = np.arange(confidence.shape[1])[None, :] < m[:, None]  # [B, W] rank < m
        n = (valid & (sorted_conf >= self.threshold)).sum(axis=1)
        return _commit_prefix(order, _at_least_one(n, m))


@dataclasses.dataclass(frozen=True)
class FactorRule(PerStepRule):
    """Fast-dLLM's factor rule as released (`get_transfer_index_dynamic` in NVlabs/Fast-dLLM
    `llada/generate.py`), which produced the published numbers. With the row's candidate
    confidences sorted c_(1) >= ... >= c_(m), scan n = 1..m and stop at the first n whose
    c_(n) < 1 - factor / (n + 1) (for n = 1 the bar is -1); commit the n - 1 that passed, except
    that a scan stopping at the last candidate commits all m (the code's
    `top_i == len(threshs) - 1` branch: with two candidates left it always commits both).

    `PaperFactorRule` is the paper's statement: the strict (n + 1)(1 - c_(n)) < factor and no
    last-candidate exception.

    Attributes:
      factor: f > 0 (finite).
    """

    factor: float = dataclasses.field(default=1.0, metadata={"help": "factor of the factor rule (Fast-dLLM)"})

    def __post_init__(self) -> None:
        f = self.factor
        if not _real(f) or f <= 0:
            raise ConfigError(f"{type(self).__name__}.factor={f!r} must be a finite number > 0")

    def select(self, confidence: np.ndarray, candidates: np.ndarray, *, step: int = 0) -> np.ndarray:
        """Commit the leading ranked run that passes (all m if only the last fails) -> [B, W] bool."""
        confidence, candidates = _check_inputs(confidence, candidates)
        order, sorted_conf, m = _rank(confidence, candidates)
        rank = np.arange(confidence.shape[1])[None, :]  # rank r holds c_(r + 1)
        thresholds = np.where(rank == 0, -1.0, 1.0 - self.factor / (rank + 2))  # the code's threshs
        ok = (rank < m[:, None]) & (sorted_conf >= thresholds)
        n = np.logical_and.accumulate(ok, axis=1).sum(axis=1)  # leading run of passes
        n = np.where(n == m - 1, m, n)  # the scan stopped at the last candidate
        return _commit_prefix(order, _at_least_one(n, m))


@dataclasses.dataclass(frozen=True)
class PaperFactorRule(FactorRule):
    """Fast-dLLM's factor rule as the paper states it: commit the largest n such that
    (n' + 1) * (1 - c_(n')) < factor for every n' <= n; at least one.

    Because (n + 1) * (1 - c_(n)) is non-decreasing in n for sorted c, this is the same as
    the largest n whose own condition holds. Meant for probabilities in [0, 1] (the `prob`
    kind); other scores are accepted but the rule has no meaning for them. It differs from the
    released `FactorRule` on exact ties (`<` against the code's `>=` on c) and when only the
    weakest candidate fails (the code commits it too).
    """

    def select(self, confidence: np.ndarray, candidates: np.ndarray, *, step: int = 0) -> np.ndarray:
        """Commit the longest ranked prefix satisfying the factor condition -> [B, W] bool."""
        confidence, candidates = _check_inputs(confidence, candidates)
        order, sorted_conf, m = _rank(confidence, candidates)
        rank = np.arange(confidence.shape[1])[None, :]  # rank r holds c_(r + 1)
        ok = (rank < m[:, None]) & ((rank + 2) * (1.0 - sorted_conf) < self.factor)
        n = np.logical_and.accumulate(ok, axis=1).sum(axis=1)  # leading run of True
        return _commit_prefix(order, _at_least_one(n, m))


@dataclasses.dataclass(frozen=True)
class FrechetRule(PerStepRule):
    """Fast-dLLM++'s Frechet rule: with c_(1) >= ... >= c_(m), let

        L_n = max(0, sum_{j <= n} c_(j) - (n - 1))   (Frechet lower bound on all n being right)
        U_n = 1 - c_(n)                              (error of the weakest committed token)
        G_n = L_n - U_n

    and commit the largest n in 1..m with G_n > delta; at least one.

    L_n is computed as max(0, 1 - sum_{j <= n} (1 - c_(j))), the same quantity with less
    cancellation when many confidences are close to 1. For sorted c, G_n is non-increasing
    in n, so the largest such n is also the end of the leading run. Meant for probabilities
    in [0, 1] (the `prob` kind); other scores are accepted but the bound has no meaning.

    At delta = 1 - f it commits at least as many tokens as `PaperFactorRule(f)` (G_n >= 1 - (n+1) U_n),
    and exactly as many when the candidates' confidences are all equal.

    Attributes:
      delta: in [0, 1).
    """

    delta: float = dataclasses.field(default=0.25, metadata={"help": "Frechet margin (Fast-dLLM++)"})

    def __post_init__(self) -> None:
        d = self.delta
        if not _real(d) or not 0 <= d < 1:
            raise ConfigError(f"FrechetRule.delta={d!r} must be in [0, 1)")

    def select(self, confidence: np.ndarray, candidates: np.ndarray, *, step: int = 0) -> np.ndarray:
        """Commit the largest ranked prefix with G_n > delta -> [B, W] bool."""
        confidence, candidates = _check_inputs(confidence, candidates)
        order, sorted_conf, m = _rank(confidence, candidates)
        width = confidence.shape[1]
        valid = np.arange(width)[None, :] < m[:, None]  # [B, W] rank < m
        u = np.where(valid, 1.0 - sorted_conf, 0.0)  # U_n in rank order
        lower = np.maximum(0.0, 1.0 - np.cumsum(u, axis=1))  # L_n
        ok = valid & (lower - u > self.delta)  # G_n > delta
        # Largest n with ok: width - (index of the first True from the right); 0 if none.
        n = np.where(ok.any(axis=1), width - np.argmax(ok[:, ::-1], axis=1), 0)
        return _commit_prefix(order, _at_least_one(n, m))

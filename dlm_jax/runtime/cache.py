"""Cache modes as strategies: which slots a step recomputes and which come from the cache.

Slots are positions of the host's [B, S] sequence grid. A strategy answers, for step `i` of
the block whose predictions need window slots [start, end), which slots are window queries,
which slots are read from the host K/V cache, and whether the window's K/V replace the cache.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from dlm_jax._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    window: np.ndarray  # [Wlive] slots recomputed this step, ascending
    cached: np.ndarray  # [Plive] slots whose K/V come from the host cache
    store: bool  # write the window's K/V into the host cache


class CacheStrategy(Protocol):
    def plan(self, step: int, start: int, end: int, total: int) -> WindowPlan: ...


def _full(total: int, store: bool) -> WindowPlan:
    return WindowPlan(np.arange(total), np.arange(0), store)


@dataclasses.dataclass(frozen=True)
class NoCache:
    """LLaDA: the whole sequence every step."""

    def plan(self, step: int, start: int, end: int, total: int) -> WindowPlan:
        return _full(total, store=False)


@dataclasses.dataclass(frozen=True)
class PrefixCache:
    """Fast-dLLM prefix cache: a full forward at each block start fills the cache; later steps
    recompute the block and everything after it over the cached prefix."""

    def plan(self, step: int, start: int, end: int, total: int) -> WindowPlan:
        if step == 0:
            return _full(total, store=True)
        return WindowPlan(np.arange(start, total), np.arange(start), False)


@dataclasses.dataclass(frozen=True)
class DualCache:
    """Fast-dLLM dual cache: prefix and suffix cached at block start; only the block is
    recomputed."""

    def plan(self, step: int, start: int, end: int, total: int) -> WindowPlan:
        if step == 0:
            return _full(total, store=True)
        return WindowPlan(np.arange(start, end), np.concatenate([np.arange(start), np.arange(end, total)]), False)


CACHES = {"none": NoCache(), "prefix": PrefixCache(), "dual": DualCache()}


def make_cache(name: str) -> CacheStrategy:
    if name not in CACHES:
        raise ConfigError(f"unknown cache mode {name!r}; known: {sorted(CACHES)}")
    return CACHES[name]

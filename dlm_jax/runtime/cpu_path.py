"""CPU paths: work a revision policy runs beside the main steps, on a second executor, merged
at the step boundary (NumPy only).

The loop (`runtime.decoder`) asks the revision policy for a `CpuPath` once per decode
(`RevisionPolicy.cpu_path`) and calls `submit` before each main step and `merge` after it.
`CpuExecutor` is what such a path runs on: the main executor's `fork()` on a thread of its
own, or the main executor itself, in turn. llada.cpp's DPPR refresh is the one CPU path today
(`dlm_jax.techniques.lladacpp.refresh`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from dlm_jax.runtime.hooks import HookBase
from dlm_jax.runtime.kvcache import KVCache
from dlm_jax.runtime.state import DecodeState
from dlm_jax.runtime.step import Executor

if TYPE_CHECKING:
    from dlm_jax.runtime.scheduler import StepPlan


class CpuExecutor(NamedTuple):
    """The executor a CPU path runs on, and whether it may run beside the main step (a fork
    of the main executor) or must run in turn (the main executor itself)."""

    executor: Executor
    threaded: bool


class CpuPath(HookBase):
    """Work a revision policy runs beside the main steps (llada.cpp's CPU path): `submit`
    before a main step reads the state and the decode's K/V (`cache`) as they are, `merge`
    applies the result at the step boundary, `close` ends it after the decode."""

    HOOKS = ("submit", "merge", "close")

    def submit(self, state: DecodeState, cache: KVCache, plan: StepPlan) -> None:
        raise NotImplementedError

    def merge(self, state: DecodeState, cache: KVCache) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None

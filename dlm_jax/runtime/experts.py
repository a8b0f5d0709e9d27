"""TIDE's I/O-aware expert placement for MoE dLLMs: residency accounting, the drift and
miss-curve estimates, and the refresh-interval (tau) solver (NumPy only; SPECS 3).

Per sparse FFN layer, B of the E routed experts are resident (where the compiled step runs,
e.g. the GPU); the other E - B sit on the host. Within a block, step t = 0..T-1 is a *refresh
step* when t % tau == 0: every layer's resident set becomes its top-B experts by hits, and the
experts that enter it are migrations (I/O). Other steps keep the placement. A token-expert
assignment to a non-resident expert is a miss (computed on the CPU path). Placement only reads
the router's choices; it never changes them, so decoded tokens are the same under every
placement (TIDE's lossless property).

Axes: L sparse FFN layers, E routed experts per layer (shared experts are outside E and never
placed), B resident experts per layer (the budget), N tokens of a step, k experts per token.
`topk` arrays are [L, N, k] int expert ids, -1 where a row is padding. A *trace* is a sequence
of blocks, each a sequence of one [L, N, k] array per step.

- `ExpertPlacement`: the residency state machine and its counters.
The `PlacementPolicy` that drives it from a decode's `router_topk` step output comes with that
output (issue 29); until then it prices recorded routing traces.
- `drift`, `miss_curve`: d (Eq. 4) and f(tau) (Eq. 6) estimated from traces.
- `io_cost`, `cpu_cost`, `solve_tau`: Eq. 5, Eq. 6 and the exhaustive Eq. 7 search.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from dlm_jax._errors import ConfigError

HITS_MODES = ("current_step", "previous_step")

Trace = Sequence[Sequence[np.ndarray]]  # blocks -> steps -> [L, N, k] int expert ids (-1: padding)


def _int(name: str, value: Any, lo: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{name}={value!r} must be an integer >= {lo}")
    return int(value)


def _counts(topk: np.ndarray, n_experts: int) -> np.ndarray:
    """[L, N, k] expert ids (-1 ignored) -> [L, E] int64 assignments per expert."""
    n_layers = topk.shape[0]
    ids = topk.reshape(n_layers, -1).astype(np.int64)
    live = ids >= 0
    flat = (ids + n_experts * np.arange(n_layers)[:, None])[live]
    return np.bincount(flat, minlength=n_layers * n_experts).reshape(n_layers, n_experts)


def _top_b(hits: np.ndarray, resident: np.ndarray, budget: int) -> np.ndarray:
    """[L, E] hits and [L, E] bool resident -> [L, E] bool, each layer's top-B by hits;
    ties go to resident experts first, then to the lower id (SPECS 3.3 [S])."""
    n_experts = hits.shape[1]
    # One integer key ranks by hits, then residency, then lower id (the tail is < 2E).
    key = hits.astype(np.int64) * (2 * n_experts) + resident * n_experts + (n_experts - 1 - np.arange(n_experts))
    best = np.argsort(-key, axis=1, kind="stable")[:, :budget]
    target = np.zeros(hits.shape, bool)
    np.put_along_axis(target, best, True, axis=1)
    return target


def _check_topk(topk: Any, n_layers: int | None, n_experts: int | None, what: str = "topk") -> np.ndarray:
    topk = np.asarray(topk)
    if topk.ndim != 3 or not np.issubdtype(topk.dtype, np.integer):
        raise ConfigError(f"{what} shape={topk.shape} dtype={topk.dtype} must be [L, N, k] integer expert ids")
    if n_layers is not None and topk.shape[0] != n_layers:
        raise ConfigError(f"{what} has {topk.shape[0]} layers, the placement {n_layers}")
    hi = np.iinfo(np.int64).max if n_experts is None else n_experts
    if topk.size and (topk.min() < -1 or topk.max() >= hi):
        raise ConfigError(f"{what} ids span [{topk.min()}, {topk.max()}], must be in [-1, {hi})")
    return topk


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one step did, per layer ([L] int64 arrays).

    refresh: whether the resident sets were recomputed at this step.
    migrations: experts moved in (|target \\ resident|; as many moved out).
    misses: assignments to non-resident experts (after the refresh).
    hits: assignments to resident experts (after the refresh).
    unique: distinct experts the step's tokens used.
    """

    refresh: bool
    migrations: np.ndarray
    misses: np.ndarray
    hits: np.ndarray
    unique: np.ndarray


class ExpertPlacement:
    """Which B of each layer's E routed experts are resident, refreshed every tau steps of a
    block from hit counters, with running totals of refreshes, migrations, misses and hits.

    Args:
      n_layers: L sparse FFN layers.
      n_experts: E routed experts per layer.
      budget: B resident experts per layer, 1 <= B <= E.
      tau: refresh interval (>= 1), or None for a static placement that never migrates.
      hits: whose assignments rank experts at a refresh step t:
        "current_step": step t's own (faithful to TIDE; the router output of step t is known
          before step t is priced);
        "previous_step": the previous `step` call's (causal). That is step t - 1 of the block,
          or at t = 0 the previous block's last step; before any step (the first block's t = 0)
          the placement is kept and nothing migrates.
      shared: shared experts per layer; always resident, outside E, never placed (recorded only).
      initial: [L, B] int, the starting resident sets (e.g. each layer's top-B on a calibration
        trace, the static baseline); default experts 0..B-1 in every layer.
    """

    def __init__(self, n_layers: int, n_experts: int, budget: int, tau: int | None, hits: str = "current_step",
                 *, shared: int = 0, initial: np.ndarray | None = None) -> None:
        self.n_layers = _int("n_layers", n_layers, 1)
        self.n_experts = _int("n_experts", n_experts, 1)
        self.budget = _int("budget", budget, 1)
        if self.budget > self.n_experts:
            raise ConfigError(f"budget={budget!r} must be <= n_experts={n_experts}")
        self.tau = None if tau is None else _int("tau", tau, 1)
        if hits not in HITS_MODES:
            raise ConfigError(f"hits={hits!r} must be one of {HITS_MODES}")
        self.hits_mode = hits
        self.shared = _int("shared", shared, 0)
        if initial is None:
            initial = np.broadcast_to(np.arange(self.budget), (self.n_layers, self.budget))
        initial = np.asarray(initial)
        if initial.shape != (self.n_layers, self.budget) or not np.issubdtype(initial.dtype, np.integer):
            raise ConfigError(f"initial shape={initial.shape} dtype={initial.dtype} must be "
                              f"[{self.n_layers}, {self.budget}] integer expert ids")
        if initial.min() < 0 or initial.max() >= self.n_experts:
            raise ConfigError(f"initial ids span [{initial.min()}, {initial.max()}], must be in [0, {self.n_experts})")
        self._resident = np.zeros((self.n_layers, self.n_experts), bool)
        np.put_along_axis(self._resident, initial.astype(np.int64), True, axis=1)
        if (self._resident.sum(1) != self.budget).any():
            raise ConfigError("initial has a repeated expert id in a layer; each row must hold B distinct ids")
        self._previous: np.ndarray | None = None  # [L, E] assignments of the last step, for "previous_step"
        self.steps = 0
        self.refreshes = 0
        self.migrations = np.zeros(self.n_layers, np.int64)  # [L] totals
        self.misses = np.zeros(self.n_layers, np.int64)
        self.hits = np.zeros(self.n_layers, np.int64)

    @property
    def resident(self) -> np.ndarray:
        """[L, B] int64, each layer's resident experts in increasing id order."""
        return np.nonzero(self._resident)[1].reshape(self.n_layers, self.budget)

    def is_refresh(self, t: int) -> bool:
        """Whether step t of a block is a refresh step by the schedule (t % tau == 0)."""
        return self.tau is not None and t % self.tau == 0

    def step(self, t: int, topk: np.ndarray) -> StepRecord:
        """Account step t (within its block; t = 0 starts a block) whose tokens were routed to
        `topk` [L, N, k] (-1: padding, ignored; never modified). Refreshes first when t is a
        refresh step, then counts misses and hits against the resulting placement."""
        t = _int("t", t, 0)
        topk = _check_topk(topk, self.n_layers, self.n_experts)
        counts = _counts(topk, self.n_experts)  # [L, E]
        ranking = counts if self.hits_mode == "current_step" else self._previous
        refresh = self.is_refresh(t) and ranking is not None
        migrations = np.zeros(self.n_layers, np.int64)
        if refresh:
            target = _top_b(ranking, self._resident, self.budget)
            migrations = (target & ~self._resident).sum(1)
            self._resident = target
        hits = (counts * self._resident).sum(1)
        record = StepRecord(refresh=refresh, migrations=migrations, misses=counts.sum(1) - hits, hits=hits,
                            unique=(counts > 0).sum(1))
        self._previous = counts
        self.steps += 1
        self.refreshes += int(refresh)
        self.migrations += record.migrations
        self.misses += record.misses
        self.hits += record.hits
        return record


def _chain(block: Sequence[np.ndarray], budget: int, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """One block's steps -> ([T, L, E] assignments, [T, L, E] bool top-B of each step), the
    top-B chained as under tau = 1 with current-step hits (ties keep the previous step's)."""
    counts = np.stack([_counts(s, n_experts) for s in block])
    tops = np.zeros(counts.shape, bool)
    previous = np.zeros(counts.shape[1:], bool)
    for t, c in enumerate(counts):
        previous = tops[t] = _top_b(c, previous, budget)
    return counts, tops


def _blocks(traces: Trace, budget: int) -> tuple[list[Sequence[np.ndarray]], int]:
    """Checked blocks and E (the largest id + 1, at least B: experts above every seen id have
    no hits and the highest ids, so they never change a top-B)."""
    _int("B", budget, 1)
    blocks = [[_check_topk(s, None, None, what="trace step") for s in block] for block in traces]
    steps = [s for block in blocks for s in block]
    if len({s.shape[0] for s in steps}) > 1:
        raise ConfigError(f"trace steps disagree on L: {sorted({s.shape[0] for s in steps})}")
    top = max((int(s.max()) for s in steps if s.size), default=-1)
    return [b for b in blocks if b], max(top + 1, budget)


def drift(traces: Trace, B: int) -> float:
    """d (Eq. 4): the mean over layers and consecutive steps within a block of
    |top-B_t \\ top-B_{t-1}| / B, top-B chained within each block as in `_chain`."""
    blocks, n_experts = _blocks(traces, B)
    moved = pairs = 0
    for block in blocks:
        _, tops = _chain(block, B, n_experts)
        moved += int((tops[1:] & ~tops[:-1]).sum())
        pairs += (len(block) - 1) * tops.shape[1]
    if not pairs:
        raise ConfigError("drift needs a block of at least 2 steps")
    return moved / (pairs * B)


def miss_curve(traces: Trace, B: int, max_lag: int) -> np.ndarray:
    """f(tau) (Eq. 6) -> [max_lag + 1] float64 indexed by tau (f[0] = 0: no steps).

    miss(j) is the fraction of the token-expert assignments of step r + j that are not in the
    top-B of step r, pooled over every step r of every block with a step r + j in the block
    (each step taken as a refresh; top-B chained as in `drift`). f(tau) = mean_{j<tau} miss(j),
    the mean miss rate of a tau-step interval. It is an estimate, not forced monotone."""
    max_lag = _int("max_lag", max_lag, 1)
    blocks, n_experts = _blocks(traces, B)
    missed = np.zeros(max_lag)
    total = np.zeros(max_lag)
    for block in blocks:
        counts, tops = _chain(block, B, n_experts)
        for j in range(min(max_lag, len(block))):
            missed[j] += (counts[j:] * ~tops[:len(block) - j]).sum()
            total[j] += counts[j:].sum()
    if (total == 0).any():
        raise ConfigError(f"miss_curve max_lag={max_lag} needs assignments at every lag < {max_lag}; "
                          f"lag {int(np.argmin(total > 0))} has none (blocks too short)")
    return np.concatenate([[0.0], np.cumsum(missed / total) / np.arange(1, max_lag + 1)])


def io_cost(tau: Any, T: int, B: int, d: float, c_io: float) -> Any:
    """Eq. 5 as printed (SPECS 3.4 [S]): C_IO * (B*T/tau) * (1 - (1-d)**tau), the migrations
    of T steps refreshed every tau (B*T*d at tau = 1). `tau` may be an array."""
    tau = np.asarray(tau, np.float64)
    return c_io * (B * T / tau) * (1.0 - (1.0 - d) ** tau)


def cpu_cost(tau: Any, T: int, B: int, f: np.ndarray, c_cpu: float) -> Any:
    """Eq. 6: C_CPU * T * B * f(tau), with `f` indexed by tau (as `miss_curve` returns it).
    `tau` may be an array."""
    return c_cpu * T * B * np.asarray(f, np.float64)[np.asarray(tau)]


class CostTable(NamedTuple):
    """Eq. 7's terms for every candidate interval ([T - 1] arrays)."""

    taus: np.ndarray  # 1..T-1
    io: np.ndarray
    cpu: np.ndarray
    total: np.ndarray


def solve_tau(T: int, B: int, d: float, f: np.ndarray, c_io: float, c_cpu: float) -> tuple[int, CostTable]:
    """Eq. 7 with C_IO restored (SPECS 3.4 [S]): the tau in 1..T-1 minimizing
    io_cost + cpu_cost, by exhaustive search (ties: the smaller tau); and the cost table.
    `f` [>= T] is indexed by tau. With f non-decreasing, c_io = 0 gives tau = 1; with 0 < d
    and c_cpu = 0 it gives T - 1 ((1 - (1-d)**tau) / tau = d * mean_{j<tau} (1-d)**j decreases)."""
    T = _int("T", T, 2)
    B = _int("B", B, 1)
    if not 0.0 <= d <= 1.0:
        raise ConfigError(f"d={d!r} must be in [0, 1]")
    if c_io < 0 or c_cpu < 0:
        raise ConfigError(f"c_io={c_io!r} and c_cpu={c_cpu!r} must be >= 0")
    f = np.asarray(f, np.float64)
    if f.ndim != 1 or len(f) < T:
        raise ConfigError(f"f shape={f.shape} must be [>= T={T}], indexed by tau")
    taus = np.arange(1, T)
    io = io_cost(taus, T, B, d, c_io)
    cpu = cpu_cost(taus, T, B, f, c_cpu)
    total = io + cpu
    return int(taus[np.argmin(total)]), CostTable(taus, io, cpu, total)

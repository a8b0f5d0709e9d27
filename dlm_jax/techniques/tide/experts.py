"""TIDE's I/O-aware expert placement for MoE dLLMs: residency accounting, the drift and
miss-curve estimates, and the refresh-interval (tau) solver (NumPy only; TIDE §3, docs/techniques/tide.md).

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
- `drift`, `miss_curve`: d (Eq. 4) and f(tau) (Eq. 6) estimated from traces.
- `io_cost`, `cpu_cost`, `solve_tau`: Eq. 5, Eq. 6 and the exhaustive Eq. 7 search.
- `ExpertPolicy`: the decode loop's placement policy (`--experts`), driving an
  `ExpertPlacement` from each step's `router_topk` output; `static_sets`, `ExpertCosts` and
  `calibrate` make its static sets and its tau from a calibration decode.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.placement import PlacementPolicy
from dlm_jax.runtime.scheduler import StepPlan
from dlm_jax.runtime.state import DecodeState
from dlm_jax.runtime.step import Capabilities, StepOutputs

HITS_MODES = ("current_step", "previous_step")

Trace = Sequence[Sequence[np.ndarray]]  # blocks -> steps -> [L, N, k] int expert ids (-1: padding)


def _int(name: str, value: Any, lo: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{name}={value!r} must be an integer >= {lo}")
    return int(value)


def expert_counts(topk: np.ndarray, n_experts: int) -> np.ndarray:
    """[L, N, k] expert ids (-1 ignored) -> [L, E] int64 assignments per expert."""
    n_layers = topk.shape[0]
    ids = topk.reshape(n_layers, -1).astype(np.int64)
    live = ids >= 0
    flat = (ids + n_experts * np.arange(n_layers)[:, None])[live]
    return np.bincount(flat, minlength=n_layers * n_experts).reshape(n_layers, n_experts)


def _top_b(hits: np.ndarray, resident: np.ndarray, budget: int) -> np.ndarray:
    """[L, E] hits and [L, E] bool resident -> [L, E] bool, each layer's top-B by hits;
    ties go to resident experts first, then to the lower id (our choice: TIDE's Alg. 1 leaves ties open)."""
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

    @property
    def known_ahead(self) -> bool:
        """Whether a step's resident sets are known before it runs (`upcoming`): a refresh from
        the previous step's hits, or no refresh at all."""
        return self.tau is None or self.hits_mode == "previous_step"

    def upcoming(self, t: int) -> np.ndarray:
        """[L, B] the resident sets step t of a block will be accounted with by `step`, before it
        runs; only where `known_ahead` (current-step hits need step t's own routing)."""
        if not self.known_ahead:
            raise ConfigError("resident sets refreshed from current-step hits are known only after the step")
        resident = self._resident
        if self.is_refresh(t) and self._previous is not None:
            resident = _top_b(self._previous, self._resident, self.budget)
        return np.nonzero(resident)[1].reshape(self.n_layers, self.budget)

    def step(self, t: int, topk: np.ndarray) -> StepRecord:
        """Account step t (within its block; t = 0 starts a block) whose tokens were routed to
        `topk` [L, N, k] (-1: padding, ignored; never modified). Refreshes first when t is a
        refresh step, then counts misses and hits against the resulting placement."""
        t = _int("t", t, 0)
        topk = _check_topk(topk, self.n_layers, self.n_experts)
        counts = expert_counts(topk, self.n_experts)  # [L, E]
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
    counts = np.stack([expert_counts(s, n_experts) for s in block])
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
    """TIDE Eq. 5 as printed: C_IO * (B*T/tau) * (1 - (1-d)**tau), the migrations of T steps
    refreshed every tau (B*T*d at tau = 1). The derivation before it gives the exponent tau - 1;
    we keep the printed tau (our choice: the one that gives B*T*d at tau = 1). `tau` may be an
    array."""
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
    """TIDE Eq. 7 with C_IO restored (its first term drops it; our reading): the tau in 1..T-1
    minimizing io_cost + cpu_cost, by exhaustive search (ties: the smaller tau); and the cost table.
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


# --------------------------------------------------------------------------- the loop's policy

EXPERT_MODES = ("tide", "per-step", "static", "random", "all")


def static_sets(traces: Trace, n_layers: int, budget: int) -> tuple[tuple[int, ...], ...]:
    """The static (Fiddler-like) placement: each layer's top-B experts by hits over a whole
    calibration trace (ties to the lower id), as `ExpertPolicy.static_sets`."""
    steps = [_check_topk(s, n_layers, None, what="trace step") for block in traces for s in block]
    top = max((int(s.max()) for s in steps if s.size), default=-1)
    n_experts = max(top + 1, budget)
    hits = sum((expert_counts(s, n_experts) for s in steps), np.zeros((n_layers, n_experts), np.int64))
    chosen = _top_b(hits, np.zeros(hits.shape, bool), budget)
    return tuple(tuple(int(e) for e in np.flatnonzero(row)) for row in chosen)


@dataclasses.dataclass(frozen=True)
class ExpertPolicy(PlacementPolicy):
    """TIDE's interval expert refresh as the decode loop's placement policy, with its baselines
    as settings: per MoE layer, `expert_budget` experts resident (the shared ones included,
    always resident), refreshed to the top by hits at steps t % tau == 0 of each block.

    It reads the step output `router_topk` of the rows a step decodes (bucket padding and
    finished requests excluded) and counts refreshes, migrations and misses
    (`DecodeStats.placement`). On an executor with expert slots (split execution,
    `dlm_jax.techniques.tide.split_experts`) it also hands each step's resident sets to the executor
    before the step (`before_step`), which moves the experts; elsewhere the compiled step
    computes every expert and the counts price what a split would do. Placement never
    changes routing, so tokens are those of `experts="all"` either way.

    Fields (flat decode options):
      experts: "tide" (refresh every `tau` steps), "per-step" (tau = 1, Mixtral-offload-like),
        "static" (`static_sets`, never migrates; Fiddler-like), "random" (each block a tau drawn
        uniformly from 2..T-1, T its block length, seeded by `expert_seed`), "all" (every
        expert resident: no misses, no migrations).
      expert_budget: B resident experts per MoE layer, shared ones included (0: the shared ones
        plus a quarter of the routed ones).
      tau: "auto" (solved from a calibration decode, `dlm_jax.api`) or an interval >= 1 (tide).
      hits: "current_step" or "previous_step" (`ExpertPlacement`).
      static_sets: [M][B - shared] resident routed experts of each MoE layer for "static".
    """

    experts: str = dataclasses.field(default="tide", metadata={
        "help": "expert placement: tide (refresh every tau steps), per-step, static, random tau, all resident",
        "choices": EXPERT_MODES})
    expert_budget: int = dataclasses.field(default=0, metadata={
        "help": "resident experts per MoE layer, shared included (0: shared + E/4)"})
    tau: str = dataclasses.field(default="auto", metadata={
        "help": "TIDE refresh interval in steps of a block, or auto (solved by the cost model)"})
    hits: str = dataclasses.field(default="current_step", metadata={
        "help": "hit counts ranking experts at a refresh: the refresh step's own or the previous step's",
        "choices": HITS_MODES})
    expert_seed: int = dataclasses.field(default=0, metadata={"help": "seed of the random-tau baseline"})
    static_sets: tuple[tuple[int, ...], ...] | None = dataclasses.field(default=None, metadata={"option": False})

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_MODES:
            raise ConfigError(f"experts={self.experts!r} must be one of {EXPERT_MODES}")
        if self.hits not in HITS_MODES:
            raise ConfigError(f"hits={self.hits!r} must be one of {HITS_MODES}")
        _int("expert_budget", self.expert_budget, 0)
        if str(self.tau) != "auto":
            try:
                value = int(str(self.tau))
            except ValueError:
                raise ConfigError(f"tau={self.tau!r} must be 'auto' or an integer >= 1") from None
            _int("tau", value, 1)
            object.__setattr__(self, "tau", str(value))

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset({"router_topk"})

    def budget(self, model: ModelConfig) -> int:
        """Resident routed experts per MoE layer (the budget less the shared experts)."""
        b = self.expert_budget or model.n_shared_experts + max(1, model.n_experts // 4)
        return model.n_experts if self.experts == "all" else b - model.n_shared_experts

    def validate(self, model: ModelConfig, capabilities: Capabilities) -> None:
        if model.ffn != "moe":
            raise ConfigError(f"experts={self.experts!r}: the model has no MoE layers (ffn={model.ffn!r}); "
                              f"expert placement needs a mixture-of-experts model")
        b, shared = self.expert_budget, model.n_shared_experts
        if b and not shared < b <= model.n_experts:
            raise ConfigError(f"expert_budget={b} must be in [{shared + 1}, {model.n_experts}]: above the "
                              f"{shared} shared expert(s), always resident, and at most the {model.n_experts} experts")
        slots = 0 if self.experts == "all" else capabilities.expert_slots  # "all": accounting only
        if slots and slots != self.budget(model):
            raise ConfigError(f"expert_budget={self.budget(model) + model.n_shared_experts} does not fit the "
                              f"executor's {slots} expert slots per split layer (+ {model.n_shared_experts} shared)")
        if slots and self.experts in ("tide", "per-step", "random") and self.hits == "current_step":
            raise ConfigError("split execution places a step's experts before it runs: use hits='previous_step' "
                              "(current-step hits are known only after the step)")

    def begin(self, state: DecodeState, model: ModelConfig) -> _ExpertRecord:
        """Refuses a placement still to calibrate (`Model.calibrated` makes tau and static sets)."""
        layers = len(model.moe_layers)
        if self.experts == "tide" and self.tau == "auto":
            raise ConfigError("tau='auto' is solved from a calibration decode (dlm_jax.load(...).generate and the "
                              "CLI do it, `Model.calibrated`); a DecodeConfig run directly needs an integer tau")
        sets = self.static_sets
        if self.experts == "static" and (sets is None or len(sets) != layers
                                         or any(len(s) != self.budget(model) for s in sets)):
            raise ConfigError(f"experts='static' needs static_sets: {layers} layers of {self.budget(model)} expert "
                              f"ids (calibration: dlm_jax.load(...).generate and the CLI make them, `Model.calibrated`)")
        tau = {"tide": None if self.tau == "auto" else int(self.tau), "per-step": 1}.get(self.experts)
        initial = None if self.static_sets is None else np.asarray(self.static_sets)
        placement = ExpertPlacement(layers, model.n_experts, self.budget(model), tau, self.hits,
                                    shared=model.n_shared_experts, initial=initial)
        return _ExpertRecord(placement, np.random.default_rng(self.expert_seed),
                             model.moe_layers)

    def before_step(self, record: _ExpertRecord, state: DecodeState, plan: StepPlan) -> dict[int, np.ndarray] | None:
        """The resident sets of the step (by model layer) when they changed and are known
        ahead (`ExpertPlacement.upcoming`): an executor holding expert slots moves them in."""
        p = record.placement
        if plan.step == 0 and self.experts == "random":
            width = len(plan.targets) if plan.unit_slots is None else len(plan.unit_slots)
            p.tau = int(record.rng.integers(2, max(width, 3)))
        if not p.known_ahead or self.experts == "all":  # "all": nothing to move
            return None
        resident = p.upcoming(plan.step)
        if record.placed is not None and np.array_equal(resident, record.placed):
            return None
        record.placed = resident
        return dict(zip(record.layers, resident))

    def after_step(self, record: _ExpertRecord, state: DecodeState, plan: StepPlan, outputs: StepOutputs) -> None:
        topk = np.array(outputs.router_topk)  # [M, B, W, K]
        topk[:, :, len(plan.window):] = -1  # bucket padding
        topk[:, ~state.active] = -1  # finished requests and padding rows of the batch
        topk = topk.reshape(topk.shape[0], -1, topk.shape[-1])
        if plan.step == 0:
            record.trace.append([])
        record.trace[-1].append(topk)
        record.unique += float(record.placement.step(plan.step, topk).unique.mean())

    def end(self, record: _ExpertRecord, state: DecodeState) -> dict:
        p = record.placement
        return {"experts": self.experts, "budget": p.budget + p.shared, "tau": p.tau, "hits": self.hits,
                "steps": p.steps, "refreshes": p.refreshes, "migrations": int(p.migrations.sum()),
                "misses": int(p.misses.sum()), "assignments": int((p.misses + p.hits).sum()),
                "unique_per_step": record.unique / max(p.steps, 1),
                "trace": record.trace}

    def probe(self) -> ExpertPolicy | None:
        """Every expert resident, when this policy needs calibration (`needs_calibration`):
        the probe decode's routing gives the static sets and the solved tau."""
        return ExpertPolicy(experts="all") if needs_calibration(self) else None

    def calibrated(self, report: dict, model: ModelConfig) -> ExpertPolicy:
        """`calibrate` from the probe decode's routing trace (costs profiled on this machine)."""
        return calibrate(self, report["trace"], model)[0]


@dataclasses.dataclass
class _ExpertRecord:
    """One decode's placement, random-tau generator and routing trace."""

    placement: ExpertPlacement
    rng: np.random.Generator
    layers: tuple[int, ...]  # the model's MoE layers, in the placement's order
    placed: np.ndarray | None = None  # the resident sets last handed to the executor
    trace: list[list[np.ndarray]] = dataclasses.field(default_factory=list)
    unique: float = 0.0  # distinct experts per layer, summed over the steps


@dataclasses.dataclass(frozen=True)
class ExpertCosts:
    """Eq. 5 and 6's constants: `c_io` seconds to move one routed expert's weights to where the
    compiled step runs, `c_cpu` seconds for one token-expert assignment on the CPU path.
    `profile` measures them on this machine; for a target device, give them directly or use
    `link` (the expert's bytes over a link's bandwidth: a PCIe GPU, a phone's flash)."""

    c_io: float
    c_cpu: float
    source: str = "given"

    def __post_init__(self) -> None:
        if not (0 <= self.c_io < float("inf") and 0 <= self.c_cpu < float("inf")):
            raise ConfigError(f"c_io={self.c_io!r} and c_cpu={self.c_cpu!r} must be finite and >= 0")

    @staticmethod
    def expert_bytes(model: ModelConfig) -> int:
        """One routed SwiGLU expert's weights (gate, up, down) in the parameter dtype."""
        return 3 * model.d_model * model.moe_ffn_hidden * np.dtype(model.param_dtype).itemsize

    @classmethod
    def link(cls, model: ModelConfig, bandwidth: float, c_cpu: float, name: str = "link") -> ExpertCosts:
        """c_io = one expert's bytes / `bandwidth` (bytes/s)."""
        return cls(cls.expert_bytes(model) / bandwidth, c_cpu, name)

    @classmethod
    def profile(cls, model: ModelConfig, *, repeats: int = 20) -> ExpertCosts:
        """Measured here: c_io from copying experts' bytes between host buffers (the best of
        `repeats` copies of 16 experts), c_cpu from NumPy's SwiGLU of 32 rows through one
        expert (best of `repeats`) / 32."""
        import time

        d, f = model.d_model, model.moe_ffn_hidden
        dtype = np.float32
        size = 16 * cls.expert_bytes(model)
        src, dst = np.ones(size, np.uint8), np.empty(size, np.uint8)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((32, d)).astype(dtype)
        gate, up = (rng.standard_normal((d, f)).astype(dtype) for _ in range(2))
        down = rng.standard_normal((f, d)).astype(dtype)
        copy = gemm = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            t1 = time.perf_counter()
            g = x @ gate
            (g / (1 + np.exp(-g)) * (x @ up)) @ down
            t2 = time.perf_counter()
            copy, gemm = min(copy, t1 - t0), min(gemm, t2 - t1)
        return cls(copy / 16, gemm / 32, "profiled on this machine (host memcpy, NumPy SwiGLU)")


def calibrate(policy: ExpertPolicy, trace: Trace, model: ModelConfig,
              costs: ExpertCosts | None = None) -> tuple[ExpertPolicy, dict]:
    """`policy` made ready from a calibration decode's routing `trace` (all experts resident):
    static sets for "static" without them (`static_sets`); for "tide" with tau="auto", the tau
    of Eq. 7 (`solve_tau`) with T the trace's mean steps per block, d = `drift`, f =
    `miss_curve`, and `costs` (default `ExpertCosts.profile`), the CPU term priced per missed
    assignment (C_CPU x mean assignments per step / B). Returns the policy and what was
    estimated."""
    layers = len(model.moe_layers)
    b = policy.budget(model)
    info: dict[str, Any] = {}
    if policy.experts == "static" and policy.static_sets is None:
        policy = dataclasses.replace(policy, static_sets=static_sets(trace, layers, b))
    if policy.experts == "tide" and policy.tau == "auto":
        lengths = [len(block) for block in trace if block]
        T = round(float(np.mean(lengths)))
        if T < 2:
            info.update(T=T, tau=1, note="blocks of one step: nothing to refresh between")
            return dataclasses.replace(policy, tau="1"), info
        costs = costs or ExpertCosts.profile(model)
        d = drift(trace, b)
        f = miss_curve(trace, b, max(lengths))
        assignments = float(np.mean([(s >= 0).sum() / s.shape[0] for block in trace for s in block]))
        tau, table = solve_tau(T, b, d, f, costs.c_io, costs.c_cpu * assignments / b)
        info.update(T=T, d=d, f=f[1:T].tolist(), tau=tau, c_io=costs.c_io, c_cpu=costs.c_cpu,
                    costs=costs.source, assignments_per_step=assignments, cost=table.total.tolist())
        policy = dataclasses.replace(policy, tau=str(tau))
    return policy, info


_SUMMED = ("steps", "refreshes", "migrations", "misses", "assignments")


def merge_placement(a: dict, b: dict) -> dict:
    """Two decodes' `DecodeStats.placement` reports as one (counts summed, the mean unique
    experts per step weighted by steps; no trace)."""
    b = {k: v for k, v in b.items() if k != "trace"}
    if not a or not b:
        return dict(a or b)
    out = {**a, **{k: a[k] + b[k] for k in _SUMMED}}
    out["unique_per_step"] = (a["unique_per_step"] * a["steps"] + b["unique_per_step"] * b["steps"]) / out["steps"]
    return out


def needs_calibration(policy: Any) -> bool:
    """Whether `policy` needs `calibrate` before a decode (tau="auto", or static without sets)."""
    return isinstance(policy, ExpertPolicy) and (
        (policy.experts == "tide" and policy.tau == "auto") or (policy.experts == "static" and policy.static_sets is None))

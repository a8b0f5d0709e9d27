"""The decode-step trace `dlm_jax.techniques.powerinfer.pipeline` simulates: per step and layer, which neurons the
predictor selected and whose gate output is non-zero, and the window size W (NumPy only)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dlm_jax._errors import ConfigError


def _at_least(name: str, value: Any, lo: float, *, integer: bool = True) -> None:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) if integer else \
        isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
    if not ok or not value >= lo:
        raise ConfigError(f"{name}={value!r} must be {'an integer' if integer else 'a number'} >= {lo}")


# --------------------------------------------------------------------------- trace

@dataclasses.dataclass(frozen=True, eq=False)
class TraceStep:
    """One decode step: `window` live rows W; per layer the sorted neuron ids (int32 [n]) the
    predictor selected over all F neurons (`predicted`; the hot ones drop out where a hot region
    computes them densely) and those whose gate output is non-zero for >= 1 row (`active`)."""

    window: int
    predicted: tuple[np.ndarray, ...]
    active: tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineTrace:
    """Decode steps of one regime. order: [L, F] each layer's neurons hottest first (the
    planner's order); hot: bucket W -> [L] hot counts (a prefix of `order`); tokens: the tokens
    the steps decode (tok/s = tokens / simulated seconds)."""

    order: np.ndarray
    hot: Mapping[int, np.ndarray]
    steps: tuple[TraceStep, ...]
    tokens: int

    def __post_init__(self) -> None:
        order = np.asarray(self.order, np.int64)
        if order.ndim != 2 or not (np.sort(order, 1) == np.arange(order.shape[1])).all():
            raise ConfigError(f"order shape={order.shape} must be [L, F], each row a permutation of range(F)")
        object.__setattr__(self, "order", order)
        hot = {int(w): np.asarray(h, np.int64) for w, h in sorted(self.hot.items())}
        for w, h in hot.items():
            if w < 1 or h.shape != (self.n_layers,) or h.min(initial=0) < 0 or h.max(initial=0) > self.n_neurons:
                raise ConfigError(f"hot[{w}]={h.tolist()} must be {self.n_layers} counts in [0, {self.n_neurons}]")
        if not hot:
            raise ConfigError("hot must name at least one window bucket")
        object.__setattr__(self, "hot", hot)
        _at_least("tokens", self.tokens, 1)
        for i, s in enumerate(self.steps):
            _at_least(f"steps[{i}].window", s.window, 1)
            self.bucket(s.window)
            for name in ("predicted", "active"):
                ids = getattr(s, name)
                if len(ids) != self.n_layers or any(a.size and (a.min() < 0 or a.max() >= self.n_neurons) for a in ids):
                    raise ConfigError(f"steps[{i}].{name} must hold {self.n_layers} arrays of ids "
                                      f"in [0, {self.n_neurons})")

    @property
    def n_layers(self) -> int:
        return self.order.shape[0]

    @property
    def n_neurons(self) -> int:
        return self.order.shape[1]

    def bucket(self, window: int) -> int:
        """The smallest planned bucket holding `window` rows."""
        for w in self.hot:
            if window <= w:
                return w
        raise ConfigError(f"window={window} exceeds the largest planned bucket {max(self.hot)}")

    def hot_set(self, step: int, layer: int) -> np.ndarray:
        s = self.steps[step]
        return self.order[layer, :self.hot[self.bucket(s.window)][layer]]

    def cold_predicted(self, step: int, layer: int) -> np.ndarray:
        """The cold neurons the predictor selected (the hot ones run dense)."""
        return np.setdiff1d(self.steps[step].predicted[layer], self.hot_set(step, layer))

    def to_dict(self) -> dict[str, Any]:
        return {"order": self.order.tolist(), "hot": {str(w): h.tolist() for w, h in self.hot.items()},
                "tokens": self.tokens, "steps": [{"window": s.window, "predicted": [a.tolist() for a in s.predicted],
                                                  "active": [a.tolist() for a in s.active]} for s in self.steps]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PipelineTrace:
        def ids(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, ...]:
            return tuple(np.asarray(r, np.int32) for r in rows)
        return cls(np.asarray(d["order"]), {int(w): h for w, h in d["hot"].items()},
                   tuple(TraceStep(int(s["window"]), ids(s["predicted"]), ids(s["active"])) for s in d["steps"]),
                   int(d["tokens"]))

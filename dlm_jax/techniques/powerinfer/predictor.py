"""Activation predictors, host side (NumPy only; PowerInfer-2 §4.1.2): which FFN neurons the rows of a
decode window activate, so the cold path reads only those from flash.

Axes: L FFN layers, N rows, F neurons per layer, D model width, r predictor rank.

- `ActivationPredictor`: the protocol (`predict` per row, `predict_window` over live rows).
- `LowRankPredictor`: the trained low-rank predictor; `OraclePredictor`: the true activations.
- `recall_precision`: a predicted mask scored against the true one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.techniques.powerinfer.neurons import _int


class ActivationPredictor(Protocol):
    """Which neurons of a layer the rows of `x` [N, D] activate (bool [N, F])."""

    def predict(self, layer: int, x: Any, threshold: float = 0.5) -> np.ndarray: ...

    def predict_window(self, layer: int, x: Any, live: Any = None, threshold: float = 0.5) -> np.ndarray: ...


def _union(rows: np.ndarray, live: Any) -> np.ndarray:
    if live is not None:
        live = np.asarray(live, bool)
        if live.shape != rows.shape[:1]:
            raise ConfigError(f"live shape={live.shape} must be [{rows.shape[0]}]")
        rows = rows[live]
    return rows.any(0)


class LowRankPredictor:
    """Our predictor (PowerInfer-2 §4.1.2 leaves its architecture open): per layer
    P(active) = sigmoid(W2 relu(W1 x + b1) + b2), rank r, trained
    with BCE on recorded activations (elsewhere); a neuron is predicted active when
    P > threshold. Arrays per layer: w1 [D, r], b1 [r], w2 [r, F], b2 [F] (float32)."""

    _NAMES = ("w1", "b1", "w2", "b2")

    def __init__(self, w1: Sequence[Any], b1: Sequence[Any], w2: Sequence[Any], b2: Sequence[Any]) -> None:
        if not len(w1) == len(b1) == len(w2) == len(b2) >= 1:
            raise ConfigError(f"predictor layers: w1 {len(w1)}, b1 {len(b1)}, w2 {len(w2)}, b2 {len(b2)} "
                              f"must agree and be >= 1")
        self.w1, self.b1, self.w2, self.b2 = ([np.asarray(a, np.float32) for a in arrs] for arrs in (w1, b1, w2, b2))
        self.d_model, self.rank = self.w1[0].shape if self.w1[0].ndim == 2 else (-1, -1)
        self.n_neurons = self.b2[0].shape[0] if self.b2[0].ndim == 1 else -1
        d, r, f = self.d_model, self.rank, self.n_neurons
        for i, arrs in enumerate(zip(self.w1, self.b1, self.w2, self.b2)):
            shapes = tuple(a.shape for a in arrs)
            if shapes != ((d, r), (r,), (r, f), (f,)) or min(d, r, f) < 1:
                raise ConfigError(f"predictor layer {i} shapes {shapes} must be w1 [D, r], b1 [r], w2 [r, F], b2 [F] "
                                  f"with D, r, F of layer 0 ({d}, {r}, {f})")

    @property
    def n_layers(self) -> int:
        return len(self.w1)

    @classmethod
    def init(cls, n_layers: int, d_model: int, n_neurons: int, rank: int, *, seed: int = 0) -> LowRankPredictor:
        """Random (He-scaled) weights and zero biases, a starting point for training."""
        rng = np.random.default_rng(seed)
        n, d, f, r = (_int(k, v, 1) for k, v in (("n_layers", n_layers), ("d_model", d_model),
                                                    ("n_neurons", n_neurons), ("rank", rank)))
        return cls([rng.standard_normal((d, r)) * math.sqrt(2 / d) for _ in range(n)], [np.zeros(r)] * n,
                   [rng.standard_normal((r, f)) * math.sqrt(2 / r) for _ in range(n)], [np.zeros(f)] * n)

    @staticmethod
    def rank_for(d_model: int, n_neurons: int, fraction: float = 0.1) -> int:
        """The largest rank whose layer's parameters are <= `fraction` of the FFN layer's
        3 D F (our choice: a predictor within 10% of the FFN), at least 1."""
        return max(1, math.floor((fraction * 3 * d_model * n_neurons - n_neurons) / (d_model + 1 + n_neurons)))

    def logits(self, layer: int, x: Any) -> np.ndarray:
        """[N, F] float32 pre-sigmoid scores of the rows `x` [N, D]."""
        x = np.asarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != self.d_model:
            raise ConfigError(f"x shape={x.shape} must be [N, {self.d_model}]")
        return np.maximum(x @ self.w1[layer] + self.b1[layer], 0) @ self.w2[layer] + self.b2[layer]

    def predict(self, layer: int, x: Any, threshold: float = 0.5) -> np.ndarray:
        """bool [N, F]: sigmoid(logits) > threshold (compared as logits > logit(threshold))."""
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"threshold={threshold!r} must be in [0, 1]")
        with np.errstate(divide="ignore"):
            cut = np.log(threshold) - np.log1p(-threshold)
        return self.logits(layer, x) > cut

    def predict_window(self, layer: int, x: Any, live: Any = None, threshold: float = 0.5) -> np.ndarray:
        """bool [F]: neurons predicted active for any live row of the window `x` [W, D]."""
        return _union(self.predict(layer, x, threshold), live)

    def param_count(self) -> int:
        return sum(a.size for arrs in (self.w1, self.b1, self.w2, self.b2) for a in arrs)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """{"layers.{i}.{w1,b1,w2,b2}": array} (safetensors names)."""
        return {f"layers.{i}.{k}": getattr(self, k)[i] for i in range(self.n_layers) for k in self._NAMES}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> LowRankPredictor:
        n = len({name.split(".")[1] for name in arrays if name.startswith("layers.")})
        try:
            return cls(*([arrays[f"layers.{i}.{k}"] for i in range(n)] for k in cls._NAMES))
        except KeyError as e:
            raise ConfigError(f"predictor arrays lack {e.args[0]!r} (have {sorted(arrays)})") from None


class OraclePredictor:
    """The true activations as a predictor (lossless tests): `update` with a step's bool
    [L, N, F]; `predict(layer, x)` returns its layer's [N, F] (x only fixes N)."""

    def __init__(self, active: Any = None) -> None:
        self._active: np.ndarray | None = None
        if active is not None:
            self.update(active)

    def update(self, active: Any) -> None:
        active = np.asarray(active)
        if active.dtype != bool or active.ndim != 3:
            raise ConfigError(f"active shape={active.shape} dtype={active.dtype} must be bool [L, N, F]")
        self._active = active

    def predict(self, layer: int, x: Any, threshold: float = 0.5) -> np.ndarray:
        if self._active is None:
            raise ConfigError("OraclePredictor has no activations: call update(active) first")
        if len(x) != self._active.shape[1]:
            raise ConfigError(f"x has {len(x)} rows, the recorded activations {self._active.shape[1]}")
        return self._active[layer].copy()

    def predict_window(self, layer: int, x: Any, live: Any = None, threshold: float = 0.5) -> np.ndarray:
        return _union(self.predict(layer, x, threshold), live)


def recall_precision(pred: Any, true: Any) -> tuple[float, float]:
    """(recall, precision) of a predicted bool mask against the true one (same shape): recall
    = |pred & true| / |true|, precision = |pred & true| / |pred|; each 1.0 when its
    denominator is 0 (nothing to find / nothing claimed)."""
    pred, true = np.asarray(pred, bool), np.asarray(true, bool)
    if pred.shape != true.shape:
        raise ConfigError(f"pred shape={pred.shape} and true shape={true.shape} differ")
    tp = int((pred & true).sum())
    n_true, n_pred = int(true.sum()), int(pred.sum())
    return (tp / n_true if n_true else 1.0), (tp / n_pred if n_pred else 1.0)

"""PowerInfer-2's neuron engine for activation-sparse FFNs, host side: recording what a decode
activates (NumPy only; PowerInfer-2 §2.2, §4; docs/techniques/powerinfer.md). The planner built on
these statistics is `neuron_plan`, the cold-neuron cache `neuron_cache`, the activation predictors
`predictor` (modules of this package).

Neuron i of an FFN layer is the bundle (gate row i, up row i, down column i). It is *active*
for a token iff relu(gate_i . x) > 0, and for a decode window of W live rows iff it is active
for at least one of them (a dLLM window behaves like the paper's batch of W: PowerInfer-2 §2.2, footnote 1).
*Hot* neurons run dense (the NPU in the paper) and stay resident; *cold* ones run sparse (the
CPU) on the neurons the predictor selects, read through the neuron cache.

Axes: L FFN layers, F neurons per layer, B batch rows, W rows of a decode window (its bucket).
Step outputs carry `ffn_active` bit-packed [L, B, W, ceil(F/32)].

- `pack_active`, `unpack_active`: the bit packing of `ffn_active`.
- `ActivationStats`: per-token and per-window activation probabilities (the Fig 2 analog).
- `NeuronTrace`, `decode_statistics`: those statistics recorded over decodes (the planner's input).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.placement import PlacementPolicy

DEFAULT_WINDOWS = (1, 2, 4, 8, 16, 32)  # window sizes of our analog of PowerInfer-2's Fig 2 (batch 1 to 32)
_SHIFTS = np.arange(32, dtype=np.uint32)


def _int(name: str, value: Any, lo: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{name}={value!r} must be an integer >= {lo}")
    return int(value)


def _windows(name: str, windows: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted({_int(f"{name} entry", w, 1) for w in windows}))
    if not out:
        raise ConfigError(f"{name}={tuple(windows)!r} must name at least one window size")
    return out


# --------------------------------------------------------------------------- bit packing

def pack_active(active: Any) -> np.ndarray:
    """bool [..., F] -> int32 [..., ceil(F/32)]: bit j (value 1 << j; bit 31 is the sign bit)
    of word w is neuron 32*w + j; the padding bits of the last word are 0. The bytes equal
    `np.packbits(active, axis=-1, bitorder="little")` read as little-endian uint32."""
    active = np.asarray(active)
    if active.dtype != bool or active.ndim < 1:
        raise ConfigError(f"active dtype={active.dtype} ndim={active.ndim} must be bool [..., F]")
    n = active.shape[-1]
    words = -(-n // 32)
    padded = np.zeros(active.shape[:-1] + (words * 32,), np.uint32)
    padded[..., :n] = active
    bits = padded.reshape(active.shape[:-1] + (words, 32)) << _SHIFTS
    return bits.sum(-1, dtype=np.uint32).view(np.int32)  # distinct powers of two: the sum is an OR


def unpack_active(packed: Any, n_neurons: int) -> np.ndarray:
    """int32 [..., ceil(F/32)] (as `pack_active` writes it) -> bool [..., F], F = n_neurons."""
    n = _int("n_neurons", n_neurons, 0)
    packed = np.asarray(packed)
    if packed.dtype not in (np.int32, np.uint32) or packed.ndim < 1 or packed.shape[-1] != -(-n // 32):
        raise ConfigError(f"packed shape={packed.shape} dtype={packed.dtype} must be int32 [..., {-(-n // 32)}] "
                          f"for {n} neurons")
    words = np.ascontiguousarray(packed).view(np.uint32)
    bits = (words[..., None] >> _SHIFTS) & np.uint32(1)
    return bits.reshape(packed.shape[:-1] + (-1,))[..., :n].astype(bool)


# --------------------------------------------------------------------------- statistics

class ActivationStats:
    """Recorded activations: per layer and neuron, the probability of being active for a token
    (P_1) and for a window of w consecutive live rows, w in `windows` (P_w; Fig 2's analog).

    Window statistics are cut from each added step: per batch row b its live rows in order,
    in consecutive groups of w (the remainder dropped); a group activates a neuron if any of
    its rows does. P_w = union hits / groups. All layers see the same rows, so the token and
    group counts are shared by the layers.
    """

    def __init__(self, n_layers: int, n_neurons: int, *, windows: Sequence[int] = DEFAULT_WINDOWS) -> None:
        self.n_layers = _int("n_layers", n_layers, 1)
        self.n_neurons = _int("n_neurons", n_neurons, 1)
        self.windows = _windows("windows", windows)
        self.tokens = 0
        self.token_hits = np.zeros((self.n_layers, self.n_neurons), np.int64)  # [L, F]
        self.groups = {w: 0 for w in self.windows}
        self.hits = {w: np.zeros((self.n_layers, self.n_neurons), np.int64) for w in self.windows}

    def add(self, active: Any, live: Any = None) -> None:
        """One step's activations: `active` bool [L, B, W, F]; `live` bool [B, W] (None: all
        rows), the rows that count (bucket padding and finished requests excluded)."""
        active = np.asarray(active)
        if active.dtype != bool or active.ndim != 4 or active.shape[0] != self.n_layers \
                or active.shape[3] != self.n_neurons:
            raise ConfigError(f"active shape={active.shape} dtype={active.dtype} must be bool "
                              f"[{self.n_layers}, B, W, {self.n_neurons}]")
        shape = active.shape[1:3]
        live = np.ones(shape, bool) if live is None else np.asarray(live)
        if live.shape != shape or live.dtype != bool:
            raise ConfigError(f"live shape={live.shape} dtype={live.dtype} must be bool {list(shape)}")
        self.tokens += int(live.sum())
        self.token_hits += active[:, live].sum(1)
        for b in range(shape[0]):
            rows = active[:, b, np.flatnonzero(live[b])]  # [L, n, F]
            for w in self.windows:
                g = rows.shape[1] // w
                if g:
                    self.groups[w] += g
                    self.hits[w] += rows[:, :g * w].reshape(self.n_layers, g, w, -1).any(2).sum(1)

    def add_packed(self, packed: Any, live: Any = None) -> None:
        """`add` for the step output `ffn_active` as it comes: int32 [L, B, W, ceil(F/32)]."""
        self.add(unpack_active(packed, self.n_neurons), live)

    def recorded_windows(self) -> tuple[int, ...]:
        """The window sizes with at least one recorded group."""
        return tuple(w for w in self.windows if self.groups[w])

    def prob(self, window: int) -> np.ndarray:
        """[L, F] float64: P_w, the share of recorded w-row groups that activated each neuron."""
        if window not in self.groups:
            raise ConfigError(f"window={window!r} is not a recorded window size {self.windows}")
        if not self.groups[window]:
            raise ConfigError(f"no group of {window} consecutive live rows was recorded")
        return self.hits[window] / self.groups[window]

    def token_prob(self) -> np.ndarray:
        """[L, F] float64: P_1, the share of recorded tokens that activated each neuron."""
        if not self.tokens:
            raise ConfigError("no token was recorded")
        return self.token_hits / self.tokens

    def density(self, window: int) -> np.ndarray:
        """[L]: the mean share of a layer's neurons active for a w-row window (Fig 2's y axis)."""
        return self.prob(window).mean(1)

    def token_density(self) -> np.ndarray:
        """[L]: the mean share of a layer's neurons active per token (1 - per-token sparsity)."""
        return self.token_prob().mean(1)

    def merge(self, other: ActivationStats) -> ActivationStats:
        """A new accumulator holding both's counts (neither is changed)."""
        if (other.n_layers, other.n_neurons, other.windows) != (self.n_layers, self.n_neurons, self.windows):
            raise ConfigError(f"cannot merge stats of [L={other.n_layers}, F={other.n_neurons}, windows="
                              f"{other.windows}] into [L={self.n_layers}, F={self.n_neurons}, windows={self.windows}]")
        out = ActivationStats(self.n_layers, self.n_neurons, windows=self.windows)
        out.tokens = self.tokens + other.tokens
        out.token_hits = self.token_hits + other.token_hits
        for w in self.windows:
            out.groups[w] = self.groups[w] + other.groups[w]
            out.hits[w] = self.hits[w] + other.hits[w]
        return out

    def to_dict(self) -> dict:
        """JSON-friendly counts (`from_dict` inverts)."""
        return {"n_layers": self.n_layers, "n_neurons": self.n_neurons, "windows": list(self.windows),
                "tokens": self.tokens, "token_hits": self.token_hits.tolist(),
                "groups": {str(w): g for w, g in self.groups.items()},
                "hits": {str(w): h.tolist() for w, h in self.hits.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ActivationStats:
        out = cls(d["n_layers"], d["n_neurons"], windows=d["windows"])
        out.tokens = int(d["tokens"])
        out.token_hits = np.asarray(d["token_hits"], np.int64).reshape(out.n_layers, out.n_neurons)
        for w in out.windows:
            out.groups[w] = int(d["groups"][str(w)])
            out.hits[w] = np.asarray(d["hits"][str(w)], np.int64).reshape(out.n_layers, out.n_neurons)
        return out


@dataclasses.dataclass(frozen=True)
class NeuronTrace(PlacementPolicy):
    """A placement policy that moves nothing and records which FFN neurons each step's window
    activates (the step output `ffn_active`): the decode's `ActivationStats`, over the window
    rows of every step (bucket padding and probe rows excluded), reported as
    `DecodeStats.placement["stats"]`. The planner's and the Fig 2 analog's input."""

    windows: tuple[int, ...] = DEFAULT_WINDOWS

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset({"ffn_active"})

    def validate(self, model: Any, capabilities: Any) -> None:
        if "ffn_active" not in capabilities.outputs:
            raise ConfigError("recording neuron activity needs an executor that returns ffn_active: a model with "
                              "a ReLU-family FFN (ffn = relu or reglu) on the JAX executor")

    def begin(self, state: Any, model: Any) -> ActivationStats:
        return ActivationStats(model.n_layers, model.ffn_hidden, windows=self.windows)

    def after_step(self, record: ActivationStats, state: Any, plan: Any, outputs: Any) -> None:
        packed = np.asarray(outputs.ffn_active)
        live = np.zeros(packed.shape[1:3], bool)
        live[:, :len(plan.window)] = True
        record.add_packed(packed, live)

    def end(self, record: ActivationStats, state: Any) -> dict:
        return {"stats": record}


def decode_statistics(model, prompts: Sequence[Sequence[int]], decode, *, windows=None) -> ActivationStats:
    """Activation statistics of decoding `prompts` with `decode` (one at a time) with the
    `dlm_jax.Model` `model` (the JAX executor): every step's
    `ffn_active` over its live window rows (`NeuronTrace`)."""
    policy = NeuronTrace(windows=tuple(windows or DEFAULT_WINDOWS))
    cfg = dataclasses.replace(decode, placement=policy)
    stats = None
    for ids in prompts:
        got = model.decoder.decode([list(ids)], cfg).stats.placement["stats"]
        stats = got if stats is None else stats.merge(got)
    return stats

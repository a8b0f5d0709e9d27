"""Weight quantization for phone NPUs: GGML Q4_0 and Q8_0, symmetric per-channel INT8 / INT4, and
PowerInfer-2's NPU-friendly INT4 per-channel with INT8 outlier input channels; plus weight
error and a registry of fake-quantization schemes for accuracy studies.

Weights follow a linear layer's `[out, in]` convention: W [N, K], y = x @ W^T. Every
per-channel scale belongs to one output row; Q4_0 blocks run along a row (the K axis), as in
GGML. Everything here is NumPy, so a lowering plan can be computed without JAX.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.lowering.tiles import crop_from_tiles, pad_to_tiles

QK4_0 = 32  # weights per Q4_0 block
Q4_0_BLOCK_BYTES = 18  # 2-byte fp16 scale + 16 bytes of packed nibbles
SCALE_BYTES = 4  # per-channel scales are kept as float32


# --- GGML Q4_0 ---------------------------------------------------------------------------

def _q4_0_blocks(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim == 0 or w.shape[-1] % QK4_0:
        raise ConfigError(f"Q4_0 needs rows whose length is a multiple of {QK4_0}, got shape {w.shape} "
                          f"(pad with dlm_jax.lowering.tiles.pad_to_tiles first)")
    return w.reshape(-1, QK4_0)


def quantize_q4_0(w: np.ndarray) -> np.ndarray:
    """W [..., K] (K a multiple of 32) -> packed uint8 [..., K/32 * 18], GGML's reference rule.

    Per block of 32: `max` = the signed value of the first element of largest |x| (+0.0 for an
    all-zero block), `d = max / -8`, `id = 1/d` (0 when d == 0), `q = min(15, trunc(x * id + 8.5))` in float32,
    stored as `d` (little-endian fp16) then byte j = q_j | q_{j+16} << 4 for j < 16.
    """
    blocks = _q4_0_blocks(w)
    first_max = np.abs(blocks).argmax(axis=1)  # argmax keeps the first of equal |x|, as GGML does
    signed_max = blocks[np.arange(len(blocks)), first_max]
    # GGML starts from max = +0.0 and replaces it only on a strictly larger |x|, so an all-zero
    # block scales by +0.0 / -8 = -0.0 even when its first element is -0.0 (gguf-py's NumPy port
    # would take that -0.0 and store +0.0: the dequantized block is zero either way).
    signed_max = np.where(signed_max == 0, np.float32(0), signed_max)
    d = signed_max / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.trunc(blocks * inv[:, None] + np.float32(8.5)).astype(np.uint8)
    q = np.minimum(q, np.uint8(15))
    nibbles = q[:, :16] | (q[:, 16:] << np.uint8(4))
    scale = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    packed = np.concatenate([scale, nibbles], axis=1)
    shape = np.shape(w)
    return packed.reshape(*shape[:-1], shape[-1] // QK4_0 * Q4_0_BLOCK_BYTES)


def _packed_blocks(packed: np.ndarray, shape: tuple[int, ...], name: str, block: int,
                   block_bytes: int) -> np.ndarray:
    """A GGML-packed tensor of logical `shape` as its [n_blocks, block_bytes] rows."""
    if not shape or shape[-1] % block:
        raise ConfigError(f"{name} needs rows whose length is a multiple of {block}, got shape {shape}")
    n_blocks = math.prod(shape) // block
    raw = np.ascontiguousarray(packed, dtype=np.uint8)
    if raw.size != n_blocks * block_bytes:
        raise ConfigError(f"{raw.size} {name} bytes cannot hold a weight of shape {shape} "
                          f"({n_blocks * block_bytes} expected)")
    return raw.reshape(n_blocks, block_bytes)


def dequantize_q4_0(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Packed Q4_0 bytes -> float32 weights of `shape`: x = (q - 8) * d."""
    shape = tuple(shape)
    blocks = _packed_blocks(packed, shape, "Q4_0", QK4_0, Q4_0_BLOCK_BYTES)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [n_blocks, 1]
    nib = blocks[:, 2:]
    q = np.concatenate([nib & np.uint8(0x0F), nib >> np.uint8(4)], axis=1).astype(np.int8) - np.int8(8)
    return (d * q.astype(np.float32)).reshape(shape)


# --- GGML Q8_0 ---------------------------------------------------------------------------

QK8_0 = 32  # weights per Q8_0 block
Q8_0_BLOCK_BYTES = 34  # 2-byte fp16 scale + 32 int8


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """W [..., K] (K a multiple of 32) -> packed uint8 [..., K/32 * 34], GGML's reference rule.

    Per block of 32: `d = max|x| / 127` in float32, `id = 1/d` (0 when d == 0), `q = roundf(x * id)`
    (half away from zero), stored as `d` (little-endian fp16) then the 32 int8 values.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim == 0 or w.shape[-1] % QK8_0:
        raise ConfigError(f"Q8_0 needs rows whose length is a multiple of {QK8_0}, got shape {w.shape}")
    blocks = w.reshape(-1, QK8_0)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    x = blocks * inv[:, None]
    q = (np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))).astype(np.int8)  # C roundf
    scale = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    packed = np.concatenate([scale, q.view(np.uint8)], axis=1)
    return packed.reshape(*w.shape[:-1], w.shape[-1] // QK8_0 * Q8_0_BLOCK_BYTES)


def dequantize_q8_0(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Packed Q8_0 bytes -> float32 weights of `shape`: x = q * d."""
    shape = tuple(shape)
    blocks = _packed_blocks(packed, shape, "Q8_0", QK8_0, Q8_0_BLOCK_BYTES)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    return (d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape)


# --- symmetric per-channel INT8 / INT4 ------------------------------------------------------

@dataclass(frozen=True)
class PerChannel:
    """Symmetric per-output-row quantization: W ~= q * scale[:, None], q in [-qmax, qmax].

    q: int8 [N, K]; scale: float32 [N] = max|W[n]| / qmax (0 for an all-zero row);
    qmax = 2**(bits-1) - 1, so INT4 uses [-7, 7] (-8 stays unused: the grid is symmetric).
    """

    q: np.ndarray
    scale: np.ndarray
    bits: int

    def dequantize(self) -> np.ndarray:
        return self.q.astype(np.float32) * self.scale[:, None]

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [..., K] @ W^T as an integer-weight kernel runs it: dot products with q, then one
        scale per output row."""
        return (np.asarray(x, np.float32) @ self.q.T.astype(np.float32)) * self.scale

    @property
    def storage_bytes(self) -> int:
        """Packed weights (INT4: two per byte, per row) plus one float32 scale per row."""
        n, k = self.q.shape
        return n * math.ceil(k * self.bits / 8) + n * SCALE_BYTES


def quantize_per_channel(w: np.ndarray, *, bits: int) -> PerChannel:
    """Symmetric per-row quantization of W [N, K] to `bits` (2..8): round to nearest (ties to
    even), clip to [-qmax, qmax]."""
    if bits not in range(2, 9):
        raise ConfigError(f"bits={bits!r} must be an integer in 2..8")
    w = _as_matrix(w)
    qmax = 2 ** (bits - 1) - 1
    scale = (np.abs(w).max(axis=1, initial=0.0) / np.float32(qmax)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint(w / safe[:, None]), -qmax, qmax).astype(np.int8)
    return PerChannel(q=q, scale=scale, bits=bits)


def quantize_int8(w: np.ndarray) -> PerChannel:
    """INT8 per-channel: scale = max|w| / 127 per row."""
    return quantize_per_channel(w, bits=8)


def quantize_int4(w: np.ndarray) -> PerChannel:
    """INT4 per-channel: scale = max|w| / 7 per row, values in [-7, 7]."""
    return quantize_per_channel(w, bits=4)


def _as_matrix(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ConfigError(f"expected a 2-D weight [N, K], got shape {w.shape}")
    return w


# --- INT4 per-channel + INT8 outlier input channels (PowerInfer-2) --------------------------

SALIENCE_WITH_ACTIVATIONS = "mean|x_j| * ||W[:, j]||_2"
SALIENCE_WEIGHT_ONLY = "||W[:, j]||_2 (no activation statistics given)"


def salience(w: np.ndarray, act_mean_abs: np.ndarray | None = None) -> np.ndarray:
    """Per input channel j of W [N, K]: mean|x_j| * ||W[:, j]||_2 (AWQ-like), or the column
    norm alone when no activation statistics are given. Returns [K]."""
    w = _as_matrix(w)
    norms = np.linalg.norm(w, axis=0)
    if act_mean_abs is None:
        return norms
    act = np.asarray(act_mean_abs, dtype=np.float32)
    if act.shape != (w.shape[1],):
        raise ConfigError(f"act_mean_abs has shape {act.shape}, expected ({w.shape[1]},) for a weight {w.shape}")
    return np.abs(act) * norms


def activation_stats(x: np.ndarray) -> np.ndarray:
    """mean |x| per input channel of calibration activations x [..., K] -> [K]."""
    x = np.asarray(x, dtype=np.float32)
    return np.abs(x.reshape(-1, x.shape[-1])).mean(axis=0)


def outlier_count(k: int, fraction: float) -> int:
    """ceil(fraction * k), at least 1 and at most k."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"fraction={fraction!r} must be in (0, 1]")
    return min(k, max(1, math.ceil(fraction * k)))


@dataclass(frozen=True)
class MixedInt4:
    """W [N, K] split by input channel: INT4 per-row over the inliers, INT8 per-row over the
    outlier channels `outliers` (sorted indices); y = W4 x[inliers] + W8 x[outliers]."""

    int4: PerChannel  # [N, K - |O|]
    int8: PerChannel  # [N, |O|]
    outliers: np.ndarray  # int64 [|O|], sorted
    shape: tuple[int, int]
    rule: dict[str, Any] = field(default_factory=dict)

    @property
    def inliers(self) -> np.ndarray:
        return np.setdiff1d(np.arange(self.shape[1]), self.outliers)

    def dequantize(self) -> np.ndarray:
        w = np.empty(self.shape, np.float32)
        w[:, self.inliers] = self.int4.dequantize()
        w[:, self.outliers] = self.int8.dequantize()
        return w

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [..., K] -> y [..., N] in the split form the NPU runs: two integer-weight matmuls
        over disjoint input channels, each with its own per-row scales, summed."""
        x = np.asarray(x, np.float32)
        return self.int4.matmul(x[..., self.inliers]) + self.int8.matmul(x[..., self.outliers])

    @property
    def storage_bytes(self) -> int:
        """Both parts (packed weights + scales) and the outlier indices as int32."""
        return self.int4.storage_bytes + self.int8.storage_bytes + 4 * len(self.outliers)


def quantize_mixed(w: np.ndarray, *, fraction: float = 0.01,
                   act_mean_abs: np.ndarray | None = None) -> MixedInt4:
    """PowerInfer-2-style mixed precision: the top `fraction` of input channels by salience
    (ceil, at least one; ties go to the lower index) stay INT8, the rest INT4, each part with
    its own symmetric per-row scales."""
    w = _as_matrix(w)
    k = w.shape[1]
    sal = salience(w, act_mean_abs)
    top = np.argsort(-sal, kind="stable")[:outlier_count(k, fraction)]
    outliers = np.sort(top).astype(np.int64)
    inliers = np.setdiff1d(np.arange(k), outliers)
    rule = {"name": "int4+int8-outliers", "fraction": fraction, "n_outliers": int(len(outliers)),
            "granularity": "input channels (columns of W[out, in])",
            "salience": SALIENCE_WEIGHT_ONLY if act_mean_abs is None else SALIENCE_WITH_ACTIVATIONS,
            "outlier_count": "max(1, ceil(fraction * K)); ties to the lower index",
            "int4_scale": "per output row over inlier channels: max|w| / 7, values in [-7, 7]",
            "int8_scale": "per output row over outlier channels: max|w| / 127, values in [-127, 127]",
            "rounding": "round half to even"}
    return MixedInt4(int4=quantize_int4(w[:, inliers]), int8=quantize_int8(w[:, outliers]),
                     outliers=outliers, shape=(int(w.shape[0]), int(k)), rule=rule)


# --- error and scheme registry --------------------------------------------------------------

class WeightError(NamedTuple):
    rel_fro: float  # ||W - W_hat||_F / ||W||_F (0 if both are zero, inf if only W is)
    max_abs: float  # max |W - W_hat|


def weight_error(w: np.ndarray, w_hat: np.ndarray) -> WeightError:
    """Relative Frobenius and max absolute error of an approximation `w_hat` of `w`."""
    w = np.asarray(w, np.float64)
    w_hat = np.asarray(w_hat, np.float64)
    if w.shape != w_hat.shape:
        raise ConfigError(f"weight_error: shapes {w.shape} and {w_hat.shape} differ")
    diff = np.linalg.norm(w - w_hat)
    ref = np.linalg.norm(w)
    rel = float(diff / ref) if ref else (0.0 if diff == 0 else math.inf)
    return WeightError(rel_fro=rel, max_abs=float(np.abs(w - w_hat).max(initial=0.0)))


class FakeQuant(NamedTuple):
    weights: np.ndarray  # float32 [N, K], dequantized
    storage_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.storage_bytes / self.weights.size


def _fake_q4_0(w: np.ndarray, act_mean_abs: np.ndarray | None = None) -> FakeQuant:
    # Rows not a multiple of 32 are zero-padded to whole tiles; zeros never change a block's
    # scale, and the padded blocks are counted in the storage.
    w = _as_matrix(w)
    wp = pad_to_tiles(w, QK4_0)[: w.shape[0]]
    packed = quantize_q4_0(wp)
    return FakeQuant(crop_from_tiles(dequantize_q4_0(packed, wp.shape), w.shape), packed.size)


def _fake_per_channel(bits: int) -> Callable[..., FakeQuant]:
    def fake(w: np.ndarray, act_mean_abs: np.ndarray | None = None) -> FakeQuant:
        pc = quantize_per_channel(w, bits=bits)
        return FakeQuant(pc.dequantize(), pc.storage_bytes)

    return fake


def _fake_mixed(w: np.ndarray, act_mean_abs: np.ndarray | None = None) -> FakeQuant:
    mixed = quantize_mixed(w, act_mean_abs=act_mean_abs)
    return FakeQuant(mixed.dequantize(), mixed.storage_bytes)


# name -> fn(W [N, K], act_mean_abs [K] | None) -> FakeQuant; only the mixed scheme reads
# activation statistics.
QUANT_SCHEMES: dict[str, Callable[..., FakeQuant]] = {
    "q4_0": _fake_q4_0,
    "int8": _fake_per_channel(8),
    "int4": _fake_per_channel(4),
    "int4+int8-outliers": _fake_mixed,
}


def fake_quantize(scheme: str, w: np.ndarray, *, act_mean_abs: np.ndarray | None = None) -> FakeQuant:
    """Quantize and dequantize W [N, K] with the scheme named `scheme`."""
    if scheme not in QUANT_SCHEMES:
        raise ConfigError(f"unknown quantization scheme {scheme!r}; known: {sorted(QUANT_SCHEMES)}")
    return QUANT_SCHEMES[scheme](w, act_mean_abs)

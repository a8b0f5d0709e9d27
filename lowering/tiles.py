"""Hardware tiles: zero padding to 32x32 tiles, the tiled weight layout and its exact inverse,
a reference matmul that reads that layout, and the stepwise cost of a padded matmul.

llada.cpp's converter rearranges every FP16 weight into 32x32 HMX tiles in the hardware's
order ("tile-level inner-product order and row shuffling") and its CPU kernels decode that
order to stay consistent with the NPU. The exact Hexagon order is not public, so the in-tile
order here is an explicit, configurable permutation (identity by default) with an exact
inverse; `row_shuffle_inner_product` is a documented, illustrative non-trivial example.

Conventions (a linear layer's `[out, in]` weight):
  W: [N, K]  weight, N output rows, K input (inner-product) columns
  x: [M, K]  activations, M rows (tokens)
  y: [M, N]  y = x @ W^T
  tiled: [ceil(N/t), ceil(K/t), t*t]  tile (i, j) holds W[i*t:(i+1)*t, j*t:(j+1)*t] (zero
         padded), its t*t elements stored in `permutation` order: slot s holds the element
         at row-major position permutation[s] of the tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dlm_jax._errors import ConfigError

TILE = 32  # FP16 HMX tile edge (llada.cpp)


def padded(n: int, tile: int = TILE) -> int:
    """`n` rounded up to a multiple of `tile`."""
    return -(-n // tile) * tile


def pad_to_tiles(a: np.ndarray, tile: int = TILE) -> np.ndarray:
    """Zero-pad the last two dims of `a` to multiples of `tile` (a copy only when needed)."""
    a = np.asarray(a)
    if a.ndim < 2:
        raise ConfigError(f"pad_to_tiles needs at least 2 dims, got shape {a.shape}")
    _check_tile(tile)
    rows, cols = a.shape[-2:]
    extra = [(0, 0)] * (a.ndim - 2) + [(0, padded(rows, tile) - rows), (0, padded(cols, tile) - cols)]
    return a if not any(after for _, after in extra) else np.pad(a, extra)


def crop_from_tiles(a: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Inverse of `pad_to_tiles`: the leading `shape` of the last two dims of `a`."""
    rows, cols = shape
    if rows > a.shape[-2] or cols > a.shape[-1]:
        raise ConfigError(f"cannot crop shape {a.shape} to last dims {tuple(shape)}")
    return a[..., :rows, :cols]


def _check_tile(tile: int) -> None:
    if not isinstance(tile, int) or tile <= 0:
        raise ConfigError(f"tile={tile!r} must be a positive integer")


def row_shuffle_inner_product(tile: int = TILE, *, group: int = 2) -> tuple[int, ...]:
    """An illustrative non-trivial in-tile order (the real Hexagon HMX order is not public).

    Row shuffle: rows are visited even rows first, then odd rows (0, 2, ..., 1, 3, ...).
    Inner-product order: the K axis is cut into groups of `group` consecutive columns; for each
    group, the `group` values of every (shuffled) row are stored together, so one sweep over
    the storage feeds a `group`-wide dot-product step of all rows at once.
    """
    _check_tile(tile)
    if tile % group:
        raise ConfigError(f"group={group} must divide tile={tile}")
    rows = list(range(0, tile, 2)) + list(range(1, tile, 2))
    return tuple(r * tile + g * group + kk for g in range(tile // group) for r in rows for kk in range(group))


@dataclass(frozen=True)
class TiledLayout:
    """Weights as `[N/t][K/t][t*t]` tiles, each tile's elements in `permutation` order.

    `permutation`: slot s of a stored tile holds the tile's row-major element permutation[s];
    None is the identity (row-major tiles). `dtype`: storage dtype (FP16 on the NPU).
    """

    tile: int = TILE
    permutation: tuple[int, ...] | None = None
    dtype: str = "float16"

    def __post_init__(self) -> None:
        _check_tile(self.tile)
        if self.permutation is not None:
            perm = np.asarray(self.permutation)
            size = self.tile * self.tile
            if perm.shape != (size,) or not np.array_equal(np.sort(perm), np.arange(size)):
                raise ConfigError(f"permutation must be a permutation of range({size}) for tile={self.tile}, "
                                  f"got {perm.size} entries")
            object.__setattr__(self, "permutation", tuple(int(p) for p in perm))
        try:
            np.dtype(self.dtype)
        except TypeError:
            raise ConfigError(f"dtype={self.dtype!r} is not a NumPy dtype") from None

    @classmethod
    def hmx_example(cls, tile: int = TILE, **kwargs) -> TiledLayout:
        """The layout with the illustrative `row_shuffle_inner_product` order."""
        return cls(tile=tile, permutation=row_shuffle_inner_product(tile), **kwargs)

    @property
    def order(self) -> np.ndarray:
        """The permutation as an index array [t*t] (storage slot -> row-major position)."""
        size = self.tile * self.tile
        return np.arange(size) if self.permutation is None else np.asarray(self.permutation)

    def grid(self, shape: tuple[int, int]) -> tuple[int, int]:
        """Tile grid (N tiles, K tiles) of a weight of `shape` [N, K]."""
        n, k = shape
        return padded(n, self.tile) // self.tile, padded(k, self.tile) // self.tile

    def pack(self, w: np.ndarray) -> np.ndarray:
        """W [N, K] -> tiled [N/t, K/t, t*t] in `dtype` (padding with zeros)."""
        w = np.asarray(w)
        if w.ndim != 2:
            raise ConfigError(f"pack needs a 2-D weight [N, K], got shape {w.shape}")
        t = self.tile
        gn, gk = self.grid(w.shape)
        tiles = pad_to_tiles(w, t).reshape(gn, t, gk, t).transpose(0, 2, 1, 3).reshape(gn, gk, t * t)
        return np.ascontiguousarray(tiles[..., self.order].astype(self.dtype))

    def decode_tile(self, stored: np.ndarray) -> np.ndarray:
        """One stored tile [t*t] (or a stack [..., t*t]) -> row-major tile(s) [..., t, t]."""
        out = np.empty_like(stored)
        out[..., self.order] = stored
        return out.reshape(*stored.shape[:-1], self.tile, self.tile)

    def unpack(self, tiled: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """Exact inverse of `pack`: tiled [N/t, K/t, t*t] -> W [N, K] (padding dropped)."""
        t = self.tile
        self._check_tiled(tiled, shape)
        gn, gk = tiled.shape[:2]
        full = self.decode_tile(np.asarray(tiled)).transpose(0, 2, 1, 3).reshape(gn * t, gk * t)
        return np.ascontiguousarray(crop_from_tiles(full, shape))

    def _check_tiled(self, tiled: np.ndarray, shape: tuple[int, int]) -> None:
        want = (*self.grid(tuple(shape)), self.tile * self.tile)
        if tuple(tiled.shape) != want:
            raise ConfigError(f"tiled array of shape {tuple(tiled.shape)} does not hold a weight of shape "
                              f"{tuple(shape)} (expected {want})")


def tiled_matmul(x: np.ndarray, tiled: np.ndarray, layout: TiledLayout, n: int) -> np.ndarray:
    """y [M, n] = x [M, K] @ W^T for W stored as `tiled` in `layout`, read tile by tile.

    Each stored tile is decoded through the layout's permutation and its product accumulated in
    float32, as a CPU kernel reading the NPU layout does; the result equals `x @ W.T`.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ConfigError(f"tiled_matmul needs x of shape [M, K], got {x.shape}")
    m, k = x.shape
    layout._check_tiled(tiled, (n, k))
    t = layout.tile
    gn, gk = tiled.shape[:2]
    xp = np.zeros((m, gk * t), np.float32)
    xp[:, :k] = x
    y = np.zeros((m, gn * t), np.float32)
    for i in range(gn):
        acc = y[:, i * t:(i + 1) * t]
        for j in range(gk):
            w_tile = layout.decode_tile(tiled[i, j]).astype(np.float32)  # [t rows of N, t cols of K]
            acc += xp[:, j * t:(j + 1) * t] @ w_tile.T
    return y[:, :n]


@dataclass(frozen=True)
class TileCost:
    """Cost of an [M, K] x [K, N] matmul on a tile engine that pays for whole tiles."""

    tiles: int  # tile products: ceil(M/t) * ceil(N/t) * ceil(K/t)
    padded_flops: int  # 2 * Mp * Np * Kp
    flops: int  # 2 * M * N * K (useful work)

    @property
    def utilization(self) -> float:
        """Useful fraction of the padded work."""
        return self.flops / self.padded_flops if self.padded_flops else 0.0


def tile_cost(m: int, n: int, k: int, tile: int = TILE) -> TileCost:
    """Stepwise cost of `[m, k] @ [k, n]` in `tile`-sized tiles: m = 33 costs as m = 64."""
    _check_tile(tile)
    for name, v in (("m", m), ("n", n), ("k", k)):
        if not isinstance(v, (int, np.integer)) or v < 0:
            raise ConfigError(f"{name}={v!r} must be a non-negative integer")
    mt, nt, kt = (math.ceil(v / tile) for v in (m, n, k))
    return TileCost(tiles=mt * nt * kt, padded_flops=2 * mt * nt * kt * tile ** 3, flops=2 * m * n * k)

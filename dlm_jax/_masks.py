"""Attention visibility masks (boolean, True = may attend).

Axes: B batch, Q query positions, K key positions. A mask of shape [B, Q, K] is what the
transformer takes; helpers here build the full-sequence masks of each attention mode and
combine them with padding. The decode program builds its own [B, W, P+W] visibility from the
same rules (see `visibility_from_positions`).
"""

from __future__ import annotations

import numpy as np

from dlm_jax._config import ATTENTION_MODES
from dlm_jax._errors import ConfigError


def attention_rule(mode: str, q_pos: np.ndarray, k_pos: np.ndarray, block_size: int) -> np.ndarray:
    """Visibility of keys at absolute positions `k_pos` for queries at `q_pos` (broadcasting)."""
    if mode == "bidirectional":
        return np.ones(np.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=bool)
    if mode == "causal":
        return k_pos <= q_pos
    if mode == "block_causal":
        return (k_pos // block_size) <= (q_pos // block_size)
    raise ConfigError(f"attention mode {mode!r} is not one of {ATTENTION_MODES}")


def attention_mask(mode: str, length: int, *, block_size: int = 32) -> np.ndarray:
    """[length, length] mask of `mode` over positions 0..length-1."""
    pos = np.arange(length)
    return attention_rule(mode, pos[:, None], pos[None, :], block_size)


def visibility_from_positions(mode: str, q_pos: np.ndarray, k_pos: np.ndarray,
                              k_valid: np.ndarray | None = None, *,
                              block_size: int = 32) -> np.ndarray:
    """[B, Q, K] mask from absolute positions.

    Args:
      q_pos: [B, Q] absolute positions of the queries.
      k_pos: [B, K] absolute positions of the keys (cache slots then window slots).
      k_valid: [B, K] False for padding keys, which nobody may see.
    """
    mask = attention_rule(mode, q_pos[:, :, None], k_pos[:, None, :], block_size)
    if k_valid is not None:
        mask = mask & k_valid[:, None, :]
    return mask


def padded_mask(mode: str, valid: np.ndarray, *, block_size: int = 32) -> np.ndarray:
    """[B, T, T] full-sequence mask for left- or right-padded rows.

    `valid` is [B, T] (False at padding). Positions are counted over the valid tokens only, so
    a left-padded row sees exactly what the unpadded row would; padding queries see only
    themselves (keeps softmax finite, their outputs are ignored).
    """
    valid = np.asarray(valid, dtype=bool)
    pos = np.cumsum(valid, axis=1) - 1
    mask = visibility_from_positions(mode, pos, pos, valid, block_size=block_size)
    eye = np.eye(valid.shape[1], dtype=bool)[None]
    return np.where(valid[:, :, None], mask, eye)

"""The Executor boundary: what one compiled decode step takes and returns (NumPy only).

Axes: B batch, W window bucket, P cache bucket, R logit-row bucket, L layers, Hkv key/value
heads, Dh head width, V vocabulary. Inputs are already padded to their bucket sizes; the
bucket key is read off their shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from buckets._sets import BucketKey


@dataclasses.dataclass(frozen=True)
class StepInputs:
    tokens: np.ndarray  # [B, W] int32; mask id where undecided, anything at padding
    positions: np.ndarray  # [B, W] int32 absolute positions (RoPE)
    visibility: np.ndarray  # [B, W, P+W] bool; cache slots first, then window slots
    k_cache: np.ndarray  # [L, B, P, Hkv, Dh]
    v_cache: np.ndarray  # [L, B, P, Hkv, Dh]
    logit_rows: np.ndarray  # [B, R] int32 window rows whose predictions are wanted
    full_logits: bool = False  # also return the rows' logits (sampling, ISD acceptance)

    @property
    def key(self) -> BucketKey:
        b, w = self.tokens.shape
        return BucketKey(b, w, self.k_cache.shape[2], self.logit_rows.shape[1], self.full_logits)


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    top_token: np.ndarray  # [B, R] int32 argmax token per requested row
    top_prob: np.ndarray  # [B, R] float32 its probability
    second_prob: np.ndarray  # [B, R] float32 runner-up probability (margin confidence)
    entropy: np.ndarray  # [B, R] float32 entropy of the row's distribution (nats)
    k_new: np.ndarray  # [L, B, W, Hkv, Dh] keys of the window (post-RoPE)
    v_new: np.ndarray  # [L, B, W, Hkv, Dh]
    logits: np.ndarray | None = None  # [B, R, V] float32 when full_logits was asked


class Executor(Protocol):
    """Runs one decode step for a bucket. JAX (AOT per bucket) and LiteRT implement it."""

    def step(self, inputs: StepInputs) -> StepOutputs: ...

    def warmup(self, keys: list[BucketKey]) -> int: ...

    @property
    def compile_count(self) -> int: ...

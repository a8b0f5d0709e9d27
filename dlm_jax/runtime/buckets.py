"""Bucket sets: the static sizes compiled programs are built for, and padding to them.

NumPy only (the on-device runner selects buckets too). A `BucketKey` names one compiled
program: batch B, window width W, cache capacity P, requested logit rows R, and whether full
logits rows are returned. The same key type is used to look up and to store executables.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Iterable

import numpy as np

from dlm_jax._errors import ConfigError

# Tile-aligned window widths (multiples of 8 below one tile; the HMX tile is 32 wide).
DEFAULT_WINDOW_BUCKETS: tuple[int, ...] = (8, 16, 32, 64, 96, 128, 160, 192, 224, 256)
DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8)
# The JAX executor compiles a bucket on first use, so it can offer more: a GPU decodes 32 rows at
# once as readily as 8 (bundles keep the exported sets).
JAX_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
# Past 256 slots the ladder steps by 64, past 1024 by 128: padding a step costs at most an
# eighth of it (a doubling ladder cost up to half: a 320-token sequence ran 512 wide).
_LADDER: tuple[tuple[int, int], ...] = ((256, 32), (1024, 64), (1 << 62, 128))


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """Sorted distinct sizes; `select(n)` is the smallest size >= n."""

    sizes: tuple[int, ...]
    name: str = "bucket"

    def __post_init__(self) -> None:
        sizes = tuple(int(s) for s in self.sizes)
        if not sizes or any(s < 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise ConfigError(f"{self.name} sizes={self.sizes} must be distinct, sorted and >= 0")
        object.__setattr__(self, "sizes", sizes)

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def select(self, n: int) -> int:
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise ConfigError(f"{n} exceeds the largest {self.name} ({self.largest})")
        return self.sizes[i]

    def __iter__(self):
        return iter(self.sizes)


def _ladder(start: int, top: int) -> set[int]:
    """Sizes above `start` up to `top`: steps of 32 to 256, of 64 to 1024, then of 128."""
    sizes, s = set(), start
    for limit, step in _LADDER:
        while s < min(limit, top):
            s += step
            sizes.add(min(s, top))
    return sizes


def window_buckets(max_len: int, base: Iterable[int] = DEFAULT_WINDOW_BUCKETS) -> BucketSet:
    """Window widths: `base` below `max_len`, then the ladder (steps of 64 to 1024, then 128)
    up to `max_len` itself (rounded up to a multiple of 8), so a whole sequence always fits
    one window."""
    top = -(-max_len // 8) * 8
    sizes = {s for s in base if s < top} | _ladder(256, top) | {top}
    return BucketSet(tuple(sorted(sizes)), "window bucket")


def infill_slots(n: int, room: int | None = None) -> int:
    """The slots after a generation that hold suffixes of up to `n` tokens (infilling): a power
    of two from 8, so that requests whose suffixes differ in length share their step shapes
    (the slots past a request's suffix are padding, which no step reads), but no more than
    `room` (what fits after the prompt and the generation) unless `n` itself does not fit."""
    if n <= 0:
        return 0
    size = max(8, 1 << (int(n) - 1).bit_length())
    return size if room is None or size <= room else max(int(n), int(room))


def cache_buckets(max_len: int) -> BucketSet:
    """Cache capacities: 0 (no cache), then multiples of 32 to 256, of 64 to 1024, then of 128,
    up to `max_len` (rounded up to 32)."""
    top = -(-max_len // 32) * 32
    return BucketSet(tuple(sorted({0, top} | _ladder(0, top))), "cache bucket")


# The flags a bucket key carries, (field, name suffix), in the order names spell them: the one
# definition `str(BucketKey)`, `step.signature_name` and `step.parse_signature_name` share.
KEY_FLAGS: tuple[tuple[str, str], ...] = (("full_logits", "_full"), ("router_topk", "_topk"), ("ffn_active", "_act"))


@functools.lru_cache(maxsize=4096)  # named at every step (stats)
def _key_name(key: BucketKey) -> str:
    return f"b{key.batch}_w{key.window}_p{key.cache}_r{key.rows}" + key.flag_suffix


@dataclasses.dataclass(frozen=True, order=True)
class BucketKey:
    """One compiled step program: batch, window, cache capacity, logit rows, full logits,
    routed experts (`router_topk`, an MoE model's), FFN neuron activity (`ffn_active`, a
    ReLU-family FFN's)."""

    batch: int
    window: int
    cache: int
    rows: int
    full_logits: bool = False
    router_topk: bool = False
    ffn_active: bool = False

    def __str__(self) -> str:
        return _key_name(self)

    @property
    def flag_suffix(self) -> str:
        """The suffixes of the flags this key sets (`KEY_FLAGS`), e.g. `_full_act`."""
        return "".join(suffix for field, suffix in KEY_FLAGS if getattr(self, field))


def pad_axis(x: np.ndarray, size: int, *, axis: int, value=0) -> np.ndarray:
    """Pad `x` with `value` at the end of `axis` up to `size` (no copy if already that size)."""
    n = x.shape[axis]
    if n == size:
        return x
    if n > size:
        raise ValueError(f"axis {axis} has {n} entries, more than the bucket size {size}")
    shape = list(x.shape)
    shape[axis] = size
    out = np.full(shape, value, dtype=x.dtype)  # np.pad is several times slower on the hot path
    out[(slice(None),) * (axis % x.ndim) + (slice(0, n),)] = x
    return out

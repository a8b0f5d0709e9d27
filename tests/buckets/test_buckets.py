"""Bucket sets, padding, per-bucket AOT compilation and the persistent cache."""

import numpy as np
import pytest

from dlm_jax.buckets import BucketKey, BucketSet, CompiledBuckets, XlaCompileCounter, cache_buckets, pad_axis, window_buckets
from dlm_jax import ConfigError


def test_select_picks_smallest_fitting_bucket():
    s = BucketSet((8, 16, 32))
    assert [s.select(n) for n in (1, 8, 9, 32)] == [8, 8, 16, 32]
    with pytest.raises(ConfigError, match="33 exceeds the largest bucket \\(32\\)"):
        s.select(33)
    with pytest.raises(ConfigError, match="sorted"):
        BucketSet((16, 8))


def test_default_sets_are_tile_aligned_and_cover_the_model():
    w = window_buckets(1000)
    assert w.sizes[:10] == (8, 16, 32, 64, 96, 128, 160, 192, 224, 256) and w.largest == 1000
    assert all(s % 8 == 0 for s in w.sizes)
    c = cache_buckets(2000)
    assert c.sizes[0] == 0 and c.largest == 2016 and all(s % 32 == 0 for s in c.sizes)
    assert c.sizes[:4] == (0, 32, 64, 96) and {256, 320, 1024, 1152} <= set(c.sizes)


@pytest.mark.parametrize("sets", [window_buckets(2000), cache_buckets(2000)])
def test_padding_is_less_than_one_ladder_step(sets):
    """A doubling ladder padded a 320-slot step to 512 (60% more work). Now a live size pads
    by less than one step: 32 slots up to 256, 64 up to 1024, 128 past (at most a quarter
    of a step past 256)."""
    for n in range(1, sets.largest + 1):
        step = 32 if n <= 256 else 64 if n <= 1024 else 128
        assert sets.select(n) - n < step, n
    assert max((sets.select(n) - n) / n for n in range(257, sets.largest + 1)) < 0.25

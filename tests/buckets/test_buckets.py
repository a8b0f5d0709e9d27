"""Bucket sets, padding, per-bucket AOT compilation and the persistent cache."""

import numpy as np
import pytest

from buckets import BucketKey, BucketSet, CompiledBuckets, XlaCompileCounter, cache_buckets, pad_axis, window_buckets
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
    assert w.sizes[:8] == (8, 16, 32, 64, 96, 128, 192, 256) and w.largest == 1000
    assert all(s % 8 == 0 for s in w.sizes)
    c = cache_buckets(1000)
    assert c.sizes[0] == 0 and c.largest == 1024 and all(s % 32 == 0 for s in c.sizes)


def test_pad_axis():
    x = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(pad_axis(x, 5, axis=1, value=-1), [[0, 1, 2, -1, -1], [3, 4, 5, -1, -1]])
    assert pad_axis(x, 3, axis=1) is x
    with pytest.raises(ValueError, match="more than the bucket size 2"):
        pad_axis(x, 2, axis=1)


def test_one_key_type_for_lookup_and_storage():
    """maxtext's prefill cache stored one key and looked up another: it recompiled on every
    call with no error. A second lookup of the same bucket must compile nothing."""
    import jax
    import jax.numpy as jnp

    built = []

    def build(key):
        built.append(key)
        return (lambda x: x * 2), (jax.ShapeDtypeStruct((key.batch, key.window), jnp.float32),)

    programs = CompiledBuckets(build)
    key = BucketKey(1, 8, 0, 8)
    out = np.asarray(programs.get(key)(np.ones((1, 8), np.float32)))
    assert out[0, 0] == 2.0
    before = XlaCompileCounter.count()
    np.asarray(programs.get(BucketKey(1, 8, 0, 8))(np.ones((1, 8), np.float32)))
    assert programs.compile_count == 1 and built == [key]
    assert XlaCompileCounter.count() == before
    assert programs.warmup([key, BucketKey(1, 16, 0, 8)]) == 1
    assert XlaCompileCounter.count() == before + 1  # the counter does see real compilations
    with pytest.raises(Exception):  # an AOT executable refuses other shapes instead of retracing
        programs.get(key)(np.ones((1, 9), np.float32))


def test_persistent_cache_is_written(tmp_path):
    import subprocess
    import sys

    code = ("import jax, jax.numpy as jnp; from buckets import enable_persistent_cache;"
            f"enable_persistent_cache({str(tmp_path)!r});"
            "jax.jit(lambda x: jnp.sin(x) * 3).lower(jnp.ones(7)).compile()")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert any(tmp_path.iterdir())

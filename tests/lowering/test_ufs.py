"""The UFS 4.0 read model reproduces the figures it is built from exactly (PowerInfer-2 §2.3.2, Fig. 3b, Tab. 1)."""

import pytest

from dlm_jax.lowering.costs import MB, UfsModel

KB = 1024
U = UfsModel()


@pytest.mark.parametrize("size, pattern, range_bytes, core, bw", [
    (4 * KB, "sequential", 128 * MB, None, 450e6),
    (512 * KB, "sequential", 128 * MB, None, 4e9),
    (512 * KB, "random", 128 * MB, None, 3.5e9),
    (4 * KB, "random", 128 * MB, None, 1e9),
    (4 * KB, "random", 512 * MB, None, 850e6),
    (4 * KB, "random", 128 * MB, "big", 1076.10e6),
    (4 * KB, "random", 128 * MB, "mid", 1007.95e6),
    (4 * KB, "random", 128 * MB, "little", 761.87e6),
])
def test_quoted_points(size, pattern, range_bytes, core, bw):
    assert U.bandwidth(size, pattern, range_bytes, core) == pytest.approx(bw, rel=1e-12)
    assert U.read_seconds(size, pattern, range_bytes, core) == pytest.approx(size / bw, rel=1e-12)


def test_between_and_beyond_the_points():
    assert 1e9 < U.bandwidth(64 * KB) < 3.5e9  # log-linear in the request size
    assert U.bandwidth(64 * KB) == pytest.approx(1e9 * 3.5 ** (4 / 7), rel=1e-9)  # 64 KB: 4/7 of the way
    assert U.read_seconds(512) == U.read_seconds(4 * KB)  # 4 KB minimum request
    assert U.bandwidth(4 * MB, "sequential") == 4e9  # clamped
    assert 850e6 < U.bandwidth(4 * KB, range_bytes=256 * MB) < 1e9
    assert U.serial_seconds([4 * KB] * 3) == pytest.approx(3 * 4 * KB / 1e9)
    with pytest.raises(ValueError):
        U.bandwidth(4 * KB, "strided")

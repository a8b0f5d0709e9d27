"""Tile padding, the tiled weight layout and its inverse, the tile-reading matmul, tile cost.

A wrong permutation or inverse would hand the NPU scrambled weights and produce wrong tokens
with no error anywhere: every layout here must round-trip exactly and multiply correctly.
"""

from __future__ import annotations

import numpy as np
import pytest

from dlm_jax._errors import ConfigError
from dlm_jax.lowering.tiles import (TiledLayout, crop_from_tiles, pad_to_tiles, row_shuffle_inner_product, tile_cost,
                            tiled_matmul)

LAYOUTS = {"identity": TiledLayout(), "hmx_example": TiledLayout.hmx_example(),
           "random": TiledLayout(permutation=tuple(np.random.default_rng(3).permutation(1024)))}
SHAPES = [(32, 32), (64, 96), (33, 31), (7, 100), (130, 65), (1, 1)]


def _fp16_matrix(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16).astype(np.float32)


def test_pad_to_tiles_pads_last_two_dims_with_zeros_and_crop_inverts():
    a = np.arange(2 * 33 * 40, dtype=np.float32).reshape(2, 33, 40) + 1
    p = pad_to_tiles(a)
    assert p.shape == (2, 64, 64)
    assert np.array_equal(p[:, :33, :40], a)
    assert not p[:, 33:, :].any() and not p[:, :, 40:].any()
    assert np.array_equal(crop_from_tiles(p, (33, 40)), a)
    assert pad_to_tiles(np.ones((64, 32))).shape == (64, 32)
    assert pad_to_tiles(np.ones((5, 9)), tile=4).shape == (8, 12)


def test_pad_to_tiles_rejects_vectors_and_bad_tiles():
    with pytest.raises(ConfigError, match="2 dims"):
        pad_to_tiles(np.ones(5))
    with pytest.raises(ConfigError, match="tile"):
        pad_to_tiles(np.ones((2, 2)), tile=0)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES)
def test_unpack_inverts_pack_exactly(name, shape):
    layout = LAYOUTS[name]
    w = _fp16_matrix(shape)
    tiled = layout.pack(w)
    assert tiled.shape == (-(-shape[0] // 32), -(-shape[1] // 32), 1024)
    assert tiled.dtype == np.float16
    back = layout.unpack(tiled, shape)
    assert back.shape == shape
    assert np.array_equal(back.astype(np.float32), w)


def test_pack_puts_each_element_where_the_permutation_says():
    perm = row_shuffle_inner_product()
    layout = TiledLayout(permutation=perm, dtype="float32")
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    tiled = layout.pack(w)
    tile_10 = w[32:64, 0:32].ravel()  # tile (1, 0), row-major
    assert np.array_equal(tiled[1, 0], tile_10[list(perm)])
    # the example order really is non-trivial: row 2 comes second, then columns in pairs
    assert perm[:4] == (0, 1, 2 * 32, 2 * 32 + 1)
    assert perm != tuple(range(1024))


def test_padding_is_zero_in_storage_and_dropped_on_unpack():
    layout = LAYOUTS["random"]
    w = _fp16_matrix((33, 40))
    tiled = layout.pack(w)
    assert np.count_nonzero(tiled) == np.count_nonzero(w)
    assert layout.unpack(tiled, (33, 40)).shape == (33, 40)


def test_dtype_is_configurable():
    w = np.random.default_rng(1).standard_normal((40, 40)).astype(np.float32)
    layout = TiledLayout.hmx_example(dtype="float32")
    assert layout.pack(w).dtype == np.float32
    assert np.array_equal(layout.unpack(layout.pack(w), w.shape), w)  # exact in float32, not fp16-rounded
    with pytest.raises(ConfigError, match="dtype"):
        TiledLayout(dtype="not-a-dtype")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", [(64, 96), (33, 31), (130, 65), (5, 3)])
def test_tiled_matmul_equals_x_at_w_transposed(name, shape):
    n, k = shape
    layout = TiledLayout(permutation=LAYOUTS[name].permutation, dtype="float32")
    rng = np.random.default_rng(2)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((17, k)).astype(np.float32)
    y = tiled_matmul(x, layout.pack(w), layout, n)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert y.shape == (17, n)
    assert np.linalg.norm(y - ref) <= 1e-6 * np.linalg.norm(ref)
    assert np.max(np.abs(y - x @ w.T)) <= 1e-6 * np.max(np.abs(ref))


def test_tiled_matmul_reads_fp16_storage():
    layout = LAYOUTS["hmx_example"]
    w = _fp16_matrix((48, 70), seed=5)
    x = np.random.default_rng(6).standard_normal((3, 70)).astype(np.float32)
    np.testing.assert_allclose(tiled_matmul(x, layout.pack(w), layout, 48), x @ w.T, rtol=1e-5, atol=1e-5)


def test_tiled_matmul_needs_the_matching_layout():
    """Decoding with the wrong permutation must not silently match (guards a no-op decoder)."""
    w = _fp16_matrix((32, 32))
    x = np.eye(32, dtype=np.float32)
    stored = LAYOUTS["hmx_example"].pack(w)
    assert not np.allclose(tiled_matmul(x, stored, LAYOUTS["identity"], 32), x @ w.T)


def test_tiled_matmul_checks_shapes():
    layout = TiledLayout()
    tiled = layout.pack(np.ones((40, 40)))
    with pytest.raises(ConfigError, match="does not hold"):
        tiled_matmul(np.ones((2, 70)), tiled, layout, 40)
    with pytest.raises(ConfigError, match="does not hold"):
        layout.unpack(tiled, (70, 40))


@pytest.mark.parametrize("perm, message", [
    (tuple(range(1023)), "permutation of range\\(1024\\)"),
    ((0,) * 1024, "permutation of range\\(1024\\)"),
    (tuple(range(1, 1025)), "permutation of range\\(1024\\)"),
    (tuple(range(16)), "permutation of range\\(1024\\)"),
])
def test_permutation_is_validated(perm, message):
    with pytest.raises(ConfigError, match=message):
        TiledLayout(permutation=perm)


def test_small_tiles_and_group_validation():
    assert TiledLayout(tile=4, permutation=row_shuffle_inner_product(4)).permutation == row_shuffle_inner_product(4)
    with pytest.raises(ConfigError, match="group"):
        row_shuffle_inner_product(32, group=3)


def test_tile_cost_is_stepwise_in_whole_tiles():
    a, b = tile_cost(33, 64, 64), tile_cost(64, 64, 64)
    assert (a.tiles, a.padded_flops) == (b.tiles, b.padded_flops)
    assert a.flops < b.flops and a.utilization == pytest.approx(33 / 64)
    assert tile_cost(32, 64, 64).tiles * 2 == tile_cost(33, 64, 64).tiles
    c = tile_cost(1, 4096, 4096)
    assert c.tiles == 1 * 128 * 128
    assert c.padded_flops == 2 * 32 * 4096 * 4096
    assert c.flops == 2 * 4096 * 4096
    assert c.utilization == pytest.approx(1 / 32)
    assert tile_cost(0, 8, 8).tiles == 0
    with pytest.raises(ConfigError, match="m="):
        tile_cost(-1, 8, 8)

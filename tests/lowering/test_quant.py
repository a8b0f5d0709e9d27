"""Quantization: Q4_0 bit for bit against GGML's reference (the `gguf` package), per-channel
INT8/INT4, PowerInfer-2's INT4 + INT8 outlier channels, weight error and the scheme registry.

A Q4_0 file that differs from GGML's in one nibble or one scale byte loads without error in
llama.cpp-family runtimes and quietly computes with different weights; these tests compare
bytes, not just reconstruction error.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dlm_jax._errors import ConfigError
from dlm_jax.lowering.quant import (QUANT_SCHEMES, activation_stats, dequantize_q4_0, fake_quantize, outlier_count,
                            quantize_int4, quantize_int8, quantize_mixed, quantize_per_channel, quantize_q4_0,
                            salience, weight_error)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _edge_blocks() -> dict[str, np.ndarray]:
    """One [rows, 32k] matrix per edge case GGML's rule has to get exactly right."""
    r = _rng(7)
    single = np.zeros((4, 32), np.float32)
    single[0, 5], single[1, 31], single[2, 0], single[3, 16] = 0.3, -2.0, 1e-3, -7.25
    negative_max = r.uniform(-1, 1, (6, 64)).astype(np.float32)
    negative_max[:, 9] = -3.0
    ties = np.zeros((5, 32), np.float32)
    ties[0, :2] = [-3.0, 3.0]  # equal |x|, first (negative) wins
    ties[1, :2] = [3.0, -3.0]  # equal |x|, first (positive) wins
    ties[2] = np.linspace(-8, 7.5, 32)  # d = 1: every x + 8.5 lands on or near an integer
    ties[3] = -np.linspace(-8, 7.5, 32)  # d = -1
    ties[4] = np.arange(32) % 16 * 0.5 - 4.0  # exact half steps with d = 0.5
    return {
        "random": r.standard_normal((16, 256)).astype(np.float32),
        "random_uniform_wide": (r.uniform(-1, 1, (8, 128)) * 10.0 ** r.integers(-3, 3, (8, 1))).astype(np.float32),
        "all_zero": np.zeros((3, 64), np.float32),
        "zero_and_nonzero_blocks": np.concatenate([np.zeros((2, 32)), r.standard_normal((2, 32))], 1)
        .astype(np.float32),
        "single_nonzero": single,
        "negative_max": negative_max,
        "large": (r.standard_normal((4, 64)) * 1e4).astype(np.float32),
        "overflowing_fp16_scale": (r.standard_normal((2, 32)) * 1e6).astype(np.float32),
        "tiny": (r.standard_normal((4, 64)) * 1e-6).astype(np.float32),
        "tiny_fp16_scale_underflow": (r.standard_normal((4, 64)) * 1e-20).astype(np.float32),
        "ties": ties,
        "fp16_grid": (r.integers(-8, 8, (4, 64)) * np.float32(0.125)).astype(np.float32),
    }


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("case", sorted(_edge_blocks()))
def test_ggml_blocks_match_gguf_reference_bit_for_bit(case, fmt):
    """Q4_0 (the lowering's and the GGUF export's) and Q8_0 (the GGUF export's): scales and
    integers byte for byte, and the dequantised weights, on the same edge blocks."""
    gguf = pytest.importorskip("gguf", reason="gguf (GGML's Python reference quantizer) is not installed")
    from gguf.quants import dequantize, quantize

    from dlm_jax.lowering.quant import dequantize_q8_0, quantize_q8_0

    ours_q, ours_dq, block_bytes = {"Q4_0": (quantize_q4_0, dequantize_q4_0, 18),
                                    "Q8_0": (quantize_q8_0, dequantize_q8_0, 34)}[fmt]
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    w = _edge_blocks()[case]
    with np.errstate(over="ignore", invalid="ignore"):
        ref = quantize(w, qtype)
        ours = ours_q(w)
        assert ours.dtype == np.uint8 and ours.shape == ref.shape == (w.shape[0], w.shape[1] // 32 * block_bytes)
        assert np.array_equal(ours, ref)
        ref_back = dequantize(ref, qtype)
        ours_back = ours_dq(ours, w.shape)
    assert ours_back.dtype == np.float32
    assert np.array_equal(ours_back, ref_back, equal_nan=True)


def test_q4_0_byte_layout_by_hand():
    """Without gguf: d = max / -8 with max = -8 gives d = 1.0 (fp16 0x3C00, little-endian);
    x = -8 -> q 0, x = 0 -> q 8, x = 7 -> q 15; byte j = q_j | q_{j+16} << 4."""
    block = np.zeros((1, 32), np.float32)
    block[0, 0], block[0, 16], block[0, 1] = -8.0, 7.0, 3.0
    packed = quantize_q4_0(block)
    assert packed.shape == (1, 18)
    assert list(packed[0, :2]) == [0x00, 0x3C]
    assert packed[0, 2] == 0 | 15 << 4  # q_0 = 0, q_16 = 15
    assert packed[0, 3] == 11 | 8 << 4  # q_1 = trunc(3 + 8.5) = 11, q_17 = 8
    assert all(b == 0x88 for b in packed[0, 4:])
    assert np.array_equal(dequantize_q4_0(packed, (1, 32)), block)


def test_q4_0_zero_block_scale_is_negative_zero_as_in_ggml():
    """GGML's C reference starts from max = +0.0, so d = +0.0 / -8 = -0.0 (fp16 0x8000) for
    every all-zero block, also one made of -0.0 (where gguf-py's NumPy port stores +0.0)."""
    for zeros in (np.zeros((1, 32), np.float32), np.full((1, 32), -0.0, np.float32)):
        packed = quantize_q4_0(zeros)
        assert list(packed[0, :2]) == [0x00, 0x80] and all(b == 0x88 for b in packed[0, 2:])
        assert not dequantize_q4_0(packed, (1, 32)).any()


def test_q4_0_error_is_bounded_by_half_a_step():
    w = _rng(1).standard_normal((8, 128)).astype(np.float32)
    back = dequantize_q4_0(quantize_q4_0(w), w.shape)
    blocks, err = w.reshape(-1, 32), np.abs(back - w).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 8
    # The grid is (q - 8) * d for q in 0..15: the max's side reaches 8|d| (half-step error),
    # the other side stops at 7|d| (clipping error up to one step). Plus fp16 rounding of d.
    same_side = np.sign(blocks) == np.sign(np.take_along_axis(blocks, np.abs(blocks).argmax(1)[:, None], 1))
    assert np.all(err[same_side] <= np.broadcast_to(d * 0.5 * (1 + 2e-3) + 1e-7, err.shape)[same_side])
    assert np.all(err <= d * (1 + 2e-3))
    assert np.all(err.max(axis=1) > 0)


def test_q4_0_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(ConfigError, match=r"multiple of 32.*\(4, 40\)"):
        quantize_q4_0(np.ones((4, 40)))
    with pytest.raises(ConfigError, match="multiple of 32"):
        dequantize_q4_0(np.zeros((4, 18), np.uint8), (4, 33))
    with pytest.raises(ConfigError, match="cannot hold"):
        dequantize_q4_0(np.zeros((4, 18), np.uint8), (4, 64))


@pytest.mark.parametrize("bits, qmax", [(8, 127), (4, 7)])
def test_per_channel_scales_and_range(bits, qmax):
    w = _rng(2).standard_normal((6, 50)).astype(np.float32) * np.array([1, 10, 0.01, 1, 1, 0])[:, None]
    pc = quantize_per_channel(w, bits=bits)
    assert pc.q.dtype == np.int8 and pc.scale.shape == (6,)
    np.testing.assert_allclose(pc.scale, np.abs(w).max(axis=1) / qmax, rtol=1e-7)
    assert pc.q.min() >= -qmax and pc.q.max() <= qmax
    assert np.all(np.abs(pc.q).max(axis=1)[:5] == qmax)  # each row's largest |w| maps to +-qmax
    assert pc.scale[5] == 0 and not pc.dequantize()[5].any()  # all-zero row
    err = np.abs(pc.dequantize() - w)
    assert np.all(err <= pc.scale[:, None] / 2 + 1e-7)
    x = _rng(3).standard_normal((4, 50)).astype(np.float32)
    np.testing.assert_allclose(pc.matmul(x), x @ pc.dequantize().T, rtol=1e-5, atol=1e-6)


def test_int8_and_int4_wrappers_and_bits_validation():
    w = _rng(4).standard_normal((3, 16)).astype(np.float32)
    assert quantize_int8(w).bits == 8 and quantize_int4(w).bits == 4
    err8 = weight_error(w, quantize_int8(w).dequantize()).rel_fro
    assert 0 < err8 < weight_error(w, quantize_int4(w).dequantize()).rel_fro
    with pytest.raises(ConfigError, match="bits"):
        quantize_per_channel(w, bits=1)
    with pytest.raises(ConfigError, match="2-D"):
        quantize_int8(np.ones(4))


def _planted(n: int = 64, k: int = 256, cols=(3, 77, 200), seed: int = 5) -> np.ndarray:
    w = _rng(seed).standard_normal((n, k)).astype(np.float32) * 0.02
    w[:, list(cols)] *= 60.0
    return w


def test_mixed_matmul_is_the_split_form_of_the_dequantized_matrix():
    w = _planted()
    mixed = quantize_mixed(w, fraction=0.02)
    x = _rng(6).standard_normal((5, 256)).astype(np.float32)
    np.testing.assert_allclose(mixed.matmul(x), x @ mixed.dequantize().T, rtol=1e-5, atol=1e-6)
    assert mixed.int4.q.shape == (64, 256 - len(mixed.outliers)) and mixed.int8.q.shape == (64, len(mixed.outliers))
    assert np.abs(mixed.int4.q).max() <= 7 and np.abs(mixed.int8.q).max() <= 127
    np.testing.assert_array_equal(mixed.dequantize()[:, mixed.outliers], mixed.int8.dequantize())


def test_mixed_outliers_are_exactly_the_top_salience_channels():
    rng = _rng(8)
    w = rng.standard_normal((32, 200)).astype(np.float32)
    act = rng.uniform(0, 3, 200).astype(np.float32)
    mixed = quantize_mixed(w, fraction=0.05, act_mean_abs=act)
    sal = act * np.sqrt((w.astype(np.float64) ** 2).sum(axis=0))
    expected = np.sort(np.argsort(-sal)[:10])
    np.testing.assert_array_equal(mixed.outliers, expected)
    others = np.setdiff1d(np.arange(200), mixed.outliers)
    assert sal[mixed.outliers].min() > sal[others].max()
    assert mixed.rule["salience"].startswith("mean|x_j|")


def test_mixed_weight_only_salience_finds_planted_columns_and_activations_can_override():
    w = _planted()
    assert set(quantize_mixed(w, fraction=3 / 256).outliers) == {3, 77, 200}
    act = np.ones(256, np.float32)
    act[10] = 1e4  # a small-weight channel carrying huge activations
    assert 10 in quantize_mixed(w, fraction=1 / 256, act_mean_abs=act).outliers
    with pytest.raises(ConfigError, match="act_mean_abs"):
        salience(w, np.ones(5))
    np.testing.assert_allclose(activation_stats(np.array([[1.0, -2.0], [-3.0, 0.0]])), [2.0, 1.0])


def test_mixed_beats_plain_int4_on_planted_outlier_columns():
    w = _planted()
    plain = weight_error(w, quantize_int4(w).dequantize()).rel_fro
    mixed = weight_error(w, quantize_mixed(w, fraction=3 / 256).dequantize()).rel_fro
    assert mixed < 0.5 * plain


def test_outlier_count_and_rule_record():
    assert outlier_count(128, 0.01) == 2 and outlier_count(50, 0.01) == 1 and outlier_count(3, 1.0) == 3
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="fraction"):
            outlier_count(10, bad)
    rule = quantize_mixed(_planted()).rule
    decoded = json.loads(json.dumps(rule))
    assert decoded["fraction"] == 0.01 and decoded["n_outliers"] == 3
    assert {"name", "salience", "int4_scale", "int8_scale"} <= set(decoded)


def test_weight_error():
    w = np.array([[3.0, 4.0]])
    assert weight_error(w, w) == (0.0, 0.0)
    e = weight_error(w, np.array([[3.0, 3.0]]))
    assert e.rel_fro == pytest.approx(0.2) and e.max_abs == pytest.approx(1.0)
    assert weight_error(np.zeros((2, 2)), np.zeros((2, 2))).rel_fro == 0.0
    assert weight_error(np.zeros((1, 1)), np.ones((1, 1))).rel_fro == np.inf
    with pytest.raises(ConfigError, match="shapes"):
        weight_error(w, np.ones((2, 1)))


def test_scheme_registry_fake_quantizes_and_counts_storage():
    assert sorted(QUANT_SCHEMES) == ["int4", "int4+int8-outliers", "int8", "q4_0"]
    w = _planted(n=64, k=256)
    out = {name: fake_quantize(name, w) for name in QUANT_SCHEMES}
    for name, fq in out.items():
        assert fq.weights.shape == w.shape and fq.weights.dtype == np.float32, name
        assert not np.array_equal(fq.weights, w), name
    assert out["q4_0"].bits_per_weight == 4.5
    assert out["int8"].bits_per_weight == pytest.approx(8 + 32 / 256)
    assert out["int4"].bits_per_weight == pytest.approx(4 + 32 / 256)
    assert 4 < out["int4+int8-outliers"].bits_per_weight < 4.5
    np.testing.assert_array_equal(out["q4_0"].weights, dequantize_q4_0(quantize_q4_0(w), w.shape))


def test_q4_0_scheme_pads_rows_that_are_not_whole_blocks():
    w = _rng(9).standard_normal((5, 40)).astype(np.float32)
    fq = fake_quantize("q4_0", w)
    padded = np.zeros((5, 64), np.float32)
    padded[:, :40] = w
    np.testing.assert_array_equal(fq.weights, dequantize_q4_0(quantize_q4_0(padded), (5, 64))[:, :40])
    assert fq.storage_bytes == 5 * 2 * 18


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown quantization scheme 'q3'.*int4\+int8-outliers"):
        fake_quantize("q3", np.ones((2, 32)))


def test_tiles_and_quant_import_without_jax_or_flax():
    code = ("import sys, dlm_jax.lowering.tiles, dlm_jax.lowering.quant, lowering; dlm_jax.lowering.QUANT_SCHEMES; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'jaxlib')); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_q4_0_known_divergence_from_gguf_py_is_only_the_sign_of_a_zero_scale():
    gguf = pytest.importorskip("gguf", reason="gguf (GGML's Python reference quantizer) is not installed")
    from gguf.quants import quantize

    w = np.full((1, 32), -0.0, np.float32)
    ref, ours = quantize(w, gguf.GGMLQuantizationType.Q4_0), quantize_q4_0(w)
    assert list(ref[0, :2]) == [0x00, 0x00] and list(ours[0, :2]) == [0x00, 0x80]
    assert np.array_equal(ref[:, 2:], ours[:, 2:])

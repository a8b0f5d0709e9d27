"""Weight-only int8 / fp8 / int4 / uint4 quantization at load (`dlm_jax.models.quant`, `dlm_jax.load(quant=...)`)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.frontends.cli import main
from dlm_jax.models.quant import (QuantExperts, QuantLinear, expert_einsum, quantize, quantize_kernel,
                                  quantized_weights, weight_bytes)
from dlm_jax.testing import tiny_config
from dlm_jax.training.data import TASKS, make_split

ROOT = Path(__file__).resolve().parents[2]


def _numpy_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8, written from the definition: scale = max|W[:, j]| / 127."""
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale


def test_int8_matches_a_numpy_reference_with_zero_columns():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 24)).astype(np.float32) * rng.uniform(0.01, 3, size=24).astype(np.float32)
    w[:, 5] = 0.0
    q, scale, _ = jax.device_get(quantize_kernel(jnp.asarray(w), mode="int8"))
    want_q, want_scale = _numpy_int8(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (24,)
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
    assert np.abs(q.astype(np.int32) - want_q.astype(np.int32)).max() <= 1  # rounding ties may differ by ulp
    assert (q[:, 5] == 0).all() and scale[5] == 1.0
    assert q.min() >= -127 and q.max() <= 127 and (np.abs(q).max(axis=0)[np.arange(24) != 5] == 127).all()
    err = np.abs(q.astype(np.float32) * scale - w)
    assert (err <= scale / 2 * (1 + 1e-5)).all()  # round to nearest: half a step per column


def test_fp8_uses_e4m3_per_channel_with_its_bound():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(48, 16)).astype(np.float32)
    q, scale, _ = jax.device_get(quantize_kernel(jnp.asarray(w), mode="fp8"))
    assert q.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_allclose(scale, np.abs(w).max(axis=0) / 448.0, rtol=1e-6)
    want = (w / scale).astype(ml_dtypes.float8_e4m3fn)  # ml_dtypes' own rounding
    np.testing.assert_array_equal(q.astype(np.float32), want.astype(np.float32))
    rel = np.abs(q.astype(np.float32) * scale - w) / np.abs(w).max(axis=0)
    assert rel.max() <= 2 ** -4 * 448 / 448 + 1e-6  # e4m3: 3 mantissa bits, half an ulp of the top binade


def _numpy_grouped_int8(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 with one scale per output channel and group of `group` input rows, from the
    definition: scale[g, j] = max over rows g*group..(g+1)*group-1 of |W[i, j]| / 127."""
    rows, cols = w.shape
    amax = np.abs(w.reshape(rows // group, group, cols)).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.round(w / np.repeat(scale, group, axis=0)), -127, 127).astype(np.int8)
    return q, scale


def test_grouped_int8_matches_a_numpy_reference_and_confines_an_outlier_to_its_group():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(128, 24)).astype(np.float32)
    w[5, :] *= 40.0  # one outlier input row: per channel, every step of every column coarsens
    q, scale, _ = jax.device_get(quantize_kernel(jnp.asarray(w), mode="int8-g32"))
    want_q, want_scale = _numpy_grouped_int8(w, 32)
    assert q.dtype == np.int8 and scale.shape == (4, 24)
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
    assert np.abs(q.astype(np.int32) - want_q.astype(np.int32)).max() <= 1
    grouped = np.abs(q.astype(np.float32) * np.repeat(scale, 32, axis=0) - w)
    assert (grouped <= np.repeat(scale, 32, axis=0) / 2 * (1 + 1e-5)).all()
    q1, s1, _ = jax.device_get(quantize_kernel(jnp.asarray(w), mode="int8"))
    per_channel = np.abs(q1.astype(np.float32) * s1 - w)
    assert grouped[32:].mean() < per_channel[32:].mean() / 10  # the groups without the outlier row
    q2, s2, _ = jax.device_get(quantize_kernel(jnp.asarray(w), mode="int8-g256"))  # a group past the rows: one
    assert s2.shape == (1, 24)
    np.testing.assert_array_equal(q2, q1)
    np.testing.assert_allclose(s2[0], s1, rtol=1e-6)


def test_grouped_int4_matches_a_numpy_reference():
    """int4: [-7, 7] with scale max|W| / 7 per output channel and group, held as JAX's int4."""
    rng = np.random.default_rng(4)
    w = rng.normal(size=(64, 24)).astype(np.float32)
    w[:32, 3] = 0.0  # a zero group: scale 1, q 0
    q, scale, _ = jax.device_get(quantize_kernel(jnp.asarray(w), mode="int4-g32"))
    assert q.dtype == ml_dtypes.int4 and scale.shape == (2, 24)
    amax = np.abs(w.reshape(2, 32, 24)).max(axis=1)
    want_scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
    q32 = q.astype(np.int32)
    want_q = np.clip(np.round(w / np.repeat(want_scale, 32, axis=0)), -7, 7)
    assert np.abs(q32 - want_q).max() <= 1 and q32.min() >= -7 and q32.max() <= 7
    assert (q32[:32, 3] == 0).all() and scale[0, 3] == 1.0
    err = np.abs(q32 * np.repeat(scale, 32, axis=0) - w)
    assert (err <= np.repeat(scale, 32, axis=0) / 2 * (1 + 1e-5)).all()


def _uint4(q, zero) -> tuple[np.ndarray, np.ndarray]:
    """uint4's q (0 to 15) and zero points as the formats store them: held minus 8."""
    return np.asarray(q, np.int32) + 8, np.asarray(zero, np.int32) + 8


@pytest.mark.parametrize("group", [32, None])
def test_uint4_matches_autorounds_asymmetric_quantizer(group):
    """uint4 is the asymmetric 4-bit rounding of GPTQ / AutoRound (`quant_tensor_asym`: the range
    [min(w, 0), max(w, 0)] in 15 steps, zero point round(-lo / scale)), held minus 8: q as int4,
    the zero points as int8; a zero group keeps q at its zero point."""
    import torch
    from auto_round.data_type.int import quant_tensor_asym

    rng = np.random.default_rng(5)
    w = (rng.normal(size=(64, 24)) + rng.uniform(-1, 2, size=24)).astype(np.float32)  # skewed columns
    w = w.astype(ml_dtypes.bfloat16).astype(np.float32)  # bfloat16 values: rounding ties are frequent
    w[:32, 3] = 0.0
    q, scale, zero = jax.device_get(quantize_kernel(jnp.asarray(w), mode="uint4" if group is None else "uint4-g32"))
    assert q.dtype == ml_dtypes.int4 and zero.dtype == np.int8 and zero.shape == scale.shape
    assert scale.shape == ((2, 24) if group else (24,))
    deq, their_scale, their_zero = quant_tensor_asym(torch.from_numpy(w.T.copy()), bits=4, group_size=group or -1,
                                                     scale_dtype=torch.float32)
    their_scale = their_scale.reshape(24, -1).T.numpy().reshape(scale.shape)
    their_zero = their_zero.reshape(24, -1).T.numpy().reshape(scale.shape)
    live = their_scale > 1e-5  # (a zero group: their scale is clamped to 1e-5, ours 1; q is the zero point alike)
    np.testing.assert_array_equal(scale[live], their_scale[live])  # divided as theirs: no reciprocal's ulp
    q, z = _uint4(q, zero)
    np.testing.assert_array_equal(z, their_zero)
    np.testing.assert_array_equal(q - np.repeat(z.reshape(-1, 24), 32 if group else 64, axis=0),
                                  np.round(deq.numpy().T / np.repeat(their_scale.reshape(-1, 24), 32 if group else 64,
                                                                     axis=0)))
    assert 0 <= q.min() and q.max() <= 15 and (z >= 0).all() and (z <= 15).all()
    rows = 32 if group else 64
    ours = (q - np.repeat(z.reshape(-1, 24), rows, axis=0)) * np.repeat(scale.reshape(-1, 24), rows, axis=0)
    np.testing.assert_allclose(ours, deq.numpy().T, atol=1e-6)
    if group:
        assert (q[:32, 3] == z[0, 3]).all() and (ours[:32, 3] == 0).all()
    # asymmetric steps fit a skewed column better than int4's symmetric ones
    q4, s4, _ = jax.device_get(quantize_kernel(jnp.asarray(w), mode="int4" if group is None else "int4-g32"))
    int4 = np.asarray(q4, np.float32) * (np.repeat(s4, rows, axis=0) if group else s4)
    assert np.abs(ours - w).mean() < 0.75 * np.abs(int4 - w).mean()


def test_uint4_is_compressed_tensors_min_max_rounding():
    """`quantize(model, "uint4-g32")` holds what compressed-tensors' own min-max qparams and
    quantization give a "W4A16_ASYM" scheme with groups of 32: its q and zero points (which it
    too holds 8 lower, from -8 to 7) and its scales, the routed experts' too."""
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    model = dlm_jax.init_model(tiny_config(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=32,
                                           tie_embeddings=False), seed=0)
    args = preset_name_to_scheme("W4A16_ASYM", ["Linear"]).weights
    args.group_size = 32
    floats = {}
    for name, module, attr in quantized_weights(model):
        w = getattr(module, attr)
        floats[name] = (module, attr, np.asarray((w.kernel if isinstance(w, nnx.Linear) else w)[...]))
    quantize(model, "uint4-g32")
    assert any(w.ndim == 3 for _, _, w in floats.values())
    for name, (module, attr, w) in floats.items():
        held = getattr(module, attr)
        q, scale, zero = ((held.qkernel[...], held.scale[...], held.zero[...]) if hasattr(held, "qkernel")
                          else (held[...], getattr(module, f"{attr}_scale")[...], getattr(module, f"{attr}_zero")[...]))
        for e in range(w.shape[0]) if w.ndim == 3 else [None]:
            we = torch.from_numpy(np.ascontiguousarray((w if e is None else w[e]).T))  # [out, in]
            g = we.reshape(we.shape[0], -1, 32)
            s, z = calculate_qparams(g.amin(-1), g.amax(-1), args)
            theirs = ct_quantize(we, s, z, args=args, dtype=torch.int8)
            pick = (lambda a: a) if e is None else (lambda a: a[e])  # noqa: E731
            np.testing.assert_array_equal(np.asarray(pick(q), np.int8).T, theirs.numpy(), name)
            np.testing.assert_array_equal(np.asarray(pick(zero)).T, z.numpy(), name)
            np.testing.assert_allclose(np.asarray(pick(scale)).T, s.numpy(), rtol=1e-6)


@pytest.mark.parametrize("text, parts", [("int8", ("int8", None)), ("fp8", ("fp8", None)),
                                         ("int8-g128", ("int8", 128)), ("fp8-g32", ("fp8", 32)),
                                         ("int4-g32", ("int4", 32)), ("int4", ("int4", None)),
                                         ("uint4-g128", ("uint4", 128)), ("int4-g128-act", ("int4", 128))])
def test_quant_modes_parse(text, parts):
    from dlm_jax._config import weight_quant_parts

    assert weight_quant_parts(text) == parts


@pytest.mark.parametrize("text, message", [("int2", "unknown quant 'int2'"), ("int8-g", "unknown quant"),
                                           ("int8-gx", "unknown quant"), ("int8g32", "unknown quant"),
                                           ("int8-g032", "unknown quant"), ("int8-g1", "at least 2 input rows"),
                                           ("int4-act", "needs groups: 'int4-g128-act'")])
def test_quant_modes_refused(text, message):
    from dlm_jax._config import weight_quant_parts

    with pytest.raises(ConfigError, match=message):
        weight_quant_parts(text)


@pytest.mark.parametrize("mode", ["int8", "fp8", "int8-g8", "fp8-g16", "int4-g8", "uint4-g8", "uint4", "uint4-g8-act"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quant_linear_is_x_times_the_dequantised_kernel(mode, dtype):
    linear = nnx.Linear(32, 12, use_bias=True, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    linear.bias[...] = jnp.arange(12, dtype=jnp.float32) / 10
    ql = QuantLinear.from_linear(linear, mode)
    x = jax.random.normal(jax.random.key(1), (3, 5, 32)).astype(dtype)
    scale = np.asarray(ql.scale[...])
    zero = np.zeros_like(scale) if ql.zero is None else np.asarray(ql.zero[...], np.float32)
    assert (ql.zero is not None) == mode.startswith("uint4") and (ql.g_idx is not None) == mode.endswith("-act")
    if scale.ndim == 2:  # grouped: [G, O], one row per group of input rows
        scale = np.repeat(scale, 32 // scale.shape[0], axis=0)
        zero = np.repeat(zero, 32 // zero.shape[0], axis=0)
    w = (np.asarray(ql.qkernel[...]).astype(np.float32) - zero) * scale
    want = np.asarray(x, np.float32) @ w + np.arange(12, dtype=np.float32) / 10
    got = ql(x)
    assert got.dtype == dtype and got.shape == (3, 5, 12)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


def test_expert_einsum_matches_dequantised_experts():
    w = jax.random.normal(jax.random.key(2), (4, 16, 8))
    q, scale, _ = quantize_kernel(w, mode="int8")
    x = jax.random.normal(jax.random.key(3), (4, 3, 16))
    dense = np.einsum("ecd,edf->ecf", np.asarray(x), np.asarray(q, np.float32) * np.asarray(scale)[:, None, :])
    np.testing.assert_allclose(expert_einsum("ecd,edf->ecf", x, QuantExperts(q, scale)), dense, rtol=1e-5, atol=1e-5)
    q, scale, _ = quantize_kernel(w, mode="int8-g4")  # grouped: [E, G, O] scales
    assert scale.shape == (4, 4, 8)
    dense = np.einsum("ecd,edf->ecf", np.asarray(x),
                      np.asarray(q, np.float32) * np.repeat(np.asarray(scale), 4, axis=1))
    np.testing.assert_allclose(expert_einsum("ecd,edf->ecf", x, QuantExperts(q, scale)), dense, rtol=1e-5, atol=1e-5)
    taken = QuantExperts(q, scale).take(jnp.array([2, 0]), jnp.float32)
    np.testing.assert_allclose(taken, (np.asarray(q, np.float32) * np.repeat(np.asarray(scale), 4, axis=1))[[2, 0]],
                               rtol=1e-6)
    for mode, rep in (("uint4-g4", 4), ("uint4", None)):  # zero points [E, G, O] / [E, O] beside the scales
        q, scale, zero = quantize_kernel(w, mode=mode)
        s, z = np.asarray(scale), np.asarray(zero, np.float32)
        s, z = (np.repeat(s, rep, axis=1), np.repeat(z, rep, axis=1)) if rep else (s[:, None, :], z[:, None, :])
        deq = (np.asarray(q, np.float32) - z) * s
        np.testing.assert_allclose(deq, np.asarray(w), atol=np.max(s) / 2 + 1e-6)  # (each within half its step)
        got = expert_einsum("ecd,edf->ecf", x, QuantExperts(q, scale, zero))
        np.testing.assert_allclose(got, np.einsum("ecd,edf->ecf", np.asarray(x), deq), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(QuantExperts(q, scale, zero).take(jnp.array([3]), jnp.float32), deq[[3]],
                                   rtol=1e-6)


def _heldout(handle, n: int) -> list[list[int]]:
    return [handle.encode(ex.prompt) for name in ("addition", "sorting") for ex in make_split(TASKS[name], n,
                                                                                             split="heldout")]


def test_int8_llada_tiny_decodes_as_float32_on_most_prompts():
    """A quantized decode that drifts silently (a scale on the wrong axis, a transposed int8
    kernel on the CPU) still produces text: only agreement with float32 catches it."""
    cfg = dlm_jax.decode_config(gen_len=32)
    base = dlm_jax.load(ROOT / "models" / "llada-tiny", executor="jax")
    quant = dlm_jax.load(ROOT / "models" / "llada-tiny", executor="jax", quant="int8")
    prompts = _heldout(base, 8)
    want = base.generate(prompts, cfg).texts
    got = quant.generate(prompts, cfg).texts
    same = np.mean([a == b for a, b in zip(want, got)])
    assert same >= 14 / 16, (same, want, got)  # measured 16/16
    grouped = dlm_jax.load(ROOT / "models" / "llada-tiny", executor="jax", quant="int8-g32")
    assert grouped.model.layers[0].ffn.down_proj.scale[...].shape == (384 // 32, 128)
    got = grouped.generate(prompts, cfg).texts
    same = np.mean([a == b for a, b in zip(want, got)])
    assert same >= 14 / 16, (same, want, got)
    int4 = dlm_jax.load(ROOT / "models" / "llada-tiny", executor="jax", quant="int4-g32")
    assert int4.model.layers[0].ffn.down_proj.qkernel[...].dtype == jnp.int4
    got = int4.generate(prompts, cfg).texts
    same = np.mean([a == b for a, b in zip(want, got)])
    assert same >= 14 / 16, (same, want, got)  # measured 16/16 (int4 per channel: 14/16)
    uint4 = dlm_jax.load(ROOT / "models" / "llada-tiny", executor="jax", quant="uint4-g32")
    assert uint4.model.layers[0].ffn.down_proj.zero[...].shape == (384 // 32, 128)
    zeros = [leaf for path, leaf in jax.tree.leaves_with_path(nnx.state(uint4.model, nnx.Param))
             if "zero" in str(path[-2] if str(path[-1]) == ".value" else path[-1])]
    assert zeros and all(z.dtype == jnp.int8 for z in zeros)  # int4's bytes plus a byte a zero point (one a scale)
    assert weight_bytes(uint4.model) == weight_bytes(int4.model) + sum(z.size for z in zeros)
    got = uint4.generate(prompts, cfg).texts
    same = np.mean([a == b for a, b in zip(want, got)])
    assert same >= 14 / 16, (same, want, got)


def test_quantized_executor_leaves_are_int8_and_smaller():
    cfg = tiny_config(dtype="bfloat16", param_dtype="bfloat16")
    bf16 = dlm_jax.init_model(cfg, seed=0)
    before = weight_bytes(bf16)
    model = quantize(dlm_jax.init_model(cfg, seed=0), "int8")
    from dlm_jax.executors.jax_executor import JaxExecutor

    ex = JaxExecutor(model)
    dtypes = {str(leaf.dtype) for leaf in ex._leaves}
    assert "int8" in dtypes
    assert isinstance(model.layers[0].attn.q_proj, QuantLinear) and isinstance(model.lm_head, QuantLinear)
    linear_bytes = sum(leaf.nbytes for leaf in ex._leaves if leaf.dtype == jnp.int8)
    assert linear_bytes > 0 and weight_bytes(model) < 0.75 * before  # the embedding stays bfloat16


def test_quantized_weights_names_exactly_what_quantize_replaces():
    cfg = tiny_config(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16, n_shared_experts=1,
                      dense_layers=(0,), tie_embeddings=False)
    model = dlm_jax.init_model(cfg, seed=0)
    listed = quantized_weights(model)
    names = [name for _, _, name in listed]
    assert names.count("gate") == names.count("up") == names.count("down") == 1  # the MoE layer's routed experts
    assert names.count("q_proj") == 2 and names.count("down_proj") == 2  # the dense layer's FFN and the shared expert
    assert names[-1] == "lm_head"
    full = {full for full, _, _ in listed}
    assert {"layers.1.ffn.gate", "layers.1.ffn.shared.down_proj", "layers.0.attn.q_proj", "lm_head"} <= full
    params = dlm_jax.get_params(model)  # each name is its weight's parameter (a Linear's: with ".kernel")
    assert all(f"{n}.kernel" in params or n in params for n in full)
    quantize(model, "int8")
    replaced = [getattr(module, name) for _, module, name in listed]
    assert all(isinstance(w, QuantLinear) or w[...].dtype == jnp.int8 for w in replaced)
    int8_leaves = [x for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.dtype == jnp.int8]
    assert len(int8_leaves) == len(listed)  # nothing else was quantized


def test_quantize_keeps_the_weights_named_float():
    cfg = tiny_config(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16, n_shared_experts=1,
                      dense_layers=(0,), tie_embeddings=False)
    keep = {"lm_head", "layers.1.ffn.gate", "layers.1.ffn.up", "layers.1.ffn.down", "layers.0.attn.o_proj"}
    model = quantize(dlm_jax.init_model(cfg, seed=0), "int8", keep=keep)
    assert model.quant_float == keep and not model.quant_head
    assert type(model.lm_head) is nnx.Linear and type(model.layers[0].attn.o_proj) is nnx.Linear
    assert isinstance(model.layers[0].attn.q_proj, QuantLinear) and model.layers[1].ffn.gate[...].dtype == jnp.float32
    assert {name for name, _, _ in quantized_weights(model, keep=keep)}.isdisjoint(keep)
    with pytest.raises(ConfigError, match=r"^quant='int8': keep names \['layers.1.ffn.router'\], which are no "
                                          r"weights it quantizes"):
        quantize(dlm_jax.init_model(cfg, seed=0), "int8", keep={"layers.1.ffn.router"})


# (XLA:CPU emulates fp8: the decode's compile takes 5 s)
@pytest.mark.parametrize("decode", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_moe_experts_quantized_per_expert_and_decode(decode):
    model = dlm_jax.load(ROOT / "models" / "moe-tiny", executor="jax", quant="fp8")
    ffn = next(b.ffn for b in model.model.layers if hasattr(b.ffn, "router"))
    assert ffn.gate[...].dtype == jnp.float8_e4m3fn and ffn.gate_scale[...].shape == ffn.gate[...].shape[::2]
    assert ffn.router.kernel[...].dtype == jnp.float32  # the router stays as stored
    if decode:
        out = model.generate("1 + 1 =", dlm_jax.decode_config(gen_len=8, block_len=8))
        assert out.stats.nfe > 0 and len(out.token_ids[0]) <= 8 and out.texts[0] is not None


def test_act_order_maps_each_row_to_its_group():
    """An act-order mode's map (`g_idx`, GPTQ's `desc_act`) picks each input row's scales and
    zero points wherever its group is, each routed expert through its own map; quantizing at
    load gives rows their groups in order."""
    from dlm_jax.models.quant import dequantize

    w = jax.random.normal(jax.random.key(4), (32, 8))
    q, scale, zero = quantize_kernel(w, mode="uint4-g8")
    perm = np.random.default_rng(0).permutation(32)
    g_idx = jnp.asarray((np.arange(32) // 8)[perm], jnp.int32)  # rows stored in another order, each with its group
    np.testing.assert_array_equal(dequantize(q[perm], scale, zero=zero, g_idx=g_idx),
                                  dequantize(q, scale, zero=zero)[perm])
    linear = QuantLinear.from_linear(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), "int4-g8-act")
    np.testing.assert_array_equal(linear.g_idx[...], np.arange(32) // 8)
    qe, se, ze = quantize_kernel(jax.random.normal(jax.random.key(5), (3, 32, 8)), mode="uint4-g8")  # 3 experts
    perms = np.stack([np.random.default_rng(e).permutation(32) for e in range(3)])
    maps = jnp.asarray((np.arange(32) // 8)[perms], jnp.int32)  # [E, I]
    stored = jnp.take_along_axis(qe, jnp.asarray(perms)[..., None], axis=1)
    want = np.stack([np.asarray(dequantize(qe[e], se[e], zero=ze[e]))[perms[e]] for e in range(3)])
    np.testing.assert_array_equal(dequantize(stored, se, zero=ze, g_idx=maps), want)
    experts = QuantExperts(stored, se, ze, maps)
    np.testing.assert_array_equal(experts.take(jnp.asarray([2, 0]), jnp.float32), want[[2, 0]])


@pytest.mark.slow  # (7 s: two MoE models quantized, kernel by kernel)
def test_act_order_at_load_gives_the_plain_groups_logits():
    """Quantizing at load with "-act" gives every kernel, routed experts' too (one map each), its
    rows' groups in order: the logits of the mode without "-act", exactly."""
    cfg = tiny_config(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=32)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)))
    plain, act = (quantize(dlm_jax.init_model(cfg, seed=0), mode) for mode in ("int4-g8", "int4-g8-act"))
    ffn = act.layers[cfg.moe_layers[0]].ffn
    assert ffn.down_g_idx[...].shape == (4, 32) and ffn.gate_g_idx[...].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(act(ids)[0]), np.asarray(plain(ids)[0]))


def test_quantize_refuses_before_it_swaps_anything():
    """Guards a refused `quantize` leaving the model half quantized (its attention swapped, its
    split experts refused after), and a stacked model failing inside the quantizer."""
    from dlm_jax.executors.jax_executor import JaxExecutor
    from dlm_jax.techniques.tide.split import split_experts

    model = dlm_jax.load(ROOT / "models" / "moe-tiny", executor="jax", expert_slots=4).model
    with pytest.raises(ConfigError, match="with split expert execution"):
        quantize(model, "int8")
    assert getattr(model, "quant", None) is None
    assert not any(isinstance(m, QuantLinear) for _, m in nnx.iter_modules(model))
    stacked = dlm_jax.init_model(tiny_config(), seed=0)
    JaxExecutor(stacked, layers="scan")
    with pytest.raises(ConfigError, match="^quant='int8': the model's layers are stacked for a scan"):
        quantize(stacked, "int8")
    quantized = dlm_jax.load(ROOT / "models" / "moe-tiny", executor="jax", quant="int8").model
    with pytest.raises(ConfigError, match="^split expert execution of a model weight-only quantized"):
        split_experts(quantized, quantized.config.moe_layers, 4)


def test_quant_refusals_are_one_line():
    with pytest.raises(ConfigError, match="unknown quant 'int3'"):
        dlm_jax.load(ROOT / "models" / "llada-tiny", quant="int3")
    with pytest.raises(ConfigError, match="quant='int8' runs on the JAX executor, not 'litert'"):
        dlm_jax.load(ROOT / "models" / "llada-tiny", quant="int8", executor="litert")
    with pytest.raises(ConfigError, match="expert_slots"):
        dlm_jax.load(ROOT / "models" / "moe-tiny", quant="int8", expert_slots=2)


def test_a_group_size_that_divides_no_kernel_is_refused_before_anything_is_swapped():
    model = dlm_jax.init_model(tiny_config(), seed=0)  # d_model 32
    with pytest.raises(ConfigError, match=r"^quant='int8-g12': Attention.q_proj has 32 input rows, not a multiple "
                                          r"of groups of 12"):
        quantize(model, "int8-g12")
    assert getattr(model, "quant", None) is None
    assert not any(isinstance(m, QuantLinear) for _, m in nnx.iter_modules(model))


def test_cli_quant_errors(capsys):
    args = ["generate", "--model", str(ROOT / "models" / "llada-tiny"), "--prompt", "hi", "--gen", "8", "--block", "8"]
    assert main([*args, "--quant", "int8", "--executor", "litert"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: quant='int8' runs on the JAX executor"), err
    with pytest.raises(SystemExit) as e:
        main([*args, "--quant", "int3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "argument --quant: unknown quant 'int3'" in err[-1], err
    assert main([*args, "--quant", "int8-g48"]) == 2  # 128 input rows: no whole groups of 48
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: quant='int8-g48': Attention.q_proj has 128 input rows"), err


def test_int4_kernels_widen_to_int8_with_the_same_values():
    """On a mesh the executor holds int4 kernels as int8 (`widen_int4`): every one, the values
    unchanged, an MoE's experts included."""
    from dlm_jax.models.quant import widen_int4

    model = dlm_jax.load(ROOT / "models" / "moe-tiny", executor="jax", quant="int4-g32").model
    flat = lambda: dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))  # noqa: E731
    before = {k: np.asarray(v[...], np.int8) for k, v in flat().items() if v[...].dtype == jnp.int4}
    assert any("gate" in "/".join(map(str, k)) and "ffn" in "/".join(map(str, k)) for k in before)
    assert widen_int4(model) == len(before) > 0
    after = flat()
    assert all(after[k][...].dtype == jnp.int8 for k in before)
    assert not any(v[...].dtype == jnp.int4 for v in after.values())
    for k, v in before.items():
        np.testing.assert_array_equal(np.asarray(after[k][...]), v)

"""The quantized GEMM in Pallas (`dlm_jax.models._quant_kernel`), run in Pallas's interpreter on
the CPU: the product of NumPy's dequantised weights (int8 / fp8 / int4 groups, zero points,
act-order maps), the shapes it takes, and the models' grouped products routed to it only where
`$DLM_JAX_QUANT_KERNEL=pallas` asks on a GPU (or the interpreter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax
from dlm_jax.models import _attention_kernel, _quant_kernel
from dlm_jax.models._quant_kernel import QUANT_KERNEL_ENV, Tiling, expert_matmul, fits, grouped_matmul, tiled
from dlm_jax.models.quant import quantize, quantize_kernel
from dlm_jax.testing import tiny_model


def numpy_product(x, q, scale, zero=None, g_idx=None) -> np.ndarray:
    """x @ ((q - zero[g]) * scale[g]) in float64, each row i in group g_idx[i] (default
    i // (I / G); scales [O]: one group)."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    scale = np.asarray(scale, np.float64).reshape(-1, q.shape[1])
    rows = np.arange(q.shape[0]) // (q.shape[0] // scale.shape[0]) if g_idx is None else np.asarray(g_idx)
    per_row = lambda a: np.asarray(a, np.float64).reshape(scale.shape)[rows]  # noqa: E731
    w = (q - (per_row(zero) if zero is not None else 0.0)) * per_row(scale)
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ w


@pytest.mark.parametrize("mode, dtype, m, rows, cols", [
    ("int8-g16", jnp.float32, 5, 64, 48),  # (rows padded to a block of 16; 16-wide column blocks)
    ("int8-g32", jnp.float32, 70, 128, 32),  # (two blocks of 64 rows, the second padded)
    ("fp8-g32", jnp.float32, 3, 96, 64),
    ("int8-g16", jnp.bfloat16, 40, 64, 256),  # (two blocks of 128 columns)
    ("int4-g32", jnp.float32, 5, 128, 48),  # (int4: two weights a byte)
    ("int4-g256", jnp.float32, 4, 512, 32),  # (groups of 256 in blocks of 128 rows: two a group)
    ("uint4-g32", jnp.float32, 6, 96, 32),  # (zero points)
    ("uint4", jnp.float32, 3, 384, 32),  # (one scale and zero point a channel: 3 blocks of 128 rows)
    ("uint4-g64", jnp.bfloat16, 20, 128, 64),
    ("int8-g48", jnp.float32, 5, 96, 32)])  # (groups of 48 in blocks of 16: three a group)
def test_kernel_is_the_product_of_the_dequantised_weights(mode, dtype, m, rows, cols):
    w = jax.random.normal(jax.random.key(0), (rows, cols))
    q, scale, zero = quantize_kernel(w, mode=mode)
    x = jax.random.normal(jax.random.key(1), (m, rows)).astype(dtype)
    assert fits(q, scale, zero)
    with _attention_kernel.interpret():
        got = grouped_matmul(x, q, scale, zero)
    assert got.shape == (m, cols) and got.dtype == jnp.float32
    want = numpy_product(x, q, scale, zero)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2  # (bfloat16: the dequantised weights are rounded to it)
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("mode", ["int4-g32-act", "uint4-g32-act", "int8-g48-act"])
def test_kernel_gathers_each_row_s_scales_by_its_act_order_group(mode):
    """An act-order kernel: rows in groups out of order (GPTQ's desc_act), each block's scales
    and zero points gathered row by row (groups of 48: not a power of two; blocks of 64 rows)."""
    rows, cols = 192, 32
    rng = np.random.default_rng(5)
    g_idx = rng.permutation(np.arange(rows) // (48 if "g48" in mode else 32)).astype(np.int32)
    q, scale, zero = quantize_kernel(jax.random.normal(jax.random.key(0), (rows, cols)), mode=mode)
    x = jnp.asarray(rng.normal(size=(7, rows)), jnp.float32)
    assert fits(q, scale, zero, g_idx) and not fits(q, scale, zero, g_idx[:-1])
    with _attention_kernel.interpret():
        got = grouped_matmul(x, q, scale, zero, jnp.asarray(g_idx))
    want = numpy_product(x, q, scale, zero, g_idx)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    in_order = numpy_product(x, q, scale, zero)
    assert np.abs(in_order - want).max() > 1e-2 * np.abs(want).max()  # (the map matters)


@pytest.mark.parametrize("tiling", [Tiling(split=2), Tiling(split=4, block_n=32), Tiling(block_m=16, split=8),
                                    Tiling(split=16, block_n=16)])
def test_kernel_tilings_compute_the_same_product(tiling):
    """Split over the input rows (float32 partial sums added share by share), narrower column
    blocks, fewer rows a program: the same product (int4 in groups of 32, zero points; 8 blocks
    of rows, so a split of 16 takes 8)."""
    q, scale, zero = quantize_kernel(jax.random.normal(jax.random.key(0), (256, 64)), mode="uint4-g32")
    x = jax.random.normal(jax.random.key(1), (20, 256))
    with _attention_kernel.interpret():
        plain = grouped_matmul(x, q, scale, zero, out_dtype=jnp.bfloat16)
        with tiled(tiling):
            got = grouped_matmul(x, q, scale, zero, out_dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    want = numpy_product(x, q, scale, zero)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(plain, np.float32), rtol=1e-2, atol=1e-2)


def test_the_default_split_gives_a_product_of_few_rows_programs_enough():
    """`auto_split` at the LLaDA-8B layer's products (128 rows a block): a batch-1 dual step's
    32 rows (one row block) over q's 32 column blocks split 4 ways (128 programs), gate / up's 96
    2 ways, down's 12288 rows 4 ways; 256 rows (4 row blocks) or the head's 988 column blocks
    not at all; a kernel of 8 blocks of rows keeps 4 a share."""
    from dlm_jax.models._quant_kernel import auto_split

    assert [auto_split(p, b) for p, b in ((32, 32), (96, 32), (32, 96), (128, 32), (384, 32), (988, 32))] == [
        4, 2, 4, 1, 1, 1]
    assert auto_split(1, 8) == 2 and auto_split(1, 1024) == 8 and auto_split(1, 4) == 1 and auto_split(1, 12) == 2
    assert auto_split(1, 6) == 1  # (two shares of 3 blocks: under 4)


def test_a_bad_tiling_is_refused():
    for bad in (dict(block_n=24), dict(block_m=8), dict(split=3), dict(split=-1), dict(warps=3), dict(stages=0)):
        with pytest.raises(ValueError, match="Tiling"):
            Tiling(**bad)


def test_kernel_rounds_its_float32_sums_to_the_asked_dtype_once():
    """`out_dtype`: the float32 sums stored in bfloat16, as XLA's einsum with a float32
    accumulator then a cast gives them."""
    q, scale, _ = quantize_kernel(jax.random.normal(jax.random.key(0), (128, 64)), mode="int8-g32")
    x = jax.random.normal(jax.random.key(1), (9, 128)).astype(jnp.bfloat16)
    with _attention_kernel.interpret():
        wide = grouped_matmul(x, q, scale)
        narrow = grouped_matmul(x, q, scale, out_dtype=jnp.bfloat16)
    assert narrow.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(narrow), np.asarray(wide.astype(jnp.bfloat16)))


def test_kernel_subtracts_zero_points_and_keeps_leading_axes():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.integers(-100, 100, (128, 32)), jnp.int8)
    zero = jnp.asarray(rng.integers(-8, 8, (4, 32)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (4, 32)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 3, 128)), jnp.float32)
    with _attention_kernel.interpret():
        got = grouped_matmul(x, q, scale, zero)
    assert got.shape == (2, 3, 32)
    want = numpy_product(x.reshape(6, 128), q, scale, zero).reshape(2, 3, 32)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_shapes_it_does_not_take_are_refused():
    q8, s = jnp.zeros((64, 32), jnp.int8), jnp.ones((4, 32), jnp.float32)
    assert fits(q8, s)
    assert not fits(q8, jnp.ones((8, 32), jnp.float32))  # groups of 8: under Triton's 16-wide products
    assert not fits(jnp.zeros((64, 40), jnp.int8), jnp.ones((4, 40), jnp.float32))  # 40 columns
    assert not fits(jnp.zeros((64, 32), jnp.int16), s)  # not a quantized dtype
    assert fits(jnp.zeros((96, 32), jnp.int8), jnp.ones((2, 32), jnp.float32))  # groups of 48: blocks of 16
    assert not fits(jnp.zeros((80, 32), jnp.int8), jnp.ones((2, 32), jnp.float32))  # groups of 40: no block
    assert not fits(q8, jnp.ones((32,), jnp.float32))  # symmetric per channel: XLA converts those inside its GEMMs
    assert fits(q8, jnp.ones((32,), jnp.float32), jnp.zeros((32,), jnp.int8))  # with zero points: not XLA's
    assert not fits(jnp.zeros((72, 32), jnp.int8), jnp.ones((32,)), jnp.zeros((32,), jnp.int8))  # 72 rows
    with pytest.raises(ValueError, match="the quantized kernel takes int8 / float8 / int4 weights"):
        grouped_matmul(jnp.zeros((2, 64)), jnp.zeros((64, 40), jnp.int8), jnp.ones((4, 40)))


@pytest.mark.parametrize("mode", ["int4-g32", "uint4-g32-act", "fp8-g64", "uint4", "int8"])
def test_experts_products_read_each_expert_s_weights_where_they_lie(mode):
    """Routed experts [E, I, O]: the experts named (out of order, one twice) through the same
    rows, through rows of their own, and summed over their inputs side by side, each against
    NumPy's product of that expert's dequantised weights (act-order: a map per expert)."""
    e, rows, cols, m = 5, 128, 48, 7
    rng = np.random.default_rng(6)
    q, scale, zero = quantize_kernel(jax.random.normal(jax.random.key(0), (e, rows, cols)), mode=mode)
    g_idx = None
    if mode.endswith("-act"):
        g_idx = jnp.asarray(np.stack([rng.permutation(np.arange(rows) // 32) for _ in range(e)]), jnp.int32)
    ids = np.array([3, 0, 3, 4])
    some = lambda a, i: None if a is None else a[i]  # noqa: E731

    def want(x, i):
        return numpy_product(x, q[i], scale[i], some(zero, i), some(g_idx, i))

    shared = jnp.asarray(rng.normal(size=(m, rows)), jnp.float32)
    own = jnp.asarray(rng.normal(size=(len(ids), m, rows)), jnp.float32)
    with _attention_kernel.interpret(), tiled(Tiling(split=2)):
        got_shared = expert_matmul(shared, q, scale, zero, g_idx, jnp.asarray(ids))
        got_own = expert_matmul(own, q, scale, zero, g_idx, jnp.asarray(ids))
        got_sum = expert_matmul(own.transpose(1, 0, 2).reshape(m, -1), q, scale, zero, g_idx, jnp.asarray(ids),
                                summed=True)
    tol = dict(rtol=1e-4, atol=1e-4 * np.abs(want(shared, 0)).max())
    assert got_shared.shape == got_own.shape == (len(ids), m, cols) and got_sum.shape == (m, cols)
    for u, i in enumerate(ids):
        np.testing.assert_allclose(np.asarray(got_shared[u]), want(shared, i), **tol)
        np.testing.assert_allclose(np.asarray(got_own[u]), want(own[u], i), **tol)
    np.testing.assert_allclose(np.asarray(got_sum), sum(want(own[u], i) for u, i in enumerate(ids)), **tol)
    with pytest.raises(ValueError, match=r"is not \[M, 4 experts x 128\]"):
        expert_matmul(shared, q, scale, zero, g_idx, jnp.asarray(ids), summed=True)
    with pytest.raises(ValueError, match=r"is neither \[M, 128\] nor \[4 experts, M, 128\]"):
        expert_matmul(own[:3], q, scale, zero, g_idx, jnp.asarray(ids))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unquantized_experts_products_read_each_expert_s_weights_where_they_lie(dtype):
    """Routed experts' float weights without scales (an unquantized MoE's): the experts named,
    out of order and one twice, in the three forms, and one dense kernel, each against NumPy's
    product of those weights; shapes Triton cannot load are refused."""
    e, rows, cols, m = 5, 64, 32, 6
    rng = np.random.default_rng(8)
    w = jnp.asarray(rng.normal(size=(e, rows, cols)), dtype)
    ids = np.array([4, 1, 4])
    shared = jnp.asarray(rng.normal(size=(m, rows)), dtype)
    own = jnp.asarray(rng.normal(size=(len(ids), m, rows)), dtype)
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    assert fits(w, None) and fits(w[0], None) and not fits(w[..., :24], None) and not fits(w[:, :40], None)
    with _attention_kernel.interpret():
        got_shared = expert_matmul(shared, w, None, None, None, jnp.asarray(ids), out_dtype=dtype)
        got_own = expert_matmul(own, w, None, None, None, jnp.asarray(ids))
        got_sum = expert_matmul(own.transpose(1, 0, 2).reshape(m, -1), w, None, None, None, jnp.asarray(ids),
                                summed=True)
        dense = grouped_matmul(own[0], w[2])  # (one kernel [I, O], as benchmarks/quant_sweep.py --quant none times it)
        # only the first `real` experts read: the pads' products zeros (a branch's U filled past the used ones)
        pads_own = expert_matmul(own, w, None, None, None, jnp.asarray(ids), real=jnp.int32(2))
        pads_sum = expert_matmul(own.transpose(1, 0, 2).reshape(m, -1), w, None, None, None, jnp.asarray(ids),
                                 summed=True, real=jnp.int32(1))
    np.testing.assert_allclose(f64(dense), f64(own[0]) @ f64(w[2]), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(pads_own[2]), 0.0)
    np.testing.assert_allclose(f64(pads_own[:2]), f64(got_own[:2]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f64(pads_sum), f64(own[0]) @ f64(w[4]), rtol=1e-5, atol=1e-4)
    assert got_shared.dtype == dtype and got_own.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # (bfloat16: its outputs rounded once)
    for u, i in enumerate(ids):
        np.testing.assert_allclose(f64(got_shared[u]), f64(shared) @ f64(w[i]), rtol=tol, atol=tol * 8)
        np.testing.assert_allclose(f64(got_own[u]), f64(own[u]) @ f64(w[i]), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(f64(got_sum), sum(f64(own[u]) @ f64(w[i]) for u, i in enumerate(ids)),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("pool", [2, 3, 5, 8])
def test_the_few_experts_form_reads_only_the_branch_s_experts_in_the_kernel(monkeypatch, pool):
    """`dispatch_experts` over unquantized experts with the kernel asked for: steps that use 2,
    3, 5 and 8 of 8 experts run the branches of a quarter, half and all the experts (the used
    ones first, the pads that fill U not read), each branch over its U experts (from half up
    XLA's form reads all 8 in place instead), with the dense form's result in XLA's, an
    assignment of -1 contributing nothing."""
    from dlm_jax.models._transformer import Routing, dense_experts, dispatch_experts

    e, d, f, n, k = 8, 32, 16, 12, 2
    rng = np.random.default_rng(pool)
    w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    chosen = np.array([0, 5, 2, 7, 1, 6, 3, 4])[:pool]  # (spread over the ids)
    experts = np.stack([chosen[rng.permutation(pool)[:k]] for _ in range(n)])
    experts[::5, 1] = -1  # (split execution's misses)
    routing = Routing(jnp.asarray(experts, jnp.int32), jnp.asarray(rng.random((n, k)), jnp.float32))
    want = np.asarray(dense_experts(x, routing, *w))
    reads = []
    traced = _quant_kernel.expert_matmul
    monkeypatch.setattr(_quant_kernel, "expert_matmul",
                        lambda *a, **kw: reads.append(a[5].shape[0]) or traced(*a, **kw))  # (a[5]: the experts)
    monkeypatch.setenv(QUANT_KERNEL_ENV, "pallas")
    with _attention_kernel.interpret():
        got = np.asarray(jax.jit(lambda *a: dispatch_experts(*a))(x, routing, *w))  # (traced afresh)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # every branch is traced (the step picks one at run time): gate, up and down over its U experts
    assert sorted(reads) == [2] * 3 + [4] * 3 + [8] * 3, reads


@pytest.mark.parametrize("spec, x_shape", [("nd,edf->nef", (6, 64)), ("nef,efd->ned", (6, 3, 64)),
                                           ("ecd,edf->ecf", (3, 5, 64)), ("bnd,edf->ebnf", (2, 4, 64))])
def test_expert_einsum_through_the_kernel_is_its_xla_form(monkeypatch, spec, x_shape):
    """`expert_einsum`'s specs (the dense form's, the packed form's, and one with two row
    axes) through the kernel: x's axes moved to [E, M, I] or [M, I] and the product moved to
    the spec's output, as XLA's form computes it."""
    from dlm_jax.models.quant import QuantExperts, expert_einsum

    q, scale, _ = quantize_kernel(jax.random.normal(jax.random.key(0), (3, 64, 32)), mode="int8-g16")
    w = QuantExperts(q, scale)
    x = jax.random.normal(jax.random.key(1), x_shape)
    want = np.asarray(expert_einsum(spec, x, w))
    monkeypatch.setenv(QUANT_KERNEL_ENV, "pallas")
    calls = []
    traced = _quant_kernel.expert_matmul
    monkeypatch.setattr(_quant_kernel, "expert_matmul", lambda *a, **k: calls.append(1) or traced(*a, **k))
    with _attention_kernel.interpret():
        got = np.asarray(expert_einsum(spec, x, w))
    assert calls and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_bad_switch_is_refused_in_one_line(monkeypatch):
    from dlm_jax._errors import ConfigError

    monkeypatch.setenv(QUANT_KERNEL_ENV, "triton")
    with pytest.raises(ConfigError, match=r"^DLM_JAX_QUANT_KERNEL='triton': expected xla or pallas$"):
        _quant_kernel.enabled()


@pytest.mark.parametrize("mode", ["int8-g16", "int4-g16-act", "uint4"])
def test_a_model_s_grouped_products_take_the_kernel_only_where_asked(monkeypatch, mode):
    """Guards the switch: `$DLM_JAX_QUANT_KERNEL=pallas` routes every grouped (or zero-point, or
    act-order) dense product of a model (q/k/v/o, the FFN, the head) to the kernel where the
    program is a GPU's (here Pallas's interpreter stands in), with the logits of XLA's form; a
    CPU program ignores it."""
    model = quantize(tiny_model(seed=3), mode)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 60, (2, 9)), jnp.int32)
    want = np.asarray(model(tokens).logits)
    calls = []
    traced = _quant_kernel.grouped_matmul
    monkeypatch.setattr(_quant_kernel, "grouped_matmul", lambda *a, **k: calls.append(a[1].shape) or traced(*a, **k))
    monkeypatch.setenv(QUANT_KERNEL_ENV, "pallas")
    np.testing.assert_array_equal(np.asarray(model(tokens).logits), want)  # a CPU program: XLA's form
    assert calls == []
    with _attention_kernel.interpret():
        got = np.asarray(model(tokens).logits)
    cfg = model.config
    assert len(calls) == cfg.n_layers * 7 + 1  # q, k, v, o, gate, up, down a layer and the head
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.delenv(QUANT_KERNEL_ENV)
    calls.clear()
    with _attention_kernel.interpret():
        np.testing.assert_array_equal(np.asarray(model(tokens).logits), want)  # not asked: XLA's form
    assert calls == []


@pytest.mark.parametrize("dtype, fused", [("float32", False), ("bfloat16", True)])
def test_a_model_s_dense_products_take_the_kernel_only_where_asked(monkeypatch, dtype, fused):
    """`$DLM_JAX_DENSE_KERNEL=pallas` routes an unquantized model's dense products (q/k/v/o or
    their fused q/k/v, gate/up or fused, down, the untied head) to the kernel, which reads their
    weights as they are, where the program is a GPU's (the interpreter stands in), with XLA's
    logits; a CPU program ignores it, and so does the quantized kernel's switch."""
    from dlm_jax.models._fuse import fuse_projections
    from dlm_jax.models._quant_kernel import DENSE_KERNEL_ENV

    model = tiny_model(seed=3, dtype=dtype, param_dtype=dtype)
    if fused:
        fuse_projections(model)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 60, (2, 9)), jnp.int32)
    want = np.asarray(model(tokens).logits, np.float32)
    calls = []
    traced = _quant_kernel.grouped_matmul
    monkeypatch.setattr(_quant_kernel, "grouped_matmul", lambda *a, **k: calls.append(a[1].shape) or traced(*a, **k))
    monkeypatch.setenv(QUANT_KERNEL_ENV, "pallas")
    with _attention_kernel.interpret():
        np.testing.assert_array_equal(np.asarray(model(tokens).logits, np.float32), want)  # not this switch
    monkeypatch.setenv(DENSE_KERNEL_ENV, "pallas")
    np.testing.assert_array_equal(np.asarray(model(tokens).logits, np.float32), want)  # a CPU program: XLA's
    assert calls == []
    with _attention_kernel.interpret():
        got = np.asarray(model(tokens).logits, np.float32)
    cfg = model.config
    assert len(calls) == cfg.n_layers * (4 if fused else 7) + 1  # a layer's projections, and the head
    tol = 1e-5 if dtype == "float32" else 5e-2  # (bfloat16: each product rounded once, in another order)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    monkeypatch.setenv(DENSE_KERNEL_ENV, "triton")
    with pytest.raises(dlm_jax.ConfigError, match=r"^DLM_JAX_DENSE_KERNEL='triton': expected xla or pallas$"):
        model(tokens)


@pytest.mark.parametrize("mode", ["int4-g16", pytest.param("uint4-g16-act", marks=pytest.mark.slow),
                                  pytest.param("int8", marks=pytest.mark.slow), None])  # (7 s each)
def test_an_moe_model_s_routed_experts_take_the_kernel(monkeypatch, mode):
    """A MoE model's routed experts quantized in groups (or per channel, or unquantized): with
    the kernel asked for (its interpreter standing in for a GPU), the expert products run in it,
    the used experts' weights read where they lie (the few-experts form: gate and up through each
    used expert, down summed over them; the packed form, grouped: each expert its rows), with
    XLA's logits."""
    from dlm_jax.models import quant as quant_module
    from dlm_jax.testing import tiny_config

    model = dlm_jax.init_model(tiny_config(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=32,
                                           tie_embeddings=False), seed=1)
    if mode is not None:
        quantize(model, mode)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 60, (2, 9)), jnp.int32)
    want = np.asarray(model(tokens).logits)
    calls = []
    traced = _quant_kernel.expert_matmul
    monkeypatch.setattr(_quant_kernel, "expert_matmul",
                        lambda *a, **k: calls.append((a[0].ndim, k.get("summed", False))) or traced(*a, **k))
    monkeypatch.setenv(QUANT_KERNEL_ENV, "pallas")
    gate = model.layers[0].ffn.expert_weights("gate", jnp.float32)
    assert not quant_module.expert_kernel(gate)  # a CPU program: XLA's form
    with _attention_kernel.interpret():
        assert quant_module.expert_kernel(gate)
        got = np.asarray(model(tokens).logits)
    assert (2, True) in calls and (2, False) in calls  # the few-experts form: the same rows through each, summed
    # the packed form (each expert its rows): in the kernel where grouped; per channel XLA fuses it, and
    # unquantized it is XLA's batched GEMM over every expert in place
    assert ((3, False) in calls) == (mode not in ("int8", None))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_load_with_the_kernel_decodes_as_without(monkeypatch):
    """The shipped model quantized to int8-g16 at load decodes the same tokens with its grouped
    products in the kernel (interpreted) as in XLA's form."""
    model = dlm_jax.load("models/llada-tiny", quant="int8-g16", executor="jax")
    cfg = dlm_jax.decode_config(gen_len=16, block_len=16)
    want = model.generate("564+894=", cfg).token_ids
    calls = []
    traced = _quant_kernel.grouped_matmul
    monkeypatch.setattr(_quant_kernel, "grouped_matmul", lambda *a, **k: calls.append(a[1].shape) or traced(*a, **k))
    monkeypatch.setenv(QUANT_KERNEL_ENV, "pallas")
    with _attention_kernel.interpret():
        again = dlm_jax.load("models/llada-tiny", quant="int8-g16", executor="jax")
        assert again.generate("564+894=", cfg).token_ids == want
    assert calls  # (traced in the executor's programs)
    calls.clear()
    monkeypatch.delenv(QUANT_KERNEL_ENV)
    monkeypatch.setenv(_quant_kernel.DENSE_KERNEL_ENV, "pallas")  # the unquantized model's products in it
    with _attention_kernel.interpret():
        dense = dlm_jax.load("models/llada-tiny", executor="jax")
        assert dense.generate("564+894=", cfg).token_ids == dlm_jax.load(
            "models/llada-tiny", executor="jax").generate("564+894=", cfg).token_ids
    assert calls


@pytest.mark.slow
def test_a_quantized_moe_load_with_the_kernel_decodes_as_without(monkeypatch):
    """The shipped MoE model (32 routed experts, 4 a token, a shared one) quantized to int4 in
    groups of 32 at load decodes the same tokens with its expert products in the kernel
    (interpreted) as in XLA's form."""
    model = dlm_jax.load("models/moe-tiny", quant="int4-g32", executor="jax")
    cfg = dlm_jax.decode_config(gen_len=16, block_len=16)
    want = model.generate("564+894=", cfg).token_ids
    calls = []
    traced = _quant_kernel.expert_matmul
    monkeypatch.setattr(_quant_kernel, "expert_matmul", lambda *a, **k: calls.append(1) or traced(*a, **k))
    monkeypatch.setenv(QUANT_KERNEL_ENV, "pallas")
    with _attention_kernel.interpret():
        again = dlm_jax.load("models/moe-tiny", quant="int4-g32", executor="jax")
        assert again.generate("564+894=", cfg).token_ids == want
    assert calls  # (traced in the executor's programs)


_ON_A_MESH = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["DLM_JAX_QUANT_KERNEL"] = "pallas"
sys.path.insert(0, sys.argv[1])
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from test_quant_kernel import numpy_product
from dlm_jax._partition import EXPERT, KV_HEADS, MODEL, leaf_axes
from dlm_jax.executors.sharding import collective_bytes
from dlm_jax.models import _attention_kernel, _quant_kernel
from dlm_jax.models._tracing import expert_mesh
from dlm_jax.models.quant import quantize_kernel, quantized_matmul

calls = []
call = _quant_kernel._call
_quant_kernel._call = lambda x, q, *a, **k: calls.append([list(x.shape), list(q.shape)]) or call(x, q, *a, **k)
rng = np.random.default_rng(0)
out = []
for grid, name, mode in [((1, 1, 2), "layers.0.attn.q_proj", "int8-g16"),  # column-parallel
                         ((1, 1, 2), "layers.0.attn.o_proj", "int4-g16"),  # row-parallel: partial sums added
                         ((2, 1, 2), "layers.1.ffn.down_proj", "uint4"),  # rows over dp too; [O] scales whole
                         ((2, 1, 2), "layers.1.ffn.down_proj", "int4-g16-act"),  # the map split, the scales whole
                         ((1, 1, 4), "layers.0.attn.o_proj", "int8-g32"),  # 2 groups over 4 devices: XLA's form
                         ((1, 1, 2), None, "int8-g16")]:  # a product the rules do not name: XLA's form
    mesh = Mesh(np.asarray(jax.devices()[:int(np.prod(grid))]).reshape(grid), ("dp", "ep", "tp"))
    axes = {MODEL: ("tp", grid[2]), EXPERT: ("ep", 1), KV_HEADS: ("tp", grid[2])}
    act = mode.endswith("-act")
    q, scale, zero = quantize_kernel(jnp.asarray(rng.standard_normal((64, 96)), jnp.float32), mode=mode)
    g_idx = jnp.asarray(rng.permutation(np.arange(64) // 16), jnp.int32) if act else None
    x = jnp.asarray(rng.standard_normal((4, 3, 64)), jnp.float32)
    put = lambda leaf, a: None if a is None else jax.device_put(a, NamedSharding(mesh, P(*leaf_axes(
        f"{name}.{leaf}", a.shape, axes, act_order=act))))
    args = [put("qkernel", q), put("scale", scale), put("zero", zero), put("g_idx", g_idx)]

    def product(x, *w):
        with expert_mesh(mesh, "psum", (axes, act)):
            return quantized_matmul(x, *w, jnp.float32, name=name)

    calls.clear()
    with _attention_kernel.interpret():
        fn = jax.jit(product)
        got = np.asarray(fn(x, *args))
        hlo = fn.lower(x, *args).compile().as_text()
    err = float(np.abs(got - numpy_product(x.reshape(-1, 64), q, scale, zero, g_idx).reshape(got.shape)).max())
    out.append({"calls": calls[:], "err": err, "collectives": collective_bytes(hlo)})
print(json.dumps(out))
"""


def test_on_a_mesh_each_device_runs_the_kernel_over_its_shards():
    """On 4 host devices (a process of its own: this one keeps one device), a product of
    parameters placed by the partition rules runs the kernel under `shard_map`, each device over
    its shards: a column-parallel q projection over its columns (no collective), row-parallel o
    and down projections over their rows, their float32 partial products summed by one
    all-reduce of the output (and nothing else: no weights gathered), rows over dp too, uint4's
    per-channel scales and an act-order map's whole scales; NumPy's product each time. Shards
    the kernel cannot take (2 groups of rows over 4 devices) and a product the rules do not name
    stay in XLA's form."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(here.parents[1])}
    proc = subprocess.run([sys.executable, "-c", _ON_A_MESH, str(here)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert max(c["err"] for c in cases) < 1e-4, [c["err"] for c in cases]
    # each device's x [rows, I] and weights [1, I, O]: columns halved, rows halved (and x's rows over dp)
    assert [c["calls"] for c in cases] == [[[[12, 64], [1, 64, 48]]], [[[12, 32], [1, 32, 96]]],
                                           [[[6, 32], [1, 32, 96]]], [[[6, 32], [1, 32, 96]]], [], []]
    assert cases[0]["collectives"] == {}
    for c, rows in zip(cases[1:4], (12, 6, 6)):  # one all-reduce of each device's float32 [rows, 96]
        assert c["collectives"] == {"all-reduce": {"ops": 1, "bytes": rows * 96 * 4}}, c["collectives"]

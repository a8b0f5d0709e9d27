"""The Pallas attention kernel (`dlm_jax.models._attention_kernel`, the "pallas" attention form)
against `attend` over the concatenation of cache and window, run in Pallas's interpreter (the
same blocks, loops and arithmetic as the Triton kernel a GPU compiles; no GPU here).

The silent failures guarded: a cache block's weights not rescaled when a later block raises
the running maximum, a masked column (or a block outside the rows' span) reaching a row, a grouped K/V head
read for the wrong query head, a query block written to the wrong rows, and precision lost in
bfloat16 against the split form the kernel replaces."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.models import _attention_kernel as kernel
from dlm_jax.models._transformer import attend, attend_cached


def _case(rng, *, b=2, t=32, slots=64, hkv=2, groups=2, dh=16, scale=1.0):
    q = rng.standard_normal((b, t, hkv * groups, dh)) * scale
    kc, vc = (rng.standard_normal((b, hkv, slots, dh)) for _ in range(2))
    k, v = (rng.standard_normal((b, t, hkv, dh)) for _ in range(2))
    mask = rng.random((b, t, slots + t)) < 0.5
    mask[:, :, slots:] |= np.eye(t, dtype=bool)  # every row sees itself (a row seeing nothing is padding)
    return q, kc, vc, k, v, mask


def _reference(q, kc, vc, k, v, mask):
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, np.concatenate([kc.swapaxes(1, 2), k], 1),
                                                 np.concatenate([vc.swapaxes(1, 2), v], 1))]
    return np.asarray(attend(*f32, jnp.asarray(mask)))


def _kernel(q, kc, vc, k, v, mask, dtype=jnp.float32):
    cache = (None, None) if kc is None else (jnp.asarray(kc, dtype), jnp.asarray(vc, dtype))
    with kernel.interpret():
        out = jax.jit(lambda *a: kernel.attend_kernel(*a))(jnp.asarray(q, dtype), *cache, jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                                           jnp.asarray(mask))  # (traced anew: `tiled`)
    return np.asarray(out.astype(jnp.float32))


# (cache blocks of 16; a group of 2 or 4 query heads a K/V head is one program's, 3 is not)
@pytest.mark.parametrize("groups, t, slots", [(1, 32, 112), (2, 48, 80), (4, 48, 80), (3, 32, 48)])
def test_the_kernel_is_attention_over_the_concatenation(groups, t, slots):
    """float32: several query blocks (T 48: three of 16) and cache blocks, grouped heads, the
    first and last blocks of cache slots and one in the middle seen by no row (the first two
    outside the rows' span, not read), a row that sees no cache slot, a batch row whose cache
    is all unread, a padding row that sees nothing at all (finite, not compared); masked cache
    columns poisoned change nothing."""
    rng = np.random.default_rng(groups)
    q, kc, vc, k, v, mask = _case(rng, t=t, slots=slots, groups=groups)
    mask[:, :, :16] = mask[:, :, slots - 16:slots] = mask[:, :, 32:48] = False
    mask[0, 3, :slots] = False
    mask[1, :, :slots] = False
    mask[0, 5] = False  # a padding row
    out = _kernel(q, kc, vc, k, v, mask)
    assert np.isfinite(out).all()
    seeing = mask.any(-1)  # [B, T]
    np.testing.assert_allclose(out[seeing], _reference(q, kc, vc, k, v, mask)[seeing], rtol=2e-5, atol=2e-5)
    poisoned = kc.copy()
    unseen = ~mask[:, :, :slots].any(1)  # [B, S]
    poisoned.transpose(0, 2, 1, 3)[unseen] = 1e4
    np.testing.assert_allclose(_kernel(q, poisoned, vc, k, v, mask), out, rtol=1e-6, atol=1e-6)
    # Values outside the span are never read: not even a NaN reaches the output (one inside it,
    # masked, would: its weight 0 times NaN).
    outside = vc.copy()
    outside[:, :, :16] = outside[:, :, slots - 16:] = np.nan
    np.testing.assert_allclose(_kernel(q, kc, outside, k, v, mask), out, rtol=1e-6, atol=1e-6)


def test_the_span_is_each_query_block_s_first_to_last_seen_cache_block():
    mask = np.zeros((2, 32, 64), bool)  # 2 query blocks of 16, 4 cache blocks of 16
    mask[0, 3, 20] = mask[0, 9, 50] = True  # batch row 0, query block 0: blocks 1 and 3
    mask[0, 20, 0] = True  # query block 1: block 0
    mask[1, 31, 63] = True  # batch row 1, query block 1: block 3; its query block 0 sees none
    span = np.asarray(kernel.cache_span(jnp.asarray(mask), 16, 16))
    np.testing.assert_array_equal(span, [[[1, 4], [0, 1]], [[0, 0], [3, 4]]])


def test_a_later_block_with_larger_scores_rescales_the_earlier_ones():
    """Scores that grow block by block (each block's maximum above the last): every earlier
    block's weights must fade by exp(old max - new max), or they dominate the output."""
    rng = np.random.default_rng(3)
    q, kc, vc, k, v, mask = _case(rng, t=16, slots=64, groups=1)
    kc = kc * np.repeat(np.arange(1, 5), 16)[None, None, :, None]  # scores grow with the block
    mask[:] = True
    np.testing.assert_allclose(_kernel(q, kc, vc, k, v, mask), _reference(q, kc, vc, k, v, mask), rtol=2e-5, atol=2e-5)


def test_the_window_alone():
    """No cache (a refresh): the window's own attention, several blocks of its columns."""
    rng = np.random.default_rng(4)
    q, _, _, k, v, mask = _case(rng, t=64, slots=0)
    empty = np.zeros((2, 2, 0, 16))
    np.testing.assert_allclose(_kernel(q, None, None, k, v, mask), _reference(q, empty, empty, k, v, mask),
                               rtol=2e-5, atol=2e-5)


def test_in_bfloat16_the_kernel_is_as_close_to_float32_as_the_split_form():
    """bfloat16 operands, float32 scores and sums: the kernel's error against float32 attention
    within 1.15x the split form's (`attend_cached`, the GPU default it would replace)."""
    rng = np.random.default_rng(5)
    for scale in (0.5, 2.0):  # flat to peaked weights
        q, kc, vc, k, v, mask = _case(rng, t=32, slots=192, dh=64, scale=scale)
        ref = _reference(q, kc, vc, k, v, mask)
        ours = np.abs(_kernel(q, kc, vc, k, v, mask, jnp.bfloat16) - ref).mean()
        bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, kc, vc, k, v)]
        split = np.asarray(jax.jit(attend_cached, static_argnames="heads_first")(
            *bf, jnp.asarray(mask), heads_first=True).astype(jnp.float32))
        assert ours <= 1.15 * np.abs(split - ref).mean(), (scale, ours, np.abs(split - ref).mean())


def _traced(tiling, *args):
    """The pallas_call's grid as traced under `tiling`, and the shapes its kernel's operations
    make (a cache block's keys are [block_k, Dh])."""
    with kernel.interpret(), kernel.tiled(tiling):
        jaxpr = jax.make_jaxpr(lambda *a: kernel.attend_kernel(*a))(*args)  # (a new function: traced anew)
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    shapes, todo = set(), [call.params["jaxpr"]]
    while todo:
        for e in todo.pop().eqns:
            shapes |= {tuple(getattr(v.aval, "shape", ())) for v in e.outvars}
            todo += [j.jaxpr if hasattr(j, "jaxpr") else j for j in jax.extend.core.jaxprs_in_params(e.params)]
    return tuple(call.params["grid_mapping"].grid), shapes


@pytest.mark.parametrize("tiling", [kernel.Tiling(rows=16, stacked_rows=32, block_k=16),
                                    kernel.Tiling(rows=32, stacked_rows=64, block_k=128, warps=8, stages=2)],
                         ids=["small", "wide"])
def test_another_tiling_is_the_same_attention_over_other_blocks(tiling):
    """A tiling the kernel sweep times (`benchmarks/kernel_sweep.py`) is attention over the
    concatenation as the default is, over its own blocks: the grid follows its rows (a program
    of one head, or of 4 stacked), the cache blocks it reads follow block_k."""
    rng = np.random.default_rng(7)
    for groups, default_grid in ((1, (2, 2, 1)), (4, (2, 2, 2))):  # (T 64: 64 rows, or 4 heads x 32 positions)
        q, kc, vc, k, v, mask = _case(rng, t=64, slots=256, groups=groups)
        mask[0, :, :128] = False  # the first half outside batch row 0's span
        args = [jnp.asarray(x) for x in (q, kc, vc, k, v, mask)]
        grid, shapes = _traced(kernel.DEFAULT_TILING, *args)
        assert grid == default_grid and (64, 16) in shapes
        rows = tiling.rows if groups == 1 else max(16, tiling.stacked_rows // groups)  # (16 positions at least)
        grid, shapes = _traced(tiling, *args)
        assert grid == (2, 2, 64 // rows) and (tiling.block_k, 16) in shapes
        with kernel.tiled(tiling):
            out = _kernel(q, kc, vc, k, v, mask)
        np.testing.assert_allclose(out, _reference(q, kc, vc, k, v, mask), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="block_k=24"):
        kernel.Tiling(block_k=24)
    with pytest.raises(ValueError, match="warps=3"):
        kernel.Tiling(warps=3)


def test_shapes_the_kernel_does_not_take_are_refused_and_fits_says_so():
    """Triton loads powers of two, products at least 16 wide: a window of 24 rows, 40 cache
    slots or a head dim of 8 does not fit (the model keeps the split form for them)."""
    assert kernel.fits(32, 64, 128) and kernel.fits(48, 0, 16) and kernel.fits(384, 512, 128)
    assert not kernel.fits(24, 64, 128) and not kernel.fits(32, 40, 128) and not kernel.fits(32, 64, 8)
    rng = np.random.default_rng(6)
    q, kc, vc, k, v, mask = _case(rng, t=16, slots=40)
    with pytest.raises(ValueError, match="T=16, S=40, Dh=16"):
        _kernel(q, kc, vc, k, v, mask)


_ON_A_MESH = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from test_attention_kernel import _case, _reference
from dlm_jax.models import _attention_kernel as kernel
from dlm_jax.models._transformer import attend

worst = 0.0
for grid, b in [((2, 1, 2), 2), ((1, 1, 2), 3), ((4, 1, 1), 4)]:  # tp=2,dp=2; tp=2 (3 rows: whole); dp=4
    mesh = Mesh(np.asarray(jax.devices()[:int(np.prod(grid))]).reshape(grid), ("dp", "ep", "tp"))
    case = _case(np.random.default_rng(sum(grid)), b=b, t=32, slots=48, hkv=2, groups=2)
    q, kc, vc, k, v, mask = (jnp.asarray(x) for x in case)
    with kernel.interpret():
        out = jax.jit(lambda *a: kernel.attend_kernel(*a, mesh=mesh))(q, kc, vc, k, v, mask)
        window = jax.jit(lambda q, k, v, m: kernel.attend_kernel(q, None, None, k, v, m, mesh=mesh))
        own = window(q, k, v, mask[:, :, 48:])
    worst = max(worst, float(np.abs(np.asarray(out) - _reference(*case)).max()),
                float(np.abs(own - attend(q, k, v, mask[:, :, 48:])).max()))
tp4 = Mesh(np.asarray(jax.devices()).reshape(1, 1, 4), ("dp", "ep", "tp"))
try:
    kernel.attend_kernel(q, kc, vc, k, v, mask, mesh=tp4)
    refused = ""
except ValueError as e:
    refused = str(e)
print(worst, kernel.shards(tp4, 2), kernel.shards(tp4, 4), kernel.shards(None, 3), refused, sep="|")
"""


@pytest.mark.slow  # (7 s: a process of 4 host devices; the decode on a mesh in the kernel is slow too)
def test_on_a_mesh_each_device_runs_the_kernel_over_its_rows_and_heads():
    """On 4 host devices (a process of its own: this one keeps one device), the kernel under
    `shard_map` on tp=2,dp=2, tp=2 with rows dp cannot split, and dp=4 meshes, grouped heads (4
    query heads over 2 K/V heads: each tp device must read its own K/V head): attention over
    the concatenation, and over the window alone. A tp that does not divide the K/V heads is
    refused (`shards` says so, and `Attention` keeps the split form there)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(here.parents[1])}
    proc = subprocess.run([sys.executable, "-c", _ON_A_MESH, str(here)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst, tp4_gqa, tp4_mha, one, refused = proc.stdout.strip().splitlines()[-1].split("|")
    assert float(worst) < 2e-5
    assert (tp4_gqa, tp4_mha, one) == ("False", "True", "True")
    assert refused == "the attention kernel on a mesh needs tp to divide the K/V heads; got tp=4, 2 K/V heads"

"""Attention over the resident K/V cache in place (the GPU-step issue, item 1).

A decode's step on the JAX executor reads its K/V where they lie: every slot of the
[L, B, Hkv, S, Dh] cache, the slots it does not read masked (`slot_reads`), the cache and the
window scored apart and joined by one softmax (`attend_cached`), with no gathered [L, B, P]
copy and no concatenation of cache and window. The silent failures guarded here: a slot the
step must not read leaking into a row's attention (a wrong mask over the full cache), a
`hide` column landing on the wrong slot after re-indexing, a window key dropped or counted
twice, and the in-place step drifting from the gathered step it replaces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.models._transformer import attend, attend_cached, attend_cudnn_cached, merge_attention
from dlm_jax.runtime.buckets import BucketKey, pad_axis
from dlm_jax.runtime.step import SlotStep
from dlm_jax.testing import cudnn_stand_in, sharp_model, xla_cudnn_part


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_split_attention_is_attention_over_the_concatenation(heads_first, groups):
    """`attend_cached` against `attend` over [cache; window] (the concatenated form), float32."""
    rng = np.random.default_rng(1 + groups)
    b, t, p, hkv, dh = 2, 5, 11, 2, 8
    h = hkv * groups
    q = rng.standard_normal((b, t, h, dh)).astype(np.float32)
    kc, vc = (rng.standard_normal((b, p, hkv, dh)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, hkv, dh)).astype(np.float32) for _ in range(2))
    mask = rng.random((b, t, p + t)) < 0.6
    mask[:, :, p:] |= np.eye(t, dtype=bool)  # every row sees itself (a row seeing nothing is padding)
    ref = attend(jnp.asarray(q), jnp.concatenate([kc, k], 1), jnp.concatenate([vc, v], 1), jnp.asarray(mask))
    cache = (kc.swapaxes(1, 2), vc.swapaxes(1, 2)) if heads_first else (kc, vc)
    out = attend_cached(jnp.asarray(q), *map(jnp.asarray, cache), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask),
                        heads_first=heads_first)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-6, atol=2e-6)
    # A masked cache column changes nothing: poison it.
    poisoned = kc.copy()
    poisoned[~mask.any(1)[:, :p]] = 1e4
    cache = (poisoned.swapaxes(1, 2), vc.swapaxes(1, 2)) if heads_first else (poisoned, vc)
    again = attend_cached(jnp.asarray(q), *map(jnp.asarray, cache), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask),
                          heads_first=heads_first)
    np.testing.assert_allclose(np.asarray(again), np.asarray(out), rtol=1e-6, atol=1e-6)


def test_split_attention_over_an_empty_cache_is_the_window_s_attention():
    """No cache columns (P = 0): the softmax's parts are the window's alone."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 4, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 4, 2, 8)), jnp.float32) for _ in range(2))
    mask = jnp.asarray((rng.random((2, 4, 4)) < 0.6) | np.eye(4, dtype=bool))
    for heads_first in (False, True):
        empty = jnp.zeros((2, 2, 0, 8) if heads_first else (2, 0, 2, 8), jnp.float32)
        out = attend_cached(q, empty, empty, k, v, mask, heads_first=heads_first)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(attend(q, k, v, mask)))


def test_split_attention_in_bfloat16_is_as_close_to_float32_as_the_concatenated_form():
    """In bfloat16 the split form (its value products over the unnormalized weights, divided
    by the softmax's sum after, in float32) strays from the float32 attention no further than
    the concatenated form does: normalizing after the products costs no precision."""
    rng = np.random.default_rng(5)
    b, t, p, hkv, g, dh = 2, 32, 200, 2, 2, 64
    for scale in (0.5, 1.5, 3.0):  # flat to peaked weights
        q = rng.standard_normal((b, t, hkv * g, dh)) * scale
        kc, vc = (rng.standard_normal((b, p, hkv, dh)) for _ in range(2))
        k, v = (rng.standard_normal((b, t, hkv, dh)) for _ in range(2))
        mask = rng.random((b, t, p + t)) < 0.8
        mask[:, :, p:] |= np.eye(t, dtype=bool)
        ref = attend(*(jnp.asarray(x, jnp.float32) for x in (q, np.concatenate([kc, k], 1), np.concatenate([vc, v], 1))),
                     jnp.asarray(mask))
        qb, kcb, vcb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, kc, vc, k, v))
        split = jax.jit(attend_cached)(qb, kcb, vcb, kb, vb, jnp.asarray(mask))
        concat = attend(qb, jnp.concatenate([kcb, kb], 1), jnp.concatenate([vcb, vb], 1), jnp.asarray(mask))
        err = {name: np.abs(np.asarray(out.astype(jnp.float32)) - np.asarray(ref)) for name, out in
               (("split", split), ("concat", concat))}
        assert split.dtype == jnp.bfloat16 and err["split"].mean() > 0  # bfloat16 arithmetic, not float32's
        assert err["split"].mean() <= 1.15 * err["concat"].mean(), (scale, err["split"].mean(), err["concat"].mean())
        assert err["split"].max() <= 2 * err["concat"].max(), (scale, err["split"].max(), err["concat"].max())


def test_joint_rope_rotates_q_and_k_as_each_apart_and_only_for_an_accelerator(monkeypatch):
    """`joint_rope`: q's and k's heads rotated by one RoPE op give the logits and the window's K
    that rotating each apart gives (float32; grouped heads, partial rotary, QK-norm). The
    executor's steps take it where it builds for one accelerator (`JaxExecutor.one_rope`), and
    not for a CPU, whose bits stay as they were."""
    from flax import nnx

    from dlm_jax.executors._compile import building_for
    from dlm_jax.models import _transformer
    from dlm_jax.models._transformer import joint_rope
    from dlm_jax.testing import tiny_model

    model = tiny_model(seed=4, n_heads=4, n_kv_heads=2, partial_rotary_factor=0.5, qk_norm=True)
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 60, (2, 12)), jnp.int32)
    apart = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
    with joint_rope():
        joint = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)  # a new function: traced here
    np.testing.assert_allclose(np.asarray(joint.logits), np.asarray(apart.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(joint.k), np.asarray(apart.k), rtol=1e-6, atol=1e-6)

    rotated = []  # the head counts each RoPE op rotates
    rope = _transformer.apply_rope
    monkeypatch.setattr(_transformer, "apply_rope", lambda x, cos, sin: rotated.append(x.shape[2]) or rope(x, cos, sin))

    def heads(executor: JaxExecutor) -> list[int]:
        rotated.clear()
        program, specs = executor._build(executor.capabilities.select(batch=1, window=8, cache=0, rows=8))
        jax.make_jaxpr(program)(*specs)  # traced as its compile traces it
        return sorted(set(rotated))

    assert heads(JaxExecutor(model)) == [2, 4]  # a CPU (this machine's backend): each apart
    with building_for("gpu"):
        assert heads(JaxExecutor(model)) == [6]


@pytest.fixture(scope="module")
def model():
    return sharp_model()


def _random_step(executor: JaxExecutor, rng, *, batch: int, slots: int, window: int) -> SlotStep:
    """A step over a decode of `slots` slots: a window of `window` slots, a random subset of
    the others read in random order (per-row read lengths), a probe row and hidden columns in
    both the cache and the window part."""
    caps = executor.capabilities
    perm = rng.permutation(slots)
    win, others = np.sort(perm[:window]), perm[window:]
    read = others[: max(1, int(0.7 * len(others)))]
    key = BucketKey(caps.batches.select(batch), caps.windows.select(window), caps.caches.select(len(read)),
                    caps.rows.select(window))
    b, w = key.batch, key.window
    read_len = rng.integers(1, len(read) + 1, size=b).astype(np.int32)
    hide = np.full(w, -1, np.int32)
    hide[0] = rng.integers(0, len(read))  # a cache column
    hide[1] = key.cache + window - 1  # a window column
    probes = np.zeros(w, bool)
    probes[2] = True
    write = np.full((b, w), -1, np.int32)
    write[:, 3] = win[3]  # one row stores its K/V
    return SlotStep(key=key, tokens=pad_axis(rng.integers(0, executor.config.vocab_size, (b, window)).astype(np.int32), w,
                                             axis=1),
                    positions=pad_axis(np.broadcast_to(win.astype(np.int32), (b, window)).copy(), w, axis=1),
                    q_valid=pad_axis(np.ones((b, window), bool), w, axis=1, value=False),
                    read=pad_axis(read.astype(np.int32), key.cache, axis=0, value=-1), probes=probes, hide=hide,
                    write=write, logit_rows=pad_axis(np.broadcast_to(np.arange(window, dtype=np.int32), (b, window)).copy(),
                                                     key.rows, axis=1),
                    read_len=read_len)


def _filled_cache(executor: JaxExecutor, rng, batch: int, slots: int):
    """A decode's cache with random K/V in every slot (as a decode's earlier steps leave it)."""
    positions = np.broadcast_to(np.arange(slots, dtype=np.int32), (batch, slots))
    cache = executor.open(executor.config, positions, np.ones_like(positions, bool))
    cache.k = tuple(jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)) for x in cache.k)
    cache.v = tuple(jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)) for x in cache.v)
    cache.written = jnp.ones_like(cache.written)
    return cache


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_place_step_equals_the_gathered_step(model, seed):
    """The same step, from the same cache, with the read slots gathered first (the step as it
    was) and read in place: the same predictions (float32, to rounding) and the same cache after."""
    rng = np.random.default_rng(seed)
    slots, batch = 40, 2
    gathered, in_place = JaxExecutor(model, attention="gather"), JaxExecutor(model, attention="split")
    req = _random_step(gathered, rng, batch=batch, slots=slots, window=9)
    state = rng.bit_generator.state
    outs, caches = [], []
    for executor in (gathered, in_place):
        rng.bit_generator.state = state  # the same cache contents for both
        cache = _filled_cache(executor, rng, req.key.batch, slots)
        outs.append(cache.step(req))
        caches.append((np.stack(cache.k), np.stack(cache.v)))
    a, b = outs
    np.testing.assert_array_equal(a.top_token, b.top_token)
    for name in ("top_prob", "second_prob", "entropy"):
        np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=1e-5, atol=1e-6, err_msg=name)
    stored = np.zeros(caches[0][0].shape[3], bool)
    stored[req.write[req.write >= 0]] = True
    for x, y in zip(caches[0], caches[1]):  # slots not written: untouched, bit for bit
        np.testing.assert_array_equal(x[:, :, :, ~stored], y[:, :, :, ~stored])
        np.testing.assert_allclose(y[:, :, :, stored], x[:, :, :, stored], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("groups", [pytest.param(1, marks=pytest.mark.slow), 2])  # (2: grouped heads, the harder pairing)
def test_cudnn_split_attention_is_attention_over_the_concatenation(groups):
    """`attend_cudnn_cached` (a fused attention over the cache where it lies and one over the
    window, merged by their log-sum-exps) against `attend` over [cache; window], float32, with
    JAX's XLA attention standing in for cuDNN's (no GPU here): rows that see no cache slot
    among them, and masked cache columns poisoned."""
    rng = np.random.default_rng(11 + groups)
    b, t, p, hkv, dh = 2, 5, 11, 2, 8
    q = rng.standard_normal((b, t, hkv * groups, dh)).astype(np.float32)
    kc, vc = (rng.standard_normal((b, p, hkv, dh)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, hkv, dh)).astype(np.float32) for _ in range(2))
    mask = rng.random((b, t, p + t)) < 0.6
    mask[:, :, p:] |= np.eye(t, dtype=bool)  # every row sees itself
    mask[0, 1, :p] = False  # a row that sees no cache slot
    mask[1, :, :p] = False  # a batch row whose cache is all unread (its weight 0, not a share)
    ref = attend(jnp.asarray(q), jnp.concatenate([kc, k], 1), jnp.concatenate([vc, v], 1), jnp.asarray(mask))

    def run(k_cache):
        return attend_cudnn_cached(jnp.asarray(q), jnp.asarray(k_cache.swapaxes(1, 2)), jnp.asarray(vc.swapaxes(1, 2)),
                                   jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), part=xla_cudnn_part)

    out = run(kc)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    poisoned = kc.copy()
    poisoned[~mask.any(1)[:, :p]] = 1e4
    np.testing.assert_allclose(np.asarray(run(poisoned)), np.asarray(out), rtol=1e-6, atol=1e-6)


def test_merged_attention_of_rows_that_see_nothing_is_finite():
    """Where neither part sees a key (a padding row), the merge is finite, as `attend`'s
    output is, and no part's non-finite output reaches a row that gives it no weight."""
    out, lse = jnp.ones((1, 1, 3, 4)), jnp.zeros((1, 1, 3))
    blind = (jnp.full((1, 1, 3, 4), jnp.nan), jnp.full((1, 1, 3), -2.38e38))  # cuDNN's masked score, bf16's
    merged = merge_attention([(out, lse), blind])
    np.testing.assert_array_equal(np.asarray(merged), np.ones((1, 1, 3, 4), np.float32))
    both = merge_attention([(out, jnp.full((1, 1, 3), -2.38e38)), (2 * out, jnp.full((1, 1, 3), -2.38e38))])
    np.testing.assert_allclose(np.asarray(both), np.full((1, 1, 3, 4), 1.5, np.float32))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_cudnn_split_step_equals_the_split_step(model, seed):
    """The executor's step in the "cudnn_split" form (the resident cache given to the fused
    attention as it lies) against the "split" step, from the same cache: the same predictions
    to float32 rounding. JAX's XLA attention stands in for cuDNN's kernel, which needs a GPU
    (the executor refuses the form elsewhere, so the test sets it after construction); the
    layouts, masks and the merge are the executor's own."""
    rng = np.random.default_rng(seed)
    slots = 40
    split, fused = JaxExecutor(model, attention="split"), JaxExecutor(model, attention="split")
    fused.attention = "cudnn_split"
    req = _random_step(split, rng, batch=2, slots=slots, window=9)
    state = rng.bit_generator.state
    outs = []
    for executor in (split, fused):
        rng.bit_generator.state = state
        with cudnn_stand_in():  # (the step compiles inside)
            outs.append(_filled_cache(executor, rng, req.key.batch, slots).step(req))
    a, b = outs
    np.testing.assert_array_equal(a.top_token, b.top_token)
    for name in ("top_prob", "second_prob", "entropy"):
        np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_pallas_step_equals_the_split_step(seed):
    """The executor's step in the "pallas" form (one kernel a layer over the resident cache as
    it lies, run in Pallas's interpreter: no GPU here, and the executor refuses the form
    elsewhere, so the test sets it after construction) against the "split" step from the same
    cache: the same predictions to float32 rounding. Head dim 16 and a window of 16 rows over
    96 slots, shapes the kernel takes (the fixture's head dim, 8, it does not)."""
    from dlm_jax.models import _attention_kernel

    wide = sharp_model(head_dim=16)
    rng = np.random.default_rng(seed)
    slots = 40
    split, kernel = JaxExecutor(wide, attention="split"), JaxExecutor(wide, attention="split")
    kernel.attention = "pallas"
    req = _random_step(split, rng, batch=2, slots=slots, window=16)
    assert _attention_kernel.fits(req.key.window, split.capacity(slots), 16)
    state = rng.bit_generator.state
    outs = []
    for executor in (split, kernel):
        rng.bit_generator.state = state
        with _attention_kernel.interpret():  # (the step compiles inside)
            outs.append(_filled_cache(executor, rng, req.key.batch, slots).step(req))
    a, b = outs
    np.testing.assert_array_equal(a.top_token, b.top_token)
    for name in ("top_prob", "second_prob", "entropy"):
        np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=1e-5, atol=1e-6, err_msg=name)


def test_an_unread_slot_does_not_reach_the_step(model):
    """Poisoning every slot the step does not read (nor the row's read length admits) leaves
    the in-place step's predictions unchanged."""
    rng = np.random.default_rng(5)
    slots = 40
    executor = JaxExecutor(model, attention="split")
    req = _random_step(executor, rng, batch=2, slots=slots, window=9)
    state = rng.bit_generator.state
    cache = _filled_cache(executor, rng, req.key.batch, slots)
    clean = cache.step(req)
    rng.bit_generator.state = state
    cache = _filled_cache(executor, rng, req.key.batch, slots)
    seen = np.zeros((req.key.batch, cache.slots), bool)
    for row, n in enumerate(req.read_len):
        cols = req.read[row, :n]
        seen[row, cols[cols >= 0]] = True
    poison = np.where(seen[None, :, None, :, None], np.stack(cache.k), np.float32(1e3))
    cache.k = tuple(jnp.asarray(x.astype(cache.k[0].dtype)) for x in poison)
    dirty = cache.step(req)
    np.testing.assert_array_equal(clean.top_token, dirty.top_token)
    np.testing.assert_allclose(dirty.top_prob, clean.top_prob, rtol=1e-5, atol=1e-6)


def test_the_in_place_step_copies_no_cache(model):
    """The compiled in-place step holds no gather or concatenation of the cache: its traced
    program reads the layers' [B, Hkv, S, Dh] buffers only through the score and value products and
    the scatter of the window's rows (the controls: the gathered step holds a gather of them,
    the in-place "concat" form a concatenation of cache and window keys). The gathered step
    scores its copy joined with the window's keys, as bundles are traced: over a copy the split
    form only adds ops (llada-tiny's batch-1 dual step ran 1.14x as long in it on a CPU)."""
    rng = np.random.default_rng(0)
    texts, keys = {}, {}
    for form in ("split", "gather", "concat"):
        executor = JaxExecutor(model, attention=form, rows="batched")
        req = _random_step(executor, rng, batch=2, slots=40, window=9)
        cap = executor.capacity(40)
        fn, specs, kw = executor._build_resident((req.key, cap))
        texts[form] = jax.jit(fn, **kw).lower(*specs).as_text()
        keys[form] = (req.key.cache if form == "gather" else cap) + req.key.window  # key columns attended
        cfg = model.config
        cache_type = f"tensor<{req.key.batch}x{cfg.n_kv_heads}x{cap}x{cfg.head_dim}x"  # one layer's K or V
    gathers = {f: [ln for ln in t.splitlines() if "gather" in ln and cache_type in ln.split("->")[0]]
               for f, t in texts.items()}
    assert gathers["gather"], "the control holds no gather of the cache: the check is blind"
    assert not gathers["split"], gathers["split"][:2]
    # A [B, keys, Hkv, Dh] result: cache and window keys (or values) joined, not scores.
    concats = {f: [ln for ln in t.splitlines() if "concatenate" in ln and ln.rstrip().endswith(
        f"tensor<{req.key.batch}x{keys[f]}x{cfg.n_kv_heads}x{cfg.head_dim}xf32>")] for f, t in texts.items()}
    assert concats["concat"], "the control joins no keys: the check is blind"
    assert concats["gather"], "the gathered step scores its copy in the split form"
    assert not concats["split"], concats["split"][:2]


def test_the_compiled_step_updates_the_cache_without_copying_it(model, monkeypatch):
    """The step the executor compiles writes its window's K/V into the donated cache where it
    lies. Guards a silent cost: XLA:CPU's copy insertion, by default, copies a donated buffer
    that a program both reads and updates, twice (every layer's [B, Hkv, S, Dh] cache, every
    step, about as many bytes as the weights of a small model); the executor compiles with
    region analysis (`_compile.CPU_COMPILER_OPTIONS`), which drops those copies. The control,
    compiled without it, holds them (or the check would be blind); JAX 0.11's XLA:CPU copies
    none there either, and the control is then a program that must copy a layer's buffer."""
    from dlm_jax.executors import _compile
    from dlm_jax.executors._compile import jit_options

    # With the default pass's faster XLA flags (tests/conftest.py), the classic emitters copy
    # the cache: these programs compile with XLA's default emitters, as users' do (jaxlib 0.11
    # has no others, and no such option).
    from importlib.metadata import version

    default = {"xla_cpu_use_fusion_emitters": True} if tuple(map(int, version("jaxlib").split(".")[:2])) < (0, 11) else {}
    for name, value in default.items():
        monkeypatch.setitem(_compile.CPU_COMPILER_OPTIONS, name, value)

    executor = JaxExecutor(model, attention="split", rows="batched")
    req = _random_step(executor, np.random.default_rng(0), batch=2, slots=40, window=9)
    spec = (req.key, executor.capacity(40))
    cfg = model.config
    shape = f"f32[{req.key.batch},{cfg.n_kv_heads},{spec[1]},{cfg.head_dim}]"  # one layer's K or V

    def copies(text: str) -> list[str]:
        return [ln.strip()[:120] for ln in text.splitlines() if f"= {shape}" in ln and " copy(" in ln]

    fn, specs, kw = executor._build_resident(spec)
    assert "compiler_options" not in kw
    # The control (`default`): XLA's defaults.
    if not copies(jax.jit(fn, **kw, compiler_options=default).lower(*specs).compile().as_text()):  # (JAX 0.11: none to drop)
        keep = jax.jit(lambda x: (x.at[:, :, 0].set(1.0), x), donate_argnums=0, compiler_options=default)  # the update beside the donated original
        layer = jax.ShapeDtypeStruct((req.key.batch, cfg.n_kv_heads, spec[1], cfg.head_dim), jnp.float32)
        assert copies(keep.lower(layer).compile().as_text()), "a copy the check does not see: blind"
    assert not copies(jax.jit(fn, **jit_options(kw, "cpu")).lower(*specs).compile().as_text())
    assert not copies(executor._resident.get(spec).as_text())  # what the executor itself compiled


@pytest.mark.parametrize("name", [pytest.param("fast-dllm", marks=pytest.mark.slow), "fast-dllm-dual",
                                  pytest.param("llada-cpp", marks=pytest.mark.slow)])
def test_in_place_decodes_the_gathered_tokens(model, name):
    """Whole decodes (the CPU's default reads gathered slots, an accelerator's reads in place):
    the same tokens and NFE either way, for a prefix cache, a dual cache and DPPR's CPU path.
    In place, every step that reads the cache runs in one read bucket, the cache's slots
    (`JaxExecutor.read_bucket`): a prefix cache's growing reads, which the gathered form runs
    in a bucket each, compile one program."""
    from dlm_jax.runtime import Decoder, preset

    cfg = preset(name, gen_len=64)
    prompts = [[5, 17, 3, 44, 9, 21, 30], [8, 1]]
    executors = [JaxExecutor(model, attention=a) for a in ("gather", "split")]
    outs = [Decoder(e, model.config).decode(prompts, cfg, seeds=[0, 1]) for e in executors]
    for a, b in zip(outs[0].sequences, outs[1].sequences):
        np.testing.assert_array_equal(a, b)
    assert outs[0].stats.nfe == outs[1].stats.nfe
    gathered, in_place = ({spec[0].cache for spec in e._resident.keys} - {0} for e in executors)
    slots = executors[1].capacity(len(prompts[0]) + cfg.gen_len)
    assert in_place == {slots}, in_place
    if name == "fast-dllm":  # the prefix grows a block a block: more than one read bucket gathered
        assert len(gathered) > 1 and max(gathered) < slots, gathered


@pytest.mark.slow  # (3 s; the default pass checks one read bucket in place above, on the dual cache)
def test_in_place_decodes_of_other_prompt_lengths_share_one_read_bucket(model):
    """Decodes whose prompts fall in other read buckets, on a cache of the same slots: read in
    place, every step that reads the cache runs in the cache's slots as its read bucket
    (`JaxExecutor.read_bucket`), so the later decodes' steps over the cache run the first
    one's program, with the gathered form's tokens; gathered, a new read bucket is a new
    program. (A refresh's window spans prompt and generation: a new window is a new program
    either way.)"""
    from dlm_jax.runtime import Decoder, preset

    cfg = preset("fast-dllm", gen_len=32)  # one block: a step reads the prompt's slots
    batches = [[[5, 17, 3, 44, 9, 21, 30]], [list(range(1, 41))]]  # read buckets 32 and 64
    compiled = {}
    for attention in ("gather", "split"):
        executor = JaxExecutor(model, attention=attention)
        decoder, read_buckets = Decoder(executor, model.config), []
        for prompts in batches:
            compiled.setdefault(tuple(map(tuple, prompts)), []).append(decoder.decode(prompts, cfg).sequences)
            read_buckets.append(sorted({k.cache for k in executor.compiled_keys} - {0}))
        (slots,) = {executor.capacity(len(p[0]) + cfg.gen_len) for p in batches}  # one cache size
        if attention == "gather":  # not blind: a new read bucket compiles
            assert read_buckets == [[32], [32, 64]], read_buckets
        else:
            assert read_buckets == [[slots]] * 2, read_buckets
    for gathered, in_place in compiled.values():
        np.testing.assert_array_equal(gathered, in_place)


@pytest.mark.parametrize("name", ["fast-dllm-dual", pytest.param("fast-dllm", marks=pytest.mark.slow)])
def test_the_pallas_form_decodes_the_split_tokens(name, monkeypatch):
    """A whole decode (random weights, head dim 16: many steps) with the attention kernel in
    Pallas's interpreter, its refreshes (the window alone) and cached steps included: the
    split form's tokens and NFE. Blocks of 32 over 96 slots, shapes the kernel takes."""
    from dlm_jax.models import _attention_kernel
    from dlm_jax.runtime import Decoder, preset

    model = sharp_model(head_dim=16)
    cfg = preset(name, gen_len=64)
    prompts = [[5, 17, 3, 44, 9, 21, 30], [8, 1]]
    split, kernel = JaxExecutor(model, attention="split"), JaxExecutor(model, attention="split")
    kernel.attention = "pallas"
    traced = []  # (cache slots of each kernel traced: 0 for a refresh's window alone)
    real = _attention_kernel.attend_kernel
    monkeypatch.setattr(_attention_kernel, "attend_kernel", lambda q, kc, *rest, **kw: (
        traced.append(0 if kc is None else kc.shape[2]) or real(q, kc, *rest, **kw)))
    want = Decoder(split, model.config).decode(prompts, cfg)
    assert not traced
    with _attention_kernel.interpret():
        got = Decoder(kernel, model.config).decode(prompts, cfg)
    assert 0 in traced and any(traced), traced  # refreshes and cached steps both took the kernel
    np.testing.assert_array_equal(got.sequences, want.sequences)
    assert got.stats.nfe == want.stats.nfe


def test_an_unknown_attention_is_refused_naming_where_it_came_from(model, monkeypatch):
    from dlm_jax._errors import ConfigError

    with pytest.raises(ConfigError, match=r"^attention='flash': known split, concat, cudnn, cudnn_split, pallas, gather$"):
        JaxExecutor(model, attention="flash")
    monkeypatch.setenv("DLM_JAX_ATTENTION", "flash")
    with pytest.raises(ConfigError, match=r"^DLM_JAX_ATTENTION='flash': known split"):
        JaxExecutor(model)
    if jax.default_backend() != "gpu":  # guards a CPU accepting cudnn, then failing inside its first compile
        monkeypatch.setenv("DLM_JAX_ATTENTION", "cudnn")
        with pytest.raises(ConfigError, match=r"^DLM_JAX_ATTENTION='cudnn': cuDNN's fused attention runs on a GPU"):
            JaxExecutor(model)
        with pytest.raises(ConfigError, match=r"^attention='cudnn_split': cuDNN's fused attention runs on a GPU"):
            JaxExecutor(model, attention="cudnn_split")
        with pytest.raises(ConfigError, match=r"^attention='pallas': the attention kernel is compiled by Triton for a "
                                              r"GPU, and JAX's backend here is 'cpu'; use split or gather$"):
            JaxExecutor(model, attention="pallas")


def test_the_kernel_asked_for_where_it_would_never_run_is_refused(monkeypatch):
    """Built for a GPU: a head dim the kernel cannot load, or a mesh whose tp does not divide the
    K/V heads, would leave every step in the split form; asked for by name, it is refused in one
    line (before the mesh is placed: no devices needed). A shape it takes builds."""
    from dlm_jax._errors import ConfigError
    from dlm_jax.executors._compile import building_for
    from dlm_jax.testing import tiny_model

    with building_for("gpu"):
        with pytest.raises(ConfigError, match=r"^attention='pallas': the attention kernel takes head dims of 16-256 "
                                              r"\(a power of two\), and this model's is 24; use split$"):
            JaxExecutor(tiny_model(head_dim=24), attention="pallas")
        grouped = tiny_model(head_dim=16)  # (4 query heads over 2 K/V heads)
        monkeypatch.setenv("DLM_JAX_ATTENTION", "pallas")
        with pytest.raises(ConfigError, match=r"^DLM_JAX_ATTENTION='pallas': the attention kernel on a mesh needs tp "
                                              r"to divide the K/V heads, and tp=4 does not divide this model's 2; "
                                              r"use split$"):
            JaxExecutor(grouped, mesh="tp=4")
        assert JaxExecutor(grouped).attention == "pallas"

"""The JAX executor's layers under `jax.lax.scan` (`JaxExecutor(model, layers="scan")`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlm_jax
import dlm_jax.testing
from dlm_jax._errors import ConfigError
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.models._scan import LAYERS_ENV, ScannedTransformer, StackedLayers
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.techniques.isd.lora import LoraSpec, attach_lora
from dlm_jax.techniques.tide.split import split_experts
from dlm_jax.testing import tiny_model

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]


def _twins(**overrides):
    """Two equal random models (the same seed): one stays unrolled, one gets stacked."""
    cfg = dict(eos_token_id=None, n_layers=3, **overrides)
    return tiny_model(seed=1, **cfg), tiny_model(seed=1, **cfg)


def _forward_inputs(cfg, *, cache: int = 6, window: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    b = 2
    kv = (cfg.n_layers, b, cache, cfg.n_kv_heads, cfg.head_dim)
    vis = rng.random((b, window, cache + window)) > 0.2
    vis[:, :, cache:] = True
    return dict(tokens=jnp.asarray(rng.integers(0, cfg.vocab_size - 8, (b, window)), jnp.int32),
                positions=jnp.asarray(np.broadcast_to(np.arange(cache, cache + window), (b, window)), jnp.int32),
                mask=jnp.asarray(vis), k_cache=jnp.asarray(rng.standard_normal(kv), jnp.float32),
                v_cache=jnp.asarray(rng.standard_normal(kv), jnp.float32))


@pytest.mark.slow  # (4 s; scanned layers are opt-in, and the default pass decodes the same tokens with them below)
def test_scanned_forward_matches_the_unrolled_one_and_the_model_keeps_working():
    """Guards a scanned step that silently differs from the unrolled one (a block fed the
    wrong layer's cache or weights gives plausible but wrong logits), and a model left
    unusable after its layers were stacked (lm-eval and calibration call it directly)."""
    ref, model = _twins()
    scanned = ScannedTransformer(model)
    inputs = _forward_inputs(ref.config)
    want = ref(**inputs, logit_rows=jnp.asarray([[0, 2, 4]] * 2, jnp.int32))
    for got in (scanned(**inputs, logit_rows=jnp.asarray([[0, 2, 4]] * 2, jnp.int32)),
                model(**inputs, logit_rows=jnp.asarray([[0, 2, 4]] * 2, jnp.int32))):
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.k, want.k, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got.v, want.v, rtol=1e-6, atol=1e-6)
    assert isinstance(model.layers, StackedLayers) and len(model.layers) == 3
    np.testing.assert_allclose(model(inputs["tokens"]).logits, ref(inputs["tokens"]).logits, rtol=1e-5, atol=1e-5)
    graphdef, state = nnx.split(model)  # as lm-eval runs it: split, jitted, merged in the trace
    jitted = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t).logits)
    np.testing.assert_allclose(jitted(state, inputs["tokens"]), ref(inputs["tokens"]).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache, dtype", [pytest.param("prefix", "float32", marks=pytest.mark.slow), ("dual", "float32"),
                                          pytest.param("dual", "bfloat16", marks=pytest.mark.slow)])
def test_scanned_executor_decodes_the_same_tokens(cache, dtype):
    """Guards the resident step (gather, step, scatter of the window K/V) over stacked
    layers: the same tokens as the unrolled executor, batch of two prompts of different
    lengths, with the per-layer K/V written back where the next step reads them (in
    bfloat16 too, where a carry of another dtype would fail the scan)."""
    ref, model = _twins(dtype=dtype, param_dtype=dtype)
    cfg = dlm_jax.decode_config(gen_len=24, block_len=8, cache=cache, rule="threshold", threshold=0.9)
    want = Decoder(JaxExecutor(ref), ref.config).decode(PROMPTS, cfg)
    ex = JaxExecutor(model, layers="scan")
    got = Decoder(ex, model.config).decode(PROMPTS, cfg)
    assert ex.layers == "scan"
    np.testing.assert_array_equal(got.sequences, want.sequences)
    assert got.stats.nfe == want.stats.nfe > 3  # several steps, reading the cache


@pytest.mark.slow
def test_scanned_executor_runs_a_cpu_path_fork_the_same():
    """Guards llada.cpp's CPU path (a fork of the executor stepping over gathered slots,
    `views`) over stacked layers: the same tokens as unrolled."""
    ref, model = _twins()
    cfg = dlm_jax.preset("llada-cpp", gen_len=16, block_len=8)
    want = Decoder(JaxExecutor(ref), ref.config).decode(PROMPTS, cfg)
    dec = Decoder(JaxExecutor(model, layers="scan"), model.config)
    got = dec.decode(PROMPTS, cfg)
    np.testing.assert_array_equal(got.sequences, want.sequences)
    assert got.stats.nfe == want.stats.nfe and got.stats.counters == want.stats.counters
    assert got.stats.counters["refresh_steps"] > 0 and dec.cpu_executor().executor._views.keys  # the path ran


def test_stacking_leaves_one_copy_of_the_layer_weights():
    """Guards a scanned executor that keeps the per-layer arrays alive beside the stacked
    ones: two device copies of the model's weights for the life of the executor."""
    model = tiny_model(seed=0)
    before = [leaf for block in model.layers for leaf in jax_leaves(block)]
    JaxExecutor(model, layers="scan")
    assert all(leaf.is_deleted() for leaf in before)
    stacked = jax_leaves(model.layers)
    assert sum(x.size for x in stacked) == sum(x.size for x in before)


def jax_leaves(module):
    return jax.tree.leaves(nnx.state(module))


@pytest.mark.slow
def test_stacking_keeps_an_array_that_backs_parameters_elsewhere():
    """Guards stacking deleting an array that other parameters still hold (`model_from_params`
    keeps a device array as it is, so one can back every norm scale, the final norm's too):
    the final norm was deleted and the model left half stacked."""
    cfg = dlm_jax.testing.tiny_config(eos_token_id=None)
    params = dlm_jax.get_params(tiny_model(seed=2, eos_token_id=None))
    ones = jnp.ones((cfg.d_model,), jnp.float32)
    shared = {k: (ones if k.endswith("norm.scale") else v) for k, v in params.items()}
    dcfg = dlm_jax.decode_config(gen_len=8, block_len=8, cache="dual")
    plain = dlm_jax.model_from_params(cfg, shared)
    want = Decoder(JaxExecutor(plain), cfg).decode([[3, 4, 5]], dcfg).sequences
    model = dlm_jax.model_from_params(cfg, shared)
    ex = JaxExecutor(model, layers="scan", projections="fused")
    assert not ones.is_deleted()
    np.testing.assert_array_equal(Decoder(ex, cfg).decode([[3, 4, 5]], dcfg).sequences, want)


def test_adapters_and_expert_slots_are_refused_on_stacked_layers():
    """Guards `attach_lora` / `split_experts` writing into the temporary blocks a stack hands
    out (silently dropped: the executor then ran without them)."""
    model = tiny_model()
    JaxExecutor(model, layers="scan")
    with pytest.raises(ConfigError, match="^attach_lora: the model's layers are stacked for a scan"):
        attach_lora(model, LoraSpec(rank=2, alpha=4.0, targets=("q_proj",)))
    moe = tiny_model(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16)
    JaxExecutor(moe, layers="scan")
    with pytest.raises(ConfigError, match="^split expert execution of a model whose layers are stacked"):
        split_experts(moe, moe.config.moe_layers, 2)


def test_scan_is_refused_with_its_reason_and_falls_back_under_the_environment(monkeypatch):
    """Guards mixed MoE / dense layers stacked into one structure (a crash deep in the
    scan, or silently wrong weights), and adapters or expert slots that would stop reaching
    the stacked weights; under `$DLM_JAX_LAYERS` such a model runs unrolled."""
    mixed = dict(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16, dense_layers=(0,))
    with pytest.raises(ConfigError, match=r"layers 0 and 1 differ in structure \(DenseFFN / MoEFFN\)"):
        JaxExecutor(tiny_model(**mixed), layers="scan")
    with pytest.raises(ConfigError, match="layers='sideways': expected one of unrolled, scan"):
        JaxExecutor(tiny_model(), layers="sideways")
    lora = attach_lora(tiny_model(), LoraSpec(rank=2, alpha=4.0, targets=("q_proj",)))
    with pytest.raises(ConfigError, match="LoRA adapters are attached to its layers: use layers='unrolled'"):
        JaxExecutor(lora, layers="scan")
    split = tiny_model(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16)
    split_experts(split, split.config.moe_layers, 2)
    with pytest.raises(ConfigError, match=r"split experts \(expert_slots\) are placed one layer at a time"):
        JaxExecutor(split, layers="scan")
    monkeypatch.setenv(LAYERS_ENV, "scan")
    with pytest.warns(UserWarning, match="DLM_JAX_LAYERS=scan: layers 0 and 1 differ"):
        assert JaxExecutor(tiny_model(**mixed)).layers == "unrolled"
    assert JaxExecutor(tiny_model()).layers == "scan"


@pytest.mark.slow  # (4 s; scanned layers are opt-in, and the default pass decodes with them above)
def test_scanned_moe_reports_the_same_routed_experts():
    """Guards the routed experts of a scanned MoE model (TIDE's placement reads them): the
    per-layer top-k stacked in layer order, as the unrolled model gives them."""
    moe = dict(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16)
    ref, model = _twins(**moe)
    scanned = ScannedTransformer(model)
    inputs = _forward_inputs(ref.config)
    want, got = ref(**inputs, router_topk=True), scanned(**inputs, router_topk=True)
    np.testing.assert_array_equal(got.router_topk, want.router_topk)
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_a_stacked_model_saves_the_checkpoint_of_the_unstacked_one(tmp_path):
    """Guards a checkpoint saved from a model whose layers an executor stacked: names of the
    stack (`layers.block.*`, [L, ...]) instead of each layer's, which no loader reads back."""
    ref, model = _twins()
    JaxExecutor(model, layers="scan")
    want, got = dlm_jax.get_params(ref), dlm_jax.get_params(model)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    dlm_jax.save_pretrained(model, tmp_path / "ckpt")
    back = dlm_jax.load_pretrained(tmp_path / "ckpt")
    np.testing.assert_allclose(back(jnp.asarray([[3, 4, 5]])).logits, ref(jnp.asarray([[3, 4, 5]])).logits,
                               rtol=1e-6, atol=1e-6)


def test_the_environment_picks_scan_for_load_but_not_beside_the_bundle_cache(monkeypatch, tmp_path):
    """Guards `$DLM_JAX_LAYERS=scan` stacking a model that the default CPU executor's bundle
    cache then exports from (its layers are exported one by one, from the unstacked model),
    and the variable not reaching `dlm_jax.load` (the GPU benchmark picks scan through it)."""
    from dlm_jax.api import EXECUTORS

    from dlm_jax.models._fuse import PROJECTIONS_ENV, is_fused

    monkeypatch.setenv(LAYERS_ENV, "scan")
    monkeypatch.setenv(PROJECTIONS_ENV, "fused")
    model = tiny_model()
    auto = EXECUTORS["jax-then-litert"](model, source="")
    assert auto.jax.layers == "unrolled" and not isinstance(model.layers, StackedLayers)
    assert auto.jax.projections == "separate" and not is_fused(model)
    monkeypatch.delenv(PROJECTIONS_ENV)
    ckpt = dlm_jax.testing.tiny_checkpoint(tmp_path / "ckpt")
    loaded = dlm_jax.load(ckpt, executor="jax")
    assert loaded.executor.layers == "scan" and isinstance(loaded.model.layers, StackedLayers)

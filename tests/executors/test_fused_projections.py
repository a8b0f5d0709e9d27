"""Fused projections (`dlm_jax.models._fuse`, `JaxExecutor(model, projections="fused")`): q/k/v
and gate/up each one GEMM, with the same outputs, the same saved parameters and the weights
held once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax._errors import ConfigError
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.models._fuse import PROJECTIONS_ENV, fuse_projections, is_fused
from dlm_jax.models._params import _abstract_model
from dlm_jax.models.quant import QuantLinear, quantize
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.techniques.isd.lora import LoraSpec, attach_lora, remove_lora
from dlm_jax.testing import tiny_config, tiny_model

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
VARIANTS = {
    "swiglu, GQA, q/k/v biases": dict(qkv_bias=True),
    "reglu": dict(ffn="reglu"),
    "relu (nothing to fuse in the FFN)": dict(ffn="relu"),
    "MoE with a shared expert": dict(ffn="moe", n_experts=4, n_experts_per_tok=2, n_shared_experts=1,
                                     moe_ffn_hidden=16),
}


@pytest.mark.parametrize("name, quant", [(name, None) for name in VARIANTS] + [
    ("swiglu, GQA, q/k/v biases", "int8"), ("MoE with a shared expert", "int8"),
    ("swiglu, GQA, q/k/v biases", "uint4-g8"),  # (zero points beside the scales)
    ("MoE with a shared expert", "int4-g8-act")])  # (act-order maps, equal: held once)
def test_a_fused_model_computes_and_saves_what_it_did_before(name, quant):
    """Guards a fused linear that mixes up its parts (q's columns read as k's: plausible but
    wrong logits), drops a bias or a quantization scale, and a fused model whose checkpoint or
    fingerprint changes (`get_params` must name and hold the projections as before)."""
    overrides = VARIANTS[name]
    ref, model = tiny_model(seed=1, **overrides), tiny_model(seed=1, **overrides)
    if quant:
        quantize(ref, quant), quantize(model, quant)
    before = dlm_jax.get_params(model)
    kernels = [lin.qkernel[...] if quant else lin.kernel[...] for lin in (model.layers[0].attn.q_proj,
                                                                           model.layers[0].attn.k_proj)]
    fused = fuse_projections(model)
    dense_ffn = overrides.get("ffn") in (None, "swiglu", "reglu", "moe")  # MoE: its shared expert
    assert fused == model.config.n_layers * (2 if dense_ffn else 1) and is_fused(model)
    assert model.layers[0].attn.q_proj is None and all(k.is_deleted() for k in kernels)  # held once
    if quant:
        assert isinstance(model.layers[0].attn.qkv_proj, QuantLinear)
        assert (model.layers[0].attn.qkv_proj.zero is not None) == quant.startswith("uint4")
        assert (model.layers[0].attn.qkv_proj.g_idx is not None) == quant.endswith("-act")
    after = dlm_jax.get_params(model)
    assert sorted(after) == sorted(before)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 60, (2, 12)), jnp.int32)
    np.testing.assert_allclose(model(tokens).logits, ref(tokens).logits, rtol=1e-5, atol=1e-5)
    assert fuse_projections(model) == 0  # fused once


def test_quantizing_after_fusing_is_quantizing_before():
    """Guards `quantize` skipping the fused linears (they would stay float: no memory saved)
    or scaling them per fused kernel instead of per output channel."""
    first, second = tiny_model(seed=2), tiny_model(seed=2)
    quantize(first, "int8")
    fuse_projections(first)
    fuse_projections(second)
    quantize(second, "int8")
    a, b = dlm_jax.get_params(first), dlm_jax.get_params(second)
    assert sorted(a) == sorted(b) and any(v.dtype == np.int8 for v in a.values())
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_an_abstract_model_fuses_into_the_shapes_of_the_real_one():
    """Guards `benchmarks/gpu_step.py --abstract --projections fused`: the 8B programs are lowered
    from a model of shapes alone, which must fuse into the shapes a loaded model fuses into."""
    cfg = tiny_config(qkv_bias=True)
    abstract = _abstract_model.__wrapped__(cfg)  # a fresh one: fusing changes it in place
    real = tiny_model(qkv_bias=True)
    fuse_projections(abstract), fuse_projections(real)
    shapes = lambda m: {p: (v.get_value().shape, v.get_value().dtype)  # noqa: E731
                        for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    assert shapes(abstract) == shapes(real)
    assert any("qkv_proj" in ".".join(map(str, p)) for p in shapes(real))


@pytest.mark.parametrize("name, cache", [("llada-tiny", "dual"), pytest.param("llada-tiny", "prefix",
                                                                               marks=pytest.mark.slow),
                                         pytest.param("moe-tiny", "dual", marks=pytest.mark.slow)])
def test_the_fused_executor_decodes_the_shipped_models_to_the_same_tokens(monkeypatch, name, cache):
    """Guards the executor path (`$DLM_JAX_PROJECTIONS`, as the CLI and the server read it) end to
    end: the resident steps over fused weights give the shipped models' tokens."""
    want = dlm_jax.load(f"models/{name}", executor="jax")
    monkeypatch.setenv(PROJECTIONS_ENV, "fused")
    got = dlm_jax.load(f"models/{name}", executor="jax")
    assert got.executor.projections == "fused" and is_fused(got.model)
    assert want.executor.projections == "separate"
    prompts = [want.tokenizer.encode(p) for p in ("The capital of France is", "2 + 2 =")]
    cfg = dlm_jax.decode_config(gen_len=32, block_len=8, cache=cache, rule="threshold", threshold=0.9)
    a = Decoder(want.executor, want.config).decode(prompts, cfg)
    b = Decoder(got.executor, got.config).decode(prompts, cfg)
    np.testing.assert_array_equal(b.sequences, a.sequences)
    assert b.stats.nfe == a.stats.nfe


def test_lora_gates_run_over_fused_projections():
    """Guards the R-ISD adapters of a fused model (each part its own gated delta; adapters on
    the wrong part would change the gated rows only), and new adapters on a fused model."""
    cfg = dict(eos_token_id=None, n_layers=2)
    ref, model = tiny_model(seed=3, **cfg), tiny_model(seed=3, **cfg)
    for m in (ref, model):
        attach_lora(m, LoraSpec(rank=2))
        for _, owner in nnx.iter_modules(m):  # nonzero deltas: a fresh adapter's B is zero
            for adapter in (getattr(owner, "lora", None) or {}).values():
                adapter.lora_b[...] = jax.random.normal(jax.random.key(7), adapter.lora_b[...].shape) * 0.5
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 60, (2, 9)), jnp.int32)
    gate = jnp.asarray(np.random.default_rng(2).random((2, 9)) > 0.5, jnp.float32)
    fuse_projections(model)
    np.testing.assert_allclose(model(tokens, lora_gate=gate).logits, ref(tokens, lora_gate=gate).logits,
                               rtol=1e-5, atol=1e-5)
    remove_lora(model)
    with pytest.raises(ConfigError, match="fused"):
        attach_lora(model, LoraSpec(rank=2))


@pytest.mark.slow
def test_scanned_layers_run_over_fused_projections():
    """Guards fusing before stacking for a scan (the executor fuses, then stacks)."""
    cfg = dict(eos_token_id=None, n_layers=2)
    plain, fused = tiny_model(seed=4, **cfg), tiny_model(seed=4, **cfg)
    dcfg = dlm_jax.decode_config(gen_len=16, block_len=8, cache="dual", rule="threshold", threshold=0.9)
    want = Decoder(JaxExecutor(plain), plain.config).decode(PROMPTS, dcfg)
    ex = JaxExecutor(fused, layers="scan", projections="fused")
    assert (ex.layers, ex.projections) == ("scan", "fused")
    np.testing.assert_array_equal(Decoder(ex, fused.config).decode(PROMPTS, dcfg).sequences, want.sequences)


def test_fused_projections_are_refused_in_one_line_where_they_cannot_run(monkeypatch):
    """Guards a mesh silently running fused weights its partition rules do not name, and an
    unknown setting passing unnoticed."""
    with pytest.raises(ConfigError, match="^projections='fused': fused projections on a mesh are not built"):
        JaxExecutor(tiny_model(), projections="fused", mesh="tp=1")
    model = tiny_model()
    fuse_projections(model)  # fused before: it runs fused whatever is asked
    assert JaxExecutor(model, projections="separate").projections == "fused"
    with pytest.raises(ConfigError, match="^projections='merged': expected"):  # checked even then
        JaxExecutor(model, projections="merged")
    with pytest.raises(ConfigError, match="^this model's projections were fused in place by an executor built before"):
        JaxExecutor(model, mesh="tp=1")
    monkeypatch.setenv(PROJECTIONS_ENV, "fused")
    with pytest.raises(ConfigError, match=f"^{PROJECTIONS_ENV}=fused: fused projections on a mesh"):
        JaxExecutor(tiny_model(), mesh="tp=1")
    monkeypatch.setenv(PROJECTIONS_ENV, "merged")
    with pytest.raises(ConfigError, match=f"{PROJECTIONS_ENV}='merged': expected one of separate, fused"):
        JaxExecutor(tiny_model())


def test_a_refused_executor_leaves_its_model_as_it_was():
    """Guards the model being fused for good by a constructor that then refused (a bad
    `layers`, or scan over adapters): it would then refuse meshes and adapters."""
    model = tiny_model()
    with pytest.raises(ConfigError, match="layers='bogus'"):
        JaxExecutor(model, projections="fused", layers="bogus")
    gated = tiny_model()
    attach_lora(gated, LoraSpec(rank=2))
    with pytest.raises(ConfigError, match="layers='scan' needs every layer of one structure"):
        JaxExecutor(gated, projections="fused", layers="scan")
    assert not is_fused(model) and not is_fused(gated)


@pytest.mark.parametrize("change", [dict(projections="fused"),
                                    pytest.param(dict(layers="scan"), marks=pytest.mark.slow)])  # (one mechanism)
def test_an_executor_whose_model_a_later_one_changed_in_place_refuses_to_run(change):
    """Guards an executor decoding over arrays a later executor over the same model deleted
    (fusing and stacking join them in place): it must refuse in one line, not crash on a deleted
    array, while the later one decodes; an executor that changed nothing leaves the others be."""
    model = tiny_model(qkv_bias=True, eos_token_id=None)
    dcfg = dlm_jax.decode_config(gen_len=8, block_len=8)
    first = JaxExecutor(model)
    want = Decoder(first, model.config).decode(PROMPTS, dcfg).sequences
    np.testing.assert_array_equal(Decoder(JaxExecutor(model), model.config).decode(PROMPTS, dcfg).sequences, want)
    later = JaxExecutor(model, **change)
    with pytest.raises(ConfigError, match="^this JAX executor's weights are gone: a JAX executor built later over the same "
                                          "model (fused its projections|stacked its layers) in place"):
        Decoder(first, model.config).decode(PROMPTS, dcfg)
    np.testing.assert_array_equal(Decoder(later, model.config).decode(PROMPTS, dcfg).sequences, want)
    again = JaxExecutor(model, **change)  # changes nothing now: `later` keeps running
    assert (again.projections, again.layers) == (later.projections, later.layers)
    np.testing.assert_array_equal(Decoder(later, model.config).decode(PROMPTS, dcfg).sequences, want)


def test_a_model_fused_then_stacked_takes_another_executor():
    model = tiny_model()
    JaxExecutor(model, layers="scan", projections="fused")
    ex = JaxExecutor(model, layers="scan")
    assert (ex.projections, ex.layers) == ("fused", "scan")


def test_code_that_walks_the_checkpoint_layout_refuses_a_changed_model():
    """Guards the LiteRT export and the NPU calibration silently skipping (or crashing on) the
    q/k/v and gate/up linears of a fused model, or walking stacked or quantized layers."""
    from dlm_jax.runtime.buckets import BucketKey
    from dlm_jax.techniques.powerinfer.npu_quant import activation_stats
    from dlm_jax.tflite_export.bundle import export_bundle

    for model, why in ((tiny_model(), "its projections are fused"), (tiny_model(), "its layers are stacked"),
                       (quantize(tiny_model(), "int8"), "its weights are quantized")):
        if why.endswith("fused"):
            fuse_projections(model)
        elif why.endswith("stacked"):
            JaxExecutor(model, layers="scan")
        with pytest.raises(ConfigError, match=f"^export_bundle\\(model=...\\): {why}"):
            export_bundle("unused", "unused", keys=[BucketKey(1, 8, 0, 8)], decode=dlm_jax.decode_config(gen_len=8, block_len=8),
                          model=model)
        with pytest.raises(ConfigError, match=f"^activation statistics name the checkpoint's linears, and {why}"):
            activation_stats(model, [[1, 2, 3]])


def test_act_order_projections_fuse_only_where_their_maps_are_equal():
    """Guards fused act-order linears reading every part's rows through one part's map (q's
    groups for k's rows): q/k/v whose maps differ stay separate, gate/up with equal ones fuse, and
    the model computes what it did."""
    ref, model = tiny_model(seed=6), tiny_model(seed=6)
    for m in (ref, model):
        quantize(m, "int4-g8-act")
        for block in m.layers:
            q = block.attn.q_proj
            q.g_idx = nnx.Param(q.g_idx.get_value()[::-1])  # (another map: q's rows in another order)
    assert fuse_projections(model) == model.config.n_layers  # the FFNs only
    assert model.layers[0].attn.qkv_proj is None and model.layers[0].ffn.gate_up_proj.g_idx is not None
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 60, (1, 7)), jnp.int32)
    np.testing.assert_allclose(model(tokens).logits, ref(tokens).logits, rtol=1e-5, atol=1e-5)


def test_projections_that_differ_stay_separate_and_whole():
    """Guards a group that cannot fuse (here q/k/v with biases, k's kernel stored in another
    dtype) losing its arrays to a join begun before the check (the biases joined, then the
    kernels refused): the model must run as before, that group unfused."""
    ref, model = tiny_model(seed=5, qkv_bias=True), tiny_model(seed=5, qkv_bias=True)
    for m in (ref, model):
        for block in m.layers:
            block.attn.k_proj.kernel = nnx.Param(block.attn.k_proj.kernel.get_value().astype(jnp.bfloat16))
    assert fuse_projections(model) == model.config.n_layers  # the FFNs only
    assert model.layers[0].attn.qkv_proj is None and model.layers[0].ffn.gate_up_proj is not None
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 60, (1, 7)), jnp.int32)
    np.testing.assert_allclose(model(tokens).logits, ref(tokens).logits, rtol=1e-5, atol=1e-5)

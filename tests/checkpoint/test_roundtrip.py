"""load -> save -> load gives identical tensors, in every family and in dlm-jax's own layout."""

import json

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ByteTokenizer
from dlm_jax.checkpoint import load_file
from dlm_jax.testing import tiny_config

from .hf_models import build, llama_to_llada, qwen2_to_dream


def _same_params(a, b):
    pa, pb = dlm_jax.get_params(a), dlm_jax.get_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and np.array_equal(pa[k], pb[k]), k


def _hf_checkpoint(kind, tmp_path):
    src = tmp_path / "src"
    if kind == "llada":
        build("llama").save_pretrained(tmp_path / "llama")
        llama_to_llada(tmp_path / "llama", src, mask_token_id=95)
    elif kind == "dream":
        build("qwen2").save_pretrained(tmp_path / "qwen2")
        qwen2_to_dream(tmp_path / "qwen2", src, mask_token_id=94)
    else:
        build(kind).save_pretrained(src)
    return src


@pytest.mark.parametrize("kind", ["llada", "dream", "qwen2", "llama", "qwen3", "qwen3_moe", "dots1"])
def test_family_round_trip(kind, tmp_path):
    src = _hf_checkpoint(kind, tmp_path)
    _, family = dlm_jax.load_config(src)
    first = dlm_jax.load_pretrained(src)
    dlm_jax.save_pretrained(first, tmp_path / "again", family=family.name)
    _same_params(first, dlm_jax.load_pretrained(tmp_path / "again"))
    # The tensors on disk are the original ones, under the original names.
    original, rewritten = load_file(src / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert original.keys() == rewritten.keys()
    for name in original:
        assert np.array_equal(original[name], rewritten[name]), name
    # And through dlm-jax's own layout, which keeps every setting.
    dlm_jax.save_pretrained(first, tmp_path / "native")
    native = dlm_jax.load_pretrained(tmp_path / "native")
    assert native.config == first.config
    _same_params(first, native)


def test_native_layout_keeps_every_variant_and_shards(tmp_path):
    tok = ByteTokenizer()
    cfg = tiny_config(tokenizer=tok, n_layers=3, n_kv_heads=1, attention="block_causal", logit_shift=True,
                      ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16,
                      n_shared_experts=2, router="sigmoid", router_bias=True, n_expert_groups=2,
                      topk_groups=1, dense_layers=(1,), tie_embeddings=True, qk_norm=True,
                      param_dtype="bfloat16")
    model = dlm_jax.init_model(cfg, seed=5)
    path = dlm_jax.save_pretrained(model, tmp_path / "m", tokenizer=tok, max_shard_bytes=20_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = dlm_jax.load_pretrained(path)
    assert loaded.config == cfg
    _same_params(model, loaded)
    assert isinstance(dlm_jax.load_tokenizer(path), ByteTokenizer)


def test_relu_ffn_round_trips_natively(tmp_path):
    cfg = tiny_config(ffn="relu")
    model = dlm_jax.init_model(cfg)
    dlm_jax.save_pretrained(model, tmp_path / "m")
    _same_params(model, dlm_jax.load_pretrained(tmp_path / "m"))


def test_bfloat16_checkpoint_loads_bit_exact(tmp_path):
    """Real checkpoints ship bf16: values arrive unchanged, as bf16 parameters."""
    import torch

    model = build("qwen3").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    ours = dlm_jax.load_pretrained(tmp_path / "bf16")
    assert ours.config.param_dtype == "bfloat16"
    q = dlm_jax.get_params(ours)["layers.1.attn.q_proj.kernel"]
    ref = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
    assert q.dtype.name == "bfloat16"
    np.testing.assert_array_equal(q.astype(np.float32), ref)

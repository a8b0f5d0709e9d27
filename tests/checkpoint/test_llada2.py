"""LLaDA2.0 (`llada2_moe`, remote code) checkpoints: config keys, fused q/k/v, logits parity.

LLaDA2.0 has no transformers class. transformers' Glm4Moe computes the same thing (per-head
q/k RMSNorm before RoPE, RoPE on the first half of each head, sigmoid router with a selection
bias, the top-2-sum group limit, scores renormalised (+1e-20) and scaled, a shared expert, a
leading dense layer), so a tiny random Glm4Moe rewritten in LLaDA2.0's layout
(`hf_models.glm4_moe_to_llada2`: q/k/v fused into `query_key_value`, per-expert tensors,
LLaDA2.0's names) stands for it.
"""

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax
from dlm_jax.checkpoint import CheckpointError, load_file, read_header, save_file
from dlm_jax._config import ConfigError

from .hf_models import build, glm4_moe_to_llada2, logits

TOL = 1e-4
IDS = np.random.default_rng(0).integers(0, 96, (2, 13))  # <= 32 tokens: block-causal == bidirectional
QKV = "attention.query_key_value.weight"

# The key set of inclusionAI/LLaDA2.0-mini's config.json (LLaDA2MoeConfig as serialised). No
# verbatim copy of that file was found in the public code index; the keys are those of the
# partial public copies (a loader test carrying its sizes and router keys, Ling/Bailing-MoE V2
# configs with the same LLaDA2MoeConfig attributes) and the sizes are LLaDA2.0-mini's; they
# are replaced by the tiny model's before use.
LLADA2_MINI_CONFIG = {
    "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "dtype": "bfloat16", "embedding_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "max_position_embeddings": 32768, "max_window_layers": 20, "model_type": "llada2_moe",
    "moe_intermediate_size": 512, "moe_router_enable_expert_bias": True, "n_group": 8,
    "norm_head": False, "norm_softmax": False, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 20, "num_key_value_heads": 4,
    "num_shared_experts": 1, "output_dropout": 0.0, "output_router_logits": False,
    "pad_token_id": 156892, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 600000, "rotary_dim": 64, "routed_scaling_factor": 2.5, "router_dtype": "fp32",
    "score_function": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
    "transformers_version": "4.52.3", "use_bias": False, "use_cache": False, "use_qk_norm": True,
    "use_qkv_bias": False, "use_rmsnorm": True, "using_split_qkv_in_self_attention": False,
    "vocab_size": 157184,
}


def _tiny_config(model) -> dict:
    hf = model.config
    tiny = {"hidden_size": hf.hidden_size, "num_hidden_layers": hf.num_hidden_layers,
            "num_attention_heads": hf.num_attention_heads, "num_key_value_heads": hf.num_key_value_heads,
            "head_dim": hf.head_dim, "rotary_dim": hf.head_dim // 2, "intermediate_size": hf.intermediate_size,
            "moe_intermediate_size": hf.moe_intermediate_size, "num_experts": hf.n_routed_experts,
            "num_experts_per_tok": hf.num_experts_per_tok, "n_group": hf.n_group,
            "topk_group": hf.topk_group, "num_shared_experts": hf.n_shared_experts,
            "first_k_dense_replace": hf.first_k_dense_replace, "vocab_size": hf.vocab_size,
            "max_position_embeddings": 128, "max_window_layers": hf.num_hidden_layers,
            "rms_norm_eps": hf.rms_norm_eps, "pad_token_id": 90, "dtype": "float32"}
    config = {**LLADA2_MINI_CONFIG, **tiny}
    assert config.keys() == LLADA2_MINI_CONFIG.keys()
    return config


@pytest.fixture(scope="module")
def glm():
    return build("glm4_moe")


@pytest.fixture
def ckpt(glm, tmp_path) -> Path:
    path = tmp_path / "llada2"
    glm4_moe_to_llada2(glm, path, _tiny_config(glm))
    return path


def _logits(model) -> np.ndarray:
    # One jitted program: op by op, every primitive of the MoE forward compiles alone.
    return np.asarray(jax.jit(lambda ids: model(ids).logits)(jnp.asarray(IDS, jnp.int32)))


def _check(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    diff = float(np.abs(ours - ref).max())
    print(f"parity llada2: max abs diff {diff:.3e}")
    assert diff <= TOL, f"max abs diff {diff}"


def _rewrite(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_logits_match_glm4_moe(glm, ckpt):
    """The real key set loads without a warning (every key is read or known not to matter)
    and the model computes the reference's logits; block-causal over <= 32 tokens sees all."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = dlm_jax.load_pretrained(ckpt)
        dlm_jax.load_config(ckpt, strict=True)  # no key left unread
    cfg = ours.config
    _, family = dlm_jax.load_config(ckpt)
    hf = glm.config
    assert family.name == "llada2"
    assert (cfg.attention, cfg.block_size, cfg.logit_shift) == ("block_causal", 32, False)
    assert (cfg.head_dim, cfg.partial_rotary_factor, cfg.rotary_dim, cfg.rope_theta) == (16, 0.5, 8, 600000.0)
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.norm_eps, cfg.tie_embeddings) == (True, False, 1e-6, False)
    assert (cfg.ffn, cfg.router, cfg.router_bias, cfg.n_experts, cfg.n_experts_per_tok) == (
        "moe", "sigmoid", True, hf.n_routed_experts, 2)
    assert (cfg.n_shared_experts, cfg.n_expert_groups, cfg.topk_groups, cfg.routed_scaling) == (1, 4, 2, 2.5)
    assert (cfg.norm_topk_prob, cfg.dense_layers, cfg.moe_ffn_hidden, cfg.ffn_hidden) == (True, (0,), 16, 48)
    assert (cfg.pad_token_id, cfg.mask_token_id, cfg.param_dtype) == (90, None, "float32")
    _check(_logits(ours), logits(glm, IDS, bidirectional=True))


def test_block_causal_matches_glm4_moe_with_block_mask(glm, ckpt):
    """Blocks shorter than the sequence: the reference gets the same block-causal 4D mask."""
    import torch

    mask = dlm_jax.attention_mask("block_causal", IDS.shape[1], block_size=4)
    bias = torch.where(torch.as_tensor(mask), 0.0, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = glm(torch.as_tensor(IDS), attention_mask=bias.expand(2, 1, -1, -1)).logits.numpy()
    _check(_logits(dlm_jax.load_pretrained(ckpt, block_size=4)), ref)


@pytest.mark.parametrize("key, value", [
    ("score_function", "softmax"), ("use_qkv_bias", True), ("use_bias", True), ("use_qk_norm", False),
    ("hidden_act", "gelu"), ("moe_router_enable_expert_bias", False), ("norm_head", True),
    ("using_split_qkv_in_self_attention", True), ("use_rmsnorm", False), ("rotary_dim", 16),
    ("rope_scaling", {"type": "linear", "factor": 2.0}),
])
def test_values_it_cannot_compute_are_refused_naming_the_key(ckpt, key, value):
    _rewrite(ckpt, **{key: value})
    for strict in (False, True):
        with pytest.raises(ConfigError, match=key):
            dlm_jax.load_config(ckpt, strict=strict)


def test_absent_keys_mean_the_reference_code_defaults(ckpt):
    """LLaDA2MoeConfig defaults use_bias to True (a biased output projection): refused."""
    config = json.loads((ckpt / "config.json").read_text())
    del config["use_bias"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="use_bias is missing"):
        dlm_jax.load_config(ckpt)


def test_fused_tensor_of_the_wrong_shape_is_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    name = f"model.layers.1.{QKV}"
    tensors[name] = tensors[name][:-16]  # one v head short
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        dlm_jax.load_pretrained(ckpt)
    msg = str(e.value)
    assert name in msg and "(112, 32)" in msg and "(128, 32)" in msg and "\n" not in msg


def test_missing_fused_tensor_is_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors[f"model.layers.0.{QKV}"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors \['model\.layers\.0\.attention\."
                                              r"query_key_value\.weight'\]"):
        dlm_jax.load_pretrained(ckpt)


def test_save_round_trip_in_llada2_layout(ckpt, tmp_path):
    ours = dlm_jax.load_pretrained(ckpt)
    out = dlm_jax.save_pretrained(ours, tmp_path / "out", family="llada2")
    header, _ = read_header(out / "model.safetensors")
    for i in range(2):
        assert header[f"model.layers.{i}.{QKV}"].shape == (128, 32)  # (4 + 2 * 2) heads * 16
        assert f"model.layers.{i}.attention.q_proj.weight" not in header
    assert not any("#" in name for name in header)
    # Byte for byte the tensors it was loaded from (fp32, no rounding anywhere).
    src, dst = load_file(ckpt / "model.safetensors"), load_file(out / "model.safetensors")
    assert src.keys() == dst.keys()
    assert all(np.array_equal(src[k], dst[k]) for k in src)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["rotary_dim"]) == (
        "llada2_moe", ["LLaDA2MoeModelLM"], 8)
    reloaded = dlm_jax.load_pretrained(out)
    assert reloaded.config == ours.config
    np.testing.assert_array_equal(_logits(reloaded), _logits(ours))
    # convert_checkpoint goes through the same writer; and back from dlm-jax's own layout.
    native = dlm_jax.convert_checkpoint(ckpt, tmp_path / "native")
    assert dlm_jax.load_config(native)[0].partial_rotary_factor == 0.5
    back = dlm_jax.convert_checkpoint(native, tmp_path / "back", family="llada2")
    assert load_file(back / "model.safetensors").keys() == src.keys()
    np.testing.assert_array_equal(_logits(dlm_jax.load_pretrained(back)), _logits(ours))


def test_saving_what_the_layout_cannot_hold_fails(ckpt, tmp_path):
    ours = dlm_jax.load_pretrained(ckpt, attention="bidirectional")
    with pytest.raises(ConfigError, match="attention"):
        dlm_jax.save_pretrained(ours, tmp_path / "out", family="llada2")
    assert not (tmp_path / "out").exists()


def test_generate_decodes(ckpt):
    """`dlm_jax.load` + block diffusion; config.json names no mask token, so one is given."""
    handle = dlm_jax.load(ckpt, mask_token_id=95)
    result = handle.generate([[5, 6, 7], [8, 9]], dlm_jax.preset("llada", gen_len=8, block_len=8))
    assert result.texts is None and result.stats.nfe == 8
    assert all(len(ids) <= 8 for ids in result.token_ids)
    assert all(0 <= t < 96 and t != 95 for ids in result.token_ids for t in ids)  # no mask left


def test_adapters_for_a_llada2_base(ckpt, tmp_path):
    """Adapters on o_proj and the FFN save in PEFT's layout; q/k/v are one PEFT module there
    (`query_key_value`), so adapters on them are refused by name rather than misnamed."""
    from dlm_jax.checkpoint import load_adapters, save_adapters
    from dlm_jax.techniques.isd import LoraSpec, attach_lora

    model = attach_lora(dlm_jax.load_pretrained(ckpt), LoraSpec(rank=2, alpha=4, targets=("o_proj", "gate_proj")))
    out = save_adapters(model, tmp_path / "lora", base=ckpt)
    header, _ = read_header(out / "adapter_model.safetensors")
    assert any("attention.dense.lora_A" in k for k in header) and not any("#" in k for k in header)
    load_adapters(out, dlm_jax.load_pretrained(ckpt), base=ckpt)
    qv = attach_lora(dlm_jax.load_pretrained(ckpt), LoraSpec(rank=2, alpha=4, targets=("q_proj",)))
    with pytest.raises(ConfigError, match=r"layers\.\d\.attn\.q_proj\.kernel"):
        save_adapters(qv, tmp_path / "lora_q", base=ckpt)
    assert not (tmp_path / "lora_q").exists()

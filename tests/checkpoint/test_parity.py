"""fp32 logits of checkpoints loaded by dlm-jax match `transformers` (max abs diff <= 1e-4).

Guards against silent import bugs (a transposed kernel, a swapped rotate-half, GQA heads
paired wrongly, the softmax router normalised twice): the model loads, runs, and produces
fluent-looking but wrong distributions.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax

from .hf_models import build, llama_to_llada, logits, qwen2_to_dream

TOL = 1e-4
IDS = np.random.default_rng(0).integers(0, 96, (2, 13))
FIGURES: dict[str, float] = {}


def _ours(path: Path, **overrides) -> np.ndarray:
    model = dlm_jax.load_pretrained(path, **overrides)
    return np.asarray(model(jnp.asarray(IDS, jnp.int32)).logits)


def _check(name: str, ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    diff = float(np.abs(ours - ref).max())
    FIGURES[name] = diff
    print(f"parity {name}: max abs diff {diff:.3e}")
    assert diff <= TOL, f"{name}: max abs diff {diff}"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_tied", "qwen3_moe", "dots1"])
def test_causal_families_match_transformers(kind, tmp_path):
    model = build(kind)
    model.save_pretrained(tmp_path)
    _check(kind, _ours(tmp_path), logits(model, IDS))
    cfg, _ = dlm_jax.load_config(tmp_path)
    assert (cfg.attention, cfg.logit_shift) == ("causal", True)


def test_llada_layout_matches_bidirectional_llama(tmp_path):
    """LLaDA has no transformers class: Llama run with an all-visible mask stands for it."""
    model = build("llama")
    model.save_pretrained(tmp_path / "llama")
    llama_to_llada(tmp_path / "llama", tmp_path / "llada", mask_token_id=95)
    ref = logits(model, IDS, bidirectional=True)
    _check("llada", _ours(tmp_path / "llada"), ref)
    cfg, family = dlm_jax.load_config(tmp_path / "llada")
    assert (family.name, cfg.attention, cfg.logit_shift, cfg.mask_token_id) == ("llada", "bidirectional", False, 95)
    # The same weights through the Llama layout with an attention override.
    _check("llama_bidirectional", _ours(tmp_path / "llama", attention="bidirectional"), ref)


def test_dream_layout_matches_bidirectional_qwen2(tmp_path):
    model = build("qwen2")
    model.save_pretrained(tmp_path / "qwen2")
    qwen2_to_dream(tmp_path / "qwen2", tmp_path / "dream", mask_token_id=94)
    _check("dream", _ours(tmp_path / "dream"), logits(model, IDS, bidirectional=True))
    cfg, _ = dlm_jax.load_config(tmp_path / "dream")
    assert (cfg.attention, cfg.logit_shift, cfg.qkv_bias) == ("bidirectional", True, True)


def test_block_causal_matches_transformers_with_block_mask(tmp_path):
    """Block diffusion attention: Qwen3 run with the same block-causal 4D mask."""
    import torch

    model = build("qwen3")
    model.save_pretrained(tmp_path)
    mask = dlm_jax.attention_mask("block_causal", IDS.shape[1], block_size=4)
    bias = torch.where(torch.as_tensor(mask), 0.0, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = model(torch.as_tensor(IDS), attention_mask=bias.expand(2, 1, -1, -1)).logits.numpy()
    _check("qwen3_block_causal", _ours(tmp_path, attention="block_causal", block_size=4), ref)


@pytest.mark.parametrize("kind, family", [("qwen3", "qwen3"), ("qwen2", "qwen2"), ("llama", "llama"),
                                          ("qwen3_moe", "qwen3_moe"), ("dots1", "dots1")])
def test_transformers_loads_what_dlm_jax_saves(kind, family, tmp_path):
    """Save through dlm-jax in an HF family; transformers reads it back to the same logits."""
    import transformers

    model = build(kind)
    model.save_pretrained(tmp_path / "src")
    ours = dlm_jax.load_pretrained(tmp_path / "src")
    dlm_jax.save_pretrained(ours, tmp_path / "out", family=family)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    diff = float(np.abs(logits(reloaded, IDS) - logits(model, IDS)).max())
    assert diff <= 1e-6, f"{kind}: {diff}"


# Every key of LLaDA-8B-Instruct's config.json (transformers 4.46.3), read from a copy of that
# file in a public GitHub repository (yinj66/support_basis, LLaDA-8B-Instruct-B&S-light), plus
# `train_max_sequence_length`, which some LLaDA-8B releases carry as well; the sizes below are
# replaced by the tiny Llama's before use.
LLADA_8B_INSTRUCT_CONFIG = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0, "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                 "AutoModel": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 4096,
    "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081,
    "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
    "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
    "mask_token_id": 126336, "max_sequence_length": 4096, "mlp_hidden_size": 12288, "mlp_ratio": 4,
    "model_type": "llada", "multi_query_attention": None, "n_heads": 32, "n_kv_heads": 32,
    "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
    "scale_logits": False, "train_max_sequence_length": 4096, "transformers_version": "4.46.3",
    "use_cache": False, "vocab_size": 126464, "weight_tying": False,
}


def test_real_llada_8b_config_loads_and_matches_llama(tmp_path):
    """LLaDA-8B-Instruct's own config.json key set, tiny sizes, no tokenizer files: loads with
    one warning naming the keys dlm-jax does not use, and computes bidirectional Llama."""
    import json
    import warnings

    model = build("llama")
    model.save_pretrained(tmp_path / "llama")
    llama_to_llada(tmp_path / "llama", tmp_path / "llada", mask_token_id=95)
    hf = model.config
    tiny = {"d_model": hf.hidden_size, "n_heads": hf.num_attention_heads,
            "n_kv_heads": hf.num_key_value_heads, "n_layers": hf.num_hidden_layers,
            "mlp_hidden_size": hf.intermediate_size, "vocab_size": hf.vocab_size,
            "embedding_size": hf.vocab_size, "max_sequence_length": 128,
            "train_max_sequence_length": 128, "rms_norm_eps": hf.rms_norm_eps,
            "eos_token_id": 90, "pad_token_id": 90, "mask_token_id": 95}
    config = {**LLADA_8B_INSTRUCT_CONFIG, **tiny}
    assert config.keys() == LLADA_8B_INSTRUCT_CONFIG.keys()
    (tmp_path / "llada" / "config.json").write_text(json.dumps(config, indent=2))
    assert sorted(p.name for p in (tmp_path / "llada").iterdir()) == ["config.json", "model.safetensors"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = dlm_jax.load_pretrained(tmp_path / "llada")
    assert len(caught) == 1 and caught[0].category is UserWarning
    assert "['train_max_sequence_length']" in str(caught[0].message)
    assert "config.json" in str(caught[0].message)
    cfg = ours.config
    assert (cfg.attention, cfg.logit_shift, cfg.mask_token_id, cfg.eos_token_id) == ("bidirectional", False, 95, 90)
    _check("llada_8b_config", np.asarray(ours(jnp.asarray(IDS, jnp.int32)).logits),
           logits(model, IDS, bidirectional=True))
    # ... and `dlm_jax.load` makes it a model that decodes token-id prompts without a tokenizer.
    handle = dlm_jax.load(tmp_path / "llada")
    result = handle.generate([[5, 6, 7], [8, 9]], dlm_jax.preset("llada", gen_len=8, block_len=8))
    assert result.texts is None and result.stats.nfe == 8
    assert all(0 <= t < cfg.vocab_size and t != 95 for ids in result.token_ids for t in ids)  # no mask left

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

"""Tiny random `transformers` models saved to disk: the references nobody here wrote."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers as T

from dlm_jax.checkpoint import load_file, save_file

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)

BUILDERS = {
    "llama": lambda: (T.LlamaConfig, T.LlamaForCausalLM, dict(rope_theta=500000.0)),
    "qwen2": lambda: (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": lambda: (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=16)),
    "qwen3_tied": lambda: (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=8, tie_word_embeddings=True)),
    "qwen3_moe": lambda: (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                          dict(head_dim=8, num_experts=4, norm_topk_prob=True, mlp_only_layers=[0], **MOE)),
    "dots1": lambda: (T.Dots1Config, T.Dots1ForCausalLM,
                      dict(head_dim=8, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
                           first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, **MOE)),
    # LLaDA2.0's computation (see test_llada2): head_dim != hidden / heads, half the head rotated.
    "glm4_moe": lambda: (T.Glm4MoeConfig, T.Glm4MoeForCausalLM,
                         dict(head_dim=16, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2,
                              first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                              use_qk_norm=True, rope_parameters={"rope_type": "default", "rope_theta": 600000.0,
                                                                 "partial_rotary_factor": 0.5}, **MOE)),
}


def build(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny model with every parameter and buffer randomised (biases, norms, router bias);
    `overrides` change its config."""
    config_cls, model_cls, extra = BUILDERS[kind]()
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or not p.is_floating_point():
                continue
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def logits(model: torch.nn.Module, ids: np.ndarray, *, bidirectional: bool = False) -> np.ndarray:
    """Reference logits; `bidirectional` passes an all-visible 4D mask (LLaDA/Dream style)."""
    tokens = torch.as_tensor(ids, dtype=torch.long)
    kwargs = {}
    if bidirectional:
        b, t = ids.shape
        kwargs["attention_mask"] = torch.zeros(b, 1, t, t, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens, **kwargs).logits.float().numpy()


def word_tokenizer(directory: Path, *, added: tuple[str, ...] = ("<|endoftext|>", "<mask>")) -> dict[str, int]:
    """Write a tiny word-level tokenizer.json whose ids fit the tiny models' vocabulary (w0..w89
    are 0..89, <unk> is 90, then the `added` special tokens from 91 on); returns their ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(90)}
    vocab["<unk>"] = 90
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in added])
    tok.save(str(directory / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in added}


def llama_to_llada(src: Path, dst: Path, *, mask_token_id: int) -> None:
    """Rewrite an HF Llama checkpoint in LLaDA's layout (docs/checkpoints.md, "The LLaDA layout")."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    rename = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
              "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj",
              "mlp.down_proj": "ff_out", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ff_norm"}
    out = {}
    for name, value in tensors.items():
        if name == "model.embed_tokens.weight":
            out["model.transformer.wte.weight"] = value
        elif name == "model.norm.weight":
            out["model.transformer.ln_f.weight"] = value
        elif name == "lm_head.weight":
            out["model.transformer.ff_out.weight"] = value
        else:
            _, _, i, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            out[f"model.transformer.blocks.{i}.{rename[module]}.{leaf}"] = value
    llada = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": cfg["hidden_size"],
        "n_heads": cfg["num_attention_heads"], "n_kv_heads": cfg["num_key_value_heads"],
        "n_layers": cfg["num_hidden_layers"], "mlp_hidden_size": cfg["intermediate_size"],
        "mlp_ratio": 4, "activation_type": "silu", "block_type": "llama", "rope": True,
        "rope_theta": cfg["rope_parameters"]["rope_theta"], "layer_norm_type": "rms",
        "rms_norm_eps": cfg["rms_norm_eps"], "vocab_size": cfg["vocab_size"],
        "embedding_size": cfg["vocab_size"], "weight_tying": False, "mask_token_id": mask_token_id,
        "eos_token_id": 2, "pad_token_id": 2, "max_sequence_length": 128, "include_bias": False,
        "include_qkv_bias": False, "scale_logits": False, "input_emb_norm": False,
        "attention_layer_norm": False, "alibi": False, "alibi_bias_max": 8.0,
        "attention_dropout": 0.0, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoModel": "modeling_llada.LLaDAModelLM"}, "bias_for_layer_norm": False,
        "block_group_size": 1, "embedding_dropout": 0.0, "flash_attention": False,
        "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
        "layer_norm_with_affine": True, "multi_query_attention": None, "precision": "amp_bf16",
        "residual_dropout": 0.0, "rope_full_precision": True, "torch_dtype": "float32",
        "transformers_version": "4.46.3", "use_cache": False,
    }
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(llada, indent=2))
    save_file(out, dst / "model.safetensors")


def qwen2_to_dream(src: Path, dst: Path, *, mask_token_id: int) -> None:
    """Dream ships Qwen2 tensors under `model_type: Dream` with a mask token."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(model_type="Dream", architectures=["DreamModel"], mask_token_id=mask_token_id,
               auto_map={"AutoModel": "modeling_dream.DreamModel"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def glm4_moe_to_llada2(model: torch.nn.Module, dst: Path, config: dict) -> None:
    """Write a Glm4Moe model's weights in LLaDA2.0's layout (dlm_jax.checkpoint._families) with
    `config` as config.json: q/k/v fused into `query_key_value` (rows q, k, v), the experts'
    fused gate_up split per expert, LLaDA2.0's tensor names."""
    rename = {"self_attn.o_proj": "attention.dense", "self_attn.q_norm": "attention.query_layernorm",
              "self_attn.k_norm": "attention.key_layernorm"}
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"model.word_embeddings.weight": state.pop("model.embed_tokens.weight"),
           "model.norm.weight": state.pop("model.norm.weight"), "lm_head.weight": state.pop("lm_head.weight")}
    for i in range(model.config.num_hidden_layers):
        pre = f"model.layers.{i}."
        out[pre + "attention.query_key_value.weight"] = np.concatenate(
            [state.pop(f"{pre}self_attn.{p}_proj.weight") for p in "qkv"])
        if pre + "mlp.experts.gate_up_proj" in state:
            gate_up, down = state.pop(pre + "mlp.experts.gate_up_proj"), state.pop(pre + "mlp.experts.down_proj")
            f = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                out[f"{pre}mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :f]
                out[f"{pre}mlp.experts.{e}.up_proj.weight"] = gate_up[e, f:]
                out[f"{pre}mlp.experts.{e}.down_proj.weight"] = down[e]
            out[pre + "mlp.gate.expert_bias"] = state.pop(pre + "mlp.gate.e_score_correction_bias")
    for name, value in state.items():
        module, leaf = name.rsplit(".", 1)
        for old, new in rename.items():
            module = module.replace(old, new)
        out[f"{module}.{leaf}"] = value
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, dst / "model.safetensors")


def edit_quantization_config(path: Path, **change) -> None:
    """Change keys of the checkpoint `path`'s `quantization_config` in its config.json."""
    data = json.loads((path / "config.json").read_text())
    data["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(data))


def loaded_logits(path: Path, ids: np.ndarray):
    """(model, logits) of the checkpoint `path` loaded by dlm-jax, in one jitted program (op by
    op, every primitive of an MoE forward would compile alone)."""
    import jax
    import jax.numpy as jnp

    import dlm_jax

    model = dlm_jax.load_pretrained(path)
    return model, np.asarray(jax.jit(lambda x: model(x).logits)(jnp.asarray(ids, jnp.int32)))


def reference_logits(path: Path, ids: np.ndarray, **kwargs) -> np.ndarray:
    """transformers' logits of the checkpoint `path` as its own loading reads it, in float32
    (a pre-quantized checkpoint dequantised on the CPU; `kwargs`: from_pretrained's)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kwargs)
    return logits(ref.eval(), ids)

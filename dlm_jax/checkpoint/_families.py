"""Checkpoint families: how each HF `config.json` maps onto `ModelConfig`, and back.

A family fixes what its format cannot express: the attention mode and logit shift a model of
that kind was trained with (LLaDA: bidirectional, no shift; LLaDA2.0: block-causal, no shift;
Dream: bidirectional, shift; Qwen2/Qwen3/Llama/MoE bases: causal, shift), and whether q/k
carry norms or biases. Loading may override those (`load_pretrained(path, attention=...)`);
saving into a family whose format cannot hold the model's settings fails with the field named
(`dlm_jax` holds all).

Config parsing follows transformers: keys this code does not use are ignored with one
`UserWarning` per load that lists them and the file (`strict=True` refuses them instead). Keys
that change the computation are never ignored: each family's parser reads or validates every
key of its format that does (an unsupported RoPE scaling or partial rotary factor, an enabled
sliding window, another activation, biases, logit scaling or soft-capping, a LayerNorm instead
of RMSNorm, ...), and a value dlm-jax cannot compute fails in both modes with the key named.
Where a key is absent, the value the family's reference code would then use is what is checked
(LLaDA's code, for one, defaults to no RoPE and a plain LayerNorm).

`block_size` (the block length of block-causal attention) has no key in the HF formats; it is
written as `block_size` when it differs from the default and read back from there.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from dlm_jax._config import ConfigError, ModelConfig
from dlm_jax.checkpoint._names import HF_SCHEME, LLADA2_SCHEME, LLADA_SCHEME, NameScheme

FORMAT_VERSION = 1
_UNSET = object()
_DEFAULT_BLOCK_SIZE: int = ModelConfig.__dataclass_fields__["block_size"].default

# Keys HF configs carry that do not change the forward pass in inference.
_HF_IRRELEVANT = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "attention_dropout", "output_router_logits", "router_aux_loss_coef",
    "auto_map", "_name_or_path", "max_window_layers", "sliding_window", "return_dict",
    "output_hidden_states", "output_attentions", "id2label", "label2id", "tokenizer_class",
    "bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id",
})
# Keys that change the computation where transformers (or remote code under an HF model_type)
# reads them, with the values that do not; a config carrying one with another value is refused.
_HF_NEUTRAL: dict[str, list[Any]] = {
    "partial_rotary_factor": [1.0, None], "attn_logit_softcapping": [None],
    "final_logit_softcapping": [None], "logit_scale": [None, 1.0], "logits_scaling": [None, 1.0],
    "embedding_multiplier": [None, 1.0], "residual_multiplier": [None, 1.0],
    "attention_multiplier": [None], "query_pre_attn_scalar": [None], "use_mrope": [False, None],
    "shared_expert_intermediate_size": [None, 0],
}
_LLADA_IRRELEVANT = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "auto_map", "_name_or_path", "alibi_bias_max", "attention_dropout", "embedding_dropout",
    "residual_dropout", "flash_attention", "init_device", "init_fn", "init_std",
    "init_cutoff_factor", "precision", "attention_layer_norm_with_affine", "rope_full_precision",
    "mlp_ratio", "bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id",
})


class _Reader:
    """Reads a config dict, remembering which keys were used, to reject the rest."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data, self.source, self.used = data, source, set()

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.data.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.data:
            raise ConfigError(f"{self.source}: required key {key!r} is missing")
        return self.get(key)

    def expect(self, key: str, allowed: Iterable[Any], *, absent: Any = _UNSET) -> None:
        """The key must hold one of `allowed` (else dlm-jax would compute wrongly). Where it is
        missing, `absent` (what the format's reference code then uses) must be allowed."""
        self.used.add(key)
        allowed = list(allowed)
        if key in self.data:
            value = self.data[key]
            if value not in allowed or (isinstance(value, bool) and not any(
                    isinstance(a, bool) and a == value for a in allowed)):
                raise ConfigError(
                    f"{self.source}: {key}={value!r} is not supported (supported: {allowed})")
        elif absent is not _UNSET and absent not in allowed:
            raise ConfigError(
                f"{self.source}: {key} is missing, which means {key}={absent!r} for this format; "
                f"that is not supported (supported: {allowed})")

    def finish(self, irrelevant: frozenset[str], *, strict: bool) -> list[str]:
        """Refuse (strict) or warn once about the keys nothing read; returns them."""
        unknown = sorted(set(self.data) - self.used - irrelevant)
        if unknown and strict:
            raise ConfigError(
                f"{self.source}: unknown config keys {unknown} (strict=True refuses them; "
                f"load with strict=False to ignore them)")
        if unknown:
            warnings.warn(f"{self.source}: ignoring config keys dlm-jax does not use: {unknown} "
                          f"(strict=True refuses them)", UserWarning, stacklevel=4)
        return unknown


def _dtype_of(r: _Reader) -> str:
    name = r.get("dtype") or r.get("torch_dtype") or "float32"
    if name not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{r.source}: dtype={name!r} is not supported")
    return name


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, list) and x else (None if isinstance(x, list) else x)


def _eos(x: Any) -> Any:
    """`eos_token_id` as HF stores it: an id, or a list of ids any of which ends generation."""
    if isinstance(x, list):
        return tuple(x) if len(x) > 1 else _first(x)
    return x


def _eos_json(x: Any) -> Any:
    return list(x) if isinstance(x, tuple) else x


def _rope_theta(r: _Reader) -> float:
    scaling = r.get("rope_scaling")
    if scaling not in (None, {}) and (not isinstance(scaling, dict) or (
            scaling.get("rope_type") or scaling.get("type")) != "default"
            or scaling.get("partial_rotary_factor", 1.0) not in (1.0, None)):
        raise ConfigError(f"{r.source}: rope_scaling={scaling!r} is not supported")
    params = r.get("rope_parameters")
    theta = r.get("rope_theta")
    if params:
        if (not isinstance(params, dict) or params.get("rope_type", "default") != "default"
                or params.get("partial_rotary_factor", 1.0) not in (1.0, None)):
            raise ConfigError(f"{r.source}: rope_parameters={params!r} is not supported")
        if theta is not None and float(theta) != float(params["rope_theta"]):
            raise ConfigError(f"{r.source}: rope_theta={theta} disagrees with rope_parameters={params}")
        theta = params["rope_theta"]
    return float(theta if theta is not None else 10000.0)


@dataclasses.dataclass(frozen=True)
class Family:
    """One checkpoint layout: its names, its config keys, and what it implies."""

    name: str
    model_types: tuple[str, ...]
    architecture: str
    scheme: NameScheme
    parse: Callable[["Family", _Reader], dict[str, Any]]
    render: Callable[["Family", ModelConfig], dict[str, Any]]
    irrelevant: frozenset[str] = _HF_IRRELEVANT
    implied: dict[str, Any] = dataclasses.field(default_factory=dict)

    def config_from_json(self, data: dict[str, Any], *, source: str, strict: bool = True) -> ModelConfig:
        r = _Reader(data, source)
        r.get("quantization_config")  # a pre-quantized checkpoint's: read and checked by `_prequantized.layout`
        kwargs = {**self.implied, **self.parse(self, r)}
        r.finish(self.irrelevant, strict=strict)
        return ModelConfig(**kwargs)

    def config_to_json(self, cfg: ModelConfig) -> dict[str, Any]:
        for field, value in self.implied.items():
            if getattr(cfg, field) != value:
                raise ConfigError(
                    f"family {self.name!r} cannot store {field}={getattr(cfg, field)!r} (its format "
                    f"implies {value!r}); save with family='dlm_jax'")
        return self.render(self, cfg)


# -- HF llama-like families (Llama, Qwen2/Dream, Qwen3, Qwen3-MoE, dots1) --------------------

def _parse_hf(fam: Family, r: _Reader) -> dict[str, Any]:
    dtype = _dtype_of(r)
    kw: dict[str, Any] = dict(
        vocab_size=r.require("vocab_size"), d_model=r.require("hidden_size"),
        n_layers=r.require("num_hidden_layers"), n_heads=r.require("num_attention_heads"),
        n_kv_heads=r.get("num_key_value_heads"), head_dim=r.get("head_dim"),
        ffn_hidden=r.require("intermediate_size"), norm_eps=float(r.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(r), tie_embeddings=bool(r.get("tie_word_embeddings", False)),
        max_seq_len=r.get("max_position_embeddings", 4096), param_dtype=dtype,
        bos_token_id=_first(r.get("bos_token_id")), eos_token_id=_eos(r.get("eos_token_id")),
        pad_token_id=_first(r.get("pad_token_id")), mask_token_id=r.get("mask_token_id"),
    )
    r.expect("hidden_act", ["silu", "swish"])  # transformers' "swish" is SiLU too
    r.expect("attention_bias", [False])
    r.expect("mlp_bias", [False])
    r.expect("pretraining_tp", [1])
    r.expect("use_sliding_window", [False])
    for key, allowed in _HF_NEUTRAL.items():
        r.expect(key, allowed)
    layer_types = r.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"{r.source}: layer_types={layer_types} (sliding attention) is not supported")
    if layer_types is None and fam.name == "dots1":
        # Dots1Config derives sliding layers from these two (no use_sliding_window switch).
        window, full = r.get("sliding_window", 4096), r.get("max_window_layers", 62)
        if window is not None and kw["n_layers"] > full:
            raise ConfigError(f"{r.source}: sliding_window={window} with max_window_layers={full} < "
                              f"num_hidden_layers={kw['n_layers']} (sliding attention) is not supported")
    if r.get("block_size") is not None:
        kw["block_size"] = r.get("block_size")
    if fam.name == "qwen3_moe":
        kw.update(_parse_qwen3_moe(r, kw["n_layers"]))
    elif fam.name == "dots1":
        kw.update(_parse_dots1(r))
    return kw


def _parse_qwen3_moe(r: _Reader, n_layers: int) -> dict[str, Any]:
    n_experts = r.get("num_experts", r.get("num_local_experts"))
    step = r.get("decoder_sparse_step", 1)
    mlp_only = set(r.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(n_layers) if i in mlp_only or (i + 1) % step != 0)
    return dict(ffn="moe", router="softmax", n_experts=n_experts,
                n_experts_per_tok=r.require("num_experts_per_tok"),
                moe_ffn_hidden=r.require("moe_intermediate_size"),
                norm_topk_prob=bool(r.get("norm_topk_prob", False)), dense_layers=dense)


def _parse_dots1(r: _Reader) -> dict[str, Any]:
    return dict(ffn="moe", router="sigmoid", router_bias=True,
                n_experts=r.require("n_routed_experts"),
                n_experts_per_tok=r.require("num_experts_per_tok"),
                moe_ffn_hidden=r.require("moe_intermediate_size"),
                n_shared_experts=r.get("n_shared_experts", 0) or 0,
                n_expert_groups=r.get("n_group", 1) or 1, topk_groups=r.get("topk_group", 1) or 1,
                routed_scaling=float(r.get("routed_scaling_factor", 1.0)),
                norm_topk_prob=bool(r.get("norm_topk_prob", False)),
                dense_layers=tuple(range(r.get("first_k_dense_replace", 0) or 0)))


def _ids_and_dtype(cfg: ModelConfig) -> dict[str, Any]:
    """The HF keys of the special token ids and the parameter dtype; `mask_token_id` and the
    `block_size` extension only where they are set."""
    out = {"bos_token_id": cfg.bos_token_id, "eos_token_id": _eos_json(cfg.eos_token_id),
           "pad_token_id": cfg.pad_token_id, "dtype": cfg.param_dtype}
    if cfg.mask_token_id is not None:
        out["mask_token_id"] = cfg.mask_token_id
    if cfg.block_size != _DEFAULT_BLOCK_SIZE:
        out["block_size"] = cfg.block_size
    return out


def _render_hf(fam: Family, cfg: ModelConfig) -> dict[str, Any]:
    if cfg.embedding_rows != cfg.vocab_size:
        raise ConfigError(f"family {fam.name!r} cannot store embedding_rows={cfg.embedding_rows} "
                          f"!= vocab_size={cfg.vocab_size}")
    if cfg.ffn in ("relu", "reglu"):
        raise ConfigError(f"family {fam.name!r} cannot store ffn={cfg.ffn!r}; save with family='dlm_jax'")
    out: dict[str, Any] = {
        "architectures": [fam.architecture], "model_type": fam.model_types[0],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": cfg.max_seq_len,
        **_ids_and_dtype(cfg),
    }
    if fam.name != "qwen2" and fam.name != "dream":
        out["attention_bias"] = False
    if fam.name == "qwen3_moe":
        out.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
                   moe_intermediate_size=cfg.moe_ffn_hidden, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers))
    elif fam.name == "dots1":
        k = len(cfg.dense_layers)
        if cfg.dense_layers != tuple(range(k)):
            raise ConfigError(f"family 'dots1' stores only leading dense layers, not {cfg.dense_layers}")
        out.update(n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
                   moe_intermediate_size=cfg.moe_ffn_hidden, n_shared_experts=cfg.n_shared_experts,
                   n_group=cfg.n_expert_groups, topk_group=cfg.topk_groups,
                   routed_scaling_factor=cfg.routed_scaling, norm_topk_prob=cfg.norm_topk_prob,
                   first_k_dense_replace=k, sliding_window=None)
    return out


# -- LLaDA (docs/checkpoints.md, "The LLaDA layout") ----------------------------------------

def _parse_llada(fam: Family, r: _Reader) -> dict[str, Any]:
    d_model = r.require("d_model")
    n_heads = r.require("n_heads")
    mqa = r.get("multi_query_attention")
    n_kv = 1 if mqa else r.get("n_kv_heads") or n_heads
    hidden = r.get("mlp_hidden_size") or int(r.get("mlp_ratio", 4)) * d_model
    # Each key with the values dlm-jax computes and, where LLaDA's configuration_llada.py
    # defaults to something else, that default (a config without the key means it).
    # A "llama" block computes silu(ff_proj(x)) * up_proj(x): "swiglu" there would chunk.
    for key, allowed, absent in (
            ("activation_type", ["silu"], "swiglu"), ("block_type", ["llama"], "sequential"),
            ("rope", [True], False), ("layer_norm_type", ["rms"], "default"),
            ("alibi", [False], False), ("include_bias", [False], False),
            ("scale_logits", [False], False), ("input_emb_norm", [False], False),
            ("attention_layer_norm", [False], False), ("clip_qkv", [None], None),
            ("layer_norm_with_affine", [True], True), ("bias_for_layer_norm", [False, None], None),
            ("block_group_size", [1], 1)):
        r.expect(key, allowed, absent=absent)
    kw: dict[str, Any] = dict(
        vocab_size=r.require("vocab_size"), d_model=d_model, n_layers=r.require("n_layers"),
        n_heads=n_heads, n_kv_heads=n_kv, ffn_hidden=hidden,
        rope_theta=float(r.get("rope_theta", 10000.0)), norm_eps=float(r.get("rms_norm_eps", 1e-5)),
        embedding_rows=r.get("embedding_size") or r.get("vocab_size"),
        tie_embeddings=bool(r.get("weight_tying", True)),  # LLaDA's default: tied
        qkv_bias=bool(r.get("include_qkv_bias", False)),
        mask_token_id=r.get("mask_token_id"), eos_token_id=_eos(r.get("eos_token_id")),
        pad_token_id=_first(r.get("pad_token_id")), bos_token_id=_first(r.get("bos_token_id")),
        max_seq_len=r.get("max_sequence_length", 4096), param_dtype=_dtype_of(r),
    )
    if r.get("block_size") is not None:
        kw["block_size"] = r.get("block_size")
    return kw


def _render_llada(fam: Family, cfg: ModelConfig) -> dict[str, Any]:
    if cfg.ffn != "swiglu" or cfg.qk_norm:
        raise ConfigError(f"family 'llada' stores a dense SwiGLU model without QK-norm "
                          f"(got ffn={cfg.ffn!r}, qk_norm={cfg.qk_norm}); save with family='dlm_jax'")
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise ConfigError(f"family 'llada' needs head_dim * n_heads == d_model "
                          f"(got {cfg.head_dim} * {cfg.n_heads} != {cfg.d_model})")
    return {
        "architectures": [fam.architecture], "model_type": "llada", "d_model": cfg.d_model,
        "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "n_layers": cfg.n_layers,
        "mlp_hidden_size": cfg.ffn_hidden, "mlp_ratio": max(1, cfg.ffn_hidden // cfg.d_model),
        "activation_type": "silu", "block_type": "llama", "rope": True,
        "rope_theta": cfg.rope_theta, "layer_norm_type": "rms", "rms_norm_eps": cfg.norm_eps,
        "vocab_size": cfg.vocab_size, "embedding_size": cfg.embedding_rows,
        "weight_tying": cfg.tie_embeddings, "mask_token_id": cfg.mask_token_id,
        "eos_token_id": _eos_json(cfg.eos_token_id), "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id, "max_sequence_length": cfg.max_seq_len,
        "include_bias": False, "include_qkv_bias": cfg.qkv_bias, "scale_logits": False,
        "input_emb_norm": False, "attention_layer_norm": False, "alibi": False,
        "torch_dtype": cfg.param_dtype,
        **({"block_size": cfg.block_size} if cfg.block_size != _DEFAULT_BLOCK_SIZE else {}),
    }


# -- LLaDA2.0 (inclusionAI LLaDA2.0-mini / -flash, `llada2_moe`, remote code) ---------------
#
# config.json: the HF keys `vocab_size`, `hidden_size`, `num_hidden_layers`,
# `num_attention_heads`, `num_key_value_heads`, `head_dim` (else hidden_size / heads),
# `intermediate_size` (dense layers), `hidden_act` ("silu"), `rms_norm_eps` (every norm),
# `rope_theta`, `rope_scaling` (null), `max_position_embeddings`, `tie_word_embeddings`; and its
# own `partial_rotary_factor` (0.5; `rotary_dim` = head_dim * factor where present),
# `use_qk_norm`, `use_qkv_bias`, `use_bias` (attention output bias), `num_experts`,
# `num_experts_per_tok`, `moe_intermediate_size`, `num_shared_experts`, `n_group`, `topk_group`,
# `routed_scaling_factor`, `first_k_dense_replace`, `score_function` ("sigmoid"),
# `moe_router_enable_expert_bias`, `router_dtype`, `norm_topk_prob`, `norm_head`, `use_rmsnorm`,
# `using_split_qkv_in_self_attention`. LLaDA2.0-mini: 20 layers, d 2048, 16 heads, 4 KV heads,
# head_dim 128, 256 experts (top-8, 8 groups, top-4 groups), one shared expert, first layer
# dense, scaling 2.5, theta 600000, vocab 157184; mask token `<|mask|>` 156895 (from the
# tokenizer files; config.json has no `mask_token_id`), EOS 156892.
#
# Tensors: `model.word_embeddings.weight`, `model.norm.weight`, `lm_head.weight`; per layer i
# under `model.layers.{i}.`: `input_layernorm`, `post_attention_layernorm`,
# `attention.query_key_value` [(H + 2 Hkv) * Dh, D] (rows: q heads, then k heads, then v heads),
# `attention.query_layernorm` / `key_layernorm` [Dh], `attention.dense` (output); dense layers
# `mlp.{gate,up,down}_proj`; MoE layers `mlp.gate.weight` [E, D] (router), `mlp.gate.expert_bias`
# [E], `mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_experts.{gate,up,down}_proj`.
#
# Computation: Qwen3-MoE-like pre-norm blocks; q and k RMS-normed per head, then RoPE on the
# first rotary_dim features of each head (rotate-half within them, exponents over rotary_dim),
# the rest passed through; attention scaled by 1/sqrt(Dh). Layers >= first_k_dense_replace are
# MoE: sigmoid scores; experts chosen by score + expert_bias, among the topk_group groups (of
# n_group) with the largest sum of their two best biased scores; weights are the unbiased scores
# of the chosen, divided by their sum (+1e-20; whenever num_experts_per_tok > 1, whatever
# norm_topk_prob says), times routed_scaling_factor; plus the shared experts (one SwiGLU of
# width num_shared_experts * moe_intermediate_size). Logits are not shifted (the mask predicts its
# own position). LLaDA2.0 was trained and decodes with block diffusion: block-causal attention
# over blocks of 32 aligned at position 0 (its generate()'s block_length), so the family implies
# attention="block_causal" with dlm-jax's default block_size 32.

def _parse_llada2(fam: Family, r: _Reader) -> dict[str, Any]:
    n_heads = r.require("num_attention_heads")
    head_dim = r.get("head_dim") or r.require("hidden_size") // n_heads
    factor = float(r.get("partial_rotary_factor", 0.5))  # LLaDA2MoeConfig's default
    rotary_dim = r.get("rotary_dim")
    if rotary_dim is not None and rotary_dim != int(head_dim * factor):
        raise ConfigError(f"{r.source}: rotary_dim={rotary_dim} disagrees with head_dim={head_dim} * "
                          f"partial_rotary_factor={factor}")
    # The modeling code always has q/k norms and the expert bias, and normalises the top-k
    # weights whenever k > 1; a config saying otherwise describes another computation.
    for key, allowed, absent in (
            ("hidden_act", ["silu"], "silu"), ("use_qkv_bias", [False], False),
            ("use_bias", [False], True), ("use_qk_norm", [True], True),
            ("score_function", ["sigmoid"], "sigmoid"),
            ("moe_router_enable_expert_bias", [True], True), ("norm_topk_prob", [True], True),
            ("router_dtype", ["fp32", None], None), ("norm_head", [False], False),
            ("use_rmsnorm", [True], True), ("using_split_qkv_in_self_attention", [False], False),
            ("use_sliding_window", [False], False), ("pretraining_tp", [1], 1)):
        r.expect(key, allowed, absent=absent)
    n_layers = r.require("num_hidden_layers")
    k = r.require("num_experts_per_tok")
    if r.require("num_experts") is None:
        raise ConfigError(f"{r.source}: num_experts=None (a dense LLaDA2) is not supported")
    kw: dict[str, Any] = dict(
        vocab_size=r.require("vocab_size"), d_model=r.require("hidden_size"), n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=r.require("num_key_value_heads"), head_dim=head_dim,
        ffn_hidden=r.require("intermediate_size"), partial_rotary_factor=factor,
        norm_eps=float(r.get("rms_norm_eps", 1e-5)), rope_theta=_rope_theta(r),
        tie_embeddings=bool(r.get("tie_word_embeddings", False)),
        max_seq_len=r.get("max_position_embeddings", 16384), param_dtype=_dtype_of(r),
        bos_token_id=_first(r.get("bos_token_id")), eos_token_id=_eos(r.get("eos_token_id")),
        pad_token_id=_first(r.get("pad_token_id")), mask_token_id=r.get("mask_token_id"),
        ffn="moe", router="sigmoid", router_bias=True, n_experts=r.get("num_experts"),
        n_experts_per_tok=k, moe_ffn_hidden=r.require("moe_intermediate_size"),
        n_shared_experts=r.get("num_shared_experts") or 0,
        n_expert_groups=r.get("n_group", 8), topk_groups=r.get("topk_group", 4),
        routed_scaling=float(r.get("routed_scaling_factor", 2.5)), norm_topk_prob=k > 1,
        dense_layers=tuple(range(min(r.get("first_k_dense_replace", 0) or 0, n_layers))),
    )
    if r.get("block_size") is not None:
        kw["block_size"] = r.get("block_size")
    return kw


def _render_llada2(fam: Family, cfg: ModelConfig) -> dict[str, Any]:
    k = len(cfg.dense_layers)
    if cfg.dense_layers != tuple(range(k)):
        raise ConfigError(f"family 'llada2' stores only leading dense layers, not {cfg.dense_layers}")
    if cfg.norm_topk_prob != (cfg.n_experts_per_tok > 1):
        raise ConfigError(f"family 'llada2' normalises the top-k weights exactly when k > 1 "
                          f"(got norm_topk_prob={cfg.norm_topk_prob}, k={cfg.n_experts_per_tok})")
    if cfg.embedding_rows != cfg.vocab_size:
        raise ConfigError(f"family 'llada2' cannot store embedding_rows={cfg.embedding_rows} "
                          f"!= vocab_size={cfg.vocab_size}")
    return {
        "architectures": [fam.architecture], "model_type": fam.model_types[0],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "partial_rotary_factor": cfg.partial_rotary_factor, "rotary_dim": cfg.rotary_dim,
        "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": cfg.max_seq_len,
        "use_qkv_bias": False, "use_bias": False, "use_qk_norm": True, "use_rmsnorm": True,
        "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_tok,
        "moe_intermediate_size": cfg.moe_ffn_hidden, "num_shared_experts": cfg.n_shared_experts,
        "n_group": cfg.n_expert_groups, "topk_group": cfg.topk_groups,
        "routed_scaling_factor": cfg.routed_scaling, "first_k_dense_replace": k,
        "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "norm_topk_prob": True,
        **_ids_and_dtype(cfg),
    }


# -- dlm-jax's own format: every ModelConfig field ------------------------------------------

def _parse_native(fam: Family, r: _Reader) -> dict[str, Any]:
    version = r.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ConfigError(f"{r.source}: format_version={version} is not supported (expected {FORMAT_VERSION})")
    r.get("weight_quant")  # the stored weights' quantization: read and checked by `_io.stored_quant`
    r.get("weight_quant_head")  # ... whether it covers the untied head (an earlier version's key) ...
    r.get("weight_quant_float")  # ... and the weights it leaves float (`_io._stored_quant_float`)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    kw = {k: r.get(k) for k in r.data if k in known}
    if "dense_layers" in kw:
        kw["dense_layers"] = tuple(kw["dense_layers"])
    return kw


def _render_native(fam: Family, cfg: ModelConfig) -> dict[str, Any]:
    return {"architectures": [fam.architecture], "model_type": "dlm_jax",
            "format_version": FORMAT_VERSION, **cfg.to_dict()}


_CAUSAL = {"attention": "causal", "logit_shift": True}
FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("dlm_jax", ("dlm_jax",), "DlmJaxTransformer", HF_SCHEME, _parse_native, _render_native,
           irrelevant=frozenset({"architectures", "model_type"})),
    Family("llada", ("llada",), "LLaDAModelLM", LLADA_SCHEME, _parse_llada, _render_llada,
           irrelevant=_LLADA_IRRELEVANT,
           implied={"attention": "bidirectional", "logit_shift": False, "ffn": "swiglu"}),
    Family("llada2", ("llada2_moe",), "LLaDA2MoeModelLM", LLADA2_SCHEME, _parse_llada2, _render_llada2,
           irrelevant=_HF_IRRELEVANT | {"embedding_dropout", "output_dropout", "norm_softmax"},
           implied={"attention": "block_causal", "logit_shift": False, "qkv_bias": False,
                    "qk_norm": True, "ffn": "moe", "router": "sigmoid", "router_bias": True}),
    Family("dream", ("Dream", "dream"), "DreamModel", HF_SCHEME, _parse_hf, _render_hf,
           implied={"attention": "bidirectional", "logit_shift": True, "qkv_bias": True,
                    "qk_norm": False, "ffn": "swiglu"}),
    Family("qwen2", ("qwen2",), "Qwen2ForCausalLM", HF_SCHEME, _parse_hf, _render_hf,
           implied={**_CAUSAL, "qkv_bias": True, "qk_norm": False, "ffn": "swiglu"}),
    Family("llama", ("llama",), "LlamaForCausalLM", HF_SCHEME, _parse_hf, _render_hf,
           implied={**_CAUSAL, "qkv_bias": False, "qk_norm": False, "ffn": "swiglu"}),
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM", HF_SCHEME, _parse_hf, _render_hf,
           implied={**_CAUSAL, "qkv_bias": False, "qk_norm": True, "ffn": "swiglu"}),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", HF_SCHEME, _parse_hf, _render_hf,
           implied={**_CAUSAL, "qkv_bias": False, "qk_norm": True, "ffn": "moe",
                    "router": "softmax", "router_bias": False, "n_shared_experts": 0,
                    "n_expert_groups": 1, "topk_groups": 1, "routed_scaling": 1.0}),
    Family("dots1", ("dots1",), "Dots1ForCausalLM", HF_SCHEME, _parse_hf, _render_hf,
           implied={**_CAUSAL, "qkv_bias": False, "qk_norm": True, "ffn": "moe",
                    "router": "sigmoid", "router_bias": True}),
]}
_BY_MODEL_TYPE = {mt: f for f in FAMILIES.values() for mt in f.model_types}


def family_for(config: dict[str, Any], *, source: str) -> Family:
    """The family of a parsed `config.json`, by its `model_type`."""
    model_type = config.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise ConfigError(
            f"{source}: unknown architecture (model_type={model_type!r}, "
            f"architectures={config.get('architectures')}); supported model types: "
            f"{sorted(_BY_MODEL_TYPE)}")
    return _BY_MODEL_TYPE[model_type]


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"unknown checkpoint family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]

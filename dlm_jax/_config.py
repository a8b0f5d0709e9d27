"""`ModelConfig`: one configuration for every model variant dlm-jax runs.

A variant is chosen by configuration only (attention mode, logit shift, FFN kind, QK-norm,
GQA, tied embeddings, MoE routing); there is one transformer implementation. Every field is
validated at construction so a bad value fails before any tracing or compilation, with the
field and its value in the message.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from dlm_jax._errors import ConfigError

AttentionMode = Literal["bidirectional", "block_causal", "causal"]
FfnKind = Literal["swiglu", "relu", "reglu", "moe"]
RouterKind = Literal["softmax", "sigmoid"]

ATTENTION_MODES: tuple[str, ...] = ("bidirectional", "block_causal", "causal")
FFN_KINDS: tuple[str, ...] = ("swiglu", "relu", "reglu", "moe")
# FFNs whose neurons are exactly zero when inactive (ReLU family): what PowerInfer-2 sparsifies
SPARSE_FFN_KINDS: tuple[str, ...] = ("relu", "reglu")
ROUTER_KINDS: tuple[str, ...] = ("softmax", "sigmoid")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# Weight-only quantization the JAX executor applies at load (`dlm_jax.models.quant`): named here,
# without JAX, so that the command line offers them without importing it.
WEIGHT_QUANTS: tuple[str, ...] = ("int8", "fp8", "int4", "uint4")
# uint4 holds each unsigned 4-bit value q (0 to 15) and its zero point as q - 8 and zero - 8
# (`dlm_jax.models.quant`): q - 8 fits JAX's int4, and the difference is unchanged.
ZERO_OFFSET = 8
# A grouped mode with this suffix ("int4-g128-act") holds each input row's group in a map (GPTQ's
# act-order checkpoints: `desc_act` without `static_groups`), not as runs of consecutive rows.
ACT_ORDER = "-act"


def act_order(mode: str | None) -> bool:
    """Whether the weight-only quant mode `mode` maps each input row to its group ("-act")."""
    return isinstance(mode, str) and mode.endswith(ACT_ORDER)


def weight_quant_parts(mode: str) -> tuple[str, int | None]:
    """(format, group) of a weight-only quant mode: "int8" / "fp8" -> (it, None), one scale per
    output channel; "int8-g128" / "fp8-g32" -> (format, 128 / 32), one scale per output channel
    and group of that many consecutive input rows (`dlm_jax.models.quant`); "int4-g128-act" ->
    (int4, 128), its groups mapped row by row (`act_order`). A ConfigError names what is wrong
    with any other text."""
    if not isinstance(mode, str):
        raise ConfigError(f"quant must be a string such as 'int8' or 'int8-g128', not {mode!r}")
    if act_order(mode):
        fmt, group = weight_quant_parts(mode[:-len(ACT_ORDER)])
        if group is None:
            raise ConfigError(f"quant={mode!r}: '{ACT_ORDER}' (each input row's group from a map) needs groups: "
                              f"'{fmt}-g128{ACT_ORDER}'")
        return fmt, group
    fmt, sep, group = mode.partition("-g")
    whole = group.isdigit() and str(int(group)) == group  # (no sign, no leading zero)
    if fmt not in WEIGHT_QUANTS or (sep and not whole) or (not sep and group):
        raise ConfigError(f"unknown quant {mode!r}; known: {', '.join(WEIGHT_QUANTS)}, each with an optional "
                          f"'-gN' (a scale per N input rows: 'int8-g128'), or None: weights as stored")
    if not sep:
        return fmt, None
    if int(group) < 2:
        raise ConfigError(f"quant={mode!r}: a group holds at least 2 input rows")
    return fmt, int(group)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyper-parameters of the shared transformer.

    Attributes:
      vocab_size: number of token ids the tokenizer produces (logits have this width).
      d_model: residual width D.
      n_layers: number of transformer blocks L.
      n_heads: query heads H.
      n_kv_heads: key/value heads Hkv (GQA); defaults to `n_heads`.
      head_dim: per-head width Dh; defaults to `d_model // n_heads`.
      ffn_hidden: hidden width of a dense FFN (and of MoE layers listed in `dense_layers`).
      ffn: `swiglu`, `relu` (activation-sparse, one up projection), `reglu` (activation-sparse
        gated: down(relu(gate(x)) * up(x)), PowerInfer-2's neuron = gate row, up row, down
        column) or `moe`.
      attention: `bidirectional` (LLaDA, Dream), `block_causal` (block diffusion) or
        `causal` (autoregressive, I-DLM).
      block_size: block length of `block_causal` attention.
      logit_shift: row i of the logits predicts position i + 1 (Dream, I-DLM, AR models).
      rope_theta: RoPE base; rotate-half convention, computed in float32.
      partial_rotary_factor: share of each head's features RoPE rotates: the first
        `rotary_dim = int(head_dim * partial_rotary_factor)` (rotate-half within them, the base's
        exponents over `rotary_dim`); the rest pass through (LLaDA2.0: 0.5).
      norm_eps: RMSNorm epsilon.
      qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3).
      qkv_bias: biases on the q, k and v projections (Qwen2 / Dream).
      tie_embeddings: the output head is the transposed embedding matrix.
      embedding_rows: rows of the embedding matrix; may exceed `vocab_size` (LLaDA's
        `embedding_size`); logits are cut to `vocab_size`.
      mask_token_id, bos_token_id, eos_token_id, pad_token_id: special ids (None if absent);
        `eos_token_id` may be a tuple (Llama-3 style: generation ends at any of them).
      max_seq_len: the longest sequence the model is meant to see.
      n_experts, n_experts_per_tok, moe_ffn_hidden: routed experts, top-k, expert width.
      n_shared_experts: always-on experts (one SwiGLU of width n * moe_ffn_hidden).
      router: `softmax` (Qwen3-MoE) or `sigmoid` (LLaDA2.0 / DeepSeek-V3 style) scores.
      router_bias: a per-expert bias added to the scores for selection only (sigmoid).
      norm_topk_prob: renormalise the selected weights to sum to one.
      routed_scaling: factor on the routed weights after normalisation.
      n_expert_groups, topk_groups: group-limited routing (sigmoid router).
      dense_layers: layers that use a dense SwiGLU FFN although `ffn == "moe"`.
      dtype: compute dtype; param_dtype: storage dtype of the parameters.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn: FfnKind = "swiglu"
    attention: AttentionMode = "bidirectional"
    block_size: int = 32
    logit_shift: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    norm_eps: float = 1e-6
    qk_norm: bool = False
    qkv_bias: bool = False
    tie_embeddings: bool = False
    embedding_rows: int | None = None
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    max_seq_len: int = 4096
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_ffn_hidden: int = 0
    n_shared_experts: int = 0
    router: RouterKind = "softmax"
    router_bias: bool = False
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    n_expert_groups: int = 1
    topk_groups: int = 1
    dense_layers: tuple[int, ...] = ()
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        # Resolve defaults that depend on other fields (frozen, so through object.__setattr__).
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.embedding_rows is None:
            object.__setattr__(self, "embedding_rows", self.vocab_size)
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        if isinstance(self.eos_token_id, (list, tuple)):
            if not self.eos_token_id:
                raise ConfigError("ModelConfig.eos_token_id=[] must name at least one id (or be None)")
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "ffn_hidden", "block_size", "max_seq_len", "embedding_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive integer")
        if self.attention not in ATTENTION_MODES:
            raise ConfigError(f"ModelConfig.attention={self.attention!r} is not one of {ATTENTION_MODES}")
        if self.ffn not in FFN_KINDS:
            raise ConfigError(f"ModelConfig.ffn={self.ffn!r} is not one of {FFN_KINDS}")
        if self.router not in ROUTER_KINDS:
            raise ConfigError(f"ModelConfig.router={self.router!r} is not one of {ROUTER_KINDS}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"ModelConfig.{name}={getattr(self, name)!r} is not one of {DTYPES}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(
                f"ModelConfig.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and "
                f"rotate an even number >= 2 of the head_dim={self.head_dim} features (got {self.rotary_dim})")
        if self.embedding_rows < self.vocab_size:
            raise ConfigError(
                f"ModelConfig.embedding_rows={self.embedding_rows} must be >= vocab_size={self.vocab_size}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError(
                f"ModelConfig.rope_theta={self.rope_theta} and norm_eps={self.norm_eps} must be > 0")
        for name in ("mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            for v in (value if isinstance(value, tuple) else (value,)):
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < self.embedding_rows):
                    raise ConfigError(
                        f"ModelConfig.{name}={value} is outside the embedding table [0, {self.embedding_rows})")
        for i in self.dense_layers:
            if not 0 <= i < self.n_layers:
                raise ConfigError(f"ModelConfig.dense_layers contains {i}, outside [0, {self.n_layers})")
        if self.ffn == "moe":
            self._validate_moe()

    def _validate_moe(self) -> None:
        if self.n_experts <= 0 or self.moe_ffn_hidden <= 0:
            raise ConfigError(
                f"ModelConfig.ffn='moe' needs n_experts > 0 and moe_ffn_hidden > 0 "
                f"(got n_experts={self.n_experts}, moe_ffn_hidden={self.moe_ffn_hidden})")
        if not 0 < self.n_experts_per_tok <= self.n_experts:
            raise ConfigError(
                f"ModelConfig.n_experts_per_tok={self.n_experts_per_tok} must be in [1, {self.n_experts}]")
        if self.n_shared_experts < 0:
            raise ConfigError(f"ModelConfig.n_shared_experts={self.n_shared_experts} must be >= 0")
        if self.n_experts % self.n_expert_groups:
            raise ConfigError(
                f"ModelConfig.n_expert_groups={self.n_expert_groups} must divide n_experts={self.n_experts}")
        if not 0 < self.topk_groups <= self.n_expert_groups:
            raise ConfigError(
                f"ModelConfig.topk_groups={self.topk_groups} must be in [1, {self.n_expert_groups}]")
        if self.n_expert_groups > 1 and self.router != "sigmoid":
            raise ConfigError("ModelConfig.n_expert_groups > 1 needs router='sigmoid'")
        if self.router_bias and self.router != "sigmoid":
            raise ConfigError("ModelConfig.router_bias=True needs router='sigmoid'")

    # -- derived ------------------------------------------------------------------------------

    def is_moe_layer(self, layer: int) -> bool:
        return self.ffn == "moe" and layer not in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose FFN is MoE, in order (expert placement's layer order)."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def rotary_dim(self) -> int:
        """Leading features of each head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def block_align(self) -> int:
        """The block length whose decode blocks must start at absolute multiples of it, 0 for
        none. Block-causal attention groups positions [k * block_size, (k + 1) * block_size)
        counted from the sequence's first token (each request's own), as block diffusion trains
        and LLaDA2.0's generator decodes: a decode block of that length must be one of them,
        the first one the rest of the block the prompt ends in, or its slots attend in a pattern
        the model never saw."""
        return self.block_size if self.attention == "block_causal" else 0

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (empty without EOS)."""
        e = self.eos_token_id
        return () if e is None else e if isinstance(e, tuple) else (e,)

    @property
    def n_groups(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    # -- (de)serialisation --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dense_layers"] = list(self.dense_layers)
        if isinstance(self.eos_token_id, tuple):
            out["eos_token_id"] = list(self.eos_token_id)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown ModelConfig keys: {unknown}")
        kwargs = dict(data)
        if "dense_layers" in kwargs:
            kwargs["dense_layers"] = tuple(kwargs["dense_layers"])
        try:
            return cls(**kwargs)
        except TypeError as e:  # a required field is missing
            raise ConfigError(f"bad ModelConfig: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

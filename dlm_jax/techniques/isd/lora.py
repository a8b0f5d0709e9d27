"""LoRA adapters on the transformer's linear layers, gated per row (I-DLM R-ISD, §3.2 and App. G).

    model = dlm_jax.load_pretrained("models/idlm-tiny")
    attach_lora(model, LoraSpec(rank=8, alpha=16), seed=0)     # adapters start at zero (B = 0)
    gate = mask_rows_gate(tokens, model.config.mask_token_id)   # [B, T] 1.0 on [MASK] rows
    logits = model(tokens, ..., lora_gate=gate).logits

Per adapted linear, y = W0 x + m * (alpha / r) * B(A x) with m = lora_gate [B, T]: 1.0 on
[MASK] rows (proposals: base + adapters), 0.0 on clean rows (base weights only). The base product
is computed as without adapters and the gated delta added to it, so a row whose gate is 0 keeps
the base output's bits; with strict causal attention clean rows never see mask rows, so their
logits and K/V are the base model's, bit for bit. Under `jax.jit` that holds within one
compiled program (a row's gate of 0 adds an exact zero, whatever the other rows' gates: compare
against the same program with an all-zero gate or zeroed adapters); a gated and an ungated
program are two XLA programs, whose fusion of gate-independent ops (RoPE's sin/cos) can round
differently (seen: 1.5e-5 on idlm-tiny logits), as two window buckets of the base can.

Axes: B batch, T rows, I a linear's input width, O its output width, r the rank.

Adapters are `LoraParam` variables, not `nnx.Param`: `get_params`, `save_pretrained` and every
base-weight path skip them, and `nnx.split(model, LoraParam, ...)` separates them for training.
They live in `Attention.lora` / `DenseFFN.lora` (a dict by projection name); their flat names
are `layers.{i}.attn.lora.q_proj.lora_a` ([I, r]) and `....lora_b` ([r, O]).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlm_jax._errors import ConfigError
from dlm_jax.models._transformer import Attention, DenseFFN, MoEFFN, Transformer

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
FFN_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTENTION_TARGETS + FFN_TARGETS


class LoraParam(nnx.Variable):
    """A LoRA adapter weight: a variable of its own type, so base-parameter filters
    (`nnx.Param`) never include it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """Rank, alpha (the delta is scaled by alpha / rank) and the projections adapted, by name:
    attention `q_proj k_proj v_proj o_proj`, dense FFN `gate_proj up_proj down_proj` (MoE
    layers: their shared experts; routed experts get none)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"LoRA {self.rank=} must be a positive integer")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ConfigError(f"LoRA {self.alpha=} must be a number > 0")
        object.__setattr__(self, "alpha", float(self.alpha))
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if not self.targets or bad or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"LoRA targets={list(self.targets)} must be distinct names out of {list(LORA_TARGETS)}"
                              + (f" (unknown: {bad})" if bad else ""))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraAdapter(nnx.Module):
    """The gated low-rank delta of one linear: `gate * (alpha / r) * (x @ A) @ B`.

    A [I, r] starts as PEFT's (Kaiming-uniform, bound 1/sqrt(I)), B [r, O] at zero, so a fresh
    adapter changes nothing. Computed in x's dtype."""

    def __init__(self, d_in: int, d_out: int, *, rank: int, alpha: float, key: jax.Array,
                 param_dtype: jnp.dtype = jnp.float32):
        bound = 1.0 / math.sqrt(d_in)
        self.lora_a = LoraParam(jax.random.uniform(key, (d_in, rank), param_dtype, -bound, bound))
        self.lora_b = LoraParam(jnp.zeros((rank, d_out), param_dtype))
        self.rank, self.alpha = rank, float(alpha)

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        """x [B, T, I], gate [B, T] -> the delta [B, T, O]."""
        delta = (x @ self.lora_a[...].astype(x.dtype)) @ self.lora_b[...].astype(x.dtype)
        m = gate.astype(jnp.float32) * (self.alpha / self.rank)
        return delta * m.astype(delta.dtype)[..., None]


def _owners(model: Transformer) -> Iterator[tuple[str, Attention | DenseFFN, tuple[str, ...]]]:
    """(dotted path, module, its adaptable projection names) of every module that can hold adapters."""
    for i, layer in enumerate(model.layers):
        yield f"layers.{i}.attn", layer.attn, ATTENTION_TARGETS
        ffn = layer.ffn
        if isinstance(ffn, MoEFFN):
            ffn, path = ffn.shared, f"layers.{i}.ffn.shared"
        else:
            path = f"layers.{i}.ffn"
        if isinstance(ffn, DenseFFN):
            yield path, ffn, tuple(n for n in FFN_TARGETS if getattr(ffn, n) is not None)


def attach_lora(model: Transformer, spec: LoraSpec, *, seed: int = 0) -> Transformer:
    """Give `model` fresh adapters (in place; returned for chaining) on every projection of
    `spec.targets` it has; their B is zero, so outputs do not change until they are trained.

    Raises:
      ValueError: the model already has adapters (`remove_lora` first).
      ConfigError: its projections are fused (`dlm_jax.models._fuse`).
    """
    if lora_spec(model) is not None:
        raise ValueError(f"the model already has LoRA adapters ({lora_spec(model)}); remove_lora first")
    from dlm_jax.models._fuse import is_fused
    from dlm_jax.models._scan import StackedLayers

    if is_fused(model):
        raise ConfigError("attach_lora: the model's projections are fused (projections='fused'); "
                          "attach adapters before building its executor, or use projections='separate'")
    if isinstance(model.layers, StackedLayers):  # (its blocks are rebuilt per call: adapters would be lost)
        raise ConfigError("attach_lora: the model's layers are stacked for a scan (layers='scan'); attach adapters "
                          "before building its executor, or use layers='unrolled'")
    pd = jnp.dtype(model.config.param_dtype)
    key, count = jax.random.key(seed), 0
    for _, owner, names in _owners(model):
        adapters = {}
        for name in names:
            if name not in spec.targets:
                continue
            kernel = getattr(owner, name).kernel
            d_in, d_out = kernel.shape
            adapters[name] = LoraAdapter(d_in, d_out, rank=spec.rank, alpha=spec.alpha,
                                         key=jax.random.fold_in(key, count), param_dtype=pd)
            count += 1
        if adapters:
            owner.lora = nnx.Dict(adapters)
    return model


def remove_lora(model: Transformer) -> Transformer:
    """Drop every adapter (in place): the base model, as it computed before `attach_lora`."""
    for _, owner, _ in _owners(model):
        owner.lora = None
    return model


def lora_spec(model: Transformer) -> LoraSpec | None:
    """The spec of the adapters attached to `model` (None without adapters)."""
    seen: dict[str, LoraAdapter] = {}
    for _, owner, _ in _owners(model):
        if owner.lora is not None:
            seen.update(owner.lora.items())
    if not seen:
        return None
    first = next(iter(seen.values()))
    return LoraSpec(rank=first.rank, alpha=first.alpha, targets=tuple(t for t in LORA_TARGETS if t in seen))


def lora_params(model: Transformer) -> dict[str, np.ndarray]:
    """Name -> host copy of every adapter weight (`layers.0.attn.lora.q_proj.lora_a` [I, r],
    `....lora_b` [r, O]); empty without adapters."""
    state = nnx.state(model, LoraParam)
    return {".".join(str(p) for p in path): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}


def set_lora_params(model: Transformer, params: Mapping[str, np.ndarray | jax.Array]) -> Transformer:
    """Set every adapter weight of `model` from `params` (names and shapes as `lora_params`
    gives them, all present, none extra); in place, returned for chaining."""
    state = nnx.state(model, LoraParam)
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        if name not in params:
            raise KeyError(f"LoRA weight {name!r} is missing")
        old = var.get_value()
        if tuple(np.shape(params[name])) != tuple(old.shape):
            raise ValueError(f"LoRA weight {name!r} has shape {tuple(np.shape(params[name]))}, expected {tuple(old.shape)}")
        flat.append((path, var.replace(jnp.asarray(params[name], old.dtype))))
    extra = sorted(set(params) - {".".join(str(p) for p in path) for path, _ in flat})
    if extra:
        raise KeyError(f"unexpected LoRA weights: {extra[:5]}")
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def kernel_name(lora_name: str) -> str:
    """The base kernel an adapter weight belongs to: `layers.0.attn.lora.q_proj.lora_a` ->
    `layers.0.attn.q_proj.kernel`."""
    owner, rest = lora_name.split(".lora.", 1)
    return f"{owner}.{rest.split('.')[0]}.kernel"

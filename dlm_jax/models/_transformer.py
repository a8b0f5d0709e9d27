"""The one transformer behind every dLLM variant (Flax NNX).

Axes: B batch, T window (query) length, P prefix-cache length, K = P + T key length,
D model width, H query heads, Hkv key/value heads, G = H // Hkv, Dh head width, L layers,
V vocabulary, E experts, F FFN width.

The forward pass serves training (full sequence, any mask, no cache) and decoding (explicit
positions, a [B, T, P+T] visibility mask, an external prefix K/V cache in, the window's K/V
out), which is the decode-step contract of docs/architecture.md. Cached K is stored after RoPE.

LoRA adapters (`dlm_jax.techniques.isd.lora`, I-DLM R-ISD) hang off `Attention.lora` and
`DenseFFN.lora` (None until `attach_lora`): with a `lora_gate` [B, T] a projection returns
`W0 x + gate * delta(x)`; without a gate or adapters the computation is the base model's, op
for op.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax._masks import attention_rule
from dlm_jax.models import _attention_kernel, _quant_kernel
from dlm_jax.models._tracing import (  # noqa: F401  (re-exported: the executor's names)
    _EXPERT_MESH, EXPERT_EXCHANGES, _scoped, expert_mesh, traced_mesh)
from dlm_jax.models.quant import QuantExperts, QuantLinear, dequantize, expert_einsum, expert_kernel, experts_matmul

_NEG = float(jnp.finfo(jnp.float32).min)
_init = nnx.initializers.normal(stddev=0.02)


class ModelOutput(NamedTuple):
    logits: jax.Array  # [B, T or R, V] float32
    k: jax.Array  # [L, B, T, Hkv, Dh] the window's keys (post-RoPE)
    v: jax.Array  # [L, B, T, Hkv, Dh]
    router_topk: jax.Array | None = None  # [Lm, B, T, k] int32 routed experts of the MoE layers
    ffn_act: jax.Array | None = None  # [L, B, T, F] float32 ReLU-family FFN activations (>= 0)


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


class RMSNorm(nnx.Module):
    """`scale * x * rsqrt(mean(x^2) + eps)`, the statistic taken in float32."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


def _linear(cfg: ModelConfig, d_in: int, d_out: int, *, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=_dtype(cfg.dtype),
                      param_dtype=_dtype(cfg.param_dtype), kernel_init=_init, rngs=rngs)


def _project(linear: nnx.Linear, adapters, name: str, x: jax.Array, gate: jax.Array | None) -> jax.Array:
    """`linear(x)`, plus the gated LoRA delta `adapters[name](x, gate)` when there is a gate and
    an adapter of that name. The base product is computed exactly as without adapters and the
    delta added to it: a row whose gate is 0 adds (+-)0 and keeps the base output's bits."""
    y = _apply(linear, x)
    if gate is None or adapters is None or name not in adapters:
        return y
    return y + adapters[name](x, gate)


def _apply(linear, x: jax.Array) -> jax.Array:
    """`linear(x)`; an unquantized `nnx.Linear`'s product in dlm-jax's Pallas kernel where
    `$DLM_JAX_DENSE_KERNEL=pallas` asks on a GPU (`_quant_kernel.use_dense`: the kernel reading
    its weights as they are, summed in float32 and rounded once to the Linear's dtype, as XLA's
    GEMM computes it up to the order of the sums)."""
    if not isinstance(linear, nnx.Linear) or not _quant_kernel.use_dense(linear.kernel[...]):
        return linear(x)  # (no op traced before this: an exported program is the Linear's alone)
    w = linear.kernel[...]
    dt = linear.dtype or jnp.result_type(x.dtype, w.dtype)
    y = _quant_kernel.grouped_matmul(x.astype(dt), w.astype(dt), out_dtype=dt)
    return y if linear.bias is None else y + linear.bias[...].astype(dt)


def _project_fused(linear, adapters, names: tuple[str, ...], widths: tuple[int, ...], x: jax.Array,
                   gate: jax.Array | None) -> tuple[jax.Array, ...]:
    """The projections `names` of x from one fused linear (`dlm_jax.models._fuse`: their
    kernels side by side, `widths` output columns each): one product, split in order, each
    part then given its gated LoRA delta as `_project` adds it."""
    y = _apply(linear, x)
    cuts = [sum(widths[:i + 1]) for i in range(len(widths) - 1)]
    parts = jnp.split(y, cuts, axis=-1)
    if gate is None or adapters is None:
        return tuple(parts)
    return tuple(p + adapters[n](x, gate) if n in adapters else p for p, n in zip(parts, names))


def rope_tables(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, 1, R] in float32 (rotate-half convention) for the R =
    `rotary_dim` rotated features of a head (all Dh of them unless partial rotary)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first R features of [B, T, heads, Dh] by the [.., R] tables (rotate-half
    within them), the other Dh - R unchanged; computed in float32, returned in x.dtype."""
    r = cos.shape[-1]
    x32 = x.astype(jnp.float32)
    rot = x32[..., :r]
    rotated = jnp.concatenate([-rot[..., r // 2:], rot[..., : r // 2]], axis=-1)
    out = rot * cos + rotated * sin
    if r < x.shape[-1]:
        out = jnp.concatenate([out, x32[..., r:]], axis=-1)
    return out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    q: [B, T, H, Dh]; k, v: [B, K, Hkv, Dh]; mask: [B, T, K] bool (True = visible) or an
    additive float bias. Returns [B, T, H, Dh]. Scores and softmax in float32.
    """
    b, t, h, dh = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(dh)))
    if mask.dtype == jnp.bool_:
        scores = jnp.where(mask[:, None, None], scores, _NEG)
    else:
        scores = scores + mask[:, None, None].astype(jnp.float32)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, dh)


# How `Attention` reads a prefix cache: "split" (default) scores the cache and the window
# separately under one softmax (`attend_cached`), so the cache is read where it lies; "concat" copies the
# cache and the window's K/V into one array first (the form LiteRT bundles are traced in);
# "cudnn" is "concat" into `jax.nn.dot_product_attention`'s cuDNN kernel (a GPU, bf16/fp16), and
# the window alone into it where no cache is read; "cudnn_split" takes cuDNN's kernel twice, over
# the cache where it lies and over the window, and merges the two by their log-sum-exps
# (`attend_cudnn_cached`: no copy of the cache), the window alone as "cudnn" where no cache is read;
# "pallas" is one Pallas (Triton) kernel a layer over the cache where it lies and the window
# (`_attention_kernel`), the window alone where no cache is read, "split" for shapes it does not take.
ATTENTION_FORMS = ("split", "concat", "cudnn", "cudnn_split", "pallas")
CUDNN_FORMS = ("cudnn", "cudnn_split")  # in cuDNN's kernel: a GPU, bfloat16 or float16
KERNEL_FORMS = ("pallas",)  # in dlm-jax's own kernel: a GPU (Triton), or Pallas's interpreter
_ATTENTION = contextvars.ContextVar("dlm_jax_attention", default=("split", False))


@contextlib.contextmanager
def attention_form(form: str, *, heads_first: bool = False) -> Iterator[None]:
    """Trace the model's cached attention in `form` (one of `ATTENTION_FORMS`) inside this
    context. `heads_first`: the prefix cache given to the model is laid out [L, B, Hkv, P, Dh]
    (a resident cache's layout: each head's slots contiguous, as the score and value products
    read them) instead of [L, B, P, Hkv, Dh]."""
    if form not in ATTENTION_FORMS:
        raise ValueError(f"unknown attention form {form!r}; known: {', '.join(ATTENTION_FORMS)}")
    with _scoped(_ATTENTION, (form, heads_first)):
        yield


# Whether `Attention` rotates q's and k's heads by one RoPE op over both (`joint_rope`) or each
# by its own (the default, and always under `litert_lowering`: the op order bundles are traced in).
_JOINT_ROPE = contextvars.ContextVar("dlm_jax_joint_rope", default=False)


@contextlib.contextmanager
def joint_rope(on: bool = True) -> Iterator[None]:
    """Trace `Attention` inside this context with q's and k's heads rotated by one RoPE op over
    both (`on`): the same values, and compiled for an H200 one or two fewer kernels a layer
    (one or two more in a split refresh over separate projections at batch 16 and 32,
    `benchmarks/results/gpu_target.md`). The JAX executor traces its steps so where it builds
    for one accelerator (`JaxExecutor.one_rope`); elsewhere each is rotated apart, as before:
    XLA:CPU compiles the joined op to other last bits (float32 logits 1e-5 apart), which can
    turn a near tie."""
    with _scoped(_JOINT_ROPE, on):
        yield




def attend_cached(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
                  mask: jax.Array, *, heads_first: bool = False) -> jax.Array:
    """`attend(q, [k_cache; k], [v_cache; v], mask)` without building the concatenation.

    q: [B, T, H, Dh]; k_cache, v_cache: [B, P, Hkv, Dh] ([B, Hkv, P, Dh] with `heads_first`);
    k, v: [B, T, Hkv, Dh]; mask: [B, T, P+T] bool, cache columns first. One softmax over
    both parts' scores ([B, Hkv, G, T, P] and [B, Hkv, G, T, T] float32), taken part by part
    (their joint maximum, then their sums added), so the cache is read once, in place, and
    neither a [B, P+T] copy of K/V nor a joined [.., P+T] copy of the scores is built per
    layer. Returns [B, T, H, Dh]."""
    b, t, h, dh = q.shape
    p, hkv = k_cache.shape[2 if heads_first else 1], k.shape[2]
    if p == 0:  # no cache columns: the window alone
        return attend(q, k, v, mask)
    cache_axes = "bksd" if heads_first else "bskd"
    qg = q.reshape(b, t, hkv, h // hkv, dh)
    k_cache, v_cache = k_cache.astype(k.dtype), v_cache.astype(v.dtype)  # no-ops for a cache of the model's dtype
    scale = 1.0 / jnp.sqrt(jnp.float32(dh))
    cached = jnp.einsum(f"btkgd,{cache_axes}->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    # The window's scores take the queries through an optimization barrier (the same values):
    # with one query operand, XLA's dot merger joins the two score products into one over a
    # concatenated copy of the layer's cached keys and the window's, the copy this form exists
    # to avoid (compiled for an H200 at batch 8: one [B, Hkv, P+T, Dh] copy per layer,
    # `benchmarks/results/gpu_target.md`).
    own = jnp.einsum("btkgd,bskd->bkgts", jax.lax.optimization_barrier(qg), k, preferred_element_type=jnp.float32)
    cached = jnp.where(mask[:, None, None, :, :p], cached * scale, _NEG)
    own = jnp.where(mask[:, None, None, :, p:], own * scale, _NEG)
    top = jax.lax.stop_gradient(jnp.maximum(cached.max(-1, keepdims=True), own.max(-1, keepdims=True)))
    e_cached, e_own = jnp.exp(cached - top), jnp.exp(own - top)
    total = e_cached.sum(-1, keepdims=True) + e_own.sum(-1, keepdims=True)
    # Each product in the values' dtype, as `attend` takes it (XLA:CPU has no bf16 x bf16 ->
    # f32 kernel for these), over the unnormalized weights (each at most 1), the two parts added
    # in float32 and divided by the sum after: compiled for an H200, the sums then fuse with
    # the exponentials instead of taking a kernel each, 2-3 fewer a layer for the same bytes
    # (`benchmarks/results/gpu_target.md`).
    out = (jnp.einsum(f"bkgts,{cache_axes}->btkgd", e_cached.astype(v_cache.dtype), v_cache
                      ).astype(jnp.float32)
           + jnp.einsum("bkgts,bskd->btkgd", e_own.astype(v.dtype), v).astype(jnp.float32))
    out = out / jnp.moveaxis(total, 3, 1)  # [B, Hkv, G, T, 1] -> [B, T, Hkv, G, 1]
    return out.astype(v.dtype).reshape(b, t, h, dh)


def attend_cudnn(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
    """`attend` through `jax.nn.dot_product_attention(implementation="cudnn")` (fused, bf16/fp16
    on a GPU; grouped heads as they are). mask: [B, T, K] bool."""
    return jax.nn.dot_product_attention(q, keys, values, mask=mask[:, None], implementation="cudnn")


def merge_attention(parts) -> jax.Array:
    """Attention over the union of disjoint key sets, from each set's own attention: `parts`
    is (out [..., T, Dh], lse [..., T] float32) per set, `out` normalized over that set alone
    and `lse` the log-sum-exp of its scaled (and masked) scores. The union's softmax weighs
    each set's output by exp(lse) over their sum (FlashAttention-2's rescaling, 3.1.1), taken
    from the largest lse, in float32. A set with nothing visible has an lse near the masked
    score (a finite large negative in both `attend` and cuDNN's mask), so its weight is 0; where
    no set has anything visible the result is finite, as `attend`'s is. Returns float32."""
    top = functools.reduce(jnp.maximum, [lse for _, lse in parts])
    weights = [jnp.exp(lse - top) for _, lse in parts]
    total = functools.reduce(jnp.add, weights)
    # A weight of 0 keeps its set out even where its output is not finite.
    return functools.reduce(jnp.add, [jnp.where(w[..., None] > 0, out.astype(jnp.float32) * (w / total)[..., None], 0.0)
                                      for (out, _), w in zip(parts, weights)])


def cudnn_part(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, scale: float):
    """cuDNN's fused attention of heads-first operands, with its log-sum-exp: q [B, H, T, Dh],
    keys and values [B, Hkv, S, Dh] (grouped heads as they are), mask [B, T, S] bool ->
    (out [B, H, T, Dh], lse [B, H, T] float32). JAX's cuDNN call itself: `jax.nn`'s takes
    [B, S, Hkv, Dh] operands only, which a resident cache ([B, Hkv, S, Dh]) would be copied
    into, and gives the log-sum-exp in the operands' dtype, where cuDNN's is float32."""
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention  # (JAX 0.10 and 0.11)

    out, lse = dot_product_attention(q, keys, values, None, mask[:, None], scale=scale, qkv_layout="BNTH",
                                     return_residual=True)
    return out, lse.astype(jnp.float32)


def attend_cudnn_cached(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
                        mask: jax.Array, *, part: Callable | None = None) -> jax.Array:
    """`attend(q, [k_cache; k], [v_cache; v], mask)` as two fused attentions, one over the
    cache where it lies and one over the window, merged by their log-sum-exps
    (`merge_attention`): no [B, P+T] copy of K/V per layer, as the "cudnn" form makes.

    q: [B, T, H, Dh]; k_cache, v_cache: [B, Hkv, P, Dh] (the resident cache's layer, the layout
    cuDNN reads as it lies); k, v: [B, T, Hkv, Dh]; mask: [B, T, P+T] bool, cache columns
    first. `part`: the fused attention (default `cudnn_part`). Returns [B, T, H, Dh]."""
    part = part or cudnn_part
    p, dh = k_cache.shape[2], q.shape[-1]
    if p == 0:  # no cache columns: the window alone
        return attend_cudnn(q, k, v, mask)
    scale = 1.0 / float(dh) ** 0.5
    qh = q.swapaxes(1, 2)  # [B, H, T, Dh]: one layout for both calls (cuDNN takes one for q, k and v)
    cached = part(qh, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask[:, :, :p], scale)
    own = part(qh, k.swapaxes(1, 2), v.swapaxes(1, 2), mask[:, :, p:], scale)
    return merge_attention([cached, own]).astype(q.dtype).swapaxes(1, 2)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, hkv, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, hkv, dh
        self.q_proj = _linear(cfg, d, h * dh, bias=cfg.qkv_bias, rngs=rngs)
        self.k_proj = _linear(cfg, d, hkv * dh, bias=cfg.qkv_bias, rngs=rngs)
        self.v_proj = _linear(cfg, d, hkv * dh, bias=cfg.qkv_bias, rngs=rngs)
        self.o_proj = _linear(cfg, h * dh, d, bias=False, rngs=rngs)
        pd = _dtype(cfg.param_dtype)
        self.q_norm = RMSNorm(dh, eps=cfg.norm_eps, param_dtype=pd) if cfg.qk_norm else None
        self.k_norm = RMSNorm(dh, eps=cfg.norm_eps, param_dtype=pd) if cfg.qk_norm else None
        self.lora = nnx.data(None)  # {projection name: LoraAdapter} once adapters are attached
        self.qkv_proj = nnx.data(None)  # q, k and v in one linear once fused (`fuse_projections`)

    QKV = ("q_proj", "k_proj", "v_proj")

    def __call__(self, x, cos, sin, mask, k_cache, v_cache, lora_gate=None):
        b, t, _ = x.shape
        if self.qkv_proj is None:  # (each reshaped as it comes: the traced op order bundles were exported in)
            q = _project(self.q_proj, self.lora, "q_proj", x, lora_gate).reshape(b, t, self.n_heads, self.head_dim)
            k = _project(self.k_proj, self.lora, "k_proj", x, lora_gate).reshape(b, t, self.n_kv_heads, self.head_dim)
            v = _project(self.v_proj, self.lora, "v_proj", x, lora_gate).reshape(b, t, self.n_kv_heads, self.head_dim)
        else:
            q, k, v = _project_fused(self.qkv_proj, self.lora, self.QKV, self.qkv_widths, x, lora_gate)
            q = q.reshape(b, t, self.n_heads, self.head_dim)
            k, v = (y.reshape(b, t, self.n_kv_heads, self.head_dim) for y in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if _JOINT_ROPE.get() and not _LITERT.get():  # one RoPE op over q's and k's heads (`joint_rope`)
            qk = apply_rope(jnp.concatenate([q, k], axis=2), cos, sin)
            q, k = qk[:, :, : self.n_heads], qk[:, :, self.n_heads:]
        else:  # (the traced op order bundles were exported in)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        form, heads_first = ("concat", False) if _LITERT.get() else _ATTENTION.get()
        slots = 0 if k_cache is None else k_cache.shape[2 if heads_first else 1]
        mesh = traced_mesh()
        if (form in KERNEL_FORMS and mask.dtype == jnp.bool_ and (slots == 0 or heads_first)
                and _attention_kernel.fits(t, slots, self.head_dim)
                and _attention_kernel.shards(mesh, self.n_kv_heads)):  # one kernel, the cache as it lies
            out = _attention_kernel.attend_kernel(q, k_cache if slots else None, v_cache if slots else None, k, v,
                                                  mask, mesh=mesh)
        elif k_cache is None:  # the window alone (in cuDNN's kernel where the executor asked for it)
            out = attend_cudnn(q, k, v, mask) if form in CUDNN_FORMS else attend(q, k, v, mask)
        elif form == "cudnn_split" and heads_first:  # the resident cache, read where it lies
            out = attend_cudnn_cached(q, k_cache, v_cache, k, v, mask)
        elif (form == "split" or form in KERNEL_FORMS) and mask.dtype == jnp.bool_:  # (shapes, meshes it refuses)
            out = attend_cached(q, k_cache, v_cache, k, v, mask, heads_first=heads_first)
        else:
            if heads_first:
                k_cache, v_cache = k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2)
            keys = jnp.concatenate([k_cache.astype(k.dtype), k], axis=1)
            values = jnp.concatenate([v_cache.astype(v.dtype), v], axis=1)
            out = attend_cudnn(q, keys, values, mask) if form in CUDNN_FORMS else attend(q, keys, values, mask)
        return _project(self.o_proj, self.lora, "o_proj", out.reshape(b, t, -1), lora_gate), k, v

    @property
    def qkv_widths(self) -> tuple[int, int, int]:
        """Output columns of q, k and v."""
        return (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim)


class DenseFFN(nnx.Module):
    """`swiglu`: down(silu(gate(x)) * up(x)); `relu`: down(relu(up(x)));
    `reglu`: down(relu(gate(x)) * up(x)). A ReLU-family FFN (`relu`, `reglu`) also returns
    its neuron activations `act` [..., F] (relu(up) or relu(gate), >= 0): neuron i adds
    nothing to the output where act[..., i] == 0."""

    def __init__(self, cfg: ModelConfig, hidden: int, *, kind: str, rngs: nnx.Rngs):
        self.kind = kind
        self.gate_proj = _linear(cfg, cfg.d_model, hidden, bias=False, rngs=rngs) if kind != "relu" else None
        self.up_proj = _linear(cfg, cfg.d_model, hidden, bias=False, rngs=rngs)
        self.down_proj = _linear(cfg, hidden, cfg.d_model, bias=False, rngs=rngs)
        self.lora = nnx.data(None)  # {projection name: LoraAdapter} once adapters are attached
        self.gate_up_proj = nnx.data(None)  # gate and up in one linear once fused (`fuse_projections`)
        self.hidden = hidden

    def __call__(self, x: jax.Array, lora_gate: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """(output, neuron activations or None for `swiglu`)."""
        a, g = self.lora, lora_gate
        if self.kind == "relu":
            act = jax.nn.relu(_project(self.up_proj, a, "up_proj", x, g))
            return _project(self.down_proj, a, "down_proj", act, g), act
        if self.gate_up_proj is None:
            gate, up = _project(self.gate_proj, a, "gate_proj", x, g), None
        else:
            gate, up = _project_fused(self.gate_up_proj, a, ("gate_proj", "up_proj"), (self.hidden,) * 2, x, g)
        act = jax.nn.relu(gate) if self.kind == "reglu" else jax.nn.silu(gate)
        if up is None:  # (after the activation: the traced op order bundles were exported in)
            up = _project(self.up_proj, a, "up_proj", x, g)
        out = _project(self.down_proj, a, "down_proj", act * up, g)
        return out, (act if self.kind == "reglu" else None)


class Routing(NamedTuple):
    """A router's decision for N rows: each row's k experts and their combine weights."""
    experts: jax.Array  # [N, k] int32 expert ids
    weights: jax.Array  # [N, k] float32


def route(cfg: ModelConfig, logits: jax.Array, expert_bias: jax.Array | None) -> Routing:
    """Top-k experts and their combine weights from router logits [N, E].

    softmax (Qwen3-MoE): top-k of softmax probabilities, optionally renormalised.
    sigmoid (LLaDA2.0, DeepSeek-V3): select by sigmoid score + bias (group-limited when
    n_expert_groups > 1, a group scored by its two best experts), weight by the unbiased
    score, optionally renormalised, then scaled by `routed_scaling`.
    """
    n, e = logits.shape
    k = cfg.n_experts_per_tok
    if cfg.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores if expert_bias is None else scores + expert_bias.astype(jnp.float32)
        if cfg.n_expert_groups > 1:
            grouped = choice.reshape(n, cfg.n_expert_groups, e // cfg.n_expert_groups)
            group_scores = jnp.take_along_axis(grouped, _top_k(grouped, 2), -1).sum(-1)  # [N, groups]
            top_groups = _top_k(group_scores, cfg.topk_groups)
            keep = jax.nn.one_hot(top_groups, cfg.n_expert_groups, dtype=jnp.bool_).any(1)
            keep = jnp.repeat(keep, e // cfg.n_expert_groups, axis=1)
            choice = jnp.where(keep, choice, -jnp.inf)
    idx = _top_k(choice, k)  # [N, k]
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        denom = weights.sum(-1, keepdims=True)
        weights = weights / (denom + 1e-20 if cfg.router == "sigmoid" else denom)
    return Routing(idx, weights * cfg.routed_scaling)


def _swiglu_experts(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """[E, C, D] rows through their own expert's SwiGLU -> [E, C, D]."""
    h = jax.nn.silu(expert_einsum("ecd,edf->ecf", x, gate)) * expert_einsum("ecd,edf->ecf", x, up)
    return expert_einsum("ecf,efd->ecd", h, down)


def dense_experts(x: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array,
                  down: jax.Array) -> jax.Array:
    """Every expert on every row [N, D], combined with zero weight where unselected: the
    reference form of `dispatch_experts`, at E/k times its FLOPs."""
    e = gate.shape[0]
    h = jax.nn.silu(expert_einsum("nd,edf->nef", x, gate)) * expert_einsum("nd,edf->nef", x, up)
    y = expert_einsum("nef,efd->ned", h, down)
    combine = jnp.einsum("nk,nke->ne", routing.weights.astype(x.dtype),
                         jax.nn.one_hot(routing.experts, e, dtype=x.dtype))
    return jnp.einsum("ne,ned->nd", combine, y)


def expert_capacities(n_rows: int, k: int, n_experts: int) -> tuple[int, ...]:
    """Rows per expert `dispatch_experts` may compile for N rows: from the mean load N*k/E up
    by factors of 1.5 to N, the most any expert can receive (a row picks an expert once)."""
    c = max(1, -(-n_rows * k // n_experts))
    levels = []
    while c < n_rows:
        levels.append(c)
        c = -(-c * 3 // 2)
    return (*levels, n_rows)


def expert_shapes(n_rows: int, k: int, n_experts: int) -> tuple[tuple[int, int], ...]:
    """The computations `dispatch_experts` compiles for N rows, cheapest first, as (experts,
    rows each): (U, N) for U a quarter, half or all of the E experts (every row through the U
    experts the step uses), and (E, C) for each of `expert_capacities` below N (each expert's
    rows only)."""
    used = sorted({max(1, n_experts // 4), max(1, n_experts // 2), n_experts})
    shapes = [(u, n_rows) for u in used] + [(n_experts, c) for c in expert_capacities(n_rows, k, n_experts)[:-1]]
    return tuple(sorted(shapes, key=lambda uc: (uc[0] * uc[1], -uc[0])))


def dispatch_experts(x: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array,
                     down: jax.Array) -> jax.Array:
    """Each row [N, D] through its k experts only; the same result as `dense_experts`.

    An expert id of -1 marks an assignment computed elsewhere (split execution's misses): it
    contributes nothing. Two forms, one branch per shape of `expert_shapes`, the cheapest that
    holds the step picked at run time (`_switch`), so no assignment is ever dropped and the
    FLOPs follow the step's routing:
    - every row through the U experts the step uses (their weights gathered), as two
      matmuls, the unselected (row, expert) pairs weighted zero; cheapest where rows
      crowd onto a few experts, as a decode window of [MASK] rows does. From U = E / 2 up
      every expert is read where its weights lie instead (a gathered copy, written and read
      again, would move more bytes), but under `litert_lowering`; with
      `$DLM_JAX_QUANT_KERNEL=pallas` on a GPU the experts (quantized or not) run in the Pallas
      kernel, which reads the used experts' weights in place at every U (the experts that
      fill the branch's U past them are not read);
    - many experts with few rows each (a varied batch): the N*k assignments are ordered by
      expert and packed into an [E, C, D] buffer, C the busiest expert's rows rounded up to a
      capacity level below N.
    """
    n, d = x.shape
    e, k = gate.shape[0], routing.experts.shape[1]
    f = gate.shape[-1]
    a = n * k
    flat = routing.experts.reshape(a)
    valid = flat >= 0
    onehot = (flat[:, None] == jnp.arange(e, dtype=flat.dtype)).astype(jnp.int32)  # [A, E]
    counts = onehot.sum(0)
    weights = routing.weights.astype(x.dtype)
    used = (counts > 0).astype(jnp.int32)
    slot = jnp.cumsum(used) - 1  # a used expert's place among the used ones

    def few(u: int) -> jax.Array:
        # The used experts first, their weights gathered. From half the experts up, every expert
        # where its weights lie instead (the unused ones weighted zero): a gathered copy would be
        # written and read again, more bytes than reading all E (at half: 1.5 E against E). But for
        # LiteRT, whose 2.3 compiled model refuses an IF branch that reads the captured weights
        # directly. The kernel reads the used experts where they lie at every U (the others that
        # fill U are not read).
        kernel = all(map(expert_kernel, (gate, up, down)))
        in_place = 2 * u >= e and not _LITERT.get() and not kernel
        if in_place:
            u, experts, ids = e, jnp.arange(e, dtype=flat.dtype), routing.experts  # (-1: one_hot gives zeros)
        else:
            experts = _inverse_permutation(jnp.where(used > 0, slot, used.sum() + jnp.cumsum(1 - used) - 1))[:u]
            ids = jnp.where(routing.experts >= 0, slot[routing.experts], -1)  # -1: no slot (one_hot gives zeros)
        combine = jnp.einsum("nk,nku->nu", weights, jax.nn.one_hot(ids, u, dtype=x.dtype))
        if kernel:  # each used expert's weights read where they lie (the pads filling U not at all)
            real = used.sum()  # (the used experts come first)
            h = (jax.nn.silu(experts_matmul(x, gate, experts, real=real))
                 * experts_matmul(x, up, experts, real=real))  # [U, N, F]
            h = h.transpose(1, 0, 2) * combine[..., None]
            return experts_matmul(h.reshape(n, u * f), down, experts, summed=True, real=real)
        if in_place:
            g, v, o = (dequantize(w.q, w.scale, x.dtype, w.zero, w.g_idx) if isinstance(w, QuantExperts) else w
                       for w in (gate, up, down))  # (quantized: dequantised whole, XLA's form)
            # a GEMM batched over the experts, x broadcast to each: the [E, D, F] weights read as
            # they lie (as one GEMM of [D, E * F] they would be transposed into a copy first)
            xs = jnp.broadcast_to(x, (e, n, d))
            h = (jax.nn.silu(jnp.einsum("end,edf->enf", xs, g)) * jnp.einsum("end,edf->enf", xs, v)).transpose(1, 0, 2)
        else:
            g, v, o = (w.take(experts, x.dtype) if isinstance(w, QuantExperts) else jnp.take(w, experts, axis=0)
                       for w in (gate, up, down))  # [U, D, F], [U, F, D]
            h = (jax.nn.silu(x @ g.transpose(1, 0, 2).reshape(d, u * f))
                 * (x @ v.transpose(1, 0, 2).reshape(d, u * f))).reshape(n, u, f)
        return (h * combine[..., None]).reshape(n, u * f) @ o.reshape(u * f, d)

    def packed(c: int) -> jax.Array:
        starts = jnp.cumsum(counts) - counts
        rank = (jnp.cumsum(onehot, 0) * onehot).sum(1) - 1  # each assignment's place in its expert
        place = jnp.where(valid, starts[flat] + rank, counts.sum() + jnp.cumsum(~valid) - 1)  # absent ones last
        order = _inverse_permutation(place)  # expert-ordered place -> assignment
        rows = jnp.take(x, order // k, axis=0)  # [A, D]
        take = starts[:, None] + jnp.arange(c, dtype=starts.dtype)[None, :]  # [E, C]
        buf = jnp.take(rows, jnp.minimum(take, a - 1).reshape(e * c), axis=0).reshape(e, c, d)
        buf = jnp.where((jnp.arange(c) < counts[:, None])[..., None], buf, 0).astype(x.dtype)
        y = _swiglu_experts(buf, gate, up, down).reshape(e * c, d)
        y = jnp.take(y, jnp.maximum(flat, 0) * c + jnp.clip(rank, 0, c - 1), axis=0)  # by assignment
        y = jnp.where(valid[:, None], y, 0).reshape(n, k, d)
        return jnp.einsum("nk,nkd->nd", weights, y)

    shapes = expert_shapes(n, k, e)
    fits = jnp.stack([used.sum() <= u if c == n else counts.max() <= c for u, c in shapes])
    return _switch(jnp.argmax(fits), [functools.partial(few, u) if c == n else functools.partial(packed, c)
                                      for u, c in shapes])


# Above this many assignments `_inverse_permutation` sorts (training); at or below it, it
# compares (decode buckets: LiteRT has no kernel for STABLEHLO_SORT).
_SORT_FREE_MAX = 4096


def _inverse_permutation(perm: jax.Array) -> jax.Array:
    a = perm.shape[0]
    if a > _SORT_FREE_MAX:
        return jnp.argsort(perm).astype(perm.dtype)
    ids = jnp.arange(a, dtype=perm.dtype)
    return ((perm[None, :] == ids[:, None]) * ids[None, :]).sum(1)


_LITERT = contextvars.ContextVar("dlm_jax_litert_lowering", default=False)


@contextlib.contextmanager
def litert_lowering() -> Iterator[None]:
    """Trace the model for TFLite inside this context (`tflite_export` does): its multi-way
    control flow becomes ops LiteRT runs (`_switch`)."""
    with _scoped(_LITERT, True):
        yield


def _switch(index: jax.Array, branches: list) -> jax.Array:
    """`lax.switch` over branches of one output shape. Under `litert_lowering`: one top-level
    two-way `lax.cond` per branch, the others giving zeros, which the sum leaves exact (TFLite
    runs IF but not STABLEHLO_CASE, and LiteRT 2.3 mis-feeds captured tensors to IFs nested in
    IFs)."""
    if not _LITERT.get():
        return jax.lax.switch(index, branches)
    spec = jax.eval_shape(branches[0])
    zeros = lambda: jnp.zeros(spec.shape, spec.dtype)  # noqa: E731
    return sum(jax.lax.cond(index == i, branch, zeros) for i, branch in enumerate(branches))


def _top_k(x: jax.Array, k: int) -> jax.Array:
    """Indices [..., k] of the k largest entries of the last axis, ties to the lower index
    (`lax.top_k`'s order) by k rounds of argmax: lax.top_k does not convert to TFLite."""
    picked = []
    for _ in range(k):
        i = jnp.argmax(x, axis=-1).astype(jnp.int32)
        picked.append(i)
        x = jnp.where(jax.nn.one_hot(i, x.shape[-1], dtype=jnp.bool_), -jnp.inf, x)
    return jnp.stack(picked, axis=-1)




def sharded_experts(mesh, experts, x: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array,
                    down: jax.Array, *, exchange: str = "psum") -> jax.Array:
    """`experts(x, routing, gate, up, down)` with the expert weights split over `mesh`: each
    device holds E / ep experts ("ep") and F / tp of their neurons ("tp"). Rows [N, D] and
    their routing come in on every device (the model's activations are replicated over ep and
    tp) and the result [N, D] leaves on every device.

    - "psum": each device computes, for every row, the assignments to its own experts (the
      others marked -1, which `dispatch_experts` skips) over its own neurons, and the partial
      outputs are summed over the axes the weights are split on: one all-reduce of [N, D].
    - "all_to_all": each device takes N / ep of the rows and sends each of their k assignments
      to the device holding its expert ([ep, N k / ep, D], every assignment a slot: none is
      dropped), which computes them over its own neurons and sends the results back; each
      device combines its rows' k results, and the rows are gathered again (and summed over
      tp). Rows that ep does not divide: "psum".
    """
    from jax.sharding import PartitionSpec as P

    from dlm_jax._partition import EXPERT, MODEL, leaf_axes

    free, sizes = _attention_kernel.free_axes(mesh)
    logical = {MODEL: ("tp", sizes.get("tp", 1)), EXPERT: ("ep", sizes.get("ep", 1))}
    specs = [leaf_axes(f"ffn.{name}", w.shape, logical) for name, w in (("gate", gate), ("up", up), ("down", down))]
    # "ep" / "tp", or None where the weights are whole on every device (not divisible, or size 1)
    split_experts, split_neurons = (ax if ax is not None and sizes.get(ax, 1) > 1 else None
                                    for ax in (specs[0][0], specs[0][2]))
    ep = sizes["ep"] if split_experts is not None else 1
    n, k = routing.experts.shape
    if exchange == "all_to_all" and ep > 1 and n % ep == 0:
        local = functools.partial(_exchanged_experts, experts, ep=ep, split_neurons=split_neurons)
    else:
        def local(x, ids, weights, g, u, d):
            if split_experts is not None:
                first = jax.lax.axis_index("ep") * g.shape[0]
                mine = (ids >= first) & (ids < first + g.shape[0])
                ids, weights = jnp.where(mine, ids - first, -1), jnp.where(mine, weights, 0.0)
            out = experts(x, Routing(ids, weights), g, u, d)
            axes = tuple(a for a in (split_experts, split_neurons) if a is not None)
            return jax.lax.psum(out, axes) if axes else out

    # quantized experts: the [E, O] scales split as their weights' expert and output axes, grouped
    # [E, G, O] ones their groups as the input rows too (the partition rules of their names); with
    # act-order maps [E, I] (g_idx), the maps split as the input rows and the groups stay whole
    weight_specs = []
    for s, (name, w) in zip(specs, (("gate", gate), ("up", up), ("down", down))):
        if not isinstance(w, QuantExperts):
            weight_specs.append(P(*s))
            continue
        act = w.g_idx is not None
        scale_spec = leaf_axes(f"ffn.{name}_scale", w.scale.shape, logical, act_order=act)
        if w.scale.ndim == 3 and scale_spec[1] != s[1] and not act:
            raise ConfigError(f"the experts' {name} weights split their {w.q.shape[1]} input rows over "
                              f"{s[1]} but not their {w.scale.shape[1]} groups of scales: pick a quant group "
                              f"size whose group count the mesh axis divides")
        weight_specs.append(QuantExperts(P(*s), P(*scale_spec), None if w.zero is None else P(*scale_spec),
                                         None if not act else P(*leaf_axes(f"ffn.{name}_g_idx", w.g_idx.shape,
                                                                           logical, act_order=True))))
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), *weight_specs), out_specs=P(),
                         axis_names=set(free), check_vma=False)(x, routing.experts, routing.weights, gate, up, down)


def _exchanged_experts(experts, x, ids, weights, g, u, d, *, ep: int, split_neurons: str | None):
    """The "all_to_all" form of `sharded_experts`, on one device (inside `shard_map`)."""
    n, k = ids.shape
    local_e = g.shape[0]
    me = jax.lax.axis_index("ep")
    rows = n // ep
    a = rows * k  # this device's assignments
    mine = jax.lax.dynamic_slice_in_dim(x, me * rows, rows)  # [rows, D]
    my_ids = jax.lax.dynamic_slice_in_dim(ids, me * rows, rows).reshape(a)
    my_w = jax.lax.dynamic_slice_in_dim(weights, me * rows, rows).reshape(a)
    dest = jnp.where(my_ids >= 0, my_ids // local_e, -1)  # the device of each assignment's expert
    to = dest[None, :] == jnp.arange(ep)[:, None]  # [ep, A]: assignment a goes to device p
    send = jnp.where(to[..., None], jnp.repeat(mine, k, axis=0)[None], 0).astype(x.dtype)  # [ep, A, D]
    send_ids = jnp.where(to, my_ids[None, :] % local_e, -1)
    got = jax.lax.all_to_all(send, "ep", 0, 0, tiled=True)  # [ep, A, D]: what each device sent here
    got_ids = jax.lax.all_to_all(send_ids, "ep", 0, 0, tiled=True)
    flat_ids = got_ids.reshape(ep * a, 1)
    y = experts(got.reshape(ep * a, -1), Routing(flat_ids, jnp.where(flat_ids >= 0, 1.0, 0.0)), g, u, d)
    back = jax.lax.all_to_all(y.reshape(ep, a, -1), "ep", 0, 0, tiled=True)  # [ep, A, D]: results, by device
    picked = jnp.take_along_axis(back, jnp.maximum(dest, 0)[None, :, None], axis=0)[0]  # [A, D]
    picked = jnp.where((dest >= 0)[:, None], picked, 0)
    out = jnp.einsum("rk,rkd->rd", my_w.reshape(rows, k).astype(x.dtype), picked.reshape(rows, k, -1))
    out = jax.lax.all_gather(out, "ep", axis=0, tiled=True)  # [N, D]
    return jax.lax.psum(out, split_neurons) if split_neurons is not None else out


class ExpertSlotMap(nnx.Variable):
    """[E] int32: the slot of each routed expert in a split layer's slot buffers, -1 if none."""


class MoEFFN(nnx.Module):
    """Routed SwiGLU experts plus optional shared experts; each row runs its top-k experts only
    (`dispatch_experts`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_ffn_hidden
        pd = _dtype(cfg.param_dtype)
        self.cfg = cfg
        self.router = nnx.Linear(d, e, use_bias=False, dtype=jnp.float32, param_dtype=pd,
                                 kernel_init=_init, rngs=rngs)
        self.expert_bias = nnx.Param(jnp.zeros((e,), jnp.float32)) if cfg.router_bias else None
        self.gate = nnx.Param(_init(rngs.params(), (e, d, f), pd))
        self.up = nnx.Param(_init(rngs.params(), (e, d, f), pd))
        self.down = nnx.Param(_init(rngs.params(), (e, f, d), pd))
        self.shared = (DenseFFN(cfg, cfg.n_shared_experts * f, kind="swiglu", rngs=rngs)
                       if cfg.n_shared_experts else None)
        # Split execution (`dlm_jax.techniques.tide.split_experts`): gate/up/down hold S expert slots,
        # `slot_of` [E] each expert's slot (-1: not resident) and `cpu_experts` computes the
        # assignments to the others on the host.
        self.slot_of: ExpertSlotMap | None = nnx.data(None)
        self.cpu_experts = None

    def expert_weights(self, name: str, dtype) -> jax.Array | QuantExperts:
        """The routed experts' `name` ("gate", "up", "down") weights: [E, I, O] in `dtype`, or
        their `QuantExperts` once quantized (`dlm_jax.models.quant.quantize` adds the scales, and
        uint4's zero points)."""
        w = getattr(self, name)[...]
        scale, zero, g_idx = (getattr(self, f"{name}_{side}", None) for side in ("scale", "zero", "g_idx"))
        if scale is None:
            return w.astype(dtype)
        return QuantExperts(w, scale[...], *(None if a is None else a[...] for a in (zero, g_idx)))

    def routing(self, flat: jax.Array) -> Routing:
        logits = flat.astype(jnp.float32) @ self.router.kernel[...].astype(jnp.float32)
        return route(self.cfg, logits, None if self.expert_bias is None else self.expert_bias[...])

    def __call__(self, x: jax.Array, lora_gate: jax.Array | None = None, *,
                 experts=dispatch_experts) -> tuple[jax.Array, Routing]:
        """(output, routing). `lora_gate` reaches the shared experts' adapters only (routed
        experts have none); `experts` computes the routed part (`dense_experts` is the
        reference form)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        dt = x.dtype
        routing = self.routing(flat)
        resident = routing
        if self.slot_of is not None:
            slot = self.slot_of[...][routing.experts]
            resident = Routing(slot, jnp.where(slot >= 0, routing.weights, 0.0))
        weights = [self.expert_weights(name, dt) for name in ("gate", "up", "down")]
        on_mesh = _EXPERT_MESH.get()
        if on_mesh is None:
            out = experts(flat, resident, *weights)
        else:
            out = sharded_experts(traced_mesh(), experts, flat, resident, *weights, exchange=on_mesh[1])
        if self.slot_of is not None:  # the misses, on the host, added at the layer output
            out = out + jax.pure_callback(self.cpu_experts, jax.ShapeDtypeStruct(flat.shape, dt), flat,
                                          routing.experts, routing.weights, resident.experts < 0)
        out = out.reshape(b, t, d)
        if self.shared is not None:
            out = out + self.shared(x, lora_gate)[0]
        return out, routing


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        pd = _dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pd)
        self.attn = Attention(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pd)
        if cfg.is_moe_layer(layer):
            self.ffn = MoEFFN(cfg, rngs=rngs)
        else:
            kind = "swiglu" if cfg.ffn == "moe" else cfg.ffn
            self.ffn = DenseFFN(cfg, cfg.ffn_hidden, kind=kind, rngs=rngs)

    def __call__(self, x, cos, sin, mask, k_cache, v_cache, lora_gate=None):
        """(output, window K, window V, the MoE FFN's `Routing` or the dense FFN's neuron
        activations or None)."""
        attn_out, k, v = self.attn(self.attn_norm(x), cos, sin, mask, k_cache, v_cache, lora_gate)
        h = x + attn_out
        y, extra = self.ffn(self.ffn_norm(h), lora_gate)
        return h + y, k, v, extra


# A forward traced inside `layers_traced_once()` (the JAX executor's step programs) runs the
# Python of each distinct block structure once: the blocks are called through one jitted
# function (per structure and forward) whose traced program JAX caches and inlines (`inline=True`)
# at each of the L calls. The lowered module, hence the compiled program and its persistent-cache
# key, is the block-by-block trace's (tests/executors/test_trace_once.py). Not inlined, the
# calls would stay function calls until XLA inlined them, after passes that had already chosen
# other roundings: bfloat16 decodes of a random model then differed in a quarter of their tokens.
# Tracing is paid by every process, also where its programs come from the persistent cache
# (JAX keys an executable by its lowered module): at the LLaDA-8B shape a second process traced
# its 16 prefix-cache programs (batch 1 and 8) in 1.8 s instead of 3.4, of the 10 s they took to
# come from the cache in all on 2 CPU cores (`benchmarks/results/cache_load.md`).
_TRACE_ONCE = contextvars.ContextVar("dlm_jax_layers_traced_once", default=False)


@contextlib.contextmanager
def layers_traced_once() -> Iterator[None]:
    """Trace a model's blocks of one structure once inside this context (see `_TRACE_ONCE`);
    a LiteRT lowering (`litert_lowering`) and an eager forward call each block as before."""
    with _scoped(_TRACE_ONCE, True):
        yield


def _block_caller(x: jax.Array) -> Callable[..., Any]:
    """`call(block, *args)`: `block(*args)`, through one jitted function per block structure
    while a forward is traced inside `layers_traced_once()` (a fresh one per forward: what a
    trace reads from its context, such as `attention_form`, is never taken from another's)."""
    if not (_TRACE_ONCE.get() and isinstance(x, jax.core.Tracer)) or _LITERT.get():
        return lambda block, *args: block(*args)
    jitted: dict[Any, Callable[..., Any]] = {}

    def call(block, *args):
        graphdef, state = nnx.split(block)
        try:
            fn = jitted.get(graphdef)
        except TypeError:  # a structure that does not hash: traced where it is called
            return block(*args)
        if fn is None:
            fn = jitted[graphdef] = jax.jit(functools.partial(_merged_call, graphdef), inline=True)
        return fn(state, *args)

    return call


def _merged_call(graphdef, state, *args):
    return nnx.merge(graphdef, state)(*args)


class Transformer(nnx.Module):
    """Embedding, L blocks, final RMSNorm and the output head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = nnx.Embed(cfg.embedding_rows, cfg.d_model, dtype=_dtype(cfg.dtype),
                               param_dtype=_dtype(cfg.param_dtype), embedding_init=_init, rngs=rngs)
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=_dtype(cfg.param_dtype))
        self.lm_head = (None if cfg.tie_embeddings else
                        _linear(cfg, cfg.d_model, cfg.embedding_rows, bias=False, rngs=rngs))

    @property
    def quant_head(self) -> bool:
        """Whether weight-only quantization (`dlm_jax.models.quant.quantize`) covers the untied
        head: all but "lm_head" in `quant_float`, the weights it left float."""
        return "lm_head" not in getattr(self, "quant_float", ())

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 mask: jax.Array | None = None, k_cache: jax.Array | None = None,
                 v_cache: jax.Array | None = None,
                 logit_rows: jax.Array | None = None,
                 lora_gate: jax.Array | None = None, router_topk: bool = False,
                 ffn_act: bool = False) -> ModelOutput:
        """Forward pass.

        Args:
          tokens: [B, T] int32 token ids.
          positions: [B, T] absolute positions; default 0..T-1.
          mask: [B, T, P+T] visibility (bool, True = visible) over cache slots then window
            slots; default the configured attention mode over `positions` (needs no cache).
          k_cache, v_cache: [L, B, P, Hkv, Dh] prefix keys/values (post-RoPE), or None.
          logit_rows: [B, R] rows of the window whose logits are wanted; default all rows.
          lora_gate: [B, T] float32 per-row weight of the LoRA adapters (`attach_lora`): 1.0 on
            [MASK] rows (base + adapters), 0.0 on clean rows (base weights only, bit for bit).
            None, or a model without adapters: the base model, the same ops as without it.
          router_topk: also return each MoE layer's routed experts (None without MoE layers).
          ffn_act: also return each layer's FFN neuron activations (a ReLU-family FFN, else None).

        Returns:
          ModelOutput(logits [B, R or T, V] float32, k, v [L, B, T, Hkv, Dh],
          router_topk [Lm, B, T, k] int32 or None, ffn_act [L, B, T, F] or None).
        """
        x, cos, sin, mask = self.layer_inputs(tokens, positions, mask, k_cache, v_cache)
        if lora_gate is not None and tuple(lora_gate.shape) != tuple(tokens.shape):
            raise ValueError(f"lora_gate has shape {tuple(lora_gate.shape)}, expected the tokens' {tuple(tokens.shape)}")
        ks, vs, topk, acts = [], [], [], []
        call = _block_caller(x)
        for i, layer in enumerate(self.layers):
            kc = None if k_cache is None else k_cache[i]
            vc = None if v_cache is None else v_cache[i]
            x, k, v, extra = call(layer, x, cos, sin, mask, kc, vc, lora_gate)
            ks.append(k)
            vs.append(v)
            if isinstance(extra, Routing):
                topk.append(extra.experts.reshape(*tokens.shape, -1))
            elif extra is not None:
                acts.append(extra)
        return ModelOutput(self.output(x, logit_rows), jnp.stack(ks), jnp.stack(vs),
                           jnp.stack(topk) if router_topk and topk else None,
                           jnp.stack(acts) if ffn_act and acts else None)

    def layer_inputs(self, tokens, positions, mask, k_cache, v_cache):
        """(embedded tokens, RoPE cos, sin, [B, T, P+T] mask): what every layer takes, with the
        defaults and checks of `__call__`."""
        cfg = self.config
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if mask is None:
            if k_cache is not None:
                raise ValueError("a prefix cache needs an explicit [B, T, P+T] mask")
            mask = jnp.asarray(attention_rule(cfg.attention, positions[:, :, None],
                                          positions[:, None, :], cfg.block_size))
            mask = jnp.broadcast_to(mask, (b, t, t))
        if (k_cache is None) != (v_cache is None):
            raise ValueError("k_cache and v_cache must be given together")
        cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
        return self.embed(tokens), cos, sin, mask

    def output(self, x: jax.Array, logit_rows: jax.Array | None) -> jax.Array:
        """Logits of the last layer's hidden states `x`, at `logit_rows` (default all rows)."""
        x = self.final_norm(x)
        if logit_rows is not None:
            x = jnp.take_along_axis(x, logit_rows[:, :, None].astype(jnp.int32), axis=1)
        return self.head(x)

    def head(self, x: jax.Array) -> jax.Array:
        """Output logits [..., V] in float32 from final hidden states [..., D].

        A head stored in the hidden states' dtype (bfloat16) is multiplied as stored, with
        float32 accumulation: no float32 copy of it per call (2 GB at LLaDA-8B)."""
        tied = self.lm_head is None
        if isinstance(self.lm_head, QuantLinear):  # weight-only quantized: dequantised inside the matmul
            return self.lm_head.product(x)[..., : self.config.vocab_size]
        w = self.embed.embedding[...] if tied else self.lm_head.kernel[...]
        if not tied and w.dtype == x.dtype and _quant_kernel.use_dense(w):  # (`_apply`'s switch)
            return _quant_kernel.grouped_matmul(x, w)[..., : self.config.vocab_size]
        if w.dtype == x.dtype and x.dtype != jnp.float32:
            logits = jnp.einsum("...d,vd->...v" if tied else "...d,dv->...v", x, w,
                                preferred_element_type=jnp.float32)
        else:
            w = w.astype(jnp.float32)
            logits = x.astype(jnp.float32) @ (w.T if tied else w)
        return logits[..., : self.config.vocab_size]

"""The decode step graph of a bucket built from a `ModelConfig` alone.

Mirrors what the exporter produces for `dlm_jax.executors.jax_executor.decode_step` (same matmul weights,
shapes [N, K] as TFLite stores them, same inputs and outputs) at the granularity the planners
need: per layer RMSNorm, q/k/v projections, RoPE, the cache slices and concatenations,
attention (scores, masked softmax, weighted sum), the output projection and residual, the FFN
(SwiGLU gate/up/down or ReLU up/down), then the final norm, the gather of the logit rows, the
LM head over those R rows and the sampling tail (mask-id select, log-softmax, top-2,
entropy). Composite ops (`RMS_NORM`, `ROPE`, `SILU_MUL`, `ENTROPY`) stand for the few TFLite
elementwise ops each lowers to. No weights are read: sizes come from the config, so an
8B-parameter model plans in milliseconds.

Byte accounting: 2-D weights at `weight_bytes_per_param` (Q4_0: 18 / 32), 1-D weights (norm
scales) at `vector_bytes_per_param`, activations and KV at `activation_bytes`; the RoPE
frequencies (float32) and the mask-id select mask (bool) are constants too, as in the
`.tflite`. What is left out are the op parameters a converter stores as tiny constants
(shapes, axes, scalars: well under 1 KiB per signature).
"""

from __future__ import annotations

import dataclasses
import math

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.lowering.graph import Op, StepGraph, Tensor
from dlm_jax.runtime.step import signature_name

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class _Builder:
    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.ops: list[Op] = []

    def tensor(self, name: str, shape: tuple[int, ...], dtype: str, nbytes: float, kind: str = "activation") -> int:
        index = len(self.tensors)
        buffer = index if kind == "weight" else -1
        self.tensors.append(Tensor(index, name, tuple(shape), dtype, int(math.ceil(nbytes)), kind, buffer))
        return index

    def op(self, opcode: str, inputs: tuple[int, ...], outputs: tuple[int, ...]) -> None:
        self.ops.append(Op(len(self.ops), opcode, tuple(inputs), tuple(outputs)))


class _Step:
    """One bucket's graph under construction; `act(name, shape)` adds an activation."""

    def __init__(self, cfg: ModelConfig, key, wbpp: float, vbpp: float, abytes: int) -> None:
        self.cfg, self.key, self.b = cfg, key, _Builder()
        self.wbpp, self.vbpp, self.abytes = wbpp, vbpp, abytes
        self.adtype = {2: "float16", 4: "float32"}.get(abytes, f"b{abytes}")
        self.wdtype = cfg.param_dtype if wbpp == _ITEMSIZE[cfg.param_dtype] else (
            "q4_0" if wbpp == 18 / 32 else f"packed{wbpp:g}")

    def act(self, name: str, shape: tuple[int, ...], kind: str = "activation") -> int:
        return self.b.tensor(name, shape, self.adtype, math.prod(shape) * self.abytes, kind)

    def matrix(self, name: str, n: int, k: int) -> int:
        return self.b.tensor(name, (n, k), self.wdtype, n * k * self.wbpp, "weight")

    def vector(self, name: str, n: int) -> int:
        return self.b.tensor(name, (n,), self.cfg.param_dtype, n * self.vbpp, "weight")

    def linear(self, name: str, x: int, w: int, n: int, bias: int | None = None) -> int:
        y = self.act(name, (self.key.batch, self.key.window, n))
        self.b.op("FULLY_CONNECTED", (x, w) if bias is None else (x, w, bias), (y,))
        return y

    def norm(self, name: str, x: int, scale: int) -> int:
        y = self.act(name, self.b.tensors[x].shape)
        self.b.op("RMS_NORM", (x, scale), (y,))
        return y


def build_step_graph(cfg: ModelConfig, key, *, weight_bytes_per_param: float | None = None,
                     vector_bytes_per_param: float | None = None, activation_bytes: int | None = None) -> StepGraph:
    """The StepGraph of bucket `key` (batch, window, cache, rows, full_logits) for `cfg`."""
    if cfg.ffn not in ("swiglu", "relu", "reglu"):
        raise ConfigError(f"analytic_graph: ffn={cfg.ffn!r} is not supported (swiglu, relu or reglu)")
    wbpp = float(weight_bytes_per_param or _ITEMSIZE[cfg.param_dtype])
    vbpp = float(vector_bytes_per_param or _ITEMSIZE[cfg.param_dtype])
    s = _Step(cfg, key, wbpp, vbpp, int(activation_bytes or _ITEMSIZE[cfg.dtype]))
    b, bsz, w, p, r = s.b, key.batch, key.window, key.cache, key.rows
    L, hkv, dh = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    cache_shape = (L, bsz, p, hkv, dh)
    tokens = b.tensor("tokens", (bsz, w), "int32", bsz * w * 4, "input")
    positions = b.tensor("positions", (bsz, w), "int32", bsz * w * 4, "input")
    visibility = b.tensor("visibility", (bsz, w, p + w), "bool", bsz * w * (p + w), "input")
    k_cache = s.act("k_cache", cache_shape, "kv")
    v_cache = s.act("v_cache", cache_shape, "kv")
    logit_rows = b.tensor("logit_rows", (bsz, r), "int32", bsz * r * 4, "input")
    inputs = (tokens, positions, visibility, k_cache, v_cache, logit_rows)

    embedding = s.matrix("embed.embedding", cfg.embedding_rows, cfg.d_model)
    x = s.act("embed", (bsz, w, cfg.d_model))
    b.op("GATHER", (embedding, tokens), (x,))
    inv_freq = b.tensor("rope.inv_freq", (dh // 2,), "float32", dh // 2 * 4, "weight")
    rope = s.act("rope.cos_sin", (2, bsz, w, dh))
    b.op("ROPE_TABLE", (positions, inv_freq), (rope,))

    ks, vs = [], []
    for layer in range(L):
        x, k, vv = _layer(s, layer, x, rope, visibility, k_cache, v_cache)
        ks.append(k)
        vs.append(vv)
    k_new, v_new = s.act("k_new", (L, bsz, w, hkv, dh), "kv"), s.act("v_new", (L, bsz, w, hkv, dh), "kv")
    b.op("CONCATENATION", tuple(ks), (k_new,))
    b.op("CONCATENATION", tuple(vs), (v_new,))
    outputs = _head(s, x, logit_rows) + (k_new, v_new)
    # The graph models neither routed experts nor neuron activity: named as the bucket without them.
    name = signature_name(dataclasses.replace(key, router_topk=False, ffn_active=False))
    return StepGraph(name, tuple(b.ops), tuple(b.tensors), inputs, outputs)


def _layer(s: _Step, layer: int, x: int, rope: int, visibility: int, k_cache: int, v_cache: int):
    """One transformer block; returns (residual out, roped window keys, window values)."""
    cfg, b, key = s.cfg, s.b, s.key
    bsz, w, p = key.batch, key.window, key.cache
    d, h, hkv, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pre = f"layers.{layer}"
    hn = s.norm(f"{pre}.attn_norm", x, s.vector(f"{pre}.attn_norm.scale", d))
    biases = [s.vector(f"{pre}.attn.{n}_proj.bias", m) if cfg.qkv_bias else None
              for n, m in (("q", h * dh), ("k", hkv * dh), ("v", hkv * dh))]
    q = s.linear(f"{pre}.attn.q", hn, s.matrix(f"{pre}.attn.q_proj.kernel", h * dh, d), h * dh, biases[0])
    k = s.linear(f"{pre}.attn.k", hn, s.matrix(f"{pre}.attn.k_proj.kernel", hkv * dh, d), hkv * dh, biases[1])
    vv = s.linear(f"{pre}.attn.v", hn, s.matrix(f"{pre}.attn.v_proj.kernel", hkv * dh, d), hkv * dh, biases[2])
    if cfg.qk_norm:
        q = s.norm(f"{pre}.attn.q_norm", q, s.vector(f"{pre}.attn.q_norm.scale", dh))
        k = s.norm(f"{pre}.attn.k_norm", k, s.vector(f"{pre}.attn.k_norm.scale", dh))
    qr, kr = s.act(f"{pre}.attn.q_rope", (bsz, h, w, dh)), s.act(f"{pre}.attn.k_rope", (bsz, hkv, w, dh))
    b.op("ROPE", (q, rope), (qr,))
    b.op("ROPE", (k, rope), (kr,))
    k_all, v_all = kr, vv
    if p > 0:  # the program reads no cache in a P == 0 bucket
        k_all, v_all = (_with_cache(s, f"{pre}.attn.{n}", cache, new)
                        for n, cache, new in (("k", k_cache, kr), ("v", v_cache, vv)))
    scores = s.act(f"{pre}.attn.scores", (bsz, h, w, p + w))
    b.op("BATCH_MATMUL", (qr, k_all), (scores,))
    probs = s.act(f"{pre}.attn.probs", (bsz, h, w, p + w))
    b.op("SOFTMAX", (scores, visibility), (probs,))
    attn = s.act(f"{pre}.attn.out", (bsz, h, w, dh))
    b.op("BATCH_MATMUL", (probs, v_all), (attn,))
    o = s.linear(f"{pre}.attn.o", attn, s.matrix(f"{pre}.attn.o_proj.kernel", d, h * dh), d)
    x1 = s.act(f"{pre}.attn.residual", (bsz, w, d))
    b.op("ADD", (x, o), (x1,))
    h2 = s.norm(f"{pre}.ffn_norm", x1, s.vector(f"{pre}.ffn_norm.scale", d))
    f = cfg.ffn_hidden
    up = s.linear(f"{pre}.ffn.up", h2, s.matrix(f"{pre}.ffn.up_proj.kernel", f, d), f)
    act = s.act(f"{pre}.ffn.act", (bsz, w, f))
    if cfg.ffn in ("swiglu", "reglu"):
        gate = s.linear(f"{pre}.ffn.gate", h2, s.matrix(f"{pre}.ffn.gate_proj.kernel", f, d), f)
        b.op("SILU_MUL" if cfg.ffn == "swiglu" else "RELU_MUL", (gate, up), (act,))
    else:
        b.op("RELU", (up,), (act,))
    down = s.linear(f"{pre}.ffn.down", act, s.matrix(f"{pre}.ffn.down_proj.kernel", d, f), d)
    x2 = s.act(f"{pre}.ffn.residual", (bsz, w, d))
    b.op("ADD", (x1, down), (x2,))
    return x2, kr, vv


def _with_cache(s: _Step, name: str, cache: int, new: int) -> int:
    """This layer's cache slice followed by the window's rows: [B, Hkv, P+W, Dh]."""
    key, cfg = s.key, s.cfg
    piece = s.act(f"{name}_cache", (key.batch, cfg.n_kv_heads, key.cache, cfg.head_dim))
    s.b.op("SLICE", (cache,), (piece,))
    both = s.act(f"{name}_all", (key.batch, cfg.n_kv_heads, key.cache + key.window, cfg.head_dim))
    s.b.op("CONCATENATION", (piece, new), (both,))
    return both


def _head(s: _Step, x: int, logit_rows: int) -> tuple[int, ...]:
    """Final norm, gather of the logit rows, LM head over R rows, sampling tail; returns the
    contract's row outputs (and `logits` in a full-logits bucket)."""
    cfg, b, key = s.cfg, s.b, s.key
    bsz, r, v, e = key.batch, key.rows, cfg.vocab_size, cfg.embedding_rows
    hf = s.norm("final_norm", x, s.vector("final_norm.scale", cfg.d_model))
    rows = s.act("head.rows", (bsz, r, cfg.d_model))
    b.op("GATHER", (hf, logit_rows), (rows,))
    if cfg.tie_embeddings:  # the head reads the embedding table itself
        head_w = next(t.index for t in b.tensors if t.name == "embed.embedding")
    else:
        head_w = s.matrix("lm_head.kernel", e, cfg.d_model)
    logits = s.act("head.logits", (bsz, r, e))
    b.op("FULLY_CONNECTED", (rows, head_w), (logits,))
    full = key.full_logits
    if cfg.mask_token_id is not None or full:
        masked = b.tensor("logits" if full else "head.masked", (bsz, r, v), "float32", bsz * r * v * 4,
                          "output" if full else "activation")
        if cfg.mask_token_id is None:
            b.op("SLICE", (logits,), (masked,))
        else:
            b.op("SELECT_V2", (b.tensor("head.mask", (v,), "bool", v, "weight"), logits), (masked,))
        logits = masked
    logp = s.act("head.logp", (bsz, r, v))
    b.op("LOG_SOFTMAX", (logits,), (logp,))
    probs = s.act("head.probs", (bsz, r, v))
    b.op("EXP", (logp,), (probs,))
    top_token = b.tensor("top_token", (bsz, r), "int32", bsz * r * 4, "output")
    top_prob = b.tensor("top_prob", (bsz, r), "float32", bsz * r * 4, "output")
    second = b.tensor("second_prob", (bsz, r), "float32", bsz * r * 4, "output")
    b.op("ARG_MAX", (probs,), (top_token,))
    b.op("REDUCE_MAX", (probs,), (top_prob,))
    runner_up = s.act("head.runner_up", (bsz, r, v))  # the top token's entry removed
    b.op("SELECT_V2", (probs, top_token), (runner_up,))
    b.op("REDUCE_MAX", (runner_up,), (second,))
    entropy = b.tensor("entropy", (bsz, r), "float32", bsz * r * 4, "output")
    b.op("ENTROPY", (probs, logp), (entropy,))
    return (top_token, top_prob, second, entropy) + ((logits,) if full else ())


def analytic_graph(config, key, *, weight_bytes_per_param: float | None = None,
                   vector_bytes_per_param: float | None = None, activation_bytes: int | None = None) -> StepGraph:
    """The decode step of bucket `key` built from `config` alone (no weights, no conversion):
    see this module's notes for the op list and byte accounting."""
    return build_step_graph(config, key, weight_bytes_per_param=weight_bytes_per_param,
                            vector_bytes_per_param=vector_bytes_per_param, activation_bytes=activation_bytes)

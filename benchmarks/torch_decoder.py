"""The PyTorch peer: dlm-jax's block-wise decoders (Fast-dLLM's no cache, prefix cache and
dual cache; threshold and LLaDA top-k commits; greedy) in eager PyTorch on the same weights.

It exists so the speed of dlm-jax is measured against a real peer in one run on any machine
(`benchmarks/peer.py` checks that both produce the same tokens and NFE). It is written as a
careful PyTorch user would write it for speed:

- `torch.inference_mode()` and `torch.set_num_threads(threads)`;
- weights converted once to contiguous [d_out, d_in] tensors for `F.linear`; Q/K/V fused
  into one matmul and gate/up into another;
- `F.scaled_dot_product_attention` with no mask (bidirectional attention over prompts of
  one length needs none), grouped K/V heads expanded only when the kernel needs it;
- the LM head computed only for the block's rows (the rows a step predicts);
- the K/V cache kept per layer as tensors: a prefix step slices it, a dual step
  concatenates prefix, suffix and the block's fresh K/V (attention is order-free without a
  mask, since keys carry their RoPE positions).

Semantics follow `dlm_jax.runtime` (see `decode`): the mask token's logit is removed before
the float32 softmax, the proposal is the argmax and its probability the confidence; ties
rank the lower position first; a block of all EOS ends its request (later slots EOS).
Dense bidirectional models only (SwiGLU, RoPE, RMSNorm; no MoE, no logit shift).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MODES = ("none", "prefix", "dual")
RULES = ("threshold", "topk")


class TorchModel:
    """The transformer of a dlm-jax checkpoint in PyTorch (float32)."""

    def __init__(self, params: dict[str, np.ndarray], config: Any, *, threads: int = 2):
        cfg = config
        if cfg.ffn != "swiglu" or cfg.n_experts or cfg.logit_shift or cfg.attention != "bidirectional":
            raise ValueError("the PyTorch peer runs dense bidirectional SwiGLU models only "
                             f"(ffn={cfg.ffn}, experts={cfg.n_experts}, attention={cfg.attention})")
        torch.set_num_threads(threads)
        self.cfg = cfg

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(params[name], dtype=np.float32))

        def lin(name: str) -> torch.Tensor:  # [d_in, d_out] kernel -> [d_out, d_in]
            return t(name).T.contiguous()

        self.embed = t("embed.embedding")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            qkv = torch.cat([lin(p + f"attn.{n}_proj.kernel") for n in "qkv"]).contiguous()
            bias = (torch.cat([t(p + f"attn.{n}_proj.bias") for n in "qkv"]) if cfg.qkv_bias else None)
            self.layers.append({
                "attn_norm": t(p + "attn_norm.scale"), "qkv": qkv, "qkv_bias": bias,
                "o": lin(p + "attn.o_proj.kernel"), "ffn_norm": t(p + "ffn_norm.scale"),
                "gate_up": torch.cat([lin(p + "ffn.gate_proj.kernel"), lin(p + "ffn.up_proj.kernel")]).contiguous(),
                "down": lin(p + "ffn.down_proj.kernel"),
                "q_norm": t(p + "attn.q_norm.scale") if cfg.qk_norm else None,
                "k_norm": t(p + "attn.k_norm.scale") if cfg.qk_norm else None,
            })
        self.final_norm = t("final_norm.scale")
        self.head = self.embed if cfg.tie_embeddings else lin("lm_head.kernel")
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32)
                                                  / cfg.head_dim))

    def _norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return scale * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[None, None]  # [1, 1, T, Dh]
        return emb.cos(), emb.sin()

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows: slice,
                cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits [B, R, V] of the window rows `rows`, and the window's K/V per layer
        ([B, Hkv, T, Dh], keys after RoPE). `cache`: per layer the K/V the window also
        attends to, or None."""
        cfg = self.cfg
        b, t = tokens.shape
        h, hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = self._rope(positions)
        x = self.embed[tokens]
        kvs = []
        for i, layer in enumerate(self.layers):
            hn = self._norm(x, layer["attn_norm"])
            qkv = F.linear(hn, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split((h * dh, hkv * dh, hkv * dh), dim=-1)
            q = q.view(b, t, h, dh).transpose(1, 2)
            k = k.view(b, t, hkv, dh).transpose(1, 2)
            v = v.view(b, t, hkv, dh).transpose(1, 2)
            if layer["q_norm"] is not None:
                q, k = self._norm(q, layer["q_norm"]), self._norm(k, layer["k_norm"])
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            kvs.append((k, v))
            keys, values = k, v
            if cache is not None:
                keys = torch.cat([cache[i][0], k], dim=2)
                values = torch.cat([cache[i][1], v], dim=2)
            attn = F.scaled_dot_product_attention(q, keys, values, enable_gqa=h != hkv)
            x = x + F.linear(attn.transpose(1, 2).reshape(b, t, h * dh), layer["o"])
            gate, up = F.linear(self._norm(x, layer["ffn_norm"]), layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        x = self._norm(x[:, rows], self.final_norm)
        return F.linear(x, self.head)[..., : cfg.vocab_size], kvs


def _propose(logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy proposals and their float32 probabilities, the mask token never proposed."""
    logits = logits.clone()
    logits[..., mask_id] = -math.inf
    probs = torch.softmax(logits, dim=-1)
    conf, tokens = probs.max(dim=-1)
    return tokens, conf


def _rank(conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Per row, positions by confidence (highest first, lower position on ties), masked
    positions first."""
    key = torch.where(masked, conf.to(torch.float64), torch.tensor(-math.inf, dtype=torch.float64))
    return torch.sort(key, dim=-1, descending=True, stable=True).indices


def _select(conf: torch.Tensor, masked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Commit the counts[b] best-ranked masked positions of each row."""
    order = _rank(conf, masked)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
    return masked & (ranks < counts[:, None])


def _transfer_counts(masked: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's `get_num_transfer_tokens`: [B, steps]."""
    n = masked.sum(dim=1, keepdim=True)
    base, rem = n // steps, n % steps
    return base + (torch.arange(steps)[None] < rem).to(n.dtype)


def decode(model: TorchModel, prompts: list[list[int]], *, gen_len: int, block_len: int = 32, mode: str = "prefix",
           rule: str = "threshold", threshold: float = 0.9, steps: int | None = None) -> tuple[list[np.ndarray], int]:
    """Decode `gen_len` tokens after each prompt (all of one length). Returns the generated
    ids per request and the NFE (forward passes of the batch)."""
    if mode not in MODES or rule not in RULES:
        raise ValueError(f"mode {mode!r} / rule {rule!r}: modes {MODES}, rules {RULES}")
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the PyTorch peer batches prompts of one length only")
    if gen_len % block_len:
        raise ValueError(f"block_len={block_len} must divide gen_len={gen_len}")
    cfg = model.cfg
    mask_id, eos = cfg.mask_token_id, torch.tensor(list(cfg.eos_ids), dtype=torch.long)
    units = gen_len // block_len
    per_unit = block_len if steps is None else steps // units
    with torch.inference_mode():
        p_len = len(prompts[0])
        total = p_len + gen_len
        x = torch.full((len(prompts), total), mask_id, dtype=torch.long)
        x[:, :p_len] = torch.tensor(prompts)
        positions = torch.arange(total)
        active = torch.ones(len(prompts), dtype=torch.bool)
        nfe = 0
        for unit in range(units):
            lo, hi = p_len + unit * block_len, p_len + (unit + 1) * block_len
            counts = _transfer_counts(x[:, lo:hi] == mask_id, per_unit) if rule == "topk" else None
            cache = None
            step = 0
            while True:
                masked = (x[:, lo:hi] == mask_id) & active[:, None]
                if rule == "topk" and step >= per_unit or rule == "threshold" and not masked.any():
                    break
                if step == 0 or mode == "none":
                    logits, kvs = model.forward(x, positions, slice(lo, hi))
                    cache = kvs
                elif mode == "prefix":
                    logits, _ = model.forward(x[:, lo:], positions[lo:], slice(0, block_len),
                                              [(k[:, :, :lo], v[:, :, :lo]) for k, v in cache])
                else:
                    logits, _ = model.forward(x[:, lo:hi], positions[lo:hi], slice(0, block_len), dual)
                if step == 0 and mode == "dual":
                    dual = [(torch.cat([k[:, :, :lo], k[:, :, hi:]], 2), torch.cat([v[:, :, :lo], v[:, :, hi:]], 2))
                            for k, v in cache]
                nfe += 1
                tokens, conf = _propose(logits, mask_id)
                if rule == "threshold":
                    n = torch.where(masked.any(1), ((conf.double() >= threshold) & masked).sum(1).clamp(min=1), 0)
                else:
                    n = torch.minimum(counts[:, step], masked.sum(1))
                chosen = _select(conf, masked, n)
                x[:, lo:hi] = torch.where(chosen, tokens, x[:, lo:hi])
                step += 1
            done = active & torch.isin(x[:, lo:hi], eos).all(1)
            x[done, hi:] = int(eos[0]) if len(eos) else mask_id
            active &= ~done
            if not active.any():
                break
        return [x[r, p_len:].numpy().copy() for r in range(len(prompts))], nfe

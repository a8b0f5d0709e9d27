"""Compact reference implementations of the published decoders, written from their papers'
pseudo-code and released code, over a plain (unbucketed, unpadded) model forward.

- `llada_generate`: LLaDA's `generate` (low-confidence remasking, semi-AR blocks, fixed steps).
- `fast_dllm_generate`: Fast-dLLM's `generate_with_prefix_cache` / `generate_with_dual_cache`
  with the threshold rule (`get_transfer_index`) or the factor rule as the paper states it:
  commit the largest n with (n' + 1)(1 - c_(n')) < f for every n' <= n, at least one.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dlm_jax import visibility_from_positions


def _softmax64(logits):
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(axis=1, keepdims=True)
    base = mask_num // steps
    remainder = mask_num % steps
    out = np.zeros((mask_num.shape[0], steps), dtype=np.int64) + base
    for i in range(mask_num.shape[0]):
        out[i, : remainder[i, 0]] += 1
    return out


def _topk_index(conf_row, k):
    return np.argsort(-conf_row, kind="stable")[:k]


def llada_generate(model, prompt, *, steps, gen_length, block_length, mask_id):
    x = np.full((1, prompt.shape[1] + gen_length), mask_id, dtype=np.int32)
    x[:, : prompt.shape[1]] = prompt
    num_blocks = gen_length // block_length
    steps = steps // num_blocks
    nfe = 0
    for nb in range(num_blocks):
        lo = prompt.shape[1] + nb * block_length
        num_transfer = get_num_transfer_tokens(x[:, lo:lo + block_length] == mask_id, steps)
        for i in range(steps):
            mask_index = x == mask_id
            logits = np.asarray(model(jnp.asarray(x)).logits)
            nfe += 1
            x0 = logits.argmax(-1)
            x0_p = np.take_along_axis(_softmax64(logits), x0[..., None], -1)[..., 0]
            x0_p[:, lo + block_length:] = -np.inf
            x0 = np.where(mask_index, x0, x)
            confidence = np.where(mask_index, x0_p, -np.inf)
            for j in range(x.shape[0]):
                sel = _topk_index(confidence[j], num_transfer[j, i])
                x[j, sel] = x0[j, sel]
    return x, nfe


def _transfer(logits, mask_index, x, *, threshold=None, factor=None):
    """Fast-dLLM's get_transfer_index (threshold) or the paper's factor rule; greedy."""
    x0 = logits.argmax(-1)
    x0_p = np.take_along_axis(_softmax64(logits), x0[..., None], -1)[..., 0]
    x0 = np.where(mask_index, x0, x)
    confidence = np.where(mask_index, x0_p, -np.inf)
    transfer = np.zeros_like(mask_index)
    for j in range(confidence.shape[0]):
        m = int(mask_index[j].sum())
        if m == 0:
            continue
        order = _topk_index(confidence[j], m)
        if threshold is not None:
            keep = [order[0]] + [i for i in order[1:] if confidence[j, i] >= threshold]
        else:
            n = 1
            while n < m and (n + 2) * (1 - confidence[j, order[n]]) < factor:
                n += 1
            keep = order[:n]
        transfer[j, keep] = True
    return x0, transfer


def _window_forward(model, x, lo, hi, k_all, v_all, cached, mode, block_size):
    window = np.arange(lo, hi)
    k_pos = np.concatenate([cached, window])[None]
    mask = visibility_from_positions(mode, window[None], k_pos, block_size=block_size)
    out = model(jnp.asarray(x[:, lo:hi]), positions=jnp.asarray(window[None], jnp.int32),
                mask=jnp.asarray(mask), k_cache=k_all[:, :, cached], v_cache=v_all[:, :, cached])
    return np.asarray(out.logits)


def fast_dllm_generate(model, prompt, *, gen_length, block_length, mask_id, cache,
                       threshold=None, factor=None):
    """Fast-dLLM with `cache` = "prefix" or "dual" (batch of one, temperature 0)."""
    cfg = model.config
    p = prompt.shape[1]
    x = np.full((1, p + gen_length), mask_id, dtype=np.int32)
    x[:, :p] = prompt
    total = x.shape[1]
    nfe = 0
    for nb in range(gen_length // block_length):
        lo, hi = p + nb * block_length, p + (nb + 1) * block_length
        out = model(jnp.asarray(x))  # full forward fills the cache
        k_all, v_all = out.k, out.v
        mask_index = x == mask_id
        mask_index[:, hi:] = False
        x0, transfer = _transfer(np.asarray(out.logits), mask_index, x, threshold=threshold, factor=factor)
        x[transfer] = x0[transfer]
        nfe += 1
        while (x[:, lo:hi] == mask_id).any():
            nfe += 1
            if cache == "prefix":
                logits = _window_forward(model, x, lo, total, k_all, v_all, np.arange(lo), cfg.attention, cfg.block_size)
                mask_index = x[:, lo:] == mask_id
                mask_index[:, block_length:] = False
                x0, transfer = _transfer(logits, mask_index, x[:, lo:], threshold=threshold, factor=factor)
                x[:, lo:] = np.where(transfer, x0, x[:, lo:])
            else:
                cached = np.concatenate([np.arange(lo), np.arange(hi, total)])
                logits = _window_forward(model, x, lo, hi, k_all, v_all, cached, cfg.attention, cfg.block_size)
                mask_index = x[:, lo:hi] == mask_id
                x0, transfer = _transfer(logits, mask_index, x[:, lo:hi], threshold=threshold, factor=factor)
                x[:, lo:hi] = np.where(transfer, x0, x[:, lo:hi])
    return x, nfe

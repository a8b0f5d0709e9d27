"""Compact transcriptions of the published decoders, over a plain (unbucketed, unpadded) model
forward, for batches of equal-length prompts as the released code takes them.

- `llada_generate`: ML-GSAI/LLaDA `generate.py` `generate` (low-confidence remasking,
  semi-autoregressive blocks, exactly `steps / num_blocks` steps per block).
- `fast_dllm_generate`: NVlabs/Fast-dLLM `llada/generate.py`: `generate` (cache "none"),
  `generate_with_prefix_cache` and `generate_with_dual_cache`, with the top-k schedule
  (`threshold=None, factor=None`), `get_transfer_index` (threshold) or
  `get_transfer_index_dynamic` (factor, as released). Temperature 0, low-confidence
  remasking. Each loop breaks when the block has no mask left, checked before a cached
  step and after an uncached one, as the released code does.

The one liberty: `get_transfer_index_dynamic` indexes `threshs[0]` of a row with no masks
left and raises; here such a row commits nothing (what the code intends, and what a batch
needs once one of its rows finishes a block first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlm_jax import visibility_from_positions


class Forward:
    """The model's forward, jitted per shape (the reference's semantics do not depend on it)."""

    def __init__(self, model):
        self.config = model.config
        graphdef, state = nnx.split(model)

        def full(state, tokens):
            out = nnx.merge(graphdef, state)(tokens)
            return out.logits, out.k, out.v

        def window(state, tokens, positions, mask, k_cache, v_cache):
            return nnx.merge(graphdef, state)(tokens, positions=positions, mask=mask, k_cache=k_cache,
                                              v_cache=v_cache).logits

        self._state = state
        self._full = jax.jit(full)
        self._window = jax.jit(window)

    def full(self, x):
        logits, k, v = self._full(self._state, jnp.asarray(x, jnp.int32))
        return np.asarray(logits), np.asarray(k), np.asarray(v)

    def window(self, x, lo, hi, k_all, v_all, cached):
        """Logits of slots [lo, hi) over the cached K/V of `cached` slots."""
        cfg = self.config
        b = x.shape[0]
        window = np.arange(lo, hi)
        k_pos = np.concatenate([cached, window])
        mask = visibility_from_positions(cfg.attention, np.broadcast_to(window, (b, len(window))),
                                         np.broadcast_to(k_pos, (b, len(k_pos))), block_size=cfg.block_size)
        logits = self._window(self._state, jnp.asarray(x[:, lo:hi], jnp.int32),
                              jnp.asarray(np.broadcast_to(window, (b, len(window))), jnp.int32),
                              jnp.asarray(mask), jnp.asarray(k_all[:, :, cached]), jnp.asarray(v_all[:, :, cached]))
        return np.asarray(logits)


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
    # torch.topk leaves ties unspecified; the runtime breaks them by the lower position.
    return np.argsort(-conf_row, kind="stable")[:k]


def get_transfer_index(logits, mask_index, x, num_transfer_tokens, threshold=None):
    x0 = logits.argmax(-1)
    x0_p = np.take_along_axis(_softmax64(logits), x0[..., None], -1)[..., 0]
    x0 = np.where(mask_index, x0, x)
    confidence = np.where(mask_index, x0_p, -np.inf)
    transfer_index = np.zeros_like(mask_index)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(axis=1)
    for j in range(confidence.shape[0]):
        select_index = _topk_index(confidence[j], int(num_transfer_tokens[j]))
        transfer_index[j, select_index] = True
        if threshold is not None:
            for k in range(1, int(num_transfer_tokens[j])):
                if confidence[j, select_index[k]] < threshold:
                    transfer_index[j, select_index[k]] = False
    return x0, transfer_index


def get_transfer_index_dynamic(logits, mask_index, x, factor=1.0):
    x0 = logits.argmax(-1)
    x0_p = np.take_along_axis(_softmax64(logits), x0[..., None], -1)[..., 0]
    x0 = np.where(mask_index, x0, x)
    confidence = np.where(mask_index, x0_p, -np.inf)
    transfer_index = np.zeros_like(mask_index)
    num_transfer_tokens = mask_index.sum(axis=1)
    for j in range(confidence.shape[0]):
        if num_transfer_tokens[j] == 0:
            continue
        ns = list(range(1, int(num_transfer_tokens[j]) + 1))
        es = [factor / (n + 1) for n in ns]
        threshs = [1 - e for e in es]
        threshs[0] = -1  # always transfer at least one token
        sorted_conf = np.sort(confidence[j][mask_index[j]])[::-1]
        assert len(sorted_conf) == len(threshs)
        for top_i in range(len(threshs)):
            if sorted_conf[top_i] < threshs[top_i]:
                break
        if top_i == 0 or top_i == len(threshs) - 1:
            top_i += 1
        transfer_index[j, _topk_index(confidence[j], top_i)] = True
    return x0, transfer_index


def llada_generate(fwd: Forward, prompt, *, steps, gen_length, block_length, mask_id):
    """ML-GSAI/LLaDA `generate` (cfg_scale 0, temperature 0). Returns (x, nfe)."""
    x = np.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=np.int32)
    x[:, : prompt.shape[1]] = prompt
    num_blocks = gen_length // block_length
    steps = steps // num_blocks
    nfe = 0
    for nb in range(num_blocks):
        lo = prompt.shape[1] + nb * block_length
        num_transfer = get_num_transfer_tokens(x[:, lo:lo + block_length] == mask_id, steps)
        for i in range(steps):
            mask_index = x == mask_id
            logits = fwd.full(x)[0]
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


def _transfer(logits, mask_index, x, num_transfer_tokens, threshold, factor):
    if factor is None:
        return get_transfer_index(logits, mask_index, x, num_transfer_tokens, threshold)
    return get_transfer_index_dynamic(logits, mask_index, x, factor)


def fast_dllm_generate(fwd: Forward, prompt, *, gen_length, block_length, mask_id, cache, steps=None,
                       threshold=None, factor=None):
    """NVlabs/Fast-dLLM `generate` / `generate_with_prefix_cache` / `generate_with_dual_cache`
    for `cache` = "none" / "prefix" / "dual". Returns (x, nfe)."""
    p = prompt.shape[1]
    x = np.full((prompt.shape[0], p + gen_length), mask_id, dtype=np.int32)
    x[:, :p] = prompt
    total = x.shape[1]
    num_blocks = gen_length // block_length
    steps_per_block = (steps or gen_length) // num_blocks
    nfe = 0
    for nb in range(num_blocks):
        start, end = p + nb * block_length, p + (nb + 1) * block_length
        num_transfer_tokens = get_num_transfer_tokens(x[:, start:end] == mask_id, steps_per_block)
        if cache == "none":
            i = 0
            while True:
                nfe += 1
                mask_index = x == mask_id
                logits = fwd.full(x)[0]
                mask_index[:, end:] = False
                x0, transfer_index = _transfer(logits, mask_index, x, num_transfer_tokens[:, i], threshold, factor)
                x[transfer_index] = x0[transfer_index]
                i += 1
                if (x[:, start:end] == mask_id).sum() == 0:
                    break
            continue
        logits, k_all, v_all = fwd.full(x)  # cache init + first update
        mask_index = x == mask_id
        mask_index[:, end:] = False
        x0, transfer_index = _transfer(logits, mask_index, x, num_transfer_tokens[:, 0], threshold, factor)
        x[transfer_index] = x0[transfer_index]
        nfe += 1
        i = 1
        while True:
            if (x[:, start:end] == mask_id).sum() == 0:
                break
            nfe += 1
            if cache == "prefix":
                mask_index = x[:, start:] == mask_id
                mask_index[:, block_length:] = False
                logits = fwd.window(x, start, total, k_all, v_all, np.arange(start))
                x0, transfer_index = _transfer(logits, mask_index, x[:, start:], num_transfer_tokens[:, i],
                                               threshold, factor)
                x[:, start:] = np.where(transfer_index, x0, x[:, start:])
            else:
                mask_index = x[:, start:end] == mask_id
                cached = np.concatenate([np.arange(start), np.arange(end, total)])
                logits = fwd.window(x, start, end, k_all, v_all, cached)
                x0, transfer_index = _transfer(logits, mask_index, x[:, start:end], num_transfer_tokens[:, i],
                                               threshold, factor)
                x[:, start:end] = np.where(transfer_index, x0, x[:, start:end])
            i += 1
    return x, nfe

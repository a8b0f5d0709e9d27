"""The block-wise decode loop (NumPy only): one loop, a cache strategy and a commit rule.

The host keeps a [B, S] grid of slots (S = longest prompt + gen_len). Prompts are left-padded
so every request's generation starts at the same slot and blocks line up across the batch;
positions are counted over each row's real tokens, so a row decodes exactly as it would
alone. Each step asks the cache strategy which slots to recompute, pads them to the window,
cache and row buckets, runs one executor step, turns the predictions of the current block's
masked slots into confidences and lets the commit rule choose what to commit.

Axes: B batch (bucketed), S slots, L layers, Hkv kv heads, Dh head width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from buckets._sets import (DEFAULT_BATCH_BUCKETS, BucketKey, BucketSet, cache_buckets, pad_axis,
                          window_buckets)
from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.models._masks import visibility_from_positions
from dlm_jax.runtime.cache import WindowPlan, make_cache
from dlm_jax.runtime.commit import TopKRule, confidence_scores, make_rule, num_transfer_tokens
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.step import Executor, StepInputs, StepOutputs


@dataclasses.dataclass
class DecodeStats:
    nfe: int = 0  # forward passes of the batch
    request_nfe: list[int] = dataclasses.field(default_factory=list)  # passes each request took part in
    tokens_committed: int = 0
    seconds: float = 0.0
    first_block_seconds: float | None = None  # time to the first completed block
    commit_histogram: dict[int, int] = dataclasses.field(default_factory=dict)  # tokens/step -> count
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # executor time per step
    host_seconds: list[float] = dataclasses.field(default_factory=list)  # host time per step
    peak_rss_mb: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens_committed / max(self.nfe, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_committed / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"nfe": self.nfe, "request_nfe": self.request_nfe,
                "tokens_committed": self.tokens_committed,
                "tokens_per_forward": round(self.tokens_per_forward, 3),
                "seconds": round(self.seconds, 4), "tokens_per_second": round(self.tokens_per_second, 1),
                "first_block_seconds": None if self.first_block_seconds is None else round(self.first_block_seconds, 4),
                "commit_histogram": dict(sorted(self.commit_histogram.items())),
                "median_step_seconds": float(np.median(self.step_seconds)) if self.step_seconds else 0.0,
                "median_host_seconds": float(np.median(self.host_seconds)) if self.host_seconds else 0.0,
                "peak_rss_mb": round(self.peak_rss_mb, 1)}


@dataclasses.dataclass
class DecodeOutput:
    sequences: list[np.ndarray]  # per request: the gen_len generated ids (EOS-filled after a stop)
    stats: DecodeStats


class BlockDecoder:
    """Decodes batches of token-id prompts with any cache mode and commit rule."""

    def __init__(self, executor: Executor, model_config: ModelConfig, *,
                 windows: BucketSet | None = None, caches: BucketSet | None = None,
                 batches: BucketSet | None = None):
        if model_config.mask_token_id is None:
            raise ConfigError("the model config has no mask_token_id; diffusion decoding needs one")
        self.executor = executor
        self.model_config = model_config
        self.windows = windows or window_buckets(model_config.max_seq_len)
        self.caches = caches or cache_buckets(model_config.max_seq_len)
        self.batches = batches or BucketSet(DEFAULT_BATCH_BUCKETS, "batch bucket")

    @property
    def max_tokens(self) -> int:
        """The longest prompt + generation this decoder can hold."""
        return min(self.windows.largest, self.caches.largest, self.model_config.max_seq_len)

    def _check(self, lens: Sequence[int], cfg: DecodeConfig) -> None:
        """Reject an empty batch, an empty prompt or a sequence longer than any bucket."""
        if len(lens) == 0:
            raise ConfigError("no prompts given")
        if min(lens) == 0:
            raise ConfigError(f"prompt {list(lens).index(0)} is empty")
        total = max(lens) + cfg.gen_len
        if total > self.max_tokens:
            raise ConfigError(f"prompt ({max(lens)} tokens) + gen_len ({cfg.gen_len}) = {total} tokens exceeds "
                              f"the limit of {self.max_tokens} (largest cache bucket / max_seq_len)")
        self.batches.select(len(lens))

    def bucket_keys(self, prompt_lens: Sequence[int], cfg: DecodeConfig) -> list[BucketKey]:
        """Every bucket key a decode of prompts with these lengths can use (for warm-up)."""
        self._check(prompt_lens, cfg)
        p_max, total = max(prompt_lens), max(prompt_lens) + cfg.gen_len
        b = self.batches.select(len(prompt_lens))
        strategy = make_cache(cfg.cache)
        shift = 1 if self.model_config.logit_shift else 0
        r = self.windows.select(cfg.block_len)
        keys = set()
        for blk in range(cfg.n_blocks):
            lo = p_max + blk * cfg.block_len
            for step in (0, 1):
                plan = strategy.plan(step, lo - shift, lo + cfg.block_len, total)
                keys.add(BucketKey(b, self.windows.select(len(plan.window)),
                                   self.caches.select(len(plan.cached)), r, cfg.temperature > 0))
        return sorted(keys)

    def warmup(self, prompt_lens: Sequence[int], cfg: DecodeConfig) -> int:
        """Compile, ahead of time, every bucket such a decode needs; returns how many were new."""
        return self.executor.warmup(self.bucket_keys(prompt_lens, cfg))

    def decode(self, prompts: Sequence[Sequence[int]], cfg: DecodeConfig, *,
               seeds: Sequence[int] | None = None,
               on_block: Callable[[int, list[np.ndarray]], None] | None = None) -> DecodeOutput:
        """Decode `cfg.gen_len` tokens after each prompt.

        Args:
          prompts: token ids per request (non-empty).
          seeds: per-request sampling seeds (default `cfg.seed` for every request).
          on_block: called after each block with (block index, generated ids so far).
        """
        mc = self.model_config
        n = len(prompts)
        lens = [len(p) for p in prompts]
        self._check(lens, cfg)
        p_max = max(lens)
        total = p_max + cfg.gen_len
        b = self.batches.select(n)
        x = np.full((b, total), mc.mask_token_id, dtype=np.int32)
        valid = np.zeros((b, total), dtype=bool)
        for r, prompt in enumerate(prompts):
            x[r, p_max - lens[r]:p_max] = np.asarray(prompt, dtype=np.int32)
            valid[r, p_max - lens[r]:] = True
        state = _State(x=x, valid=valid, pos=np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32),
                       active=np.arange(b) < n)
        kv_shape = (mc.n_layers, b, total, mc.n_kv_heads, mc.head_dim)
        kv = (np.zeros(kv_shape, mc.dtype), np.zeros(kv_shape, mc.dtype)) if cfg.cache != "none" else None
        seeds = list(seeds) if seeds is not None else [cfg.seed] * n
        rngs = [np.random.default_rng(s) for s in seeds] + [None] * (b - n)
        strategy = make_cache(cfg.cache)
        fixed_rule = None if cfg.rule == "topk" else make_rule(cfg.rule, **cfg.rule_params)
        shift = 1 if mc.logit_shift else 0
        stats = DecodeStats(request_nfe=[0] * n)
        hist: Counter[int] = Counter()
        start = time.perf_counter()
        for blk in range(cfg.n_blocks):
            lo, hi = p_max + blk * cfg.block_len, p_max + (blk + 1) * cfg.block_len
            if not state.active.any():
                break
            masked = (x[:, lo:hi] == mc.mask_token_id) & state.active[:, None]
            rule = fixed_rule or TopKRule(num_transfer_tokens(masked, cfg.steps_per_block))
            step = 0
            while True:
                t0 = time.perf_counter()
                plan = strategy.plan(step, lo - shift, hi, total)
                inputs, rows = self._inputs(plan, state, kv, lo - shift, cfg)
                t1 = time.perf_counter()
                out = self.executor.step(inputs)
                t2 = time.perf_counter()
                if plan.store:
                    state.kv_version += 1
                    w = len(plan.window)
                    kv[0][:, :, plan.window] = out.k_new[:, :, :w]
                    kv[1][:, :, plan.window] = out.v_new[:, :, :w]
                cand = (x[:, lo:hi] == mc.mask_token_id) & state.active[:, None]
                x0, conf = self._predict(out, rows, cand, cfg, rngs)
                commit = rule.select(conf, cand, step=step)
                if fixed_rule is not None and ((cand.any(1) & ~commit.any(1)).any() or step > cfg.block_len):
                    # Only the fixed step count of topk may leave a step empty; anything else
                    # would spin forever on an unfinishable block.
                    raise RuntimeError(f"commit rule {cfg.rule!r} committed nothing for a row with candidates")
                x[:, lo:hi] = np.where(commit, x0, x[:, lo:hi])
                counts = commit.sum(axis=1)
                for r in range(n):
                    if cand[r].any():
                        stats.request_nfe[r] += 1
                        hist[int(counts[r])] += 1
                stats.tokens_committed += int(counts[:n].sum())
                stats.nfe += 1
                step += 1
                stats.step_seconds.append(t2 - t1)
                stats.host_seconds.append((t1 - t0) + (time.perf_counter() - t2))
                left = ((x[:, lo:hi] == mc.mask_token_id) & state.active[:, None]).any()
                if (cfg.rule == "topk" and step == cfg.steps_per_block) or (cfg.rule != "topk" and not left):
                    break
            self._end_block(state, lo, hi, cfg)
            if stats.first_block_seconds is None:
                stats.first_block_seconds = time.perf_counter() - start
            if on_block is not None:
                on_block(blk, [x[r, p_max:].copy() for r in range(n)])
        stats.seconds = time.perf_counter() - start
        stats.commit_histogram = dict(hist)
        stats.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return DecodeOutput([x[r, p_max:].copy() for r in range(n)], stats)

    def _end_block(self, state: _State, lo: int, hi: int, cfg: DecodeConfig) -> None:
        eos = self.model_config.eos_token_id
        if not cfg.stop_on_eos_block or eos is None:
            return
        done = state.active & (state.x[:, lo:hi] == eos).all(axis=1)
        state.x[done, hi:] = eos
        state.active &= ~done

    def _inputs(self, plan: WindowPlan, state: _State, kv, row_start: int,
                cfg: DecodeConfig) -> tuple[StepInputs, np.ndarray]:
        """Pad the planned window/cache slots to their buckets; return inputs and the window
        rows that predict the block's slots."""
        mc = self.model_config
        win, cached = plan.window, plan.cached
        w = self.windows.select(len(win))
        tokens = pad_axis(state.x[:, win], w, axis=1, value=mc.mask_token_id)
        # Within a block every step after the first has the same slots and an unchanged cache:
        # positions, visibility, cache gathers and rows are reused, only the tokens change.
        memo_key = (state.kv_version, row_start, int(win[0]), len(win), len(cached),
                    int(cached[0]) if len(cached) else -1, int(cached[-1]) if len(cached) else -1)
        if state.memo is None or state.memo[0] != memo_key:
            state.memo = (memo_key, self._static_inputs(win, cached, w, state, kv, row_start, cfg))
        positions, vis, k_cache, v_cache, logit_rows, rows = state.memo[1]
        inputs = StepInputs(tokens=tokens, positions=positions, visibility=vis, k_cache=k_cache,
                            v_cache=v_cache, logit_rows=logit_rows, full_logits=cfg.temperature > 0)
        return inputs, rows

    def _static_inputs(self, win, cached, w, state: _State, kv, row_start: int, cfg: DecodeConfig):
        mc = self.model_config
        p = self.caches.select(len(cached))
        r = self.windows.select(cfg.block_len)
        positions = pad_axis(state.pos[:, win], w, axis=1)
        q_valid = pad_axis(state.valid[:, win], w, axis=1, value=False)
        k_pos = np.concatenate([pad_axis(state.pos[:, cached], p, axis=1), positions], axis=1)
        k_valid = np.concatenate([pad_axis(state.valid[:, cached], p, axis=1, value=False), q_valid], axis=1)
        vis = visibility_from_positions(mc.attention, positions, k_pos, k_valid, block_size=mc.block_size)
        if kv is None:
            shape = (mc.n_layers, state.x.shape[0], p, mc.n_kv_heads, mc.head_dim)
            k_cache = v_cache = np.zeros(shape, mc.dtype)
        else:
            k_cache = pad_axis(kv[0][:, :, cached], p, axis=2)
            v_cache = pad_axis(kv[1][:, :, cached], p, axis=2)
        rows = np.arange(row_start, row_start + cfg.block_len) - win[0]
        logit_rows = np.ascontiguousarray(
            np.broadcast_to(pad_axis(rows, r, axis=0), (state.x.shape[0], r)).astype(np.int32))
        return positions, vis, k_cache, v_cache, logit_rows, rows

    def _predict(self, out: StepOutputs, rows: np.ndarray, cand: np.ndarray, cfg: DecodeConfig,
                 rngs: list) -> tuple[np.ndarray, np.ndarray]:
        """Proposed tokens and confidences [B, block] for the block's slots."""
        k = len(rows)
        if cfg.temperature > 0:
            x0, top1, top2, ent = _sample(out.logits[:, :k], cand, cfg.temperature, rngs)
        else:
            x0, top1, top2, ent = (out.top_token[:, :k], out.top_prob[:, :k], out.second_prob[:, :k],
                                   out.entropy[:, :k])
        conf = confidence_scores(cfg.confidence, top1.astype(np.float64), top2.astype(np.float64),
                                 ent.astype(np.float64))
        if cfg.remasking == "random":
            conf = np.zeros_like(conf)
            for r, rng in enumerate(rngs):
                if rng is not None and cand[r].any():
                    conf[r] = rng.random(k)
        if cfg.defer_eos and self.model_config.eos_token_id is not None:
            floor = -np.log(self.model_config.vocab_size) if cfg.confidence == "entropy" else 0.0
            conf = np.where(x0 == self.model_config.eos_token_id, floor, conf)
        return x0.astype(np.int32), conf


@dataclasses.dataclass
class _State:
    x: np.ndarray  # [B, S] int32 tokens (mask id where undecided)
    valid: np.ndarray  # [B, S] bool, False at left padding and padded batch rows
    pos: np.ndarray  # [B, S] int32 absolute positions
    active: np.ndarray  # [B] bool, False for padded rows and finished requests
    kv_version: int = 0  # bumped whenever the host K/V cache is written
    memo: tuple | None = None  # (key, step inputs that stay fixed within a block)


def _sample(logits: np.ndarray, cand: np.ndarray, temperature: float, rngs: list):
    """LLaDA's Gumbel-max in float64: x0 = argmax(exp(logits) / (-log u)^T), confidence = the
    softmax probability of x0. Noise is drawn per request from its own generator, only while
    it has candidates, so batching does not change a request's samples."""
    logits = logits.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x0 = logits.argmax(-1)
    for r, rng in enumerate(rngs):
        if rng is not None and cand[r].any():
            gumbel = (-np.log(rng.random(logits[r].shape))) ** temperature
            x0[r] = np.argmax(np.exp(logits[r]) / gumbel, axis=-1)
    top1 = np.take_along_axis(probs, x0[..., None], -1)[..., 0]
    top2 = np.sort(probs, axis=-1)[..., -2]
    ent = -(probs * np.log(np.maximum(probs, 1e-300))).sum(-1)
    return x0, top1, top2, ent

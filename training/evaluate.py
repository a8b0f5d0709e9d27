"""Task accuracy of a model under any decoder setting: held-out prompts, decoded answers,
verified scores, NFE and throughput."""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.training.data import TASKS, make_split


def evaluate(handle: Any, task: str, cfg: DecodeConfig, *, n: int = 200, batch_size: int = 8,
             seed: int = 0, progress: bool = True, keep: int = 0, chat: bool | None = None) -> dict[str, Any]:
    """Decode `n` held-out examples of `task` with `handle` (a `dlm_jax.Model`) and score them.
    Prompts take the model's prompt format (`handle.prompt_format`, chat for the shipped models)
    unless `chat` says otherwise.

    Returns accuracy, mean NFE per request, tokens/s (committed tokens over decode time, after
    warm-up), the first `keep` (prompt, completion, correct) triples, and for a speculative
    schedule (ISD) its rates over all prompts (`speculation`: TPF, alpha_i, accepted-length
    histogram, IAR when measured, query rows per token).
    """
    from tqdm import tqdm

    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; known: {sorted(TASKS)}")
    for name, value in (("n", n), ("batch_size", batch_size)):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    examples = make_split(TASKS[task], n, split="heldout", seed=seed)
    from dlm_jax.runtime.decoder import merge_speculation, speculation_summary
    from dlm_jax.techniques.tide.experts import merge_placement

    correct, nfe, tokens, seconds, samples, spec, placed = [], [], 0, 0.0, [], {}, {}
    if hasattr(handle, "calibrated"):  # expert placement: calibrated once, on the first batch
        cfg = handle.calibrated(cfg, [handle.encode(ex.prompt, chat=chat) for ex in examples[:batch_size]])
    for i in tqdm(range(0, n, batch_size), desc=f"eval {task}", disable=not progress, file=sys.stderr):
        chunk = examples[i:i + batch_size]
        prompts = [handle.encode(ex.prompt, chat=chat) for ex in chunk]
        handle.decoder.warmup([len(p) for p in prompts], cfg)
        t0 = time.perf_counter()
        res = handle.generate(prompts, cfg)
        seconds += time.perf_counter() - t0
        nfe += res.stats.request_nfe
        tokens += res.stats.tokens_committed
        spec = merge_speculation(spec, res.stats.speculation)
        placed = merge_placement(placed, res.stats.placement)
        for ex, text in zip(chunk, res.texts):
            ok = TASKS[task].score(text, ex)
            correct.append(ok)
            if len(samples) < keep:
                samples.append({"prompt": ex.prompt, "completion": text, "answer": ex.answer, "correct": ok})
    return {"task": task, "n": n, "accuracy": float(np.mean(correct)), "mean_nfe": float(np.mean(nfe)),
            "tokens_per_second": tokens / seconds if seconds else 0.0, "seconds": seconds, "samples": samples,
            **({"speculation": speculation_summary(spec)} if spec else {}),
            **({"placement": placed} if placed else {})}


def chance_accuracy(task: str, *, n: int = 200, seed: int = 0) -> float:
    """Accuracy of answering all `n` held-out prompts of `task` with one fixed completion, the
    best of the split's own answers: the floor a model has to clear (about 5% on GSM-lite,
    whose running totals pile up on small numbers)."""
    examples = make_split(TASKS[task], n, split="heldout", seed=seed)
    score = TASKS[task].score
    return max(float(np.mean([score(c.answer, ex) for ex in examples])) for c in examples)

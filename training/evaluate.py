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


def evaluate(handle: Any, task: str, cfg: DecodeConfig, *, n: int = 200, max_batch: int | None = None,
             seed: int = 0, progress: bool = True, keep: int = 0, chat: bool | None = None) -> dict[str, Any]:
    """Decode `n` held-out examples of `task` with `handle` (a `dlm_jax.Model`) and score them.
    The prompts stream through the continuous-batching engine (`dlm_jax.Engine`), at most
    `max_batch` at once (default: the engine's). Prompts take the model's prompt format
    (`handle.prompt_format`, chat for the shipped models) unless `chat` says otherwise.

    Returns accuracy, mean NFE per request, tokens/s (committed tokens over the decode's wall
    time, less the time it waited for compiles), the first `keep` (prompt, completion,
    correct) triples, and for a speculative schedule (ISD) its rates over all prompts
    (`speculation`: TPF, alpha_i, accepted-length histogram, IAR when measured, query rows per
    token).
    """
    from tqdm import tqdm

    from dlm_jax._engine import Engine

    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; known: {sorted(TASKS)}")
    for name, value in (("n", n), ("max_batch", max_batch)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    examples = make_split(TASKS[task], n, split="heldout", seed=seed)
    from dlm_jax.runtime.decoder import merge_speculation, speculation_summary
    from dlm_jax.techniques.tide.experts import merge_placement

    correct, samples, spec, placed = [], [], {}, {}
    prompts = [handle.encode(ex.prompt, chat=chat) for ex in examples]
    if hasattr(handle, "calibrated"):  # expert placement: calibrated once, on the first prompts
        cfg = handle.calibrated(cfg, prompts[:max_batch or 8])
    engine = Engine(handle, cfg, max_batch=max_batch)
    built = handle.decoder.build_counts()
    t0 = time.perf_counter()
    try:
        handles = [engine.submit(p, cfg) for p in prompts]
        with tqdm(total=n, desc=f"eval {task}", disable=not progress, file=sys.stderr) as bar:
            done = 0
            while engine.step():
                now = sum(h.done for h in handles)
                bar.update(now - done)
                done = now
        results = [h.result() for h in handles]
    finally:
        engine.close()
    seconds = time.perf_counter() - t0 - (handle.decoder.build_counts() - built).compile_wait_seconds
    tokens = sum(r.stats.decode.tokens_committed for r in results if r.stats.decode is not None)
    for ex, res in zip(examples, results):
        ok = TASKS[task].score(res.text, ex)
        correct.append(ok)
        if res.stats.decode is not None:
            spec = merge_speculation(spec, res.stats.decode.speculation)
            placed = merge_placement(placed, res.stats.decode.placement)
        if len(samples) < keep:
            samples.append({"prompt": ex.prompt, "completion": res.text, "answer": ex.answer, "correct": ok})
    return {"task": task, "n": n, "accuracy": float(np.mean(correct)),
            "mean_nfe": float(np.mean([r.stats.nfe for r in results])),
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0, "seconds": seconds, "samples": samples,
            "max_batch": engine.max_batch, "row_utilisation": round(engine.stats.utilisation, 4),
            **({"speculation": speculation_summary(spec)} if spec else {}),
            **({"placement": placed} if placed else {})}


def chance_accuracy(task: str, *, n: int = 200, seed: int = 0) -> float:
    """Accuracy of answering all `n` held-out prompts of `task` with one fixed completion, the
    best of the split's own answers: the floor a model has to clear (about 5% on GSM-lite,
    whose running totals pile up on small numbers)."""
    examples = make_split(TASKS[task], n, split="heldout", seed=seed)
    score = TASKS[task].score
    return max(float(np.mean([score(c.answer, ex) for ex in examples])) for c in examples)

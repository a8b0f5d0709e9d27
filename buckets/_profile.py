"""Profile an executor: median step latency per (window, cache) bucket."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.buckets import cache_buckets, window_buckets
from dlm_jax.runtime.latency import LatencyEntry, LatencyTable
from dlm_jax.runtime.step import Executor, OutputRequest, StepInputs


def synthetic_inputs(cfg: ModelConfig, *, batch: int, window: int, cache: int, rows: int) -> StepInputs:
    rng = np.random.default_rng(0)
    kv = rng.normal(size=(cfg.n_layers, batch, cache, cfg.n_kv_heads, cfg.head_dim)).astype(cfg.dtype)
    return StepInputs(
        tokens=rng.integers(0, cfg.vocab_size, (batch, window)).astype(np.int32),
        positions=np.broadcast_to(np.arange(cache, cache + window, dtype=np.int32), (batch, window)).copy(),
        visibility=np.ones((batch, window, cache + window), dtype=bool),
        k_cache=kv, v_cache=kv.copy(),
        logit_rows=np.broadcast_to(np.arange(rows, dtype=np.int32), (batch, rows)).copy(),
        want=OutputRequest(kv=False))


def profile_executor(executor: Executor, cfg: ModelConfig, *, windows: Sequence[int],
                     caches: Sequence[int], batch: int = 1, repeats: int = 20,
                     device: str = "cpu", progress: bool = True) -> LatencyTable:
    from tqdm import tqdm

    pairs = [(w, p) for p in caches for w in windows]
    entries = []
    for w, p in tqdm(pairs, desc="profiling buckets", disable=not progress, file=sys.stderr):
        rows = min(w, 32)
        inputs = synthetic_inputs(cfg, batch=batch, window=w, cache=p, rows=rows)
        for _ in range(2):
            executor.step(inputs)  # compile + warm caches
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            executor.step(inputs)
            times.append((time.perf_counter() - t0) * 1e3)
        entries.append(LatencyEntry(w, p, batch, rows, float(np.median(times)),
                                    float(np.percentile(times, 10)), float(np.percentile(times, 90))))
    model = {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "vocab_size": cfg.vocab_size, "ffn": cfg.ffn}
    return LatencyTable(device, model, entries)


def _check_writable(folder: Path) -> None:
    """Fail before measuring when the output folder cannot take a file (read-only, full)."""
    import tempfile

    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".write-test-", dir=folder)
    os.close(fd)
    os.unlink(name)


def profile_model(path: str | None, *, out: Path, windows: Sequence[int] | None = None,
                  caches: Sequence[int] | None = None, batch: int = 1, repeats: int = 20,
                  quant: str | None = None) -> LatencyTable:
    """`dlm-jax profile`: write `<out>.json` and `<out>.png` for a checkpoint (or a random tiny
    model when `path` is None), its weights quantized to `quant` ("int8", "fp8") when given
    (`dlm_jax.models.quant`)."""
    import jax

    import dlm_jax
    from dlm_jax._integrity import manifest_name, write_manifest
    from dlm_jax.executors.jax_executor import JaxExecutor

    if path is None:
        from dlm_jax.models._params import tiny_byte_config

        model = dlm_jax.init_model(tiny_byte_config()[1])
    else:
        model = dlm_jax.load_pretrained(path)
    stored = getattr(model, "quant", None)  # a checkpoint stored quantized loads so (as `dlm_jax.load`)
    if quant is not None and stored not in (None, quant):
        raise ConfigError(f"quant={quant!r}: {path} is stored weight-only quantized as {stored!r}; profile it with "
                          f"quant={stored!r} or None")
    if quant is not None and stored is None:
        from dlm_jax.models.quant import quantize

        quantize(model, quant)
    cfg = model.config
    _check_writable(out.parent)
    windows = list(windows or [w for w in window_buckets(cfg.max_seq_len) if w <= 256])
    caches = list(caches if caches is not None else [0, max(c for c in cache_buckets(cfg.max_seq_len) if c <= cfg.max_seq_len // 2)])
    table = profile_executor(JaxExecutor(model), cfg, windows=windows, caches=caches, batch=batch,
                             repeats=repeats, device=jax.devices()[0].device_kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out.with_suffix(".json"))
    table.plot(out.with_suffix(".png"))
    write_manifest(out.parent, [out.with_suffix(".json").name, out.with_suffix(".png").name],
                   name=manifest_name(out))
    print(json.dumps({"json": str(out.with_suffix(".json")), "png": str(out.with_suffix(".png")),
                      "entries": len(table.entries)}))
    return table

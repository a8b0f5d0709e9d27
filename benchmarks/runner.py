"""The LiteRT runner against the JAX executor on this CPU: step latency, end-to-end decode,
bundle size, peak memory and task accuracy, for float32, int8 and int4 bundles.

    .venv/bin/python benchmarks/runner.py [--quick] [--models llada-tiny ...] [--repeats 20] [--n 32]

Models: the shipped llada-tiny and idlm-tiny, and a random ~25M-parameter model of
llada-tiny's family (d_model 512, 8 layers, 8 heads / 4 KV heads, FFN 1536, vocab 264). Each is
exported (`dlm_jax.tflite_export.bundle.export_bundle`, into a temporary directory removed at the end)
as fp32, int8 and int4 bundles holding the buckets measured below, and run by
`dlm_jax.executors.runner` (XNNPACK, 2 threads) next to `dlm_jax.executors.jax_executor.JaxExecutor` (XLA CPU).

1. Step latency per bucket (windows 32/64/128 x caches 0/64/128 at batch 1, and one batch-8
   bucket): one step with the window K/V returned, random tokens, full visibility, random
   cache. Both executors are warmed up (JAX compiled) first; then each repeat runs every
   executor once, in rotating order, so machine noise hits all of them alike. Reported:
   medians and `jax_ms / litert_ms` per bucket, and its geometric mean per model and
   quantisation (the target: the runner at least as fast per step as XLA, ratio >= 1).
2. End to end: held-out prompts (2 per task) decoded one by one with the default fast decoder
   (prefix cache, threshold 0.9, block 32, gen 64), executors interleaved prompt by prompt;
   seconds (median over passes) and NFE.
3. Sizes: `model.tflite` bytes per quantisation, and bytes per added bucket (the full bundle
   against a one-bucket one). Peak RSS (`ru_maxrss`) of one decode of the same prompts in a
   fresh subprocess per executor, so no process's memory pollutes another's.
4. Task accuracy (shipped models): `dlm_jax.training.evaluate` on each task, `--n` held-out prompts in
   batches of 8, with bundles exported for the longest encoded prompt of the split.

Writes <out>.json (everything, with machine and package versions), <out>.md (tables),
<out>.png (step latency per bucket) and <out>_buckets.png (ratio per bucket); progress on
stderr. `--quick`: 5 repeats, five buckets, shipped models only, n = 8, one pass (under 3 minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402
from dlm_jax.runtime.registry import decode_options  # noqa: E402

QUANTS = {"none": "fp32", "int8": "int8", "int4": "int4"}  # export name -> label
EXECUTORS = ("jax", *QUANTS.values())
STEP_BUCKETS = tuple(f"step_w{w}_p{p}_r32" for w in (32, 64, 128) for p in (0, 64, 128)) + ("step_w32_p64_r32_b8",)
QUICK_BUCKETS = ("step_w32_p0_r32", "step_w32_p128_r32", "step_w128_p0_r32", "step_w128_p128_r32", "step_w32_p64_r32_b8")
LARGE_SHAPE = dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536, head_dim=64)
MODELS = ("llada-tiny", "idlm-tiny", "random-25m")
GEN_LEN = 64
BLOCK_LEN = 32
E2E_PER_TASK = 2
_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def fast_decoder():
    import dlm_jax

    return dlm_jax.decode_config(gen_len=GEN_LEN, block_len=BLOCK_LEN)  # prefix cache + threshold 0.9


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model: a checkpoint directory, whether its task accuracy means anything
    (a random model's does not), and how many end-to-end passes to time."""

    name: str
    source: Path
    accuracy: bool
    e2e_passes: int


def model_spec(name: str, tmp: Path, *, e2e_passes: int) -> ModelSpec:
    if name != "random-25m":
        return ModelSpec(name, ROOT / "models" / name, True, e2e_passes)
    import dlm_jax

    shipped = dlm_jax.load(ROOT / "models" / "llada-tiny")
    config = dlm_jax.ModelConfig.from_dict({**shipped.config.to_dict(), **LARGE_SHAPE})
    path = tmp / name
    dlm_jax.save_pretrained(dlm_jax.init_model(config), path, tokenizer=shipped.tokenizer)
    return ModelSpec(name, path, False, max(1, e2e_passes // 3))  # its decode runs 64 NFE per prompt


# ---------------------------------------------------------------------------------------------
# Prompts and buckets


def e2e_prompts(handle: Any, tasks: Sequence[str]) -> list[list[int]]:
    from dlm_jax.training.data import TASKS, make_split

    return [handle.encode(ex.prompt) for t in tasks for ex in make_split(TASKS[t], E2E_PER_TASK, split="heldout")]


def longest_prompt(handle: Any, tasks: Sequence[str], n: int) -> int:
    """The longest encoded prompt of the held-out split `dlm_jax.training.evaluate` decodes."""
    from dlm_jax.training.data import TASKS, make_split

    return max(len(handle.encode(ex.prompt)) for t in tasks for ex in make_split(TASKS[t], n, split="heldout"))


def bundle_keys(buckets: Sequence[str], handle: Any, prompts: list[list[int]], max_prompt: int | None) -> list:
    """The step-latency buckets, the batch-1 buckets of the end-to-end prompts and, for
    accuracy, the batch-8 buckets of every prompt length up to `max_prompt`."""
    from dlm_jax.tflite_export.bundle import buckets_for_prompts, parse_bucket

    cfg = fast_decoder()
    keys = {parse_bucket(b) for b in buckets}
    for p in prompts:
        keys.update(handle.decoder.bucket_keys([len(p)], cfg))
    if max_prompt is not None:
        keys.update(buckets_for_prompts(handle.config, cfg, max_prompt=max_prompt, batches=(8,)))
    return sorted(keys)


# ---------------------------------------------------------------------------------------------
# Export and sizes


@contextlib.contextmanager
def shared_float_conversion() -> Iterator[None]:
    """Within the block, `export_bundle` converts a given signature list once: the float
    flatbuffer does not depend on the quantisation (applied after it), and conversion is most
    of an export's time (seconds per signature for the 25M model)."""
    import dlm_jax.tflite_export._convert as convert

    original, cache = convert.convert_signatures, {}

    def converted(signatures, **kwargs) -> bytes:
        sigs = list(signatures)
        names = tuple(s[0] for s in sigs)
        if names not in cache:
            cache[names] = original(sigs, **kwargs)
        return cache[names]

    convert.convert_signatures = converted
    try:
        yield
    finally:
        convert.convert_signatures = original


def export_bundles(spec: ModelSpec, handle: Any, keys: list, tmp: Path) -> dict[str, Any]:
    """fp32 / int8 / int4 bundles of `keys`; their paths, export seconds, file sizes and the
    bytes one more bucket adds (full bundle against a bundle of the first bucket alone)."""
    from flax import nnx

    from dlm_jax.tflite_export._convert import convert_signatures, decode_signature
    from dlm_jax.tflite_export.bundle import export_bundle, quantize_tflite

    out: dict[str, Any] = {"buckets": len(keys), "paths": {}, "export_seconds": {}, "model_bytes": {}}
    with shared_float_conversion():
        for quant, label in QUANTS.items():
            t0 = time.perf_counter()
            res = export_bundle(spec.source, tmp / f"{spec.name}-{label}", keys=keys, decode=fast_decoder(),
                                quant=quant, latency_repeats=1)
            out["paths"][label] = str(res.path)
            out["export_seconds"][label] = round(time.perf_counter() - t0, 2)
            out["model_bytes"][label] = res.model_bytes
            _log(f"{spec.name}: exported {label} ({len(keys)} buckets, {res.model_bytes / 2**20:.2f} MiB, "
                 f"{out['export_seconds'][label]:.1f} s)")
    graphdef, state = nnx.split(handle.model)
    one = convert_signatures([decode_signature(graphdef, state, handle.config, keys[0])])
    out["one_bucket_bytes"] = {label: len(quantize_tflite(one, quant)) for quant, label in QUANTS.items()}
    out["bytes_per_added_bucket"] = {label: round((out["model_bytes"][label] - out["one_bucket_bytes"][label])
                                                  / max(len(keys) - 1, 1))
                                     for label in QUANTS.values()}
    out["weights_float32_bytes"] = 4 * param_count(handle)
    return out


def param_count(handle: Any) -> int:
    import dlm_jax

    return dlm_jax.param_count(handle.config)


# ---------------------------------------------------------------------------------------------
# Step latency


def random_inputs(config: Any, key: Any, rng: np.random.Generator) -> Any:
    """A realistic step of bucket `key`: random tokens and cache, every slot visible, the
    window's K/V asked for."""
    from dlm_jax.runtime.step import OutputRequest, StepInputs

    b, w, p, r = key.batch, key.window, key.cache, key.rows
    cache = (config.n_layers, b, p, config.n_kv_heads, config.head_dim)
    dtype = np.dtype(config.dtype)
    return StepInputs(tokens=rng.integers(0, config.vocab_size, (b, w), dtype=np.int32),
                      positions=np.broadcast_to(np.arange(p, p + w, dtype=np.int32), (b, w)).copy(),
                      visibility=np.ones((b, w, p + w), bool),
                      k_cache=rng.standard_normal(cache).astype(dtype), v_cache=rng.standard_normal(cache).astype(dtype),
                      logit_rows=np.broadcast_to(np.arange(r, dtype=np.int32), (b, r)).copy(),
                      want=OutputRequest(kv=True))


def time_interleaved(executors: dict[str, Any], inputs: Any, repeats: int) -> dict[str, list[float]]:
    """Milliseconds per step of each executor; every repeat runs each once, the order rotating."""
    names = list(executors)
    for ex in executors.values():
        ex.step(inputs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            executors[name].step(inputs)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def step_latency(executors: dict[str, Any], config: Any, buckets: Sequence[str], repeats: int) -> list[dict[str, Any]]:
    from dlm_jax.runtime.step import signature_name
    from dlm_jax.tflite_export.bundle import parse_bucket

    keys = [parse_bucket(b) for b in buckets]
    for ex in executors.values():
        ex.warmup(keys)
    rng = np.random.default_rng(0)
    rows = []
    for key in keys:
        times = time_interleaved(executors, random_inputs(config, key, rng), repeats)
        med = {n: float(np.median(t)) for n, t in times.items()}
        rows.append({"bucket": signature_name(key), "batch": key.batch, "window": key.window, "cache": key.cache,
                     "rows": key.rows, "median_ms": {n: round(v, 4) for n, v in med.items()},
                     "p10_ms": {n: round(float(np.percentile(t, 10)), 4) for n, t in times.items()},
                     "p90_ms": {n: round(float(np.percentile(t, 90)), 4) for n, t in times.items()},
                     "jax_over_litert": {q: round(med["jax"] / med[q], 4) for q in QUANTS.values()}})
        _log(f"  {rows[-1]['bucket']:>22}: " + ", ".join(f"{n} {v:.2f} ms" for n, v in med.items()))
    return rows


def gemm_peak_gflops(n: int = 1024, repeats: int = 10) -> dict[str, float]:
    """The hardware limit the steps are held against: fp32 GEMM throughput of this CPU as
    NumPy's BLAS reaches it on [n, n] x [n, n] (median of `repeats`)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return {"n": n, "gflops": round(2 * n**3 / float(np.median(times)) / 1e9, 2)}


def step_matmul_flops(config: Any, bucket: str) -> int:
    """Matmul FLOPs of one step of `bucket` (projections, attention, FFN, LM head over its
    rows), from the analytic step graph."""
    from dlm_jax.lowering._analytic import analytic_graph
    from dlm_jax.lowering.graph import MATMUL_OPS, op_flops
    from dlm_jax.tflite_export.bundle import parse_bucket

    graph = analytic_graph(config, parse_bucket(bucket))
    return int(sum(op_flops(graph, op) for op in graph.ops if op.opcode in MATMUL_OPS))


def add_hardware_limit(rows: list[dict[str, Any]], config: Any, peak: dict[str, float]) -> None:
    """Per bucket: matmul GFLOP/s each executor reached and its share of the GEMM peak."""
    for r in rows:
        flops = step_matmul_flops(config, r["bucket"])
        r["matmul_flops"] = flops
        r["gflops"] = {n: round(flops / (ms / 1e3) / 1e9, 2) for n, ms in r["median_ms"].items()}
        r["of_gemm_peak"] = {n: round(g / peak["gflops"], 3) for n, g in r["gflops"].items()}


def ratio_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per quantisation: geometric mean, minimum and maximum of jax_ms / litert_ms over buckets."""
    out = {}
    for q in QUANTS.values():
        ratios = {r["bucket"]: r["jax_over_litert"][q] for r in rows}
        slowest = min(ratios, key=ratios.get)
        geomean = float(np.exp(np.mean(np.log(list(ratios.values())))))
        out[q] = {"geomean": round(geomean, 4), "min": ratios[slowest], "min_bucket": slowest,
                  "max": max(ratios.values()), "at_least_as_fast": geomean >= 1.0,
                  "buckets_litert_slower": sorted(b for b, v in ratios.items() if v < 1.0)}
    return out


# ---------------------------------------------------------------------------------------------
# End to end, accuracy, memory


def end_to_end(handles: dict[str, Any], prompts: list[list[int]], passes: int) -> dict[str, dict[str, Any]]:
    """Each prompt decoded by every handle in turn (order rotating), `passes` times; seconds are
    the median over passes of the whole set's decode time."""
    cfg = fast_decoder()
    names = list(handles)
    for h in handles.values():
        for p in prompts:
            h.decoder.warmup([len(p)], cfg)
    totals = {n: [] for n in names}
    nfe, texts = {n: 0 for n in names}, {n: [] for n in names}
    for i in range(passes):
        secs = {n: 0.0 for n in names}
        for j, p in enumerate(prompts):
            shift = (i * len(prompts) + j) % len(names)
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                res = handles[name].generate(p, cfg)
                secs[name] += time.perf_counter() - t0
                if i == 0:
                    nfe[name] += res.stats.nfe
                    texts[name].append(res.token_ids[0])
        for n in names:
            totals[n].append(secs[n])
    out = {}
    for n in names:
        s = float(np.median(totals[n]))
        out[n] = {"seconds": round(s, 4), "passes": [round(t, 4) for t in totals[n]], "nfe": nfe[n],
                  "mean_nfe": nfe[n] / len(prompts), "ms_per_nfe": round(s * 1e3 / nfe[n], 3),
                  "jax_over_this": round(float(np.median(totals["jax"])) / s, 4),
                  "same_tokens_as_jax": float(np.mean([a == b for a, b in zip(texts[n], texts["jax"])]))}
    return out


def accuracy(handles: dict[str, Any], tasks: Sequence[str], n: int) -> dict[str, dict[str, Any]]:
    """`dlm_jax.training.evaluate` per task and handle (handles interleaved task by task), with the
    share of completions identical to the JAX executor's."""
    from dlm_jax.training.evaluate import evaluate

    cfg = fast_decoder()
    out: dict[str, dict[str, Any]] = {name: {"per_task": {}} for name in handles}
    completions: dict[str, list[str]] = {name: [] for name in handles}
    for task in tasks:
        for name, h in handles.items():
            r = evaluate(h, task, cfg, n=n, max_batch=8, progress=False, keep=n)
            out[name]["per_task"][task] = {"accuracy": r["accuracy"], "mean_nfe": r["mean_nfe"],
                                           "seconds": round(r["seconds"], 3)}
            completions[name] += [s["completion"] for s in r["samples"]]
        _log(f"  accuracy {task}: " + ", ".join(f"{k} {v['per_task'][task]['accuracy']:.3f}" for k, v in out.items()))
    for name, row in out.items():
        row["mean_accuracy"] = float(np.mean([t["accuracy"] for t in row["per_task"].values()]))
        row["same_completion_as_jax"] = float(np.mean([a == b for a, b in zip(completions[name], completions["jax"])]))
    return out


def peak_rss_mb() -> dict[str, float]:
    """This process's peak RSS in MB: `ru_maxrss`, and the kernel's high-water mark of its
    current address space (`VmHWM`, which an exec starts afresh)."""
    hwm = next((float(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:")), float("nan"))
    return {"ru_maxrss": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # Linux: KiB
            "vm_hwm": round(hwm / 1024, 1)}


def child_decode(kind: str, path: str, prompts_file: str) -> dict[str, Any]:
    """Runs in a fresh process: load a checkpoint (JAX) or a bundle (LiteRT), decode the
    prompts once, report peak RSS."""
    prompts = json.loads(Path(prompts_file).read_text())
    base = peak_rss_mb()
    t0 = time.perf_counter()
    if kind == "jax":
        import dlm_jax

        handle = dlm_jax.load(path, executor="jax")
    else:
        from dlm_jax.executors.runner import load_bundle

        handle = load_bundle(path)
    loaded = peak_rss_mb()
    nfe = sum(handle.generate(p, fast_decoder()).stats.nfe for p in prompts)
    peak = peak_rss_mb()
    return {"peak_rss_mb": peak["ru_maxrss"], "peak_vm_hwm_mb": peak["vm_hwm"],
            "peak_rss_before_load_mb": base["ru_maxrss"], "peak_rss_after_load_mb": loaded["ru_maxrss"],
            "cold_seconds": round(time.perf_counter() - t0, 3), "nfe": nfe, "jax_imported": "jax" in sys.modules}


_SPAWNER = """
import json, subprocess, sys
for line in sys.stdin:
    p = subprocess.run(json.loads(line), capture_output=True, text=True)
    print(json.dumps([p.returncode, p.stdout, p.stderr]), flush=True)
"""


class Spawner:
    """A small process, started before this one loads anything large, that starts the memory
    children. Linux carries `ru_maxrss` across fork and exec, so a child started from this
    process once it has grown would report this process's peak as its own."""

    def __init__(self):
        self._proc = subprocess.Popen([sys.executable, "-c", _SPAWNER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        self._proc.stdin.write(json.dumps(argv) + "\n")
        self._proc.stdin.flush()
        rc, out, err = json.loads(self._proc.stdout.readline())
        return rc, out, err

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait()


def memory(spec: ModelSpec, paths: dict[str, str], prompts: list[list[int]], tmp: Path,
           spawner: Spawner) -> dict[str, Any]:
    """`child_decode` of every executor, one fresh process each."""
    prompts_file = tmp / f"{spec.name}-prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    out = {}
    for name in EXECUTORS:
        kind, path = ("jax", str(spec.source)) if name == "jax" else ("bundle", paths[name])
        rc, stdout, stderr = spawner.run([sys.executable, __file__, "--child", kind, path, str(prompts_file)])
        if rc != 0:
            raise RuntimeError(f"{spec.name} {name} child failed:\n{stderr[-3000:]}")
        out[name] = json.loads(stdout.strip().splitlines()[-1])
        _log(f"  peak RSS {name}: {out[name]['peak_rss_mb']:.0f} MB (VmHWM {out[name]['peak_vm_hwm_mb']:.0f} MB, "
             f"cold decode {out[name]['cold_seconds']:.1f} s)")
    return out


# ---------------------------------------------------------------------------------------------
# One model


def bench_model(spec: ModelSpec, args: argparse.Namespace, tmp: Path, spawner: Spawner) -> dict[str, Any]:
    import dlm_jax
    from dlm_jax.executors.runner import load_bundle

    jax_handle = dlm_jax.load(spec.source, executor="jax")
    prompts = e2e_prompts(jax_handle, args.tasks)
    max_prompt = longest_prompt(jax_handle, args.tasks, args.n) if spec.accuracy else None
    keys = bundle_keys(args.buckets, jax_handle, prompts, max_prompt)
    result: dict[str, Any] = {"source": str(spec.source.relative_to(ROOT)) if spec.source.is_relative_to(ROOT)
                              else "random init (temporary checkpoint)", "config": jax_handle.config.to_dict(),
                              "params": param_count(jax_handle), "max_prompt_tokens": max_prompt,
                              "e2e_prompt_tokens": [len(p) for p in prompts]}
    result["bundles"] = export_bundles(spec, jax_handle, keys, tmp)
    handles = {"jax": jax_handle, **{label: load_bundle(path) for label, path in result["bundles"]["paths"].items()}}
    _log(f"{spec.name}: step latency, {args.repeats} repeats per bucket")
    result["step_latency"] = step_latency({n: h.executor for n, h in handles.items()}, jax_handle.config, args.buckets, args.repeats)
    add_hardware_limit(result["step_latency"], jax_handle.config, args.gemm_peak)
    result["ratio_summary"] = ratio_summary(result["step_latency"])
    _log(f"{spec.name}: end to end, {len(prompts)} prompts x {spec.e2e_passes} passes")
    result["end_to_end"] = end_to_end(handles, prompts, spec.e2e_passes)
    if spec.accuracy:
        _log(f"{spec.name}: accuracy, n={args.n} per task")
        result["accuracy"] = accuracy(handles, args.tasks, args.n)
    for name, h in handles.items():
        if name != "jax":
            h.executor.close()
    del handles, jax_handle
    gc.collect()
    _log(f"{spec.name}: peak RSS, one subprocess per executor")
    result["memory"] = memory(spec, result["bundles"]["paths"], prompts, tmp, spawner)
    result["bundles"].pop("paths")
    return result


# ---------------------------------------------------------------------------------------------
# Report


def machine() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for pkg in ("dlm-jax", "jax", "jaxlib", "flax", "numpy", "ai-edge-litert", "litert-converter", "ai-edge-quantizer"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "cpus_available": len(os.sched_getaffinity(0)), "loadavg_start": os.getloadavg(),
            "litert_threads": 2, "versions": versions}


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown(report: dict[str, Any]) -> str:
    models = report["models"]
    q = list(QUANTS.values())
    lines = [f"LiteRT runner (XNNPACK, 2 threads) against the JAX executor (XLA CPU) on {report['machine']['machine']}, "
             f"{report['machine']['cpus_available']} CPUs; {report['repeats']} interleaved repeats per bucket, medians. "
             "Ratio = jax_ms / litert_ms (> 1: the runner is faster).", "",
             "## Step latency ratio, geometric mean over buckets", "",
             "| model | params | " + " | ".join(f"{x} geomean | {x} min (bucket)" for x in q) + " |",
             "|" + "---|" * (2 + 2 * len(q))]
    for name, m in models.items():
        s = m["ratio_summary"]
        lines.append(f"| {name} | {m['params'] / 1e6:.2f}M | "
                     + " | ".join(f"{s[x]['geomean']:.2f} | {s[x]['min']:.2f} ({s[x]['min_bucket']})" for x in q) + " |")
    lines += ["", "## Step latency per bucket (ms)", "",
              "| model | bucket | jax | " + " | ".join(q) + " | " + " | ".join(f"jax/{x}" for x in q) + " |",
              "|" + "---|" * (3 + 2 * len(q))]
    for name, m in models.items():
        for r in m["step_latency"]:
            ms = r["median_ms"]
            lines.append(f"| {name} | {r['bucket']} | {ms['jax']:.2f} | " + " | ".join(f"{ms[x]:.2f}" for x in q)
                         + " | " + " | ".join(f"{r['jax_over_litert'][x]:.2f}" for x in q) + " |")
    peak = report.get("gemm_peak")
    if peak:
        lines += ["", f"## Against the hardware limit: measured fp32 GEMM {peak['gflops']:.1f} GFLOP/s "
                  f"(NumPy BLAS, {peak['n']}^3)", "",
                  "Matmul FLOPs of a step (analytic step graph) over its median time, as a share of that peak. "
                  "int8 / int4 steps run integer dot-product kernels on dynamically quantised inputs, whose "
                  "limit lies above the fp32 one: their shares can pass 100%.", "",
                  "| model | bucket | matmul MFLOP | jax | " + " | ".join(q) + " |", "|" + "---|" * (4 + len(q))]
        for name, m in models.items():
            for r in m["step_latency"]:
                share = r["of_gemm_peak"]
                lines.append(f"| {name} | {r['bucket']} | {r['matmul_flops'] / 1e6:.1f} | {share['jax'] * 100:.1f}% | "
                             + " | ".join(f"{share[x] * 100:.1f}%" for x in q) + " |")
    lines += ["", f"## End to end: {E2E_PER_TASK} held-out prompts per task, batch 1, prefix cache + threshold 0.9, "
              f"gen {GEN_LEN}", "", "| model | executor | seconds | NFE | ms / NFE | jax / this | same tokens as jax |",
              "|---|---|---|---|---|---|---|"]
    for name, m in models.items():
        for ex, e in m["end_to_end"].items():
            lines.append(f"| {name} | {ex} | {e['seconds']:.3f} | {e['nfe']} | {e['ms_per_nfe']:.2f} | "
                         f"{e['jax_over_this']:.2f} | {e['same_tokens_as_jax'] * 100:.0f}% |")
    lines += ["", "## Bundle size (model.tflite) and peak RSS of one decode in a fresh process", "",
              "KiB/bucket: what one more bucket adds to model.tflite, (full bundle - one-bucket bundle) / "
              "(buckets - 1). Peak RSS: `ru_maxrss` in a fresh process that loads, decodes the end-to-end "
              "prompts once (JAX compiling its buckets) and exits; VmHWM is the kernel's high-water mark "
              "of the same process; after load: once the checkpoint or bundle is open.", "",
              "| model | buckets | fp32 weights MiB | " + " | ".join(f"{x} MiB" for x in q) + " | "
              + " | ".join(f"{x} KiB/bucket" for x in q) + " |", "|" + "---|" * (3 + 2 * len(q))]
    for name, m in models.items():
        b = m["bundles"]
        lines.append(f"| {name} | {b['buckets']} | {_mb(b['weights_float32_bytes'])} | "
                     + " | ".join(_mb(b["model_bytes"][x]) for x in q) + " | "
                     + " | ".join(f"{b['bytes_per_added_bucket'][x] / 1024:.1f}" for x in q) + " |")
    lines += ["", "| model | executor | peak RSS MB (ru_maxrss) | VmHWM MB | before load MB | after load MB | "
              "cold load + decode s | imports JAX |", "|---|---|---|---|---|---|---|---|"]
    for name, m in models.items():
        for ex, r in m["memory"].items():
            lines.append(f"| {name} | {ex} | {r['peak_rss_mb']:.0f} | {r['peak_vm_hwm_mb']:.0f} | "
                         f"{r['peak_rss_before_load_mb']:.0f} | {r['peak_rss_after_load_mb']:.0f} | "
                         f"{r['cold_seconds']:.1f} | {'yes' if r['jax_imported'] else 'no'} |")
    acc = {n: m["accuracy"] for n, m in models.items() if "accuracy" in m}
    if acc:
        tasks = report["tasks"]
        lines += ["", f"## Task accuracy, {report['n_per_task']} held-out prompts per task, batches of 8, "
                  f"prefix cache + threshold 0.9, gen {GEN_LEN}", "",
                  "| model | executor | " + " | ".join(tasks) + " | mean | same completion as jax |",
                  "|" + "---|" * (4 + len(tasks))]
        for name, rows in acc.items():
            for ex, r in rows.items():
                lines.append(f"| {name} | {ex} | " + " | ".join(f"{r['per_task'][t]['accuracy'] * 100:.1f}%" for t in tasks)
                             + f" | {r['mean_accuracy'] * 100:.1f}% | {r['same_completion_as_jax'] * 100:.0f}% |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path, buckets_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter, NullFormatter

    models = report["models"]
    caches = sorted({r["cache"] for m in models.values() for r in m["step_latency"] if r["batch"] == 1})
    fig, axes = plt.subplots(len(models), len(caches), figsize=(4.2 * len(caches), 3.4 * len(models)), squeeze=False)
    for row, (name, m) in zip(axes, models.items()):
        for ax, cache in zip(row, caches):
            pts = sorted((r["window"], r["median_ms"]) for r in m["step_latency"] if r["batch"] == 1 and r["cache"] == cache)
            for ex, style in zip(EXECUTORS, ("k-o", "C0-s", "C1-^", "C2-v")):
                ax.plot([w for w, _ in pts], [ms[ex] for _, ms in pts], style, label=ex if ex == "jax" else f"LiteRT {ex}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks([w for w, _ in pts], [str(w) for w, _ in pts])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))  # 6, not 6x10^0
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
            ax.set_title(f"{name}, cache {cache}, batch 1", fontsize=9)
            ax.set_xlabel("window (tokens)")
            ax.set_ylabel("step median (ms)")
            ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(models), 1, figsize=(11, 3.2 * len(models)), squeeze=False)
    for ax, (name, m) in zip(axes[:, 0], models.items()):
        names = [r["bucket"] for r in m["step_latency"]]
        x = np.arange(len(names))
        for i, q in enumerate(QUANTS.values()):
            ax.bar(x + (i - 1) * 0.27, [r["jax_over_litert"][q] for r in m["step_latency"]], 0.27, label=f"LiteRT {q}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("jax ms / LiteRT ms")
        ax.set_title(f"{name}: > 1 means the runner is faster", fontsize=9)
        ax.grid(alpha=0.3, axis="y", which="both")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(buckets_path, dpi=110)
    plt.close(fig)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), report)
    atomic_write(out.with_suffix(".md"), markdown(report))
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # matplotlib writes; renamed into place
        a, b = Path(tmp) / "a.png", Path(tmp) / "b.png"
        plot(report, a, b)
        os.replace(a, out.with_suffix(".png"))
        os.replace(b, out.with_name(out.name + "_buckets.png"))


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, help=f"default: all ({', '.join(MODELS)})")
    p.add_argument("--repeats", type=int, help="timed steps per bucket and executor (default 20; --quick 5)")
    p.add_argument("--n", type=int, help="held-out prompts per task for accuracy (default 32; --quick 8)")
    p.add_argument("--e2e-passes", type=int, help="end-to-end passes over the prompts (default 3; --quick 1)")
    p.add_argument("--buckets", nargs="+", help="step-latency buckets by signature name (default: windows "
                   "32/64/128 x caches 0/64/128 at batch 1 and step_w32_p64_r32_b8; --quick: five of them)")
    p.add_argument("--tasks", nargs="+", default=["addition", "sorting", "gsm_lite"])
    p.add_argument("--quick", action="store_true", help="smoke run: 5 repeats, 5 buckets, shipped models, n=8, one pass")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "runner",
                   help="output prefix (.json, .md, .png, _buckets.png)")
    p.add_argument("--child", nargs=3, metavar=("KIND", "PATH", "PROMPTS"), help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(child_decode(*args.child)), flush=True)
        return
    args.models = args.models or (list(MODELS[:2]) if args.quick else list(MODELS))
    args.repeats = args.repeats or (5 if args.quick else 20)
    args.buckets = args.buckets or list(QUICK_BUCKETS if args.quick else STEP_BUCKETS)
    args.n = args.n or (8 if args.quick else 32)
    args.e2e_passes = args.e2e_passes or (1 if args.quick else 3)
    for name in ("repeats", "n", "e2e_passes"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    from dlm_jax.tflite_export.bundle import parse_bucket

    [parse_bucket(b) for b in args.buckets]  # a malformed name fails here, before any export
    report: dict[str, Any] = {"machine": machine(), "repeats": args.repeats, "n_per_task": args.n,
                              "e2e_passes": args.e2e_passes, "tasks": args.tasks, "quick": args.quick,
                              "decoder": decode_options(fast_decoder()), "step_buckets": args.buckets, "models": {}}
    spawner = Spawner()  # before anything large is loaded
    args.gemm_peak = report["gemm_peak"] = gemm_peak_gflops()
    _log(f"fp32 GEMM peak (NumPy BLAS, 1024^3): {args.gemm_peak['gflops']} GFLOP/s")
    tmp = Path(tempfile.mkdtemp(prefix="dlm-runner-bench-"))
    try:
        for name in args.models:
            spec = model_spec(name, tmp, e2e_passes=args.e2e_passes)
            _log(f"{name}: {spec.source}")
            report["models"][name] = bench_model(spec, args, tmp, spawner)
    finally:
        spawner.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["summary"] = {name: {q: s["geomean"] for q, s in m["ratio_summary"].items()}
                         for name, m in report["models"].items()}
    report["seconds"] = round(time.perf_counter() - _T0, 1)
    write_outputs(report, args.out)
    _log(f"wrote {args.out}.json/.md/.png/_buckets.png in {report['seconds']:.0f} s")
    print(markdown(report), end="", flush=True)
    from dlm_jax.executors.runner import quiet_native_exit

    quiet_native_exit()  # LiteRT logs every accelerator it tears down at exit


if __name__ == "__main__":
    main()

"""PowerInfer-2's NPU quantisation as the partitioned bundle runs it: INT4 per channel with INT8
outlier input channels (`--quant int4-outliers`) against float32, INT4 per channel alone
(QNN's scheme: the same programs with no outliers) and LiteRT's whole-model int8, on the
shipped models (issue 30; PowerInfer-2 §2.3.1, §7.6); and what partitioning itself costs: the float32
unpartitioned bundle against the float32 partitioned one.

    .venv/bin/python benchmarks/npu_quant.py --out benchmarks/results/npu_quant

Per model and scheme: held-out accuracy per task (the model card's Fast-dLLM decoder,
threshold 0.9, block 32, generation 64, `--n` prompts per task), the share of completions
identical to the unpartitioned float32 bundle's (a paired measure, far less noisy than
accuracy), the NPU programs' weights and size (`model.tflite`: weights + graphs) and decode
tokens per second (batch 1, after a warm-up; all bundles timed in one run, interleaved, in
`--repeats` rounds). Writes <out>.json, <out>.md and
<out>.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dlm_jax  # noqa: E402
from _hardware import machine  # noqa: E402
from _plots import png_bytes  # noqa: E402
from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402
from dlm_jax.executors.runner import load_bundle  # noqa: E402
from dlm_jax.tflite_export.bundle import buckets_for_prompts, export_bundle  # noqa: E402
from dlm_jax.techniques.powerinfer.npu_quant import constant_bytes  # noqa: E402
from dlm_jax.training.data import TASKS, make_split  # noqa: E402
from dlm_jax.runtime.registry import decode_options  # noqa: E402

SCHEMES = {  # name -> export options (partitioned unless said otherwise)
    "float32, unpartitioned bundle": {"quant": "none", "partition": False},
    "float32": {"quant": "none"},
    "int8 (LiteRT, whole model)": {"quant": "int8"},
    "int4 per channel (no outliers)": {"quant": "int4-outliers", "outlier_fraction": 0.0},
    "int4 + int8 outliers (1%)": {"quant": "int4-outliers"},
}


def decode_all(runner, n: int, cfg) -> tuple[dict, list]:
    """Accuracy per task and every completion's text (`dlm_jax.training.evaluate`, batch 1)."""
    from dlm_jax.training.evaluate import evaluate

    acc, texts = {}, []
    for task in TASKS:
        r = evaluate(runner, task, cfg, n=n, max_batch=1, keep=n, progress=False)
        acc[task] = round(r["accuracy"], 4)
        texts += [s["completion"] for s in r["samples"]]
    return acc, texts


def speed(runners: dict, prompts: list, cfg, repeats: int) -> dict:
    """(tokens per second, speed relative to the first runner) of each runner over `prompts`:
    interleaved rounds, the best round's tokens per second and the median over rounds of the
    round's time ratio (a paired measure: each round's runs are seconds apart)."""
    import numpy as np

    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            for p in prompts:
                runner.decoder.decode([p], cfg)
            times[name].append(time.perf_counter() - t0)
    first = np.asarray(times[next(iter(runners))])
    return {name: (round(len(prompts) * cfg.gen_len / min(t), 1), round(float(np.median(first / np.asarray(t))), 3))
            for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["models/llada-tiny", "models/sparse-tiny", "models/llada-12m"])
    ap.add_argument("--n", type=int, default=50, help="held-out prompts per task")
    ap.add_argument("--speed-n", type=int, default=4, help="prompts per task for the timing")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/npu_quant")
    args = ap.parse_args()
    out = Path(args.out)
    cfg = dlm_jax.preset("fast-dllm", gen_len=64, block_len=32)
    result = {"machine": machine(), "decode": decode_options(cfg), "n_per_task": args.n, "models": {}}
    tmp = Path(tempfile.mkdtemp(prefix="dlm-jax-npuq-"))
    try:
        for model_dir in args.models:
            handle = dlm_jax.load(model_dir, executor="jax")
            examples = [ex for t in TASKS for ex in make_split(TASKS[t], max(args.n, args.speed_n), split="heldout")]
            max_prompt = max(len(handle.encode(ex.prompt)) for ex in examples)
            keys = buckets_for_prompts(handle.config, cfg, max_prompt=max_prompt, batches=(1,))
            rows, runners, reference = {}, {}, None
            for name, opts in SCHEMES.items():
                print(f"{model_dir}: export {name}", file=sys.stderr, flush=True)
                path = tmp / f"{Path(model_dir).name}-{len(rows)}"
                t0 = time.perf_counter()
                export_bundle(model_dir, path, keys=keys, decode=cfg, latency_repeats=0,
                              **{"partition": True, **opts})
                seconds = time.perf_counter() - t0
                runner = load_bundle(path)
                acc, texts = decode_all(runner, args.n, cfg)
                reference = texts if reference is None else reference  # the unpartitioned float32 bundle's
                same = sum(a == b for a, b in zip(texts, reference)) / len(texts)
                plan = json.loads((path / "plan.json").read_text()).get("quantization", {})
                errs = [w["rel_error"] for w in plan.get("weights", {}).values()]
                rows[name] = {"accuracy": acc, "mean_accuracy": round(sum(acc.values()) / len(acc), 4),
                              "same_as_float": round(same, 4), "npu_bytes": (path / "model.tflite").stat().st_size,
                              "npu_weight_bytes": constant_bytes((path / "model.tflite").read_bytes()),
                              "export_s": round(seconds, 1),
                              **({"mean_rel_weight_error": round(sum(errs) / len(errs), 4)} if errs else {})}
                runners[name] = runner
            prompts = [handle.encode(ex.prompt) for t in TASKS for ex in make_split(TASKS[t], args.speed_n,
                                                                                     split="heldout")]
            for runner in runners.values():  # warm every bucket first
                for p in prompts:
                    runner.decoder.warmup([len(p)], cfg)
            for name, (tps, ratio) in speed(runners, prompts, cfg, args.repeats).items():
                rows[name]["tokens_per_s"] = tps
                rows[name]["speed_vs_unpartitioned"] = ratio
            result["models"][model_dir] = rows
            runners.clear()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write(result, out)
    print(json.dumps(result, indent=1))


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), result)
    lines = ["# NPU quantisation in the partitioned bundle (INT4 + INT8 outliers)", "",
             f"Held-out accuracy, {result['n_per_task']} prompts per task, decoder Fast-dLLM "
             f"(prefix cache, threshold 0.9, block 32, gen 64); machine {result['machine']}. Every bundle but the "
             "first is partitioned; the partitioned schemes differ only in the NPU programs' weights (the CPU head "
             "is float32, or int8 for the int8 and int4 schemes). `same as fp32`: completions identical to the "
             "unpartitioned float32 bundle's. `NPU weights`: the constants of `model.tflite` (the unpartitioned bundle's "
             "hold the whole model). Speed: batch 1, every bundle timed in each round, interleaved; tok/s "
             "of the best round; `vs unpart.`: the median over rounds of the unpartitioned bundle's time over "
             "this one's (above 1: faster).", ""]
    tasks = list(TASKS)
    lines.append("| model | scheme | " + " | ".join(tasks) + " | mean | same as fp32 | NPU weights | NPU programs "
                 "(weights + graphs) | tok/s | vs unpart. |")
    lines.append("|---|---|" + "---|" * len(tasks) + "---|---|---|---|---|---|")
    for model, rows in result["models"].items():
        for name, r in rows.items():
            lines.append(f"| {Path(model).name} | {name} | " + " | ".join(f"{100 * r['accuracy'][t]:.0f}%" for t in tasks)
                         + f" | {100 * r['mean_accuracy']:.1f}% | {100 * r['same_as_float']:.0f}% | "
                         f"{r['npu_weight_bytes'] / 1e6:.2f} MB | {r['npu_bytes'] / 1e6:.2f} MB | "
                         f"{r.get('tokens_per_s', '')} | {r.get('speed_vs_unpartitioned', '')} |")
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = result["models"][model]
        for name, r in rows.items():
            ax.scatter(r["npu_weight_bytes"] / 1e6, 100 * r["mean_accuracy"], s=60, label=name)
            ax.annotate(f"{100 * r['same_as_float']:.0f}% = fp32",
                        (r["npu_weight_bytes"] / 1e6, 100 * r["mean_accuracy"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("NPU weights (MB)")
        ax.set_ylabel("mean held-out accuracy (%)")
        ax.set_title(Path(model).name)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, png_bytes(fig))


if __name__ == "__main__":
    main()

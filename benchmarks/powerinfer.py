"""The PowerInfer-2 benchmark: activation sparsity of a dLLM's decode windows, the activation
predictor, and the sparse bundle's neuron engine against its baselines under FFN memory
budgets (PowerInfer-2 §4; docs/techniques/powerinfer.md; issue 30).

    .venv/bin/python benchmarks/powerinfer.py --model models/sparse-tiny --out benchmarks/results/powerinfer

1. Sparsity (Fig 2 analog): the share of FFN neurons a window of W live rows activates, for
   W in 1..32, from the `ffn_active` step output of decoding held-out prompts (JAX executor).
2. Predictor: trained on calibration sequences (training split), recall / precision per
   window size on held-out samples; held-out task accuracy of the sparse bundle with the
   predictor against oracle activations and the dense bundle.
3. Throughput at FFN budgets of 100 / 50 / 25 % (the FFN bytes the configuration may keep in
   memory, on top of everything else), batch 1, the page cache dropped and the neuron cache
   emptied before each run, every configuration timed in each of `--repeats` rounds
   (interleaved; the best round counts, the others are in the JSON):
   (a) the dense bundle, everything resident (unpartitioned, and partitioned: the
   partitioned bundle's cost on this CPU); the neuron engine (its plan's hot neurons in the
   NPU programs, cold ones predicted, bundled reads on a reader thread pipelined with compute,
   LRU neuron cache; at 50% also with the prefetch region: the cache read ahead from the
   calibration statistics when it starts empty); (b) LLMFlash-like: every neuron cold, each needed neuron read on demand
   from plain matrices (three reads, unbundled, unpipelined) into the same cache; (c)
   llama.cpp-like: the dense FFN from a memory-mapped weight file whose pages beyond the
   budget are dropped after each layer. Tokens per second, bytes read per token (the
   process's storage reads, /proc/self/io), the tokens against the dense bundle's.
4. Phone projection (a model, not a measurement): each run's reads and neuron counts priced with
   PowerInfer-2's UFS and bandwidth figures (§2.3) at a virtual Mistral-7B (d 4096, 14336
   neurons, 32 layers, INT4 bundles of 8 KB read as two 4 KB reads).
Writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import dlm_jax  # noqa: E402
from dlm_jax._errors import ConfigError  # noqa: E402
from _hardware import machine  # noqa: E402
from _neuron_baselines import MatrixReader, MmapColdPath, process_read_bytes, write_matrices  # noqa: E402
from dlm_jax.executors.partition_contract import tiled  # noqa: E402
from dlm_jax.executors.runner import load_bundle  # noqa: E402
from dlm_jax.techniques.powerinfer.flash import drop_page_cache  # noqa: E402
from dlm_jax.tflite_export.bundle import SparseExport, buckets_for_prompts, export_bundle  # noqa: E402
from dlm_jax.techniques.powerinfer.sparse import (calibration_examples, decode_statistics, ffn_samples, neuron_bytes,  # noqa: E402
                                  non_ffn_bytes, plan_sparse, record_windows, train_predictor)
from dlm_jax.training.data import TASKS, make_split  # noqa: E402
from dlm_jax.runtime.registry import decode_options  # noqa: E402

WINDOWS = (1, 2, 4, 8, 16, 32)
BUDGETS = (1.0, 0.5, 0.25)
# Virtual Mistral-7B for the phone projection (PowerInfer-2 §4.4's INT4 bundles, §2.3's figures)
PHONE = {"d_model": 4096, "neurons": 14336, "layers": 32, "read_bytes": 4096, "npu_bytes_per_s": 56e9,
         "cpu_bytes_per_s": 43.9e9, "neuron_int4_bytes": 7680,  # 3 x (2 KB int4 + 0.5 KB fp16 scales)
         "attention_bytes_per_layer": (2 * 4096 * 4096 + 2 * 4096 * 1024) * 0.5625}  # GQA 8 kv heads, 4.5 bit


def heldout_prompts(handle, n: int) -> list[list[int]]:
    return [handle.encode(ex.prompt) for t in TASKS for ex in make_split(TASKS[t], n, split="heldout")]


def sparsity(handle, prompts, cfg) -> dict:
    stats = decode_statistics(handle, prompts, cfg, windows=WINDOWS)
    return {"stats": stats, "tokens": stats.tokens,
            "density": {w: [round(float(x), 4) for x in stats.density(w)] for w in stats.recorded_windows()},
            "token_density": [round(float(x), 4) for x in stats.token_density()]}


def zero_hot(plan):
    """`plan` with no hot neurons (every neuron cold): the baselines' bundle."""
    import dataclasses

    return dataclasses.replace(plan, hot={w: np.zeros_like(h) for w, h in plan.hot.items()})


def run_decode(runner, prompts, cfg, *, drop=(), reset=None) -> dict:
    """Decode `prompts` one at a time after a warm-up, the page cache of `drop` dropped and
    the cold path reset first: seconds, tokens, bytes read, the sequences."""
    for p in prompts:
        runner.decoder.warmup([len(p)], cfg)
    if reset is not None:
        reset()
    for path in drop:
        drop_page_cache(path)
    gc.collect()
    read0, t0 = process_read_bytes(), time.perf_counter()
    seqs, steps = [], 0
    for p in prompts:
        out = runner.decoder.decode([p], cfg)
        seqs.append(out.sequences[0])
        steps += out.stats.nfe
    seconds = time.perf_counter() - t0
    tokens = cfg.gen_len * len(prompts)
    read = process_read_bytes() - read0 if read0 >= 0 else -1
    return {"seconds": round(seconds, 3), "tokens": tokens, "steps": steps,
            "tokens_per_s": round(tokens / seconds, 2), "bytes_read": read,
            "bytes_read_per_token": round(read / tokens) if read >= 0 else None, "sequences": seqs}


def phone_projection(run: dict, model_cfg, hot_per_layer: float) -> dict:
    """Modelled seconds per token of `run` at the virtual 7B, priced with PowerInfer-2 §2.3's
    figures: each of our
    neurons stands for a 7B neuron (counts scale by neurons per layer and layers); a missed
    neuron costs two random 4 KB reads bundled (the INT4 bundle's two phases) or three unbundled
    (a 4 KB request per matrix row), through the one UFS queue (`dlm_jax.lowering.costs.UfsModel`,
    128 MB range); the cold neurons' INT4 bytes stream at the CPU's 43.9 GB/s, attention and
    the hot neurons at the NPU's 56 GB/s, once per step. mmap: the dense FFN every step, the
    share beyond the budget paged in with 128 KB sequential reads. The engine pipelines I/O
    under the CPU's compute (max); the baselines add them."""
    from dlm_jax.lowering.costs import UfsModel

    p, ufs = PHONE, UfsModel()
    per_layer = p["neurons"] / model_cfg.ffn_hidden
    scale = per_layer * p["layers"] / model_cfg.n_layers
    steps = run["steps"] / run["tokens"]
    c = run.get("cold", {})
    npu = steps * (p["attention_bytes_per_layer"] * p["layers"]
                   + hot_per_layer * per_layer * p["layers"] * p["neuron_int4_bytes"]) / p["npu_bytes_per_s"]
    if run["kind"] == "mmap":
        dense = p["neurons"] * p["layers"] * p["neuron_int4_bytes"]
        io = steps * dense * (1 - run["fraction"]) / ufs.bandwidth(128 * 1024, "sequential")
        cpu = steps * dense / p["cpu_bytes_per_s"]
    else:
        misses = c.get("misses", 0) * scale / run["tokens"]
        reads = 2 if run["kind"].startswith("engine") else 3
        io = misses * reads * ufs.read_seconds(p["read_bytes"])
        cpu = c.get("neurons", 0) * scale * p["neuron_int4_bytes"] / run["tokens"] / p["cpu_bytes_per_s"]
    total = npu + (max(io, cpu) if run["kind"].startswith("engine") else io + cpu)
    return {"io_s": round(io, 5), "cpu_s": round(cpu, 5), "npu_s": round(npu, 5), "s_per_token": round(total, 5),
            "tokens_per_s": round(1 / total, 2) if total > 0 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/sparse-tiny")
    ap.add_argument("--n", type=int, default=4, help="held-out prompts per task for the throughput runs")
    ap.add_argument("--stats-n", type=int, default=16, help="held-out prompts per task for the sparsity figures")
    ap.add_argument("--eval-n", type=int, default=50, help="held-out prompts per task for the accuracy table")
    ap.add_argument("--calibration", type=int, default=24, help="training prompts per task for plan and predictor")
    ap.add_argument("--predictor-steps", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=3, help="throughput rounds (every configuration, interleaved)")
    ap.add_argument("--out", default="benchmarks/results/powerinfer")
    args = ap.parse_args()
    out = Path(args.out)
    handle = dlm_jax.load(args.model, executor="jax")
    mc = handle.config
    cfg = dlm_jax.preset("fast-dllm", gen_len=64, block_len=32)
    result: dict = {"machine": machine(), "model": args.model, "decode": decode_options(cfg),
                    "config": {"d_model": mc.d_model, "ffn_hidden": mc.ffn_hidden, "layers": mc.n_layers,
                               "ffn": mc.ffn}}

    print("sparsity of decode windows", file=sys.stderr)
    held = sparsity(handle, heldout_prompts(handle, args.stats_n), cfg)
    result["sparsity"] = {k: v for k, v in held.items() if k != "stats"}

    print("calibration statistics and predictor", file=sys.stderr)
    examples = calibration_examples(args.calibration)
    cal_prompts = [handle.encode(p) for p, _ in examples]
    cal_stats = decode_statistics(handle, cal_prompts, cfg, windows=WINDOWS)
    t0 = time.perf_counter()
    samples = ffn_samples(handle.model, record_windows(handle, cal_prompts, cfg))
    predictor, report = train_predictor(samples, mc, steps=args.predictor_steps)
    result["predictor"] = {**report.to_dict(), "train_seconds": round(time.perf_counter() - t0, 1)}

    prompts = heldout_prompts(handle, args.n)
    max_prompt = max(len(p) for p in heldout_prompts(handle, max(args.n, args.eval_n)))
    keys = buckets_for_prompts(mc, cfg, max_prompt=max_prompt, batches=(1,))
    windows = sorted({tiled(k.window) for k in keys})
    ffn = mc.n_layers * mc.ffn_hidden * neuron_bytes(mc)
    base = non_ffn_bytes(mc)
    out.parent.mkdir(parents=True, exist_ok=True)  # the bundles sit beside the results: a disk, not tmpfs
    tmp = Path(tempfile.mkdtemp(prefix="dlm-jax-powerinfer-", dir=str(out.parent)))
    try:
        print("exporting bundles", file=sys.stderr)
        export_bundle(args.model, tmp / "dense", keys=keys, decode=cfg, latency_repeats=0, plan=False)
        export_bundle(args.model, tmp / "partitioned", keys=keys, decode=cfg, latency_repeats=0, plan=False,
                      partition=True)
        plans, result["refused"] = {}, {}
        for p in BUDGETS:
            try:
                plans[p] = plan_sparse(mc, cal_stats, predictor, windows=windows, budget_mb=(base + p * ffn) / 1e6,
                                       resident_bytes=base, cluster=128)
            except ConfigError as e:  # the budget cannot hold one window's active neurons
                result["refused"][str(p)] = str(e)
        for p, plan in plans.items():
            export_bundle(args.model, tmp / f"engine{p}", keys=keys, decode=cfg, latency_repeats=0, plan=False,
                          sparse=plan)
        cold_plan = SparseExport(plan=zero_hot(plans[1.0].plan), predictor=predictor, cluster=128)
        export_bundle(args.model, tmp / "allcold", keys=keys, decode=cfg, latency_repeats=0, plan=False,
                      sparse=cold_plan)
        info = write_matrices(tmp / "allcold" / "ffn.flash", tmp / "matrices.bin")
        from dlm_jax.executors.partitioned import resident_bytes

        result["bytes"] = {"ffn": ffn, "non_ffn_params": base,
                           "allcold_resident": sum(resident_bytes(dlm_jax.executors.runner.Bundle.open(tmp / "allcold")).values()),
                           "flash_file": (tmp / "allcold" / "ffn.flash").stat().st_size}
        result["plans"] = {str(p): {str(w): [int(h) for h in plans[p].plan.hot[w]] for w in plans[p].plan.windows}
                           for p in plans}
        result["hot_exported"] = {}

        # every configuration open at once, then timed interleaved, best of --repeats (the
        # machine is shared and noisy: one run each would compare one moment with another)
        flash_cold = tmp / "allcold" / "ffn.flash"
        configs = [("resident (dense bundle)", "dense", 1.0, load_bundle(tmp / "dense"), (), None),
                   ("resident (dense, partitioned bundle)", "partitioned", 1.0, load_bundle(tmp / "partitioned"),
                    (), None)]
        for p in plans:
            budget_mb = (result["bytes"]["allcold_resident"] + p * ffn) / 1e6
            hot = json.loads((tmp / f"engine{p}" / "neurons.json").read_text())["hot"]
            result["hot_exported"][str(p)] = hot
            variants = [("neuron engine", "engine", False)] + (
                [("neuron engine + prefetch", "engine_prefetch", True)] if p == 0.5 else [])
            for name, kind, ahead in variants:
                engine = load_bundle(tmp / f"engine{p}", memory_budget_mb=budget_mb, prefetch=ahead)
                engine.hot_per_layer = float(np.mean([np.mean(v) for v in hot.values()]))
                configs.append((name, kind, p, engine, [tmp / f"engine{p}" / "ffn.flash"], engine.executor.cold.reset))
            flash = load_bundle(tmp / "allcold", memory_budget_mb=budget_mb, pipeline=False, prefetch=False)
            flash.executor.cold.reader = MatrixReader(tmp / "matrices.bin", info)
            configs.append(("LLMFlash-like", "llmflash", p, flash, [flash_cold, tmp / "matrices.bin"],
                            flash.executor.cold.reset))
            mm = load_bundle(tmp / "allcold", memory_budget_mb=budget_mb, pipeline=False, prefetch=False)
            mm.executor.cold.close()
            # a file of its own: a page another open mapping holds would never leave the page cache
            own = tmp / f"matrices-{p}.bin"
            shutil.copyfile(tmp / "matrices.bin", own)
            mm.executor.cold = MmapColdPath(own, info, p)
            configs.append(("llama.cpp-like (mmap)", "mmap", p, mm, [own], None))
        runs = {}
        for rep in range(args.repeats):
            print(f"throughput, round {rep + 1} of {args.repeats}", file=sys.stderr)
            for name, kind, p, runner, drop, reset in configs:
                r = run_decode(runner, prompts, cfg, drop=drop, reset=reset)
                cold = getattr(runner.executor, "cold", None)
                if cold is not None and hasattr(cold, "counters") and kind != "mmap":
                    r["cold"] = cold.counters.to_dict()
                old = runs.get((kind, p))
                times = (old["seconds_runs"] if old else []) + [r["seconds"]]
                if old is None or r["seconds"] < old["seconds"]:
                    runs[(kind, p)] = {"config": name, "kind": kind, "budget": p,
                                       **({"fraction": p} if kind == "mmap" else {}),
                                       **({"hot_per_layer": runner.hot_per_layer} if kind.startswith("engine") else {}),
                                       **r}
                runs[(kind, p)]["seconds_runs"] = times
        reference = runs[("dense", 1.0)]["sequences"]
        runs = list(runs.values())
        for _, kind, _, runner, _, _ in configs:
            cold = getattr(runner.executor, "cold", None)
            if cold is not None:
                cold.close()
        del configs
        for run in runs:
            seqs = run.pop("sequences", None)
            if seqs is not None and run["kind"] != "dense":
                run["tokens_equal_dense"] = all(np.array_equal(a, b) for a, b in zip(seqs, reference))
            if run["kind"] not in ("dense", "partitioned"):
                run["phone"] = phone_projection({**run, "fraction": run["budget"]}, mc,
                                                run.get("hot_per_layer", 0.0))
        result["runs"] = runs
        result["ratios"] = ratios(runs)

        print("accuracy", file=sys.stderr)
        result["accuracy"] = accuracy(args, tmp, cfg)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write(result, out)


def ratios(runs: list[dict]) -> dict:
    by = {(r["kind"], r["budget"]): r for r in runs}
    out = {"partitioned_vs_unpartitioned": round(by[("partitioned", 1.0)]["tokens_per_s"]
                                                 / by[("dense", 1.0)]["tokens_per_s"], 3)}
    for p in BUDGETS:
        e, f, m = by.get(("engine", p)), by.get(("llmflash", p)), by.get(("mmap", p))
        if e and f:
            out[f"engine_vs_llmflash@{p}"] = round(e["tokens_per_s"] / f["tokens_per_s"], 2)
        if e and m:
            out[f"engine_vs_mmap@{p}"] = round(e["tokens_per_s"] / m["tokens_per_s"], 2)
        if e and e.get("phone") and f and f.get("phone"):
            out[f"phone_engine_vs_llmflash@{p}"] = round(f["phone"]["s_per_token"] / e["phone"]["s_per_token"], 2)
        n = by.get(("engine_prefetch", p))
        if e and n:
            out[f"prefetch_gain@{p}"] = round(n["tokens_per_s"] / e["tokens_per_s"], 2)
    return out


def accuracy(args, tmp: Path, cfg) -> dict:
    """Held-out accuracy per task: the dense bundle, the engine with oracle activations, the
    engine with the predictor (every neuron once read stays: accuracy does not depend on I/O)."""
    from dlm_jax.training.evaluate import evaluate

    out = {}
    for name, kwargs in (("dense", None), ("oracle", {"oracle": True}), ("predictor", {"audit": True})):
        path = tmp / ("dense" if kwargs is None else f"engine{BUDGETS[0]}")
        runner = load_bundle(path, **(kwargs or {}))
        out[name] = {t: evaluate(runner, t, cfg, n=args.eval_n, max_batch=1, progress=False)["accuracy"]
                     for t in TASKS}
        cold = getattr(runner.executor, "cold", None)
        if cold is not None:
            c = cold.counters
            out[name]["cold_neurons_per_step_layer"] = round(c.neurons / max(1, c.steps) / runner.config.n_layers, 2)
            if c.true_active:  # the predictor's recall and precision on the decode's own windows
                out[name]["window_recall"] = round(c.found / c.true_active, 4)
                out[name]["window_precision"] = round(c.found / max(1, c.neurons), 4)
            cold.close()
        del runner
    return out


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    md = ["# PowerInfer-2 on a dLLM: neuron engine, sparse bundle", "",
          f"Model `{result['model']}` ({result['config']}), decode {result['decode']['cache']} cache "
          f"threshold {result['decode'].get('threshold')}, block {result['decode'].get('block_len')}; "
          f"machine {result['machine']}.", "",
          "## Neurons active per window (Fig 2 analog)", "", "| W | " + " | ".join(
              f"layer {i}" for i in range(result["config"]["layers"])) + " |",
          "|---|" + "---|" * result["config"]["layers"]]
    for w, d in result["sparsity"]["density"].items():
        md.append(f"| {w} | " + " | ".join(f"{x:.1%}" for x in d) + " |")
    pr = result["predictor"]
    md += ["", f"## Predictor (rank {pr['rank']}, {pr['params']} parameters = "
               f"{pr['params'] / pr['ffn_params']:.1%} of the FFN)", "",
           "| window | recall (per layer) | precision (per layer) |", "|---|---|---|"]
    md.append(f"| token | {pr['recall']} | {pr['precision']} |")
    for w in pr["window_recall"]:
        md.append(f"| {w} | {pr['window_recall'][w]} | {pr['window_precision'][w]} |")
    md += ["", "## Throughput (batch 1, page cache dropped and neuron cache emptied before each run; every "
               "configuration timed in each of the rounds, interleaved, best round shown)", "",
           "| configuration | FFN budget | tok/s | bytes read / token | tokens = dense | phone tok/s (modelled) |",
           "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        phone = r.get("phone", {}).get("tokens_per_s", "")
        md.append(f"| {r['config']} | {r['budget']:.0%} | {r['tokens_per_s']} | {r['bytes_read_per_token']} | "
                  f"{r.get('tokens_equal_dense', '')} | {phone} |")
    md += ["", "Ratios: " + ", ".join(f"{k} {v}x" for k, v in result["ratios"].items()), "",
           "## Accuracy (held-out, exact match)", "", "| decoding | " + " | ".join(TASKS) + " |",
           "|---|" + "---|" * len(TASKS)]
    for name, acc in result["accuracy"].items():
        md.append(f"| {name} | " + " | ".join(f"{acc[t]:.1%}" for t in TASKS) + " |")
    audit = result["accuracy"].get("predictor", {})
    if "window_recall" in audit:
        md += ["", f"On the decode's own windows the predictor found {audit['window_recall']:.1%} of the cold neurons "
                   f"they activated (precision {audit['window_precision']:.1%}; "
                   f"{audit['cold_neurons_per_step_layer']} cold neurons computed per layer and step, "
                   f"{result['accuracy']['oracle']['cold_neurons_per_step_layer']} with oracle activations)."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    dens = result["sparsity"]["density"]
    ws = [int(w) for w in dens]
    for i in range(result["config"]["layers"]):
        a.plot(ws, [dens[w][i] * 100 for w in dens], marker="o", label=f"layer {i}")
    a.set_xscale("log", base=2)
    a.set_xlabel("window rows W")
    a.set_ylabel("% of FFN neurons active for >= 1 row")
    a.set_title("Neurons a decode window activates")
    a.legend()
    kinds = [("engine", "neuron engine"), ("llmflash", "LLMFlash-like"), ("mmap", "llama.cpp-like (mmap)")]
    x = np.arange(len(BUDGETS))
    for j, (kind, label) in enumerate(kinds):
        vals = [next((r["tokens_per_s"] for r in result["runs"] if r["kind"] == kind and r["budget"] == p), 0)
                for p in BUDGETS]
        b.bar(x + (j - 1) * 0.27, vals, 0.27, label=label)
    dense = next(r["tokens_per_s"] for r in result["runs"] if r["kind"] == "dense")
    b.axhline(dense, color="k", ls="--", label="resident dense bundle")
    b.set_xticks(x, [f"{p:.0%}" for p in BUDGETS])
    b.set_xlabel("FFN memory budget")
    b.set_ylabel("tokens / s (this machine)")
    b.set_title("Decoding with the FFN partly on disk")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

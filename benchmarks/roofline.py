"""Per-step profile of decoding against this CPU's limits.

    .venv/bin/python benchmarks/roofline.py --out benchmarks/results/roofline

For each model, cache mode (none, prefix, dual; threshold 0.9, block 32, batch 1) and
generation length, one decode of one prompt (64 random ids; a held-out task prompt for
llada-tiny) runs through a timing wrapper around the
JAX executor (after its buckets are compiled). Every step is split into:

  prep     host: building the padded step inputs (tokens, positions, visibility, cache gather)
  h2d      host -> device transfer of the inputs
  compute  the compiled step, waited for
  d2h      device -> host transfer of the outputs the host reads
  decide   host: proposer, commit rule, state update, K/V store write

Per bucket it reports the steps run in it, the median of each phase, the matmul FLOPs and the
bytes a step must move (weights, K/V cache in, window K/V out when stored) at the bucket's
size and at the live sizes (the padding waste), and the GFLOP/s and GB/s the compute reached
as a share of the GEMM peak and the copy bandwidth measured in this run. Writes <out>.json
and <out>.png (a roofline of every bucket, and where each decode's time goes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _hardware import gemm_peak, machine, memory_bandwidth  # noqa: E402
from _models import MODELS, model_path, prompts_for  # noqa: E402

from dlm_jax.runtime.step import Executor  # noqa: E402

PHASES = ("prep", "h2d", "compute", "d2h", "decide")
MODES = ("none", "prefix", "dual")
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


class TimingExecutor(Executor):
    """Wraps an executor that accepts `step(inputs, timings)`; records per step the bucket,
    the live window / cache sizes (read off the visibility mask: padded query rows see
    nothing, padded cache slots are seen by no row) and the phase timings."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.records: list[dict[str, Any]] = []

    @property
    def capabilities(self):
        return self.inner.capabilities

    def warmup(self, keys, *, slots=0, views=False):
        return self.inner.warmup(keys)

    def step(self, inputs, *, timings=None):
        timings = {} if timings is None else timings
        out = self.inner.step(inputs, timings=timings)
        vis = inputs.visibility
        p = inputs.k_cache.shape[2]
        self.records.append({"key": inputs.key, "kv_out": inputs.want.kv,
                             "live_window": int(vis.any(axis=2).sum(axis=1).max()),
                             "live_cache": int(vis[:, :, :p].any(axis=1).sum(axis=1).max()), **timings})
        return out


def step_cost(config: Any, key: Any, kv_out: bool) -> dict[str, int]:
    """Matmul FLOPs and bytes moved (weights once, K/V cache in, window K/V out) of one step."""
    from dlm_jax.lowering._analytic import analytic_graph
    from dlm_jax.lowering.graph import MATMUL_OPS, op_flops

    graph = analytic_graph(config, key)
    itemsize = np.dtype(config.dtype).itemsize
    kv = 2 * config.n_layers * key.batch * config.n_kv_heads * config.head_dim * itemsize
    return {"flops": int(sum(op_flops(graph, op) for op in graph.ops if op.opcode in MATMUL_OPS)),
            "bytes": int(graph.weight_bytes() + kv * key.cache + (kv * key.window if kv_out else 0))}


def summarize(config: Any, records: list[dict], prep: list[float], decide: list[float], peak: float,
              bandwidth: float) -> list[dict[str, Any]]:
    from dlm_jax.runtime.buckets import BucketKey

    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        groups[(r["key"], r["kv_out"])].append(i)
    rows = []
    for (key, kv_out), idx in sorted(groups.items(), key=lambda g: g[1][0]):
        ms = {ph: float(np.median([(prep if ph == "prep" else decide if ph == "decide" else
                                     [r[ph] for r in records])[i] for i in idx])) * 1e3 for ph in PHASES}
        live_w = max(records[i]["live_window"] for i in idx)
        live_p = max(records[i]["live_cache"] for i in idx)
        cost = step_cost(config, key, kv_out)
        live = step_cost(config, BucketKey(key.batch, live_w, live_p, key.rows), kv_out)
        sec = ms["compute"] / 1e3
        gflops = cost["flops"] / sec / 1e9
        rows.append({"bucket": str(key), "kv_out": kv_out, "steps": len(idx),
                     "median_ms": {k: round(v, 3) for k, v in ms.items()},
                     "flops": cost["flops"], "bytes": cost["bytes"],
                     "intensity": round(cost["flops"] / cost["bytes"], 2),
                     "gflops": round(gflops, 2), "of_gemm_peak": round(gflops / peak, 3),
                     "gbps": round(cost["bytes"] / sec / 1e9, 2),
                     "of_bandwidth": round(cost["bytes"] / sec / 1e9 / bandwidth, 3),
                     "live": {"window": live_w, "cache": live_p, "of_window": round(live_w / key.window, 3),
                              "of_cache": round(live_p / key.cache, 3) if key.cache else None},
                     "padding_waste": round(1 - live["flops"] / cost["flops"], 3)})
    return rows


def profile_decode(handle: Any, prompt: list[int], gen: int, mode: str, peak: float,
                   bandwidth: float) -> dict[str, Any]:
    import dlm_jax
    from dlm_jax.runtime.decoder import Decoder

    from dlm_jax.executors.runner import zero_inputs

    cfg = dlm_jax.decode_config(gen_len=gen, block_len=32, cache=mode, rule="threshold", threshold=0.9)
    prompts = [prompt]
    timer = TimingExecutor(handle.decoder.executor)
    decoder = Decoder(timer, handle.config)
    t0 = time.perf_counter()
    keys = decoder.bucket_keys([len(prompts[0])], cfg)
    compiled = decoder.warmup([len(prompts[0])], cfg)
    compile_s = time.perf_counter() - t0
    for key in keys:  # a first run of each program, untimed
        handle.decoder.executor.step(zero_inputs(handle.config, key))
    out = decoder.decode(prompts, cfg)
    st = out.stats
    decide = [h - p for h, p in zip(st.host_seconds, st.prep_seconds)]
    totals = {"prep": sum(st.prep_seconds), "decide": sum(decide),
              **{ph: sum(r[ph] for r in timer.records) for ph in ("h2d", "compute", "d2h")}}
    return {"gen_len": gen, "mode": mode, "nfe": st.nfe, "seconds": round(st.seconds, 3),
            "compile_seconds": round(compile_s, 2), "buckets_compiled": compiled,
            "phase_seconds": {k: round(totals[k], 4) for k in PHASES},
            "phase_share": {k: round(totals[k] / max(sum(totals.values()), 1e-12), 4) for k in PHASES},
            "buckets": summarize(handle.config, timer.records, st.prep_seconds, decide, peak, bandwidth)}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak, bw = report["gemm"]["gflops"], report["bandwidth"]["copy_gbps"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    xs = np.logspace(0, 3, 100)
    ax.plot(xs, np.minimum(peak, xs * bw), "k-", lw=1, label=f"roof: {peak:.0f} GFLOP/s, {bw:.0f} GB/s")
    markers = {"none": "o", "prefix": "s", "dual": "^"}
    for i, m in enumerate(report["models"]):
        color = f"C{i}"
        for d in m["decodes"]:
            pts = [(b["intensity"], b["gflops"]) for b in d["buckets"]]
            ax.scatter(*zip(*pts), color=color, marker=markers[d["mode"]], s=22, alpha=0.7,
                       label=f"{m['model']} {d['mode']}" if d["gen_len"] == report["gens"][0] else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("matmul FLOPs per byte moved (weights + K/V)")
    ax.set_ylabel("GFLOP/s of the compiled step")
    ax.set_title("every bucket of every decode (JAX executor)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    labels, bottoms = [], None
    bars = [(f"{m['model']}\n{d['mode']} {d['gen_len']}", d["phase_seconds"]) for m in report["models"]
            for d in m["decodes"]]
    labels = [b[0] for b in bars]
    bottoms = np.zeros(len(bars))
    for j, ph in enumerate(PHASES):
        share = np.array([b[1][ph] / max(sum(b[1].values()), 1e-12) for b in bars])
        bx.bar(range(len(bars)), share, bottom=bottoms, color=f"C{j}", label=ph)
        bottoms += share
    bx.set_xticks(range(len(bars)))
    bx.set_xticklabels(labels, rotation=90, fontsize=6)
    bx.set_ylabel("share of decode time")
    bx.set_title("where each decode's time goes")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--gens", nargs="+", type=int, default=[128, 256])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--max-gen-154m", type=int, default=128,
                   help="longest generation profiled on random-154m (its decodes are the slow ones)")
    p.add_argument("--workdir", type=Path, default=None, help="where random checkpoints are written (default: temp)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/roofline"))
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    import dlm_jax

    log("measuring the GEMM peak and memory bandwidth")
    report: dict[str, Any] = {"machine": machine(), "gemm": gemm_peak(), "bandwidth": memory_bandwidth(),
                              "gens": args.gens, "prompts": "64 random ids; shipped models: a held-out gsm_lite prompt", "models": []}
    log(f"GEMM {report['gemm']}, bandwidth {report['bandwidth']}")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        for name in args.models:
            handle = dlm_jax.load(model_path(name, workdir), executor="jax")
            entry = {"model": name, "params": dlm_jax.param_count(handle.model), "decodes": []}
            prompt = prompts_for(name, handle, 1)[0]
            for gen in args.gens:
                if name == "random-154m" and gen > args.max_gen_154m:
                    continue
                for mode in args.modes:
                    d = profile_decode(handle, prompt, gen, mode, report["gemm"]["gflops"], report["bandwidth"]["copy_gbps"])
                    entry["decodes"].append(d)
                    worst = min(d["buckets"], key=lambda b: b["of_gemm_peak"])
                    log(f"{name} gen {gen} {mode}: {d['seconds']:.2f} s, {d['nfe']} NFE, compute "
                        f"{d['phase_share']['compute']:.0%}; slowest bucket {worst['bucket']} at "
                        f"{worst['of_gemm_peak']:.0%} of the GEMM peak")
            report["models"].append(entry)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    log(f"wrote {args.out.with_suffix('.json')} and .png")
    print(json.dumps({m["model"]: {f"{d['mode']} {d['gen_len']}": {"seconds": d["seconds"],
                                                                   "compute_share": d["phase_share"]["compute"]}
                                   for d in m["decodes"]} for m in report["models"]}))
    return report


if __name__ == "__main__":
    main()

"""Continuous batching against fixed batches: tokens/s, row utilisation, time to first block
and per-request latency, on the held-out task prompts of a shipped model.

    .venv/bin/python benchmarks/batching.py [--cases llada-12m:fast-dllm llada-12m:fast-dllm-dual
        idlm-tiny:isd] [--n 300] [--gen 256] [--batches 8 16] [--rates 1 2 4] [--stream-n 48]
        [--out benchmarks/results/batching]

Two servers decode the same requests with the same decode config, in one run:

- fixed: today's `Decoder.decode` over fixed batches of `b` requests, each batch decoding
  until its slowest request is done (a request that arrives while a batch runs waits for it);
- engine: `dlm_jax.runtime.engine.Engine(max_batch=b)`, requests joining and leaving between
  steps.

Workloads: all `n` prompts at once (an eval), and Poisson arrivals at each rate of `--rates`
(requests per second, `--stream-n` requests each). Generation is `--gen` tokens with the EOS
stop on (a block of EOS ends a request), so answers of different lengths end at different
steps. Row utilisation: the batch rows that held a running request's step over all rows
computed (fixed: each request's steps over steps x batch bucket; engine: busy rows over
the rows of its calls). Tokens: the answers' tokens (to the first EOS). Seconds exclude the
time a decode waited for compiles (`DecodeStats.compile_wait_seconds`; both servers compile on
first use). Every request's tokens are compared between the two servers (batch invariance).

Prints JSON lines; writes <out>.json, <out>.md and <out>.png (latency against throughput).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402 (imports no JAX)


def prompt_texts(n: int) -> list[str]:
    """`n` held-out task prompts, the tasks interleaved."""
    from dlm_jax.training.data import TASKS, make_split

    tasks = sorted(TASKS)
    per = -(-n // len(tasks))
    out = [ex.prompt for t in tasks for ex in make_split(TASKS[t], per, split="heldout", seed=0)]
    order = np.random.default_rng(0).permutation(len(out))  # the tasks interleaved
    return [out[i] for i in order[:n]]


def _prompts(model, n: int) -> list[list[int]]:
    return [model.encode(text) for text in prompt_texts(n)]


def _trim(seq, eos) -> list[int]:
    ids = [int(t) for t in seq]
    return ids[:next((i for i, t in enumerate(ids) if t in eos), len(ids))]


def _waited(decoder) -> float:
    return decoder.build_counts().compile_wait_seconds


def _pct(xs, q) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if len(xs) else None


def fixed_batches(decoder, cfg, prompts, arrivals, b: int):
    """Static batching: whenever the decoder is free, the next (up to) b arrived requests
    decode as one batch until all of them are done. Yields (the batch's request indices, its
    `DecodeOutput`, start, end, first block), seconds since the first arrival's clock with
    compile waits excluded. The first block's own seconds include the batch's compile waits:
    taking all of them off (down to 0) may also take off waits that came after it, so the
    first block errs early."""
    n = len(prompts)
    excluded = 0.0
    t0 = time.perf_counter()
    nxt = 0
    while nxt < n:
        clock = time.perf_counter() - t0 - excluded
        if arrivals[nxt] > clock:
            time.sleep(arrivals[nxt] - clock)
            continue
        batch = [i for i in range(nxt, n) if arrivals[i] <= clock][:b]
        nxt = batch[-1] + 1
        w0 = _waited(decoder)
        start = time.perf_counter() - t0 - excluded
        out = decoder.decode([prompts[i] for i in batch], cfg)
        waited = _waited(decoder) - w0
        excluded += waited
        end = time.perf_counter() - t0 - excluded
        first = start + min(end - start, max(0.0, (out.stats.first_block_seconds or (end - start)) - waited))
        yield batch, out, start, end, first


def run_fixed(decoder, cfg, prompts, arrivals, b: int) -> dict:
    """The fixed batches of `fixed_batches`: the workload's summary."""
    eos = set(decoder.model_config.eos_ids)
    n = len(prompts)
    done_at, first_at, tokens = [0.0] * n, [0.0] * n, [None] * n
    rows = useful = 0
    for batch, out, _, end, first in fixed_batches(decoder, cfg, prompts, arrivals, b):
        st = out.stats
        bucket = decoder.capabilities.batches.select(len(batch))
        rows += st.nfe * bucket
        useful += sum(st.request_nfe)
        for j, i in enumerate(batch):
            tokens[i] = _trim(out.sequences[j], eos)
            done_at[i] = end
            first_at[i] = first
    makespan = max(done_at)
    return _summary("fixed", b, prompts, arrivals, tokens, done_at, first_at, makespan, useful / max(rows, 1))


def run_engine(decoder, cfg, prompts, arrivals, b: int, padding: str | None = None) -> dict:
    from dlm_jax.runtime.engine import Engine

    eos = set(decoder.model_config.eos_ids)
    n = len(prompts)
    engine = Engine(decoder, max_batch=b, padding=padding)
    reqs = [None] * n
    t0 = time.perf_counter()
    excluded = 0.0
    nxt = 0
    while nxt < n or not engine.idle:
        clock = time.perf_counter() - t0 - excluded
        while nxt < n and arrivals[nxt] <= clock:
            reqs[nxt] = engine.submit(prompts[nxt], cfg)
            reqs[nxt].arrived = arrivals[nxt]
            reqs[nxt].excluded_before = excluded
            nxt += 1
        if engine.idle:
            time.sleep(max(0.0, arrivals[nxt] - clock))
            continue
        w0 = _waited(decoder)
        engine.step()
        excluded += _waited(decoder) - w0
        now = time.perf_counter() - t0 - excluded
        for r in reqs[:nxt]:
            if r.stats.first_block_seconds is not None and not hasattr(r, "first_at"):
                r.first_at = now
            if r.done and not hasattr(r, "done_at"):
                r.done_at = now
    engine.close()
    tokens = [_trim(r.output.sequences[0], eos) for r in reqs]
    done_at = [r.done_at for r in reqs]
    first_at = [getattr(r, "first_at", r.done_at) for r in reqs]
    s = _summary("engine" if padding is None else f"engine-{padding}", b, prompts, arrivals, tokens, done_at, first_at, max(done_at), engine.stats.utilisation)
    s["calls"], s["ticks"] = engine.stats.calls, engine.stats.ticks
    s["calls_per_tick"] = round(engine.stats.calls / max(engine.stats.ticks, 1), 3)
    return s


def _summary(server, b, prompts, arrivals, tokens, done_at, first_at, makespan, util) -> dict:
    lat = [d - a for d, a in zip(done_at, arrivals)]
    ttfb = [max(0.0, f - a) for f, a in zip(first_at, arrivals)]
    answer = sum(len(t) for t in tokens)
    return {"server": server, "max_batch": b, "requests": len(prompts), "answer_tokens": answer,
            "seconds": round(makespan, 4), "tokens_per_second": round(answer / makespan, 2) if makespan else 0.0,
            "row_utilisation": round(float(util), 4), "latency_p50": _pct(lat, 50), "latency_p99": _pct(lat, 99),
            "first_block_p50": _pct(ttfb, 50), "first_block_p99": _pct(ttfb, 99), "_tokens": tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=["llada-12m:fast-dllm", "llada-12m:fast-dllm-dual", "idlm-tiny:isd"],
                   help="shipped model:preset pairs")
    p.add_argument("--n", type=int, default=300, help="prompts of the all-at-once workload")
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    p.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0], help="Poisson arrivals, requests/s")
    p.add_argument("--stream-n", type=int, default=48, help="requests per Poisson workload")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "batching"))
    args = p.parse_args(argv)

    import dlm_jax

    rows, identical = [], {}
    for case in args.cases:
        model_name, name = case.split(":")
        model = dlm_jax.load(ROOT / "models" / model_name, executor="jax")
        decoder = model.decoder
        prompts = _prompts(model, max(args.n, args.stream_n))
        options = {} if name in ("isd", "ar") else {"block_len": args.block}
        cfg = dlm_jax.preset(name, gen_len=args.gen, **options)
        workloads = [("all at once", prompts[:args.n], [0.0] * args.n)]
        rng = np.random.default_rng(1)
        for rate in args.rates:
            gaps = rng.exponential(1.0 / rate, args.stream_n)
            workloads.append((f"poisson {rate:g}/s", prompts[:args.stream_n], list(np.cumsum(gaps) - gaps[0])))
        for b in args.batches:
            for label, ps, arrivals in workloads:
                pair = {}
                for server in (run_fixed, run_engine):
                    rec = server(decoder, cfg, ps, arrivals, b)
                    pair[rec["server"]] = rec.pop("_tokens")
                    rec.update(preset=name, model=model_name, workload=label)
                    rows.append(rec)
                    print(json.dumps(rec), flush=True)
                same = sum(a == e for a, e in zip(pair["fixed"], pair["engine"]))
                identical[f"{name} b{b} {label}"] = [same, len(ps)]
    import jax

    report = {"benchmark": "benchmarks/batching.py", "cases": args.cases, "gen_len": args.gen,
              "device": jax.devices()[0].device_kind, "executor_rows": getattr(decoder.executor, "rows", None),
              "block_len": args.block, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "cores": __import__("os").cpu_count(), "rows": rows, "identical_tokens": identical,
              "ratios": _ratios(rows)}
    out = Path(args.out)
    atomic_write_json(out.with_suffix(".json"), report, indent=1)
    atomic_write(out.with_suffix(".md"), markdown(report))
    atomic_write(out.with_suffix(".png"), plot(report))
    print(json.dumps(report["ratios"]))
    return 0


def _ratios(rows) -> list[dict]:
    """Engine over fixed, per (preset, batch, workload): tokens/s, utilisation, latency."""
    out = []
    keyed = {(r["model"], r["preset"], r["max_batch"], r["workload"], r["server"]): r for r in rows}
    for (model, preset, b, workload, server), e in keyed.items():
        if server != "engine":
            continue
        f = keyed[(model, preset, b, workload, "fixed")]
        out.append({"model": model, "preset": preset, "max_batch": b, "workload": workload,
                    "tokens_per_second_ratio": round(e["tokens_per_second"] / f["tokens_per_second"], 3),
                    "utilisation": [f["row_utilisation"], e["row_utilisation"]],
                    "latency_p50_ratio": round(e["latency_p50"] / f["latency_p50"], 3) if f["latency_p50"] else None,
                    "latency_p99_ratio": round(e["latency_p99"] / f["latency_p99"], 3) if f["latency_p99"] else None})
    return out


def markdown(rep: dict) -> str:
    lines = [f"# Continuous batching against fixed batches (gen {rep['gen_len']}, block {rep['block_len']}, EOS "
             f"stop; {rep['device']}, {rep['cores']} cores, JAX executor rows={rep['executor_rows']})", "",
             "Written by `benchmarks/batching.py`. Seconds exclude compile waits.", "",
             "| model | preset | batch | workload | server | tokens/s | row util. | latency p50 / p99 (s) | "
             "first block p50 / p99 (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        lines.append(f"| {r['model']} | {r['preset']} | {r['max_batch']} | {r['workload']} | {r['server']} | "
                     f"{r['tokens_per_second']} | {r['row_utilisation']} | {r['latency_p50']} / {r['latency_p99']} | "
                     f"{r['first_block_p50']} / {r['first_block_p99']} |")
    lines += ["", "Engine over fixed (same run):", "", "| preset | batch | workload | tokens/s ratio | "
              "utilisation fixed -> engine | latency p50 ratio | latency p99 ratio |", "|---|---|---|---|---|---|---|"]
    for r in rep["ratios"]:
        lines.append(f"| {r['preset']} | {r['max_batch']} | {r['workload']} | {r['tokens_per_second_ratio']} | "
                     f"{r['utilisation'][0]} -> {r['utilisation'][1]} | {r['latency_p50_ratio']} | "
                     f"{r['latency_p99_ratio']} |")
    lines += ["", "Requests with identical tokens under both servers: "
              + ", ".join(f"{k}: {v[0]}/{v[1]}" for k, v in rep["identical_tokens"].items()), ""]
    return "\n".join(lines)


def plot(rep: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._plots import png_bytes

    presets = sorted({r["preset"] for r in rep["rows"]})
    fig, axes = plt.subplots(1, len(presets), figsize=(5.5 * len(presets), 4.2), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for server, marker in (("fixed", "o"), ("engine", "s")):
            for b in sorted({r["max_batch"] for r in rep["rows"]}):
                pts = [r for r in rep["rows"] if r["preset"] == preset and r["server"] == server
                       and r["max_batch"] == b and r["workload"].startswith("poisson")]
                if pts:
                    ax.plot([r["tokens_per_second"] for r in pts], [r["latency_p50"] for r in pts], marker=marker,
                            label=f"{server} b{b}")
        ax.set_xlabel("throughput (answer tokens/s)")
        ax.set_ylabel("median latency (s)")
        ax.set_title(f"{preset}: Poisson arrivals")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)


if __name__ == "__main__":
    raise SystemExit(main())

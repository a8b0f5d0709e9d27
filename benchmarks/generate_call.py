"""One `Model.generate` call against the decode it runs: what the engine around a decode costs.

    .venv/bin/python benchmarks/generate_call.py [--models llada-tiny llada-12m] [--prompts 1 4]
        [--reps 20] [--out benchmarks/results/generate_call]

`Model.generate` runs its prompts on the continuous-batching engine (`dlm_jax.Engine`), whose
pooled K/V cache is allocated (and zeroed) when a call starts and released when it ends. Per
model (JAX executor, float32, dual cache, generation 128, block 32, threshold 0.9) and number
of prompts, in one run and alternating, the median wall time of:

- decode: `model.decoder.decode(ids, cfg)`, the fixed batch alone (no engine);
- generate: `model.generate(ids, cfg)`, its engine sized to the call (rows: the batch bucket
  of the prompts; slots: the longest prompt + generation);
- engine at limits: an `Engine` with its defaults (rows: the largest batch bucket whose K/V
  fit 1 GiB; slots: the model's limit), the same requests submitted and run, which is how
  `generate` ran before it sized its engine.

Tokens must be equal across the three (exit status 1 otherwise). Ratios: generate / decode and
engine at limits / generate. Prints JSON lines; writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _hardware import machine  # noqa: E402
from _models import MODELS, model_path, prompts_for  # noqa: E402
from _plots import png_bytes  # noqa: E402

from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402

WAYS = ("decode", "generate", "engine at limits")


def run_case(name: str, workdir: Path, n_prompts: int, reps: int, gen: int) -> dict[str, Any]:
    import dlm_jax
    from dlm_jax.runtime.engine import Engine, _eos_cut

    model = dlm_jax.load(model_path(name, workdir), executor="jax")
    ids = prompts_for(name, model, n_prompts)
    cfg = dlm_jax.decode_config(gen_len=gen, block_len=32, cache="dual", rule="threshold", threshold=0.9)
    pools: dict[str, tuple[int, int]] = {}

    eos = model.decoder.model_config.eos_ids

    def decode():  # its sequences are the gen_len ids: cut at the first EOS as the engine's answers are
        return [list(map(int, s[:_eos_cut(s, eos)])) for s in model.decoder.decode(ids, cfg).sequences]

    def generate():
        return [list(map(int, t)) for t in model.generate(ids, cfg).token_ids]

    def at_limits():
        engine = Engine(model.decoder)
        pools["engine at limits"] = (engine.max_batch, engine.max_tokens)
        try:
            reqs = [engine.submit(i, cfg) for i in ids]
            engine.run()
            return [list(map(int, r.tokens())) for r in reqs]
        finally:
            engine.close()

    calls = {"decode": decode, "generate": generate, "engine at limits": at_limits}
    tokens = {way: call() for way, call in calls.items()}  # compiles, and the answers compared
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(reps):
        for way in WAYS:
            t = time.perf_counter()
            calls[way]()
            seconds[way].append(time.perf_counter() - t)
    med = {way: statistics.median(s) for way, s in seconds.items()}
    same = all(tokens[way] == tokens["decode"] for way in WAYS[1:])
    return {"model": name, "prompts": n_prompts, "seconds": med, "all_seconds": seconds,
            "generate_over_decode": med["generate"] / med["decode"],
            "limits_over_generate": med["engine at limits"] / med["generate"],
            "pool_at_limits": pools.get("engine at limits"), "same_tokens": bool(same)}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# One `Model.generate` call against its decode ({report['machine']['cpu']})", "",
             f"Written by `benchmarks/generate_call.py`: JAX executor, dual cache, generation {report['gen']}, "
             f"block 32, threshold 0.9; median of {report['reps']} calls each, alternating.", "",
             "| model | prompts | decode s | generate s | engine at limits s | generate / decode | "
             "at limits / generate | pool at limits (rows x slots) | same tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for c in report["cases"]:
        s = c["seconds"]
        pool = c["pool_at_limits"]
        lines.append(f"| {c['model']} | {c['prompts']} | {s['decode']:.4f} | {s['generate']:.4f} | "
                     f"{s['engine at limits']:.4f} | {c['generate_over_decode']:.2f} | {c['limits_over_generate']:.2f} | "
                     f"{pool[0]} x {pool[1]} | {'yes' if c['same_tokens'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(cases)), 3.5))
    width = 0.27
    for k, way in enumerate(WAYS):
        ax.bar([i + (k - 1) * width for i in range(len(cases))], [c["seconds"][way] * 1e3 for c in cases], width,
               label=way)
    ax.set_xticks(range(len(cases)), [f"{c['model']}\n{c['prompts']} prompt(s)" for c in cases], fontsize=8)
    ax.set_ylabel("ms per call (median)")
    ax.set_title("Model.generate against its decode")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=(*MODELS, "llada-12m"), default=["llada-tiny", "llada-12m"])
    p.add_argument("--prompts", type=int, nargs="+", default=[1, 4])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--out", type=Path, default=HERE / "results" / "generate_call")
    args = p.parse_args(argv)
    if any(n <= 0 for n in args.prompts) or args.reps <= 0:
        p.error("--prompts and --reps must be positive")
    if args.gen <= 0 or args.gen % 32:
        p.error(f"--gen {args.gen}: a positive multiple of the block, 32")
    report: dict[str, Any] = {"benchmark": "benchmarks/generate_call.py", "machine": machine(), "gen": args.gen,
                              "reps": args.reps, "cases": []}
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            for n in args.prompts:
                case = run_case(name, Path(work), n, args.reps, args.gen)
                print(json.dumps({k: v for k, v in case.items() if k != "all_seconds"}), flush=True)
                report["cases"].append(case)
    atomic_write_json(args.out.with_suffix(".json"), report, indent=1)
    atomic_write(args.out.with_suffix(".md"), markdown(report))
    atomic_write(args.out.with_suffix(".png"), plot(report))
    print(markdown(report))
    return 0 if all(c["same_tokens"] for c in report["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())

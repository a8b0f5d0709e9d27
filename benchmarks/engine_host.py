"""The engine's host time: what a request costs the host per step and per `submit`, at an
older commit against the working tree, each side in fresh processes, the two alternating.

    .venv/bin/python benchmarks/engine_host.py [--base 0f156f2] [--batches 1 4 16] [--repeats 3]
        [--model models/llada-tiny] [--out benchmarks/results/engine_host]

An engine (`dlm_jax.Engine`, the JAX executor) decodes `b` requests submitted at once, each
its own prompt, 64 tokens with the dual cache and one token committed per step (`rule="topk"`:
every request takes 64 steps, all in step together), once to warm up and once timed. Between
the executor's calls everything is the host's: each request's decode loop (plan, inputs,
proposals, commit rule, state), the engine's grouping, merging and splitting of the calls'
rows, streaming. Reported per batch: host microseconds per request-step (the timed run's wall
time less the executor's, over the requests' steps), the executor's milliseconds per tick,
the host's share of a tick, and `Engine.submit`'s milliseconds per request (its options
checked and the prompt encoded). With `--base`, the same in a copy of that commit's
`dlm_jax/` (`git archive`), each repeat a fresh process per side in alternating order, and
the working tree over the base as ratios (the medians of the repeats), with whether both
decoded the same tokens. Without `--base`, the working tree alone.

Prints JSON lines; writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402 (imports no JAX)

from _commits import extract, run_case  # noqa: E402

GEN = 64

_CASE = """
import hashlib, json, sys, time
import dlm_jax
model_dir, gen, batches = sys.argv[1], int(sys.argv[2]), [int(b) for b in sys.argv[3].split(",")]
model = dlm_jax.load(model_dir, executor="jax")
config = dlm_jax.preset("fast-dllm", gen_len=gen)
options = {"cache": "dual", "rule": "topk"}
out = {"file": dlm_jax.__file__, "batches": {}}
for b in batches:
    prompts = [f"{100 + 7 * i}+{200 + 3 * i}=" for i in range(b)]
    for timed in (False, True):
        engine = dlm_jax.Engine(model, config, max_batch=b)
        t0 = time.perf_counter()
        handles = [engine.submit(p, options, seed=i) for i, p in enumerate(prompts)]
        t1 = time.perf_counter()
        engine.run()
        t2 = time.perf_counter()
    tokens = [h.result().token_ids for h in handles]
    steps = sum(h.request.stats.steps for h in handles)
    s = engine.stats
    out["batches"][b] = {"submit_ms": 1e3 * (t1 - t0) / b, "wall_s": t2 - t1, "executor_s": s.step_seconds,
                         "ticks": s.ticks, "request_steps": steps,
                         "tokens": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}
print(json.dumps(out))
"""


def run(pythonpath: str, model: Path, batches: list[int]) -> dict:
    return run_case(_CASE, [str(model), str(GEN), ",".join(map(str, batches))], pythonpath)


def summary(runs: list[dict], b: int) -> dict:
    """The medians of one side's repeats at batch `b`."""
    rows = [r["batches"][str(b)] for r in runs]
    host_us = [1e6 * (r["wall_s"] - r["executor_s"]) / r["request_steps"] for r in rows]
    tick_ms = [1e3 * r["executor_s"] / r["ticks"] for r in rows]
    share = [(r["wall_s"] - r["executor_s"]) / r["wall_s"] for r in rows]
    return {"host_us_per_request_step": round(statistics.median(host_us), 1),
            "executor_ms_per_tick": round(statistics.median(tick_ms), 3),
            "host_share_of_tick": round(statistics.median(share), 4),
            "submit_ms": round(statistics.median(r["submit_ms"] for r in rows), 3),
            "request_steps": rows[0]["request_steps"], "tokens": sorted({r["tokens"] for r in rows})}


def markdown(report: dict) -> str:
    base = report["base"]
    lines = [f"# The engine's host time ({report['machine']}, {report['cores']} cores, JAX executor)", "",
             f"Written by `benchmarks/engine_host.py`. Model `{report['model']}`; each request {GEN} tokens, dual "
             f"cache, one token committed per step; median of {report['repeats']} fresh processes per side"
             + (f", alternating with commit `{base}`." if base else ".") + f" Working tree: `{report['tree']}`.", "",
             "| batch | side | host us / request-step | executor ms / tick | host share of a tick | submit ms / request |",
             "|---|---|---|---|---|---|"]
    for row in report["rows"]:
        for side in ("base", "tree"):
            if row.get(side):
                s = row[side]
                lines.append(f"| {row['batch']} | {base if side == 'base' else 'working tree'} | "
                             f"{s['host_us_per_request_step']} | {s['executor_ms_per_tick']} | "
                             f"{s['host_share_of_tick']} | {s['submit_ms']} |")
    if base:
        lines += ["", "Working tree over the base (same run):", "",
                  "| batch | host per request-step | submit | same tokens |", "|---|---|---|---|"]
        for row in report["rows"]:
            r = row["ratios"]
            lines.append(f"| {row['batch']} | {r['host_us_per_request_step']} | {r['submit_ms']} | "
                         f"{row['same_tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="an older commit to compare with (default: the working tree alone)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "llada-tiny")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine_host")
    args = ap.parse_args(argv)
    args.model = args.model.resolve()  # (the processes run elsewhere)
    sides: dict[str, list[dict]] = {"base": [], "tree": []}
    with tempfile.TemporaryDirectory() as before:
        paths = [("tree", str(ROOT))]
        if args.base:
            extract(args.base, before)
            paths.insert(0, ("base", before))
        for i in range(args.repeats):
            for side, path in (paths if i % 2 == 0 else paths[::-1]):
                sides[side].append(run(path, args.model, args.batches))
                print(json.dumps({"repeat": i, "side": side, **{f"b{b}_host_us_per_request_step": round(
                    1e6 * (r["wall_s"] - r["executor_s"]) / r["request_steps"], 1)
                    for b, r in ((int(k), v) for k, v in sides[side][-1]["batches"].items())}}), flush=True)
    rows = []
    for b in args.batches:
        row = {"batch": b, "tree": summary(sides["tree"], b)}
        if args.base:
            row["base"] = summary(sides["base"], b)
            row["ratios"] = {k: round(row["tree"][k] / row["base"][k], 3)
                             for k in ("host_us_per_request_step", "submit_ms")}
            row["same_tokens"] = row["tree"]["tokens"] == row["base"]["tokens"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "dlm_jax"], cwd=ROOT, capture_output=True, text=True)
    tree = (head.stdout.strip() or "unknown") + (" with changes to dlm_jax/" if dirty.stdout.strip() else "")
    report = {"benchmark": "benchmarks/engine_host.py", "base": args.base, "tree": tree, "model": args.model.name,
              "machine": platform.machine(), "cores": os.cpu_count(), "repeats": args.repeats, "gen_len": GEN,
              "rows": rows}
    atomic_write_json(args.out.with_suffix(".json"), report)
    atomic_write(args.out.with_suffix(".md"), markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

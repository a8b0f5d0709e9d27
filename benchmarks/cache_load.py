"""Where a second process's wait for its programs goes: trace, lower, and the load from JAX's
persistent compilation cache, per program, with a model's blocks traced once or one by one.

    .venv/bin/python benchmarks/cache_load.py --out benchmarks/results/cache_load
    PYTHONPATH=. python3 benchmarks/cache_load.py --xla-cache DIR --out $OUT/cache_load   (a GPU)

A process whose programs are all in the persistent cache still traces and lowers each one:
JAX keys an executable by its lowered module, so only then can it look the executable up
(and deserialize it). Here the JAX executor's resident step programs of a decode
(`benchmarks/gpu_step.py`'s steps: prompt 128, generation 256, blocks of 32; `--kinds`,
`--batches`, the blocks `--at`) at `--shape` (LLaDA-8B: 32 layers, lowered from abstract
shapes, no weights allocated) are first compiled into `--xla-cache` by a process of their own
(skipped where the cache already holds them), then loaded by `--repeats` fresh processes per
variant, the variants taking turns:

  once   the executor's programs as it builds them: the blocks of one structure traced once
         (`dlm_jax.models._transformer.layers_traced_once`);
  plain  every block traced where it is called (that context replaced by a null one).

Both lower to the same module (tests/executors/test_trace_once.py), so they share the
cache's entries. Per program and variant: the medians of the trace, lower and load (JAX's
`compile` on a cache hit) seconds; every load must be a hit (counted from JAX's monitoring
events) or the run fails. Writes <out>.json, .md and .png; prints the JSON.
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
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402 (imports no JAX)

VARIANTS = ("once", "plain")
PARTS = ("trace_s", "lower_s", "load_s")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One process: every program traced, lowered and compiled (a load where the cache has it)."""
    t0 = time.perf_counter()
    import contextlib

    import jax

    import gpu_step
    from dlm_jax.executors import jax_executor
    from dlm_jax.executors._compile import enable_persistent_cache, jitted

    import_s = time.perf_counter() - t0
    enable_persistent_cache(args.xla_cache)
    events: dict[str, int] = {}
    jax.monitoring.register_event_listener(lambda event, **_: events.__setitem__(event, events.get(event, 0) + 1))
    if args.child == "plain":
        jax_executor.layers_traced_once = contextlib.nullcontext
    cfg = gpu_step.model_config(args.shape, args.dtype)
    # a fresh abstract model: the cached one is shared and never mutated, and $DLM_JAX_LAYERS /
    # $DLM_JAX_PROJECTIONS would change this one in place
    executor = gpu_step.build_executor(gpu_step._abstract_model.__wrapped__(cfg), "split", None)
    slots = executor.capacity(gpu_step.Geometry("dual").total)
    steps = gpu_step.probe_steps(executor, args.batches, args.kinds, args.at)
    programs = []
    for (batch, kind, at), step in steps.items():
        hits = events.get("/jax/compilation_cache/cache_hits", 0)
        t = time.perf_counter()
        fn, specs = jitted(executor._build_resident, (step.key, slots))
        traced = fn.trace(*specs)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        programs.append({"program": f"{kind} {step.key}", "trace_s": t1 - t, "lower_s": t2 - t1, "load_s": t3 - t2,
                         "hit": events.get("/jax/compilation_cache/cache_hits", 0) > hits})
    dev = jax.devices()[0]
    return {"variant": args.child, "import_s": import_s, "programs": programs, "jax": jax.__version__,
            "device": f"{dev.platform}: {getattr(dev, 'device_kind', str(dev))}"}


def run_child(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", variant, "--xla-cache", str(args.xla_cache), "--shape", args.shape,
            "--dtype", args.dtype, "--kinds", *args.kinds, "--batches", *map(str, args.batches),
            "--at", *map(str, args.at), "--out", str(args.out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DLM_JAX_COMPILE_THREADS": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode:
        raise SystemExit(f"cache_load.py: the {variant} process failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    fill = run_child(args, "once")  # compiles what the cache lacks
    log(f"filled {args.xla_cache}: {sum(not p['hit'] for p in fill['programs'])} compiled, "
        f"{sum(p['hit'] for p in fill['programs'])} loaded, {time.perf_counter() - t0:.0f}s")
    runs: dict[str, list] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for variant in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
            run = run_child(args, variant)
            missed = [p["program"] for p in run["programs"] if not p["hit"]]
            if missed:
                raise SystemExit(f"cache_load.py: the {variant} process compiled {', '.join(missed)} instead of "
                                 "loading them: its lowered modules differ from the filling process's")
            runs[variant].append(run)
            log(f"{variant} {rep}: " + ", ".join(f"{k} {sum(p[k] for p in run['programs']):.2f}" for k in PARTS))
    names = [p["program"] for p in fill["programs"]]
    rows = []
    for i, name in enumerate(names):
        row: dict[str, Any] = {"program": name}
        for variant in VARIANTS:
            for part in PARTS:
                row[f"{variant}_{part}"] = statistics.median(r["programs"][i][part] for r in runs[variant])
            row[f"{variant}_total_s"] = sum(row[f"{variant}_{part}"] for part in PARTS)
        rows.append(row)
    totals = {f"{v}_{k}": sum(r[f"{v}_{k}"] for r in rows) for v in VARIANTS for k in (*PARTS, "total_s")}
    return {"benchmark": "benchmarks/cache_load.py", "shape": args.shape, "dtype": args.dtype, "kinds": args.kinds,
            "batches": args.batches, "at": args.at, "repeats": args.repeats, "device": fill["device"],
            "jax": fill["jax"], "machine": f"{platform.node()} ({os.cpu_count()} CPU cores)",
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "command": args.command, "import_s": statistics.median(
                r["import_s"] for v in VARIANTS for r in runs[v]),
            "programs": rows, "totals": totals,
            "once_over_plain": totals["once_total_s"] / totals["plain_total_s"],
            "trace_lower_once_over_plain": (totals["once_trace_s"] + totals["once_lower_s"])
            / (totals["plain_trace_s"] + totals["plain_lower_s"])}


def markdown(rep: dict[str, Any]) -> str:
    t = rep["totals"]
    lines = [
        "# A second process's programs: trace, lower, load from the persistent cache (`benchmarks/cache_load.py`)", "",
        f"{rep['device']}, jax {rep['jax']}, {rep['machine']}, {rep['date']}. The JAX executor's resident steps of "
        f"a decode at the `{rep['shape']}` shape ({rep['dtype']}, lowered from abstract shapes), kinds "
        f"{', '.join(rep['kinds'])}, batch {', '.join(map(str, rep['batches']))}, blocks "
        f"{', '.join(map(str, rep['at']))}; seconds are medians of {rep['repeats']} fresh processes per variant "
        f"(taking turns), every program a persistent-cache hit. once: the blocks of one structure traced once (the "
        f"executor's default); plain: every block traced where it is called. Imports (jax, dlm_jax): "
        f"{rep['import_s']:.2f} s a process. Command: `{rep['command']}`.", "",
        "| program | trace s once / plain | lower s once / plain | load s once / plain | total s once / plain |",
        "|---|---:|---:|---:|---:|"]
    for r in rep["programs"]:
        lines.append(f"| `{r['program']}` | " + " | ".join(
            f"{r[f'once_{k}']:.3f} / {r[f'plain_{k}']:.3f}" for k in (*PARTS, "total_s")) + " |")
    lines.append("| all | " + " | ".join(f"{t[f'once_{k}']:.2f} / {t[f'plain_{k}']:.2f}"
                                         for k in (*PARTS, "total_s")) + " |")
    lines += ["", f"Once / plain: {rep['once_over_plain']:.2f} of the whole, "
              f"{rep['trace_lower_once_over_plain']:.2f} of trace + lower."]
    return "\n".join(lines) + "\n"


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from _plots import png_bytes

    fig, ax = plt.subplots(figsize=(6, 3.2))
    bottom = [0.0, 0.0]
    for part, color in zip(PARTS, ("tab:blue", "tab:orange", "tab:gray")):
        vals = [rep["totals"][f"{v}_{part}"] for v in VARIANTS]
        ax.barh(VARIANTS, vals, left=bottom, color=color, label=part[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel(f"seconds, all {len(rep['programs'])} programs")
    ax.set_title(f"persistent-cache load of a decode's programs, {rep['shape']}, {rep['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, png_bytes(fig))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llada-8b", choices=("llada-8b", "small"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--kinds", nargs="+", default=["prefix"], choices=("refresh", "prefix", "dual"))
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--at", type=int, nargs="+", default=[0, 1, 2, 3], help="the blocks whose steps are taken")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--xla-cache", type=Path, help="the persistent cache (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=900, help="seconds a process may take")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = " ".join(["benchmarks/cache_load.py", *argv])
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.repeats < 1:
        raise SystemExit("cache_load.py: --repeats must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        if args.xla_cache is None:
            args.xla_cache = Path(tmp) / "xla"
        rep = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out.with_suffix(".json"), rep, indent=1)
    atomic_write(args.out.with_suffix(".md"), markdown(rep))
    plot(rep, args.out.with_suffix(".png"))
    print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())

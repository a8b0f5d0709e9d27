"""The attention kernel's tilings timed on this device, against the split form and float32.

    PYTHONPATH=. python3 benchmarks/kernel_sweep.py --out $OUT/kernel_sweep                (on a GPU)
    PYTHONPATH=. /tmp/venv12/bin/python benchmarks/kernel_sweep.py --target h200 --out /tmp/sweep
    .venv/bin/python benchmarks/kernel_sweep.py --shape small --stand-in --layers 2 --out /tmp/sweep

One decode step's attention over `--layers` layers (32: LLaDA-8B's; each layer its own cache
arrays, as a step reads them, so the caches do not stay in the GPU's L2 between layers), in the
steps of `benchmarks/attention_check.py` (the dual cache's: a window of 32 rows, every other of
384 slots read; the prefix cache's: 128 rows, the 256 slots before them read) at `--batches`,
at the LLaDA-8B shape and the grouped-query 8B shape (32 query heads over 8 K/V heads), in
bfloat16. Each form takes the same inputs in one program:

  split        `attend_cached` (XLA's kernels: the GPU's default form);
  pallas:NAME  dlm-jax's kernel (`dlm_jax.models._attention_kernel`) under the tiling NAME (a
               `Tiling`: the query rows a program takes, one head's or a grouped K/V head's
               stacked heads', the cache slots a loop step reads, Triton's warps and stages).

`--tilings` names presets (`TILINGS`: the default, and one setting changed at a time) or
gives its own as `rows=32,stacked=64,k=128,warps=8,stages=2`. Per case and form: the median
over `--reps` rounds of `--calls` calls dispatched back to back, per layer (microseconds); the
cache bytes the step needs per layer (the slots its rows see, keys and values) over that time,
against the device's copy bandwidth; and layer 0's output against float32 attention over the
concatenation (mean and largest error, `attention_check.py`'s margins: a tiling whose error
strays past them is not a candidate). Per case the fastest tiling within the margins, its time
over the split form's and over the default tiling's. The default tiling is what the executor
traces (`DEFAULT_TILING`): a lease's sweep says which to make the default.

`--target h200` (or a `GpuTargetConfigProto` file, as `gpu_step.py --target` takes) compiles
each program for that GPU without one, no timing: which tilings Triton takes at these shapes
(shared memory, registers), and each program's kernels. `--stand-in` runs the kernel in
Pallas's interpreter on any device (the code path, not its speed). Writes <out>.json, .md and
.png (times over the split form's) after every case, so a run cut short keeps the cases it
finished.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import _sweep  # noqa: E402
from _plots import png_bytes  # noqa: E402
from _profile import hlo_kernels  # noqa: E402
from attention_check import MAX_MARGIN, MEAN_MARGIN, SHAPES, STEPS, errors, inputs  # noqa: E402
from gemm_probe import time_calls  # noqa: E402  (calls back to back, the median of rounds)
from dlm_jax._integrity import atomic_write  # noqa: E402
from dlm_jax.models import _attention_kernel  # noqa: E402
from dlm_jax.models._attention_kernel import Tiling  # noqa: E402
from dlm_jax.models._transformer import attend, attend_cached  # noqa: E402

# The default, then one setting changed at a time.
TILINGS = {"default": Tiling(), "k32": Tiling(block_k=32), "k128": Tiling(block_k=128),
           "rows32": Tiling(rows=32, stacked_rows=64), "warps8": Tiling(warps=8), "warps4": Tiling(warps=4),
           "stages2": Tiling(stages=2), "stages4": Tiling(stages=4)}
_FIELDS = {"rows": "rows", "stacked": "stacked_rows", "k": "block_k", "warps": "warps", "stages": "stages"}
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


tiling = _sweep.tiling_type(TILINGS, _FIELDS, Tiling)  # (the --tilings type: a preset, or key=value pairs)


def program(form: str, tile: Tiling | None):
    """A program over every layer: (q, k caches, v caches, k, v, mask) -> each layer's output.
    A new function per form, so each is traced anew under its own tiling."""
    if form == "split":
        def one(q, kc, vc, k, v, mask):
            return attend_cached(q, kc, vc, k, v, mask, heads_first=True)
    else:
        def one(q, kc, vc, k, v, mask):
            return _attention_kernel.attend_kernel(q, kc, vc, k, v, mask)

    def layers(q, kcs, vcs, k, v, mask):
        return [one(q, kc, vc, k, v, mask) for kc, vc in zip(kcs, vcs)]

    return layers


def case_inputs(batch: int, kind: str, window: int, slots: int, start: int, heads, layers: int, seed: int):
    """`attention_check.inputs` with a cache per layer (layer 0's is attention_check's)."""
    (q, kc, vc, k, v), mask = inputs(batch, kind, window, slots, start, heads, seed)
    kcs, vcs = [kc], [vc]
    for i in range(1, layers):  # (other layers: other random caches, made on the device)
        key = jax.random.key(seed * 1000 + i)
        kcs.append(jax.random.normal(jax.random.fold_in(key, 0), kc.shape, jnp.bfloat16))
        vcs.append(jax.random.normal(jax.random.fold_in(key, 1), vc.shape, jnp.bfloat16))
    return (q, kcs, vcs, k, v, mask)


def run(args: argparse.Namespace, target=None) -> dict[str, Any]:
    dev = target if target is not None else jax.devices()[0]
    rep: dict[str, Any] = {
        "benchmark": "benchmarks/kernel_sweep.py", "shapes": {s: SHAPES[s] for s in args.shape},
        "device": {"backend": "gpu" if target is not None else jax.default_backend(),
                   "kind": getattr(dev, "device_kind", str(dev))},
        "mode": "compile only" if target is not None else "stand-in" if args.stand_in else "timed",
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "machine": f"{platform.node()} ({os.cpu_count()} CPU cores)",
        "command": " ".join(["benchmarks/kernel_sweep.py", *args.argv]), "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "environment": {"XLA_FLAGS": os.environ.get("XLA_FLAGS")}, "layers": args.layers, "calls": args.calls,
        "reps": args.reps, "margins": {"mean": MEAN_MARGIN, "max": MAX_MARGIN},
        "tilings": {name: dataclasses.asdict(t) for name, t in args.tilings},
        "default_tiling": dataclasses.asdict(_attention_kernel.DEFAULT_TILING), "notes": list(args.note),
        "complete": False, "cases": []}
    if target is None and not args.stand_in:
        rep["device"]["copy_gbps"] = _sweep.copy_gbps()
        log(f"copy bandwidth {rep['device']['copy_gbps']:.0f} GB/s on {rep['device']['kind']}")
    forms = [("split", None)] + [(f"pallas:{name}", t) for name, t in args.tilings]
    with contextlib.ExitStack() as context:
        if args.stand_in:
            context.enter_context(_attention_kernel.interpret())
        for shape in args.shape:
            for batch in args.batches:
                for kind, window, slots, start in (s for s in STEPS[shape] if s[0] in args.kinds):
                    rep["cases"].append(one_case(args, rep, target, forms, shape, batch, kind, window, slots, start))
                    write(rep, args.out)  # (after every case: a part cut by its time limit keeps what it has)
    rep["complete"] = True
    write(rep, args.out)
    return rep


def one_case(args, rep, target, forms, shape, batch, kind, window, slots, start) -> dict[str, Any]:
    h, hkv, dh = SHAPES[shape]
    seen = slots - window if kind == "dual" else start  # (the slots its rows read)
    case: dict[str, Any] = {"shape": shape, "batch": batch, "kind": kind, "window": window, "slots": slots,
                            "read_slots": seen, "cache_bytes": batch * hkv * seen * dh * 2 * 2, "forms": {}}
    if target is not None:
        from gpu_step import on_device

        q, kc, k, mask = (jax.ShapeDtypeStruct(s, d) for s, d in (
            ((batch, window, h, dh), jnp.bfloat16), ((batch, hkv, slots, dh), jnp.bfloat16),
            ((batch, window, hkv, dh), jnp.bfloat16), ((batch, window, slots + window), jnp.bool_)))
        specs = on_device((q, [kc] * args.layers, [kc] * args.layers, k, k, mask), target)
    else:
        values = case_inputs(batch, kind, window, slots, start, SHAPES[shape], args.layers, args.seed)
        q, kcs, vcs, k, v, mask = values
        f32 = [x.astype(jnp.float32) for x in (q, kcs[0], vcs[0], k, v)]
        ref = np.asarray(attend(f32[0], jnp.concatenate([f32[1].swapaxes(1, 2), f32[3]], 1),
                                jnp.concatenate([f32[2].swapaxes(1, 2), f32[4]], 1), mask))
        blind = ~np.asarray(mask)[0, :, :slots].any(-1)
    for name, tile in forms:
        row: dict[str, Any] = {}
        try:
            with _attention_kernel.tiled(tile or _attention_kernel.DEFAULT_TILING), \
                    (jax.default_device(target) if target is not None else contextlib.nullcontext()):
                t0 = time.perf_counter()
                exe = jax.jit(program(name, tile)).lower(*(specs if target is not None else values)).compile()
                row["compile_s"] = round(time.perf_counter() - t0, 3)
            if target is not None:
                row["kernels"] = hlo_kernels(exe.as_text())
            else:
                row.update(errors(exe(*values)[0], ref, blind))
                row["us_per_layer"] = time_calls(exe, values, calls=args.calls, reps=args.reps) / args.layers * 1e6
                row["cache_gbps"] = case["cache_bytes"] / row["us_per_layer"] / 1e3
                if "copy_gbps" in rep["device"]:
                    row["over_copy"] = row["cache_gbps"] / rep["device"]["copy_gbps"]
        except Exception as e:  # noqa: BLE001 - a tiling Triton refuses (shared memory, say) is its row's error
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        case["forms"][name] = row
        log(f"{shape} b{batch} {kind} {name}: " + (row["error"] if "error" in row else
            f"compiled in {row['compile_s']:.1f} s" + (f", {row['us_per_layer']:.1f} us a layer, mean error "
                                                        f"{row['mean_error']:.3g}" if "us_per_layer" in row else "")))
    summarize(case)
    return case


def summarize(case: dict[str, Any]) -> None:
    """Each kernel form's verdict (finite, within the margins of the split form's errors), and
    the fastest that passes, over the split form and over the default tiling."""
    split = case["forms"]["split"]
    if "us_per_layer" not in split:
        return
    for name, r in case["forms"].items():
        r["pass"] = "error" not in r and r["finite"] and r["mean_error"] <= MEAN_MARGIN * split["mean_error"] \
            and r["max_error"] <= MAX_MARGIN * split["max_error"] if name != "split" else "error" not in r
    _sweep.rank(case, {n: r for n, r in case["forms"].items() if n != "split" and r["pass"]}, "split", "us_per_layer")


def markdown(rep: dict[str, Any]) -> str:
    dev = rep["device"]
    timed = rep["mode"] != "compile only"
    lines = ["# The attention kernel's tilings (`benchmarks/kernel_sweep.py`)", "",
             f"{dev['kind']} ({dev['backend']}, {rep['mode']})"
             + (f", copy bandwidth {dev['copy_gbps']:.0f} GB/s" if "copy_gbps" in dev else "")
             + f", jax {rep['versions']['jax']}, {rep['date']}; one step's attention over {rep['layers']} layers, "
             f"bfloat16" + (f"; median of {rep['reps']} rounds of {rep['calls']} calls back to back" if timed else "")
             + ("" if rep.get("complete", True) else f" (cut short after {len(rep['cases'])} cases)")
             + f". `{rep['command']}`"
             + (f"; XLA_FLAGS {rep['environment']['XLA_FLAGS']}" if rep["environment"].get("XLA_FLAGS") else ""), "",
             "Tilings: " + "; ".join(f"{n} " + ", ".join(f"{k}={v}" for k, v in t.items())
                                     for n, t in rep["tilings"].items()) + ".", "",
             *[f"- {n}" for n in rep.get("notes", [])], ""]
    if timed:
        lines += ["| shape | batch | step | form | us / layer | cache GB/s | / copy | mean error | largest error | "
                  "within margins |", "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    else:
        lines += ["| shape | batch | step | form | compile s | kernels |", "|---|---:|---|---|---:|---:|"]
    for c in rep["cases"]:
        for name, r in c["forms"].items():
            where = f"| {c['shape']} | {c['batch']} | {c['kind']} | {name} |"
            if "error" in r:
                lines.append(f"{where} {r['error']} |" + " |" * (5 if timed else 1))
            elif timed:
                lines.append(f"{where} {r['us_per_layer']:.2f} | {r['cache_gbps']:.4g} | "
                             + (f"{r['over_copy']:.2f}" if "over_copy" in r else "-")
                             + f" | {r['mean_error']:.3g} | {r['max_error']:.3g} | {'yes' if r.get('pass') else 'NO'} |")
            else:
                lines.append(f"{where} {r['compile_s']:.1f} | {r['kernels']['kernels']} |")
    if timed:
        lines += ["", "| shape | batch | step | split us | default tiling us | fastest within margins | its us | "
                  "fastest / split | fastest / default |", "|---|---:|---|---:|---:|---|---:|---:|---:|"]
        for c in rep["cases"]:
            f = c["forms"]
            d = f.get("pallas:default", {})
            lines.append(f"| {c['shape']} | {c['batch']} | {c['kind']} | {f['split'].get('us_per_layer', 0):.2f} | "
                         + (f"{d['us_per_layer']:.2f}" if "us_per_layer" in d else "-") + " | "
                         + (f"{c['best']} | {f[c['best']]['us_per_layer']:.2f} | {c['best_over_split']:.3f} | "
                            + (f"{c['best_over_default']:.3f}" if "best_over_default" in c else "-")
                            if "best" in c else "none | - | - | -") + " |")
    return "\n".join(lines) + "\n"


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in rep["cases"] if "us_per_layer" in c["forms"]["split"]]
    names = [n for n in rep["cases"][0]["forms"] if n != "split"] if rep["cases"] else []
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(cases) * max(1, len(names)) / 3), 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ys = [c["forms"][name]["us_per_layer"] / c["forms"]["split"]["us_per_layer"]
              if "us_per_layer" in c["forms"][name] else 0 for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=name.split(":", 1)[-1])
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="split form")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))],
                  [f"{c['shape']}\nb{c['batch']} {c['kind']}" for c in cases], fontsize=7)
    ax.set_ylabel("time / split form's")
    ax.set_title(f"attention kernel tilings, {rep['device']['kind']} ({rep['mode']})", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    atomic_write(path, png_bytes(fig))


def write(rep: dict[str, Any], out: Path) -> None:
    _sweep.write(rep, out, markdown, plot)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["llada-8b", "gqa-8b"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--kinds", nargs="+", choices=("dual", "prefix"), default=["dual", "prefix"])
    _sweep.add_flags(p, TILINGS, _FIELDS, Tiling, layers=32)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args, target = _sweep.parse(p, argv, ("layers", "calls", "reps", "batches"))
    run(args, target)  # (written case by case)
    print(f"wrote {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

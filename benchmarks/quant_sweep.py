"""The quantized GEMM kernel's tilings timed on this device, against XLA's forms.

    PYTHONPATH=. python3 benchmarks/quant_sweep.py --out $OUT/quant_sweep                (on a GPU)
    PYTHONPATH=. /tmp/venv12/bin/python benchmarks/quant_sweep.py --target h200 --out /tmp/qsweep
    .venv/bin/python benchmarks/quant_sweep.py --shape small --stand-in --rows 8 --out /tmp/qsweep

One layer's projections at `--shape` (LLaDA-8B: q, k, v and o 4096 -> 4096, gate and up
4096 -> 12288, down 12288 -> 4096; `--kernels` picks), `--layers` copies of each kernel in one
program (so the weights do not stay in the GPU's L2 between calls), over `--rows` activation
rows (32: a dual-cache step at batch 1; 256: at batch 8, or a prefix step's 128 rows at batch 2)
in bfloat16, each weight-only `--quant` mode (`dlm_jax.models.quant`'s: int8-g128, int4-g128,
uint4-g128, int4-g128-act, ...) in these forms:

  bf16         the unquantized kernel (the weight-read floor's other side);
  xla          the mode's product as a model computes it without the kernel
               (`quantized_matmul`: the weights dequantised in a fusion of their own, then read
               by the GEMM);
  pallas:NAME  dlm-jax's kernel (`dlm_jax.models._quant_kernel`) under the tiling NAME (a
               `Tiling`: rows and columns a program takes, the shares of the input rows summed
               apart, Triton's warps and stages).

`--quant none`: the unquantized bfloat16 kernel, XLA's GEMM (xla) against the same Pallas
kernel reading the bfloat16 weights as they are (pallas:NAME): whether a weight-streaming kernel
of dlm-jax's own reads a batch-1 step's weights faster than XLA's GEMMs do (the measured 8B
steps ran at 28-41% of the memory bandwidth; the model's unquantized products are XLA's).

`--tilings` names presets (`TILINGS`) or gives its own as `m=64,n=64,split=4,warps=4,stages=3`.
Per case and form: the median over `--reps` rounds of `--calls` calls back to back, per kernel
(microseconds); the kernel's stored bytes over that time, against the device's copy bandwidth
(the weight-read rate: at 32 rows a product is a read of its weights); and the largest
difference from the xla form's product over its largest value (a tiling past 1e-2 computes
something else and is not a candidate). Per case the fastest tiling, its time over the xla
form's, over the default tiling's and over bf16's. The default tiling is what the executor
traces (`DEFAULT_TILING`): a lease's sweep says which to make the default, and whether the
kernel beats XLA's form at all (then `$DLM_JAX_QUANT_KERNEL=pallas` could become the GPU's
default for these modes).

`--target h200` (or a `GpuTargetConfigProto` file, as `gpu_step.py --target` takes) compiles
each program for that GPU without one, no timing: which tilings Triton takes at these shapes,
and each program's kernels and the bytes they write (a split's partial sums).
`--stand-in` runs the kernel in Pallas's interpreter on any device (the code path, not its
speed). Writes <out>.json, .md and .png (times over the xla form's) after every case, so a
run cut short keeps the cases it finished.
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
from gemm_probe import time_calls  # noqa: E402  (calls back to back, the median of rounds)
from dlm_jax._integrity import atomic_write  # noqa: E402
from dlm_jax.models import _attention_kernel, _quant_kernel  # noqa: E402
from dlm_jax._config import act_order  # noqa: E402
from dlm_jax.models._quant_kernel import QUANT_KERNEL_ENV, Tiling  # noqa: E402
from dlm_jax.models.quant import gpu_bytes as nbytes, check_quant, quantize_kernel, quantized_matmul  # noqa: E402

# (input width, output width) of each kernel of one layer, by shape.
SHAPES = {"llada-8b": {"qkvo": (4096, 4096), "gate_up": (4096, 12288), "down": (12288, 4096)},
          "small": {"qkvo": (256, 256), "gate_up": (256, 768), "down": (768, 256)}}
# The default (its split `auto_split`'s), then one setting changed at a time, then a split with narrower columns.
TILINGS = {"default": Tiling(), "n64": Tiling(block_n=64), "n32": Tiling(block_n=32), "n256": Tiling(block_n=256),
           "split1": Tiling(split=1), "split2": Tiling(split=2), "split4": Tiling(split=4), "split8": Tiling(split=8),
           "n64split4": Tiling(block_n=64, split=4), "warps8": Tiling(warps=8), "stages2": Tiling(stages=2),
           "stages4": Tiling(stages=4)}
_FIELDS = {"m": "block_m", "n": "block_n", "split": "split", "warps": "warps", "stages": "stages"}
MARGIN = 1e-2  # the largest difference from XLA's form, over its largest value, that a tiling may show
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


tiling = _sweep.tiling_type(TILINGS, _FIELDS, Tiling)  # (the --tilings type: a preset, or key=value pairs)


def weights(rows: int, cols: int, mode: str, layers: int, seed: int) -> list[tuple]:
    """`layers` kernels [rows, cols]: bfloat16 ("none"), else (q, scale, zero, g_idx) by the
    quantizer `dlm_jax.load(quant=...)` uses (act-order: the rows' groups shuffled, as GPTQ's
    desc_act leaves them)."""
    out = []
    for i in range(layers):
        key = jax.random.fold_in(jax.random.key(seed), i)
        w = 0.02 * jax.random.normal(key, (rows, cols), jnp.float32)
        if mode == "none":
            out.append((w.astype(jnp.bfloat16),))
            continue
        q, scale, zero = quantize_kernel(w, mode=mode)
        g_idx = None
        if act_order(mode):
            g_idx = jax.random.permutation(jax.random.fold_in(key, 1), jnp.arange(rows) // (rows // scale.shape[0]))
            g_idx = g_idx.astype(jnp.int32)
        out.append((q, scale, zero, g_idx))
    return out


def program(form: str):
    """x [M, I], the kernels -> each kernel's product [M, O] in bfloat16. A new function per
    form, so each is traced anew under its own tiling."""
    def one(x, w):
        if form == "bf16" or (form == "xla" and len(w) == 1):  # (--quant none: xla is the bfloat16 GEMM)
            return jnp.dot(x, w[0], preferred_element_type=jnp.float32).astype(x.dtype)
        if form == "xla":
            return quantized_matmul(x, *w, dtype=x.dtype)
        return _quant_kernel.grouped_matmul(x, *w, out_dtype=x.dtype)

    return lambda x, ws: [one(x, w) for w in ws]


def run(args: argparse.Namespace, target=None) -> dict[str, Any]:
    dev = target if target is not None else jax.devices()[0]
    rep: dict[str, Any] = {
        "benchmark": "benchmarks/quant_sweep.py", "shape": args.shape, "kernels": SHAPES[args.shape],
        "device": {"backend": "gpu" if target is not None else jax.default_backend(),
                   "kind": getattr(dev, "device_kind", str(dev))},
        "mode": "compile only" if target is not None else "stand-in" if args.stand_in else "timed",
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "machine": f"{platform.node()} ({os.cpu_count()} CPU cores)",
        "command": " ".join(["benchmarks/quant_sweep.py", *args.argv]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "environment": {"XLA_FLAGS": os.environ.get("XLA_FLAGS")}, "layers": args.layers, "calls": args.calls,
        "reps": args.reps, "margin": MARGIN, "tilings": {name: dataclasses.asdict(t) for name, t in args.tilings},
        "default_tiling": dataclasses.asdict(_quant_kernel.DEFAULT_TILING), "notes": list(args.note),
        "complete": False, "cases": []}
    if target is None and not args.stand_in:
        rep["device"]["copy_gbps"] = _sweep.copy_gbps()
        log(f"copy bandwidth {rep['device']['copy_gbps']:.0f} GB/s on {rep['device']['kind']}")
    with contextlib.ExitStack() as context:
        if args.stand_in:
            context.enter_context(_attention_kernel.interpret())
        for kernel in args.kernels:
            rows, cols = SHAPES[args.shape][kernel]
            bf16 = None if target is not None else weights(rows, cols, "none", args.layers, args.seed)
            for mode in args.quant:
                ws = bf16 if mode == "none" else None if target is not None else weights(
                    rows, cols, mode, args.layers, args.seed)
                for m in args.rows:
                    rep["cases"].append(one_case(args, rep, target, kernel, mode, m, rows, cols, ws, bf16))
                    write(rep, args.out)  # (after every case: a part cut by its time limit keeps what it has)
    rep["complete"] = True
    write(rep, args.out)
    return rep


def one_case(args, rep, target, kernel, mode, m, rows, cols, ws, bf16) -> dict[str, Any]:
    case: dict[str, Any] = {"kernel": kernel, "quant": mode, "rows": m, "shape": [rows, cols], "forms": {}}
    unquantized = mode == "none"  # (xla: the bfloat16 GEMM, and the kernel reads the bfloat16 weights)
    forms = [("bf16", None)] * (not unquantized) + [("xla", None)] + [(f"pallas:{n}", t) for n, t in args.tilings]
    if target is not None:
        from gpu_step import on_device

        x = jax.ShapeDtypeStruct((m, rows), jnp.bfloat16)
        specs = {"none": on_device((x, [(jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16),)] * args.layers), target)}
        if not unquantized:
            q, scale, zero = jax.eval_shape(lambda: quantize_kernel(jnp.zeros((rows, cols)), mode=mode))
            g_idx = jax.ShapeDtypeStruct((rows,), jnp.int32) if act_order(mode) else None
            specs["quant"] = on_device((x, [(q, scale, zero, g_idx)] * args.layers), target)
    else:
        x = jax.random.normal(jax.random.key(args.seed + m), (m, rows), jnp.float32).astype(jnp.bfloat16)
        values = {"quant": (x, ws), "none": (x, bf16)}
        case["weight_bytes"] = nbytes(ws[0])
    ref = None
    inputs = specs if target is not None else values
    for name, tile in forms:
        kind = "none" if name == "bf16" or unquantized else "quant"
        row: dict[str, Any] = {}
        if name.startswith("pallas:") and not _quant_kernel.fits(*inputs[kind][1][0]):
            row["error"] = f"{mode} [{rows}, {cols}]: not a shape the kernel takes"
            case["forms"][name] = row
            continue
        try:
            with _quant_kernel.tiled(tile or _quant_kernel.DEFAULT_TILING), \
                    (jax.default_device(target) if target is not None else contextlib.nullcontext()):
                t0 = time.perf_counter()
                exe = jax.jit(program(name.split(":")[0])).lower(*inputs[kind]).compile()
                row["compile_s"] = round(time.perf_counter() - t0, 3)
            if target is not None:  # (its launches and the bytes they write: the splits' partial sums)
                row["kernels"] = hlo_kernels(exe.as_text())
            else:
                args_ = values[kind]
                out = np.asarray(exe(*args_)[0], np.float32)
                if name == "xla":
                    ref = out
                elif ref is not None and name != "bf16":
                    row["max_diff"] = float(np.abs(out - ref).max() / (np.abs(ref).max() or 1.0))
                row["us"] = time_calls(exe, args_, calls=args.calls, reps=args.reps) / args.layers * 1e6
                stored = nbytes(args_[1][0])
                row["weight_gbps"] = stored / row["us"] / 1e3
                if "copy_gbps" in rep["device"]:
                    row["over_copy"] = row["weight_gbps"] / rep["device"]["copy_gbps"]
        except Exception as e:  # noqa: BLE001 - a tiling Triton refuses (shared memory, say) is its row's error
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        case["forms"][name] = row
        log(f"{kernel} {mode} rows {m} {name}: " + (row["error"] if "error" in row else
            f"compiled in {row['compile_s']:.1f} s" + (f", {row['us']:.1f} us a kernel" if "us" in row else "")))
    summarize(case)
    return case


def summarize(case: dict[str, Any]) -> None:
    """Each kernel form's verdict (ran, within `MARGIN` of the xla form's product), and the
    fastest that passes over the xla form, the default tiling and bf16."""
    xla = case["forms"].get("xla", {})
    if "us" not in xla:
        return
    for name, r in case["forms"].items():
        if name.startswith("pallas:"):
            r["pass"] = "error" not in r and r.get("max_diff", np.inf) <= MARGIN
    good = {n: r for n, r in case["forms"].items() if n.startswith("pallas:") and r["pass"]}
    _sweep.rank(case, good, "xla", "us")
    if good and "us" in case["forms"].get("bf16", {}):
        case["best_over_bf16"] = good[case["best"]]["us"] / case["forms"]["bf16"]["us"]


def markdown(rep: dict[str, Any]) -> str:
    dev = rep["device"]
    timed = rep["mode"] != "compile only"
    lines = ["# The quantized GEMM kernel's tilings (`benchmarks/quant_sweep.py`)", "",
             f"{dev['kind']} ({dev['backend']}, {rep['mode']})"
             + (f", copy bandwidth {dev['copy_gbps']:.0f} GB/s" if "copy_gbps" in dev else "")
             + f", jax {rep['versions']['jax']}, {rep['shape']} bfloat16, {rep['layers']} copies of each kernel a "
             f"program, {rep['date']}" + ("" if rep.get("complete", True) else f" (cut short after "
                                           f"{len(rep['cases'])} cases)") + f". `{rep['command']}`", "",
             *[f"- {n}" for n in rep.get("notes", [])],
             "- tilings: " + "; ".join(f"{n} {t}" for n, t in rep["tilings"].items()), ""]
    if timed:
        lines += ["| kernel | quant | rows | form | us a kernel | weight GB/s | over copy | max diff / xla | pass |",
                  "|---|---|---:|---|---:|---:|---:|---:|---|"]
    else:
        lines += ["| kernel | quant | rows | form | compile s | kernels | MB written a kernel | error |",
                  "|---|---|---:|---|---:|---:|---:|---|"]
    for c in rep["cases"]:
        for name, r in c["forms"].items():
            head = f"| {c['kernel']} | {c['quant']} | {c['rows']} | {name} | "
            if not timed:
                k = r.get("kernels")
                written = sum(v["bytes_written"] for v in k["by_kind"].values()) / rep["layers"] / 1e6 if k else None
                lines.append(head + (f"- | - | - | {r['error']} |" if "error" in r else f"{r['compile_s']:.1f} | "
                                     + (f"{k['kernels']} | {written:.2f} |" if k else "- | - |") + " |"))
                continue
            if "error" in r:
                lines.append(head + f"- | - | - | - | no: {r['error']} |")
                continue
            lines.append(head + f"{r['us']:.1f} | {r['weight_gbps']:.0f} | "
                         + (f"{r['over_copy']:.2f}" if "over_copy" in r else "-") + " | "
                         + (f"{r['max_diff']:.2g}" if "max_diff" in r else "-") + " | "
                         + ("-" if "pass" not in r else "yes" if r["pass"] else "no") + " |")
    if timed:
        lines += ["", "| kernel | quant | rows | fastest tiling | over xla | over default | default over xla "
                  "| over bf16 |", "|---|---|---:|---|---:|---:|---:|---:|"]
        for c in rep["cases"]:
            if "best" in c:
                fmt = lambda k: f"{c[k]:.3f}" if k in c else "-"  # noqa: E731
                lines.append(f"| {c['kernel']} | {c['quant']} | {c['rows']} | {c['best']} | {fmt('best_over_xla')} | "
                             f"{fmt('best_over_default')} | {fmt('default_over_xla')} | {fmt('best_over_bf16')} |")
    return "\n".join(lines) + "\n"


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in rep["cases"] if "us" in c["forms"].get("xla", {})]
    names = [n for n in dict.fromkeys(n for c in cases for n in c["forms"]) if n != "xla"]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cases) + 2), 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ys = [c["forms"][name]["us"] / c["forms"]["xla"]["us"] if "us" in c["forms"].get(name, {}) else np.nan
              for c in cases]
        ax.bar(np.arange(len(cases)) + i * width, ys, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2,
                  [f"{c['kernel']}\n{c['quant']}\n{c['rows']} rows" for c in cases], fontsize=7)
    ax.set_ylabel("time / XLA's form")
    ax.set_title(f"quantized GEMM kernel tilings, {rep['device']['kind']} ({rep['mode']})", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    atomic_write(path, png_bytes(fig))
    plt.close(fig)


def write(rep: dict[str, Any], out: Path) -> None:
    _sweep.write(rep, out, markdown, plot)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llada-8b")
    p.add_argument("--kernels", nargs="+", choices=("qkvo", "gate_up", "down"), default=["qkvo", "gate_up", "down"])
    p.add_argument("--quant", nargs="+", default=["int8-g128", "int4-g128"],
                   help="weight-only modes of dlm_jax.models.quant (int8-g128, int4-g128, uint4-g128, "
                   "int4-g128-act, ...), or none: the bfloat16 kernel in XLA's GEMM and in dlm-jax's kernel")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    _sweep.add_flags(p, TILINGS, _FIELDS, Tiling, layers=8, layers_help="copies of each kernel a program (kept out of "
                     "the L2)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args, target = _sweep.parse(p, argv, ("layers", "calls", "reps", "rows"))
    try:
        for mode in args.quant:
            check_quant(None if mode == "none" else mode)
    except Exception as e:  # noqa: BLE001 - a ConfigError naming the mode
        p.error(f"--quant: {e}")
    os.environ.pop(QUANT_KERNEL_ENV, None)  # (the xla form is XLA's: the kernel only where named)
    run(args, target)  # (written case by case)
    print(f"wrote {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

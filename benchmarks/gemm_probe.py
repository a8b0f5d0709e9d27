"""A layer's projection GEMMs one by one against fused into one, unquantized and int8.

    PYTHONPATH=. python3 benchmarks/gemm_probe.py --out $OUT/gemm_probe        (on a GPU)
    .venv/bin/python benchmarks/gemm_probe.py --shape small --out /tmp/gemm_probe

A decode step's matmuls at one layer of `--shape` (LLaDA-8B: d 4096, 32 heads of 128, MLP
12288, bfloat16), over `--rows` window rows (32: a dual-cache step at batch 1; 256: a
prefix-cache step, or 8 rows of 32):

  qkv      x @ Wq, x @ Wk, x @ Wv   against   x @ [Wq | Wk | Wv]
  gate_up  x @ Wg, x @ Wu           against   x @ [Wg | Wu]

each in one jitted program (what XLA makes of three dots sharing their input is what a decode
step gets), its weights stored as the model holds them (`--quant none`) or weight-only int8
per output channel and dequantised inside the matmul as `dlm_jax.models.quant.QuantLinear`
does (`--quant int8`: the int8 weights converted to x's dtype in the product, accumulated in
float32, scaled), or grouped (`--quant int8-g128`: a scale per output channel and 128 input
rows, the kernel dequantised to x's dtype before the product: does XLA fuse that into the
GEMM's operand read as it fuses int8's convert?).
Per case: the compile seconds, the median over `--reps` rounds of `--calls`
calls dispatched back to back (the time a call takes in a stream of them), the weights' bytes
read per call over it (against the device's measured copy bandwidth) and the FLOP rate; per
pair, the fused call's time over the separate one's. A decode step at batch 1 reads its
weights once: an int8 case at 0.5x the unquantized one's time reads them at the same rate,
a fused case under 1.0 is time a fused layout would save. Writes <out>.json, .md and .png
after every pair (a run cut short keeps the pairs it finished, its report marked incomplete).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _plots import png_bytes  # noqa: E402
from gpu_step import copy_bandwidth  # noqa: E402  (the same measure as the step's weight-read limit)
from dlm_jax._integrity import atomic_write  # noqa: E402
from dlm_jax.models.quant import gpu_bytes, quantize_kernel, quantized_matmul  # noqa: E402

SHAPES = {"llada-8b": dict(d_model=4096, heads=32, kv_heads=32, head_dim=128, ffn_hidden=12288),
          "small": dict(d_model=256, heads=4, kv_heads=4, head_dim=64, ffn_hidden=768)}
GROUPS = ("qkv", "gate_up")
FORMS = ("separate", "fused")
QUANTS = ("none", "int8", "int8-g128")
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def widths(shape: dict[str, int], group: str) -> list[int]:
    """The output widths of a group's matmuls (their input width is d_model)."""
    if group == "qkv":
        return [shape["heads"] * shape["head_dim"], *[shape["kv_heads"] * shape["head_dim"]] * 2]
    return [shape["ffn_hidden"]] * 2


def weights(shape: dict[str, int], group: str, quant: str, dtype, seed: int) -> list[Any]:
    """The group's kernels [d, o] (as stored: `dtype`; int8: (q, scale, zero) per kernel, per output
    channel or grouped, by the quantizer `dlm_jax.load(quant=...)` uses)."""
    key = jax.random.key(seed)
    out = []
    for i, o in enumerate(widths(shape, group)):
        w = (0.02 * jax.random.normal(jax.random.fold_in(key, i), (shape["d_model"], o), jnp.float32)).astype(dtype)
        out.append(w if quant == "none" else quantize_kernel(w, mode=quant))
    return out


def fuse(kernels: list[Any], quant: str) -> Any:
    """The kernels side by side [d, sum o] (int8: their q, their scales and zero points side by side)."""
    if quant == "none":
        return jnp.concatenate(kernels, axis=1)
    q, s, z = zip(*kernels)
    return (jnp.concatenate(q, axis=1), jnp.concatenate(s, axis=-1),
            None if z[0] is None else jnp.concatenate(z, axis=-1))


def product(x: jax.Array, w: Any, quant: str) -> jax.Array:
    """x [M, d] @ one kernel, as the model computes it (`nnx.Linear`, or `QuantLinear.product`)."""
    if quant == "none":
        return jnp.dot(x, w)
    return quantized_matmul(x, *w).astype(x.dtype)


def program(form: str, quant: str):
    if form == "fused":
        return lambda x, w: product(x, w, quant)
    return lambda x, ws: tuple(product(x, w, quant) for w in ws)


def weight_bytes(w: Any) -> int:
    return gpu_bytes(w)


def time_calls(fn, args, *, calls: int, reps: int) -> float:
    """Median over `reps` rounds of the seconds a call takes among `calls` dispatched back to back."""
    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t0) / calls)
    return statistics.median(rounds)


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape, dtype = SHAPES[args.shape], jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    rep: dict[str, Any] = {
        "benchmark": "benchmarks/gemm_probe.py", "shape": args.shape, "config": shape, "dtype": args.dtype,
        "device": {"backend": jax.default_backend(), "kind": getattr(dev, "device_kind", str(dev))},
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "machine": f"{platform.node()} ({os.cpu_count()} CPU cores)",
        "command": " ".join(["benchmarks/gemm_probe.py", *args.argv]), "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "environment": {"XLA_FLAGS": os.environ.get("XLA_FLAGS")}, "calls": args.calls, "reps": args.reps,
        "notes": list(args.note), "complete": False, "cases": []}
    rep["device"]["copy_gbps"] = copy_bandwidth() / 1e9
    log(f"copy bandwidth {rep['device']['copy_gbps']:.0f} GB/s on {rep['device']['kind']}")
    for group in args.groups:
        for quant in args.quant:
            kernels = weights(shape, group, quant, dtype, args.seed)
            stored = {"separate": kernels, "fused": fuse(kernels, quant)}
            for rows in args.rows:
                x = (jax.random.normal(jax.random.key(args.seed + rows), (rows, shape["d_model"]), jnp.float32)
                     ).astype(dtype)
                outs = {}
                for form in FORMS:
                    w = stored[form]
                    t0 = time.perf_counter()
                    exe = jax.jit(program(form, quant)).lower(x, w).compile()
                    compile_s = time.perf_counter() - t0
                    s = time_calls(exe, (x, w), calls=args.calls, reps=args.reps)
                    y = exe(x, w)
                    outs[form] = np.asarray(jnp.concatenate(y, axis=1) if form == "separate" else y, np.float32)
                    nbytes = weight_bytes(w)
                    flops = 2 * rows * shape["d_model"] * sum(widths(shape, group))
                    case = {"group": group, "quant": quant, "rows": rows, "form": form, "compile_s": round(compile_s, 3),
                            "ms": s * 1e3, "weight_bytes": nbytes, "weight_gbps": nbytes / s / 1e9,
                            "tflops": flops / s / 1e12}
                    case["weight_read_over_copy"] = case["weight_gbps"] / rep["device"]["copy_gbps"]
                    rep["cases"].append(case)
                    log(f"{group} {quant} rows {rows} {form}: {case['ms']:.4f} ms, {case['weight_gbps']:.0f} GB/s of "
                        f"weights, compiled in {compile_s:.1f} s")
                # Fused and separate compute the same products (a layout, not an approximation).
                scale = float(np.abs(outs["separate"]).max()) or 1.0
                rep["cases"][-1]["max_diff_vs_separate"] = float(np.abs(outs["fused"] - outs["separate"]).max()) / scale
                if args.out is not None:  # (after every pair: a lease part cut by its time limit keeps them)
                    write(rep, args.out)
    rep["complete"] = True
    return rep


def write(rep: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out.with_suffix(".json"), json.dumps(rep, indent=1) + "\n")
    atomic_write(out.with_suffix(".md"), markdown(rep))
    plot(rep, out.with_suffix(".png"))


def pairs(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (group, quant, rows): separate and fused ms, and fused / separate; per (group, form,
    rows) with a quantized case and the unquantized one: quantized / unquantized (int8_over_none)."""
    by = {(c["group"], c["quant"], c["rows"], c["form"]): c for c in rep["cases"]}
    out = []
    for (group, quant, rows, form), c in by.items():
        if form != "fused" or (group, quant, rows, "separate") not in by:
            continue
        sep = by[(group, quant, rows, "separate")]
        none = {f: by.get((group, "none", rows, f)) for f in FORMS}
        out.append({"group": group, "quant": quant, "rows": rows, "separate_ms": sep["ms"], "fused_ms": c["ms"],
                    "fused_over_separate": c["ms"] / sep["ms"],
                    "int8_over_none": None if quant == "none" or not none["separate"] else
                    {f: by[(group, quant, rows, f)]["ms"] / none[f]["ms"] for f in FORMS if none[f]}})
    return out


def markdown(rep: dict[str, Any]) -> str:
    dev = rep["device"]
    lines = ["# A layer's projection GEMMs, separate against fused (`benchmarks/gemm_probe.py`)", "",
             f"{dev['kind']} ({dev['backend']}), copy bandwidth {dev['copy_gbps']:.0f} GB/s, jax "
             f"{rep['versions']['jax']}, {rep['shape']} {rep['dtype']}, {rep['date']}; median of {rep['reps']} rounds "
             f"of {rep['calls']} calls back to back"
             + ("" if rep.get("complete", True) else f" (cut short after {len(rep['cases'])} cases)")
             + f". `{rep['command']}`"
             + (f"; XLA_FLAGS {rep['environment']['XLA_FLAGS']}" if rep["environment"].get("XLA_FLAGS") else ""), "",
             *[f"- {n}" for n in rep.get("notes", [])], "",
             "| group | quant | rows | form | ms / call | weight GB/s | weight read / copy bandwidth | TFLOP/s | compile s |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for c in rep["cases"]:
        lines.append(f"| {c['group']} | {c['quant']} | {c['rows']} | {c['form']} | {c['ms']:.4f} | "
                     f"{c['weight_gbps']:.0f} | {c['weight_read_over_copy']:.2f} | {c['tflops']:.1f} | {c['compile_s']:.1f} |")
    lines += ["", "| group | quant | rows | separate ms | fused ms | fused / separate | quantized / unquantized (separate, fused) |",
              "|---|---|---:|---:|---:|---:|---|"]
    for p in pairs(rep):
        q = p["int8_over_none"]
        lines.append(f"| {p['group']} | {p['quant']} | {p['rows']} | {p['separate_ms']:.4f} | {p['fused_ms']:.4f} | "
                     f"{p['fused_over_separate']:.3f} | "
                     + ("-" if not q else ", ".join(f"{q[f]:.3f}" for f in FORMS if f in q)) + " |")
    return "\n".join(lines) + "\n"


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = rep["cases"]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(cases)), 4))
    labels = [f"{c['group']} {c['quant']}\n{c['rows']} {c['form'][:3]}" for c in cases]
    ax.bar(range(len(cases)), [c["weight_read_over_copy"] for c in cases],
           color=["tab:blue" if c["form"] == "separate" else "tab:orange" for c in cases])
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="copy bandwidth")
    ax.set_xticks(range(len(cases)), labels, fontsize=7)
    ax.set_ylabel("weight bytes per call / copy bandwidth")
    ax.set_title(f"projection GEMMs, {rep['device']['kind']} (blue separate, orange fused)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, png_bytes(fig))
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llada-8b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS))
    p.add_argument("--quant", nargs="+", choices=QUANTS, default=list(QUANTS))
    p.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--note", action="append", default=[], metavar="TEXT")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if min(args.rows) < 1 or args.calls < 1 or args.reps < 1:
        p.error("--rows, --calls and --reps must be at least 1")
    rep = run(args)
    if args.out is not None:
        write(rep, args.out)
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())

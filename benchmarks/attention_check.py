"""How close each way of reading the resident cache comes to float32 attention, on this device.

    PYTHONPATH=. python3 benchmarks/attention_check.py --out $OUT/attention_check      (on a GPU)
    .venv/bin/python benchmarks/attention_check.py --shape small --stand-in --out /tmp/attention_check

One layer's attention in the JAX executor's steps at the LLaDA-8B shape (32 heads of 128, in
bfloat16) and at a grouped-query 8B shape (`gqa-8b`: 32 query heads over 8 K/V heads, as
Llama 3 8B and Qwen3 8B have them, which the Pallas kernel takes 4 query heads a program), in
the setting of `benchmarks/gpu_step.py` (prompt 128, generation 256, block 32, at
block 4): the dual cache's step (a window of 32 rows, every other slot of 384 read) and the
prefix cache's (the 128 rows of the block and after it, the 256 slots before it read), at batch
1 and 8, over a cache of random K/V laid out as the resident one ([B, Hkv, S, Dh]). Each form of
`dlm_jax.models._transformer.ATTENTION_FORMS` that the device runs takes the same bfloat16
inputs:

  split        `attend_cached`: the cache and the window scored apart under one softmax (XLA);
  cudnn        cuDNN's fused kernel over a concatenated copy of the cache and the window;
  cudnn_split  `attend_cudnn_cached`: cuDNN's kernel over the cache where it lies and over the
               window, the two merged by their log-sum-exps;
  pallas       `dlm_jax.models._attention_kernel`: dlm-jax's own kernel (Pallas, compiled by
               Triton), the cache where it lies and the window in one launch, an online softmax.

Each is compared with `attend` over the concatenation in float32 (the same bfloat16 values,
converted): the mean and largest absolute error over the rows, also over the rows that see no
cache slot (one row in four: a block's first step in a fresh request sees its prompt, but a
padding row sees nothing), and whether every output is finite. The check passes where each
fused form (cuDNN's and the kernel) strays from float32 no further than the split form does,
within the margins the
CPU's tests allow the split form against the concatenated one (mean error within 1.15x, largest
within 2x), and every output is finite; the exit status is 1 otherwise.

cuDNN's kernel and Triton's need a GPU (elsewhere the script stops in one line). `--stand-in`
runs JAX's XLA attention in cuDNN's place (`dlm_jax.testing.cudnn_stand_in`) and the Pallas
kernel in Pallas's interpreter (`_attention_kernel.interpret`), which exercises the forms' own
code (layouts, masks, the merge, the kernel's blocks) on any device; its report says so.
Writes <out>.json and <out>.md after every case (a run cut short keeps the cases it finished,
its report marked incomplete).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.models import _attention_kernel, _transformer
from gpu_decide import form_passes  # (benchmarks/, the script's own folder)
from dlm_jax.models._transformer import attend, attend_cached, attend_cudnn_cached

# Heads, K/V heads, head size; the steps: (kind, window rows, slots, the window's first slot).
SHAPES = {"llada-8b": (32, 32, 128), "gqa-8b": (32, 8, 128), "small": (4, 2, 16)}
STEPS = {"llada-8b": [("dual", 32, 384, 256), ("prefix", 128, 384, 256)],
         "small": [("dual", 16, 64, 32), ("prefix", 32, 64, 32)]}  # (shapes the Pallas kernel takes)
STEPS["gqa-8b"] = STEPS["llada-8b"]
MEAN_MARGIN, MAX_MARGIN = 1.15, 2.0


def inputs(batch: int, kind: str, window: int, slots: int, start: int, heads: tuple[int, int, int], seed: int):
    """q [B, T, H, Dh]; the cache [B, Hkv, S, Dh]; the window's K/V [B, T, Hkv, Dh] (bfloat16);
    the mask [B, T, S + T]: the dual step reads every slot but the window's own (its fresh K/V
    are the window part), the prefix step the slots before the window; one row in four sees no
    cache slot, and the window is seen whole."""
    h, hkv, dh = heads
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, window, h, dh)) * 1.5
    kc, vc = (rng.standard_normal((batch, hkv, slots, dh)) for _ in range(2))
    k, v = (rng.standard_normal((batch, window, hkv, dh)) for _ in range(2))
    seen = np.zeros(slots, bool)
    seen[:start] = True
    if kind == "dual":
        seen[start + window:] = True
    mask = np.concatenate([np.broadcast_to(seen, (batch, window, slots)), np.ones((batch, window, window), bool)], -1)
    mask[:, ::4, :slots] = False
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, kc, vc, k, v)]
    return bf, jnp.asarray(mask)


def forms() -> dict[str, Any]:
    """{form: attention(q, k_cache, v_cache, k, v, mask)}."""
    def concat(q, kc, vc, k, v, mask):
        return _transformer.attend_cudnn(q, jnp.concatenate([kc.swapaxes(1, 2), k], 1), jnp.concatenate([vc.swapaxes(1, 2), v], 1),
                            mask)

    return {"split": lambda q, kc, vc, k, v, mask: attend_cached(q, kc, vc, k, v, mask, heads_first=True),
            "cudnn": concat, "cudnn_split": attend_cudnn_cached,
            "pallas": _attention_kernel.attend_kernel}


def errors(out: jax.Array, ref: np.ndarray, blind: np.ndarray) -> dict[str, Any]:
    got = np.asarray(out.astype(jnp.float32))
    err = np.abs(got - ref)
    return {"mean_error": float(err.mean()), "max_error": float(err.max()),
            "blind_rows_mean_error": float(err[:, blind].mean()), "finite": bool(np.isfinite(got).all())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = jax.devices()[0]
    report: dict[str, Any] = {
        "benchmark": "benchmarks/attention_check.py", "shapes": {s: SHAPES[s] for s in args.shape},
        "device": {"backend": jax.default_backend(), "kind": getattr(device, "device_kind", str(device))},
        "cudnn": "JAX's XLA attention standing in (--stand-in)" if args.stand_in else "cuDNN's fused attention",
        "pallas": "Pallas's interpreter (--stand-in)" if args.stand_in else "the Triton kernel",
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "command": " ".join(["benchmarks/attention_check.py", *args.argv]), "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "margins": {"mean": MEAN_MARGIN, "max": MAX_MARGIN}, "complete": False, "pass": False, "cases": []}
    with contextlib.ExitStack() as context:
        if args.stand_in:
            from dlm_jax.testing import cudnn_stand_in

            context.enter_context(cudnn_stand_in())
            context.enter_context(_attention_kernel.interpret())
        for shape, batch in ((s, b) for s in args.shape for b in args.batches):
            for kind, window, slots, start in STEPS[shape]:
                (q, kc, vc, k, v), mask = inputs(batch, kind, window, slots, start, SHAPES[shape], args.seed)
                f32 = [x.astype(jnp.float32) for x in (q, kc, vc, k, v)]
                ref = np.asarray(attend(f32[0], jnp.concatenate([f32[1].swapaxes(1, 2), f32[3]], 1),
                                        jnp.concatenate([f32[2].swapaxes(1, 2), f32[4]], 1), mask))
                blind = ~np.asarray(mask)[0, :, :slots].any(-1)
                case: dict[str, Any] = {"shape": shape, "batch": batch, "kind": kind, "window": window, "slots": slots,
                                        "forms": {}}
                for name, fn in forms().items():
                    try:
                        case["forms"][name] = errors(jax.jit(fn)(q, kc, vc, k, v, mask), ref, blind)
                    except Exception as e:  # noqa: BLE001 - a form the device refuses is its row's error
                        case["forms"][name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
                case["pass"] = verdict(case["forms"])
                report["cases"].append(case)
                report["pass"] = all(c["pass"] for c in report["cases"])
                write(report, args.out)  # (after every case: a lease part cut by its time limit keeps them)
                print(json.dumps({k: case[k] for k in ("shape", "batch", "kind", "pass")} | {
                    n: {k: f.get(k) for k in ("mean_error", "max_error", "error") if k in f}
                    for n, f in case["forms"].items()}), flush=True)
    report["complete"] = True
    return report


def verdict(rows: dict[str, dict[str, Any]]) -> bool:
    """Every form finite, and each fused form within the margins of the split form's errors."""
    margins = {"mean": MEAN_MARGIN, "max": MAX_MARGIN}
    return "split" in rows and all(form_passes(rows, name, margins) for name in rows)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Attention against float32: {report['device']['kind']} ({report['device']['backend']})", "",
             "Shapes " + ", ".join(f"{s} {tuple(h)}" for s, h in report["shapes"].items())
             + " (heads, K/V heads, head size), bfloat16 inputs; "
             f"the cuDNN forms ran {report['cudnn']}, the Pallas kernel {report.get('pallas', 'the Triton kernel')}; "
             f"jax {report['versions']['jax']}; {report['date']}; "
             f"`{report['command']}`. Pass: every output finite and each fused form's mean error within "
             f"{report['margins']['mean']}x, its largest within {report['margins']['max']}x, the split form's.", "",
             "| shape | batch | step | form | mean error | largest error | mean error, rows seeing no cache slot "
             "| finite |",
             "|---|---:|---|---|---:|---:|---:|---|"]
    for c in report["cases"]:
        for name, r in c["forms"].items():
            where = f"| {c['shape']} | {c['batch']} | {c['kind']} | {name} |"
            if "error" in r:
                lines.append(f"{where} {r['error']} | | | |")
            else:
                lines.append(f"{where} {r['mean_error']:.3g} | {r['max_error']:.3g} | "
                             f"{r['blind_rows_mean_error']:.3g} | {'yes' if r['finite'] else 'NO'} |")
    lines += ["", f"Result: {'PASS' if report['pass'] else 'FAIL'}"
              + ("" if report.get("complete", True) else f" (cut short: the {len(report['cases'])} cases above only)"), ""]
    return "\n".join(lines)


def write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(report, indent=1) + "\n"), (".md", markdown(report))):
        tmp = out.with_name(out.name + suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(out.with_name(out.name + suffix))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["llada-8b", "gqa-8b"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--stand-in", action="store_true", help="JAX's XLA attention in cuDNN's place and the Pallas "
                   "kernel in Pallas's interpreter (any device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = argv
    if not args.stand_in and jax.default_backend() != "gpu":  # (a check of the split form alone says nothing)
        p.error(f"the cuDNN and Pallas forms need a GPU and JAX's backend here is {jax.default_backend()!r}; "
                "--stand-in runs JAX's XLA attention in cuDNN's place and the kernel in Pallas's interpreter")
    report = run(args)
    write(report, args.out)
    print(f"wrote {args.out}.json ({'PASS' if report['pass'] else 'FAIL'})")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

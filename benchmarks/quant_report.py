"""Weight quantization against task accuracy on the shipped tiny models.

    .venv/bin/python benchmarks/quant_report.py [--n 24] [--models models/llada-tiny ...]

For each model and each scheme of `dlm_jax.lowering.quant.QUANT_SCHEMES` (q4_0, int8, int4,
int4+int8-outliers), every linear weight is fake-quantized (quantized, then dequantized to
float32) and the model is evaluated with those weights next to its float32 self:

- linear weights: every 2-D parameter except the embedding table, i.e. attention
  q/k/v/o_proj, FFN gate/up/down_proj and lm_head. Flax kernels are [in, out], so each is
  quantized as W = kernel.T ([out, in]): per-channel scales per output row, Q4_0 blocks
  along the input axis, as GGML lays out a linear weight.
- kept float: the embedding table, norm scales (1-D) and anything that is not 2-D (MoE expert
  stacks), listed in the JSON.
- weight error: relative Frobenius error per matrix, mean and worst over the model's matrices,
  and bits per weight (storage of all quantized matrices over their weight count).
- task accuracy: `dlm_jax.training.evaluate.evaluate` on the held-out task suite with the model card's
  left-to-right decoder (block 1, one token per step, generation length 64: the most
  deterministic of the card's decoders), `--n` prompts per task.
- int4+int8-outliers runs without activation statistics, so outlier channels are chosen by
  column norm alone (the weight-only salience of `dlm_jax.lowering.quant.salience`).

Writes <out>.json and <out>.md (default benchmarks/results/quant).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402
from dlm_jax.lowering.quant import QUANT_SCHEMES, fake_quantize, quantize_mixed, weight_error  # noqa: E402
from dlm_jax.runtime.registry import decode_options  # noqa: E402

MODELS = ("models/llada-tiny", "models/idlm-tiny")
DECODER = "left-to-right (block 1, one token per step)"
GEN_LEN = 64


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def linear_weight_names(params: Mapping[str, np.ndarray]) -> list[str]:
    """The 2-D parameters that are linear kernels: everything 2-D but the embedding table."""
    return sorted(n for n, v in params.items() if np.ndim(v) == 2 and not n.startswith("embed"))


def quantize_params(params: Mapping[str, np.ndarray], scheme: str) -> tuple[dict[str, np.ndarray], dict]:
    """`params` with every linear kernel fake-quantized by `scheme`, and the weight error."""
    out = dict(params)
    errors, bits, weights = {}, 0, 0
    for name in linear_weight_names(params):
        w = np.asarray(params[name], np.float32).T  # kernel [in, out] -> W [out, in]
        fq = fake_quantize(scheme, w)
        out[name] = np.ascontiguousarray(fq.weights.T).astype(params[name].dtype)
        errors[name] = weight_error(w, fq.weights)
        bits, weights = bits + 8 * fq.storage_bytes, weights + w.size
    rel = {n: e.rel_fro for n, e in errors.items()}
    worst = max(rel, key=rel.get)
    return out, {"mean_rel_fro": float(np.mean(list(rel.values()))), "worst_rel_fro": rel[worst],
                 "worst_matrix": worst, "max_abs": max(e.max_abs for e in errors.values()),
                 "bits_per_weight": bits / weights}


def decode_tasks(handle: Any, tasks: Sequence[str], n: int, cfg: Any) -> tuple[dict[str, float], list[str]]:
    """Accuracy per task and every completion (task by task, prompt by prompt)."""
    from dlm_jax.training.evaluate import evaluate

    results = {t: evaluate(handle, t, cfg, n=n, progress=False, keep=n) for t in tasks}
    return ({t: r["accuracy"] for t, r in results.items()},
            [s["completion"] for r in results.values() for s in r["samples"]])


def report_model(path: str, schemes: Sequence[str], tasks: Sequence[str], n: int, cfg: Any) -> dict:
    """fp32 and every scheme's row for one checkpoint."""
    import dlm_jax
    from dlm_jax.api import jax_executor

    handle = dlm_jax.load(ROOT / path if not Path(path).is_absolute() else path)
    params = dlm_jax.get_params(handle.model)
    rows, reference = [], []
    for scheme in ("fp32", *schemes):
        t0 = time.perf_counter()
        if scheme == "fp32":
            model_handle, err = handle, {"mean_rel_fro": 0.0, "worst_rel_fro": 0.0, "worst_matrix": None,
                                         "max_abs": 0.0, "bits_per_weight": 32.0}
        else:
            qparams, err = quantize_params(params, scheme)
            qmodel = dlm_jax.model_from_params(handle.config, qparams)
            model_handle = dlm_jax.Model(qmodel, handle.tokenizer, executor=jax_executor(qmodel, source=path))
        acc, texts = decode_tasks(model_handle, tasks, n, cfg)
        if scheme == "fp32":
            reference = texts
        rows.append({"model": path, "scheme": scheme, "weight_error": err, "accuracy": acc,
                     "mean_accuracy": float(np.mean(list(acc.values()))),
                     "same_completion_as_fp32": float(np.mean([a == b for a, b in zip(texts, reference)])),
                     "seconds": time.perf_counter() - t0})
        _log(f"{path} {scheme:>18}: bits/weight {err['bits_per_weight']:.3f}, mean rel err "
             f"{err['mean_rel_fro']:.4f}, accuracy {rows[-1]['mean_accuracy']:.3f} {acc} "
             f"({rows[-1]['seconds']:.1f} s)")
    base = rows[0]["mean_accuracy"]
    for row in rows:
        row["delta_vs_fp32_points"] = round((row["mean_accuracy"] - base) * 100, 2)
    # Sampling noise of one mean accuracy (binomial, at the fp32 accuracy): differences of a
    # few points between schemes are within it at small n.
    stderr = float(np.sqrt(base * (1 - base) / (n * len(tasks))) * 100)
    linear = linear_weight_names(params)
    return {"rows": rows, "fp32_mean_accuracy_stderr_points": round(stderr, 2), "linear_weights": linear,
            "kept_float": sorted(set(params) - set(linear))}


def markdown(report: dict) -> str:
    tasks = list(report["tasks"])
    lines = [f"Held-out accuracy, {report['n_per_task']} prompts per task, decoder: {report['decoder']}, "
             f"generation length {report['gen_len']}. Weight error: relative Frobenius over the linear "
             f"weights (mean / worst matrix).", "",
             "| model | scheme | bits/weight | mean rel. error | worst rel. error | "
             + " | ".join(tasks) + " | mean acc. | vs fp32 (points) | same as fp32 |",
             "|" + "---|" * (8 + len(tasks))]
    for r in (r for m in report["models"].values() for r in m["rows"]):
        e = r["weight_error"]
        accs = " | ".join(f"{r['accuracy'][t] * 100:.1f}%" for t in tasks)
        lines.append(f"| {Path(r['model']).name} | {r['scheme']} | {e['bits_per_weight']:.3f} | "
                     f"{e['mean_rel_fro']:.4f} | {e['worst_rel_fro']:.4f} | {accs} | "
                     f"{r['mean_accuracy'] * 100:.1f}% | {r['delta_vs_fp32_points']:+.1f} | "
                     f"{r['same_completion_as_fp32'] * 100:.1f}% |")
    noise = ", ".join(f"{Path(m).name} {v['fp32_mean_accuracy_stderr_points']:.1f}"
                      for m, v in report["models"].items())
    lines += ["", f"Standard error of a mean accuracy (binomial, at the fp32 accuracy), in points: {noise}. "
              "`same as fp32`: completions identical to the float32 model's, prompt by prompt (a paired "
              "measure, far less noisy than accuracy)."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    from dlm_jax.training.data import TASKS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), help="checkpoint directories")
    p.add_argument("--n", type=int, default=24, help="held-out prompts per task")
    p.add_argument("--tasks", nargs="+", default=sorted(TASKS), choices=sorted(TASKS))
    p.add_argument("--schemes", nargs="+", default=list(QUANT_SCHEMES), choices=list(QUANT_SCHEMES))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant",
                   help="output prefix (writes .json and .md)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    from dlm_jax.training.data import task_settings
    from dlm_jax.training.ship import card_decoders

    args = build_parser().parse_args(argv)
    if args.n <= 0:
        raise SystemExit(f"--n {args.n} must be positive")
    cfg = card_decoders(GEN_LEN)[DECODER]
    t0 = time.perf_counter()
    models = {m: report_model(m, args.schemes, args.tasks, args.n, cfg) for m in args.models}
    report = {"n_per_task": args.n, "gen_len": GEN_LEN, "decoder": DECODER, "decoder_options": decode_options(cfg),
              "tasks": task_settings(args.tasks), "schemes": list(args.schemes),
              "mixed_rule": quantize_mixed(np.ones((1, 128), np.float32)).rule,
              "models": models, "seconds": time.perf_counter() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out.with_suffix(".json"), report)
    atomic_write(args.out.with_suffix(".md"), markdown(report))
    _log(f"wrote {args.out.with_suffix('.json')} and .md in {report['seconds']:.0f} s")
    return report


if __name__ == "__main__":
    print(markdown(main()), end="")

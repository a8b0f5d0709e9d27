"""The decoder benchmark: accuracy, NFE and wall clock of every decoder on a trained model.

    .venv/bin/python benchmarks/decoders.py --model models/llada-tiny --n 32 \
        --out benchmarks/results/decoders

Settings (block 32, generation lengths 128 and 256): vanilla top-k with steps = generation
length (LLaDA), prefix + threshold 0.9 (Fast-dLLM), prefix + factor 1.0 (as released, and as
the paper states it), prefix + Frechet delta in {0.1, 0.25, 0.5} (Fast-dLLM++), dual +
Frechet 0.25; and two deliberately aggressive references, top-k at 4 tokens per step and
prefix + threshold 0.5, that show how much accuracy the tasks lose to over-parallel commits.
Every setting decodes the same held-out prompts of every task. Writes <out>.json, <out>.md
(table) and <out>.png (accuracy against NFE), and reports the targets as ratios measured in
this one run:
- Frechet 0.25 uses >= 25% fewer NFE than threshold 0.9 at <= 1 point accuracy loss;
- the cached pipeline is >= 5x faster than vanilla in wall clock at matched accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dlm_jax  # noqa: E402
from dlm_jax.training.data import TASKS, task_settings  # noqa: E402
from dlm_jax.training.evaluate import evaluate  # noqa: E402

SETTINGS = {
    "vanilla top-k": dict(cache="none", rule="topk", tokens_per_step=1),
    "prefix + threshold 0.9": dict(cache="prefix", rule="threshold", threshold=0.9),
    "prefix + factor 1.0": dict(cache="prefix", rule="factor", factor=1.0),
    "prefix + factor 1.0 (paper)": dict(cache="prefix", rule="factor_paper", factor=1.0),
    "prefix + frechet 0.1": dict(cache="prefix", rule="frechet", delta=0.1),
    "prefix + frechet 0.25": dict(cache="prefix", rule="frechet", delta=0.25),
    "prefix + frechet 0.5": dict(cache="prefix", rule="frechet", delta=0.5),
    "dual + frechet 0.25": dict(cache="dual", rule="frechet", delta=0.25),
    "top-k, 4 tokens/step": dict(cache="none", rule="topk", tokens_per_step=4),
    "prefix + threshold 0.5": dict(cache="prefix", rule="threshold", threshold=0.5),
}
AGGRESSIVE = ("top-k, 4 tokens/step", "prefix + threshold 0.5")


def run(model: str, gens: list[int], n: int, tasks: list[str], block: int) -> list[dict]:
    handle = dlm_jax.load(model, executor="jax")
    rows = []
    for gen in gens:
        for name, setting in SETTINGS.items():
            kwargs = dict(setting)
            if kwargs["rule"] == "topk":
                kwargs["steps"] = gen // kwargs.pop("tokens_per_step")
            cfg = dlm_jax.decode_config(gen_len=gen, block_len=block, **kwargs)
            per_task = {t: evaluate(handle, t, cfg, n=n, progress=False) for t in tasks}
            seconds = sum(r["seconds"] for r in per_task.values())
            row = {"gen_len": gen, "setting": name,
                   "accuracy": sum(r["accuracy"] for r in per_task.values()) / len(tasks),
                   "mean_nfe": sum(r["mean_nfe"] for r in per_task.values()) / len(tasks),
                   "seconds": seconds, "per_task": {t: {"accuracy": r["accuracy"], "mean_nfe": r["mean_nfe"]}
                                                   for t, r in per_task.items()}}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "per_task"}), file=sys.stderr)
    return rows


def targets(rows: list[dict]) -> dict:
    out = {}
    for gen in sorted({r["gen_len"] for r in rows}):
        by = {r["setting"]: r for r in rows if r["gen_len"] == gen}
        thr, fre, van = by["prefix + threshold 0.9"], by["prefix + frechet 0.25"], by["vanilla top-k"]
        nfe_cut = 1 - fre["mean_nfe"] / thr["mean_nfe"]
        acc_drop = (thr["accuracy"] - fre["accuracy"]) * 100
        cached = [r for name, r in by.items() if SETTINGS[name]["cache"] != "none"
                  and r["accuracy"] >= van["accuracy"] - 0.01]
        aggressive = {name: round((van["accuracy"] - by[name]["accuracy"]) * 100, 2)
                      for name in AGGRESSIVE if name in by}
        best = min(cached, key=lambda r: r["seconds"]) if cached else None
        out[str(gen)] = {
            "frechet_0.25_nfe_reduction_vs_threshold_0.9": round(nfe_cut, 4),
            "frechet_0.25_accuracy_drop_points": round(acc_drop, 2),
            "frechet_target_met": nfe_cut >= 0.25 and acc_drop <= 1.0,
            "fastest_cached_at_matched_accuracy": best and best["setting"],
            "cached_speedup_vs_vanilla": best and round(van["seconds"] / best["seconds"], 2),
            "speedup_target_met": bool(best) and van["seconds"] / best["seconds"] >= 5.0,
            "aggressive_accuracy_drop_points_vs_vanilla": aggressive,
        }
    return out


def markdown(rows: list[dict], tasks: list[str]) -> str:
    head = "| gen | setting | accuracy | " + " | ".join(tasks) + " | mean NFE | seconds |"
    lines = [head, "|" + "---|" * (5 + len(tasks))]
    for r in rows:
        accs = " | ".join(f"{r['per_task'][t]['accuracy']:.3f}" for t in tasks)
        lines.append(f"| {r['gen_len']} | {r['setting']} | {r['accuracy']:.3f} | {accs} | "
                     f"{r['mean_nfe']:.1f} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gens = sorted({r["gen_len"] for r in rows})
    fig, axes = plt.subplots(1, len(gens), figsize=(6 * len(gens), 4.5), squeeze=False)
    for ax, gen in zip(axes[0], gens):
        points: dict[tuple[float, float], list[str]] = {}  # settings that land on one point share a label
        for r in (r for r in rows if r["gen_len"] == gen):
            points.setdefault((round(r["mean_nfe"], 6), round(r["accuracy"] * 100, 6)), []).append(r["setting"])
        for (nfe, acc), names in points.items():
            ax.scatter(nfe, acc, s=40)
            ax.annotate(" = ".join(names), (nfe, acc), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("mean NFE per request (log)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"generation length {gen}, block 32")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "llada-tiny"))
    parser.add_argument("--gens", type=int, nargs="*", default=[128, 256])
    parser.add_argument("--tasks", nargs="*", default=sorted(TASKS))
    parser.add_argument("--n", type=int, default=48, help="held-out prompts per task")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decoders"))
    args = parser.parse_args()
    rows = run(args.model, args.gens, args.n, args.tasks, args.block)
    result = {"model": args.model, "n_per_task": args.n, "block_len": args.block,
              "tasks": task_settings(args.tasks), "rows": rows,
              "targets": targets(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, args.tasks))
    plot(rows, args.out.with_suffix(".png"))
    print(json.dumps(result["targets"], indent=2))


if __name__ == "__main__":
    main()

"""Swap-optimized memory planner vs paging-only, simulated (llada.cpp Fig. 13c and Tab. 7 analogs).

    .venv/bin/python benchmarks/somr.py [--out benchmarks/results/somr]

Fig. 13c analog: the staging budget is fixed and the resident-weight budget (NPU-visible
weights kept across steps) shrinks from all NPU weights to none; for each budget, the
planner's exposed stall (synchronous staging time on the critical path), its total staging
time and step time, against the paging-only baseline run in the same VA budget. Two graphs:
an analytic LLaDA-8B Q4_0 step (window 32, cache 512, staging 256 MB) and the real
llada-tiny `.tflite` step (window 32, cache 64) whose staging budget AND fixed mapping cost
are scaled by its NPU weight bytes over LLaDA-8B's, so that a slot holds the same share of
the model and a mapping costs the same share of a transfer (the unscaled run is in the
JSON). Only the NPU part of each step is planned (the partition puts embedding, LM head and
sampling on the CPU).

Tab. 7 analog: LLaDA-8B at windows (microbatches) 32-512, cache 512: the smallest VA budget
the planner needs (no resident weights), whether paging-only completes there, and the first
budget at which paging-only completes (bisection on a 4 MB grid). All times come from the
phone cost model (`dlm_jax.lowering.costs.CostModel`: PowerInfer-2 §2.3.1's figures and our
choices, docs/techniques/lladacpp.md), not from a device.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plots import png_bytes  # noqa: E402
from dlm_jax import ModelConfig  # noqa: E402
from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402
from dlm_jax.runtime.buckets import BucketKey  # noqa: E402
from dlm_jax.lowering.costs import MB, CostModel  # noqa: E402
from dlm_jax.lowering._analytic import analytic_graph  # noqa: E402
from dlm_jax.lowering.graph import StepGraph, read_tflite_graph  # noqa: E402
from dlm_jax.techniques.lladacpp.somr import DEFAULT_STAGING_BYTES, check_plan, plan_memory  # noqa: E402
from dlm_jax.techniques.lladacpp.paging import paging_only  # noqa: E402
from dlm_jax.lowering.partition import partition  # noqa: E402

LLADA_8B = ModelConfig(vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=12288,
                       dtype="float16", param_dtype="float16", mask_token_id=126336)
Q4_0 = 18 / 32  # bytes per weight; norm scales stay float32
FRACTIONS = [i / 20 for i in range(21)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def npu_part(graph: StepGraph) -> StepGraph:
    return graph.subgraph(partition(graph).npu_ops)


def llada_8b(window: int, cache: int) -> StepGraph:
    return npu_part(analytic_graph(LLADA_8B, BucketKey(1, window, cache, 32), weight_bytes_per_param=Q4_0,
                                   vector_bytes_per_param=4))


def tiny_graph(model_dir: str, key: BucketKey) -> StepGraph:
    import dlm_jax
    from flax import nnx

    from dlm_jax.tflite_export import convert_signatures, decode_signature, decode_signature_name

    model = dlm_jax.load(model_dir).model
    graphdef, state = nnx.split(model)
    content = convert_signatures([decode_signature(graphdef, state, model.config, key)])
    return npu_part(read_tflite_graph(content, decode_signature_name(key)))


def sweep(name: str, graph: StepGraph, staging: int, cost: CostModel) -> list[dict]:
    """One row per resident-weight budget: planner vs paging-only in the same VA budget."""
    total, rows = graph.weight_bytes(), []
    for frac in FRACTIONS:
        plan = plan_memory(graph, weight_budget=int(total * frac), staging_bytes=staging, cost=cost)
        check_plan(plan, graph)
        paging = paging_only(graph, va_budget=plan.va_budget, cost=cost)
        t = plan.timeline
        rows.append({"graph": name, "weight_fraction": frac, "weight_budget_mb": plan.weight_budget / MB,
                     "va_budget_mb": plan.va_budget / MB, "staged_chunks": len(plan.staged),
                     "planner_stall_ms": t.stall_s * 1e3, "planner_staging_ms": t.staging_s * 1e3,
                     "planner_step_ms": t.step_s * 1e3, "compute_ms": t.compute_s * 1e3,
                     "paging_ok": paging.ok, "paging_stall_ms": paging.stall_s * 1e3 if paging.ok else None,
                     "paging_step_ms": paging.step_s * 1e3 if paging.ok else None, "paging_reason": paging.reason})
        log(f"[{name}] resident {frac:4.0%}: planner stall {t.stall_s * 1e3:8.3f} ms, paging-only "
            + (f"{paging.stall_s * 1e3:8.3f} ms" if paging.ok else "fails"))
    return rows


def paging_minimum(graph: StepGraph, low: int, high: int, cost: CostModel, step: int = 4 * MB) -> int:
    """The smallest budget, on a `step` grid, at which paging-only completes, by bisection
    between `low` (fails) and `high` (raised until it completes). Fragmentation makes success
    not strictly monotone in the budget, so this is the edge bisection finds."""
    ok = lambda budget: paging_only(graph, va_budget=budget, cost=cost).ok  # noqa: E731
    while not ok(high):
        low, high = high, high + 2 * (high - low)
    while high - low > step:
        mid = (low + high) // 2
        low, high = (low, mid) if ok(mid) else (mid, high)
    return high


def tab7(windows: list[int], cache: int, stagings: list[int], cost: CostModel) -> list[dict]:
    rows = []
    for window in windows:
        graph = llada_8b(window, cache)
        for staging in stagings:
            plan = plan_memory(graph, weight_budget=0, staging_bytes=staging, cost=cost)
            check_plan(plan, graph)
            paging = paging_only(graph, va_budget=plan.va_budget, cost=cost)
            first = paging_minimum(graph, plan.kv.size, plan.va_budget, cost)
            rows.append({"window": window, "cache": cache, "staging_mb": staging / MB, "kv_mb": plan.kv.size / MB,
                         "scratch_mb": plan.scratch_bytes / MB, "va_budget_mb": plan.va_budget / MB,
                         "planner_step_ms": plan.timeline.step_s * 1e3, "planner_stall_ms": plan.timeline.stall_s * 1e3,
                         "paging_ok": paging.ok, "paging_reason": paging.reason,
                         "paging_min_mb": first / MB})
            log(f"[tab7] W={window} staging {staging / MB:.0f} MB: VA {plan.va_budget / MB:.0f} MB planner "
                f"{plan.timeline.step_s * 1e3:.0f} ms/step, paging-only {'ok' if paging.ok else 'fails'} "
                f"(completes from about {first / MB:.0f} MB)")
    return rows


def _ms(value: float | None) -> str:
    return "fails" if value is None else f"{value:.3f}"


def markdown(result: dict) -> str:
    lines = ["# SOMR planner vs paging-only (simulated, phone cost model)", ""]
    for name, meta in result["graphs"].items():
        lines += [f"## Fig. 13c analog: {name}", "", meta["note"], "",
                  "| resident weights | VA budget MB | staged chunks | planner stall ms | planner staging ms | "
                  "planner step ms | paging-only stall ms | paging-only step ms |", "|---|---|---|---|---|---|---|---|"]
        for r in (r for r in result["fig13c"] if r["graph"] == name):
            lines.append(f"| {r['weight_fraction']:.0%} ({r['weight_budget_mb']:.1f} MB) | {r['va_budget_mb']:.1f} | "
                         f"{r['staged_chunks']} | {r['planner_stall_ms']:.3f} | {r['planner_staging_ms']:.3f} | "
                         f"{r['planner_step_ms']:.3f} | {_ms(r['paging_stall_ms'])} | {_ms(r['paging_step_ms'])} |")
        lines.append("")
    lines += ["## Tab. 7 analog: LLaDA-8B Q4_0, no resident weights, VA budget = the planner's minimum", "",
              "| window | cache | staging MB | KV MB | scratch MB | VA budget MB | planner step ms | "
              "planner stall ms | paging-only at that budget | paging-only completes from MB |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["tab7"]:
        outcome = "completes" if r["paging_ok"] else "fails: " + r["paging_reason"].split(":")[0]
        lines.append(f"| {r['window']} | {r['cache']} | {r['staging_mb']:.0f} | {r['kv_mb']:.0f} | "
                     f"{r['scratch_mb']:.1f} | {r['va_budget_mb']:.1f} | {r['planner_step_ms']:.1f} | "
                     f"{r['planner_stall_ms']:.1f} | {outcome} | "
                     f"{r['paging_min_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["graphs"])
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [r for r in result["fig13c"] if r["graph"] == name]
        x = [r["weight_budget_mb"] for r in rows]
        ax.plot(x, [r["planner_stall_ms"] for r in rows], "o-", label="planner: exposed stall")
        ax.plot(x, [r["planner_staging_ms"] for r in rows], "s--", label="planner: all staging transfers")
        ok = [r for r in rows if r["paging_ok"]]
        ax.plot([r["weight_budget_mb"] for r in ok], [r["paging_stall_ms"] for r in ok], "^-",
                label="paging-only: synchronous loads")
        top = max(r["planner_staging_ms"] for r in rows) * 1.05
        failed = [r["weight_budget_mb"] for r in rows if not r["paging_ok"]]
        if failed:
            ax.scatter(failed, [top] * len(failed), marker="x", color="red", label="paging-only fails")
        ax.set_xlabel("resident-weight budget (MB)")
        ax.set_ylabel("ms per step")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "llada-tiny"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/somr"))
    args = parser.parse_args()
    start, cost = time.time(), CostModel()
    big = llada_8b(32, 512)
    tiny = tiny_graph(args.model, BucketKey(1, 32, 64, 32))
    scale = tiny.weight_bytes() / big.weight_bytes()
    tiny_staging = int(DEFAULT_STAGING_BYTES * scale)
    tiny_cost = dataclasses.replace(cost, map_cost_s=cost.map_cost_s * scale)
    graphs = {
        "LLaDA-8B Q4_0 (analytic), W=32, P=512": (big, DEFAULT_STAGING_BYTES, cost,
            f"NPU weights {big.weight_bytes() / MB:.0f} MB; staging 256 MB (two 128 MB slots)."),
        "llada-tiny (.tflite), W=32, P=64": (tiny, tiny_staging, tiny_cost,
            f"NPU weights {tiny.weight_bytes() / MB:.2f} MB; staging and map cost scaled by {scale:.3g} "
            f"(staging {tiny_staging} B, map cost {tiny_cost.map_cost_s * 1e6:.3f} us)."),
        "llada-tiny (.tflite), W=32, P=64, unscaled map cost": (tiny, tiny_staging, cost,
            f"As above with the 8B map cost ({cost.map_cost_s * 1e6:.0f} us per transfer), which dominates "
            "at this size."),
    }
    fig13c = [row for name, (g, staging, c, _) in graphs.items() for row in sweep(name, g, staging, c)]
    result = {"cost_model": cost.to_dict(), "tiny_scale": scale,
              "graphs": {name: {"staging_bytes": s, "npu_weight_bytes": g.weight_bytes(), "note": note,
                                "cost_model": c.to_dict()} for name, (g, s, c, note) in graphs.items()},
              "fig13c": fig13c, "tab7": tab7([32, 128, 256, 512], 512, [32 * MB, DEFAULT_STAGING_BYTES], cost),
              "seconds": round(time.time() - start, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out.with_suffix(".json"), result)
    atomic_write(args.out.with_suffix(".md"), markdown(result))
    atomic_write(args.out.with_suffix(".png"), plot(result))
    log(f"wrote {args.out}.{{json,md,png}} in {result['seconds']} s")


if __name__ == "__main__":
    main()

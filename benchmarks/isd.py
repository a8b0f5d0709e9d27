"""The ISD benchmark: introspective strided decoding against left-to-right decoding of the same
causal model (I-DLM §3.2 and App. B; docs/techniques/isd.md; issue 28).

    .venv/bin/python benchmarks/isd.py --model models/idlm-tiny --n 200 --out benchmarks/results/isd

For strides 2, 3, 4, 5 at T = 0 and at T = 1 (top-k 50, top-p 0.95), over the held-out prompts
of every task (`--n` per task, batches of 8): tokens per forward (TPF, over the steps after
the prompt's), the TPF the renewal formula predicts from the measured per-position acceptance
alpha_i (compared with the TPF of the acceptance mechanics: tokens cut at EOS or at the
generation's end count as emitted), the accepted-length histogram, query rows per token
(overhead), accuracy per task against left-to-right decoding of the same model, whether the
tokens are identical (T = 0), forwards per answer and wall clock on the JAX executor and on
LiteRT (the bundle cache); the relaxed-acceptance sweep (relax 0 / 0.1 / 0.2 / 0.5 / 1 at
T = 1, stride 4); and the phone cost of each row from the phone cost model
(`dlm_jax.runtime.latency.PhoneCostModel`: every ISD step is one bucket of 2N-1 rows, a cold
start N); single-request latency (batch 1) per stride; R-ISD: TPF of stride 4 with and
without each model's gated LoRA adapters (`--lora MODEL:ADAPTERS`) and whether its tokens stay
the base's left-to-right tokens. Writes <out>.json, <out>.md and <out>.png, and reports the
targets as measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import dlm_jax  # noqa: E402
from _hardware import machine  # noqa: E402
from dlm_jax.runtime.decoder import merge_speculation, speculation_summary  # noqa: E402
from dlm_jax.techniques.isd.strided import renewal_tpf  # noqa: E402
from dlm_jax.runtime.latency import PhoneCostModel  # noqa: E402
from dlm_jax.training.data import TASKS, make_split  # noqa: E402

STRIDES = (2, 3, 4, 5)
SAMPLED = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}
RELAX = (0.0, 0.1, 0.2, 0.5, 1.0)
BATCH = 8


def _examples(tasks: list[str], n: int) -> dict[str, list]:
    return {t: make_split(TASKS[t], n, split="heldout", seed=0) for t in tasks}


def decode_all(handle, examples: dict[str, list], cfg) -> dict:
    """Every task's prompts in batches of 8 (seed = prompt index): accuracy per task, the ids,
    forwards per answer, the speculation counts and the decode seconds (each batch's buckets
    built first, untimed)."""
    out = {"per_task": {}, "ids": {}, "seconds": 0.0, "forwards": 0, "answers": 0, "speculation": {}}
    for task, exs in examples.items():
        correct, ids = [], []
        for i in range(0, len(exs), BATCH):
            chunk = exs[i:i + BATCH]
            prompts = [handle.encode(e.prompt) for e in chunk]
            handle.decoder.warmup([len(p) for p in prompts], cfg)  # builds are not timed
            t0 = time.perf_counter()
            res = handle.generate(prompts, cfg, seeds=list(range(i, i + len(chunk))))
            out["seconds"] += time.perf_counter() - t0
            out["forwards"] += sum(res.stats.request_nfe)
            out["answers"] += len(chunk)
            out["speculation"] = merge_speculation(out["speculation"], res.stats.speculation)
            ids += [list(s) for s in res.token_ids]
            correct += [TASKS[task].score(text, ex) for text, ex in zip(res.texts, chunk)]
        out["per_task"][task] = float(np.mean(correct))
        out["ids"][task] = ids
    return out


def phone_ms_per_token(spec: dict, stride: int, cost: PhoneCostModel) -> float:
    """Phone latency per token over the steps after the prompt's: verify steps run 2N-1 rows,
    cold starts N (left to right: one row a step)."""
    verify = sum(spec.get("accept_histogram", {}).values())
    cold = spec["steps"] - verify
    ms = verify * cost.step_ms(2 * stride - 1) + cold * cost.step_ms(stride)
    return ms / max(spec["tokens"], 1)


def row(name: str, executor: str, sampling: str, stride: int, res: dict, ref: dict | None, cost: PhoneCostModel,
        relax: float = 0.0) -> dict:
    spec = res["speculation"]
    summary = speculation_summary(spec)
    alpha = [a for a in summary["alpha"] if a is not None]
    predicted = renewal_tpf(alpha) if stride > 1 and len(alpha) == stride - 1 else 1.0
    out = {"setting": name, "executor": executor, "sampling": sampling, "stride": stride, "relax": relax,
           "accuracy": res["per_task"], "mean_accuracy": float(np.mean(list(res["per_task"].values()))),
           "tpf": summary["tpf"], "mechanics_tpf": summary["emitted_tpf"], "renewal_tpf": round(predicted, 4),
           "renewal_error": round(abs(summary["emitted_tpf"] - predicted) / predicted, 4),
           "emitted_tokens": summary["emitted"], "alpha": summary["alpha"],
           "accept_histogram": summary["accept_histogram"], "overhead": summary["overhead"],
           "forwards_per_answer": round(res["forwards"] / res["answers"], 3), "seconds": round(res["seconds"], 3),
           "phone_ms_per_token": round(phone_ms_per_token(spec, stride, cost), 2)}
    if ref is not None:
        same = sum(a == b for t in res["ids"] for a, b in zip(res["ids"][t], ref["ids"][t]))
        out["identical_to_left_to_right"] = f"{same}/{res['answers']}"
        out["speedup_vs_left_to_right"] = round(ref["seconds"] / max(res["seconds"], 1e-9), 3)
        out["phone_speedup"] = round(phone_ms_per_token(ref["speculation"], 1, cost) / out["phone_ms_per_token"], 3)
    return out


def latency(handle, examples: dict[str, list], n: int, executor: str) -> list[dict]:
    """Single-request latency: the first `n` prompts of every task decoded one at a time
    (batch 1, T = 0), left to right and with ISD at each stride (buckets built first, untimed)."""
    prompts = [handle.encode(e.prompt) for exs in examples.values() for e in exs[:n]]
    out, ref = [], None
    for stride in (1, *STRIDES):
        cfg = dlm_jax.preset("ar", gen_len=64) if stride == 1 else dlm_jax.preset("isd", stride=stride, gen_len=64)
        seconds, forwards, ids = 0.0, 0, []
        for p in prompts:
            handle.decoder.warmup([len(p)], cfg)
            t0 = time.perf_counter()
            res = handle.generate([p], cfg)
            seconds += time.perf_counter() - t0
            forwards += res.stats.nfe
            ids.append(res.token_ids[0])
        ref = ref or (seconds, ids)
        out.append({"executor": executor, "stride": stride, "prompts": len(prompts),
                    "ms_per_answer": round(1e3 * seconds / len(prompts), 2),
                    "forwards_per_answer": round(forwards / len(prompts), 3),
                    "speedup_vs_left_to_right": round(ref[0] / seconds, 3),
                    "identical_to_left_to_right": f"{sum(a == b for a, b in zip(ids, ref[1]))}/{len(prompts)}"})
        print(json.dumps(out[-1]), file=sys.stderr)
    return out


def run(model: str, n: int, tasks: list[str], executors: list[str], latency_n: int = 0) -> tuple[list, list]:
    examples = _examples(tasks, n)
    cost = PhoneCostModel.npu()
    rows, single = [], []
    for executor in executors:
        handle = dlm_jax.load(model, executor=executor)
        if latency_n:
            single += latency(handle, examples, latency_n, executor)
        samplings = {"T=0": {}, "T=1 top-k 50 top-p 0.95": SAMPLED} if executor == "jax" else {"T=0": {}}
        for label, sampling in samplings.items():
            ref = decode_all(handle, examples, dlm_jax.preset("ar", gen_len=64, **sampling))
            rows.append(row("left to right", executor, label, 1, ref, None, cost))
            print(json.dumps({k: rows[-1][k] for k in ("setting", "executor", "sampling", "mean_accuracy",
                                                       "seconds")}), file=sys.stderr)
            for stride in STRIDES:
                res = decode_all(handle, examples, dlm_jax.preset("isd", stride=stride, gen_len=64, **sampling))
                rows.append(row(f"isd stride {stride}", executor, label, stride, res, ref, cost))
                print(json.dumps({k: rows[-1][k] for k in ("setting", "executor", "sampling", "tpf", "renewal_tpf",
                                                           "mean_accuracy", "speedup_vs_left_to_right")}),
                      file=sys.stderr)
            if executor == "jax" and sampling:
                for relax in RELAX[1:]:
                    res = decode_all(handle, examples, dlm_jax.preset("isd", stride=4, gen_len=64, relax=relax,
                                                                      **sampling))
                    rows.append(row(f"isd stride 4, relax {relax}", executor, label, 4, res, ref, cost, relax))
                    print(json.dumps({k: rows[-1][k] for k in ("setting", "tpf", "mean_accuracy")}), file=sys.stderr)
    return rows, single


def risd(pairs: list[tuple[str, str]], tasks: list[str], n: int) -> list[dict]:
    """R-ISD: each base model decoded left to right, with ISD (stride 4, T = 0) and with ISD
    over its gated LoRA adapters (JAX executor): TPF with and without the adapters, and whether
    the tokens stay the base's left-to-right tokens."""
    examples = _examples(tasks, n)
    cost = PhoneCostModel.npu()
    out = []
    for model, adapters in pairs:
        base = dlm_jax.load(model, executor="jax")
        ref = decode_all(base, examples, dlm_jax.preset("ar", gen_len=64))
        out.append(row(f"{model}: left to right", "jax", "T=0", 1, ref, None, cost))
        plain = decode_all(base, examples, dlm_jax.preset("isd", stride=4, gen_len=64))
        out.append(row(f"{model}: isd stride 4", "jax", "T=0", 4, plain, ref, cost))
        gated = decode_all(dlm_jax.load(model, lora=adapters), examples, dlm_jax.preset("isd", stride=4, gen_len=64))
        out.append(row(f"{model}: isd stride 4 + {adapters}", "jax", "T=0", 4, gated, ref, cost))
        for r in out[-3:]:
            r["model"], r["adapters"] = model, adapters if r["setting"].endswith(adapters) else None
            print(json.dumps({k: r[k] for k in ("setting", "tpf", "mean_accuracy")}
                             | {"identical": r.get("identical_to_left_to_right")}), file=sys.stderr)
    return out


def targets(rows: list[dict], single: list[dict]) -> dict:
    """The issue's targets, as measured here."""
    greedy = [r for r in rows if r["sampling"] == "T=0" and r["stride"] > 1]
    s4 = next(r for r in rows if r["executor"] == "jax" and r["sampling"] == "T=0" and r["stride"] == 4)
    ar = next(r for r in rows if r["executor"] == "jax" and r["sampling"] == "T=0" and r["stride"] == 1)
    long_runs = [r for r in rows if r["stride"] > 1 and r["relax"] == 0 and r["emitted_tokens"] >= 2000]
    out = {"greedy_identical_everywhere": all(r["identical_to_left_to_right"].split("/")[0]
                                              == r["identical_to_left_to_right"].split("/")[1] for r in greedy),
           "stride4_greedy_tpf": s4["tpf"], "stride4_tpf_at_least_2.5": s4["tpf"] >= 2.5,
           "stride4_accuracy_vs_left_to_right": [s4["mean_accuracy"], ar["mean_accuracy"]],
           "renewal_within_5pct": {f"{r['executor']} {r['sampling']} N={r['stride']}": r["renewal_error"]
                                   for r in long_runs},
           "wall_clock_speedup_stride4": {r["executor"]: r["speedup_vs_left_to_right"] for r in greedy
                                          if r["stride"] == 4}}
    out["renewal_all_within_5pct"] = all(v <= 0.05 for v in out["renewal_within_5pct"].values())
    out["single_request_speedup_stride4"] = {r["executor"]: r["speedup_vs_left_to_right"] for r in single
                                             if r["stride"] == 4}
    return out


def markdown(rows: list[dict], tasks: list[str], meta: dict, single: list[dict]) -> str:
    head = ("| setting | executor | sampling | " + " | ".join(tasks) + " | TPF | renewal TPF (mechanics TPF) | "
            "alpha_i | rows/token | forwards/answer | identical to L2R | wall clock x L2R | phone ms/token (x L2R) |")
    lines = [f"ISD on `{meta['model']}`, {meta['n']} held-out prompts per task, generation 64, batches of 8, "
             f"{meta['machine'].get('cpu', 'CPU')} ({meta['machine'].get('cores', '?')} cores). TPF counts tokens per request-forward after the prompt's forward; the renewal "
             f"formula (I-DLM App. B; docs/techniques/isd.md) is evaluated at the measured alpha_i and "
             f"compared with the TPF of the acceptance mechanics (tokens cut at EOS count as emitted).", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        acc = " | ".join(f"{100 * r['accuracy'][t]:.1f}%" for t in tasks)
        alpha = ", ".join("-" if a is None else f"{a:.3f}" for a in r["alpha"]) or "-"
        lines.append(f"| {r['setting']} | {r['executor']} | {r['sampling']} | {acc} | {r['tpf']} | "
                     f"{r['renewal_tpf']} ({r['mechanics_tpf']}) | {alpha} | {r['overhead']} | "
                     f"{r['forwards_per_answer']} | {r.get('identical_to_left_to_right', '-')} | "
                     f"{r.get('speedup_vs_left_to_right', '-')} | {r['phone_ms_per_token']} "
                     f"({r.get('phone_speedup', '-')}) |")
    if single:
        lines += ["", "Single requests (batch 1, T = 0, one prompt at a time):", "",
                  "| executor | stride | prompts | ms per answer | forwards per answer | wall clock x L2R | "
                  "identical to L2R |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['executor']} | {r['stride']} | {r['prompts']} | {r['ms_per_answer']} | "
                  f"{r['forwards_per_answer']} | {r['speedup_vs_left_to_right']} | {r['identical_to_left_to_right']} |"
                  for r in single]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for sampling, marker in (("T=0", "o"), ("T=1 top-k 50 top-p 0.95", "s")):
        sel = [r for r in rows if r["executor"] == "jax" and r["sampling"] == sampling and r["relax"] == 0]
        if not sel:
            continue
        n = [r["stride"] for r in sel]
        line = ax1.plot(n, [r["tpf"] for r in sel], marker=marker, label=f"TPF (tokens kept), {sampling}")[0]
        ax1.plot(n, [r["mechanics_tpf"] for r in sel], marker=marker, linestyle=":", color=line.get_color(),
                 label=f"TPF of the acceptance mechanics (EOS-cut tokens counted), {sampling}")
        ax1.plot(n, [r["renewal_tpf"] for r in sel], linestyle="--", alpha=0.5, color="black",
                 label="renewal formula at the measured alpha_i" if marker == "o" else None)
        ax2.plot(n, [100 * r["mean_accuracy"] for r in sel], marker=marker, label=sampling)
    ax1.plot([1, 5], [1, 5], color="grey", linewidth=0.8, label="TPF = N")
    ax1.set_xlabel("stride N")
    ax1.set_ylabel("tokens per forward")
    ax1.legend(fontsize=6, loc="lower right")
    ax2.set_xlabel("stride N (1 = left to right)")
    ax2.set_ylabel("mean accuracy (%)")
    ax2.legend(fontsize=8)
    fig.suptitle("ISD on the shipped I-DLM model: TPF and accuracy by stride")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/idlm-tiny")
    parser.add_argument("--n", type=int, default=200, help="held-out prompts per task")
    parser.add_argument("--tasks", nargs="+", default=["addition", "sorting", "gsm_lite"])
    parser.add_argument("--executors", nargs="+", default=["jax", "litert"])
    parser.add_argument("--latency-n", type=int, default=30, help="prompts per task decoded one at a time")
    parser.add_argument("--lora", nargs="*", default=["models/idlm-tiny:models/idlm-tiny/risd",
                                                      "models/ar-tiny:models/ar-tiny/risd"],
                        help="MODEL:ADAPTERS pairs for the R-ISD rows (pairs whose adapters are missing are skipped)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/isd"))
    parser.add_argument("--render", action="store_true",
                        help="re-write OUT.md and OUT.png from OUT.json, decoding nothing (after a change of this "
                             "script's text)")
    args = parser.parse_args()
    if args.render:
        write_views(json.loads(args.out.with_suffix(".json").read_text()), args.tasks, args.out)
        return
    meta = {"model": args.model, "n": args.n, "machine": machine()}
    rows, single = run(args.model, args.n, args.tasks, args.executors, args.latency_n)
    pairs = [tuple(p.split(":", 1)) for p in args.lora if Path(p.split(":", 1)[1]).is_dir()]
    lora_rows = risd(pairs, args.tasks, args.n)
    report = {"meta": meta, "targets": targets(rows, single), "rows": rows, "single_request": single,
              "risd": lora_rows}
    report["targets"]["risd_identical_to_base_left_to_right"] = {
        r["setting"]: r["identical_to_left_to_right"] for r in lora_rows if r.get("adapters")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    write_views(report, args.tasks, args.out)
    print(json.dumps(report["targets"], indent=2))


def write_views(report: dict, tasks: list[str], out: Path) -> None:
    """OUT.md and OUT.png of a report (what a run wrote to OUT.json)."""
    rows, meta, single, lora_rows = report["rows"], report["meta"], report["single_request"], report["risd"]
    out.with_suffix(".md").write_text(markdown(rows, tasks, meta, single)
                                      + ("\nR-ISD (gated LoRA adapters on the mask rows; base anchors), JAX, T = 0, "
                                         "stride 4:\n\n" + "\n".join(markdown(lora_rows, tasks, meta, [])
                                                                   .splitlines()[2:]) + "\n" if lora_rows else ""))
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()

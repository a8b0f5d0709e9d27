"""llada.cpp's decoding on the bucketed runtime: what each technique buys.

    .venv/bin/python benchmarks/lladacpp.py --model models/llada-tiny --n 200 \
        --out benchmarks/results/lladacpp

Two passes per model, on the held-out prompts of every task, block 32:
- accuracy (`--n` prompts per task, batches of 8, generation lengths `--gens`): accuracy,
  forwards per request, useful rows per forward (window rows still masked, invisible or
  draft), and the revision counters;
- latency (`--cases` prompts per task, batch 1, `--repeats` runs each, alternating settings):
  measured wall clock on this CPU with each executor (`--executors jax litert`), and the
  simulated phone latency of the same decodes: every forward priced by its window bucket with
  the phone cost model (`PhoneCostModel`, our model from PowerInfer-2 §2.3.1's figures and
  llada.cpp §2.2's tiles: an 8B Q4_0 model, NPU 56 GB/s and 770 prefill tokens/s in 32-token
  tiles; CPU 43.9 GB/s and 8 tokens/s). The baselines run on the
  phone's CPU, llada.cpp's rows on its NPU, with CPU refreshes beside the NPU steps (what a
  refresh costs beyond the step it runs beside is added). The Markdown also prices every row
  on the NPU, vanilla included, to separate what the techniques buy from what the NPU does.

Settings, in llada.cpp's breakdown order (Table 6): CPU vanilla (LLaDA: no cache, one token
per step) -> + prefix KV reuse (Fast-dLLM's prefix cache, still one token per step) ->
+ MBSD (sliding speculative windows, look-ahead at 4, threshold 0.9) -> + staged
stabilization (DPPR states: visible at 0.7, stable at 0.9; visible slots in the window
re-scored every forward, by probe rows with `remask`) -> + selective logits skipping ->
+ sparse CPU refresh (8 rows; the `llada-cpp` preset). Then Fast-dLLM (prefix + threshold
0.9) and Fast-dLLM++ (prefix + Frechet 0.25) for comparison, and the sensitivity sweeps of
Fig. 13: trigger in {2, 4, 6, 8} and theta_visible x theta_stable (`--sweep-n` prompts per
task, default `--n`).

Writes <out>.json, <out>.md and <out>.png, and reports the issue's targets as ratios from
this one run. `--revisit` picks how filled tokens are scored: leave-one-out `remask` probe
rows (the default, as in the preset) or `in_place`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import dlm_jax  # noqa: E402
from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402
from dlm_jax.runtime.buckets import BucketKey  # noqa: E402
from dlm_jax.runtime.latency import PhoneCostModel  # noqa: E402
from dlm_jax.training.data import TASKS, make_split  # noqa: E402

NPU, CPU = PhoneCostModel.npu(), PhoneCostModel.cpu()
CPU_ROWS = PhoneCostModel.cpu(tile=1)  # a CPU has no tile: a refresh of n rows costs n rows
BASELINES = ("CPU vanilla", "+ prefix KV reuse")
PASSES = ("calibration", "accuracy", "latency", "sweeps")


def breakdown(gen: int, revisit: str) -> dict[str, dict]:
    """The settings of llada.cpp's breakdown table, each adding one technique."""
    mbsd = dict(cache="mbsd", rule="threshold", threshold=0.9, draft_threshold=0.9, skip_stable=False)
    staged = dict(mbsd, threshold=0.7, draft_threshold=0.7, revision="dppr", theta_stable=0.9, theta_visible=0.7,
                  refresh_rows=0, revisit=revisit)
    return {
        "CPU vanilla": dict(cache="none", rule="topk", steps=gen),
        "+ prefix KV reuse": dict(cache="prefix", rule="topk", steps=gen),
        "+ MBSD": mbsd,
        "+ staged stabilization": staged,
        "+ selective logits skipping": dict(staged, skip_stable=True),
        "+ sparse CPU refresh": dict(staged, skip_stable=True, refresh_rows=8),
    }


def comparisons() -> dict[str, dict]:
    return {"Fast-dLLM threshold 0.9": dict(cache="prefix", rule="threshold", threshold=0.9),
            "Fast-dLLM++ Frechet 0.25": dict(cache="prefix", rule="frechet", delta=0.25)}


def sweeps(revisit: str) -> dict[str, dict]:
    full = dict(cache="mbsd", rule="threshold", threshold=0.7, draft_threshold=0.7, revision="dppr",
                theta_stable=0.9, refresh_rows=8, revisit=revisit)
    out = {f"trigger {t}": dict(full, trigger=t) for t in (2, 4, 6, 8)}
    for tv in (0.5, 0.6, 0.7, 0.8):
        for ts in (0.85, 0.9, 0.95):
            out[f"theta_v {tv} / theta_s {ts}"] = dict(full, threshold=tv, draft_threshold=tv, theta_visible=tv,
                                                       theta_stable=ts)
    return out


def simulated_ms(name: str, stats: dict) -> dict[str, float]:
    """Phone latency of one decode from its buckets: on the NPU, and on the CPU for the
    baselines (their setting); refreshes priced on the CPU, counted where they outlast the
    NPU step they run beside."""
    npu = cpu = 0.0
    for key, steps in stats["buckets"].items():
        window = int(key.split("_w")[1].split("_")[0])
        npu += steps * NPU.step_ms(window)
        cpu += steps * CPU.step_ms(window)
    c = stats["counters"]
    refresh = 0.0
    if c.get("refresh_steps"):
        per = CPU_ROWS.step_ms(c["refresh_rows"] / c["refresh_steps"])
        refresh = c["refresh_steps"] * max(0.0, per - NPU.step_ms(32))
    phone = cpu if name in BASELINES else npu + refresh
    return {"phone_ms": phone, "npu_ms": npu + refresh, "cpu_ms": cpu, "refresh_exposed_ms": refresh}


def _auroc(pos: np.ndarray, neg: np.ndarray) -> float | None:
    """P(a random `pos` score > a random `neg` one), ties half; None without both kinds."""
    if not len(pos) or not len(neg):
        return None
    pos, neg = np.asarray(pos)[:, None], np.asarray(neg)[None, :]
    return float(((pos > neg).sum() + 0.5 * (pos == neg).sum()) / max(pos.size * neg.size, 1))


def calibration(handle, tasks: list[str], n: int, *, corrupt: float = 0.2, seed: int = 0) -> dict:
    """How well a filled token's score tells a right token from a wrong one, before trusting
    revision on it. Two kinds of filled answers after each held-out prompt: `random`, the
    reference answer (+ EOS) with a fraction `corrupt` of its tokens replaced by random bytes;
    `own`, the model's own answer from an over-parallel decoder (prefix cache, threshold 0.5,
    generation 64), a token counted right where it equals the reference (+ EOS tail) at its
    offset. Each filled slot is scored in place (one forward, the token visible: the
    probability the model gives it) and leave-one-out (the slot alone masked: `remask`).
    Reports the AUROC of each score for right vs wrong tokens (0.5: no signal) and the mean
    scores."""
    rng = np.random.default_rng(seed)
    mask_id, eos = handle.config.mask_token_id, handle.config.eos_ids[0]
    aggressive = dlm_jax.decode_config(cache="prefix", threshold=0.5, gen_len=64, block_len=32,
                                       stop_on_eos_block=False)
    scores = {(fill, kind): ([], []) for fill in ("random", "own") for kind in ("in_place", "remask")}
    for task in tasks:
        examples = make_split(TASKS[task], n, split="heldout", seed=0)
        prompts = [handle.encode(ex.prompt) for ex in examples]
        own = handle.decoder.decode(prompts, aggressive).sequences if len(prompts) <= 8 else [
            s for i in range(0, len(prompts), 8) for s in handle.decoder.decode(prompts[i:i + 8], aggressive).sequences]
        for ex, prompt, mine in zip(examples, prompts, own):
            ref = (handle.tokenizer.encode(ex.answer) + [eos] * 64)[:64]
            answer = np.array(ref[:len(handle.tokenizer.encode(ex.answer)) + 1])
            wrong = rng.random(len(answer)) < corrupt
            random_fill = answer.copy()
            random_fill[wrong] = (random_fill[wrong] + rng.integers(1, 255, wrong.sum())) % 256
            for fill, tokens, bad in (("random", random_fill, wrong),
                                      ("own", np.asarray(mine), np.asarray(mine) != np.array(ref))):
                place, loo = _filled_scores(handle, prompt, tokens, mask_id)
                for kind, v in (("in_place", place), ("remask", loo)):
                    scores[fill, kind][0].extend(v[~bad])
                    scores[fill, kind][1].extend(v[bad])
    out = {}
    for (fill, kind), (right, bad) in scores.items():
        out.setdefault(fill, {})[kind] = {
            "auroc": _auroc(np.array(right), np.array(bad)), "mean_right": float(np.mean(right)),
            "mean_wrong": float(np.mean(bad)) if bad else None, "right": len(right), "wrong": len(bad)}
    return out


def _filled_scores(handle, prompt: list[int], filled: np.ndarray, mask_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(in place, leave-one-out) probability of each filled token after `prompt`. Sequences
    are padded to multiples of 64 slots (hidden from every real slot) and the leave-one-out
    batch to 64 rows, so one compiled forward serves many examples."""
    seq = np.array(prompt + [int(t) for t in filled], np.int32)
    n, length = len(filled), len(seq)
    size = -(-length // 64) * 64
    at = len(prompt) + np.arange(n)
    rows = -(-(n + 1) // 64) * 64
    batch = np.full((rows, size), mask_id, np.int32)
    batch[:, :length] = seq
    batch[1 + np.arange(n), at] = mask_id  # row 0: in place; row 1 + i: slot i masked
    logp = _forward(handle)(batch, length)
    place = np.exp(logp[0, at, filled])
    loo = np.exp(logp[1 + np.arange(n), at, filled])
    return place, loo


def _forward(handle):
    """A jitted full-sequence forward returning log-probabilities, real slots [0, length)."""
    if getattr(handle, "_lladacpp_forward", None) is None:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        graphdef, state = nnx.split(handle.model)

        @jax.jit
        def fwd(state, tokens, length):
            model = nnx.merge(graphdef, state)
            valid = jnp.arange(tokens.shape[1]) < length
            mask = jnp.broadcast_to(valid[None, None, :] | jnp.eye(tokens.shape[1], dtype=bool)[None],
                                    (tokens.shape[0], tokens.shape[1], tokens.shape[1]))
            return jax.nn.log_softmax(model(tokens, mask=mask).logits.astype(jnp.float32), axis=-1)

        handle._lladacpp_forward = lambda tokens, length: np.asarray(fwd(state, tokens, length))
    return handle._lladacpp_forward


def accuracy_pass(handle, settings: dict[str, dict], gen: int, tasks: list[str], n: int, batch: int) -> dict:
    out = {}
    for name, setting in settings.items():
        cfg = dlm_jax.decode_config(gen_len=gen, block_len=32, **setting)
        per_task, nfe, useful, forwards, counters = {}, [], 0, 0, {}
        t0 = time.perf_counter()
        for task in tasks:
            examples = make_split(TASKS[task], n, split="heldout", seed=0)
            correct = []
            for i in range(0, n, batch):
                chunk = examples[i:i + batch]
                res = handle.generate([handle.encode(ex.prompt) for ex in chunk], cfg)
                correct += [TASKS[task].score(text, ex) for ex, text in zip(chunk, res.texts)]
                nfe += res.stats.request_nfe
                forwards += res.stats.nfe
                for k, v in res.stats.counters.items():
                    counters[k] = counters.get(k, 0) + v
            per_task[task] = float(np.mean(correct))
        acc = float(np.mean(list(per_task.values())))
        out[name] = {"accuracy": acc, "per_task": per_task, "n": n, "mean_nfe": float(np.mean(nfe)),
                     "useful_rows_per_forward": counters.get("useful_rows", 0) / max(forwards, 1),
                     "window_rows_per_forward": counters.get("window_rows", 0) / max(forwards, 1),
                     "logit_rows_per_forward": counters.get("logit_rows", 0) / max(forwards, 1),
                     "counters": counters, "seconds": time.perf_counter() - t0}
        print(f"  gen {gen} {name:34s} acc {acc:.3f} nfe {out[name]['mean_nfe']:6.1f} "
              f"useful/fwd {out[name]['useful_rows_per_forward']:5.1f} ({out[name]['seconds']:.0f} s)",
              file=sys.stderr, flush=True)
    return out


def latency_pass(handles: dict, settings: dict[str, dict], gen: int, tasks: list[str], cases: int,
                 repeats: int) -> dict:
    """Batch-1 decodes of `cases` prompts per task; settings alternate within each repeat."""
    prompts = [ex.prompt for t in tasks for ex in make_split(TASKS[t], cases, split="heldout", seed=0)]
    cfgs = {name: dlm_jax.decode_config(gen_len=gen, block_len=32, **s) for name, s in settings.items()}
    out = {name: {"sim": [], **{f"{e}_s": [] for e in handles}} for name in settings}
    for ex, handle in handles.items():  # warm every bucket first (compile / export), untimed
        for cfg in cfgs.values():
            for p in prompts:
                handle.generate([handle.encode(p)], cfg)
    for r in range(repeats):
        for name, cfg in cfgs.items():
            for ex, handle in handles.items():
                total = 0.0
                for p in prompts:
                    ids = handle.encode(p)
                    t0 = time.perf_counter()
                    res = handle.generate([ids], cfg)
                    total += time.perf_counter() - t0
                    if r == 0 and ex == next(iter(handles)):
                        out[name]["sim"].append(simulated_ms(name, res.stats.to_dict()))
                out[name][f"{ex}_s"].append(total / len(prompts))
        print(f"  latency gen {gen}: repeat {r + 1}/{repeats} done", file=sys.stderr, flush=True)
    summary = {}
    for name, o in out.items():
        sim = {k: float(np.mean([s[k] for s in o["sim"]])) for k in o["sim"][0]}
        summary[name] = {**{f"{ex}_s": statistics.median(o[f"{ex}_s"]) for ex in handles}, **sim}
    return summary


def run(model: str, gens: list[int], tasks: list[str], n: int, cases: int, repeats: int, executors: list[str],
        revisit: str, sweep_gen: int | None, batch: int, passes: set[str], save=lambda result: None,
        sweep_n: int | None = None) -> dict:
    """One model's passes; `save(result)` is called with the result so far after each part
    (a long run that is stopped keeps what it measured)."""
    handles = {ex: dlm_jax.load(model, executor=ex) for ex in executors}
    acc_handle = handles.get("jax") or next(iter(handles.values()))
    result = {"model": model, "parameters": int(sum(v.size for v in dlm_jax.get_params(
        dlm_jax.load_pretrained(model)).values())), "revisit": revisit, "n": n, "tasks": tasks, "gens": {}}
    if "calibration" in passes:
        print(f"{model}: calibration", file=sys.stderr, flush=True)
        result["calibration"] = calibration(acc_handle, tasks, min(n, 50))
    for gen in gens:
        settings = {**breakdown(gen, revisit), **comparisons()}
        print(f"{model}: gen {gen}", file=sys.stderr, flush=True)
        acc = accuracy_pass(acc_handle, settings, gen, tasks, n, batch) if "accuracy" in passes else {}
        lat = latency_pass(handles, settings, gen, tasks, cases, repeats) if "latency" in passes else {}
        result["gens"][str(gen)] = {name: {**acc.get(name, {}), **lat.get(name, {})} for name in settings}
        save(result)
    if sweep_gen and "sweeps" in passes:
        print(f"{model}: sweeps at gen {sweep_gen}", file=sys.stderr, flush=True)
        sw, sweep_n = sweeps(revisit), sweep_n or n
        acc = accuracy_pass(acc_handle, sw, sweep_gen, tasks, sweep_n, batch)
        lat = latency_pass({"jax": acc_handle}, sw, sweep_gen, tasks, max(1, cases // 2), 1)
        result["sweeps"] = {"gen_len": sweep_gen, "n": sweep_n, "settings": {k: {**acc[k], **lat[k]} for k in sw}}
        save(result)
    return result


def merge(a: dict, b: dict) -> dict:
    """`b` laid over `a`, dictionaries merged key by key (results of passes run apart); a
    setting's `counters` come from one accuracy pass, so `b`'s replace `a`'s whole."""
    out = dict(a)
    for k, v in b.items():
        deep = isinstance(v, dict) and isinstance(out.get(k), dict) and k != "counters"
        out[k] = merge(out[k], v) if deep else v
    return out


def combine(paths: list[Path]) -> list[dict]:
    """Results of several runs (for example the accuracy pass run on an accelerator and the
    latency pass on this CPU), merged per model."""
    by_model: dict[str, dict] = {}
    for path in paths:
        for res in json.loads(path.read_text())["results"]:
            by_model[res["model"]] = merge(by_model.get(res["model"], {}), res)
    return list(by_model.values())


def targets(res: dict) -> list[dict]:
    """The issue's targets, per model and generation length."""
    out = []
    for gen, rows in res["gens"].items():
        van, full = rows["CPU vanilla"], rows["+ sparse CPU refresh"]
        thr = rows["Fast-dLLM threshold 0.9"]
        if "accuracy" not in van or "phone_ms" not in van:
            continue
        wall = {k[:-2]: van[k] / full[k] for k in van if k.endswith("_s") and full.get(k)}
        out.append({"model": res["model"], "gen_len": int(gen),
                    "phone_speedup": van["phone_ms"] / full["phone_ms"], "phone_target": 17.0,
                    "npu_speedup": van["npu_ms"] / full["npu_ms"],
                    "wall_speedup": wall, "wall_target": 10.0,
                    "accuracy_drop_points": 100 * (van["accuracy"] - full["accuracy"]), "accuracy_target": 1.0,
                    "nfe_vs_threshold": full["mean_nfe"] / thr["mean_nfe"],
                    "accuracy_vs_threshold_points": 100 * (full["accuracy"] - thr["accuracy"])})
    return out


def markdown(results: list[dict]) -> str:
    lines = ["# llada.cpp decoding: breakdown, comparison, sensitivity", ""]
    for res in results:
        lines += [f"## {res['model']} ({res['parameters'] / 1e6:.2f}M parameters, revisit={res['revisit']}, "
                  f"{res['n']} prompts per task: {', '.join(res['tasks'])})", ""]
        if "calibration" in res:
            lines += ["In-place vs leave-one-out (remask) scores of filled tokens, AUROC for right vs wrong "
                      "tokens (0.5 = no signal) and mean probability of right / wrong tokens:", "",
                      "| filled with | in place | remask |", "|---|---|---|"]
            for fill, kinds in res["calibration"].items():
                cells = [f"{'-' if k['auroc'] is None else format(k['auroc'], '.3f')} ({k['mean_right']:.2f} / "
                         f"{'-' if k['mean_wrong'] is None else format(k['mean_wrong'], '.2f')})"
                         for k in (kinds["in_place"], kinds["remask"])]
                lines.append(f"| {fill} | {cells[0]} | {cells[1]} |")
            lines.append("")
        for gen, rows in res["gens"].items():
            if not all("accuracy" in r and "phone_ms" in r for r in rows.values()):
                continue
            exs = sorted({k[:-2] for r in rows.values() for k in r if k.endswith("_s") and k != "seconds"})
            head = ("| setting | accuracy | forwards | useful rows / forward | logit rows / forward | "
                    + " | ".join(f"wall s ({e})" for e in exs)
                    + " | phone ms (sim) | vs vanilla (phone) | NPU ms (sim, every row on the NPU) |")
            n_gen = next(iter(rows.values())).get("n", res["n"])
            lines += [f"### generation {gen} ({n_gen} prompts per task)", "", head,
                      "|" + "---|" * (head.count("|") - 1)]
            van = rows["CPU vanilla"]
            for name, r in rows.items():
                walls = " | ".join(f"{r[e + '_s']:.3f}" for e in exs)
                mark = " *" if "source" in r else ""
                lines.append(f"| {name}{mark} | {100 * r['accuracy']:.1f}% | {r['mean_nfe']:.1f} | "
                             f"{r['useful_rows_per_forward']:.1f} | {r['logit_rows_per_forward']:.1f} | {walls} | "
                             f"{r['phone_ms']:.0f} | {van['phone_ms'] / r['phone_ms']:.1f}x | {r['npu_ms']:.0f} |")
            lines += [""] + [f"\\* {name}: {r['source']}." for name, r in rows.items() if "source" in r]
            lines.append("")
        if "sweeps" in res:
            sweep_n = res["sweeps"].get("n", res["n"])
            lines += [f"### sensitivity (generation {res['sweeps']['gen_len']}, full stack, {sweep_n} prompts per task)",
                      "",
                      "| setting | accuracy | forwards | visible at block end / request | phone ms (sim) |",
                      "|---|---|---|---|---|"]
            per = len(res["tasks"]) * sweep_n
            for name, r in res["sweeps"]["settings"].items():
                lines.append(f"| {name} | {100 * r['accuracy']:.1f}% | {r['mean_nfe']:.1f} | "
                             f"{r['counters'].get('visible_at_block_end', 0) / per:.2f} | {r['phone_ms']:.0f} |")
            lines.append("")
    lines += ["## Targets (ratios from this run)", "", "| model | gen | phone speed-up (>= 17x) | "
              "same speed-up, vanilla on the NPU too | wall speed-up (>= 10x) | accuracy drop vs vanilla (<= 1 pt) | "
              "forwards vs threshold 0.9 (< 1) | accuracy vs threshold 0.9 (>= 0) |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for t in targets(res):
            wall = ", ".join(f"{k} {v:.1f}x" for k, v in t["wall_speedup"].items())
            lines.append(f"| {t['model']} | {t['gen_len']} | {t['phone_speedup']:.1f}x | {t['npu_speedup']:.1f}x | "
                         f"{wall} | "
                         f"{t['accuracy_drop_points']:+.1f} | {t['nfe_vs_threshold']:.2f} | "
                         f"{t['accuracy_vs_threshold_points']:+.1f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for res in results:
        label = Path(res["model"]).name
        for gen, rows in res["gens"].items():
            if not all("accuracy" in r and "phone_ms" in r for r in rows.values()):
                continue
            names = list(rows)
            van = rows["CPU vanilla"]["phone_ms"]
            axes[0].plot(range(len(names)), [van / rows[n]["phone_ms"] for n in names], marker="o",
                         label=f"{label}, gen {gen}")
            axes[1].scatter([rows[n]["mean_nfe"] for n in names], [100 * rows[n]["accuracy"] for n in names],
                            label=f"{label}, gen {gen}")
            for n in names:
                axes[1].annotate(n.replace("+ ", ""), (rows[n]["mean_nfe"], 100 * rows[n]["accuracy"]),
                                 fontsize=6)
            axes[0].set_xticks(range(len(names)), [n.replace("+ ", "+") for n in names], rotation=35,
                               ha="right", fontsize=7)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("simulated phone speed-up over CPU vanilla")
    axes[0].axhline(17, ls="--", c="gray", lw=0.8)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("forwards per request")
    axes[1].set_ylabel("accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("llada.cpp techniques on the bucketed runtime")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], help="a model directory (repeatable)")
    ap.add_argument("--gens", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--tasks", nargs="+", default=sorted(TASKS), choices=sorted(TASKS))
    ap.add_argument("--n", type=int, default=200, help="held-out prompts per task (accuracy pass)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cases", type=int, default=5, help="prompts per task in the latency pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--executors", nargs="+", default=["jax", "litert"], choices=["jax", "litert"])
    ap.add_argument("--revisit", action="append", choices=["in_place", "remask"],
                    help="per --model: how filled tokens are scored (default remask, as the preset)")
    ap.add_argument("--sweep-gen", type=int, default=128, help="generation length of the sweeps (0: none)")
    ap.add_argument("--sweep-n", type=int, help="held-out prompts per task in the sweeps (default --n)")
    ap.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES,
                    help="what to run (the accuracy pass may run elsewhere; --combine merges)")
    ap.add_argument("--combine", type=Path, nargs="+", help="merge these result files instead of running")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.combine:
        results = combine(args.combine)
    else:
        if not args.model:
            ap.error("give --model (or --combine)")
        revisits = args.revisit or ["remask"] * len(args.model)
        if len(revisits) != len(args.model):
            ap.error("give --revisit once per --model, or not at all")
        results = []
        partial = args.out.with_suffix(".partial.json")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for m, rv in zip(args.model, revisits):
            results.append(run(m, args.gens, args.tasks, args.n, args.cases, args.repeats, args.executors, rv,
                               args.sweep_gen or None, args.batch, set(args.passes),
                               save=lambda r: atomic_write_json(partial, {"results": results + [r]}),
                               sweep_n=args.sweep_n))
        partial.unlink(missing_ok=True)
    doc = {"results": results, "targets": [t for r in results for t in targets(r)],
           "cost_model": {"npu": NPU.__dict__, "cpu": CPU.__dict__}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out.with_suffix(".json"), doc)
    atomic_write(args.out.with_suffix(".md"), markdown(results))
    plot(results, args.out.with_suffix(".png"))
    print(json.dumps(doc["targets"], indent=1))


if __name__ == "__main__":
    main()

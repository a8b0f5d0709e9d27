"""dlm-jax against the engines a user would pick instead, on one trained model and its task prompts.

    .venv/bin/python benchmarks/peers.py --model models/llada-12m --n 200 --out benchmarks/results/peers
    .venv/bin/python benchmarks/peers.py --build-llama-cpp       (builds llama.cpp's diffusion CLI, ~8 min)

Engines, all on the same weights, the same held-out task prompts (chat-formatted as the model
was trained), generation `--gen`, block 32, batch 1, 2 threads each:

  dlm-jax    presets and settings through `dlm_jax.load(executor="litert")` (what the default
             executor runs on a CPU once its bundle cache holds the buckets, fp32) and an int8 bundle (`dlm-jax export --quant int8`,
             `load_bundle`); every bucket warmed up before timing.
  fast-dllm  NVlabs/Fast-dLLM's released `llada/generate.py` and `modeling_llada.py` (PyTorch,
             float32), imported from `--peer-src` with the shims `benchmarks/gpu.py` lists, on the
             checkpoint converted with `dlm-jax convert --family llada`.
  llama.cpp  `llama-diffusion-cli` (`benchmarks/_llamacpp.py`: built from the llama-cpp-python
             sdist) on GGUF files written by `dlm-jax export --format gguf` (f32, q8_0, q4_0),
             LLaDA's block schedule with `--llama-steps` steps per block.

Two comparisons:
1. Best against best at equal accuracy: every setting's accuracy and mean time per answer on
   `--n` prompts per task; each engine's frontier in one plot. An engine's best is its fastest
   setting within 1 point of its most accurate one; dlm-jax's answer to it is dlm-jax's fastest
   setting at no more than 1 point below it. Ratio = its seconds / ours.
2. Identical work (`--same-n` prompts per task): llama.cpp's timestep schedule (one region, S
   steps, every step the whole prompt + generation) against dlm-jax's LLaDA decode with the
   same S steps over one block of the whole generation, no cache and no early stop: the same
   forwards over the same positions (tokens differ: llama.cpp samples, see `_llamacpp`).

Time per answer: dlm-jax and Fast-dLLM, the wall clock of the generate call; llama.cpp, the
CLI's own timer around its decode loop (its process start, model load and tokenisation are left
out, which favours it). Settings are timed interleaved, prompt by prompt, in rotating order
(this machine is noisy). Writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import _llamacpp  # noqa: E402
from _hardware import machine  # noqa: E402

CACHE = Path.home() / ".cache" / "dlm-jax"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    ids: list[int]  # chat-formatted, as every engine sees it
    example: Any  # dlm_jax.training.data.Example


@dataclasses.dataclass
class Setting:
    engine: str
    label: str
    run: Callable[[Example], tuple[str, float, int]]  # -> (completion, seconds, forwards)
    texts: list[str] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    forwards: list[int] = dataclasses.field(default_factory=list)
    correct: list[bool] = dataclasses.field(default_factory=list)
    setup_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"engine": self.engine, "setting": self.label, "n": len(self.correct),
                "accuracy": float(np.mean(self.correct)) if self.correct else None,
                "mean_seconds": float(np.mean(self.seconds)) if self.seconds else None,
                "median_seconds": float(np.median(self.seconds)) if self.seconds else None,
                "max_seconds": float(np.max(self.seconds)) if self.seconds else None,
                "mean_forwards": float(np.mean(self.forwards)) if self.forwards else None,
                "setup_seconds": round(self.setup_seconds, 1)}


def examples(model_dir: Path, n: int) -> list[Example]:
    import dlm_jax
    from dlm_jax.training.data import TASKS, make_split

    tok = dlm_jax.load_tokenizer(model_dir)
    out = []
    for task in TASKS:
        for ex in make_split(TASKS[task], n, split="heldout"):
            out.append(Example(task, ex.prompt, tok.apply_chat([{"role": "user", "content": ex.prompt}]), ex))
    return out


def score(ex: Example, text: str) -> bool:
    from dlm_jax.training.data import TASKS

    return bool(TASKS[ex.task].score(text, ex.example))


# --- dlm-jax ---------------------------------------------------------------------------------

def dlm_settings(model_dir: Path, exs: list[Example], gen: int, work: Path, *, int8: bool) -> list[Setting]:
    import dlm_jax
    from dlm_jax.executors.runner import load_bundle
    from dlm_jax.runtime.registry import preset
    from dlm_jax.tflite_export.bundle import buckets_for_prompts, export_bundle

    configs = {
        "fast-dllm preset (prefix, threshold 0.9)": preset("fast-dllm", gen_len=gen),
        "dual, threshold 0.9": preset("fast-dllm-dual", gen_len=gen),
        "dual, threshold 0.7": preset("fast-dllm-dual", gen_len=gen, threshold=0.7),
        "llada-cpp preset": preset("llada-cpp", gen_len=gen),
    }
    lengths = sorted({len(e.ids) for e in exs})
    t0 = time.perf_counter()
    handle = dlm_jax.load(model_dir, executor="litert")  # what the default runs once its buckets are cached
    for cfg in configs.values():
        for n in lengths:  # batch 1: one prompt length at a time
            handle.decoder.warmup([n], cfg)
    handles = {label: (handle, cfg) for label, cfg in configs.items()}
    setup = {label: time.perf_counter() - t0 for label in configs}
    if int8:
        q_configs = {f"{label}, int8 bundle": configs[label] for label in ("dual, threshold 0.9", "dual, threshold 0.7")}
        path = work / f"{model_dir.name}-int8"
        t0 = time.perf_counter()
        if not (path / "bundle.json").exists():
            keys = sorted({k for cfg in q_configs.values()
                           for k in buckets_for_prompts(handle.config, cfg, max_prompt=max(lengths))})
            log(f"dlm-jax: exporting an int8 bundle of {len(keys)} buckets")
            export_bundle(model_dir, path, keys=keys, decode=configs["dual, threshold 0.9"], quant="int8",
                          latency_repeats=0, plan=False)
        q_handle = load_bundle(path)
        for cfg in q_configs.values():
            for n in lengths:
                q_handle.decoder.warmup([n], cfg)
        handles.update({label: (q_handle, cfg) for label, cfg in q_configs.items()})
        setup.update({label: time.perf_counter() - t0 for label in q_configs})

    return [Setting("dlm-jax", label, timed(h, cfg), setup_seconds=setup[label]) for label, (h, cfg) in handles.items()]


def timed(handle, cfg) -> Callable[[Example], tuple[str, float, int]]:
    """One dlm-jax answer: (completion, wall seconds of `generate`, forwards)."""
    def run(ex: Example) -> tuple[str, float, int]:
        t = time.perf_counter()
        res = handle.generate([ex.ids], cfg)
        return res.texts[0], time.perf_counter() - t, int(res.stats.request_nfe[0])
    return run


def dlm_same_work(model_dir: Path, exs: list[Example], gen: int, steps: int) -> Setting:
    """LLaDA's decode: one block of `gen`, `steps` steps, no cache, no early stop."""
    import dlm_jax
    from dlm_jax.runtime.registry import preset

    cfg = preset("llada", gen_len=gen, block_len=gen, steps=steps, stop_on_eos_block=False)
    handle = dlm_jax.load(model_dir, executor="litert")
    for n in sorted({len(e.ids) for e in exs}):
        handle.decoder.warmup([n], cfg)
    return Setting("dlm-jax", f"none, top-k, 1 block, {steps} steps", timed(handle, cfg))


# --- Fast-dLLM --------------------------------------------------------------------------------

def fast_dllm_settings(model_dir: Path, gen: int, block: int, work: Path, peer_src: Path) -> list[Setting]:
    import torch

    import dlm_jax
    from gpu import load_peer, loaded

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    converted = work / f"{model_dir.name}-llada"
    if not (converted / "config.json").exists():
        from dlm_jax.checkpoint._io import convert_checkpoint

        convert_checkpoint(model_dir, converted, family="llada")
    peer = load_peer(peer_src, device="cpu")
    model = loaded(peer, peer.model_class.from_pretrained(converted, torch_dtype=torch.float32))
    mask_id = dlm_jax.load_config(model_dir)[0].mask_token_id
    tok = dlm_jax.load_tokenizer(model_dir)
    setup = time.perf_counter() - t0

    def runner(cache: str, threshold: float):
        fn = peer.generator(cache)

        def run(ex: Example) -> tuple[str, float, int]:
            x = torch.tensor([ex.ids])
            t = time.perf_counter()
            with torch.no_grad():
                out, nfe = fn(model, x, steps=gen, gen_length=gen, block_length=block, temperature=0.0,
                              remasking="low_confidence", mask_id=mask_id, threshold=threshold)
            seconds = time.perf_counter() - t
            ids = out[0, len(ex.ids):].tolist()
            if tok.eos_id in ids:
                ids = ids[:ids.index(tok.eos_id)]
            return tok.decode(ids), seconds, int(nfe)
        return run

    return [Setting("fast-dllm", f"{cache}, threshold {th}", runner(cache, th), setup_seconds=setup)
            for cache, th in (("prefix", 0.9), ("dual", 0.9), ("dual", 0.7))]


# --- llama.cpp --------------------------------------------------------------------------------

def gguf_files(model_dir: Path, quants: list[str], work: Path) -> dict[str, Path]:
    from dlm_jax.tflite_export.gguf import export_gguf

    out = {}
    for q in quants:
        path = work / f"{model_dir.name}-{q}.gguf"
        if not path.exists():
            export_gguf(model_dir, path, quant=q)
        out[q] = path
    return out


def llama_settings(binary: Path, files: dict[str, Path], gen: int, block: int, steps: list[int]) -> list[Setting]:
    def runner(path: Path, spb: int):
        def run(ex: Example) -> tuple[str, float, int]:
            shape = _llamacpp.RunShape(len(ex.ids), gen, block, spb)
            r = _llamacpp.diffuse(binary, path, ex.prompt, shape)
            return r.text, r.total_ms / 1000, shape.steps
        return run

    return [Setting("llama.cpp", f"{q}, {spb} steps/block", runner(path, spb))
            for q, path in files.items() for spb in steps]


def llama_same_work(binary: Path, path: Path, gen: int, steps: int) -> Setting:
    def run(ex: Example) -> tuple[str, float, int]:
        shape = _llamacpp.RunShape(len(ex.ids), gen, 0, steps)
        r = _llamacpp.diffuse(binary, path, ex.prompt, shape)
        return r.text, r.total_ms / 1000, steps
    return Setting("llama.cpp", f"f32, timestep schedule, {steps} steps", run)


# --- running, reporting -----------------------------------------------------------------------

def run_interleaved(settings: list[Setting], exs: list[Example], what: str) -> None:
    for i, ex in enumerate(exs):
        order = settings[i % len(settings):] + settings[:i % len(settings)]
        for s in order:
            text, seconds, forwards = s.run(ex)
            s.texts.append(text)
            s.seconds.append(seconds)
            s.forwards.append(forwards)
            s.correct.append(score(ex, text))
        if (i + 1) % 10 == 0 or i + 1 == len(exs):
            log(f"{what}: {i + 1}/{len(exs)} prompts")


def best(rows: list[dict], engine: str) -> dict | None:
    """An engine's fastest setting within 1 point of its most accurate one."""
    mine = [r for r in rows if r["engine"] == engine]
    if not mine:
        return None
    top = max(r["accuracy"] for r in mine)
    return min((r for r in mine if r["accuracy"] >= top - 0.01 - 1e-9), key=lambda r: r["mean_seconds"])


def answer_to(rows: list[dict], peer: dict) -> dict | None:
    """dlm-jax's fastest setting at no more than 1 point below `peer`'s accuracy."""
    ours = [r for r in rows if r["engine"] == "dlm-jax" and r["accuracy"] >= peer["accuracy"] - 0.01 - 1e-9]
    return min(ours, key=lambda r: r["mean_seconds"]) if ours else None


def report(result: dict, out: Path) -> None:
    from dlm_jax._integrity import atomic_write, atomic_write_json

    rows = result["settings"]
    lines = ["# dlm-jax against its peers", "",
             f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores. Model {result['model']}, "
             f"{result['n_per_task']} held-out prompts per task ({result['n_prompts']} in all), generation "
             f"{result['gen']}, block {result['block']}, batch 1, 2 threads per engine.", "",
             "## Every setting", "",
             "| engine | setting | accuracy | mean s / answer | median s | max s | forwards | setup s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["engine"], r["mean_seconds"])):
        lines.append(f"| {r['engine']} | {r['setting']} | {100 * r['accuracy']:.1f}% | {r['mean_seconds']:.4f} | "
                     f"{r['median_seconds']:.4f} | {r['max_seconds']:.3f} | {r['mean_forwards']:.1f} | "
                     f"{r['setup_seconds']} |")
    lines += ["", "## Best against best at equal accuracy", "",
              "| peer | peer's best | its accuracy | its s | dlm-jax's answer | accuracy | s | peer s / dlm-jax s |",
              "|---|---|---|---|---|---|---|---|"]
    for c in result["best_vs_best"]:
        lines.append(f"| {c['peer']} | {c['peer_setting']} | {100 * c['peer_accuracy']:.1f}% | {c['peer_seconds']:.4f} | "
                     f"{c['ours_setting']} | {100 * c['ours_accuracy']:.1f}% | {c['ours_seconds']:.4f} | "
                     f"**{c['ratio']:.2f}** |")
    if result.get("same_work"):
        sw = result["same_work"]
        lines += ["", f"## Identical work ({sw['n']} prompts: {sw['steps']} steps over prompt + {result['gen']} "
                  "positions each)", "", "| engine | setting | accuracy | mean s / answer | ms / forward |",
                  "|---|---|---|---|---|"]
        for r in sw["settings"]:
            lines.append(f"| {r['engine']} | {r['setting']} | {100 * r['accuracy']:.1f}% | {r['mean_seconds']:.4f} | "
                         f"{1000 * r['mean_seconds'] / r['mean_forwards']:.2f} |")
        lines.append(f"\nllama.cpp s / dlm-jax s: **{sw['ratio']:.2f}**")
    lines += ["", f"Targets: {json.dumps(result['targets'])}", ""]
    atomic_write(out.with_suffix(".md"), "\n".join(lines))
    atomic_write_json(out.with_suffix(".json"), result)
    plot(rows, out.with_suffix(".png"), result)


def plot(rows: list[dict], path: Path, result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for engine, color in (("dlm-jax", "tab:blue"), ("fast-dllm", "tab:orange"), ("llama.cpp", "tab:green")):
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["mean_seconds"])
        if not mine:
            continue
        ax.scatter([r["mean_seconds"] for r in mine], [100 * r["accuracy"] for r in mine], color=color, label=engine)
        frontier, top = [], -1.0
        for r in mine:  # the accuracy / time frontier: each point beats every faster one
            if r["accuracy"] > top:
                frontier.append(r)
                top = r["accuracy"]
        ax.plot([r["mean_seconds"] for r in frontier], [100 * r["accuracy"] for r in frontier], color=color)
        ends = [frontier[0]] + ([frontier[-1]] if len(frontier) > 1 else [])
        for k, r in enumerate(ends):  # the frontier's fastest and most accurate named (the rest: the table)
            ax.annotate(r["setting"], (r["mean_seconds"], 100 * r["accuracy"]), fontsize=7, color=color,
                        xytext=(0, -14 - 10 * k), textcoords="offset points", ha="center")
    ax.set_xscale("log")
    ax.set_xlabel("mean seconds per answer (batch 1, log scale)")
    ax.set_ylabel("accuracy, %")
    ax.set_title(f"{result['model']}: accuracy against time, {result['n_prompts']} prompts, gen {result['gen']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=HERE.parent / "models" / "llada-12m")
    p.add_argument("--n", type=int, default=200, help="held-out prompts per task")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--engines", nargs="+", default=["dlm-jax", "fast-dllm", "llama.cpp"])
    p.add_argument("--llama-quants", nargs="+", default=["f32", "q8_0", "q4_0"])
    p.add_argument("--llama-steps", type=int, nargs="+", default=[16, 8, 4], help="steps per block")
    p.add_argument("--same-n", type=int, default=5, help="prompts per task for the identical-work comparison (0: off)")
    p.add_argument("--no-int8", action="store_true", help="leave out dlm-jax's int8 bundle")
    p.add_argument("--peer-src", type=Path, default=CACHE / "peers" / "Fast-dLLM", help="a checkout of NVlabs/Fast-dLLM")
    p.add_argument("--work", type=Path, default=CACHE / "peers-work", help="converted checkpoints, GGUF files, bundles")
    p.add_argument("--build-llama-cpp", action="store_true", help="build llama-diffusion-cli (if needed) and exit")
    p.add_argument("--out", type=Path)
    p.add_argument("--replot", action="store_true", help="redraw <out>.md and <out>.png from <out>.json")
    args = p.parse_args(argv)
    if args.replot:
        report(json.loads(args.out.with_suffix(".json").read_text()), args.out)
        return 0
    if args.build_llama_cpp:
        print(_llamacpp.build(log=log))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    exs = examples(args.model, args.n)
    log(f"{len(exs)} prompts, {len(set(len(e.ids) for e in exs))} prompt lengths")
    binary = _llamacpp.built_binary()
    if "llama.cpp" in args.engines and binary is None:
        raise SystemExit("error: llama-diffusion-cli is not built: run benchmarks/peers.py --build-llama-cpp")

    settings: list[Setting] = []
    if "dlm-jax" in args.engines:
        settings += dlm_settings(args.model, exs, args.gen, args.work, int8=not args.no_int8)
    if "fast-dllm" in args.engines:
        settings += fast_dllm_settings(args.model, args.gen, args.block, args.work, args.peer_src)
    files = gguf_files(args.model, args.llama_quants, args.work) if "llama.cpp" in args.engines else {}
    if files:
        settings += llama_settings(binary, files, args.gen, args.block, args.llama_steps)
    log(f"{len(settings)} settings set up; timing")
    run_interleaved(settings, exs, "frontier")
    rows = [s.summary() for s in settings]

    comparisons = []
    for peer in ("fast-dllm", "llama.cpp"):
        pb = best(rows, peer)
        ours = answer_to(rows, pb) if pb else None
        if pb and ours:
            comparisons.append({"peer": peer, "peer_setting": pb["setting"], "peer_accuracy": pb["accuracy"],
                                "peer_seconds": pb["mean_seconds"], "ours_setting": ours["setting"],
                                "ours_accuracy": ours["accuracy"], "ours_seconds": ours["mean_seconds"],
                                "ratio": pb["mean_seconds"] / ours["mean_seconds"]})
    same = None
    if args.same_n and binary is not None and "f32" in files:
        per_task = {}
        for e in exs:
            per_task.setdefault(e.task, [])
            if len(per_task[e.task]) < args.same_n:
                per_task[e.task].append(e)
        sub = [e for v in per_task.values() for e in v]
        pair = [dlm_same_work(args.model, sub, args.gen, args.gen), llama_same_work(binary, files["f32"], args.gen,
                                                                                    args.gen)]
        run_interleaved(pair, sub, "identical work")
        same_rows = [s.summary() for s in pair]
        same = {"n": len(sub), "steps": args.gen, "settings": same_rows,
                "ratio": same_rows[1]["mean_seconds"] / same_rows[0]["mean_seconds"]}
    targets = {f"best_vs_best_{c['peer']}": round(c["ratio"], 2) for c in comparisons}
    targets.update({"fast-dllm_at_least_3x": any(c["peer"] == "fast-dllm" and c["ratio"] >= 3 for c in comparisons),
                    "llama.cpp_at_least_1.5x": any(c["peer"] == "llama.cpp" and c["ratio"] >= 1.5
                                                   for c in comparisons)})
    if same:
        targets["same_work_llama.cpp_over_dlm-jax"] = round(same["ratio"], 2)
    result = {"machine": machine(), "model": args.model.name, "n_per_task": args.n, "n_prompts": len(exs),
              "gen": args.gen, "block": args.block, "llama_cpp": {"version": f"llama-cpp-python {_llamacpp.VERSION}",
                                                                 "binary": str(binary) if binary else None},
              "settings": rows, "best_vs_best": comparisons, "same_work": same, "targets": targets,
              "samples": {s.label: s.texts[:3] for s in settings}}
    print(json.dumps({"targets": targets, "settings": rows}, indent=1))
    if args.out:
        report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

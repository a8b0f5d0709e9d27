"""dlm-jax against its PyTorch peer on the same weights, prompts and settings.

    .venv/bin/python benchmarks/peer.py --out benchmarks/results/peer     (needs the test extra: torch)

Every case decodes the same prompts (batch 1 or 4, all of one length) with block 32,
threshold 0.9, temperature 0, generation 128 or 256, cache none / prefix / dual, through:

  jax      the JAX executor (`dlm_jax.load(path, executor="jax")`)
  litert   the LiteRT runner on an fp32 bundle exported here (`dlm_jax.executors.runner.load_bundle`): what
           `generate` and the API run by default on a CPU, over their bundle cache
  torch    the eager PyTorch peer (`benchmarks/torch_decoder.py`, 2 threads)

Each executor runs in a process of its own, as a user runs one engine: on 2 cores the
thread pools of the others (torch's OpenMP, XNNPACK's) slowed XLA's decodes when all three shared
a process (the 29M prefix case: 14.5 s shared, 9.6 s alone, same warm-up). Per case, each executor builds its buckets (`Decoder.warmup`) and
decodes the case once, untimed (a first decode also pays allocations: 7.2 s against 5.5 s for
the 29M prefix case); then the decodes are timed in rotating order (this machine is noisy, so
only ratios measured in one run are reported; a decode under a second is repeated). Compile
and export times are reported apart. The benchmark
checks that every executor returns the same tokens and NFE as the peer. Ratios are
torch seconds / dlm-jax seconds (above 1: dlm-jax is faster). Peak RSS of one cold decode
(prefix cache, the shortest generation, batch 1) is measured per executor in a fresh process.
Writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _hardware import gemm_peak, machine, memory_bandwidth  # noqa: E402
from _models import MODELS, model_path, prompts_for  # noqa: E402

EXECUTORS = ("jax", "litert", "torch")
MODES = ("none", "prefix", "dual")
BLOCK = 32
THRESHOLD = 0.9
MIN_SECONDS, MAX_REPS = 3.0, 7
# Left out by default to keep a run near an hour here: batch 4 at generation 256, and the
# 154M model's cache-less decodes past batch 1 / generation 128.
DEFAULT_SKIP = tuple(f"{m} {mode} 256 b4" for m in MODELS for mode in ("none", "prefix", "dual")) + (
    "random-154m none 256", "random-154m none 128 b4")
# Exporting the 154M model takes about a minute per bucket here; left out by default.
DEFAULT_NO_LITERT = ("random-154m",)
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def decode_config(gen: int, mode: str):
    import dlm_jax

    return dlm_jax.decode_config(gen_len=gen, block_len=BLOCK, cache=mode, rule="threshold", threshold=THRESHOLD)


def case_name(model: str, mode: str, gen: int, batch: int) -> str:
    return f"{model} {mode} {gen}" + (f" b{batch}" if batch != 1 else "")


class Executors:
    """The three decoders of one model, each in a worker process of its own (`serve`):
    decode(kind, prompts, gen, mode) -> (sequences, nfe), timed inside the worker. The JAX
    model loaded here only lists buckets, exports the bundle and picks the prompts."""

    def __init__(self, name: str, path: Path, cases: list[tuple[int, int, str]], tmp: Path, litert: bool):
        import dlm_jax

        self.name = name
        self.jax = dlm_jax.load(path, executor="jax")
        self.export_seconds = None
        self.bundle_path = None
        if litert:
            from dlm_jax.tflite_export.bundle import export_bundle

            keys = sorted({k for batch, gen, mode in cases
                           for k in self.jax.decoder.bucket_keys([len(prompts_for(name, self.jax, 1)[0])] * batch,
                                                                 decode_config(gen, mode))})
            log(f"{name}: exporting {len(keys)} buckets to an fp32 bundle")
            t0 = time.perf_counter()
            export_bundle(path, tmp / f"{name}.bundle", keys=keys, decode=decode_config(128, "prefix"),
                          latency_repeats=1, overwrite=True)
            self.export_seconds = round(time.perf_counter() - t0, 1)
            self.bundle_path = tmp / f"{name}.bundle"
        self.kinds = [k for k in EXECUTORS if k != "litert" or self.bundle_path is not None]
        self.workers = {k: Worker(k, self.bundle_path if k == "litert" else path, name) for k in self.kinds}

    def prepare(self, kind: str, prompts: list[list[int]], gen: int, mode: str) -> float:
        """Build every bucket of the case (`Decoder.warmup`) and decode it once, untimed; the
        build's seconds."""
        return self.workers[kind].ask(op="prepare", prompts=prompts, gen=gen, mode=mode)["seconds"]

    def decode(self, kind: str, prompts: list[list[int]], gen: int, mode: str) -> dict[str, Any]:
        """One timed decode: {"sequences", "nfe", "seconds", "built" (buckets compiled or
        exported inside it)}."""
        return self.workers[kind].ask(op="decode", prompts=prompts, gen=gen, mode=mode)

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


class Worker:
    """One executor in its own process (`peer.py --serve KIND PATH NAME`), one JSON line per request."""

    def __init__(self, kind: str, path: Path, name: str):
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(path), name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, **request: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.kind} worker exited with status {self.proc.wait()} (its log is above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.kind} worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def serve(kind: str, path: str, name: str) -> None:
    """A worker: load one executor, then answer `prepare` / `decode` requests from stdin."""
    import os

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, not into the replies
    import dlm_jax

    if kind == "litert":
        from dlm_jax.executors.runner import load_bundle

        handle = load_bundle(path)
    else:
        handle = dlm_jax.load(path, executor="jax")
        if kind == "torch":
            from torch_decoder import TorchModel

            model = TorchModel(dlm_jax.get_params(handle.model), handle.config, threads=2)
            del handle

    def run(req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        if kind == "torch":
            from torch_decoder import decode

            seqs, nfe = decode(model, req["prompts"], gen_len=req["gen"], block_len=BLOCK, mode=req["mode"],
                               rule="threshold", threshold=THRESHOLD)
            built = 0
        else:
            res = handle.decoder.decode(req["prompts"], decode_config(req["gen"], req["mode"]))
            seqs, nfe, built = res.sequences, res.stats.nfe, res.stats.compiles + res.stats.exports
        return {"seconds": time.perf_counter() - t0, "nfe": int(nfe), "built": int(built),
                "sequences": [np.asarray(x).tolist() for x in seqs]}

    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "prepare":
                reply = {"seconds": 0.0}
                if kind != "torch":
                    t0 = time.perf_counter()
                    # the decoder's warm-up: with the decode's slot count, so the executor's
                    # resident-state programs are built too (its own warmup(keys) left 6 to the decode)
                    handle.decoder.warmup([len(p) for p in req["prompts"]], decode_config(req["gen"], req["mode"]))
                    reply["seconds"] = time.perf_counter() - t0
                run(req)  # one untimed decode: a first decode also pays allocations
            else:
                reply = run(req)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which stops
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")


def run_case(ex: Executors, batch: int, gen: int, mode: str, reps: int) -> dict[str, Any]:
    prompts = prompts_for(ex.name, ex.jax, batch)
    compile_s = {k: round(ex.prepare(k, prompts, gen, mode), 2) for k in ex.kinds}
    seconds = {k: [] for k in ex.kinds}
    built = {k: 0 for k in ex.kinds}
    results = {}
    i = 0
    # Short decodes repeat (up to MIN_SECONDS of the slowest, at most MAX_REPS times): one
    # tenth-of-a-second decode says little on this machine.
    while i < reps or (i < MAX_REPS and sum(seconds["torch"]) < MIN_SECONDS):
        order = ex.kinds[i % len(ex.kinds):] + ex.kinds[:i % len(ex.kinds)]
        for kind in order:
            r = ex.decode(kind, prompts, gen, mode)
            results[kind] = ([np.asarray(x) for x in r["sequences"]], r["nfe"])
            seconds[kind].append(r["seconds"])
            built[kind] += r["built"]
        i += 1
    ref_seqs, ref_nfe = results["torch"]
    med = {k: float(np.median(v)) for k, v in seconds.items()}
    return {"model": ex.name, "batch": batch, "gen_len": gen, "mode": mode, "reps": i,
            "prompt_len": len(prompts[0]), "seconds": {k: round(v, 4) for k, v in med.items()},
            "all_seconds": {k: [round(s, 4) for s in v] for k, v in seconds.items()},
            "compile_seconds": compile_s, "built_while_timed": built, "nfe": {k: results[k][1] for k in ex.kinds},
            "same_tokens_as_torch": {k: all(np.array_equal(a, b) for a, b in zip(results[k][0], ref_seqs))
                                     for k in ex.kinds if k != "torch"},
            "same_nfe_as_torch": {k: results[k][1] == ref_nfe for k in ex.kinds if k != "torch"},
            "torch_over": {k: round(med["torch"] / med[k], 3) for k in ex.kinds if k != "torch"},
            "ms_per_nfe": {k: round(med[k] * 1e3 / results[k][1], 2) for k in ex.kinds}}


# ---------------------------------------------------------------------------------------------
# Peak memory, one fresh process per executor


def child(kind: str, path: str, name: str, gen: str) -> dict[str, Any]:
    """Runs in a fresh process: load, decode one prefix-cache case (batch 1) once."""
    import dlm_jax

    gen = int(gen)

    t0 = time.perf_counter()
    if kind == "litert":
        from dlm_jax.executors.runner import load_bundle

        handle = load_bundle(path)
        prompts = prompts_for(name, handle, 1)
        seqs = handle.decoder.decode(prompts, decode_config(gen, "prefix")).stats.nfe
    else:
        handle = dlm_jax.load(path, executor="jax")
        prompts = prompts_for(name, handle, 1)
        if kind == "jax":
            seqs = handle.decoder.decode(prompts, decode_config(gen, "prefix")).stats.nfe
        else:
            from torch_decoder import TorchModel, decode

            model = TorchModel(dlm_jax.get_params(handle.model), handle.config)
            del handle
            seqs = decode(model, prompts, gen_len=gen, mode="prefix", threshold=THRESHOLD)[1]
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "cold_seconds": round(time.perf_counter() - t0, 2), "nfe": seqs}


def peak_memory(ex: Executors, path: Path, gen: int, spawner: Any) -> dict[str, Any]:
    out = {}
    for kind in ex.kinds:
        target = str(ex.bundle_path) if kind == "litert" else str(path)
        rc, stdout, stderr = spawner.run([sys.executable, __file__, "--child", kind, target, ex.name, str(gen)])
        if rc != 0:
            raise RuntimeError(f"{ex.name} {kind} memory child failed:\n{stderr[-3000:]}")
        out[kind] = json.loads(stdout.strip().splitlines()[-1])
        log(f"  peak RSS {kind}: {out[kind]['peak_rss_mb']:.0f} MB (cold decode {out[kind]['cold_seconds']:.1f} s)")
    return out


# ---------------------------------------------------------------------------------------------
# Report


def markdown(report: dict[str, Any]) -> str:
    lines = ["# dlm-jax against the PyTorch peer", "",
             f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores; GEMM peak "
             f"{report['gemm']['gflops']} GFLOP/s; torch {report['torch']} ({report['torch_threads']} threads).", "",
             "Ratio = peer seconds / dlm-jax seconds (above 1: dlm-jax faster). Block 32, threshold 0.9, greedy.", "",
             "| case | NFE | torch s | jax s | litert s | torch/jax | torch/litert | same tokens | jax compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        s, r = c["seconds"], c["torch_over"]
        same = all(c["same_tokens_as_torch"].values()) and all(c["same_nfe_as_torch"].values())
        lines.append(f"| {case_name(c['model'], c['mode'], c['gen_len'], c['batch'])} | {c['nfe']['torch']} | "
                     f"{s['torch']:.2f} | {s['jax']:.2f} | {s.get('litert', float('nan')):.2f} | {r['jax']:.2f} | "
                     f"{r.get('litert', float('nan')):.2f} | {'yes' if same else 'NO'} | {c['compile_seconds']['jax']} |")
    lines += ["", "| model | params | export s (litert) | peak RSS MB jax / litert / torch |", "|---|---|---|---|"]
    for m in report["models"]:
        mem = m.get("peak_rss_mb", {})
        lines.append(f"| {m['model']} | {m['params'] / 1e6:.1f}M | {m['export_seconds']} | "
                     + " / ".join(str(mem.get(k, "-")) for k in EXECUTORS) + " |")
    lines += ["", "Targets: " + json.dumps(report["targets"])]
    return "\n".join(lines) + "\n"


def targets(cases: list[dict]) -> dict[str, Any]:
    """The issue's targets, as measured: dlm-jax >= 1.5x the peer (goal 3x) for prefix and dual
    caches on the 29M and 154M models at batch 1 and 4; no case slower than the peer."""
    big = [c for c in cases if c["model"] != "llada-tiny" and c["mode"] in ("prefix", "dual")]
    best = lambda c: max(c["torch_over"].values())  # noqa: E731
    return {"cached_big_min_ratio_best_executor": round(min(map(best, big)), 3) if big else None,
            "cached_big_at_least_1.5x": all(best(c) >= 1.5 for c in big) if big else None,
            "jax_min_ratio": round(min(c["torch_over"]["jax"] for c in cases), 3),
            "no_case_slower_jax": all(c["torch_over"]["jax"] >= 1.0 for c in cases),
            "no_case_slower_best_executor": all(best(c) >= 1.0 for c in cases),
            "all_tokens_and_nfe_equal": all(all(c["same_tokens_as_torch"].values()) and all(c["same_nfe_as_torch"].values())
                                            for c in cases)}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    labels = [case_name(c["model"], c["mode"], c["gen_len"], c["batch"]) for c in cases]
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(cases)), 5))
    x = np.arange(len(cases))
    for i, kind in enumerate(("jax", "litert")):
        vals = [c["torch_over"].get(kind, np.nan) for c in cases]
        ax.bar(x + (i - 0.5) * 0.4, vals, 0.4, label=f"{kind} (PyTorch s / {kind} s)")
    ax.axhline(1.0, color="k", lw=1)
    ax.axhline(1.5, color="gray", lw=1, ls="--", label="1.5x target")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_ylabel("speed-up over the PyTorch peer")
    ax.set_title("dlm-jax vs eager PyTorch, same weights and decoder (block 32, threshold 0.9)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    p.add_argument("--gens", nargs="+", type=int, default=[128, 256])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--reps", type=int, default=1, help="timed decodes per executor and case")
    p.add_argument("--skip", nargs="*", default=list(DEFAULT_SKIP), help='cases left out, e.g. "random-154m none 256"')
    p.add_argument("--no-litert", nargs="*", default=list(DEFAULT_NO_LITERT), choices=MODELS, help="models measured without a bundle")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS children")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/peer"))
    p.add_argument("--update", action="store_true",
                   help="merge into the report at --out: replace the cases and models measured now, keep the rest")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return {}
    if args.serve:
        serve(*args.serve)
        return {}
    from runner import Spawner  # started before anything large is loaded (ru_maxrss is inherited)

    spawner = None if args.no_memory else Spawner()
    import torch

    import dlm_jax

    report: dict[str, Any] = {"machine": machine(), "gemm": gemm_peak(), "bandwidth": memory_bandwidth(),
                              "torch": torch.__version__, "torch_threads": 2, "jax": __import__("jax").__version__,
                              "models": [], "cases": []}
    log(f"GEMM {report['gemm']}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        workdir = args.workdir or tmp
        for name in args.models:
            path = model_path(name, workdir)
            cases = [(b, g, m) for b in args.batches for g in args.gens for m in args.modes
                     if case_name(name, m, g, b) not in args.skip]
            ex = Executors(name, path, cases, tmp, litert=name not in args.no_litert)
            entry = {"model": name, "params": dlm_jax.param_count(ex.jax.model), "export_seconds": ex.export_seconds}
            reps = args.reps
            for batch, gen, mode in cases:
                c = run_case(ex, batch, gen, mode, reps)
                report["cases"].append(c)
                log(f"{case_name(name, mode, gen, batch)}: NFE {c['nfe']['torch']}, seconds {c['seconds']}, "
                    f"torch/x {c['torch_over']}, same tokens {c['same_tokens_as_torch']}")
            ex.close()
            if spawner is not None:
                entry["peak_rss_mb"] = {k: v["peak_rss_mb"] for k, v in peak_memory(ex, path, min(args.gens), spawner).items()}
            report["models"].append(entry)
            del ex
    if spawner is not None:
        spawner.close()
    if args.update and args.out.with_suffix(".json").exists():
        old = json.loads(args.out.with_suffix(".json").read_text())
        ran = {m["model"] for m in report["models"]}
        report["models"] = [m for m in old["models"] if m["model"] not in ran] + report["models"]
        report["cases"] = [c for c in old["cases"] if c["model"] not in ran] + report["cases"]
        order = {m: i for i, m in enumerate(MODELS)}
        report["models"].sort(key=lambda m: order[m["model"]])
        report["cases"].sort(key=lambda c: order[c["model"]])
    report["targets"] = targets(report["cases"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps(report["targets"]))
    return report


if __name__ == "__main__":
    main()

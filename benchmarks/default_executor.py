"""`dlm-jax generate` end to end: the default executor against `--executor jax`.

    .venv/bin/python benchmarks/default_executor.py --out benchmarks/results/default_executor

On a CPU the default (`--executor auto`) decodes with JAX while a background process exports
the decode's buckets into the bundle cache, and with the LiteRT runner once they are cached;
later processes open the cached bundle. The JAX executor compiles each bucket instead, kept
across processes by the persistent XLA cache. After the first (cold) runs the benchmark waits
for that background export to finish and reports its duration.
Each case (model x cache mode; generation 128, batch 1, block 32, threshold 0.9) runs the
command in fresh processes, both executors on empty caches of their own first (the cold run:
export vs compilation), then `--warm` more runs each, alternating. Reported per executor: the
command's wall time, cold and warm (median), the decode seconds it prints (median), its peak
RSS and NFE; tokens must be equal. Ratios are JAX / default (above 1: the default is faster).
Writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _hardware import machine  # noqa: E402
from _models import MODELS, model_path, prompts_for  # noqa: E402

BIN = Path(sys.executable).parent
EXECUTORS = ("jax", "auto")
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def generate(model: Path, prompt: list[int], cache: str, gen: int, executor: str, env: dict[str, str]) -> dict:
    """One `dlm-jax generate` process: wall seconds, its stats line and its completion."""
    cmd = [str(BIN / "dlm-jax"), "generate", "--model", str(model), "--prompt-ids", " ".join(map(str, prompt)),
           "--raw", "--cache", cache, "--gen", str(gen), "--block", "32", "--threshold", "0.9"]
    if executor != "auto":
        cmd += ["--executor", executor]
    t0 = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    return {"wall": wall, "stats": stats, "completion": result.stdout}


def wait_for_background(bundles: Path, timeout: float = 3600) -> float | None:
    """Wait for the background export a first run started (its log says "done:"); its seconds."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        logs = list(bundles.glob("*.export.log"))
        text = "".join(p.read_text() for p in logs)
        if "error" in text.lower():
            raise SystemExit(f"the background export failed:\n{text[-2000:]}")
        if logs and "done:" in text:
            m = [line for line in text.splitlines() if "done:" in line][-1]
            return float(m.rsplit(" in ", 1)[1].split()[0])
        if not logs and time.perf_counter() - t0 > 30:
            return None  # nothing was started (the buckets were cached already)
        time.sleep(1)
    raise SystemExit(f"the background export in {bundles} did not finish in {timeout:.0f} s")


def ids_only(name: str, path: Path, workdir: Path) -> Path:
    """A random model's checkpoint without its tokenizer: the random models carry the shipped
    byte tokenizer, which cannot spell their outputs (ids up to 4096), so `generate` prints ids."""
    import shutil

    bare = workdir / f"{name}-ids"
    if not (bare / "model.safetensors").exists():
        bare.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy2(path / f, bare / f)
    return bare


def run_case(model_name: str, path: Path, prompt: list[int], cache: str, gen: int, warm: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        envs = {}
        for ex in EXECUTORS:
            env = {k: v for k, v in os.environ.items() if k != "DLM_JAX_EXECUTOR"}
            env["DLM_JAX_CACHE_DIR"] = str(Path(tmp) / ex / "xla")
            env["DLM_JAX_BUNDLE_CACHE"] = str(Path(tmp) / ex / "bundles")
            envs[ex] = env
        runs: dict[str, list[dict]] = {ex: [] for ex in EXECUTORS}
        background = None
        for i in range(warm + 1):
            for ex in (EXECUTORS if i % 2 == 0 else EXECUTORS[::-1]):
                r = generate(path, prompt, cache, gen, ex, envs[ex])
                runs[ex].append(r)
                log(f"{model_name} {cache} {ex} {'cold' if i == 0 else f'warm {i}'}: {r['wall']:.2f} s "
                    f"(decode {r['stats']['seconds']:.3f} s)")
            if i == 0:  # the default's first run left a background export: later runs use what it wrote
                background = wait_for_background(Path(envs["auto"]["DLM_JAX_BUNDLE_CACHE"]))
                log(f"{model_name} {cache} background export: {background} s")
    out: dict[str, Any] = {"model": model_name, "cache": cache, "gen": gen, "batch": 1,
                           "prompt_tokens": len(prompt), "background_export_s": background}
    for ex in EXECUTORS:
        rs = runs[ex]
        out[ex] = {"cold_wall_s": round(rs[0]["wall"], 3),
                   "warm_wall_s": round(float(np.median([r["wall"] for r in rs[1:]])), 3),
                   "warm_decode_s": round(float(np.median([r["stats"]["seconds"] for r in rs[1:]])), 4),
                   "peak_rss_mb": max(r["stats"]["peak_rss_mb"] for r in rs[1:]),
                   "nfe": rs[-1]["stats"]["nfe"]}
    completions = {r["completion"] for ex in EXECUTORS for r in runs[ex]}
    out["same_tokens"] = len(completions) == 1
    out["same_nfe"] = out["jax"]["nfe"] == out["auto"]["nfe"]
    for what in ("cold_wall_s", "warm_wall_s", "warm_decode_s"):
        out[f"jax/auto {what}"] = round(out["jax"][what] / out["auto"][what], 2)
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = ["| case | cold s: jax / default | warm s: jax / default | decode s: jax / default | "
             "warm ratio | decode ratio | RSS MB: jax / default | same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for c in results["cases"]:
        j, a = c["jax"], c["auto"]
        lines.append(f"| {c['model']} {c['cache']} {c['gen']} | {j['cold_wall_s']} / {a['cold_wall_s']} | "
                     f"{j['warm_wall_s']} / {a['warm_wall_s']} | {j['warm_decode_s']} / {a['warm_decode_s']} | "
                     f"{c['jax/auto warm_wall_s']} | {c['jax/auto warm_decode_s']} | "
                     f"{j['peak_rss_mb']:.0f} / {a['peak_rss_mb']:.0f} | {c['same_tokens'] and c['same_nfe']} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    labels = [f"{c['model']}\n{c['cache']} {c['gen']}" for c in cases]
    x = np.arange(len(cases))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, what, title in zip(axes, ("cold_wall_s", "warm_wall_s", "warm_decode_s"),
                               ("first run (empty caches)", "later runs: command wall time", "later runs: decode")):
        for k, (ex, name) in enumerate((("jax", "--executor jax"), ("auto", "default (JAX, then LiteRT once cached)"))):
            ax.bar(x + (k - 0.5) * 0.38, [c[ex][what] for c in cases], 0.38, label=name)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"dlm-jax generate, batch 1, block 32, threshold 0.9 ({results['machine']['cpu']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/default_executor")
    ap.add_argument("--workdir", help="where the random checkpoints are written (default: a temporary one)")
    ap.add_argument("--models", nargs="+", default=["llada-tiny", "random-29m"], choices=MODELS)
    ap.add_argument("--caches", nargs="+", default=["prefix", "dual"], choices=["none", "prefix", "dual"])
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--warm", type=int, default=3, help="warm runs per executor and case")
    args = ap.parse_args()
    import dlm_jax

    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        cases = []
        for name in args.models:
            path = model_path(name, workdir)
            prompt = prompts_for(name, dlm_jax.load(path, executor="jax"), 1)[0]
            if name != "llada-tiny":
                path = ids_only(name, path, workdir)
            for cache in args.caches:
                cases.append(run_case(name, path, prompt, cache, args.gen, args.warm))
    results = {"machine": machine(), "command": " ".join(sys.argv), "cases": cases}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

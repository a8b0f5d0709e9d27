"""The JAX executor's decode time at an older commit against the working tree, same cases,
each decode in a fresh process, the two alternating (this machine is noisy).

    .venv/bin/python benchmarks/before_after.py --base 3abe65d --workdir W --out benchmarks/results/before_after.json

`--base`'s `dlm_jax/` is extracted with `git archive` to a temporary directory and put first
on PYTHONPATH; the random checkpoints come from `benchmarks/_models.py`. Per case: seconds
of one timed decode after warm-up (a 64-token random prompt, block 32, threshold 0.9) and
whether both produced the same tokens. `DLM_JAX_ATTENTION` / `DLM_JAX_LAYERS` set in the
environment pick the working tree's executor options (recorded in the result):

    DLM_JAX_ATTENTION=split .venv/bin/python benchmarks/before_after.py --base 2694d72 --workdir W --cases 8 \
        --out benchmarks/results/before_after_split.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _commits import extract, run_case  # noqa: E402
from _models import model_path  # noqa: E402

CASES = ([("random-29m", g, m, 1) for g in (128, 256) for m in ("none", "prefix", "dual")]
         + [("random-29m", 128, m, 4) for m in ("prefix", "dual")]
         + [("random-154m", 128, m, 1) for m in ("prefix", "dual")])

_CASE = """
import json, sys, time
import numpy as np
import dlm_jax
path, gen, mode, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
h = dlm_jax.load(path)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 256, 64).tolist() for _ in range(batch)]
cfg = lambda g: dlm_jax.decode_config(gen_len=g, block_len=32, cache=mode, rule="threshold", threshold=0.9)
h.decoder.warmup([64] * batch, cfg(gen))
h.decoder.decode(prompts, cfg(32))
t0 = time.perf_counter()
out = h.decoder.decode(prompts, cfg(gen))
print(json.dumps({"seconds": time.perf_counter() - t0, "nfe": out.stats.nfe, "file": dlm_jax.__file__,
                  "tokens": [s.tolist() for s in out.sequences]}))
"""


def run(pythonpath: str, args: list[str]) -> dict:
    return run_case(_CASE, args, pythonpath, DLM_JAX_EXECUTOR="jax")  # the JAX executor on both sides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--workdir", type=Path, required=True, help="where the random checkpoints are (or are written)")
    ap.add_argument("--cases", type=int, default=len(CASES), help="run only the first N cases")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "before_after.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as before:
        extract(args.base, before)
        for i, (name, gen, mode, batch) in enumerate(CASES[:args.cases]):
            case = [str(model_path(name, args.workdir)), str(gen), mode, str(batch)]
            order = [("before", before), ("after", str(ROOT))]
            res = {w: run(pp, case) for w, pp in (order if i % 2 == 0 else order[::-1])}
            rows.append({"case": f"{name} {mode} {gen} b{batch}", "before_s": round(res["before"]["seconds"], 2),
                         "after_s": round(res["after"]["seconds"], 2),
                         "speedup": round(res["before"]["seconds"] / res["after"]["seconds"], 2),
                         "nfe": res["after"]["nfe"], "same_tokens": res["before"]["tokens"] == res["after"]["tokens"]})
            print(json.dumps(rows[-1]), flush=True)
    # The executor options the environment chose (both sides inherit them; an older base may ignore them).
    env = {k: os.environ[k] for k in ("DLM_JAX_ATTENTION", "DLM_JAX_LAYERS", "DLM_JAX_COMPILE_THREADS") if k in os.environ}
    args.out.write_text(json.dumps({"base": args.base, "environment": env, "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

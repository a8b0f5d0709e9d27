"""Host-side time per decode step against the compiled step's time, per window bucket.

    .venv/bin/python benchmarks/host_overhead.py [--out benchmarks/results/host_overhead.json]

For each window bucket W, decodes with the dual cache and block length W (so every step after
a block's first is one W-wide window over the cache) and reports the medians of the host time
(planning, padding, masks, cache gathers, confidences, commit rule, bookkeeping) and of the
executor time, and their ratio. Two model sizes; prints JSON, ratios measured in one run.
Target: host <= 10% of the step at the 32-token bucket.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dlm_jax  # noqa: E402
from dlm_jax.executors.jax_executor import JaxExecutor  # noqa: E402
from dlm_jax.runtime.decoder import Decoder  # noqa: E402

MODELS = {
    "tiny-d64-L2": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128),
    "small-d256-L6": dict(d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_hidden=768),
}


def measure(name: str, spec: dict, windows: list[int], prompt_len: int, repeats: int) -> list[dict]:
    tok = dlm_jax.ByteTokenizer()
    cfg = dlm_jax.ModelConfig(vocab_size=tok.vocab_size, mask_token_id=tok.mask_id, eos_token_id=tok.eos_id,
                              max_seq_len=1024, **spec)
    model = dlm_jax.init_model(cfg)
    decoder = Decoder(JaxExecutor(model), cfg)
    prompt = list(np.random.default_rng(0).integers(0, 256, prompt_len))
    rows = []
    for w in windows:
        # threshold 1.0 commits one token per step: many steady-state steps per block
        dc = dlm_jax.decode_config(gen_len=2 * w, block_len=w, cache="dual", rule="threshold",
                                  threshold=1.0, stop_on_eos_block=False)
        decoder.decode([prompt], dc)  # warm-up: compiles this setting's buckets
        host, step = [], []
        for _ in range(repeats):
            st = decoder.decode([prompt], dc).stats
            first = {0, w}  # each block's first step is a full forward; keep the W-wide steps
            host += [h for i, h in enumerate(st.host_seconds) if i not in first]
            step += [s for i, s in enumerate(st.step_seconds) if i not in first]
        h, s = float(np.median(host)) * 1e3, float(np.median(step)) * 1e3
        rows.append({"model": name, "params": dlm_jax.param_count(cfg), "window": w, "cache_slots": prompt_len + w,
                     "host_ms": round(h, 4), "step_ms": round(s, 4), "host_over_step": round(h / s, 4),
                     "steps_measured": len(host)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, nargs="*", default=[8, 16, 32, 64, 128])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for name, spec in MODELS.items():
        rows += measure(name, spec, args.windows, args.prompt_len, args.repeats)
    at32 = {r["model"]: r["host_over_step"] for r in rows if r["window"] == 32}
    result = {"machine": platform.machine(), "cpus": __import__("os").cpu_count(), "rows": rows,
              "host_over_step_at_32": at32, "target": 0.10,
              "meets_target": {m: v <= 0.10 for m, v in at32.items()}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

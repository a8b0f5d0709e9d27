"""How often a request's decode changes with its batch-mates: float32 and bfloat16, a step's rows
computed together ("batched") or one at a time ("each", `JaxExecutor(rows=...)`).

    .venv/bin/python benchmarks/batch_invariance.py [--n 32] [--out benchmarks/results/batch_invariance]

For each setting, `--n` held-out prompts are decoded alone (one at a time in an engine of
`--batch` rows) and together (submitted at once into such an engine), and compared: requests
whose tokens differ, requests whose NFE differs, and steps whose outputs (top token, its
probability, the runner-up's, the entropy) differ in any bit; and requests whose tokens differ
from `Decoder.decode` of the prompt alone (a fixed batch of one: other compiled programs).
Prints JSON; writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402 (imports no JAX)

CASES = [("fast-dllm", "llada-12m", dict(gen_len=64, block_len=32)),
         ("fast-dllm-dual", "llada-12m", dict(gen_len=64, block_len=16)),
         ("isd", "idlm-tiny", dict(gen_len=32)),
         ("llada-cpp", "llada-tiny", dict(gen_len=32, block_len=16))]


def measure(preset: str, model_name: str, options: dict, *, dtype: str, rows: str, n: int, batch: int) -> dict:
    import dlm_jax
    from dlm_jax.executors.jax_executor import JaxExecutor
    from dlm_jax.runtime.decoder import Decoder
    from dlm_jax.runtime.engine import Engine
    from dlm_jax.training.data import TASKS, make_split

    extra = {} if dtype == "float32" else {"dtype": dtype, "param_dtype": dtype}
    model = dlm_jax.load(ROOT / "models" / model_name, executor="jax", **extra)
    decoder = Decoder(JaxExecutor(model.model, rows=rows), model.config)
    cfg = dlm_jax.preset(preset, **options)
    per_task = [[model.encode(ex.prompt) for ex in make_split(TASKS[t], n, split="heldout")] for t in sorted(TASKS)]
    prompts = [p for group in zip(*per_task) for p in group][:n]  # the tasks interleaved
    logs: dict = {}

    class Recording(Engine):
        def _advance(self, req, out):
            if out is not None:
                logs.setdefault((self.tag, req.id % len(prompts)), []).append(
                    b"".join(getattr(out, f).tobytes() for f in ("top_token", "top_prob", "second_prob", "entropy")))
            return super()._advance(req, out)

    # Alone: each request in an otherwise idle engine of the same size (the same programs);
    # together: all of them submitted at once.
    engine = Recording(decoder, max_batch=batch)
    engine.tag = "alone"
    alone = []
    for p in prompts:
        alone.append(engine.submit(p, cfg))
        engine.run()
    engine.close()
    engine = Recording(decoder, max_batch=batch)
    engine.tag = "together"
    together = [engine.submit(p, cfg) for p in prompts]
    engine.run()
    engine.close()
    solo = [decoder.decode([p], cfg).sequences[0] for p in prompts]  # a fixed batch of one: other programs
    steps = sum(len(logs[("alone", i)]) for i in range(len(prompts)))
    differing_steps = sum(a != b for i in range(len(prompts))
                          for a, b in zip(logs[("alone", i)], logs[("together", i)]))
    return {"preset": preset, "model": model_name, "dtype": dtype, "rows": rows, "requests": len(prompts),
            "batch": batch, "differing_tokens": sum(list(a.tokens()) != list(b.tokens()) for a, b in zip(alone, together)),
            "differing_from_fixed_batch_of_one": sum(not np.array_equal(s, b.output.sequences[0])
                                                     for s, b in zip(solo, together)),
            "differing_nfe": sum(a.stats.nfe != b.stats.nfe for a, b in zip(alone, together)),
            "steps": steps, "steps_with_other_bits": differing_steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "batch_invariance"))
    args = p.parse_args(argv)
    rows = []
    for preset, model_name, options in CASES:
        for dtype in ("float32", "bfloat16"):
            for mode in ("batched", "each"):
                rec = measure(preset, model_name, options, dtype=dtype, rows=mode, n=args.n, batch=args.batch)
                rows.append(rec)
                print(json.dumps(rec), flush=True)
    import jax

    report = {"benchmark": "benchmarks/batch_invariance.py", "device": jax.devices()[0].device_kind, "rows": rows}
    out = Path(args.out)
    atomic_write_json(out.with_suffix(".json"), report, indent=1)
    lines = ["# Batch invariance: alone against beside others", "",
             f"Written by `benchmarks/batch_invariance.py` ({report['device']}). Requests alone (one at a time) "
             f"against all submitted at once, in an engine of {args.batch} rows; and against `Decoder.decode` of "
             f"each prompt alone.", "",
             "| preset | model | dtype | rows | requests with other tokens | other NFE | steps with other bits | "
             "other tokens than a fixed batch of one |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['model']} | {r['dtype']} | {r['rows']} | {r['differing_tokens']}/"
                     f"{r['requests']} | {r['differing_nfe']}/{r['requests']} | {r['steps_with_other_bits']}/"
                     f"{r['steps']} | {r['differing_from_fixed_batch_of_one']}/{r['requests']} |")
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The bundle cache's disk use: one copy of the weights per model, against a copy per export.

    .venv/bin/python benchmarks/bundle_cache.py --out benchmarks/results/bundle_cache

For each model (the shipped llada-tiny and llada-12m) a bundle cache in a throwaway directory
is grown as a session of decodes grows it: each step warms up what `Model.generate` warms up
for its prompts (`Decoder.warmup`: every bucket of prompts up to the next multiple of 64
tokens, as one export), a short prompt, a long one, a batch of four, a longer one, the
llada-cpp preset (progressive revision's buckets). After each step it records the bytes of the
part that export wrote (the old cache kept every part: their sum is its disk use), the
entry's bytes after compaction (`dlm_jax.tflite_export.merge`: one bundle, each weight once), the
export and compaction seconds, and the model's float32 weight bytes (`lstat` sizes, as the
cache's limit counts them); at the end, the bytes of the merged `.tflite`'s constants (the
weights once, and the graphs' small constants). Target: the compacted entry at most 1.2x the
weights. Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _hardware import machine  # noqa: E402

MODELS = ("llada-tiny", "llada-12m")
TARGET = 1.2
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def session():
    """The decodes of a session, in order: (label, prompt lengths, decode config)."""
    import dlm_jax

    default = dlm_jax.decode_config()
    return [("prompt 12", [12], default), ("prompt 90", [90], default),
            ("batch 4, prompts 12-40", [12, 20, 30, 40], default), ("prompt 200", [200], default),
            ("llada-cpp, prompt 12", [12], dlm_jax.preset("llada-cpp"))]


def constant_bytes(path: Path) -> int:
    """The bytes of a `.tflite`'s constant buffers (inline or after the flatbuffer)."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.Model.GetRootAs(path.read_bytes(), 0)
    return sum(b.DataLength() or (b.Size() if b.Offset() > 1 else 0)
               for b in (model.Buffers(i) for i in range(model.BuffersLength())))


def run_model(name: str) -> dict[str, Any]:
    import dlm_jax
    from dlm_jax.models._params import get_params
    from dlm_jax.runtime.decoder import Decoder
    from dlm_jax.executors.bundle_cache import BundleCacheExecutor
    from dlm_jax.tflite_export.cache_admin import tree_bytes

    path = HERE.parent / "models" / name
    model = dlm_jax.load(path, executor="jax").model
    weights = int(sum(v.nbytes for v in get_params(model).values()))
    steps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root:
        executor = BundleCacheExecutor(model, source=path, root=root)
        decoder = Decoder(executor, model.config)
        compact = executor._compact
        measured: dict[str, float] = {}

        def timed_compact() -> None:  # the entry as the old cache left it: every part, before the merge
            measured["before"] = tree_bytes(executor.path)
            t0 = time.perf_counter()
            compact()
            measured["seconds"] = time.perf_counter() - t0

        executor._compact = timed_compact
        old_total, after = 0, 0
        for label, lens, cfg in session():
            measured.clear()
            exported, seconds = len(executor.exported), executor.export_seconds
            t0 = time.perf_counter()
            decoder.warmup(lens, cfg)
            wall = time.perf_counter() - t0
            if "before" not in measured:  # nothing new to export
                continue
            part = measured["before"] - after  # the new part (the entry held `after` before it)
            after = tree_bytes(executor.path)
            old_total += part
            steps.append({"step": label, "buckets_added": len(executor.exported) - exported,
                          "buckets": len(set(executor.exported)), "part_bytes": part, "old_bytes": old_total,
                          "compacted_bytes": after, "parts_on_disk": len(list(executor.path.glob("part-*"))),
                          "export_s": round(executor.export_seconds - seconds, 2),
                          "compact_s": round(measured["seconds"], 2), "warmup_s": round(wall, 2)})
            log(f"{name} {label}: +{steps[-1]['buckets_added']} buckets, part {part / 1e6:.2f} MB; old "
                f"{old_total / 1e6:.2f} MB, compacted {after / 1e6:.2f} MB ({measured['seconds']:.1f} s)")
        [part] = executor.path.glob("part-*")
        constants = constant_bytes(part / "model.tflite")
        executor.close()
    last = steps[-1]
    return {"model": name, "parameters": dlm_jax.param_count(model.config), "weights_bytes": weights,
            "steps": steps, "exports": len(steps), "buckets": last["buckets"],
            "old_bytes": last["old_bytes"], "compacted_bytes": last["compacted_bytes"],
            "old_over_weights": round(last["old_bytes"] / weights, 3),
            "compacted_over_weights": round(last["compacted_bytes"] / weights, 3),
            "old_over_compacted": round(last["old_bytes"] / last["compacted_bytes"], 2),
            "graph_bytes_per_bucket": round((last["compacted_bytes"] - weights) / last["buckets"]),
            "constant_bytes": constants, "constants_over_weights": round(constants / weights, 3),
            "within_target": last["compacted_bytes"] <= TARGET * weights}


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = ["# Bundle cache disk use: one copy of the weights per model\n",
             f"Machine: {m['cpu']}, {m['cores']} cores. Bytes are `lstat` sizes (MB = 10^6 bytes). "
             f"Old: every export's part kept (the cache before compaction); compacted: the entry after "
             f"each export is merged into one bundle. Target: compacted <= {TARGET}x the float32 weights.\n",
             "| model | weights MB | exports | buckets | old MB | compacted MB | old / weights | "
             "compacted / weights | old / compacted | graph KB per bucket | within target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["models"]:
        lines.append(f"| {r['model']} | {r['weights_bytes'] / 1e6:.2f} | {r['exports']} | {r['buckets']} | "
                     f"{r['old_bytes'] / 1e6:.2f} | {r['compacted_bytes'] / 1e6:.2f} | {r['old_over_weights']} | "
                     f"{r['compacted_over_weights']} | {r['old_over_compacted']} | "
                     f"{r['graph_bytes_per_bucket'] / 1e3:.0f} | {r['within_target']} |")
    lines += [""] + [f"{r['model']}: the compacted `.tflite` holds {r['constant_bytes'] / 1e6:.2f} MB of constants "
                     f"({r['constants_over_weights']}x the weights: each weight once); the rest of the entry, "
                     f"{(r['compacted_bytes'] - r['constant_bytes']) / 1e6:.2f} MB, is the {r['buckets']} signatures' "
                     f"graphs and the bundle's JSON files." for r in results["models"]]
    lines += ["", "Per export:", "",
              "| model | step | buckets added | part MB | old MB | compacted MB | parts on disk | export s | "
              "compact s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["models"]:
        for s in r["steps"]:
            lines.append(f"| {r['model']} | {s['step']} | {s['buckets_added']} | {s['part_bytes'] / 1e6:.2f} | "
                         f"{s['old_bytes'] / 1e6:.2f} | {s['compacted_bytes'] / 1e6:.2f} | {s['parts_on_disk']} | "
                         f"{s['export_s']} | {s['compact_s']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "bundle_cache"))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args = ap.parse_args()
    results = {"machine": machine(), "target_over_weights": TARGET,
               "models": [run_model(name) for name in args.models]}
    text = json.dumps(results, indent=2)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(text + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

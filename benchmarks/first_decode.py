"""The first decode of a fresh process: how long it waits for compiles, cold and over the
persistent compilation cache.

    PYTHONPATH=. python3 benchmarks/first_decode.py --xla-cache /tmp/xla --out first_decode   (on a GPU)
    (run it twice with the same --xla-cache: the second process loads what the first compiled)

One process, one decode setting: random weights at `--shape` made on the device (the output
head scaled so that threshold 0.9 commits several tokens a step, as a trained model's does;
nothing read from disk), the JAX executor (`--layers`, as `DLM_JAX_LAYERS` picks), and the
decode of `benchmarks/gpu.py`'s setting (prompt 128, generation 256, block 32, threshold 0.9,
`--cache`, `--batch` rows) run twice: the first decode (every compile it waits for included;
the decoder prefetches its buckets on background threads) and a second one (all compiled).
Reported: both wall times, their difference (the wait), the compiles and the seconds the
decode waited for them (`DecodeStats`), the persistent cache's hits, and whether the cache
directory was empty when the process started. Each run appends one record to <out>.json.

`--prompt-lens N ...` then decodes once at each of these other prompt lengths, as a server's
next requests would come, and adds each one's seconds and new compiles (`later`): what a
request of another length waits for once the first is served. `--attention` picks the
executor's attention form (default: the platform's, `split` on a GPU), so that a CPU can run
the in-place form a GPU runs, and `--projections` its projections (`benchmarks/gpu_lease.sh`
passes both as its `decide` part chose them):

    PYTHONPATH=. python3 benchmarks/first_decode.py --shape small --dtype float32 --cache prefix --gen-len 128 \
        --attention split --prompt-lens 40 72 104 136 --xla-cache /tmp/xla-first-small --out /tmp/first_small
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

T0 = time.perf_counter()  # before JAX is imported: the process's start

from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402 (imports no JAX)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llada-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cache", default="dual", choices=("prefix", "dual"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--head-std", type=float, default=20.0, help="standard deviation of the scaled head's logits")
    p.add_argument("--attention", default=None, help="the executor's attention form (default: the platform's)")
    p.add_argument("--projections", choices=("separate", "fused"), default=None,
                   help="the executor's projections (default: its own, $DLM_JAX_PROJECTIONS or separate)")
    p.add_argument("--path", choices=("decoder", "engine"), default="decoder",
                   help="decode with the decoder (Decoder.decode, the default) or with an engine (dlm_jax.runtime."
                        "engine.Engine: what Model.generate, the commands and the server run), max_batch --batch")
    p.add_argument("--compile", choices=("full", "tiered"), default="full",
                   help="the executor's compile (tiered: quick programs first, full ones built behind)")
    p.add_argument("--upgrade-wait-s", type=float, default=None,
                   help="tiered: wait at most this long for the full compiles (default: until built)")
    p.add_argument("--prompt-lens", type=int, nargs="*", default=[], metavar="N",
                   help="after the two decodes, one decode at each of these prompt lengths (new compiles each)")
    p.add_argument("--xla-cache", type=Path)
    p.add_argument("--render", type=Path, nargs="+", metavar="RESULT.json",
                   help="measure nothing: write --out's .json and .md from these results of this script (runs "
                   "joined in order)")
    p.add_argument("--note", action="append", default=[], metavar="TEXT", help="a remark for --render's report")
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.render:
        runs = [r for path in args.render for r in json.loads(path.read_text())["runs"]]
        rep = {"benchmark": "benchmarks/first_decode.py", "runs": runs, "notes": args.note,
               "sources": [str(path) for path in args.render]}
        _write(args.out, rep)
        print(markdown(rep))
        return 0
    if args.xla_cache is None:
        p.error("--xla-cache is required (the persistent compilation cache this process reads and fills)")
    cold = not (args.xla_cache.exists() and any(args.xla_cache.iterdir()))

    import jax
    import numpy as np

    import gpu_step
    from dlm_jax.executors._compile import enable_persistent_cache
    from dlm_jax.executors.jax_executor import JaxExecutor
    from dlm_jax.runtime import Decoder, decode_config

    enable_persistent_cache(args.xla_cache)
    hits = [0]
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.__setitem__(0, hits[0] + (event == "/jax/compilation_cache/cache_hits")))
    cfg = gpu_step.model_config(args.shape, args.dtype)
    t = time.perf_counter()
    model = gpu_step.random_model(cfg)
    # Peak the head: logits of std `head_std` over hidden states of unit RMS (the final norm's).
    w = model.lm_head.kernel[...]
    model.lm_head.kernel.set_value((w * (args.head_std / (0.02 * np.sqrt(cfg.d_model)))).astype(w.dtype))
    jax.block_until_ready(model.lm_head.kernel[...])
    weights_s = time.perf_counter() - t
    executor = JaxExecutor(model, **({"attention": args.attention} if args.attention else {}),
                           **({"projections": args.projections} if args.projections else {}), compile=args.compile)
    decoder = Decoder(executor, cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.mask_token_id, args.prompt_len).tolist() for _ in range(args.batch)]
    dc = decode_config(gen_len=args.gen_len, block_len=32, cache=args.cache, rule="threshold", threshold=0.9)
    decode = decoder.decode if args.path == "decoder" else engine_decode(  # (rows for the later prompts too)
        decoder, args.batch, max([args.prompt_len, *args.prompt_lens]) + args.gen_len)
    t = time.perf_counter()
    first = decode(prompts, dc)
    first_s = time.perf_counter() - t
    hits_first = hits[0]
    tiers_first = executor.tiers()
    t = time.perf_counter()
    second = decode(prompts, dc)
    second_s = time.perf_counter() - t
    tiered = {"tiers_after_first": tiers_first, "tiers_after_second": executor.tiers()} if args.compile == "tiered" \
        else {}
    record = {"label": args.label, "path": args.path, "shape": args.shape, "dtype": args.dtype, "cache": args.cache,
              "batch": args.batch,
              "layers": getattr(executor, "layers", "unrolled"), "attention": executor.attention,
              "projections": getattr(executor, "projections", "separate"), "compile": args.compile,
              "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}", "jax": jax.__version__,
              "xla_cache_empty_at_start": cold, "weights_seconds": round(weights_s, 2),
              "first_decode_seconds": round(first_s, 3), "second_decode_seconds": round(second_s, 3),
              "waited_seconds": round(first_s - second_s, 3),  # (tiered: below, over the upgraded decode)
              "first_compiles": first.stats.compiles,
              "first_compile_wait_seconds": round(first.stats.compile_wait_seconds, 3),
              "first_compile_seconds": round(first.stats.compile_seconds, 3),
              "persistent_cache_hits": hits_first, "nfe": first.stats.nfe,
              "same_tokens": all(np.array_equal(a, b) for a, b in zip(first.sequences, second.sequences)),
              "process_seconds": round(time.perf_counter() - T0, 2),
              "machine": f"{platform.node()} ({os.cpu_count()} CPU cores)",
              "date": time.strftime("%Y-%m-%d", time.gmtime()), **tiered}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = args.out.with_suffix(".json")
    runs = json.loads(path.read_text())["runs"] if path.exists() else []

    def save() -> None:  # after the first two decodes, then after each later one: a cut run keeps them
        atomic_write_json(path, {"benchmark": "benchmarks/first_decode.py", "runs": runs + [record]}, indent=1)

    save()
    if args.compile == "tiered":  # then the decode once every program holds its full compile
        t = time.perf_counter()
        done = executor.wait_for_upgrades(args.upgrade_wait_s)
        record.update(upgrade_wait_seconds=round(time.perf_counter() - t, 2), upgrades_done=done,
                      upgrade_seconds=executor.tiers()["upgrade_seconds"], tiers_upgraded=executor.tiers())
        if done:
            t = time.perf_counter()
            upgraded = decode(prompts, dc)
            record["upgraded_decode_seconds"] = round(time.perf_counter() - t, 3)
            record["waited_seconds"] = round(first_s - min(second_s, record["upgraded_decode_seconds"]), 3)
            record["upgraded_same_tokens"] = all(np.array_equal(a, b) for a, b in zip(first.sequences,
                                                                                      upgraded.sequences))
        save()
    if args.prompt_lens:
        record["later"] = []
    for n in args.prompt_lens:
        later = [rng.integers(0, cfg.mask_token_id, n).tolist() for _ in range(args.batch)]
        before, had = executor.compile_count, set(executor.compiled_keys)
        t = time.perf_counter()
        out = decode(later, dc)
        record["later"].append({"prompt_len": n, "seconds": round(time.perf_counter() - t, 3),
                                "compiles": executor.compile_count - before, "nfe": out.stats.nfe,
                                "new_buckets": [str(k) for k in executor.compiled_keys if k not in had],
                                "compile_wait_seconds": round(out.stats.compile_wait_seconds, 3)})
        save()
    print(json.dumps(record))
    return 0


def engine_decode(decoder, max_batch: int, max_tokens: int):
    """`decoder.decode` through an engine of `max_batch` rows of `max_tokens` slots: the
    prompts submitted together; the outputs' `sequences` (each request's ids) and `stats`
    (`compiles`, `compile_wait_seconds`, `compile_seconds` over the engine's run, `nfe` its
    calls), as `Decoder.decode` gives them."""
    from types import SimpleNamespace

    from dlm_jax.runtime.engine import Engine

    engine = Engine(decoder, max_batch=max_batch, max_tokens=max_tokens)

    def decode(prompts, cfg):
        before, calls = decoder.build_counts(), engine.stats.calls
        handles = [engine.submit(p, cfg) for p in prompts]
        engine.run()
        built = decoder.build_counts() - before
        stats = SimpleNamespace(compiles=built.compiles, compile_wait_seconds=built.compile_wait_seconds,
                                compile_seconds=built.compile_seconds, nfe=engine.stats.calls - calls)
        return SimpleNamespace(sequences=[h.result() for h in handles], stats=stats)

    return decode


def markdown(rep: dict) -> str:
    lines = ["# The first decode of a fresh process (`benchmarks/first_decode.py`)", "",
             *[f"- {n}" for n in rep.get("notes", [])], "",
             "| run | device | shape | cache | batch | path | layers | compile | XLA cache at start | first decode s | "
             "second decode s | waited s | compile s (all threads) | persistent-cache hits | NFE | process s |",
             "|---|---|---|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rep["runs"]:
        lines.append(f"| {r['label']} | {r['device']} | {r['shape']} {r['dtype']} | {r['cache']} | {r['batch']} | "
                     f"{r.get('path', 'decoder')} | "
                     f"{r['layers']} | {r.get('compile', 'full')} | {'empty' if r['xla_cache_empty_at_start'] else 'filled'} | "
                     f"{r['first_decode_seconds']:.2f} | {r['second_decode_seconds']:.3f} | {r['waited_seconds']:.2f} | "
                     f"{r['first_compile_seconds']:.1f} | {r['persistent_cache_hits']} | {r['nfe']} | "
                     f"{r['process_seconds']:.1f} |")
    tiered = [r for r in rep["runs"] if r.get("compile") == "tiered"]
    if tiered:
        lines += ["", "Tiered compiles (`--compile tiered`): the step programs each run holds after its first decode "
                  "(quick / full), its steps that ran padded in a wider window's program while their own was "
                  "built behind (attention read in place: the steps of one cache share a read bucket), the full "
                  "compiles' seconds on their thread, how long the run then waited for the rest, the decode once all "
                  "were full against the second decode, and whether it kept the first decode's tokens. Waited s "
                  "above: the first decode over the faster of the two.", "",
                  "| run | shape | attention | quick / full after the first decode | steps in a wider window | "
                  "full compiles s | then waited s | second decode s | decode on full programs s | same tokens |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in tiered:
            t = r.get("tiers_after_first", {})
            done = r.get("upgraded_decode_seconds")
            lines.append(f"| {r['label']} | {r['shape']} | {r.get('attention', '-')} | "
                         f"{t.get('quick', '-')} / {t.get('full', '-')} | {t.get('widened', '-')} | "
                         f"{r.get('upgrade_seconds', '-')} | "
                         f"{r.get('upgrade_wait_seconds', '-')}{'' if r.get('upgrades_done', True) else ' (cut)'} | "
                         f"{r['second_decode_seconds']:.3f} | {'-' if done is None else f'{done:.3f}'} | "
                         f"{r.get('upgraded_same_tokens', '-')} |")
    later = [r for r in rep["runs"] if r.get("later")]
    if later:
        lines += ["", "Later decodes of the same process at other prompt lengths (a server's next requests): "
                  "prompt length: seconds (new compiles)", ""]
        lines += [f"- {r['cache']} cache, {r['label'] or '-'} ({r.get('attention', '-')}, prompt {r.get('prompt_len', '-')} "
                  "first): "
                  + ", ".join(f"{x['prompt_len']}: {x['seconds']:.2f} s ({x['compiles']})" for x in r["later"])
                  for r in later]
    return "\n".join(lines) + "\n"


def _write(out: Path, rep: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), rep, indent=1)
    atomic_write(out.with_suffix(".md"), markdown(rep))


if __name__ == "__main__":
    sys.exit(main())

"""Does running the layers under a scan cut the decode step's compile time? Measured.

    .venv/bin/python benchmarks/compile_scan.py --out benchmarks/results/compile_scan

The decode step (`dlm_jax.executors.jax_executor.decode_step`, one AOT-compiled program per bucket) runs the
model's blocks in a Python loop, so XLA sees L copies of a block and compiles each. Here, in
one process and for every (width, layers) case, two programs over the same weights and the
same bucket are built with fresh `jax.jit` objects (nothing reused between repeats) and timed:

  unrolled  the real `decode_step` over the model of `dlm_jax.init_model` (today's code);
  scanned   the same `decode_step` over `ScannedTransformer`: the same embedding, final norm
            and head, and the model's own `Block` (nnx.split of one block, its parameters
            stacked along a leading [L] axis), run by `jax.lax.scan` over (stacked
            parameters, K/V cache per layer) with nnx.merge inside the body, as `nnx.scan`
            does: one block in the HLO whatever L.

Then, at the LLaDA-8B shape (d 4096, 32 layers, 32 heads, MLP 12288, vocab 126464, bfloat16),
the JAX executor's own resident step (`JaxExecutor(model, layers=...)`: gather the read
slots, step, scatter the window K/V) for the buckets a decode of prompt 128 + generation 256
uses, lowered from abstract shapes (`nnx.eval_shape`: no weights allocated) and compiled,
`layers="unrolled"` vs `layers="scan"` (`--llada-8b-repeats 0` skips it).

Last, the first decode of a fresh process (`--first-decode`): per model, cache and layers, a
new Python process with the persistent cache off builds the JAX executor over random weights
of the checkpoint's shape (so that blocks take many steps, as in `benchmarks/gpu.py`) and
decodes prompt 128 + generation 256 in blocks of 32 at threshold 0.9; the decode's wall time,
its compiles and the seconds it waited for them (`DecodeStats.compile_wait_seconds`).

Per case: trace + lower seconds and XLA compile seconds (medians of `--repeats`, the two
variants alternating so that load from other jobs falls on both), the compiled step's run
time (median of `--steps` calls, the variants taking turns call by call), the minima of both
(steadier on a shared machine), and the largest |logits| difference between the two
(asserted allclose, with top tokens and window K/V). JAX's persistent compilation cache is
off for the run (`DLM_JAX_CACHE_DIR=off`, `jax_compilation_cache_dir` None; both recorded).

This is the CPU backend: XLA:GPU's compile times are larger (8-12 s per bucket at LLaDA-8B)
and differ in make-up; the ratio between the variants and how it grows with L is what this
shows. Writes <out>.json, <out>.md and <out>.png; prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from _hardware import machine  # noqa: E402

import dlm_jax  # noqa: E402
from dlm_jax.models._params import _ShapeOnlyRngs  # noqa: E402
from dlm_jax.models._transformer import ModelOutput, Transformer  # noqa: E402
from dlm_jax.executors.jax_executor import JaxExecutor, abstract_inputs, decode_step  # noqa: E402
from dlm_jax.runtime.buckets import BucketKey  # noqa: E402

_T0 = time.perf_counter()
FIELDS = ("layers", "d_model", "n_heads", "ffn_hidden", "vocab", "params_m", "unrolled_lower_s",
          "unrolled_compile_s", "unrolled_total_s", "scanned_lower_s", "scanned_compile_s", "scanned_total_s",
          "compile_ratio", "total_ratio", "unrolled_step_ms", "scanned_step_ms", "step_ratio", "max_abs_diff",
          "unrolled_compile_min_s", "scanned_compile_min_s", "compile_ratio_min", "unrolled_step_min_ms",
          "scanned_step_min_ms", "step_ratio_min")


def disable_persistent_cache() -> None:
    """No persistent XLA cache read or written by this process (nor by dlm_jax, which turns
    one on by default in its commands unless `DLM_JAX_CACHE_DIR=off`): every compile is real."""
    os.environ["DLM_JAX_CACHE_DIR"] = "off"
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


class ScannedTransformer(nnx.Module):
    """`Transformer` with its blocks' parameters stacked [L, ...] and run by `jax.lax.scan`.

    Built from a dense `Transformer` (every block the same structure); shares its embedding,
    final norm and head modules. `__call__` is `Transformer.__call__` with the layer loop
    replaced by the scan; `head` is `Transformer.head` itself."""

    def __init__(self, model: Transformer):
        cfg = model.config
        splits = [nnx.split(layer) for layer in model.layers]
        graphdef = splits[0][0]
        if any(gd != graphdef for gd, _ in splits[1:]):
            raise ValueError("the blocks differ in structure (MoE dense_layers?): cannot stack them")
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(st for _, st in splits))
        self.config = cfg
        self.embed = model.embed
        self.layers = nnx.merge(graphdef, stacked)  # one Block whose arrays carry a leading [L]
        self.final_norm = model.final_norm
        self.lm_head = model.lm_head

    head = Transformer.head
    layer_inputs = Transformer.layer_inputs
    output = Transformer.output

    def __call__(self, tokens, *, positions=None, mask=None, k_cache=None, v_cache=None,
                 logit_rows=None) -> ModelOutput:
        x, cos, sin, mask = self.layer_inputs(tokens, positions, mask, k_cache, v_cache)
        graphdef, stacked = nnx.split(self.layers)

        def body(x, xs):
            params, kc, vc = xs
            x, k, v, _ = nnx.merge(graphdef, params)(x, cos, sin, mask, kc, vc)
            return x, (k, v)

        x, (ks, vs) = jax.lax.scan(body, x, (stacked, k_cache, v_cache))
        return ModelOutput(self.output(x, logit_rows), ks, vs)


def model_config(layers: int, d_model: int, *, heads: int, ffn: int, vocab: int) -> dlm_jax.ModelConfig:
    return dlm_jax.ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=layers, n_heads=heads, ffn_hidden=ffn,
                               mask_token_id=vocab - 1, max_seq_len=4096)


def step_inputs(cfg: dlm_jax.ModelConfig, key: BucketKey, seed: int = 0) -> list[jax.Array]:
    """Concrete inputs of the bucket, in `decode_step`'s order: ids, positions after a prefix
    of `key.cache` slots, a visibility mask with some cache slots hidden, a random K/V cache."""
    specs = abstract_inputs(cfg, key)
    rng = np.random.default_rng(seed)
    b, w, p = key.batch, key.window, key.cache
    tokens = rng.integers(0, cfg.vocab_size, (b, w), dtype=np.int32)
    positions = np.broadcast_to(np.arange(p, p + w, dtype=np.int32), (b, w)).copy()
    vis = np.ones((b, w, p + w), bool)
    vis[:, :, : p // 8] = False  # some slots not visible: the mask is exercised
    kc = (0.5 * rng.standard_normal(specs[3].shape)).astype(specs[3].dtype)
    vc = (0.5 * rng.standard_normal(specs[4].shape)).astype(specs[4].dtype)
    rows = np.broadcast_to(np.arange(key.rows, dtype=np.int32), (b, key.rows)).copy()
    arrays = [tokens, positions, vis, kc, vc, rows]
    for a, s in zip(arrays, specs):
        assert a.shape == s.shape and a.dtype == s.dtype, (a.shape, a.dtype, s)
    return [jnp.asarray(a) for a in arrays]


def _program(graphdef, key: BucketKey, mask_id: int | None):
    """A fresh function object each call: `jax.jit` of it shares no trace or executable."""

    def program(state, *inputs):
        return decode_step(graphdef, state, *inputs, full_logits=key.full_logits, mask_id=mask_id)

    return program


def compile_once(graphdef, state, inputs, key: BucketKey, mask_id: int | None):
    """(trace + lower seconds, compile seconds, executable) of a fresh jit."""
    jitted = jax.jit(_program(graphdef, key, mask_id))
    t0 = time.perf_counter()
    lowered = jitted.lower(state, *inputs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, compiled


def step_times(programs: dict[str, tuple[Any, Any]], inputs, steps: int) -> dict[str, list[float]]:
    """Seconds per call of each compiled program, the programs taking turns call by call (so
    that load from other jobs falls on all of them), after one untimed call each."""
    for compiled, state in programs.values():
        jax.block_until_ready(compiled(state, *inputs))
    times: dict[str, list[float]] = {n: [] for n in programs}
    for i in range(steps):
        for name in (list(programs) if i % 2 == 0 else list(programs)[::-1]):
            compiled, state = programs[name]
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(state, *inputs))
            times[name].append(time.perf_counter() - t0)
    return times


def measure(cfg: dlm_jax.ModelConfig, key: BucketKey, *, repeats: int = 3, steps: int = 10,
            seed: int = 0) -> dict[str, Any]:
    """One case: both variants compiled `repeats` times (alternating), run, and compared."""
    model = dlm_jax.init_model(cfg, seed=seed)
    scanned = ScannedTransformer(model)
    variants = {"unrolled": nnx.split(model), "scanned": nnx.split(scanned)}
    inputs = step_inputs(cfg, key, seed)
    lower: dict[str, list[float]] = {v: [] for v in variants}
    comp: dict[str, list[float]] = {v: [] for v in variants}
    executables = {}
    for r in range(repeats):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in order:
            graphdef, state = variants[name]
            lo, co, executables[name] = compile_once(graphdef, state, inputs, key, cfg.mask_token_id)
            lower[name].append(lo)
            comp[name].append(co)
    outs = {n: jax.device_get(executables[n](variants[n][1], *inputs)) for n in variants}
    a, b = outs["unrolled"], outs["scanned"]
    finite = np.isfinite(a["logits"])  # the mask id's logit is -inf in both
    diff = float(np.max(np.abs(a["logits"][finite] - b["logits"][finite])))
    np.testing.assert_allclose(b["logits"], a["logits"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(b["k_new"], a["k_new"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b["v_new"], a["v_new"], rtol=1e-5, atol=1e-5)
    assert np.array_equal(a["top_token"], b["top_token"]), "top tokens differ"
    steps_s = step_times({n: (executables[n], variants[n][1]) for n in variants}, inputs, steps)
    ms = {n: 1e3 * statistics.median(v) for n, v in steps_s.items()}
    ms_min = {n: 1e3 * min(v) for n, v in steps_s.items()}
    med = {f"{n}_{what}_s": statistics.median(vals) for what, d in (("lower", lower), ("compile", comp))
           for n, vals in d.items()}
    for n in variants:
        med[f"{n}_total_s"] = med[f"{n}_lower_s"] + med[f"{n}_compile_s"]
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {
        "layers": cfg.n_layers, "d_model": cfg.d_model, "n_heads": cfg.n_heads, "ffn_hidden": cfg.ffn_hidden,
        "vocab": cfg.vocab_size, "params_m": round(n_params / 1e6, 2),
        **{k: round(v, 4) for k, v in med.items()},
        "compile_ratio": round(med["unrolled_compile_s"] / med["scanned_compile_s"], 2),
        "total_ratio": round(med["unrolled_total_s"] / med["scanned_total_s"], 2),
        "unrolled_step_ms": round(ms["unrolled"], 3), "scanned_step_ms": round(ms["scanned"], 3),
        "step_ratio": round(ms["scanned"] / ms["unrolled"], 3), "max_abs_diff": diff,
        "unrolled_compile_min_s": round(min(comp["unrolled"]), 4),
        "scanned_compile_min_s": round(min(comp["scanned"]), 4),
        "compile_ratio_min": round(min(comp["unrolled"]) / min(comp["scanned"]), 2),
        "unrolled_step_min_ms": round(ms_min["unrolled"], 3), "scanned_step_min_ms": round(ms_min["scanned"], 3),
        "step_ratio_min": round(ms_min["scanned"] / ms_min["unrolled"], 3),
        "samples": {"unrolled_lower_s": [round(x, 4) for x in lower["unrolled"]],
                    "unrolled_compile_s": [round(x, 4) for x in comp["unrolled"]],
                    "scanned_lower_s": [round(x, 4) for x in lower["scanned"]],
                    "scanned_compile_s": [round(x, 4) for x in comp["scanned"]]},
    }


LLADA_8B = dict(vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=12288,
                mask_token_id=126336, max_seq_len=4096, rope_theta=500000.0, dtype="bfloat16",
                param_dtype="bfloat16")
# (batch, window, cache) of the resident steps of a decode of prompt 128 + generation 256 in
# blocks of 32 (512 slots): the steady step of both caches, and a block's first (full) step.
LLADA_8B_STEPS = ((1, 32, 384), (1, 384, 0), (8, 32, 384))
SLOTS = 512


def resident_compile(cfg: dlm_jax.ModelConfig, key: BucketKey, slots: int, layers: str) -> tuple[float, float, Any]:
    """(trace + lower seconds, compile seconds, executable) of the JAX executor's resident step
    for `key` over a decode of `slots` slots, built over an abstract model (no weights)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=_ShapeOnlyRngs()))
    fn, specs, options = JaxExecutor(model, layers=layers)._build_resident((key, slots))
    t0 = time.perf_counter()
    lowered = jax.jit(fn, **options).lower(*specs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return t1 - t0, time.perf_counter() - t1, compiled


def measure_resident(cfg: dlm_jax.ModelConfig, steps=LLADA_8B_STEPS, *, slots: int = SLOTS,
                     repeats: int = 3) -> list[dict[str, Any]]:
    """Per bucket, the resident step compiled `repeats` times per variant (alternating)."""
    rows = []
    for batch, window, cache in steps:
        key = BucketKey(batch=batch, window=window, cache=cache, rows=min(window, 32))
        lower: dict[str, list[float]] = {"unrolled": [], "scan": []}
        comp: dict[str, list[float]] = {"unrolled": [], "scan": []}
        temp: dict[str, int | None] = {}
        for r in range(repeats):
            for layers in (("unrolled", "scan") if r % 2 == 0 else ("scan", "unrolled")):
                lo, co, exe = resident_compile(cfg, key, slots, layers)
                lower[layers].append(lo)
                comp[layers].append(co)
                mem = exe.memory_analysis()
                temp[layers] = getattr(mem, "temp_size_in_bytes", None)
        med = {f"{'scanned' if v == 'scan' else v}_{what}_s": round(statistics.median(d[v]), 4)
               for what, d in (("lower", lower), ("compile", comp)) for v in d}
        row = {"bucket": str(key), "slots": slots, **med,
               "compile_ratio": round(med["unrolled_compile_s"] / med["scanned_compile_s"], 2),
               "total_ratio": round((med["unrolled_lower_s"] + med["unrolled_compile_s"])
                                    / (med["scanned_lower_s"] + med["scanned_compile_s"]), 2),
               "unrolled_temp_mb": None if temp["unrolled"] is None else round(temp["unrolled"] / 2**20, 1),
               "scanned_temp_mb": None if temp["scan"] is None else round(temp["scan"] / 2**20, 1),
               "samples": {"unrolled_compile_s": [round(x, 4) for x in comp["unrolled"]],
                           "scanned_compile_s": [round(x, 4) for x in comp["scan"]]}}
        log(f"8B {row['bucket']}: compile unrolled {row['unrolled_compile_s']:.2f}s scanned "
            f"{row['scanned_compile_s']:.2f}s ({row['compile_ratio']:.2f}x)")
        rows.append(row)
    return rows


def first_decode_worker(model: str, cache: str, batch: int, gen_len: int) -> dict[str, Any]:
    """In this (fresh) process: the first decode over random weights of `model`'s shape."""
    from dlm_jax._model import Model
    from dlm_jax.api import jax_executor, stored_tokenizer

    t0 = time.perf_counter()
    cfg, _ = dlm_jax.load_config(model, eos_token_id=None)  # random weights: no early end
    net = dlm_jax.init_model(cfg, seed=0)
    m = Model(net, stored_tokenizer(model), executor=jax_executor(net))
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.mask_token_id, 128).tolist() for _ in range(batch)]
    dc = dlm_jax.decode_config(gen_len=gen_len, block_len=32, cache=cache, rule="threshold", threshold=0.9)
    t0 = time.perf_counter()
    out = m.decoder.decode(prompts, dc)
    s = out.stats
    return {"model": model, "cache": cache, "batch": batch, "layers": m.executor.layers,
            "first_decode_s": round(time.perf_counter() - t0, 3), "setup_s": round(load_s, 3), "nfe": s.nfe,
            "buckets": len(s.buckets), "compiles": s.compiles, "compile_s": round(s.compile_seconds, 3),
            "compile_wait_s": round(s.compile_wait_seconds, 3), "steps_s": round(sum(s.step_seconds), 3)}


def first_decode(model: str, cache: str, batch: int, layers: str, *, gen_len: int = 256) -> dict[str, Any]:
    """`first_decode_worker` in a new process (`DLM_JAX_LAYERS=layers`, no persistent cache)."""
    import subprocess

    env = {**os.environ, "DLM_JAX_CACHE_DIR": "off", "DLM_JAX_LAYERS": layers}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--first-decode-worker", model, cache, str(batch),
           str(gen_len)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"first decode of {model} ({cache}, {layers}) failed: {done.stderr[-1000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def environment() -> dict[str, Any]:
    return {**machine(), "jax": jax.__version__, "flax": __import__("flax").__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "jax_compilation_cache_dir": jax.config.jax_compilation_cache_dir,
            "jax_enable_compilation_cache": jax.config.jax_enable_compilation_cache,
            "DLM_JAX_CACHE_DIR": os.environ.get("DLM_JAX_CACHE_DIR")}


NOTE = ("CPU backend (XLA:CPU), on a shared machine (other jobs ran alongside). "
        "GPU compile times differ (XLA:GPU takes 8-12 s per bucket at LLaDA-8B, "
        "32 layers); read the unrolled/scanned ratio and its growth with layers, not the seconds. "
        "lower = Python trace + StableHLO lowering; compile = XLA compile of the lowered module; "
        "medians over the repeats, the variants alternating.")


def report(rows: list[dict[str, Any]], key: BucketKey, args: dict[str, Any]) -> dict[str, Any]:
    return {"benchmark": "compile_scan", "note": NOTE, "environment": environment(), "bucket": str(key),
            "args": args, "rows": rows}


def markdown(rep: dict[str, Any]) -> str:
    env = rep["environment"]
    lines = [
        "# Decode step compile time: layers unrolled vs under a scan",
        "",
        f"Machine: {env['cpu']}, {env['cores']} cores; jax {env['jax']}, flax {env['flax']}, "
        f"backend `{env['backend']}`; bucket `{rep['bucket']}` (full logits); persistent compilation cache "
        f"off (`jax_compilation_cache_dir` = {env['jax_compilation_cache_dir']}).",
        "",
        f"Note: {rep['note']}",
        "",
        "| layers | width | unrolled lower s | unrolled compile s | scanned lower s | scanned compile s "
        "| compile ratio | total ratio | unrolled step ms | scanned step ms | step ratio | max abs diff "
        "| compile ratio of mins | step ms, mins (unrolled / scanned) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rep["rows"]:
        lines.append(
            f"| {r['layers']} | {r['d_model']} | {r['unrolled_lower_s']:.3f} | {r['unrolled_compile_s']:.3f} "
            f"| {r['scanned_lower_s']:.3f} | {r['scanned_compile_s']:.3f} | {r['compile_ratio']:.2f}x "
            f"| {r['total_ratio']:.2f}x | {r['unrolled_step_ms']:.2f} | {r['scanned_step_ms']:.2f} "
            f"| {r['step_ratio']:.2f}x | {r['max_abs_diff']:.2e} | {r['compile_ratio_min']:.2f}x "
            f"| {r['unrolled_step_min_ms']:.2f} / {r['scanned_step_min_ms']:.2f} |")
    lines += ["", "Compile ratios are unrolled / scanned (above 1: the scan compiles faster); step ratios "
              "scanned / unrolled (above 1: the scanned step runs slower). Seconds and ms are medians (compiles: "
              "of the repeats; steps: of the timed calls, the variants taking turns); the last two columns use "
              "the minima, less sensitive to other jobs on this shared machine. Widths: "
              + "; ".join(sorted({f"d {r['d_model']}: {r['n_heads']} heads, ffn {r['ffn_hidden']}, "
                                  f"vocab {r['vocab']}" for r in rep["rows"]})) + "."]
    if rep.get("llada_8b"):
        lines += ["", "## The JAX executor's resident step at the LLaDA-8B shape", "",
                  "`JaxExecutor(model, layers=\"unrolled\" | \"scan\")` over an abstract model (d 4096, 32 layers, "
                  "32 heads, MLP 12288, vocab 126464, bfloat16; no weights allocated), its resident step (gather, "
                  f"step, scatter) lowered and compiled on this CPU for a decode of {SLOTS} slots; medians of "
                  f"{rep['llada_8b']['repeats']} compiles per variant, alternating. Temp: the compiled program's "
                  "scratch memory (XLA's memory analysis); XLA:CPU runs bfloat16 dots in float32, so here it "
                  "holds float32 copies of the weights: read the difference between the variants, not the size "
                  "a GPU needs.", "",
                  "| bucket | unrolled lower s | unrolled compile s | scanned lower s | scanned compile s "
                  "| compile ratio | total ratio | temp MB (unrolled / scanned) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rep["llada_8b"]["rows"]:
            lines.append(f"| `{r['bucket']}` | {r['unrolled_lower_s']:.3f} | {r['unrolled_compile_s']:.3f} "
                         f"| {r['scanned_lower_s']:.3f} | {r['scanned_compile_s']:.3f} | {r['compile_ratio']:.2f}x "
                         f"| {r['total_ratio']:.2f}x | {r['unrolled_temp_mb']} / {r['scanned_temp_mb']} |")
    if rep.get("first_decode"):
        lines += ["", "## The first decode of a fresh process", "",
                  "Random weights of each checkpoint's shape, prompt 128 + generation 256, blocks of 32, threshold "
                  "0.9, persistent compilation cache off, background compile threads as the machine's default "
                  f"(`DLM_JAX_COMPILE_THREADS`: {os.environ.get('DLM_JAX_COMPILE_THREADS', 'unset')}; none under "
                  "4 cores). Seconds of one run each.", "",
                  "| model | cache | batch | layers | first decode s | buckets | compiles | compile s | waited s "
                  "| steps s |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in rep["first_decode"]:
            lines.append(f"| {r['model']} | {r['cache']} | {r['batch']} | {r['layers']} | {r['first_decode_s']:.2f} "
                         f"| {r['buckets']} | {r['compiles']} | {r['compile_s']:.2f} | {r['compile_wait_s']:.2f} "
                         f"| {r['steps_s']:.2f} |")
    if "wall_s" in rep:
        lines += ["", f"Wall time of the run: {rep['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    widths = sorted({r["d_model"] for r in rep["rows"]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, d in enumerate(widths):
        rows = sorted((r for r in rep["rows"] if r["d_model"] == d), key=lambda r: r["layers"])
        xs = [r["layers"] for r in rows]
        for variant, style in (("unrolled", "-o"), ("scanned", "--s")):
            axes[0].plot(xs, [r[f"{variant}_compile_s"] for r in rows], style, color=colors[i],
                         label=f"d {d} {variant}")
            axes[1].plot(xs, [r[f"{variant}_total_s"] for r in rows], style, color=colors[i],
                         label=f"d {d} {variant}")
    for ax, title in ((axes[0], "XLA compile (s)"), (axes[1], "trace + lower + compile (s)")):
        ax.set_xlabel("layers")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.set_xticks(sorted({r["layers"] for r in rep["rows"]}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    env = rep["environment"]
    fig.suptitle(f"decode step {rep['bucket']}, layers unrolled vs jax.lax.scan — CPU backend "
                 f"({env['cpu']}, {env['cores']} cores, jax {env['jax']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


WIDTHS = {256: (4, 768), 1024: (16, 3072)}  # d_model -> (heads, ffn hidden)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/compile_scan", help="output path stem")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--widths", type=int, nargs="+", default=[256, 1024], help="d_model values (head width 64, ffn 3d)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--cache", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="compiles per variant and case (median)")
    p.add_argument("--steps", type=int, default=10, help="timed calls per variant and case (median)")
    p.add_argument("--llada-8b-repeats", type=int, default=3,
                   help="compiles per variant of each resident step at the LLaDA-8B shape (0: skip)")
    p.add_argument("--first-decode", nargs="*", default=["models/llada-tiny", "models/llada-12m"],
                   help="checkpoints whose first decode in a fresh process is measured (none: skip)")
    p.add_argument("--first-decode-worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.first_decode_worker:
        model, cache, batch, gen = args.first_decode_worker
        row = first_decode_worker(model, cache, int(batch), int(gen))
        print(json.dumps(row))
        return row
    disable_persistent_cache()
    assert jax.config.jax_compilation_cache_dir is None, "the persistent cache must be off"
    key = BucketKey(batch=args.batch, window=args.window, cache=args.cache, rows=args.window, full_logits=True)
    t_start = time.perf_counter()
    # A throwaway compile first: the process's one-off XLA start-up is not charged to a case.
    measure(model_config(1, 64, heads=2, ffn=128, vocab=args.vocab), key, repeats=1, steps=1)
    rows = []
    for d in args.widths:
        heads, ffn = WIDTHS.get(d, (max(1, d // 64), 3 * d))
        for n in args.layers:
            cfg = model_config(n, d, heads=heads, ffn=ffn, vocab=args.vocab)
            row = measure(cfg, key, repeats=args.repeats, steps=args.steps)
            log(f"d {d} L {n}: compile unrolled {row['unrolled_compile_s']:.2f}s scanned "
                f"{row['scanned_compile_s']:.2f}s ({row['compile_ratio']:.2f}x); lower "
                f"{row['unrolled_lower_s']:.2f}s / {row['scanned_lower_s']:.2f}s; step "
                f"{row['unrolled_step_ms']:.1f} / {row['scanned_step_ms']:.1f} ms; diff {row['max_abs_diff']:.1e}")
            rows.append(row)
    rep = report(rows, key, vars(args))
    if args.llada_8b_repeats:
        rep["llada_8b"] = {"config": LLADA_8B, "repeats": args.llada_8b_repeats,
                           "rows": measure_resident(dlm_jax.ModelConfig(**LLADA_8B),
                                                    repeats=args.llada_8b_repeats)}
    rep["first_decode"] = []
    for model in args.first_decode:
        for cache in ("prefix", "dual"):
            for layers in ("unrolled", "scan"):
                row = first_decode(model, cache, 1, layers)
                log(f"first decode {model} {cache} {layers}: {row['first_decode_s']:.2f}s, waited "
                    f"{row['compile_wait_s']:.2f}s for {row['compiles']} compiles")
                rep["first_decode"].append(row)
    rep["wall_s"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rep, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rep))
    plot(rep, out.with_suffix(".png"))
    print(json.dumps(rep, indent=2))
    return rep


if __name__ == "__main__":
    main()

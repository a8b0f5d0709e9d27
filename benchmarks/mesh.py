"""Decoding on a device mesh: step time and per-device memory of a 150M-parameter model at
tp 1/2/4/8, against the one-device executor, with the same tokens. A functional figure.

    .venv/bin/python benchmarks/mesh.py [--tp 1 2 4 8] [--repeats 3] [--small]
        [--out benchmarks/results/mesh]

The model: random float32 weights (`dlm_jax.models._params.init_model`) of a bidirectional
LLaDA-style config with the byte tokenizer's vocabulary (264, mask <|mask|>): d_model 1024,
13 layers, 16 heads, 8 K/V heads (head width 64), SwiGLU 2816: 154M parameters, heads and K/V
heads divisible by 8. As `dlm_jax.testing.sharp_model` does, the weights are then made
position-sensitive and confident (mask embedding zero, RoPE base 4, q/k and the head scaled):
plain random weights predict one token everywhere, one per step, which would make "identical
tokens" a weak check; these commit 1 to 6 varied tokens a step, so the threshold's decisions
are compared too. `--small` is a 4-layer d_model 128 twin and one timed decode (a smoke run
for tests/benchmarks/test_mesh.py).

Per executor, one after the other: the one-device `JaxExecutor(model)` (the baseline), then
`JaxExecutor(model, mesh="tp=N")` for each N of `--tp` (parameters split by the partition rules
training uses, the K/V cache by its heads: `dlm_jax.executors.sharding`). Each decodes one
32-token prompt with generation 64, block 32, the fast-dllm preset (prefix cache, threshold
0.9): one untimed decode first (it compiles), then `--repeats` timed decodes. Recorded: the step
time (decode seconds / NFE; median and min), the executor's time per step (the mean of
`DecodeStats.step_seconds`, median over the decodes; the rest of a step is the host's), NFE,
the tokens (asserted equal to the baseline's, NFE too), the compiles and their seconds
(`executor.build_counts()`; persistent compilation cache off unless `--persistent-cache`),
per-device parameter bytes (min / max over the mesh's devices) and the dense layers' kernels
(attention q/k/v/o, FFN gate/up/down) per device against their total / tp, and per-device K/V
bytes of the decode's cache (`executor.open` for prompt + generation positions: its K and V
arrays' addressable shards). Where `dlm_jax.planner` is importable, its per-device weight
figure for each mesh, and the seconds it takes to plan LLaDA2.0-flash's shipped config
(`examples/configs/llada2.0-flash/config.json`) for 8 devices of 80 GB.

On a CPU the script asks XLA for 8 host devices (`--xla_force_host_platform_device_count=8`,
set before JAX loads unless XLA_FLAGS already names a count). Those devices share this
machine's cores: the step times show what the sharded program costs over the one-device one
(its collectives, its partitioning), not a speed-up. On a GPU (`jax.default_backend() ==
"gpu"`) the meshes are those the visible GPUs allow: on one GPU, tp=1 against no mesh, the
sharded program's overhead at tp=1.

Expert parallelism (`--ep`, default 2 4 8; none with `--small`): the shipped MoE model
`models/moe-tiny` (32 routed experts, 4 per token) on `ep=N` meshes with each way of bringing
routed rows to their experts (`JaxExecutor(expert_exchange=...)`): "psum" (every device computes
its own experts for all rows, partial outputs summed: one all-reduce of the rows per MoE layer)
and "all_to_all" (each device sends its share of the rows' assignments to the experts' devices
and gets the results back, then the rows are gathered). Per case: a 4-prompt batch decoded in
one batched call per step (`rows="batched"`, generation 64, fast-dllm), its tokens against one
device's, the step time (median of `--repeats` decodes), and the bytes the collectives of the
compiled step program move (their output shapes read from the program's HLO after SPMD
partitioning, summed per kind: one pass of the step, each MoE layer once).

Data parallelism (`--dp`, default 2; none with `--small`): the shipped `models/llada-tiny`, 16
prompts through the continuous-batching engine (`max_batch` 8, generation 32, fast-dllm-dual),
on one device and on `dp=N` meshes, with the CPU's row forms (`rows="each"`, gathered attention)
and a GPU's (`rows="batched"`, the cache read in place: "split"). On each mesh twice: with the
engine placing requests by replica (each replica computes its own rows over its own cache rows)
and with an engine that does not (`engine_replicas = 1`: its calls' rows cross the replicas
and run the whole mesh's program, as every call did before the per-replica steps). Per case:
the seconds of the 16 requests (median of `--repeats` after one untimed run), tokens/s, the
tokens and per-request NFE against one device's, and the collective bytes of the largest of the
engine's step programs beside one cache row's K/V bytes.

Prints the JSON; writes <out>.json, <out>.md and <out>.png (step time and per-device weight MB
against tp) through a temporary file and a rename.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX loads: 8 host devices on a CPU
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dlm_jax  # noqa: E402
from _hardware import machine  # noqa: E402
from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402
from dlm_jax._model import Model  # noqa: E402
from dlm_jax._partition import param_name  # noqa: E402
from dlm_jax._tokenizer import ByteTokenizer  # noqa: E402
from dlm_jax.executors.jax_executor import JaxExecutor  # noqa: E402
from dlm_jax.executors.sharding import collective_bytes  # noqa: E402
from dlm_jax.models._params import init_model  # noqa: E402

PROMPT = "Decode past one device: tp=1..8."  # 32 bytes, 32 tokens of the byte tokenizer
FULL = dict(d_model=1024, n_layers=13, n_heads=16, n_kv_heads=8, ffn_hidden=2816)
SMALL = dict(d_model=128, n_layers=4, n_heads=8, n_kv_heads=8, ffn_hidden=256)
# (head, q/k) weight scales that make each model commit several varied tokens a step at
# threshold 0.9 (found by trying a few: full NFE 30 of 64 positions, small 29).
SHARPEN = {"full": (8.0, 4.0), "small": (20.0, 8.0)}
DENSE_KERNEL = re.compile(r"(attn\.(q|k|v|o)_proj|ffn\.(gate|up|down)_proj)\.kernel$")
FLASH_CONFIG = ROOT / "examples" / "configs" / "llada2.0-flash" / "config.json"
MB = 1e6
MOE_MODEL = ROOT / "models" / "moe-tiny"
MOE_PROMPTS = ["564+894=", "sort: 37 44 13 33 47 48", "66+76=", "12+9="]


REPLICA_MODEL = ROOT / "models" / "llada-tiny"
REPLICA_PROMPTS = ["564+894=", "sort: 37 44 13 33 47 48", "66+76=", "12+9=", "7+8=", "sort: 9 4 1 7", "100+23=",
                   "5+5=", "318+27=", "sort: 5 3 8", "41+59=", "sort: 12 7 30 2", "9+90=", "250+250=", "sort: 1 1 0",
                   "73+8="]
# (rows, attention): the CPU's defaults, and the forms a GPU runs (batched rows, the cache read in place)
REPLICA_FORMS = (("each", "gather"), ("batched", "split"))


class _Unplaced(JaxExecutor):
    """A JAX executor whose engine places no request by replica: its calls' rows cross the
    replicas, so each runs the whole mesh's program (how every engine call ran on a dp mesh
    before the per-replica steps)."""

    engine_replicas = 1


def _biggest_collectives(executor: JaxExecutor) -> dict[str, dict[str, int]]:
    per_program = [collective_bytes(executor._resident.get(k).as_text()) for k in executor._resident.keys]
    return max(per_program, key=lambda c: sum(v["bytes"] for v in c.values()), default={})


def run_replicas(dps: list[int], repeats: int, gen: int) -> dict[str, Any]:
    """Data parallelism through the engine: the replicas section of the module docstring."""
    handle = dlm_jax.load(REPLICA_MODEL, executor="jax")
    cfg = dlm_jax.preset("fast-dllm-dual", gen_len=gen)
    batch = 8
    mc = handle.model.config
    rows = []
    for form, attention in REPLICA_FORMS:
        base = None
        for dp in [1] + [d for d in dps if d <= len(jax.devices())]:
            for placed in ((True,) if dp == 1 else (True, False)):
                kind = JaxExecutor if placed else _Unplaced
                executor = kind(handle.model, mesh=None if dp == 1 else f"dp={dp}", rows=form, attention=attention)
                model = Model(handle.model, handle.tokenizer, executor=executor)
                warm = model.generate(REPLICA_PROMPTS, cfg, max_batch=batch)
                seconds = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    res = model.generate(REPLICA_PROMPTS, cfg, max_batch=batch)
                    seconds.append(time.perf_counter() - t0)
                base = base or warm
                biggest = _biggest_collectives(executor) if dp > 1 else {}
                tokens = sum(len(t) for t in res.token_ids)
                row = {"rows": form, "attention": attention, "dp": dp, "placed": placed,
                       "identical": warm.token_ids == base.token_ids and list(warm.stats.request_nfe)
                       == list(base.stats.request_nfe), "seconds_median": round(statistics.median(seconds), 4),
                       "tokens": tokens, "tokens_per_s": round(tokens / statistics.median(seconds), 1),
                       "calls": res.stats.nfe, "collectives": biggest,
                       "collective_bytes": sum(v["bytes"] for v in biggest.values()),
                       "row_kv_bytes": 2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * executor.capacity(
                           max(len(handle.tokenizer.encode(p)) for p in REPLICA_PROMPTS) + gen) * 4}
                assert row["identical"], f"dp={dp} {form}: tokens differ from one device"
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                executor.close()
    for r in rows:
        one = next(b for b in rows if b["rows"] == r["rows"] and b["dp"] == 1)
        r["speedup"] = round(one["seconds_median"] / r["seconds_median"], 3)
    return {"model": str(REPLICA_MODEL.relative_to(ROOT)), "prompts": len(REPLICA_PROMPTS), "max_batch": batch,
            "gen_len": gen, "preset": "fast-dllm-dual", "repeats": repeats, "rows": rows}


def run_experts(eps: list[int], repeats: int, gen: int) -> dict[str, Any]:
    """The expert-exchange comparison of the module docstring."""
    handle = dlm_jax.load(MOE_MODEL, executor="jax")
    cfg = dlm_jax.preset("fast-dllm", gen_len=gen)
    one = Model(handle.model, handle.tokenizer, executor=JaxExecutor(handle.model, rows="batched"))
    base = one.generate(MOE_PROMPTS, cfg, max_batch=len(MOE_PROMPTS))  # one device, rows batched alike
    rows = []
    for ep in [e for e in eps if e <= len(jax.devices())]:
        for exchange in ("psum", "all_to_all"):
            executor = JaxExecutor(handle.model, mesh=f"ep={ep}", rows="batched", expert_exchange=exchange)
            model = Model(handle.model, handle.tokenizer, executor=executor)
            warm = model.generate(MOE_PROMPTS, cfg, max_batch=len(MOE_PROMPTS))
            step_ms = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                res = model.generate(MOE_PROMPTS, cfg, max_batch=len(MOE_PROMPTS))
                step_ms.append(1e3 * (time.perf_counter() - t0) / res.stats.nfe)
            biggest = _biggest_collectives(executor)
            rows.append({"ep": ep, "exchange": exchange, "identical": warm.token_ids == base.token_ids
                         and warm.stats.nfe == base.stats.nfe, "nfe": warm.stats.nfe,
                         "step_ms_median": round(statistics.median(step_ms), 3),
                         "programs": len(executor._resident.keys), "collectives": biggest,
                         "collective_bytes": sum(v["bytes"] for v in biggest.values())})
            assert rows[-1]["identical"], f"ep={ep} {exchange}: tokens differ from one device"
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            executor.close()
    return {"model": str(MOE_MODEL.relative_to(ROOT)), "experts": handle.config.n_experts,
            "experts_per_token": handle.config.n_experts_per_tok, "prompts": len(MOE_PROMPTS), "gen_len": gen,
            "rows": rows}


def model_config(*, small: bool) -> dlm_jax.ModelConfig:
    tok = ByteTokenizer()
    return dlm_jax.ModelConfig(vocab_size=tok.vocab_size, mask_token_id=tok.mask_id, eos_token_id=tok.eos_id,
                               max_seq_len=1024, attention="bidirectional", rope_theta=4.0,
                               **(SMALL if small else FULL))


def make_model(cfg: dlm_jax.ModelConfig, *, small: bool, seed: int = 0):
    """`init_model(cfg)` made position-sensitive and confident (`dlm_jax.testing.sharp_model`'s
    recipe): the mask token's embedding zero, so a masked slot is a pure attention read-out,
    sharp attention over a fast RoPE (`cfg.rope_theta` 4), and a scaled head."""
    head, qk = SHARPEN["small" if small else "full"]
    scale = {"lm_head.kernel": head, "q_proj": qk, "k_proj": qk}
    params = dlm_jax.get_params(init_model(cfg, seed=seed))
    params = {k: v * next((f for key, f in scale.items() if key in k), 1.0) for k, v in params.items()}
    params["embed.embedding"] = params["embed.embedding"].copy()
    params["embed.embedding"][cfg.mask_token_id] = 0.0
    return dlm_jax.model_from_params(cfg, params)


def disable_persistent_cache() -> None:
    """Every compile real: no persistent XLA cache read or written by this process."""
    os.environ["DLM_JAX_CACHE_DIR"] = "off"
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)


def parameter_names(model) -> list[str]:
    """Dotted names of the model's state leaves, in the order the executor flattens them."""
    paths, _ = jax.tree_util.tree_flatten_with_path(nnx.split(model)[1])
    return [param_name(path) for path, _ in paths]


def per_device(arrays) -> dict[str, int]:
    """{device: bytes of `arrays`' shards on it}."""
    out: dict[str, int] = {}
    for a in arrays:
        for shard in a.addressable_shards:
            out[str(shard.device)] = out.get(str(shard.device), 0) + shard.data.nbytes
    return out


def memory(executor: JaxExecutor, names: list[str], tp: int, cfg: dlm_jax.ModelConfig, slots: int) -> dict[str, Any]:
    """Per-device parameter bytes (all, and the dense kernels against their total / tp) and
    per-device K/V bytes of a one-row decode cache of `slots` positions."""
    leaves = executor._leaves  # the arrays the compiled programs take, as placed on the mesh
    assert len(leaves) == len(names), (len(leaves), len(names))
    weights = per_device(leaves)
    dense = per_device([leaf for leaf, name in zip(leaves, names) if DENSE_KERNEL.search(name)])
    dense_total = sum(leaf.nbytes for leaf, name in zip(leaves, names) if DENSE_KERNEL.search(name))
    positions = np.arange(slots, dtype=np.int32)[None]
    cache = executor.open(cfg, positions, np.ones_like(positions, bool))
    try:
        kv = per_device([*cache.k, *cache.v])
        cache_slots = cache.slots
    finally:
        cache.close()
    ideal = dense_total / tp
    return {"weights_bytes_min": min(weights.values()), "weights_bytes_max": max(weights.values()),
            "weights_bytes_total": sum(leaf.nbytes for leaf in leaves), "devices": len(weights),
            "dense_kernel_bytes_total": dense_total,
            "dense_kernel_ratio_min": round(min(dense.values()) / ideal, 4),
            "dense_kernel_ratio_max": round(max(dense.values()) / ideal, 4),
            "kv_bytes_min": min(kv.values()), "kv_bytes_max": max(kv.values()), "kv_slots": cache_slots}


def planned_weights(cfg: dlm_jax.ModelConfig, tp: int) -> int | None:
    """The planner's per-device weight bytes for tp (None without `dlm_jax.planner`)."""
    try:
        from dlm_jax.planner import weight_bytes_per_device
    except ImportError:
        return None
    return int(weight_bytes_per_device(cfg, f"tp={tp}"))


def run_case(label: str, model, tok, cfg: dlm_jax.ModelConfig, decode_cfg, *, mesh: str | None, tp: int,
             repeats: int, names: list[str]) -> dict[str, Any]:
    """One executor: built, warmed by an untimed decode, then `repeats` timed decodes."""
    t0 = time.perf_counter()
    executor = JaxExecutor(model, mesh=mesh)
    build_s = time.perf_counter() - t0
    handle = Model(model, tok, executor=executor)
    t0 = time.perf_counter()
    warm = handle.generate([PROMPT], decode_cfg)
    warm_s = time.perf_counter() - t0
    built = executor.build_counts()
    seconds, step_ms, exec_ms, results = [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = handle.generate([PROMPT], decode_cfg)
        dt = time.perf_counter() - t0
        seconds.append(dt)
        step_ms.append(1e3 * dt / res.stats.nfe)
        exec_ms.append(1e3 * sum(res.stats.step_seconds) / len(res.stats.step_seconds))
        results.append(res)
    for res in results:  # a warmed decode compiles nothing and repeats itself
        assert res.token_ids == warm.token_ids and res.stats.nfe == warm.stats.nfe, f"{label}: decodes differ"
        assert res.stats.compiles == 0, f"{label}: a timed decode compiled {res.stats.compiles} programs"
    row = {"case": label, "mesh": mesh, "tp": tp, "nfe": warm.stats.nfe, "tokens": warm.token_ids[0],
           "step_ms_median": round(statistics.median(step_ms), 3), "step_ms_min": round(min(step_ms), 3),
           "executor_step_ms": round(statistics.median(exec_ms), 3),
           "decode_s": [round(s, 4) for s in seconds], "executor_build_s": round(build_s, 3),
           "warm_decode_s": round(warm_s, 3), "compiles": built.compiles,
           "compile_s": round(built.compile_seconds, 3),
           **memory(executor, names, tp, cfg, len(tok.encode(PROMPT)) + decode_cfg.gen_len)}
    planned = planned_weights(cfg, tp) if mesh is not None else None
    if planned is not None:
        row["planned_weights_bytes"] = planned
    executor.close()
    return row


def plan_flash() -> dict[str, Any]:
    """Seconds `dlm_jax.planner.plan` takes for LLaDA2.0-flash's config on 8 x 80 GB, and its
    pick; a note instead where the planner or the config is absent."""
    try:
        from dlm_jax import planner
    except ImportError:
        return {"skipped": "dlm_jax.planner is not importable in this checkout"}
    if not FLASH_CONFIG.is_file():
        return {"skipped": f"{FLASH_CONFIG.relative_to(ROOT)} is absent in this checkout"}
    t0 = time.perf_counter()
    config, _family = planner.read_config(FLASH_CONFIG)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = planner.plan(config, devices=8, memory_gib=80)
    plan_s = time.perf_counter() - t0
    pick = plan.pick
    return {"config": str(FLASH_CONFIG.relative_to(ROOT)), "devices": 8, "memory_gib": 80,
            "read_config_s": round(read_s, 4), "plan_s": round(plan_s, 4), "total_s": round(read_s + plan_s, 4),
            "parameters": plan.parameters, "pick": None if pick is None else planner.full_name(pick.mesh),
            "pick_weights_bytes": None if pick is None else pick.weights,
            "fitting": [planner.full_name(m.mesh) for m in plan.fitting]}


def environment() -> dict[str, Any]:
    return {**machine(), "load_average_after": [round(x, 2) for x in os.getloadavg()], "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "devices": len(jax.devices()),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "jax_compilation_cache_dir": jax.config.jax_compilation_cache_dir}


def note(backend: str) -> str:
    if backend == "cpu":
        return ("The host devices are XLA's CPU devices (--xla_force_host_platform_device_count=8): all of them "
                "share this machine's cores, so a mesh of N devices computes with the same cores as one device. "
                "The step times are a functional figure, what the sharded program costs over the one-device "
                "program (its partitioning and collectives), not a speed claim.")
    return (f"One {backend.upper()} device: the mesh of tp=1 runs the sharded program (explicit shardings, "
            "collectives of size one) against the one-device executor; the ratio is its overhead.")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not args.persistent_cache:
        disable_persistent_cache()
    devices = len(jax.devices())
    tps = [t for t in args.tp if t <= devices]
    skipped = [t for t in args.tp if t > devices]
    cfg = model_config(small=args.small)
    tok = ByteTokenizer()
    assert len(tok.encode(PROMPT)) == 32
    model = make_model(cfg, small=args.small)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {n_params:,} parameters, {devices} {jax.default_backend()} devices", file=sys.stderr, flush=True)
    names = parameter_names(model)
    decode_cfg = dlm_jax.preset("fast-dllm", gen_len=args.gen, block_len=args.block)
    t_start = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    rows = [run_case("one device", model, tok, cfg, decode_cfg, mesh=None, tp=1, repeats=args.repeats, names=names)]
    base = rows[0]
    print(json.dumps({k: v for k, v in base.items() if k != "tokens"}), file=sys.stderr, flush=True)
    for tp in tps:
        row = run_case(f"tp={tp}", model, tok, cfg, decode_cfg, mesh=f"tp={tp}", tp=tp, repeats=args.repeats,
                       names=names)
        assert row["tokens"] == base["tokens"] and row["nfe"] == base["nfe"], (
            f"tp={tp}: tokens or NFE differ from one device ({row['nfe']} vs {base['nfe']} NFE)")
        row["identical"] = True
        row["step_ratio"] = round(row["step_ms_median"] / base["step_ms_median"], 3)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), file=sys.stderr, flush=True)
    base["identical"] = True
    base["step_ratio"] = 1.0
    return {"benchmark": "benchmarks/mesh.py", "command": " ".join(["benchmarks/mesh.py", *sys.argv[1:]]),
            "environment": {**environment(), "load_average_before": load_before},
            "note": note(jax.default_backend()),
            "model": {**{k: getattr(cfg, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                                      "ffn_hidden", "attention", "dtype")},
                      "rope_theta": cfg.rope_theta, "sharpen": SHARPEN["small" if args.small else "full"],
                      "parameters": n_params, "small": args.small},
            "decode": {"preset": "fast-dllm", "prompt_tokens": 32, "gen_len": args.gen, "block_len": args.block,
                       "repeats": args.repeats},
            "tp_skipped": skipped, "identical": all(r["identical"] for r in rows), "rows": rows,
            "planner": plan_flash(),
            "experts": run_experts(args.ep, args.repeats, args.gen) if args.ep else None,
            "replicas": run_replicas(args.dp, args.repeats, 32) if args.dp else None,
            "wall_s": round(time.perf_counter() - t_start, 1)}


def _ops(row: dict[str, Any]) -> str:
    """A row's collectives as "kind count, ..."."""
    return ", ".join(f"{k} {v['ops']}" for k, v in sorted(row["collectives"].items()))


def markdown(rep: dict[str, Any]) -> str:
    env, m, d = rep["environment"], rep["model"], rep["decode"]
    lines = [
        "# Decoding on a device mesh",
        "",
        f"`{rep['command']}`: random float32 weights, {m['parameters'] / 1e6:.1f}M parameters (d_model "
        f"{m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads, {m['n_kv_heads']} K/V heads, SwiGLU "
        f"{m['ffn_hidden']}, vocab {m['vocab_size']}, {m['attention']}; sharpened as `dlm_jax.testing.sharp_model`: "
        f"head x{m['sharpen'][0]:g}, q/k x{m['sharpen'][1]:g}, RoPE base {m['rope_theta']:g}); one prompt of "
        f"{d['prompt_tokens']} tokens, "
        f"generation {d['gen_len']}, block {d['block_len']}, {d['preset']}; one untimed decode per executor, "
        f"then {d['repeats']} timed (step = decode seconds / NFE, median).",
        "",
        "| executor | step ms | ratio to one device | executor ms / step | NFE | weights MB per device (min-max) "
        "| dense kernels / (total / tp) | K/V MB per device | compiles (s) | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rep["rows"]:
        lo, hi = r["weights_bytes_min"] / MB, r["weights_bytes_max"] / MB
        weights = f"{lo:.1f}" if abs(hi - lo) < 0.05 else f"{lo:.1f}-{hi:.1f}"
        lines.append(
            f"| {r['case']} | {r['step_ms_median']:.1f} | {r['step_ratio']:.2f}x | {r['executor_step_ms']:.1f} "
            f"| {r['nfe']} | {weights} | {r['dense_kernel_ratio_max']:.3f} | {r['kv_bytes_max'] / MB:.2f} "
            f"| {r['compiles']} ({r['compile_s']:.1f}) | {'yes' if r['identical'] else 'no'} |")
    lines += ["", rep["note"], "",
              "Weights: the parameters each device holds (the one-device executor: all of them); dense kernels: "
              "the attention and FFN kernels on the fullest device over their total / tp (1.000: split evenly); "
              f"K/V: the K and V arrays of a one-row decode cache ({rep['rows'][0]['kv_slots']} slots) on the "
              "fullest device. Identical: the tokens and NFE equal the one-device decode's."]
    planned = [r for r in rep["rows"] if "planned_weights_bytes" in r]
    if planned:
        lines += ["", "The planner's weight bytes per device (`dlm_jax.planner.weight_bytes_per_device`) against "
                  "the measured fullest device: " + "; ".join(
                      f"tp={r['tp']}: {r['planned_weights_bytes']:,} planned, {r['weights_bytes_max']:,} measured"
                      for r in planned) + "."]
    p = rep["planner"]
    if "skipped" in p:
        lines += ["", f"Planner on LLaDA2.0-flash: skipped ({p['skipped']})."]
    else:
        lines += ["", f"Planner on LLaDA2.0-flash (`{p['config']}`, {p['parameters'] / 1e9:.1f}B parameters) for "
                  f"{p['devices']} x {p['memory_gib']} GiB: {p['total_s'] * 1e3:.0f} ms (read config "
                  f"{p['read_config_s'] * 1e3:.0f} ms, plan {p['plan_s'] * 1e3:.0f} ms); picks {p['pick']}."]
    ex = rep.get("experts")
    if ex:
        lines += ["", "## Expert parallelism: psum or all-to-all", "",
                  f"`{ex['model']}` ({ex['experts']} routed experts, {ex['experts_per_token']} per token), "
                  f"{ex['prompts']} prompts in one batched call per step, generation {ex['gen_len']}, fast-dllm. "
                  "Collective bytes: the output bytes of the collectives in the step program's HLO (the largest of "
                  "the decode's step programs), one pass of the step.", "",
                  "| ep | exchange | step ms | collective MB per step | ops (kind: count) | identical |",
                  "|---:|---|---:|---:|---|---|"]
        for r in ex["rows"]:
            lines.append(f"| {r['ep']} | {r['exchange']} | {r['step_ms_median']:.1f} | "
                         f"{r['collective_bytes'] / MB:.3f} | {_ops(r)} | {'yes' if r['identical'] else 'no'} |")
    rp = rep.get("replicas")
    if rp:
        lines += ["", "## Data parallelism: each replica its own requests", "",
                  f"`{rp['model']}`, {rp['prompts']} prompts through the engine (`max_batch` {rp['max_batch']}, "
                  f"generation {rp['gen_len']}, {rp['preset']}), median of {rp['repeats']} runs after one untimed. "
                  "Placed: the engine places each request's cache row in a replica and lays each call out by "
                  "replica, so each replica computes its own rows (the per-replica step); unplaced: the same "
                  "executor with an engine that does not, whose calls run the whole mesh's program. Collective "
                  "bytes: as above, the largest of the engine's step programs; a cache row's K/V for scale.", "",
                  "| rows, attention | mesh | placed | seconds | tokens/s | vs one device | collective KB per step "
                  "| ops (kind: count) | a row's K/V KB | identical |",
                  "|---|---|---|---:|---:|---:|---:|---|---:|---|"]
        for r in rp["rows"]:
            ops = _ops(r) or "-"
            mesh = "one device" if r["dp"] == 1 else f"dp={r['dp']}"
            placed = "-" if r["dp"] == 1 else ("yes" if r["placed"] else "no")
            lines.append(f"| {r['rows']}, {r['attention']} | {mesh} | {placed} | {r['seconds_median']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['collective_bytes'] / 1e3:.1f} | {ops} | "
                         f"{r['row_kv_bytes'] / 1e3:.0f} | {'yes' if r['identical'] else 'no'} |")
    if rep["tp_skipped"]:
        lines += ["", f"Not run (more devices than the {env['devices']} visible): tp "
                  + ", ".join(map(str, rep["tp_skipped"])) + "."]
    lines += ["", f"Machine: {env['cpu']}, {env['cores']} cores; backend `{env['backend']}` ({env['device_kind']}, "
              f"{env['devices']} devices); jax {env['jax']}, Python {env['python']}; persistent compilation cache "
              f"{env['jax_compilation_cache_dir'] or 'off'}; load average (1, 5, 15 min) "
              f"{env['load_average_before']} before, "
              f"{env['load_average_after']} after (other jobs shared the cores). Wall time of the run: "
              f"{rep['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def plot(rep: dict[str, Any]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._plots import png_bytes

    base = rep["rows"][0]
    rows = [r for r in rep["rows"] if r["mesh"] is not None]
    tps = [r["tp"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(tps, [r["step_ms_median"] for r in rows], "-o", label="mesh tp=N")
    axes[0].axhline(base["step_ms_median"], ls="--", color="gray", label="one device, no mesh")
    axes[0].set_ylabel("ms per step (median)")
    axes[0].set_title("step time")
    axes[1].plot(tps, [r["weights_bytes_max"] / MB for r in rows], "-o", label="fullest device")
    axes[1].plot(tps, [base["weights_bytes_max"] / MB / t for t in tps], ":", color="gray", label="total / tp")
    axes[1].set_ylabel("parameter MB per device")
    axes[1].set_title("weights per device")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(tps, [str(t) for t in tps])
        ax.set_xlabel("tp (devices)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    env = rep["environment"]
    fig.suptitle(f"{rep['model']['parameters'] / 1e6:.0f}M model on {env['devices']} {env['backend']} devices "
                 f"({env['cores']} cores shared)" if env["backend"] == "cpu" else
                 f"{rep['model']['parameters'] / 1e6:.0f}M model on {env['device_kind']}", fontsize=10)
    fig.tight_layout()
    return png_bytes(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="tensor-parallel sizes")
    p.add_argument("--repeats", type=int, help="timed decodes per executor (default 3; --small: 1)")
    p.add_argument("--gen", type=int, default=64, help="generation length")
    p.add_argument("--block", type=int, default=32, help="block length")
    p.add_argument("--small", action="store_true", help="a 4-layer d_model 128 model and one timed decode (smoke run)")
    p.add_argument("--persistent-cache", action="store_true",
                   help="keep JAX's persistent compilation cache as the environment sets it (default: off, so "
                        "the compile seconds are real compiles)")
    p.add_argument("--ep", type=int, nargs="*", help="expert-parallel sizes of the expert-exchange comparison "
                   "(default 2 4 8; --small: none; --ep with no size: none)")
    p.add_argument("--dp", type=int, nargs="*", help="data-parallel sizes of the replicas comparison "
                   "(default 2; --small: none; --dp with no size: none)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mesh"), help="output path stem")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.small else 3
    if args.ep is None:
        args.ep = [] if args.small else [2, 4, 8]
    if args.dp is None:
        args.dp = [] if args.small else [2]
    if args.repeats < 1 or any(t < 1 for t in args.tp):
        p.error("--repeats and --tp take whole numbers >= 1")
    rep = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), rep, indent=1)
    atomic_write(out.with_suffix(".md"), markdown(rep))
    atomic_write(out.with_suffix(".png"), plot(rep))
    print(json.dumps(rep, indent=1))
    return rep


if __name__ == "__main__":
    main()

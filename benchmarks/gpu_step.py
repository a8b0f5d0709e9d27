"""The compiled decode step at a model's shape: XLA's cost analysis, step times, kernel profile.

    .venv/bin/python benchmarks/gpu_step.py --abstract --out benchmarks/results/step_cost
    PYTHONPATH=. python3 benchmarks/gpu_step.py --out $OUT/gpu_step        (on a GPU)

Each case is one resident decode step of the JAX executor (`JaxExecutor`'s `_build_resident`:
the step of a decode whose K/V live on the device) at the LLaDA-8B shape (d 4096, 32 layers,
32 heads, MLP 12288, vocabulary 126464, bfloat16) in the setting of `benchmarks/gpu.py`:
prompt 128, generation 256, block 32, the step taken in the middle of the generation (block 4
of 8):

  refresh  the whole sequence as the window, nothing read, every slot written (the full
           forward that opens a block in both caches);
  prefix   the current block and everything after it as the window, the slots before it
           read (Fast-dLLM's prefix cache);
  dual     the current block as the window, every other slot read (the dual cache).

Variants: how the step reads the resident cache (`--attention`: in place, `split`, the
default; `gather`, the read slots copied out first; `cudnn`, `jax.nn.dot_product_attention`'s
fused kernel over a concatenated copy; `cudnn_split`, cuDNN's kernel over the cache where it
lies and over the window, merged by their log-sum-exps), the weights' storage (`--quant`, where
`dlm_jax.load` offers it), the layer loop (`--layers`, where the executor offers it) and the
projections (`--projections separate fused`: q/k/v and gate/up each one GEMM,
`dlm_jax.models._fuse`; each variant over weights of its own, as fusing changes a model).

Per case: XLA's cost analysis of the compiled step (FLOPs and bytes accessed, against the
weight bytes and the dense FLOPs 2 x parameters x window rows), and with weights (not
`--abstract`) the median of `--reps` timed steps, the weight-read limit (weight bytes over the
measured device-to-device copy bandwidth) and the roofline (the larger of bytes over bandwidth
and FLOPs over the peak), the compile seconds, and with `--profile` the device's ten costliest
kernels over `--profile-steps` steps with their share of the step's kernel time.

`--at` takes the steps at other blocks (a step whose program another already is, is left
out): `--kinds refresh prefix --at 0 1 2 3 4 5 6 7` is every program a prefix-cache decode of
this setting compiles, so `--threads` (the executor's background compile threads: 4 on a
16-core GPU machine), `--xla-cache DIR` (JAX's persistent cache as the executor enables it, with
XLA's per-fusion autotuning cache under it; off by default here) and `XLA_FLAGS` (recorded in
the result) time a cold first decode's compiles program by program; run again over the same
`--xla-cache`, the loads of a second process. Each timed case also reports its program's first
execution (`first_call_ms`: its kernels loaded and, on a GPU, its command buffers recorded),
which a process's first decode pays once per program.

`--abstract` builds nothing: the programs are lowered from `jax.ShapeDtypeStruct`s, so the
8B shape's cost analysis runs on any CPU. `--target h200` (or a `GpuTargetConfigProto` text
file: `benchmarks/targets/`, or one the lease writes from its device) compiles them with
XLA:GPU for that GPU on a machine without one (JAX's compile-only client; needs JAX's CUDA
plugin, `pip install "jax-cuda13-plugin[with-cuda]==<jax's version>"`): per program its compile
seconds without autotuning (XLA cannot time kernels without the device, so it takes its
default tiles) and the kernels one step launches, by kind (`_profile.hlo_kernels`): a
step's launches cost time outside the kernels, which a device profile shows (`gpu.md`).
No cost analysis there (XLA:GPU gives none without a device). On a GPU, `--write-target --out
PATH` writes that device's own config to PATH.txtpb (a lease's first part) for `--target
PATH.txtpb`. Writes <out>.json and <out>.md (and, with times, <out>.png) after every case, so a
run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dlm_jax  # noqa: E402
from _plots import png_bytes  # noqa: E402
from _profile import hlo_kernels, kernel_table, top_kernels  # noqa: E402
from dlm_jax._integrity import atomic_write  # noqa: E402
from dlm_jax.executors._compile import building_for, jitted  # noqa: E402
from dlm_jax.executors.jax_executor import JaxExecutor  # noqa: E402

try:  # an executor that reads its cache in place names its ways of reading it
    from dlm_jax.executors.jax_executor import RESIDENT_ATTENTION  # noqa: E402
except ImportError:  # a dlm-jax from before (the read slots gathered, then concatenated with the window)
    RESIDENT_ATTENTION = ("gather",)
try:  # (a tree from before fused projections: separate ones only)
    from dlm_jax.models._fuse import PROJECTIONS  # noqa: E402
except ImportError:
    PROJECTIONS = ("separate",)
from dlm_jax.models._params import _abstract_model, model_from_params, param_shapes  # noqa: E402
from dlm_jax.models._quant_kernel import DENSE_KERNEL_ENV, QUANT_KERNEL_ENV  # noqa: E402
from dlm_jax.models.quant import gpu_bytes  # noqa: E402
from dlm_jax.runtime.buckets import BucketKey, pad_axis  # noqa: E402
from dlm_jax.runtime.step import SlotStep  # noqa: E402

_T0 = time.perf_counter()
KINDS = ("refresh", "prefix", "dual")
SHAPES = {
    "llada-8b": dict(vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=12288,
                     mask_token_id=126336, max_seq_len=4096, rope_theta=500000.0, norm_eps=1e-5),
    "small": dict(vocab_size=1024, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=768,
                  mask_token_id=1000, max_seq_len=512, rope_theta=500000.0, norm_eps=1e-5),
    # 113M parameters: a model whose programs take a CPU seconds to compile (`first_decode.py`)
    "cpu-113m": dict(vocab_size=32768, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_hidden=2048,
                     mask_token_id=32000, max_seq_len=1024, rope_theta=500000.0, norm_eps=1e-5),
}
# LLaDA-8B's shape with its 32 query heads over 8 K/V heads (grouped as Llama 3 8B's are): a
# quarter of the K/V projections and cache, and the attention kernel's programs take 4 heads.
SHAPES["gqa-8b"] = {**SHAPES["llada-8b"], "n_kv_heads": 8}
# LLaDA2.0-mini's shape (16B parameters, 1.4B a token): 256 routed experts of width 512 a layer,
# 8 a token in 4 of 8 groups, one shared, the first layer dense (dlm_jax/checkpoint/_families.py).
SHAPES["moe-mini"] = dict(vocab_size=157184, d_model=2048, n_layers=20, n_heads=16, n_kv_heads=4, head_dim=128,
                          ffn_hidden=5120, ffn="moe", n_experts=256, n_experts_per_tok=8, moe_ffn_hidden=512,
                          n_shared_experts=1, router="sigmoid", router_bias=True, routed_scaling=2.5,
                          n_expert_groups=8, topk_groups=4, dense_layers=(0,), qk_norm=True,
                          partial_rotary_factor=0.5, mask_token_id=156895, max_seq_len=4096, rope_theta=600000.0,
                          norm_eps=1e-6)
# HBM TB/s and dense bf16 TFLOP/s by device name (datasheet; the copy bandwidth is measured).
DEVICES = (("H200", 4.8, 989.0), ("H100", 3.35, 989.0), ("A100", 2.0, 312.0))
TARGETS = Path(__file__).resolve().parent / "targets"  # GPU target configs by name (`--target`)


def compile_only_device(target: str):
    """The one device of a compile-only XLA:GPU client for `target` (a name in `TARGETS` or a
    `GpuTargetConfigProto` text file), on a machine without that GPU. JAX's own backends stay
    the CPU's (set before any is made)."""
    path = TARGETS / f"{target}.txtpb" if (TARGETS / f"{target}.txtpb").is_file() else Path(target)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TARGETS.glob("*.txtpb")))
        raise SystemExit(f"--target {target}: neither a known target ({known}) nor a file")
    jax.config.update("jax_platforms", "cpu")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=path.read_text(), topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - no CUDA plugin, or a config it cannot read
        raise SystemExit(f"--target {target}: no compile-only XLA:GPU client ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}); it needs JAX's CUDA plugin of JAX's version") from None
    return topology.devices[0]


def write_target(out: Path) -> int:
    """This machine's GPU as XLA's compile-only client takes it (`--target`): its
    `GpuTargetConfigProto`, text format, at `out`.txtpb; 1 on a backend without one."""
    from jax._src.lib import xla_client as xc

    config = getattr(xc.get_topology_for_devices(jax.devices()[:1]), "target_config", None)
    if not config:
        print(f"--write-target: JAX's {jax.default_backend()} backend has no GPU target config", file=sys.stderr)
        return 1
    atomic_write(out.with_suffix(".txtpb"), str(config))
    print(f"wrote {out.with_suffix('.txtpb')} ({jax.devices()[0].device_kind})")
    return 0


def plugin_versions() -> dict[str, str]:
    """The versions of JAX's CUDA plugins installed here (what compiles for `--target`)."""
    from importlib import metadata

    found = {}
    for name in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def on_device(specs, device):
    """`specs` (a pytree of `jax.ShapeDtypeStruct`s) placed on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
                        if isinstance(s, jax.ShapeDtypeStruct) else s, specs)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One step of a decode of `prompt` + `gen` slots, block `block`, at block `at`."""

    kind: str
    prompt: int = 128
    gen: int = 256
    block: int = 32
    at: int = 4

    @property
    def total(self) -> int:
        return self.prompt + self.gen

    def window(self) -> np.ndarray:
        start = self.prompt + self.at * self.block
        if self.kind == "refresh":
            return np.arange(self.total)
        if self.kind == "prefix":
            return np.arange(start, self.total)
        return np.arange(start, start + self.block)

    def read(self) -> np.ndarray:
        start = self.prompt + self.at * self.block
        if self.kind == "refresh":
            return np.zeros(0, np.int64)
        if self.kind == "prefix":
            return np.arange(start)
        return np.setdiff1d(np.arange(self.total), self.window())

    def rows(self) -> np.ndarray:
        """Window rows whose predictions are wanted: the current block's."""
        start = self.prompt + self.at * self.block
        return np.searchsorted(self.window(), np.arange(start, start + self.block))


def slot_step(executor: JaxExecutor, geo: Geometry, batch: int, *, seed: int = 0) -> SlotStep:
    """The step of `geo` for `batch` rows, padded to the bucket the executor runs it in
    (`JaxExecutor.read_bucket`: read in place, every step that reads the cache in the cache's
    slots)."""
    caps = executor.capabilities
    win, read, rows = geo.window(), geo.read(), geo.rows()
    key = BucketKey(caps.batches.select(batch), caps.windows.select(len(win)), caps.caches.select(len(read)),
                    caps.rows.select(len(rows)))
    b, w = key.batch, key.window
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, executor.config.vocab_size, (b, len(win)), dtype=np.int32)
    mask_id = executor.config.mask_token_id
    tokens[:, len(win) - geo.gen + geo.at * geo.block if geo.kind == "refresh" else 0:] = mask_id  # undecoded
    write = np.broadcast_to(win.astype(np.int32), (b, len(win))) if geo.kind == "refresh" else np.full(
        (b, len(win)), -1, np.int32)
    req = SlotStep(
        key=key, tokens=pad_axis(tokens, w, axis=1),
        positions=pad_axis(np.broadcast_to(win.astype(np.int32), (b, len(win))).copy(), w, axis=1),
        q_valid=pad_axis(np.ones((b, len(win)), bool), w, axis=1, value=False),
        read=pad_axis(read.astype(np.int32), key.cache, axis=0, value=-1),
        probes=np.zeros(w, bool), hide=np.full(w, -1, np.int32),
        write=pad_axis(np.ascontiguousarray(write), w, axis=1, value=-1),
        logit_rows=pad_axis(np.broadcast_to(rows.astype(np.int32), (b, len(rows))).copy(), key.rows, axis=1))
    return req.widened(executor.read_bucket(key, executor.capacity(geo.total)).cache)


def model_config(shape: str, dtype: str) -> dlm_jax.ModelConfig:
    return dlm_jax.ModelConfig(**SHAPES[shape], dtype=dtype, param_dtype=dtype)


def random_model(cfg: dlm_jax.ModelConfig, seed: int = 0):
    """The model of `cfg` with random weights made on the default device (nothing on the host):
    normal(0, 0.02) for matrices, ones for norm scales."""
    shapes = param_shapes(cfg)
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    params = {}
    for k, (name, spec) in zip(keys, shapes.items()):
        if name.endswith("scale"):
            params[name] = jnp.ones(spec.shape, spec.dtype)
        else:
            params[name] = (0.02 * jax.random.normal(k, spec.shape, jnp.float32)).astype(spec.dtype)
    return model_from_params(cfg, params)


def cost(compiled) -> dict[str, float | None]:
    """FLOPs and bytes accessed from XLA's cost analysis of a compiled program (after the
    backend's fusion: what the device's kernels read and write), or of a lowered one (the
    program as traced, every op's operands and result counted: no backend's choices)."""
    try:
        ca = compiled.cost_analysis()
    except Exception as e:  # noqa: BLE001 (a backend without it)
        return {"flops": None, "bytes_accessed": None, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    if isinstance(ca, list):
        ca = ca[0] if ca else None
    if not isinstance(ca, dict):  # XLA:GPU gives None for a lowered (not yet compiled) program
        return {"flops": None, "bytes_accessed": None, "error": f"no cost analysis ({type(ca).__name__})"}
    return {"flops": ca.get("flops"), "bytes_accessed": ca.get("bytes accessed")}


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of 10, over
    4 GiB on an accelerator (many times its cache), 64 MiB on a CPU."""
    x = jnp.ones((1 << (30 if jax.default_backend() != "cpu" else 24),), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    nbytes = x.nbytes
    del x
    return 2 * nbytes / statistics.median(ts)


def median_call_ms(call, reps: int) -> float:
    """Median ms of `reps` calls of `call` (which waits for its results), after one untimed."""
    call()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def request_transfers(executor: JaxExecutor, req: SlotStep, reps: int) -> dict[str, float]:
    """What a step's request costs to send and its predictions to read back, in one run: a
    program that computes nothing, called from the host with the request as its ten separate
    arrays and four [B, R] outputs read back (the step before `pack_request`), against the
    packed request and one [4, B, R] output (the step now); median ms of `reps` calls each."""
    b, r = req.logit_rows.shape

    def timed(fn, arrays) -> float:
        exe = jax.jit(fn, keep_unused=True).lower(*arrays).compile()  # (every argument sent)
        return median_call_ms(lambda: [np.asarray(o) for o in exe(*arrays)], reps)  # each output read back

    fields = [a for n, a in req.arrays().items() if n != "lora_gate"]
    return {"request_fields_ms": timed(lambda *a: tuple(jnp.full((b, r), i) + a[0][0, 0] for i in range(4)), fields),
            "request_packed_ms": timed(lambda p: (jnp.zeros((4, b, r), jnp.int32) + p[0, 0],),
                                       executor.resident_inputs(req))}


def probe_steps(executor: JaxExecutor, batches, kinds, blocks, *, seed: int = 0) -> dict[tuple, SlotStep]:
    """{(batch, kind, block): its step} for every combination whose program (bucket) no
    earlier one has: one step per program."""
    steps, seen = {}, set()
    for c in ((b, k, at) for b in batches for k in kinds for at in blocks):
        req = slot_step(executor, Geometry(c[1], at=c[2]), c[0], seed=seed)
        if req.key not in seen:  # another block's step of that program is left out
            seen.add(req.key)
            steps[c] = req
    return steps


def build_executor(model, attention: str, layers: str | None, projections: str = "separate") -> JaxExecutor:
    kw = {"attention": attention} if len(RESIDENT_ATTENTION) > 1 else {}
    if layers:
        kw["layers"] = layers
    return JaxExecutor(model, projections=projections, **kw)  # named: $DLM_JAX_PROJECTIONS does not decide


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.target:  # the executors built for a GPU, their programs compiled by a compile-only client
        target = compile_only_device(args.target)
        with building_for("gpu"):
            return _run(args, target)
    return _run(args, None)


def _run(args: argparse.Namespace, target) -> dict[str, Any]:
    cfg = model_config(args.shape, args.dtype)
    backend = jax.default_backend() if target is None else "gpu, compile only"
    dev = jax.devices()[0] if target is None else target
    name = getattr(dev, "device_kind", str(dev))
    hbm, peak = next(((b, p) for k, b, p in DEVICES if k in name), (None, None))
    weights = {n: s for n, s in param_shapes(cfg).items()}
    params = int(sum(np.prod(s.shape) for s in weights.values()))
    report: dict[str, Any] = {
        "benchmark": "benchmarks/gpu_step.py", "shape": args.shape, "config": SHAPES[args.shape],
        "dtype": args.dtype, "params": params, "abstract": args.abstract,
        "device": {"backend": backend, "kind": name, "hbm_tbps_datasheet": hbm, "peak_tflops_datasheet": peak},
        "versions": {"jax": jax.__version__, "python": platform.python_version()} | plugin_versions(),
        "machine": f"{platform.node()} ({platform.platform()}, {os.cpu_count()} CPU cores)",
        "command": " ".join(["benchmarks/gpu_step.py", *args.argv]), "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "setting": dataclasses.asdict(Geometry("dual")) | {"kinds": args.kinds, "at": args.at},
        "environment": {"XLA_FLAGS": os.environ.get("XLA_FLAGS"), "xla_cache": str(args.xla_cache or "off"),
                        "compile_threads": args.threads,
                        "persistent_cache_enable_xla_caches": jax.config.jax_persistent_cache_enable_xla_caches},
        "notes": list(args.note), "cases": []}
    if not args.abstract:
        report["device"]["copy_gbps"] = copy_bandwidth() / 1e9
        log(f"copy bandwidth {report['device']['copy_gbps']:.0f} GB/s on {name}")
    # Grouped by the weights they run: fused projections and stacked layers change a model in
    # place, so each (quant, projections) gets weights of its own, and scan comes after unrolled.
    variants = [(a, q, lay, pj) for q in args.quant for pj in args.projections for a in args.attention
                for lay in sorted(args.layers, key=lambda x: x == "scan")]
    models: dict[tuple, Any] = {}
    for attention, quant, layers, projections in variants:
        stored, *kernels = quant.split("+")  # ("int8-g128+pallas": the weights of int8-g128)
        unknown = sorted(set(kernels) - {"pallas", "dense"})
        if unknown:
            raise SystemExit(f"--quant {quant}: unknown kernel {unknown[0]!r} (after '+': pallas, dense)")
        if kernels and target is None and jax.default_backend() != "gpu":
            report["cases"].append({"attention": attention, "quant": quant, "layers": layers,
                                    "projections": projections,
                                    "error": f"{quant}: the Pallas kernel is compiled by Triton for a GPU "
                                             f"(or --target)"})
            continue
        for env, name in ((QUANT_KERNEL_ENV, "pallas"), (DENSE_KERNEL_ENV, "dense")):
            if name in kernels:
                os.environ[env] = "pallas"  # (read as each program is traced: `_quant_kernel.enabled`)
            else:
                os.environ.pop(env, None)
        weights = (stored, projections)
        if weights not in models:
            models.clear()  # one set of weights on the device at a time
            if args.abstract:  # a fresh abstract model (the cached one is shared, and stays as built)
                models[weights] = _abstract_model.__wrapped__(cfg, None if stored == "none" else stored)
            else:
                t0 = time.perf_counter()
                m = random_model(cfg, args.seed)
                if stored != "none":
                    from dlm_jax.models.quant import quantize  # the weight-only quantizer of `dlm_jax.load(quant=...)`

                    quantize(m, stored)
                jax.block_until_ready(jax.tree.leaves(nnx.state(m)))
                models[weights] = m
                log(f"weights ({stored}) made in {time.perf_counter() - t0:.1f}s")
        model = models[weights]
        if model is None:
            continue
        try:
            executor = build_executor(model, attention, layers, projections)
        except Exception as e:  # noqa: BLE001
            report["cases"].append({"attention": attention, "quant": quant, "layers": layers,
                                    "projections": projections,
                                    "error": f"{type(e).__name__}: {e}".splitlines()[0]})
            continue
        variant = variant_name({"attention": attention, "quant": quant, "layers": layers or "unrolled",
                                "projections": projections})
        weight_bytes = gpu_bytes(executor._leaves)  # (int4 two a byte, as a GPU holds it)
        slots = executor.capacity(Geometry(args.kinds[0]).total)
        steps = probe_steps(executor, args.batches, args.kinds, args.at, seed=args.seed)
        cases = list(steps)

        def compile_case(c):
            t0 = time.perf_counter()
            fn, specs = jitted(executor._build_resident, (steps[c].key, slots))  # as the executor compiles
            if target is not None:  # (its options the target's: `building_for`) its arguments on the target's device
                specs = on_device(specs, target)
            # The target the default device while lowering: a Pallas kernel's Triton lowering asks it for the GPU.
            with jax.default_device(target) if target is not None else contextlib.nullcontext():
                lowered = fn.lower(*specs)
            exe = lowered.compile()
            return exe, time.perf_counter() - t0, lowered

        log(f"compiling {len(cases)} steps ({variant}) on {args.threads} threads")
        with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
            futures = {c: pool.submit(compile_case, c) for c in cases}
        for (b, kind, at) in cases:
            geo, req = Geometry(kind, at=at), steps[(b, kind, at)]
            row: dict[str, Any] = {"batch": b, "kind": kind, "at": at, "compile_env": compile_env(report["environment"]),
                                   "attention": attention, "quant": quant, "layers": layers or "unrolled",
                                   "projections": projections, "bucket": str(req.key), "slots": slots,
                                   "window_rows": len(geo.window()), "read_slots": len(geo.read()),
                                   "weight_bytes": weight_bytes}
            try:
                exe, secs, lowered = futures[(b, kind, at)].result()
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                report["cases"].append(row)
                log(f"b{b} {kind} {variant}: {row['error']}")
                continue
            row["compile_s"] = secs
            if target is not None:
                row["kernels"] = hlo_kernels(exe.as_text())
            # Neither cost analysis may stop the timing: a backend without one gives None (noted).
            c, hlo = cost(exe), cost(lowered)
            dense_flops = 2 * params * b * len(geo.window())
            row.update(flops=c["flops"], bytes_accessed=c["bytes_accessed"],
                       bytes_over_weights=c["bytes_accessed"] / weight_bytes if c["bytes_accessed"] else None,
                       flops_over_dense=c["flops"] / dense_flops if c["flops"] else None,
                       hlo_bytes_over_weights=hlo["bytes_accessed"] / weight_bytes if hlo["bytes_accessed"] else None)
            row.update({f"{name}_cost_error": x["error"] for name, x in (("compiled", c), ("traced", hlo)) if "error" in x})
            if not args.abstract:
                try:
                    row.update(time_step(executor, exe, req, slots, geo, b, args, report["device"], weight_bytes,
                                         dense_flops))
                except Exception as e:  # noqa: BLE001 - one case's failure is its own; the others still run
                    row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            report["cases"].append(row)
            log(f"b{b} {kind} {variant}: " + ", ".join(
                f"{k} {row[k]:.3g}" for k in ("compile_s", "bytes_over_weights", "step_ms", "step_over_weight_read")
                if row.get(k) is not None))
            write(report, args.out)
        executor = None  # (its compiled steps and leaves released before the next variant)
    return report


def time_step(executor, exe, req: SlotStep, slots: int, geo: Geometry, batch: int, args, device: dict,
              weight_bytes: int, dense_flops: float) -> dict[str, Any]:
    """Median step time of the compiled resident step over a decode's cache; the profile."""
    total = geo.total
    positions = np.broadcast_to(np.arange(total, dtype=np.int32), (req.key.batch, total))
    cache = executor.open(executor.config, positions, np.ones_like(positions, bool))
    if hasattr(executor, "resident_inputs"):  # the request packed into one array (and the predictions)
        arrays = [jax.device_put(x) for x in executor.resident_inputs(req)]
    else:  # (a tree from before: one array per request field)
        arrays = [jax.device_put(req.arrays()[n]) for n in req.arrays() if n != "lora_gate"]
    state = [cache.k, cache.v, cache.written]

    def call():
        *named, k, v, written = exe(executor._leaves, *state, cache.pos, cache.valid, *arrays)
        state[:] = k, v, written
        return named

    t0 = time.perf_counter()
    jax.block_until_ready(call())  # the program's first execution: its kernels loaded, its command buffers recorded
    first = time.perf_counter() - t0
    ts = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(ts)
    bw = device["copy_gbps"] * 1e9
    out = {"step_ms": ms, "step_ms_min": 1e3 * min(ts), "reps": args.reps, "first_call_ms": 1e3 * first,
           "weight_read_ms": 1e3 * weight_bytes / bw,
           "roofline_ms": 1e3 * max(weight_bytes / bw, dense_flops / (device["peak_tflops_datasheet"] or 1e30) / 1e12)}
    out["step_over_weight_read"] = ms / out["weight_read_ms"]
    out["step_over_roofline"] = ms / out["roofline_ms"]
    # A program that takes the step's arguments (the weights' leaves, the cache, the request)
    # and computes next to nothing: what a call costs before its first kernel and after its last.
    given = (executor._leaves, *state, cache.pos, cache.valid, *arrays)
    empty = jax.jit(lambda leaves, *_: leaves[0].reshape(-1)[:1], keep_unused=True).lower(*given).compile()
    out["empty_call_ms"] = median_call_ms(lambda: jax.block_until_ready(empty(*given)), max(args.reps, 10))
    if hasattr(executor, "resident_inputs"):
        out.update(request_transfers(executor, req, max(args.reps, 10)))
    if args.profile:
        trace = tempfile.mkdtemp(prefix="gpu-step-trace-")
        jax.profiler.start_trace(trace)
        for _ in range(args.profile_steps):
            jax.block_until_ready(call())
        jax.profiler.stop_trace()
        try:
            out["profile"] = top_kernels(trace, args.profile_steps)
        except Exception as e:  # noqa: BLE001
            out["profile"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    mem = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    if mem:
        out["peak_bytes_in_use"] = mem.get("peak_bytes_in_use")

    return out


def _g(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def compile_env(env: dict[str, Any] | None) -> str:
    """How a run compiled, in a few words (threads, persistent cache, XLA_FLAGS)."""
    if not env:
        return "-"
    return (f"{env['compile_threads']} threads, persistent cache {env['xla_cache']}, "
            f"XLA_FLAGS {env['XLA_FLAGS'] or 'unset'}")


def kernel_cells(kernels: dict[str, Any] | None) -> str:
    """A step's launches (`hlo_kernels`) as two table cells: all, then by kind (the GEMMs with
    how many of them are distinct, where the run counted it)."""
    if not kernels:
        return "- | -"
    kinds = kernels["by_kind"]
    distinct = kernels.get("distinct_gemms")
    counts = [str(kinds.get(k, {}).get("kernels", 0)) for k in ("gemm", "data movement", "other")]
    if distinct is not None:
        counts[0] += f" ({distinct} distinct)"
    return f"{kernels['kernels']} | " + " / ".join(counts) + (
        f" (+{kinds['attention']['kernels']} attention)" if "attention" in kinds else "")


def variant_name(row: dict[str, Any], sep: str = "/") -> str:
    """attention/quant/layers of a case, and /fused where its projections were."""
    parts = [row["attention"], row["quant"], row["layers"]]
    return sep.join(parts + (["fused"] if row.get("projections", "separate") != "separate" else []))


def markdown(rep: dict[str, Any]) -> str:
    d = rep["device"]
    envs = {r.get("compile_env", "-") for r in rep["cases"]}
    env_col = len(envs) > 1  # runs rendered together that compiled differently: a column says which
    first_col = any("first_call_ms" in r for r in rep["cases"])  # results before it was timed: no column
    proj_col = any(r.get("projections", "separate") != "separate" for r in rep["cases"])
    kernel_col = any("kernels" in r for r in rep["cases"])  # compiled for a GPU target: its launches
    shapes = list(dict.fromkeys(r.get("shape", rep["shape"]) for r in rep["cases"])) or [rep["shape"]]
    shape_col = len(shapes) > 1  # runs of other model shapes rendered together: a column says which
    lines = [f"# The decode step at the {' and '.join(shapes)} shape{'s' if shape_col else ''}: {d['kind']} "
             f"({d['backend']})", "",
             f"{rep['params'] / 1e9:.3f}B parameters, {rep['dtype']}; setting {rep['setting']}; "
             f"jax {rep['versions']['jax']}; {rep['date']}; `{rep['command']}`."
             + ("" if rep["abstract"] else f" Copy bandwidth {d.get('copy_gbps', 0):.0f} GB/s.")
             + ("" if env_col or not rep.get("environment") else f" Compiles: {compile_env(rep['environment'])}."),
             "",
             *[f"- {n}" for n in rep.get("notes", [])], *([""] if rep.get("notes") else []),
             *[f"- source: `{src['file']}`: `{src['command']}` ({src['date']}, {src['device']['kind']}, "
               f"{src['cases']} cases)" for src in rep.get("sources", [])], *([""] if rep.get("sources") else []),
             ("| shape " if shape_col else "")
             + "| batch | step | attention | quant | layers | " + ("projections | " if proj_col else "") + "bucket | "
             + ("compiles | " if env_col else "")
             + "compile s | " + ("first call ms | " if first_col else "")
             + ("kernels | GEMM / data movement / other | " if kernel_col else "") + "bytes / weights | FLOPs / dense | "
             "traced bytes / weights | step ms | weight-read ms | roofline ms | step / weight read | error |",
             ("|---" if shape_col else "")
             + "|---:|---|---|---|---|" + ("---|" if proj_col else "") + "---|" + ("---|" if env_col else "") + "---:|"
             + ("---:|" if first_col else "") + ("---:|---|" if kernel_col else "")
             + "---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rep["cases"]:
        lines.append((f"| {r.get('shape', rep['shape'])} " if shape_col else "")
                     + f"| {r.get('batch', '-')} | {r.get('kind', '-')} | {r['attention']} | {r['quant']} | "
                     f"{r['layers']} | " + (f"{r.get('projections', 'separate')} | " if proj_col else "")
                     + f"{r.get('bucket', '-')} | " + (f"{r.get('compile_env', '-')} | " if env_col else "")
                     + f"{_g(r.get('compile_s'), '.1f')} | " + (f"{_g(r.get('first_call_ms'), '.1f')} | " if first_col else "")
                     + (f"{kernel_cells(r.get('kernels'))} | " if kernel_col else "")
                     + f"{_g(r.get('bytes_over_weights'))} | {_g(r.get('flops_over_dense'))} | "
                     f"{_g(r.get('hlo_bytes_over_weights'))} | "
                     f"{_g(r.get('step_ms'))} | {_g(r.get('weight_read_ms'))} | {_g(r.get('roofline_ms'))} | "
                     f"{_g(r.get('step_over_weight_read'))} | {r.get('error', '')} |")
    for r in rep["cases"]:
        prof = r.get("profile")
        if not prof or "top" not in prof:
            continue
        outside = ("" if r.get("step_ms") is None or prof.get("source") != "device" else  # (see gpu.py)
                   f"; the step {r['step_ms']:.2f} ms, {r['step_ms'] - prof['kernel_ms_per_step']:.2f} ms of it "
                   "outside the kernels" + ("" if r.get("empty_call_ms") is None else
                                           f"; a call of a program that takes the step's arguments and computes "
                                           f"nothing: {r['empty_call_ms']:.3f} ms")
                   + ("" if r.get("request_fields_ms") is None else
                      f"; the request sent and the predictions read back as ten and four arrays "
                      f"{r['request_fields_ms']:.3f} ms, packed as one and one {r['request_packed_ms']:.3f} ms"))
        lines += ["", f"Kernels, b{r['batch']} {r['kind']} {variant_name(r)} "
                  f"({prof['source']}, {prof['kernel_ms_per_step']:.2f} ms of kernels per step{outside}):", "",
                  *kernel_table(prof)]
    return "\n".join(lines) + "\n"


def plot(rep: dict[str, Any], path: Path) -> bool:
    """Step ms against batch, one line per (step, attention, quant, layers), with the
    weight-read limit; False (nothing written) when no case was timed."""
    timed = [r for r in rep["cases"] if r.get("step_ms") is not None]
    if not timed:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len({r.get("at") for r in timed}) > 1:  # a compile probe: every block's program, by window width
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for env in sorted({r.get("compile_env", "-") for r in timed}):
            pts = sorted((int(r["bucket"].split("_w")[1].split("_")[0]), r["compile_s"], r["step_ms"])
                         for r in timed if r.get("compile_env", "-") == env)
            for ax, i in zip(axes, (1, 2)):
                ax.plot([p[0] for p in pts], [p[i] for p in pts], "o-", label=env)
        for ax, what in zip(axes, ("compile s (side by side)", "step ms")):
            ax.set_xlabel("window width (slots)")
            ax.set_ylabel(what)
            ax.set_title(f"{what}, {rep['device']['kind']}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        atomic_write(path, png_bytes(fig))
        return True
    kinds = [k for k in KINDS if any(r["kind"] == k for r in timed)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        lines: dict[tuple, list] = {}
        for r in timed:
            if r["kind"] == kind:
                lines.setdefault(variant_name(r, " / "), []).append((r["batch"], r["step_ms"]))
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([b for b, _ in pts], [m for _, m in pts], "o-", label=label)
        limit = {r["batch"]: r["weight_read_ms"] for r in timed if r["kind"] == kind and r["quant"] == "none"}
        if limit:
            ax.plot(sorted(limit), [limit[b] for b in sorted(limit)], "k--", label="bf16 weight-read limit")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("step ms")
        ax.set_title(f"{kind} step, {rep['device']['kind']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, png_bytes(fig))
    return True


def write(rep: dict[str, Any], out: Path | None, *, final: bool = False) -> None:
    """<out>.json and .md (after every case); with `final`, the plot too."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(rep, indent=1) + "\n"), (".md", markdown(rep))):
        atomic_write(out.with_suffix(suffix), text)
    if final:
        plot(rep, out.with_suffix(".png"))


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if (args.render or args.write_target) and args.out is None:
        p.error(f"{'--render' if args.render else '--write-target'} needs --out")
    args.abstract = args.abstract or bool(args.target)
    blocks = Geometry("dual").gen // Geometry("dual").block
    if bad := [a for a in args.at if not 0 <= a < blocks]:
        p.error(f"--at {bad[0]}: the setting has blocks 0 to {blocks - 1}")
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llada-8b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--at", type=int, nargs="+", default=[Geometry("dual").at],
                   help="the blocks whose steps are taken (default: the middle one)")
    p.add_argument("--xla-cache", type=Path, help="JAX's persistent compilation cache here, as the executor "
                   "enables it (default: none)")
    p.add_argument("--attention", nargs="+", choices=RESIDENT_ATTENTION, default=[RESIDENT_ATTENTION[0]])
    p.add_argument("--quant", nargs="+", default=["none"],
                   help="none, or a dlm_jax.models.quant mode (int8, fp8-g128, ...); '+pallas' after a grouped, "
                   "uint4 or act-order mode (int4-g128+pallas): its products in the Pallas kernel of "
                   "dlm_jax.models._quant_kernel ($DLM_JAX_QUANT_KERNEL=pallas while its programs are traced); "
                   "'+dense' (none+dense): the unquantized dense products in it ($DLM_JAX_DENSE_KERNEL=pallas)")
    p.add_argument("--layers", nargs="+", default=[None], help="the executor's layer loop (unrolled, scan)")
    p.add_argument("--projections", nargs="+", choices=PROJECTIONS, default=["separate"],
                   help="separate, or fused: q/k/v and gate/up each one GEMM (the executor's projections=)")
    p.add_argument("--abstract", action="store_true", help="cost analysis only, lowered from shapes (no weights)")
    p.add_argument("--write-target", action="store_true", help="write this machine's GPU as --target takes it to "
                   "--out's .txtpb, and measure nothing")
    p.add_argument("--target", metavar="GPU", help="compile for this GPU without one (implies --abstract): "
                   "h200 (benchmarks/targets/) or a GpuTargetConfigProto text file; needs JAX's CUDA plugin")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="a remark kept in the result (repeatable; with --render, added to the rendered one)")
    p.add_argument("--render", type=Path, nargs="+", metavar="RESULT.json",
                   help="measure nothing: rewrite --out's .md and .png from these results of this script (their "
                   "cases joined, in order; the first gives the device and setting)")
    return p


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        reps = [json.loads(path.read_text()) for path in args.render]
        rep = {**reps[0], "cases": [{"shape": r["shape"], **c} for r in reps for c in r["cases"]],
               "notes": [n for r in reps for n in r.get("notes", [])] + args.note,
               "sources": [{"file": str(path), "command": r["command"], "date": r["date"],
                            "device": r["device"], "cases": len(r["cases"])} for path, r in zip(args.render, reps)]}
        write(rep, args.out, final=True)
        print(markdown(rep))
        return 0
    if args.write_target:
        return write_target(args.out)
    os.environ.setdefault("DLM_JAX_CACHE_DIR", "off")
    if args.xla_cache:
        from dlm_jax.executors._compile import enable_persistent_cache
        enable_persistent_cache(args.xla_cache)
    rep = run(args)
    write(rep, args.out, final=True)
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())

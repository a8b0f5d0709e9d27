"""Decodes on meshes against one device, in a process of its own with host devices.

    python tests/executors/mesh_driver.py '<JSON spec>'

Run by tests/executors/test_mesh.py (the test process itself keeps one device: training's
meshes take every device there is). The spec: {"devices": D (host devices of this process),
"cases": [{"model": path or "random:<kind>", "mesh": "tp=2", "presets": [a preset name, or
decode options as a mapping], "gen_len": G, "max_batch": B, "load": {other `dlm_jax.load` options},
"prompts": P (the first P prompts), "fixed": false (the engine's decode only), "exchange": an MoE
layer's expert exchange on the mesh (`JaxExecutor(expert_exchange=...)`), "attention": "pallas" (both
models' steps in the attention kernel, run in Pallas's interpreter: the executor refuses the form
on a CPU, so it is set after loading; the report counts the kernel's traces on the mesh), "rows":
"batched" (both executors' row form, set after loading), "collectives": true (report the
collectives of the mesh executor's step programs after the decodes: the largest program's bytes
by kind, and one cache row's K/V bytes), "quant_kernel": true (the mesh model's quantized products in
`dlm_jax.models._quant_kernel`, run in Pallas's interpreter, one device's in XLA's form; the report
counts the kernel's traces on the mesh by each call's weight shape)}],
"processes": [coordinator, N, rank] (optional: join a run of N processes)}.

For each case the model loads twice through `dlm_jax.load` (once on the default device, once
with `mesh=`: parameters streamed onto their shards) and both decode the same prompts with each
preset, through the engine (`Model.generate`, `max_batch` rows) and as one fixed batch
(`Decoder.decode`). Prints one JSON line: per case and preset the token ids and NFE of both
(their equality is the test's to assert), the per-device parameter bytes, the K/V bytes per
device of an open cache, and the planner's figures for the same mesh.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

spec = json.loads(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={spec.get('devices', 8)}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if spec.get("processes"):
    from dlm_jax.executors.sharding import join_processes

    coordinator, n, rank = spec["processes"]
    join_processes(coordinator, num_processes=n, process_id=rank)

import numpy as np  # noqa: E402

import dlm_jax  # noqa: E402
from dlm_jax._partition import MeshShape  # noqa: E402
from dlm_jax.executors.sharding import collective_bytes  # noqa: E402
from dlm_jax.models._transformer import KERNEL_FORMS  # noqa: E402
from dlm_jax.planner import kv_bytes_per_device, weight_bytes_per_device  # noqa: E402

PROMPTS = ["564+894=", "sort: 37 44 13 33 47 48", "66+76=", "12+9="]


def random_model(kind: str, directory: Path) -> Path:
    """A random float32 model with 8 query and 8 K/V heads (tp up to 8 divides them): `bidir`
    (LLaDA-style) or `causal` (logit shift, I-DLM / AR-style), saved with the byte tokenizer."""
    from dlm_jax.models._params import tiny_byte_config

    tok, cfg = tiny_byte_config()
    cfg = cfg.replace(n_heads=8, n_kv_heads=8, d_model=128, ffn_hidden=256,
                      **({"attention": "causal", "logit_shift": True} if kind == "causal" else {}))
    return Path(dlm_jax.save_pretrained(dlm_jax.init_model(cfg, seed=3), directory / kind, tokenizer=tok))


def decode(model, preset, case: dict) -> dict:
    gen_len = case.get("gen_len", 32)
    cfg = (dlm_jax.preset(preset, gen_len=gen_len) if isinstance(preset, str)
           else dlm_jax.decode_config(**preset, gen_len=gen_len))
    out = model.generate(PROMPTS[:case.get("prompts", len(PROMPTS))], cfg, max_batch=case.get("max_batch", 2))
    got = {"engine": out.token_ids, "engine_nfe": out.stats.nfe, "request_nfe": list(out.stats.request_nfe or []),
           "fixed": None, "fixed_nfe": None, "d2h": max(out.stats.d2h_bytes or [0]),
           "logits_on": model.decoder.capabilities.logits_on}
    if case.get("fixed", True):
        fixed = model.decoder.decode([model.encode(p) for p in PROMPTS[:2]], cfg)
        got.update(fixed=[np.asarray(s).tolist() for s in fixed.sequences], fixed_nfe=fixed.stats.nfe)
    return got


def main() -> None:
    report = {"cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for case in spec["cases"]:
            path = case["model"]
            if path.startswith("random:"):
                path = str(random_model(path.split(":", 1)[1], Path(tmp)))
            if path.startswith("fp8:"):  # a copy in fine-grained FP8 (blocks of 32 x 32, the head float)
                from tests.checkpoint.test_fp8_checkpoint import fp8_checkpoint

                fp8_checkpoint(Path(path[4:]), Path(tmp) / "fp8", (32, 32))
                path = str(Path(tmp) / "fp8")
            one = dlm_jax.load(path, executor="jax", **case.get("load", {}))
            os.environ["DLM_JAX_EXPERT_EXCHANGE"] = case.get("exchange", "psum")
            mesh = dlm_jax.load(path, mesh=case["mesh"], **case.get("load", {}))
            shape = MeshShape.parse(case["mesh"])
            per_device = mesh.executor.param_bytes_per_device()
            slots = 256
            cache = mesh.executor.open(mesh.config, np.zeros((2, slots), np.int32), np.ones((2, slots), bool))
            kv = {}
            for a in (*cache.k, *cache.v, cache.pos, cache.valid, cache.written):
                for s in a.addressable_shards:
                    kv[str(s.device)] = kv.get(str(s.device), 0) + s.data.nbytes
            cache.close()
            row = {"model": case["model"], "mesh": case["mesh"], "load": case.get("load", {}), "presets": {},
                   "param_bytes": sorted(per_device.values()), "devices": len(per_device),
                   "plan_param_bytes": weight_bytes_per_device(
                       mesh.config, shape, quant=getattr(one.model, "quant", None),
                       quant_float=getattr(one.model, "quant_float", frozenset())),
                   "kv_bytes": sorted(kv.values()),
                   "plan_kv_bytes": kv_bytes_per_device(mesh.config, shape, batch=2, context=slots),
                   "total_param_bytes": sum(int(np.asarray(x).nbytes) for x in
                                            dlm_jax.get_params(one.model).values())}
            with contextlib.ExitStack() as kernel:
                if case.get("attention"):
                    from dlm_jax.models import _attention_kernel

                    one.executor.attention = mesh.executor.attention = case["attention"]
                    if case["attention"] in KERNEL_FORMS:
                        kernel.enter_context(_attention_kernel.interpret())
                    on_mesh, traces = _attention_kernel._on_mesh, row.setdefault("kernel_traces", [])

                    def counted(*args, on_mesh=on_mesh, traces=traces):
                        traces.append(args[1].shape[2])  # (q's query heads, which it splits)
                        return on_mesh(*args)

                    _attention_kernel._on_mesh = counted
                    kernel.callback(setattr, _attention_kernel, "_on_mesh", on_mesh)
                if case.get("rows"):
                    one.executor.rows = mesh.executor.rows = case["rows"]
                around_mesh = contextlib.nullcontext  # (what the mesh model's decodes run in)
                if case.get("quant_kernel"):
                    from dlm_jax.models import _attention_kernel, _quant_kernel

                    kernel.enter_context(_attention_kernel.interpret())
                    call, shapes = _quant_kernel._call, row.setdefault("quant_kernel_traces", [])

                    def counted(x, q, *args, call=call, shapes=shapes, **kw):
                        shapes.append(list(q.shape))  # (the weights each device's kernel reads: [E, I, O])
                        return call(x, q, *args, **kw)

                    _quant_kernel._call = counted
                    kernel.callback(setattr, _quant_kernel, "_call", call)

                    @contextlib.contextmanager
                    def kernel_on():  # (read where a program is traced: the mesh model's only)
                        os.environ[_quant_kernel.QUANT_KERNEL_ENV] = "pallas"
                        try:
                            yield
                        finally:
                            os.environ.pop(_quant_kernel.QUANT_KERNEL_ENV)

                    around_mesh = kernel_on
                for preset in case["presets"]:
                    a = decode(one, preset, case)
                    with around_mesh():
                        b = decode(mesh, preset, case)
                    row["presets"][json.dumps(preset)] = {"one": a, "mesh": b}
            if case.get("collectives"):
                ex, mc = mesh.executor, mesh.config
                per_program = [collective_bytes(ex._resident.get(k).as_text()) for k in ex._resident.keys]
                row["collectives"] = max(per_program, key=lambda c: sum(v["bytes"] for v in c.values()))
                row["programs"] = len(per_program)
                row["row_kv_bytes"] = (2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * ex.capacity(1)
                                       * np.dtype(mc.dtype).itemsize)
            report["cases"].append(row)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

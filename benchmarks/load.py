"""Checkpoint load time and peak memory: `dlm_jax.load` against `transformers`' `from_pretrained`.

    .venv/bin/python benchmarks/load.py                       # ~1B LLaMA shape, bf16 (CPU: a few minutes)
    .venv/bin/python benchmarks/load.py --size 8b --baseline  # LLaDA-8B shape, for a GPU machine

Writes a random LLaMA-family checkpoint with `transformers` (bfloat16, shards of
`--shard-size`, a `mask_token_id` in its config so dlm-jax loads it as it is), reads every file
once so both loaders start from a warm page cache, then times each loader in fresh processes,
`--repeats` times in rotating order, and reports the median:

  dlm_jax         `dlm_jax.load(path, executor="jax", dtype="bfloat16", param_dtype="bfloat16")`
                  until every live JAX array is ready on the default device (the executor's
                  transposed kernels included)
  dlm_jax_params  `dlm_jax.load_pretrained(path, dtype=..., param_dtype=...)`: the parameters
                  alone, without the executor (whose transposed copy of every kernel the JAX
                  executor makes when it is built, `dlm_jax/executors/jax_executor.py`)
  dlm_jax_before  (`--baseline`) the same through the loader of main before streaming loads
                  (a copy of it below: every tensor read into a host dict, transposed with
                  NumPy, then put on the device)
  torch           `AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)`, onto
                  "cuda" (`device_map`) when there is one

Imports and backend start-up happen before the clock starts. Peak RSS is the process's
VmHWM (its largest repeat), `rss_before_mib` the RSS once imports are done; on a GPU the
peak device memory is reported too. `ratio` is dlm_jax seconds / torch seconds (the target on a
GPU: at most 2), `ratio_params` the same for dlm_jax_params. On a CPU, transformers maps the
files and reads no weight until they are used, so its time and RSS there are a floor, not a
like-for-like load. Prints the JSON and writes <out-dir>/load.json and load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _hardware import warm_page_cache  # noqa: E402

# LLaMA shapes (multi-head attention, SwiGLU, untied head), as transformers' LlamaConfig names them.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=192, vocab_size=512),
    "200m": dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
                 intermediate_size=3072, vocab_size=32000),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
               intermediate_size=6144, vocab_size=32000),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
               intermediate_size=12288, vocab_size=126464),  # LLaDA-8B's shape
}
LOADERS = ("dlm_jax", "dlm_jax_params", "dlm_jax_before", "torch")
DTYPE = "bfloat16"


def write_checkpoint(path: Path, size: str, *, shard_size: str = "2GB", seed: int = 0) -> Path:
    """A random bf16 `LlamaForCausalLM` of shape `SIZES[size]` saved by transformers at `path`
    (built on the meta device and filled once, so no float32 copy is ever made)."""
    import torch
    import transformers as T

    spec = SIZES[size]
    config = T.LlamaConfig(**spec, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=False, mask_token_id=spec["vocab_size"] - 1, dtype=DTYPE)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")  # cast while on meta: nothing to copy
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(path, max_shard_size=shard_size)
    return path


# -- the loader of main before streaming loads (dlm_jax/checkpoint/_io.py at 7d12a36) ------------

def _before_read(info) -> Any:
    import numpy as np

    from dlm_jax import CheckpointError

    with open(info.path, "rb") as f:
        f.seek(info.begin)
        buf = f.read(info.end - info.begin)
    if len(buf) != info.end - info.begin:
        raise CheckpointError(f"{info.path}: tensor {info.name!r} is truncated")
    return np.frombuffer(buf, dtype=info.dtype).reshape(info.shape).copy()


def _before_from_checkpoint(name: str, tensors: list) -> Any:
    import numpy as np

    from dlm_jax.checkpoint import _names

    if _names._is_expert(name):
        return np.stack([t.T for t in tensors])
    if name.endswith(".kernel"):
        return np.ascontiguousarray(tensors[0].T)
    return tensors[0]


def _before_model_from_params(cfg, params):
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dlm_jax.models._transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        spec = var.get_value()
        flat.append((path, var.replace(jnp.asarray(np.asarray(params[name]), dtype=spec.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _before_load_pretrained(path: Path, **overrides: Any):
    """main's `load_pretrained` (validation as there; the reading, transposing and placing
    copied from it: they are what changed)."""
    from dlm_jax.checkpoint import _io, _names
    from dlm_jax.models import param_shapes

    cfg, family = _io.load_config(path, **overrides)
    infos = _io._tensor_index(path)
    shapes = {name: tuple(s.shape) for name, s in param_shapes(cfg).items()}
    plan = {name: [infos[src] for src in sources] for name, sources in _names.iter_sources(family.scheme, shapes)}
    params = {name: _before_from_checkpoint(name, [_before_read(i) for i in found]) for name, found in plan.items()}
    return _before_model_from_params(cfg, params)


# -- one measurement, in a fresh process ----------------------------------------------------

def _status_mib(key: str) -> float:
    """A /proc/self/status figure: VmRSS (now) or VmHWM (peak). Unlike `ru_maxrss`, which a
    process started by fork and exec inherits from its parent, VmHWM is this process's own."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def _child(loader: str, path: Path) -> dict[str, Any]:
    if loader == "torch":
        import torch
        from transformers import AutoModelForCausalLM

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.init()
        kwargs = {"device_map": "cuda"} if cuda else {}
        rss0, t0 = _status_mib("VmRSS"), time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        device = "cuda" if cuda else "cpu"
        device_peak = torch.cuda.max_memory_allocated() if cuda else None
        assert next(model.parameters()).dtype == torch.bfloat16
    else:
        import jax

        import dlm_jax
        from dlm_jax import api

        dev = jax.devices()[0]
        jax.block_until_ready(jax.numpy.zeros(1))  # the backend is up before the clock starts
        rss0, t0 = _status_mib("VmRSS"), time.perf_counter()
        if loader == "dlm_jax":
            loaded = dlm_jax.load(path, executor="jax", dtype=DTYPE, param_dtype=DTYPE)
        elif loader == "dlm_jax_params":
            loaded = dlm_jax.load_pretrained(path, dtype=DTYPE, param_dtype=DTYPE)
        else:
            flax_model = _before_load_pretrained(path, dtype=DTYPE, param_dtype=DTYPE)
            loaded = api.Model(flax_model, api.stored_tokenizer(path),
                               executor=api.jax_executor(flax_model, source=path))
        jax.block_until_ready(jax.live_arrays())
        seconds = time.perf_counter() - t0
        device = dev.platform
        stats = dev.memory_stats() if dev.platform != "cpu" else None
        device_peak = (stats or {}).get("peak_bytes_in_use")
        flax_model = loaded.model if isinstance(loaded, api.Model) else loaded
        assert str(flax_model.layers[0].attn.q_proj.kernel.dtype) == DTYPE
    peak = _status_mib("VmHWM")
    return {"seconds": seconds, "peak_rss_mib": round(peak, 1), "rss_before_mib": round(rss0, 1),
            "device": device, "device_peak_mib": None if device_peak is None else round(device_peak / 2**20, 1)}


def measure(path: Path, loaders: list[str], *, repeats: int = 3) -> dict[str, dict[str, Any]]:
    """{loader: median seconds, every repeat's seconds, peak RSS, ...}: each repeat a fresh
    process, the loaders in rotating order."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in loaders}
    for r in range(repeats):
        for name in loaders[r % len(loaders):] + loaders[:r % len(loaders)]:
            out = subprocess.run([sys.executable, __file__, "--child", name, str(path)], check=True,
                                 capture_output=True, text=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{name}: {runs[name][-1]}", file=sys.stderr)
    result = {}
    for name, rs in runs.items():
        result[name] = {
            "seconds": round(statistics.median(r["seconds"] for r in rs), 3),
            "runs": [round(r["seconds"], 3) for r in rs],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            "rss_before_mib": min(r["rss_before_mib"] for r in rs),
            "device": rs[0]["device"],
            "device_peak_mib": rs[0]["device_peak_mib"],
        }
    return result


def checkpoint_path(directory: Path, size: str) -> Path:
    """Where `run` writes (or finds, and reuses) the checkpoint of `size` in `directory`."""
    return directory / f"llama-{size}-{DTYPE}"


def run(*, size: str = "1b", repeats: int = 3, baseline: bool = False, directory: Path | None = None,
        shard_size: str = "2GB", loaders: list[str] | None = None) -> dict[str, Any]:
    """Write the checkpoint (in `directory`, else a temporary one), measure, return the JSON."""
    from _hardware import machine

    loaders = loaders or [name for name in LOADERS if baseline or name != "dlm_jax_before"]
    with tempfile.TemporaryDirectory(prefix="dlm-jax-load-") as tmp:
        path = checkpoint_path(directory or Path(tmp), size)
        if not (path / "config.json").exists():
            t0 = time.perf_counter()
            write_checkpoint(path, size, shard_size=shard_size)
            print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        nbytes = warm_page_cache(path, "*.safetensors")
        import dlm_jax

        params = dlm_jax.param_count(dlm_jax.load_config(path)[0])
        shards = len(list(path.glob("*.safetensors")))
        load_before = os.getloadavg()[0]
        results = measure(path, loaders, repeats=repeats)
        load_after = os.getloadavg()[0]
    out: dict[str, Any] = {
        "machine": machine(), "size": size, "shape": SIZES[size], "params": params, "dtype": DTYPE,
        "checkpoint_mib": round(nbytes / 2**20, 1),
        "shards": shards,
        "repeats": repeats, "page_cache": "warm",
        "load_average": [round(load_before, 2), round(load_after, 2)],  # other work on the machine, before / after
        "loaders": results,
    }
    if "dlm_jax" in results and "torch" in results:
        out["ratio"] = round(results["dlm_jax"]["seconds"] / results["torch"]["seconds"], 3)
    if "dlm_jax_params" in results and "torch" in results:
        out["ratio_params"] = round(results["dlm_jax_params"]["seconds"] / results["torch"]["seconds"], 3)
    if "dlm_jax" in results and "dlm_jax_before" in results:
        out["speedup_over_before"] = round(results["dlm_jax_before"]["seconds"] / results["dlm_jax"]["seconds"], 3)
    return out


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"# Checkpoint load: {result['size']} ({result['params'] / 1e9:.2f} B parameters, "
             f"{result['checkpoint_mib'] / 1024:.2f} GiB {result['dtype']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores (1-minute load average {result['load_average'][0]} "
             f"before, {result['load_average'][1]} after). Page cache warm; median of {result['repeats']} "
             "fresh processes each.", "",
             "| loader | device | seconds (median) | runs | peak RSS MiB | RSS before MiB | device peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for name, r in result["loaders"].items():
        lines.append(f"| {name} | {r['device']} | {r['seconds']} | {', '.join(map(str, r['runs']))} | "
                     f"{r['peak_rss_mib']} | {r['rss_before_mib']} | {r['device_peak_mib'] or '-'} |")
    lines.append("")
    if "ratio" in result:
        lines.append(f"dlm_jax / torch: {result['ratio']} (target on a GPU: at most 2).")
    if "ratio_params" in result:
        lines.append(f"dlm_jax_params / torch: {result['ratio_params']}.")
    if "speedup_over_before" in result:
        lines.append(f"dlm_jax_before / dlm_jax: {result['speedup_over_before']}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", action="store_true", help="also time main's loader before streaming loads")
    parser.add_argument("--dir", type=Path, help="keep (and reuse) the checkpoint here instead of a temporary one")
    parser.add_argument("--shard-size", default="2GB")
    parser.add_argument("--loaders", nargs="*", choices=LOADERS)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--child", nargs=2, metavar=("LOADER", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], Path(args.child[1]))))
        return
    result = run(size=args.size, repeats=args.repeats, baseline=args.baseline, directory=args.dir,
                 shard_size=args.shard_size, loaders=args.loaders)
    text = json.dumps(result, indent=2)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "load.json").write_text(text + "\n")
    (args.out_dir / "load.md").write_text(markdown(result))


if __name__ == "__main__":
    main()

"""The training loop: optax AdamW (warm-up + cosine), gradient clipping, optional bf16 compute,
a `jax.sharding` mesh with data and model axes, orbax checkpoints with exact resume, JSONL
metrics and a progress bar.

Multi-host (TPU pods, GPU clusters): call `jax.distributed.initialize()` in every process
before `train` (on Cloud TPU it needs no arguments; on GPU clusters pass coordinator_address,
num_processes and process_id); `jax.devices()` then spans all hosts, the mesh is built over
them, and each process feeds the same deterministic batches (the data pipeline is seeded and
cheap, so every host computes it and the `data` sharding keeps each host's slice).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dlm_jax._errors import ConfigError
from dlm_jax._tokenizer import ByteTokenizer
from dlm_jax.checkpoint._io import load_pretrained, save_pretrained
from dlm_jax.models._params import init_model, model_from_params
from training.config import RunConfig
from training.objectives import get_objective

# Megatron-style rules: column-parallel in-projections, row-parallel out-projections.
PARTITION_RULES: tuple[tuple[str, P], ...] = (
    (r"attn\.(q|k|v)_proj\.kernel$", P(None, "model")),
    (r"attn\.o_proj\.kernel$", P("model", None)),
    (r"(ffn|shared)\.(gate|up)_proj\.kernel$", P(None, "model")),
    (r"(ffn|shared)\.down_proj\.kernel$", P("model", None)),
    (r"ffn\.(gate|up)$", P(None, None, "model")),
    (r"ffn\.down$", P(None, "model", None)),
    (r"lm_head\.kernel$", P(None, "model")),
)


def build_mesh(data: int, model: int, devices: list | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if data == -1:
        data = len(devices) // model
    if data <= 0 or data * model > len(devices):
        raise ConfigError(f"mesh data={data} x model={model} needs {max(data, 1) * model} devices, "
                          f"{len(devices)} available")
    return Mesh(np.asarray(devices[: data * model]).reshape(data, model), ("data", "model"))


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path if not (
        isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value"))


def param_sharding(state, mesh: Mesh):
    """NamedSharding per parameter from `PARTITION_RULES` (replicated when no rule matches or
    the dimension does not divide by the axis size)."""

    def rule(path, leaf):
        name = _name(path)
        for pattern, spec in PARTITION_RULES:
            if re.search(pattern, name) and len(spec) == leaf.ndim and all(
                    ax is None or leaf.shape[i] % mesh.shape[ax] == 0 for i, ax in enumerate(spec)):
                return NamedSharding(mesh, spec)
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(rule, state)


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                                 mask=decay_mask))
    return tx, schedule


@dataclasses.dataclass
class TrainResult:
    steps: int
    final_loss: float
    seconds: float
    tokens_per_second: float
    model_dir: Path
    resumed_from: int


def _checkpoint_manager(directory: Path, keep: int):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(directory.resolve(), options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False))


def _initial_params(path: str, params: Any) -> Any:
    """The weights of the HF-layout checkpoint at `path` ([train] init_from), in the tree and
    dtypes of `params`."""
    if not Path(path).is_dir():
        raise ConfigError(f"[train] init_from={path!r} is not a model directory")
    _, loaded = nnx.split(load_pretrained(path))
    want = {k: v.shape for k, v in nnx.to_flat_state(params)}
    got = {k: v.shape for k, v in nnx.to_flat_state(loaded)}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:4]
        raise ConfigError(f"[train] init_from={path!r}: its parameters do not fit [model] "
                          f"(first differences, (name, shape): {diff})")
    return jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), loaded, params)


def train(run: RunConfig, out_dir: str | Path, *, resume: bool = True, stop_after: int | None = None,
          progress: bool = True, dataset: dict[str, np.ndarray] | None = None) -> TrainResult:
    """Train `run` into `out_dir` (checkpoints/, metrics.jsonl, model/ in HF layout).

    Args:
      resume: continue from the latest checkpoint in out_dir/checkpoints if there is one.
      stop_after: stop (after checkpointing) once this many steps are done: an interruption.
      dataset: pre-built training arrays (default: built from `run.data`).
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from training.data import Batches, LengthBuckets

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tc = run.train
    tok = ByteTokenizer()
    objective = get_objective(tc.objective, run.model)
    train_cfg = run.model.replace(dtype=tc.compute_dtype, param_dtype="float32")
    mesh = build_mesh(tc.mesh_data, tc.mesh_model)
    if tc.batch_size % mesh.shape["data"]:
        raise ConfigError(f"[train] batch_size={tc.batch_size} must divide by the data axis ({mesh.shape['data']})")
    if tc.length_buckets:
        if dataset is not None:
            raise ConfigError("a pre-built dataset cannot be used with [train] length_buckets")
        per_task = build_task_datasets(run, tok)
        batches = LengthBuckets(per_task, run.data.tasks, tc.length_buckets, tc.batch_size * tc.seq_len,
                                seed=tc.seed, long_tail_prob=tc.long_tail_prob, eos_id=tok.eos_id,
                                multiple_of=mesh.shape["data"])
    else:
        arrays = dataset if dataset is not None else build_dataset(run, tok)
        batches = Batches(arrays, tc.batch_size, seed=tc.seed)
    graphdef, params = nnx.split(init_model(train_cfg, seed=tc.seed))
    manager = _checkpoint_manager(out_dir / "checkpoints", tc.keep_checkpoints)
    resuming = resume and manager.latest_step() is not None
    if tc.init_from and not resuming:  # a resumed run restores its own weights below
        params = _initial_params(tc.init_from, params)
    tx, schedule = make_optimizer(tc)
    p_shard = param_sharding(params, mesh)
    params = jax.device_put(params, p_shard)
    opt_state = tx.init(params)
    start = 0
    if resuming:
        start = manager.latest_step()
        abstract = {"params": params, "opt_state": opt_state}
        restored = manager.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        params, opt_state = restored["state"]["params"], restored["state"]["opt_state"]
        state = restored["meta"]["data"]
        batches = (batches.restore(state) if tc.length_buckets
                   else Batches.restore(arrays, tc.batch_size, state))
    b_shard = NamedSharding(mesh, P("data"))

    def loss_fn(p, batch, rng):
        return objective(nnx.merge(graphdef, p), batch, rng)

    @jax.jit
    def step_fn(p, o, batch, rng):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, batch, rng)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, {**metrics, "grad_norm": optax.tree.norm(grads)}

    base_key = jax.random.key(tc.seed)
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    metrics_file = open(out_dir / "metrics.jsonl", "a")
    tokens_per_step = tc.batch_size * tc.seq_len
    t0, last_loss, window_t, window_steps = time.perf_counter(), float("nan"), time.perf_counter(), 0
    bar = tqdm(total=tc.steps, initial=start, desc=f"train {tc.objective}", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    with jax.set_mesh(mesh):
        for step in range(start, end):
            batch = {k: jax.device_put(jnp.asarray(v), b_shard) for k, v in next(batches).items()}
            params, opt_state, metrics = step_fn(params, opt_state, batch, jax.random.fold_in(base_key, step))
            window_steps += 1
            done = step + 1
            if done % tc.log_every == 0 or done == end:
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                m.update(step=done, lr=float(schedule(step)),
                         tokens_per_second=window_steps * tokens_per_step / (now - window_t))
                window_t, window_steps, last_loss = now, 0, m["loss"]
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
                bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_second']:.0f}")
            if done % tc.checkpoint_every == 0 or done == end:
                manager.save(done, args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                    meta=ocp.args.JsonSave({"step": done, "data": batches.state()})))
            bar.update(1)
    bar.close()
    metrics_file.close()
    manager.wait_until_finished()
    seconds = time.perf_counter() - t0
    model_dir = out_dir / "model"
    info = out_dir / "train_seconds.json"  # wall time summed over interrupted segments
    total = seconds + (json.loads(info.read_text())["seconds"] if info.exists() and start > 0 else 0.0)
    info.write_text(json.dumps({"seconds": total}))
    if end == tc.steps:
        _save_model(run, params, model_dir)
    return TrainResult(end, last_loss, seconds, (end - start) * tokens_per_step / max(seconds, 1e-9),
                       model_dir, start)


def build_task_datasets(run: RunConfig, tok: Any) -> dict[str, dict[str, np.ndarray]]:
    """Encoded rows of seq_len tokens per entry of `run.data.tasks`: SFT rows per task, packed
    stdlib code for "code"."""
    from training.data import TASKS, code_corpus, encode_sft, make_split, pack_corpus

    d, seq = run.data, run.train.seq_len
    datasets = {}
    for name in d.tasks:
        if name == "code":
            datasets[name] = {"tokens": pack_corpus(tok, code_corpus(d.corpus_bytes, seed=d.seed), seq)}
        else:
            examples = make_split(TASKS[name], d.train_examples, split="train", seed=d.seed)
            datasets[name] = encode_sft(tok, examples, seq)
    return datasets


def build_dataset(run: RunConfig, tok: Any) -> dict[str, np.ndarray]:
    """The training mixture of `run.data` (fixed-length rows, mixed by weight)."""
    from training.data import mix

    d = run.data
    datasets = build_task_datasets(run, tok)
    total = sum(len(next(iter(v.values()))) for v in datasets.values())
    return mix(datasets, d.tasks, total, seed=d.seed)


def export_checkpoint(run: RunConfig, out_dir: str | Path, dest: str | Path, *, step: int | None = None) -> int:
    """Write the parameters of checkpoint `step` (default: the latest) of the run in `out_dir`
    as an HF-layout model at `dest`, e.g. to evaluate a run that is still training. Returns the
    step exported."""
    import orbax.checkpoint as ocp

    manager = _checkpoint_manager(Path(out_dir) / "checkpoints", run.train.keep_checkpoints)
    step = manager.latest_step() if step is None else step
    if step is None or step not in manager.all_steps():
        raise ConfigError(f"{out_dir}: no checkpoint at step {step} (have {sorted(manager.all_steps())})")
    train_cfg = run.model.replace(dtype=run.train.compute_dtype, param_dtype="float32")
    _, params = nnx.split(init_model(train_cfg, seed=run.train.seed))
    tx, _ = make_optimizer(run.train)
    abstract = {"params": params, "opt_state": tx.init(params)}
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    _save_model(run, restored["state"]["params"], dest)
    return step


def _save_model(run: RunConfig, params, dest: str | Path) -> None:
    """Training parameters as an HF-layout model (with the byte tokenizer) at `dest`."""
    flat = {_name(path): np.asarray(v) for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    save_pretrained(model_from_params(run.model, flat), dest, tokenizer=ByteTokenizer(), overwrite=True)

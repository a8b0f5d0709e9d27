"""The training loop: optax AdamW (warm-up + cosine), gradient clipping, optional bf16 compute,
a `jax.sharding` mesh with data and model axes, orbax checkpoints with exact resume, JSONL
metrics and a progress bar.

A run directory holds one run: its resolved config (run_config.json) is checked before a resume,
a new run never starts in a directory that holds files unless asked to move them aside, Ctrl-C
saves a checkpoint, and a non-finite loss stops the run without saving that step.

Multi-host (TPU pods, GPU clusters): call `jax.distributed.initialize()` in every process
before `train` (on Cloud TPU it needs no arguments; on GPU clusters pass coordinator_address,
num_processes and process_id); `jax.devices()` then spans all hosts, the mesh is built over
them, and each process feeds the same deterministic batches (the data pipeline is seeded and
cheap, so every host computes it and the `data` sharding keeps each host's slice).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dlm_jax import _partition
from dlm_jax._errors import ConfigError
from dlm_jax._integrity import atomic_write
from dlm_jax._tokenizer import ByteTokenizer
from dlm_jax.checkpoint._io import load_pretrained, save_pretrained
from dlm_jax.techniques.isd.lora import LoraParam, attach_lora
from dlm_jax.models._params import init_model, model_from_params
from dlm_jax.training.config import RunConfig
from dlm_jax.training.objectives import Batch, Objective, get_objective

# Megatron-style rules, the ones mesh decoding uses (`dlm_jax._partition`): column-parallel
# in-projections, row-parallel out-projections, vocabulary-parallel embedding and head; the
# logical axis `model` is this mesh's `model` axis (experts are split by their neurons: a
# training mesh has no expert axis).
PARTITION_RULES = _partition.PARTITION_RULES


def build_mesh(data: int, model: int, devices: list | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if data == -1:
        data = len(devices) // model
    if data <= 0 or data * model > len(devices):
        raise ConfigError(f"mesh data={data} x model={model} needs {max(data, 1) * model} devices, "
                          f"{len(devices)} available")
    return Mesh(np.asarray(devices[: data * model]).reshape(data, model), ("data", "model"))


_name = _partition.param_name


def param_sharding(state, mesh: Mesh):
    """NamedSharding per parameter from `PARTITION_RULES` (replicated when no rule matches or
    the dimension does not divide by the axis size)."""
    axes = {_partition.MODEL: ("model", mesh.shape["model"]), _partition.KV_HEADS: ("model", mesh.shape["model"])}

    def rule(path, leaf):
        return NamedSharding(mesh, P(*_partition.leaf_axes(_name(path), leaf.shape, axes)))

    return jax.tree_util.tree_map_with_path(rule, state)


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                                 mask=decay_mask))
    return tx, schedule


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """Where the train step's arrays live on a mesh: parameters by PARTITION_RULES, optimizer
    state like the parameters it tracks (Adam's moments) or replicated (step counts), batch rows
    [B, T] split over the data axis, the rng key, metrics and scalars replicated."""

    params: Any
    opt_state: Any
    batch: NamedSharding
    replicated: NamedSharding

    @classmethod
    def for_mesh(cls, mesh: Mesh, tx: optax.GradientTransformation, params: Any) -> StepShardings:
        p_shard, rep = param_sharding(params, mesh), NamedSharding(mesh, P())
        o_shard = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params), p_shard,
                                        transform_non_params=lambda _: rep)
        return cls(p_shard, o_shard, NamedSharding(mesh, P("data")), rep)


def train_step(params: nnx.State, opt_state: optax.OptState, batch: Batch, rng: jax.Array,
               frozen: nnx.State | None = None, *, graphdef: nnx.GraphDef, objective: Objective,
               tx: optax.GradientTransformation, expert_bias_rate: float = 0.0, activation_l1: float = 0.0,
               ) -> tuple[nnx.State, optax.OptState, dict[str, jax.Array], jax.Array]:
    """One optimizer step of `objective` on `batch` ([B, T] arrays) with key `rng`. Returns the
    updated parameters and optimizer state, the objective's metrics plus `grad_norm` (before
    clipping), and whether the loss and every updated parameter are finite (a bool scalar).
    `frozen`: the rest of the model's state (an R-ISD run's base weights), an input of the step
    that is neither differentiated nor updated. `expert_bias_rate` > 0: the MoE layers' expert
    biases are not trained by the optimizer but moved towards balanced loads (`balance_experts`).
    `activation_l1` > 0: that times the mean FFN neuron activation joins the loss (metrics
    `activation_l1`, the mean activation, and `ffn_active`, the share of active neurons)."""

    def loss_fn(p, batch, rng):
        model = nnx.merge(graphdef, p) if frozen is None else nnx.merge(graphdef, p, frozen)
        if not expert_bias_rate and not activation_l1:
            return objective(model, batch, rng)
        recorder = _Recorder(model, loads=bool(expert_bias_rate), activations=bool(activation_l1))
        loss, metrics = objective(recorder, batch, rng)
        if expert_bias_rate:
            metrics = {**metrics, "expert_loads": recorder.loads}
        if activation_l1:
            mean_act = recorder.act_sum / recorder.calls
            loss = loss + activation_l1 * mean_act
            metrics = {**metrics, "activation_l1": mean_act, "ffn_active": recorder.active_sum / recorder.calls}
        return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if expert_bias_rate:
        loads = metrics.pop("expert_loads")
        new_params = balance_experts(params, new_params, loads, expert_bias_rate)
        metrics["expert_max_load"] = (loads.max(-1) / loads.mean(-1)).mean()
    params = new_params
    finite = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(params)]))
    return params, opt_state, {**metrics, "grad_norm": optax.tree.norm(grads)}, finite


class _Recorder:
    """The model, each call also asked for its routing (`loads`: [Lm, E] sums the tokens each
    MoE layer's experts received over the calls) and/or its FFN neuron activations (`act_sum`,
    `active_sum`: per call, the mean activation and the share of active neurons, summed)."""

    def __init__(self, model: Any, *, loads: bool, activations: bool):
        self._model, self._loads, self._activations = model, loads, activations
        self.loads, self.act_sum, self.active_sum, self.calls = None, 0.0, 0.0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._model(*args, **({"router_topk": True} if self._loads else {}),
                          **({"ffn_act": True} if self._activations else {}), **kwargs)
        if self._loads:
            loads = jax.nn.one_hot(out.router_topk, self._model.config.n_experts, dtype=jnp.float32).sum((1, 2, 3))
            self.loads = loads if self.loads is None else self.loads + loads
        if self._activations:
            self.act_sum = self.act_sum + out.ffn_act.mean()
            self.active_sum = self.active_sum + jax.lax.stop_gradient((out.ffn_act > 0).mean(dtype=jnp.float32))
        self.calls += 1
        return out


def balance_experts(old: nnx.State, new: nnx.State, loads: jax.Array, rate: float) -> nnx.State:
    """`new` with each MoE layer's expert bias set to its value in `old` plus `rate` times
    sign(mean load - load) per expert (LLaDA2.0 / DeepSeek-V3 auxiliary-loss-free balancing; the
    bias only selects experts, so the optimizer's update of it, weight decay alone, is dropped).
    `loads` [Lm, E] in layer order."""
    old_flat = dict(nnx.to_flat_state(old))
    biased = sorted((path for path in old_flat if path[-1] == "expert_bias"), key=lambda p: p[1])
    flat = dict(nnx.to_flat_state(new))
    for path, load in zip(biased, loads):
        bias = old_flat[path]
        flat[path] = bias.replace(bias[...] + rate * jnp.sign(load.mean() - load))
    return nnx.from_flat_state(flat)


def make_train_step(*, graphdef: nnx.GraphDef, objective: Objective, tx: optax.GradientTransformation,
                    shardings: StepShardings, frozen: Any = None, expert_bias_rate: float = 0.0,
                    activation_l1: float = 0.0) -> Callable[..., Any]:
    """`train_step` jitted with `shardings` as its in and out shardings, donating the parameters
    and optimizer state (arguments 0 and 1): the update is written over them, so the accelerator
    holds one copy of each, and the arrays passed in are deleted by the call. `frozen`: the
    shardings of a frozen state passed as a fifth argument (never donated)."""
    s = shardings
    extra = () if frozen is None else (frozen,)
    return jax.jit(functools.partial(train_step, graphdef=graphdef, objective=objective, tx=tx,
                                     expert_bias_rate=expert_bias_rate, activation_l1=activation_l1),
                   in_shardings=(s.params, s.opt_state, s.batch, s.replicated, *extra),
                   out_shardings=(s.params, s.opt_state, s.replicated, s.replicated),
                   donate_argnums=(0, 1))


@dataclasses.dataclass
class TrainResult:
    steps: int
    final_loss: float
    seconds: float
    tokens_per_second: float
    model_dir: Path
    resumed_from: int
    replaced: Path | None = None  # where a previous run in the directory was moved (replace=True)


class TrainingError(ConfigError):
    """Training stopped because a step went wrong (a non-finite loss or parameters). A
    ConfigError, so the CLI prints it as one line: a diverging run is usually its config's
    doing (learning rate, warm-up, clipping)."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during `train`, after the checkpoint of `step` was saved: resuming continues at
    `step`. Still a KeyboardInterrupt, so callers that do not know it stop as before."""

    def __init__(self, step: int, out_dir: Path):
        super().__init__(f"interrupted at step {step}; its checkpoint is in {out_dir / 'checkpoints'}" if step
                         else f"interrupted before the first checkpoint of the run in {out_dir}")
        self.step, self.out_dir = step, out_dir


RUN_CONFIG = "run_config.json"  # the resolved RunConfig of the run in a directory
# Keys that may differ when a run resumes: how long it runs, how often it logs and checkpoints,
# how many checkpoints it keeps, and the devices it runs on. (`steps` also stretches the cosine
# schedule over the new length: that is what extending a run means.) Every other key changes
# what the steps compute or which data they see (model, objective, optimizer, batch, seed,
# data), so resuming with it changed would silently splice two runs: refused.
RESUMABLE_KEYS = frozenset({("train", "steps"), ("train", "log_every"), ("train", "checkpoint_every"),
                            ("train", "keep_checkpoints"), ("train", "mesh_data"), ("train", "mesh_model")})


def _holds_files(directory: Path) -> bool:
    """Whether `directory` holds any file (empty folders, e.g. the checkpoints/ a failed start
    left, do not make a run)."""
    return directory.is_dir() and any(p.is_file() for p in directory.rglob("*"))


def _move_aside(directory: Path) -> Path:
    """Rename `directory` to a free sibling `<name>.old-<date-time>` (one atomic rename; nothing
    is deleted) and return where it went."""
    directory = directory.resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = directory.with_name(f"{directory.name}.old-{stamp}"), 1
    while dest.exists():
        dest, n = directory.with_name(f"{directory.name}.old-{stamp}-{n}"), n + 1
    os.replace(directory, dest)
    return dest


def _config_json(run: RunConfig) -> dict[str, Any]:
    """The [model], [train] and [data] tables as they read back from JSON (tuples as lists)."""
    return json.loads(json.dumps(run.to_dict()))


def _check_same_run(run: RunConfig, out_dir: Path) -> None:
    """Refuse to resume the run in `out_dir` with a config that differs from its stored one in
    any key outside RESUMABLE_KEYS, naming every such key with its old and new value."""
    stored = out_dir / RUN_CONFIG
    try:
        old = json.loads(stored.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{stored}: unreadable ({e}); move the run aside with --replace") from None
    new = _config_json(run)
    missing = object()
    changes = []
    for table in ("model", "train", "data", "lora"):
        if table not in old and table not in new:
            continue
        a, b = old.get(table, {}), new.get(table, {})
        # A key newer than the stored file reads as its default: runs outlive code changes.
        section = getattr(run, table)
        defaults = {} if section is None or table not in old else json.loads(json.dumps(
            {f.name: f.default for f in dataclasses.fields(section) if f.default is not dataclasses.MISSING}))
        for key in sorted(set(a) | set(b)):
            was, now = a.get(key, defaults.get(key, missing)), b.get(key, missing)
            if (table, key) not in RESUMABLE_KEYS and was != now:
                show = lambda v: "(absent)" if v is missing else json.dumps(v)  # noqa: E731
                changes.append(f"[{table}] {key}: {show(was)} -> {show(now)}")
    if changes:
        allowed = ", ".join(f"[{t}] {k}" for t, k in sorted(RESUMABLE_KEYS))
        raise ConfigError(f"{out_dir} holds a run with another config ({stored.name}); resuming it with "
                          f"{run.source} would change {'; '.join(changes)}. Only {allowed} may change on "
                          f"resume: restore the old values, choose another --out, or pass --replace to move "
                          f"the old run aside and start a new one")


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics of steps <= `step` (the checkpoint a resume starts from): a run that
    stopped after logging past its last checkpoint logs those steps again."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            break  # a line cut short by a crash
    atomic_write(path, "".join(keep))


@contextlib.contextmanager
def _ctrl_c_after():
    """Hold Ctrl-C until the block (a checkpoint save) is done, then raise it: an interrupted
    save would leave orbax's temporary directory and its threads' errors behind. Only where
    Python's own SIGINT handler is in place (the main thread, no custom handler)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def _checkpoint_manager(directory: Path, keep: int, *, cleanup: bool = False):
    """Orbax manager of `directory`; `cleanup` removes temporary directories of saves a crash cut
    short (only for the training process itself: an export may run beside a training run)."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(directory.resolve(), options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False, cleanup_tmp_directories=cleanup))


def _savable(good: tuple) -> bool:
    """Whether the state `good` of `train` can be saved: the step that made it gave finite
    values (waiting for it), and its arrays were not donated to a step since (a KeyboardInterrupt
    between a step's call and `good` taking its outputs, where `_ctrl_c_after` cannot hold it)."""
    if any(x.is_deleted() for x in jax.tree.leaves((good[1], good[2]))):
        print(f"the state of step {good[0]} was donated to the next step; not saved", file=sys.stderr)
        return False
    if not bool(good[4]):
        print(f"step {good[0]} gave non-finite values; not saved", file=sys.stderr)
        return False
    return True


def _initial_params(path: str, params: Any, *, partial: bool = False) -> Any:
    """The weights of the HF-layout checkpoint at `path` ([train] init_from), in the tree and
    dtypes of `params`; `partial`: only those whose name and shape match, the rest of `params`
    as initialised."""
    if not Path(path).is_dir():
        raise ConfigError(f"[train] init_from={path!r} is not a model directory")
    _, loaded = nnx.split(load_pretrained(path))
    want = {k: v.shape for k, v in nnx.to_flat_state(params)}
    got = {k: v.shape for k, v in nnx.to_flat_state(loaded)}
    if partial:
        source = dict(nnx.to_flat_state(loaded))
        flat = [(k, source[k].replace(jnp.asarray(source[k][...], v.dtype)) if got.get(k) == want[k] else v)
                for k, v in nnx.to_flat_state(params)]
        return nnx.from_flat_state(flat)
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:4]
        raise ConfigError(f"[train] init_from={path!r}: its parameters do not fit [model] "
                          f"(first differences, (name, shape): {diff})")
    return jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), loaded, params)


ADAPTERS_DIR = "adapters"  # where an R-ISD run ([lora]) writes its adapters, beside checkpoints/


def _objectives(run: RunConfig) -> Callable[[int | None], Objective]:
    """The run's objective for a curriculum stride (None: no curriculum), options bound: the
    [train] ones, the stage's noisy block (N - 1 masks) and, for [lora], the R-ISD gate."""
    tc = run.train
    extra = {"lora_gate": True} if run.lora is not None else {}

    def make(stride: int | None) -> Objective:
        block = {} if stride is None else {"noisy_block": stride - 1}
        return get_objective(tc.objective, run.model, **tc.objective_options(), **block, **extra)

    make(None)  # a bad option fails here, before anything is built
    return make


def _split_model(run: RunConfig, train_cfg) -> tuple[nnx.GraphDef, nnx.State, nnx.State | None]:
    """(graphdef, trained state, frozen state or None): the whole model's parameters, or for
    [lora] the adapters (trained) apart from the base weights (frozen)."""
    model = init_model(train_cfg, seed=run.train.seed)
    if run.lora is None:
        graphdef, params = nnx.split(model)
        return graphdef, params, None
    attach_lora(model, run.lora, seed=run.train.seed)
    return nnx.split(model, LoraParam, ...)


def train(run: RunConfig, out_dir: str | Path, *, resume: bool = True, replace: bool = False,
          stop_after: int | None = None, progress: bool = True, dataset: dict[str, np.ndarray] | None = None,
          on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Train `run` into `out_dir` (run_config.json, checkpoints/, metrics.jsonl,
    train_seconds.json, model/ in HF layout; for an R-ISD run ([lora]), adapters/ in PEFT
    layout instead, for the base `init_from`, which is never written).

    Args:
      resume: continue the run in out_dir if there is one (its stored config must match `run`
        but for RESUMABLE_KEYS); False starts a new run and refuses a directory that holds files.
      replace: start a new run, first moving whatever out_dir holds aside to a sibling
        `<out_dir>.old-<date-time>` (one rename, nothing deleted).
      stop_after: stop (after checkpointing) once this many steps are done: an interruption.
      dataset: pre-built training arrays (default: built from `run.data`).
      on_step: called with the number of steps done after each step (and its logging and
        checkpoint); tests raise KeyboardInterrupt from it to interrupt a run at a known step.

    Ctrl-C saves a checkpoint at the last finished step and raises TrainingInterrupted; a
    non-finite loss or parameter raises TrainingError without saving that step.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from dlm_jax.training.data import Batches, LengthBuckets

    # The directory first, before anything is built: never mix two runs in one directory.
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file, not a run directory")
    replaced = None
    occupied = _holds_files(out_dir)
    if occupied and (replace or not resume):
        if not replace:
            raise ConfigError(f"{out_dir} already holds a run (or other files); pass --replace to move it "
                              f"aside and start a new run there, or leave out --fresh to resume it")
        replaced = _move_aside(out_dir)
        print(f"moved the previous contents of {out_dir} aside to {replaced}", file=sys.stderr)
        occupied = False
    if occupied:
        if (out_dir / RUN_CONFIG).exists():
            _check_same_run(run, out_dir)
        elif not _holds_files(out_dir / "checkpoints") and not (out_dir / "metrics.jsonl").exists():
            raise ConfigError(f"{out_dir} holds files but no training run ({RUN_CONFIG}, checkpoints/); choose "
                              f"an empty --out, or pass --replace to move them aside")
    out_dir.mkdir(parents=True, exist_ok=True)
    tc = run.train
    tok = ByteTokenizer()
    objective_for = _objectives(run)
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
    graphdef, params, frozen = _split_model(run, train_cfg)
    manager = _checkpoint_manager(out_dir / "checkpoints", tc.keep_checkpoints, cleanup=True)
    resuming = resume and manager.latest_step() is not None
    if resuming and manager.latest_step() > tc.steps:
        raise ConfigError(f"[train] steps={tc.steps} is below step {manager.latest_step()}, which the run in "
                          f"{out_dir} has reached; set steps >= {manager.latest_step()}")
    if frozen is not None:  # R-ISD: the base is init_from's weights, on every start and resume
        frozen = _initial_params(tc.init_from, frozen)
    elif tc.init_from and not resuming:  # a resumed run restores its own weights below
        params = _initial_params(tc.init_from, params, partial=tc.init_partial)
    tx, schedule = make_optimizer(tc)
    shardings = StepShardings.for_mesh(mesh, tx, params)
    params = jax.device_put(params, shardings.params)
    frozen_shardings = None if frozen is None else param_sharding(frozen, mesh)
    if frozen is not None:
        frozen = jax.device_put(frozen, frozen_shardings)
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
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
    # Every check passed: record the run (allowed changes such as a longer `steps` included)
    # and drop metrics logged past the checkpoint it continues from.
    atomic_write(out_dir / RUN_CONFIG, json.dumps(_config_json(run), indent=2) + "\n")
    _truncate_metrics(out_dir / "metrics.jsonl", start)

    step_fns: dict[int | None, Callable[..., Any]] = {}  # by curriculum stride: one compiled step each

    def step_fn(step: int, *args):
        stride = tc.stride_at(step)
        if stride not in step_fns:
            step_fns[stride] = make_train_step(graphdef=graphdef, objective=objective_for(stride), tx=tx,
                                               shardings=shardings, frozen=frozen_shardings,
                                               expert_bias_rate=tc.expert_bias_rate,
                                               activation_l1=tc.activation_l1)
        return step_fns[stride](*args, *(() if frozen is None else (frozen,)))

    def save(good) -> None:
        done, p, o, data_state, _ = good
        manager.save(done, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": p, "opt_state": o}),
            meta=ocp.args.JsonSave({"step": done, "data": data_state})))
        manager.wait_until_finished()

    base_key = jax.random.key(tc.seed)
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    tokens_per_step = tc.batch_size * tc.seq_len
    last_loss, saved = float("nan"), start
    # (steps done, params, optimizer state, data position, finite), replaced as one value by
    # each step, so Ctrl-C at any instant finds a consistent state. The step donates the arrays
    # of the state before it (they are deleted), so `good` takes its outputs at once and holds
    # `finite` with them: a state is saved only once `finite` says it is.
    good = (start, params, opt_state, batches.state(), True)
    metrics_file = open(out_dir / "metrics.jsonl", "a")
    bar = tqdm(total=tc.steps, initial=start, desc=f"train {tc.objective}", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    t0 = window_t = time.perf_counter()
    window_steps = 0
    try:
        with jax.set_mesh(mesh):
            for step in range(start, end):
                batch = {k: jax.device_put(jnp.asarray(v), shardings.batch) for k, v in next(batches).items()}
                done, data_state = step + 1, batches.state()
                with _ctrl_c_after():  # the call deletes good's arrays: no Ctrl-C until good holds its outputs
                    p, o, metrics, finite = step_fn(step, good[1], good[2], batch, jax.random.fold_in(base_key, step))
                    good = (done, p, o, data_state, finite)
                # One scalar a step: a diverged step is named exactly and never saved or shipped.
                if not bool(finite):
                    m = jax.device_get(metrics)
                    what = [f"the {label} is {float(m[key])}" for key, label in
                            (("loss", "loss"), ("grad_norm", "gradient norm")) if not np.isfinite(m[key])]
                    kept = f"step {saved} is the last checkpoint" if saved else "no checkpoint was saved"
                    raise TrainingError(
                        f"step {done}: {' and '.join(what) or 'the updated parameters hold NaN or inf'}; training "
                        f"stopped without saving this step ({kept} in {out_dir / 'checkpoints'}). Lower [train] "
                        f"learning_rate or raise warmup_steps, then start again with --replace")
                window_steps += 1
                if done % tc.log_every == 0 or done == end:
                    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    now = time.perf_counter()
                    m.update(step=done, lr=float(schedule(step)),
                             tokens_per_second=window_steps * tokens_per_step / (now - window_t))
                    if tc.stride_curriculum:
                        m["stride"] = tc.stride_at(step)
                    window_t, window_steps, last_loss = now, 0, m["loss"]
                    metrics_file.write(json.dumps(m) + "\n")
                    metrics_file.flush()
                    bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_second']:.0f}")
                if done % tc.checkpoint_every == 0 or done == end:
                    with _ctrl_c_after():
                        save(good)
                        saved = done
                bar.update(1)
                if on_step is not None:
                    on_step(done)
    except KeyboardInterrupt:
        if good[0] > saved:
            try:
                with _ctrl_c_after():
                    if _savable(good):
                        save(good)
                        saved = good[0]
            except KeyboardInterrupt:
                pass  # pressed again while saving: the save finished first, stop now
            except Exception as e:  # the last checkpoint stays the one to resume from
                print(f"could not save the checkpoint at step {good[0]} ({e!r})", file=sys.stderr)
        raise TrainingInterrupted(saved, out_dir) from None
    finally:
        bar.close()
        metrics_file.close()
        seconds = time.perf_counter() - t0
        info = out_dir / "train_seconds.json"  # wall time summed over every segment of the run
        total = seconds + (json.loads(info.read_text())["seconds"] if info.exists() else 0.0)
        atomic_write(info, json.dumps({"seconds": total}))
    params = good[1]
    model_dir = out_dir / ("model" if frozen is None else ADAPTERS_DIR)
    if end == tc.steps:
        if frozen is None:
            _save_model(run, params, model_dir)
        else:
            _save_adapters(run, graphdef, params, frozen, model_dir)
    return TrainResult(end, last_loss, seconds, (end - start) * tokens_per_step / max(seconds, 1e-9),
                       model_dir, start, replaced)


def build_task_datasets(run: RunConfig, tok: Any) -> dict[str, dict[str, np.ndarray]]:
    """Encoded rows of seq_len tokens per entry of `run.data.tasks`: SFT rows per task, packed
    stdlib code for "code"."""
    from dlm_jax.training.data import TASKS, code_corpus, encode_sft, make_split, pack_corpus

    d, seq = run.data, run.train.seq_len
    splits = {name: make_split(TASKS[name], d.train_examples, split="train", seed=d.seed)
              for name in d.tasks if name != "code"}
    # The longest example of every task must fit one row (chat prompt + answer + EOS); a row is
    # never cut, so a short seq_len is a config error, named before any data is encoded.
    need = {name: max(len(tok.apply_chat([{"role": "user", "content": ex.prompt}])) + len(tok.encode(ex.answer)) + 1
                      for ex in examples) for name, examples in splits.items() if examples}
    if need and max(need.values()) > seq:
        task = max(need, key=need.get)
        also = (f" (and [model] max_seq_len={run.model.max_seq_len} with it)"
                if need[task] > run.model.max_seq_len else "")
        raise ConfigError(f"{run.source}: [train] seq_len={seq} is too short for the task data: the longest "
                          f"{task!r} example needs {need[task]} tokens (chat prompt + answer + EOS); set "
                          f"[train] seq_len >= {need[task]}{also}")
    datasets = {}
    for name in d.tasks:
        if name == "code":
            datasets[name] = {"tokens": pack_corpus(tok, code_corpus(d.corpus_bytes, seed=d.seed), seq)}
        else:
            datasets[name] = encode_sft(tok, splits[name], seq)
    return datasets


def build_dataset(run: RunConfig, tok: Any) -> dict[str, np.ndarray]:
    """The training mixture of `run.data` (fixed-length rows, mixed by weight)."""
    from dlm_jax.training.data import mix

    d = run.data
    datasets = build_task_datasets(run, tok)
    total = sum(len(next(iter(v.values()))) for v in datasets.values())
    return mix(datasets, d.tasks, total, seed=d.seed)


def export_checkpoint(run: RunConfig, out_dir: str | Path, dest: str | Path, *, step: int | None = None) -> int:
    """Write the parameters of checkpoint `step` (default: the latest) of the run in `out_dir`
    as an HF-layout model at `dest` (an R-ISD run: its adapters, in PEFT layout), e.g. to
    evaluate a run that is still training. Returns the step exported."""
    import orbax.checkpoint as ocp

    manager = _checkpoint_manager(Path(out_dir) / "checkpoints", run.train.keep_checkpoints)
    step = manager.latest_step() if step is None else step
    if step is None or step not in manager.all_steps():
        raise ConfigError(f"{out_dir}: no checkpoint at step {step} (have {sorted(manager.all_steps())})")
    train_cfg = run.model.replace(dtype=run.train.compute_dtype, param_dtype="float32")
    graphdef, params, frozen = _split_model(run, train_cfg)
    tx, _ = make_optimizer(run.train)
    abstract = {"params": params, "opt_state": tx.init(params)}
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    if frozen is None:
        _save_model(run, restored["state"]["params"], dest)
    else:
        _save_adapters(run, graphdef, restored["state"]["params"], _initial_params(run.train.init_from, frozen), dest)
    return step


def _save_model(run: RunConfig, params, dest: str | Path) -> None:
    """Training parameters as an HF-layout model (with the byte tokenizer) at `dest`; refused
    when a tensor holds NaN or inf, so a diverged run never becomes a model."""
    flat = {_name(path): np.asarray(v) for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    bad = [name for name, v in flat.items() if not np.isfinite(v).all()]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise TrainingError(f"parameter {bad[0]}{more} has non-finite values (NaN or inf); "
                            f"refusing to write a model to {dest}")
    save_pretrained(model_from_params(run.model, flat), dest, tokenizer=ByteTokenizer(prompt_format(run)),
                    overwrite=True)


def _save_adapters(run: RunConfig, graphdef, params, frozen, dest: str | Path) -> None:
    """An R-ISD run's adapters (with the frozen base they were trained on) as a PEFT-layout
    adapter directory at `dest` for the base `init_from`; refused when one holds NaN or inf."""
    from dlm_jax.techniques.isd.adapters import save_adapters

    model = nnx.merge(graphdef, jax.device_get(params), jax.device_get(frozen))
    flat = {_name(path): np.asarray(v) for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    bad = [name for name, v in flat.items() if not np.isfinite(v).all()]
    if bad:
        raise TrainingError(f"adapter weight {bad[0]} has non-finite values (NaN or inf); refusing to write "
                            f"adapters to {dest}")
    save_adapters(model, dest, base=run.train.init_from, overwrite=True)


def prompt_format(run: RunConfig) -> str:
    """How the trained model expects prompts: task rows are chat-formatted (`encode_sft`),
    so a run with any task answers chat prompts; a code-corpus-only run takes raw text."""
    return "chat" if any(name != "code" for name in run.data.tasks) else "raw"

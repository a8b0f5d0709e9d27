"""Ship a trained run as a reference checkpoint: copy its HF-layout model into the repository
and write a model card with the exact command, steps, wall time, final loss and per-task
accuracy measured here.

    .venv/bin/python -m dlm_jax.training.ship --run runs/llada-tiny \
        --config examples/configs/llada-tiny.toml --dest models/llada-tiny
    .venv/bin/python -m dlm_jax.training.ship --run runs/llada-12m --config examples/configs/llada-12m.toml \
        --dest models/llada-12m --weights-dtype bfloat16 --max-mb 26 --trained-on "one NVIDIA H100 GPU"
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

import dlm_jax
from dlm_jax._config import SPARSE_FFN_KINDS
from dlm_jax._integrity import make_temp_dir, write_manifest
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.registry import decode_config
from dlm_jax.training.config import RunConfig
from dlm_jax.training.data import TASKS, task_settings
from dlm_jax.training.evaluate import chance_accuracy, evaluate
from dlm_jax.training.loop import prompt_format

MAX_MB = 10.0  # default size limit of a shipped model (--max-mb raises it per model)
CPU_MACHINE = "a 2-core CPU machine"
STORAGE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def card_decoders(gen_len: int) -> dict[str, DecodeConfig]:
    """The card's decoders, from one token per step in order (left to right, the most
    sequential) to the most parallel commits."""
    one_per_step = dict(gen_len=gen_len, cache="none", rule="topk", steps=gen_len)
    return {"left-to-right (block 1, one token per step)": decode_config(block_len=1, **one_per_step),
            "vanilla top-k (LLaDA, steps = gen)": decode_config(block_len=32, **one_per_step),
            "prefix + threshold 0.9 (Fast-dLLM)": decode_config(gen_len=gen_len, block_len=32),
            "prefix + frechet 0.25 (Fast-dLLM++)": decode_config(gen_len=gen_len, block_len=32, rule="frechet")}


def ship(run_dir: Path, config: Path, dest: Path, *, n: int, gen_len: int, max_mb: float = MAX_MB,
         weights_dtype: str = "float32", trained_on: str = CPU_MACHINE, stopped_at: int | None = None) -> dict:
    """Copy the run's model to `dest` (floating tensors stored as `weights_dtype`; the model
    still loads as its config's float32), evaluate the copy with the card's decoders and write
    the card, eval.json and manifest.

    `stopped_at`: the run was stopped (with a checkpoint) at this step, before its configured
    `steps`, and its model exported from that checkpoint; the card says so. Without it a run
    must have finished."""
    run = RunConfig.load(config)
    if weights_dtype not in STORAGE_DTYPES:
        raise SystemExit(f"weights dtype {weights_dtype!r} is not one of {sorted(STORAGE_DTYPES)}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1]
    if stopped_at is None and last["step"] != run.train.steps:
        raise SystemExit(f"{run_dir}: run stopped at step {last['step']} of {run.train.steps}")
    if stopped_at is not None and not last["step"] <= stopped_at < run.train.steps:
        raise SystemExit(f"{run_dir}: stopped_at={stopped_at} must be in [last logged step {last['step']}, "
                         f"steps={run.train.steps})")
    params = dlm_jax.get_params(dlm_jax.load_pretrained(run_dir / "model"))
    bad = [name for name, v in params.items() if not np.isfinite(v).all()]
    if bad:  # a diverged run is never shipped, however it came to write its model
        raise SystemExit(f"{run_dir / 'model'}: tensor {bad[0]} has non-finite values (NaN or inf); not shipping it")
    from dlm_jax._integrity import replace_dir

    dest.parent.mkdir(parents=True, exist_ok=True)  # stage beside dest: the rename stays atomic
    tmp = make_temp_dir(dest.parent, f".{dest.name}.")
    try:
        shutil.copytree(run_dir / "model", tmp, dirs_exist_ok=True)
        _store_weights(tmp, weights_dtype)
        size_mb = sum(f.stat().st_size for f in tmp.iterdir() if f.name != "manifest.json") / 2**20
        if size_mb > max_mb:
            raise SystemExit(f"{run_dir / 'model'} is {size_mb:.1f} MB as {weights_dtype}, over the {max_mb} MB limit")
        write_manifest(tmp)
        # The card reports what ships: the stored weights, through the JAX executor.
        handle = dlm_jax.load(tmp, executor="jax")
        results = {name: {t: evaluate(handle, t, cfg, n=n, keep=2) for t in TASKS}
                   for name, cfg in card_decoders(gen_len).items()}
        train_seconds = _wall_seconds(run_dir, run, metrics)
        chance = {t: chance_accuracy(t, n=n) for t in TASKS}
        sparsity = _sparsity(handle, gen_len) if run.model.ffn in SPARSE_FFN_KINDS else None
        card = _card(dest.name, run, config, metrics, results, chance, size_mb, train_seconds, n, gen_len,
                     weights_dtype=weights_dtype, trained_on=trained_on, stopped_at=stopped_at, sparsity=sparsity)
        (tmp / "README.md").write_text(card)
        (tmp / "eval.json").write_text(json.dumps({"n_per_task": n, "gen_len": gen_len, "results": results,
                                                  "chance": chance,
                                                  **({"sparsity": sparsity} if sparsity else {}),
                                                  "tasks": task_settings()}, indent=2))
        write_manifest(tmp)  # the card and evaluation too
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return results


def _store_weights(directory: Path, dtype: str) -> None:
    """Rewrite the safetensors files in `directory` with every floating tensor as `dtype`."""
    from dlm_jax.checkpoint._safetensors import load_file, read_header, save_file

    target = STORAGE_DTYPES[dtype]
    for file in sorted(directory.glob("*.safetensors")):
        _, metadata = read_header(file)
        tensors = load_file(file)
        if all(t.dtype == target or t.dtype.kind != "f" for t in tensors.values()):
            continue
        save_file({k: t.astype(target) if t.dtype.kind == "f" else t for k, t in tensors.items()}, file,
                  metadata=metadata or None)


SPARSITY_WINDOWS = (1, 4, 16, 32)


def _sparsity(handle, gen_len: int, per_task: int = 16) -> dict:
    """Per layer, the share of FFN neurons active per token and for a window of W consecutive
    rows of the card's Fast-dLLM decode (`dlm_jax.techniques.powerinfer.neurons.decode_statistics` over held-out
    prompts)."""
    from dlm_jax.techniques.powerinfer.neurons import decode_statistics
    from dlm_jax.training.data import make_split

    prompts = [handle.encode(ex.prompt) for t in TASKS for ex in make_split(TASKS[t], per_task, split="heldout")]
    stats = decode_statistics(handle, prompts, decode_config(gen_len=gen_len, block_len=32),
                              windows=SPARSITY_WINDOWS)
    return {"prompts": len(prompts), "tokens": stats.tokens,
            "windows": {w: [round(float(x), 4) for x in stats.density(w)] for w in stats.recorded_windows()}}


def _wall_seconds(run_dir: Path, run: RunConfig, metrics: list[dict]) -> float:
    """Wall time of the training steps: recorded by the loop, else summed from the logged
    throughput of each logging window."""
    info = run_dir / "train_seconds.json"
    if info.exists():
        return json.loads(info.read_text())["seconds"]
    tokens = run.train.batch_size * run.train.seq_len
    prev, total = 0, 0.0
    for m in metrics:
        total += (m["step"] - prev) * tokens / m["tokens_per_second"]
        prev = m["step"]
    return total


PROMPT_FORMAT_NOTE = ("Prompts: chat format, as in training (`\"prompt_format\": \"chat\"` in `tokenizer_config.json`): "
                      "`dlm-jax generate`, `eval`, `demo` and `dlm_jax.load(...).generate` wrap a text prompt in "
                      "the byte tokenizer's chat template; `--raw` / `chat=False` feed it as it is.")

LOSS_WINDOW = 10  # logged steps averaged for the card's final loss: single batches are noisy


def _final_loss(metrics: list[dict], key: str = "loss") -> float:
    """Mean `key` (the loss) of the last LOSS_WINDOW logged steps."""
    tail = metrics[-LOSS_WINDOW:]
    return sum(m[key] for m in tail) / len(tail)


def _ffn(m) -> str:
    """The card's words for the model's FFN."""
    if m.ffn == "reglu":
        return f"gated ReLU FFN of {m.ffn_hidden} neurons, down(relu(gate x) * up x)"
    if m.ffn == "relu":
        return f"ReLU FFN of {m.ffn_hidden} neurons"
    if m.ffn != "moe":
        return f"SwiGLU {m.ffn_hidden}"
    active = m.n_experts_per_tok + m.n_shared_experts
    return (f"MoE: {m.n_experts} routed SwiGLU experts of width {m.moe_ffn_hidden}, top-{m.n_experts_per_tok}, "
            f"{m.n_shared_experts} shared, {m.router} router{' with a selection bias' if m.router_bias else ''}; "
            f"{active} x {m.moe_ffn_hidden} FFN width active per token")


def _fresh(m) -> str:
    """What an `init_partial` run of this model starts randomly (shapes a dense model lacks)."""
    return "experts, router" if m.ffn == "moe" else "the FFN, whose width or kind differs"


def _lr_at(t, step: int) -> float:
    from dlm_jax.training.loop import make_optimizer

    return float(make_optimizer(t)[1](step))


def _card(name, run, config, metrics, results, chance, size_mb, seconds, n, gen_len, *,
          weights_dtype: str = "float32", trained_on: str = CPU_MACHINE, stopped_at: int | None = None,
          sparsity: dict | None = None) -> str:
    m, t = run.model, run.train
    lines = [f"# {name}", "",
             f"A {dlm_jax.param_count(m):,}-parameter {m.attention} transformer "
             f"({'logit shift, ' if m.logit_shift else ''}d_model {m.d_model}, {m.n_layers} layers, "
             f"{m.n_heads} heads / {m.n_kv_heads} kv heads, {_ffn(m)}) trained by dlm-jax with the "
             f"`{t.objective}` objective on the task mix {dict(run.data.tasks)} (byte-level tokenizer).", "",
             *([PROMPT_FORMAT_NOTE, ""] if prompt_format(run) == "chat" else []),
             "## How it was trained", "", "```", f"dlm-jax train --config {config}", "```", "",
             f"- steps: {t.steps if stopped_at is None else stopped_at}"
             + (f" of the configured {t.steps}: the run was stopped at step {stopped_at} (a checkpoint) by the "
                f"machine's time limit, with the cosine schedule at lr {_lr_at(t, stopped_at):.2g}, and this model "
                f"is that checkpoint (`dlm_jax.training.loop.export_checkpoint`)" if stopped_at is not None else "")
             + f", batch {t.batch_size} x {t.seq_len} tokens, AdamW lr {t.learning_rate} "
             f"(warm-up {t.warmup_steps}, cosine to {t.min_lr_ratio}x), weight decay {t.weight_decay}, "
             f"clip {t.grad_clip}, {t.compute_dtype}",
             *([f"- initial weights: `{t.init_from}` (`[train] init_from`; its wall time not counted "
                f"here), with this config's attention and logit shift"
                + (f": the parameters whose names and shapes match (`init_partial`), the others ({_fresh(m)}) "
                   "random" if t.init_partial else "")] if t.init_from else []),
             *([f"- expert balancing without an auxiliary loss: each step every expert's selection bias moves "
                f"{t.expert_bias_rate} towards the mean load (`expert_bias_rate`); busiest expert's load / mean at "
                f"the end: {_final_loss(metrics, 'expert_max_load'):.2f} (per layer, averaged)"]
               if t.expert_bias_rate else []),
             *([f"- activation sparsity: {t.activation_l1} x the mean FFN neuron activation added to the loss "
                f"(`activation_l1`); share of neurons active per token at the end: "
                f"{_final_loss(metrics, 'ffn_active'):.2%} (training batches)"] if t.activation_l1 else []),
             *([f"- objective options: clean-position term, weight {t.clean_loss_weight}, "
                f"{t.corrupt_prob:.0%} of the visible response tokens corrupted"] if t.clean_loss_weight else []),
             f"- wall time: {seconds / 60:.1f} min of training steps on {trained_on}",
             f"- final training loss: {_final_loss(metrics):.4f} (mean of the last {min(len(metrics), LOSS_WINDOW)} "
             f"logged steps, up to step {metrics[-1]['step']}; single batches are noisy"
             + (f"; masked-diffusion part {_final_loss(metrics, 'md_loss'):.4f}, clean-position cross-entropy "
                f"{_final_loss(metrics, 'clean_ce'):.4f}" if "md_loss" in metrics[-1] else "") + ")",
             f"- size: {size_mb:.1f} MB (safetensors, {weights_dtype}"
             + (f" storage; loads into a {m.param_dtype} model" if weights_dtype != m.param_dtype else "") + ")", "",
             "## Tasks", "", "Held-out prompts of the task generators in `training/data.py`, with these sizes:", "",
             *[f"- `{sizes}`" for sizes in task_settings().values()], "",
             f"## Held-out accuracy ({n} prompts per task, generation length {gen_len}, block 32 unless named)", "",
             "| decoder | " + " | ".join(TASKS) + " | mean NFE |", "|---|" + "---|" * (len(TASKS) + 1)]
    for dec, per in results.items():
        accs = " | ".join(f"{per[task]['accuracy'] * 100:.1f}%" for task in TASKS)
        nfe = sum(r["mean_nfe"] for r in per.values()) / len(per)
        lines.append(f"| {dec} | {accs} | {nfe:.1f} |")
    floors = " | ".join(f"{chance[task] * 100:.1f}%" for task in TASKS)
    lines += [f"| chance: the most frequent held-out answer, always | {floors} | 0 |", "",
              "Measured with `dlm_jax.training.ship` (`dlm_jax.training.evaluate`); answers must match exactly.", ""]
    if sparsity:
        windows = list(sparsity["windows"])
        lines += ["## Activation sparsity", "",
                  f"Share of each layer's {m.ffn_hidden} FFN neurons active (relu output > 0) for one token and "
                  f"for a window of W consecutive rows (a neuron counts if any row activates it), over the "
                  f"{sparsity['tokens']} window rows of decoding {sparsity['prompts']} held-out prompts with "
                  f"prefix + threshold 0.9 (block 32):", "",
                  "| layer | " + " | ".join("token" if w == 1 else f"W = {w}" for w in windows) + " |",
                  "|---|" + "---|" * len(windows)]
        for i in range(m.n_layers):
            lines.append(f"| {i} | " + " | ".join(f"{sparsity['windows'][w][i]:.1%}" for w in windows) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--max-mb", type=float, default=MAX_MB, help="size limit of the shipped files (MB)")
    p.add_argument("--weights-dtype", choices=sorted(STORAGE_DTYPES), default="float32",
                   help="storage dtype of the floating tensors (the model still loads as its config's dtype)")
    p.add_argument("--trained-on", default=CPU_MACHINE, help="the machine the card names for the wall time")
    p.add_argument("--stopped-at", type=int, default=None,
                   help="the run was stopped with a checkpoint at this step (before [train] steps) and its model "
                        "exported from it; the card says so")
    args = p.parse_args()
    results = ship(args.run, args.config, args.dest, n=args.n, gen_len=args.gen, max_mb=args.max_mb,
                   weights_dtype=args.weights_dtype, trained_on=args.trained_on, stopped_at=args.stopped_at)
    print(json.dumps({d: {t: r["accuracy"] for t, r in per.items()} for d, per in results.items()}, indent=2))


if __name__ == "__main__":
    main()

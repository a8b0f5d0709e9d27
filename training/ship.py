"""Ship a trained run as a reference checkpoint: copy its HF-layout model into the repository
and write a model card with the exact command, steps, wall time, final loss and per-task
accuracy measured here.

    .venv/bin/python -m training.ship --run runs/llada-tiny \
        --config examples/configs/llada-tiny.toml --dest models/llada-tiny
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

import dlm_jax
from dlm_jax._integrity import make_temp_dir, write_manifest
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.registry import decode_config
from training.config import RunConfig
from training.data import TASKS, task_settings
from training.evaluate import chance_accuracy, evaluate
from training.loop import prompt_format

MAX_MB = 10.0


def card_decoders(gen_len: int) -> dict[str, DecodeConfig]:
    """The card's decoders, from one token per step in order (left to right, the most
    sequential) to the most parallel commits."""
    one_per_step = dict(gen_len=gen_len, cache="none", rule="topk", steps=gen_len)
    return {"left-to-right (block 1, one token per step)": decode_config(block_len=1, **one_per_step),
            "vanilla top-k (LLaDA, steps = gen)": decode_config(block_len=32, **one_per_step),
            "prefix + threshold 0.9 (Fast-dLLM)": decode_config(gen_len=gen_len, block_len=32),
            "prefix + frechet 0.25 (Fast-dLLM++)": decode_config(gen_len=gen_len, block_len=32, rule="frechet")}


def ship(run_dir: Path, config: Path, dest: Path, *, n: int, gen_len: int) -> dict:
    run = RunConfig.load(config)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1]
    if last["step"] != run.train.steps:
        raise SystemExit(f"{run_dir}: run stopped at step {last['step']} of {run.train.steps}")
    params = dlm_jax.get_params(dlm_jax.load_pretrained(run_dir / "model"))
    bad = [name for name, v in params.items() if not np.isfinite(v).all()]
    if bad:  # a diverged run is never shipped, however it came to write its model
        raise SystemExit(f"{run_dir / 'model'}: tensor {bad[0]} has non-finite values (NaN or inf); not shipping it")
    handle = dlm_jax.load(run_dir / "model", executor="jax")  # the card reports the JAX executor's speed
    results = {name: {t: evaluate(handle, t, cfg, n=n, keep=2) for t in TASKS}
               for name, cfg in card_decoders(gen_len).items()}
    size_mb = sum(f.stat().st_size for f in (run_dir / "model").iterdir()) / 2**20
    if size_mb > MAX_MB:
        raise SystemExit(f"{run_dir / 'model'} is {size_mb:.1f} MB, over the {MAX_MB} MB limit")
    train_seconds = _wall_seconds(run_dir, run, metrics)
    chance = {t: chance_accuracy(t, n=n) for t in TASKS}
    card = _card(dest.name, run, config, metrics, results, chance, size_mb, train_seconds, n, gen_len)
    from dlm_jax._integrity import replace_dir

    dest.parent.mkdir(parents=True, exist_ok=True)  # stage beside dest: the rename stays atomic
    tmp = make_temp_dir(dest.parent, f".{dest.name}.")
    try:
        shutil.copytree(run_dir / "model", tmp, dirs_exist_ok=True)
        (tmp / "README.md").write_text(card)
        (tmp / "eval.json").write_text(json.dumps({"n_per_task": n, "gen_len": gen_len, "results": results,
                                                  "chance": chance,
                                                  "tasks": task_settings()}, indent=2))
        write_manifest(tmp)  # the card and evaluation too
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return results


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


def _final_loss(metrics: list[dict]) -> float:
    """Mean loss of the last LOSS_WINDOW logged steps."""
    tail = metrics[-LOSS_WINDOW:]
    return sum(m["loss"] for m in tail) / len(tail)


def _card(name, run, config, metrics, results, chance, size_mb, seconds, n, gen_len) -> str:
    m, t = run.model, run.train
    lines = [f"# {name}", "",
             f"A {dlm_jax.param_count(m):,}-parameter {m.attention} transformer "
             f"({'logit shift, ' if m.logit_shift else ''}d_model {m.d_model}, {m.n_layers} layers, "
             f"{m.n_heads} heads / {m.n_kv_heads} kv heads, SwiGLU {m.ffn_hidden}) trained by dlm-jax with the "
             f"`{t.objective}` objective on the task mix {dict(run.data.tasks)} (byte-level tokenizer).", "",
             *([PROMPT_FORMAT_NOTE, ""] if prompt_format(run) == "chat" else []),
             "## How it was trained", "", "```", f"dlm-jax train --config {config}", "```", "",
             f"- steps: {t.steps}, batch {t.batch_size} x {t.seq_len} tokens, AdamW lr {t.learning_rate} "
             f"(warm-up {t.warmup_steps}, cosine to {t.min_lr_ratio}x), weight decay {t.weight_decay}, "
             f"clip {t.grad_clip}, {t.compute_dtype}",
             *([f"- initial weights: `{t.init_from}` (`[train] init_from`; its wall time not counted "
                f"here), with this config's attention and logit shift"] if t.init_from else []),
             f"- wall time: {seconds / 60:.1f} min of training steps on a 2-core CPU machine",
             f"- final training loss: {_final_loss(metrics):.4f} (mean of the last {min(len(metrics), LOSS_WINDOW)} "
             f"logged steps, up to step {metrics[-1]['step']}; single batches are noisy)",
             f"- size: {size_mb:.1f} MB (safetensors, float32)", "",
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
              "Measured with `training.ship` (`training.evaluate`); answers must match exactly.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--gen", type=int, default=64)
    args = p.parse_args()
    results = ship(args.run, args.config, args.dest, n=args.n, gen_len=args.gen)
    print(json.dumps({d: {t: r["accuracy"] for t, r in per.items()} for d, per in results.items()}, indent=2))


if __name__ == "__main__":
    main()

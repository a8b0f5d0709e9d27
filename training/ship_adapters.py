"""Ship an R-ISD run's LoRA adapters ([lora] runs, `dlm_jax.training.loop`) beside their base model: copy
the PEFT-layout adapter directory, measure the held-out introspective losses of the base and of
base + gated adapters, and write a card with the exact command, wall time and loss curve.

    .venv/bin/python -m dlm_jax.training.ship_adapters --run runs/idlm-tiny-risd \
        --config examples/configs/idlm-tiny-risd.toml --dest models/idlm-tiny/risd
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from dlm_jax._integrity import make_temp_dir, replace_dir, write_manifest
from dlm_jax.training.config import RunConfig
from dlm_jax.training.data import TASKS, encode_sft, make_split, task_settings
from dlm_jax.training.ship import CPU_MACHINE, LOSS_WINDOW, _final_loss, _wall_seconds

MAX_MB = 1.0  # adapters are small: refuse anything larger


def heldout_losses(run: RunConfig, adapters: Path, *, n: int, rows: int = 25) -> dict[str, dict[str, dict[str, float]]]:
    """{task: {"base" | "adapted": {"noisy_ce", "clean_ce", "masked_acc"}}}: the introspective
    objective's terms on `n` held-out examples per task, for base + adapters (gate 1 on [MASK]
    rows) and for the base alone. Both run the same compiled program, the base with every
    adapter's B zeroed (an exact zero delta): one XLA program, so the clean rows, and with them
    `clean_ce`, are the same bits in both (two different programs may round differently)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dlm_jax._tokenizer import ByteTokenizer
    from dlm_jax.techniques.isd.adapters import load_adapted
    from dlm_jax.techniques.isd.lora import LoraParam
    from dlm_jax.training.objectives import get_objective

    graphdef, adapted, base = nnx.split(load_adapted(run.train.init_from, adapters), LoraParam, ...)
    zeroed = jax.tree_util.tree_map_with_path(
        lambda path, v: jnp.zeros_like(v) if any(getattr(k, "key", None) == "lora_b" for k in path) else v, adapted)
    objective = get_objective(run.train.objective, run.model, **run.train.objective_options(), lora_gate=True)
    step = jax.jit(lambda lora, frozen, batch: objective(nnx.merge(graphdef, lora, frozen), batch, None)[1])
    tok = ByteTokenizer()
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task in TASKS:
        batch = encode_sft(tok, make_split(TASKS[task], n, split="heldout", seed=run.data.seed), run.train.seq_len)
        for label, lora in (("base", zeroed), ("adapted", adapted)):
            sums: dict[str, float] = {}
            for start in range(0, n, rows):
                part = {k: jnp.asarray(batch[k][start: start + rows]) for k in ("tokens", "prompt_mask")}
                m = step(lora, base, part)
                for key in ("noisy_ce", "clean_ce", "masked_acc"):  # means over rows' targets: weight by rows
                    sums[key] = sums.get(key, 0.0) + float(m[key]) * len(part["tokens"])
            out.setdefault(task, {})[label] = {k: v / n for k, v in sums.items()}
    return out


def ship_adapters(run_dir: Path, config: Path, dest: Path, *, n: int, max_mb: float = MAX_MB,
                  trained_on: str = CPU_MACHINE, command_seconds: float | None = None) -> dict[str, Any]:
    """Copy `run_dir`/adapters to `dest` with a card (README.md), eval.json and a manifest."""
    run = RunConfig.load(config)
    if run.lora is None:
        raise SystemExit(f"{config}: has no [lora] table; ship a full model with dlm_jax.training.ship")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if metrics[-1]["step"] != run.train.steps:
        raise SystemExit(f"{run_dir}: run stopped at step {metrics[-1]['step']} of {run.train.steps}")
    source = run_dir / "adapters"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(dest.parent, f".{dest.name}.")
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        size_mb = sum(f.stat().st_size for f in tmp.iterdir() if f.name != "manifest.json") / 2**20
        if size_mb > max_mb:
            raise SystemExit(f"{source} is {size_mb:.2f} MB, over the {max_mb} MB limit")
        results = heldout_losses(run, tmp, n=n)
        for task, r in results.items():  # clean rows run the base weights only: the same bits
            if r["base"]["clean_ce"] != r["adapted"]["clean_ce"]:
                raise SystemExit(f"{task}: held-out CE_clean differs with the adapters ({r['base']['clean_ce']!r} vs "
                                 f"{r['adapted']['clean_ce']!r}): the gate leaks into clean rows")
        seconds = _wall_seconds(run_dir, run, metrics)
        (tmp / "README.md").write_text(_card(dest, run, config, metrics, results, size_mb, seconds, n,
                                             trained_on=trained_on, command_seconds=command_seconds))
        (tmp / "eval.json").write_text(json.dumps({"n_per_task": n, "results": results, "tasks": task_settings()},
                                                  indent=2) + "\n")
        write_manifest(tmp)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return results


def _curve(metrics: list[dict], points: int = 6) -> list[str]:
    """Markdown rows of the loss curve at `points` evenly spaced logged steps (the last included)."""
    idx = sorted({round(i * (len(metrics) - 1) / (points - 1)) for i in range(points)})
    return [f"| {metrics[i]['step']} | {metrics[i]['loss']:.4f} | {metrics[i]['noisy_ce']:.4f} | "
            f"{metrics[i]['clean_ce']:.4f} | {metrics[i]['masked_acc'] * 100:.2f}% |" for i in idx]


def _card(dest: Path, run: RunConfig, config: Path, metrics, results, size_mb, seconds, n, *,
          trained_on: str, command_seconds: float | None) -> str:
    t, lora = run.train, run.lora
    out = run_dir_hint(config)
    lines = [f"# {dest.parent.name} R-ISD adapters", "",
             f"Rank-{lora.rank} LoRA adapters (alpha {lora.alpha:g}, scale {lora.scale:g}) on "
             f"{', '.join(lora.targets)} of every layer of `{t.init_from}`, trained for lossless R-ISD "
             f"(I-DLM: gated LoRA). Per adapted linear y = W0 x + m (alpha / r) B A x with m = `lora_gate`: 1 on "
             f"[MASK] rows (proposals), 0 on clean rows, so the clean rows (the anchors ISD verifies with) run the "
             f"base weights only, bit for bit. PEFT layout (`adapter_config.json`, `adapter_model.safetensors`); "
             f"`adapter_config.json` records the base's shapes and weight sha256.", "",
             "```python", "import dlm_jax", "from dlm_jax.techniques.isd import mask_rows_gate",
             f"model = dlm_jax.load_adapted(\"{t.init_from}\", \"{dest}\")  # checks the base hash",
             "out = model(tokens, positions=..., mask=..., lora_gate=mask_rows_gate(tokens, model.config.mask_token_id))",
             "```", "",
             "## How it was trained", "", "```", f"dlm-jax train --config {config} --out {out}",
             f"python -m dlm_jax.training.ship_adapters --run {out} --config {config} --dest {dest}", "```", "",
             f"- frozen base: `{t.init_from}` (never written); only the adapters train "
             f"({sum(int(np.prod(s)) for s in _adapter_shapes(dest, run))} parameters)",
             f"- objective: `{t.objective}` on [x_masked ; x_clean], noisy blocks of "
             f"{run.model.block_size} masks, clean-term weight "
             + ("Eq. 2 auto-balance (CE_mask / CE_clean, no gradient)" if t.ce_alpha is None else f"ce_alpha = {t.ce_alpha}")
             + "; the clean stream has gate 0, so only CE_mask reaches the adapters",
             f"- steps: {t.steps}, batch {t.batch_size} x {t.seq_len} tokens (length buckets "
             f"{list(t.length_buckets)}), AdamW lr {t.learning_rate} (warm-up {t.warmup_steps}, cosine to "
             f"{t.min_lr_ratio}x), weight decay {t.weight_decay}, clip {t.grad_clip}, {t.compute_dtype}",
             f"- data: {dict(run.data.tasks)}, {run.data.train_examples} training examples per task",
             f"- wall time: {seconds / 60:.1f} min of training steps on {trained_on}"
             + (f" ({command_seconds / 60:.1f} min for the whole `dlm-jax train` command, data and compiles included)"
                if command_seconds else ""),
             f"- final training loss: {_final_loss(metrics):.4f} (mean of the last {min(len(metrics), LOSS_WINDOW)} "
             f"logged steps; CE_mask {_final_loss(metrics, 'noisy_ce'):.4f})",
             f"- size: {size_mb:.2f} MB (float32)", "",
             "## Loss curve (training batches)", "",
             "| step | loss | CE_mask | CE_clean | mask-row accuracy |", "|---|---|---|---|---|", *_curve(metrics), "",
             f"## Held-out introspective losses ({n} prompts per task)", "",
             "Both columns run one compiled program (the base: every adapter's B zeroed); CE_clean is the same "
             "number with and without the adapters (checked equal when shipping): the clean rows are the base "
             "model's, bit for bit.", "",
             "| task | CE_mask base | CE_mask base + adapters | mask-row acc. base | mask-row acc. adapted | CE_clean (both) |",
             "|---|---|---|---|---|---|"]
    for task, r in results.items():
        b, a = r["base"], r["adapted"]
        lines.append(f"| {task} | {b['noisy_ce']:.4f} | {a['noisy_ce']:.4f} | {b['masked_acc'] * 100:.2f}% | "
                     f"{a['masked_acc'] * 100:.2f}% | {b['clean_ce']:.4f} |")
    lines += ["", "Measured with `dlm_jax.training.ship_adapters` (`heldout_losses`). Task sizes:", "",
              *[f"- `{s}`" for s in task_settings().values()], ""]
    return "\n".join(lines)


def run_dir_hint(config: Path) -> str:
    """The run directory the card's command names (`runs/<config stem>`)."""
    return f"runs/{Path(config).stem}"


def _adapter_shapes(dest: Path, run: RunConfig) -> list[tuple[int, ...]]:
    import dlm_jax
    from dlm_jax.techniques.isd.lora import attach_lora, lora_params

    model = attach_lora(dlm_jax.init_model(run.model), run.lora)
    return [v.shape for v in lora_params(model).values()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--n", type=int, default=100, help="held-out examples per task")
    p.add_argument("--max-mb", type=float, default=MAX_MB)
    p.add_argument("--trained-on", default=CPU_MACHINE)
    p.add_argument("--command-seconds", type=float, default=None,
                   help="wall time of the whole `dlm-jax train` command, measured outside it")
    args = p.parse_args()
    results = ship_adapters(args.run, args.config, args.dest, n=args.n, max_mb=args.max_mb,
                            trained_on=args.trained_on, command_seconds=args.command_seconds)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Weight-only quantization on the JAX executor (`dlm_jax.load(path, quant=...)`) against the
weights as stored, on the shipped models.

    .venv/bin/python benchmarks/quant_jax.py --out benchmarks/results/quant_jax
    .venv/bin/python benchmarks/quant_jax.py --variants int8 int8-g32 fp8 fp8-g32 "int8 f32" "int8-g32 f32" \
        --out benchmarks/results/quant_jax_grouped
    .venv/bin/python benchmarks/quant_jax.py --variants int8-g32 int4-g32 --models llada-tiny moe-tiny --n 50 \
        --out benchmarks/results/quant_jax_int4
    .venv/bin/python benchmarks/quant_jax.py --variants int4-g32 uint4-g32 --models llada-tiny moe-tiny \
        --n 50 --out benchmarks/results/quant_jax_int4_asym

Per shipped model (models/llada-12m, llada-tiny, ar-tiny, idlm-tiny, moe-tiny, sparse-tiny) and variant, all decoded in this
run on the JAX executor with the default decoder (`dlm_jax.decode_config`: prefix cache,
threshold 0.9, block 32, greedy; generation `--gen-len`), on `--n` held-out prompts of each
task of `dlm_jax.training.data.TASKS`, batched `--batch` at a time. ar-tiny and idlm-tiny are
decoded a second time with the decoder each was trained for (`model:preset` in `--models`:
`ar-tiny:ar`, left to right; `idlm-tiny:isd`, introspective strided decoding): the default
decoder fills [MASK] rows that ar-tiny's objective never trained, and its greedy completions
there are chaotic.

- float32: the checkpoint as stored;
- bfloat16: weights and activations in bfloat16 (`dtype=`, `param_dtype="bfloat16"`);
- int8, fp8: the bfloat16 model quantized at load (`quant="int8"` / `"fp8"`: per output
  channel, dequantised inside the matmuls, activations in bfloat16), as a GPU user runs it;
- int8 f32: the float32 model quantized, activations in float32: what the weights' rounding
  alone changes, against float32;
- int8-g32, fp8-g32, int8-g32 f32: the same with a scale per output channel and group of 32
  input rows (`quant="int8-g32"`): GGUF Q8_0's block size;
- int4-g32: the bfloat16 model in 4-bit integers, a scale per output channel and group of 32
  input rows (`quant="int4-g32"`): the layout of GPTQ / AWQ and compressed-tensors' W4A16;
- uint4-g32: the bfloat16 model in asymmetric 4-bit integers with a zero point per output
  channel and group of 32 (`quant="uint4-g32"`: min-max, 16 levels from the group's minimum to
  its maximum, each group's zero among them): what an AutoAWQ or "W4A16_ASYM" checkpoint
  stores, without AWQ's activation-aware scaling, held as dlm-jax loads such a checkpoint;
- bf16 1 ulp: the bfloat16 model with every weight that int8 quantizes
  (`dlm_jax.models.quant.quantized_weights`) moved one unit in the last place of its bfloat16
  value, up or down at random (`nudge_one_ulp`). No weight format that changes these weights
  changes them less, so its share of completions identical to bfloat16 is the floor for int8's;
  decoded once per seed (`--nudge-seeds`, default 4), as that share moves with the draw.

Reported: held-out accuracy (all tasks pooled, and per task), the share of completions
identical to float32's and to bfloat16's (paired: far less noisy than accuracy), and the
weight bytes as held (`dlm_jax.models.quant.weight_bytes`; quantized weights with their scales,
the embedding and norms as loaded). Writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dlm_jax  # noqa: E402
from _hardware import machine  # noqa: E402
from _plots import png_bytes  # noqa: E402
from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402
from dlm_jax.models.quant import quantized_weights, weight_bytes  # noqa: E402
from dlm_jax.runtime.registry import decode_options  # noqa: E402
from dlm_jax.training.data import TASKS, make_split  # noqa: E402

MODELS = ("llada-12m", "llada-tiny", "ar-tiny", "ar-tiny:ar", "idlm-tiny", "idlm-tiny:isd", "moe-tiny",
          "sparse-tiny")  # every shipped model (model:preset decodes with that preset)
NUDGED = "bf16 1 ulp"
BF16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
VARIANTS: dict[str, dict] = {  # name -> dlm_jax.load options
    "float32": {},
    "bfloat16": BF16,
    "int8": {**BF16, "quant": "int8"},
    "fp8": {**BF16, "quant": "fp8"},
    "int8 f32": {"quant": "int8"},  # the float32 model quantized: weights alone differ from float32's
    "int8-g32": {**BF16, "quant": "int8-g32"},  # grouped: a scale per 32 input rows and output channel
    "fp8-g32": {**BF16, "quant": "fp8-g32"},
    "int8-g32 f32": {"quant": "int8-g32"},
    "int4-g32": {**BF16, "quant": "int4-g32"},  # 4 bits in groups of 32 (GPTQ / AWQ, W4A16's layout)
    "uint4-g32": {**BF16, "quant": "uint4-g32"},  # asymmetric: zero points (AutoAWQ's default, W4A16_ASYM)
    NUDGED: BF16,  # and then `nudge_one_ulp`
}


def nudge_one_ulp(model, seed: int = 0) -> int:
    """Move every nonzero weight that int8 quantizes (`quantized_weights`) of a bfloat16 `model`
    one unit in the last place, away from zero or toward it at random (in place); returns how
    many weights moved. A bfloat16 value's bit pattern is sign, then magnitude: adding 1 to it
    moves the magnitude one ulp up, subtracting 1 one ulp down, for either sign."""
    rng = np.random.default_rng(seed)
    moved = 0
    for _, module, name in quantized_weights(model):
        weight = getattr(module, name)
        param = weight.kernel if isinstance(weight, nnx.Linear) else weight
        w = np.asarray(param[...])
        if w.dtype != jnp.bfloat16:
            raise ValueError(f"nudge_one_ulp: {name} is {w.dtype}, not bfloat16")
        bits = w.view(np.uint16).astype(np.int32)
        step = np.where((bits & 0x7FFF) > 0, rng.choice(np.array([-1, 1], np.int32), size=w.shape), 0)
        nudged = (bits + step).astype(np.uint16).view(w.dtype)
        if not np.all(np.isfinite(nudged.astype(np.float32))):
            raise ValueError(f"nudge_one_ulp: {name} holds the largest bfloat16 value")
        param[...] = jnp.asarray(nudged)
        moved += int(np.count_nonzero(step))
    return moved


def load_variant(path: Path, variant: str, seed: int = 0):
    """The model of `variant` (`VARIANTS`) ready to decode on the JAX executor (`seed`: the
    nudges of `NUDGED`)."""
    if variant != NUDGED:
        return dlm_jax.load(path, executor="jax", **VARIANTS[variant])
    from dlm_jax.api import jax_executor, stored_tokenizer
    from dlm_jax.checkpoint import load_pretrained

    model = load_pretrained(path, **VARIANTS[variant])
    nudge_one_ulp(model, seed)  # before the executor holds the weights
    return dlm_jax.Model(model, stored_tokenizer(path), executor=jax_executor(model, source=path))


def decode_variant(path: Path, variant: str, cfg, n: int, batch: int, seed: int = 0) -> dict:
    """Completions and correctness per task of one variant, and its weight bytes."""
    handle = load_variant(path, variant, seed)
    out = {"weight_bytes": weight_bytes(handle.model), "texts": {}, "correct": {}}
    for task_name, task in TASKS.items():
        examples = make_split(task, n, split="heldout")
        texts = []
        for i in range(0, n, batch):
            chunk = examples[i:i + batch]
            texts += handle.generate([handle.encode(ex.prompt) for ex in chunk], cfg).texts
        out["texts"][task_name] = texts
        out["correct"][task_name] = [bool(task.score(t, ex)) for t, ex in zip(texts, examples)]
    return out


def same_share(a: dict, b: dict) -> float:
    pairs = [(x, y) for t in a["texts"] for x, y in zip(a["texts"][t], b["texts"][t])]
    return sum(x == y for x, y in pairs) / len(pairs)


def report_model(spec: str, cfg, n: int, batch: int, nudge_seeds: int = 1, variants=tuple(VARIANTS)) -> dict:
    """Every variant of `spec` ("model" or "model:preset", `--models`) decoded and compared;
    `NUDGED` once per seed 0 .. `nudge_seeds` - 1 (its row: seed 0's, and every seed's share
    identical to bfloat16 in `identical_to_bfloat16_seeds`)."""
    name, _, preset = spec.partition(":")
    if preset:
        cfg = dlm_jax.preset(preset, gen_len=cfg.gen_len)
    runs = {}
    for variant in variants:
        print(f"{spec}: {variant}", file=sys.stderr, flush=True)
        runs[variant] = decode_variant(ROOT / "models" / name, variant, cfg, n, batch)
    rows = {}
    for variant, run in runs.items():
        pooled = [c for cs in run["correct"].values() for c in cs]
        rows[variant] = {
            "accuracy": float(np.mean(pooled)),
            "accuracy_per_task": {t: float(np.mean(cs)) for t, cs in run["correct"].items()},
            "identical_to_float32": same_share(run, runs["float32"]),
            "identical_to_bfloat16": same_share(run, runs["bfloat16"]),
            "weight_bytes": run["weight_bytes"],
        }
    if NUDGED in rows:
        shares = [rows[NUDGED]["identical_to_bfloat16"]]
        for seed in range(1, nudge_seeds):
            print(f"{spec}: {NUDGED}, seed {seed}", file=sys.stderr, flush=True)
            shares.append(same_share(decode_variant(ROOT / "models" / name, NUDGED, cfg, n, batch, seed),
                                     runs["bfloat16"]))
        rows[NUDGED]["identical_to_bfloat16_seeds"] = shares
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quant_jax")
    ap.add_argument("--n", type=int, default=100, help="held-out prompts per task")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--nudge-seeds", type=int, default=4,
                    help=f"decodes of '{NUDGED}', each with its own random nudges (the floor's spread)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="the variants to decode (float32 and bfloat16, the references, always are)")
    args = ap.parse_args()
    variants = [v for v in VARIANTS if v in {"float32", "bfloat16", *args.variants}]
    cfg = dlm_jax.decode_config(gen_len=args.gen_len)
    result = {"machine": machine(), "decoder": decode_options(cfg), "n_per_task": args.n,
              "tasks": list(TASKS), "variants": {k: dict(VARIANTS[k]) for k in variants},
              "models": {m: report_model(m, cfg, args.n, args.batch, args.nudge_seeds, variants) for m in args.models}}
    write(result, args.out)
    print(json_summary(result))


def json_summary(result: dict) -> str:
    import json

    return json.dumps({m: {v: {"accuracy": round(r["accuracy"], 4), "identical_to_float32": round(r["identical_to_float32"], 4),
                               "identical_to_bfloat16": round(r["identical_to_bfloat16"], 4),
                               "weight_bytes": r["weight_bytes"]} for v, r in rows.items()}
                       for m, rows in result["models"].items()}, indent=1)


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), result)
    n_all = result["n_per_task"] * len(result["tasks"])
    lines = ["# Weight-only quantization on the JAX executor (`benchmarks/quant_jax.py`)", "",
             f"Held-out prompts: {result['n_per_task']} per task ({', '.join(result['tasks'])}; {n_all} per model), "
             f"decoder {result['decoder']}, machine: {result['machine'].get('cpu', result['machine'])}. int8 / fp8: the bfloat16 model quantized "
             "at load (per output channel, or with -g32 per output channel and group of 32 input rows; activations in bfloat16). Identical: the share of completions equal, "
             f"character for character, to float32's / bfloat16's. One completion is {100 / n_all:.2f}% of a "
             f"model's, and one correct answer {100 / n_all:.2f} points of its accuracy.", "",
             "| model | variant | accuracy | identical to float32 | identical to bfloat16 | weight MB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for model, rows in result["models"].items():
        for variant, r in rows.items():
            lines.append(f"| {model} | {variant} | {r['accuracy']:.3f} | {r['identical_to_float32']:.3f} | "
                         f"{r['identical_to_bfloat16']:.3f} | {r['weight_bytes'] / 1e6:.2f} |")
    lines += ["", "Target of the issue (int8): at least 98% of completions identical and held-out accuracy within "
              "1 point, against the model int8 is quantized from (int8, int8-g32: bfloat16; int8 f32, int8-g32 f32: float32). For scale, "
              "bfloat16 itself against float32 is in the table, and `bf16 1 ulp` (every quantized weight of the "
              "bfloat16 model moved one ulp) gives the floor: the share of completions that stay identical to "
              "bfloat16's when these weights change as little as a weight can (the table: seed 0's nudges; "
              "below: the range over every seed's). `model:preset` rows decode with that preset instead of the "
              "default decoder.", ""]
    for model, rows in result["models"].items():
        for name, ref, key in (("int8", "bfloat16", "identical_to_bfloat16"), ("int8 f32", "float32",
                                                                             "identical_to_float32"),
                               ("int8-g32", "bfloat16", "identical_to_bfloat16"),
                               ("int8-g32 f32", "float32", "identical_to_float32")):
            if name not in rows:
                continue
            r, b = rows[name], rows[ref]
            ok = r[key] >= 0.98 and abs(r["accuracy"] - b["accuracy"]) <= 0.01
            floor = ""
            if ref == "bfloat16" and NUDGED in rows:
                seeds = rows[NUDGED].get("identical_to_bfloat16_seeds", [rows[NUDGED]["identical_to_bfloat16"]])
                floor = (f" (1-ulp floor {min(seeds):.1%}" + (f"-{max(seeds):.1%} over {len(seeds)} seeds" if len(seeds) > 1
                                                                 else "") + ")")
            lines.append(f"- {model}, {name} against {ref}: {r[key]:.1%} identical{floor}, accuracy {r['accuracy']:.3f} vs "
                         f"{b['accuracy']:.3f}: {'met' if ok else 'not met'}")
    atomic_write(out.with_suffix(".md"), ("\n".join(lines) + "\n").encode())
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    variants = list(result["models"][models[0]])
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.5))
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        xs = np.arange(len(models)) + j * width
        axes[0].bar(xs, [result["models"][m][v]["accuracy"] for m in models], width, label=v)
        axes[1].bar(xs, [result["models"][m][v]["identical_to_bfloat16"] for m in models], width, label=v)
    axes[1].axhline(0.98, color="k", lw=0.8, ls="--")
    axes[1].text(len(models) - 0.2, 0.985, "98%", ha="right", fontsize=8)
    for ax, title, low in zip(axes, ("held-out accuracy", "completions identical to bfloat16's"), (0, 0.5)):
        ax.set_xticks(np.arange(len(models)) + 0.4 - width / 2, models, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(low, 1.02)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, png_bytes(fig))


if __name__ == "__main__":
    main()

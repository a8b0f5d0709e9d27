"""The `dlm-jax` command line."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

DEMO_PROMPT = "Q: 12+30=? A:"


def decode_config(args: argparse.Namespace):
    """The preset named by --preset, with every decode option given on the command line."""
    from dlm_jax.runtime.registry import config_from_args

    return config_from_args(args)


def _run_generate(handle, prompt: str, cfg, *, chat: bool, stream: bool) -> dict:
    shown = [""]

    def on_block(i: int, texts: list[str]) -> None:
        if stream:
            new = texts[0][len(shown[0]):]
            shown[0] = texts[0]
            print(new, end="", flush=True)

    result = handle.generate(prompt, cfg, chat=chat, on_block=on_block)
    if stream:
        print(result.texts[0][len(shown[0]):], flush=True)
    return {"prompt": prompt, "completion": result.texts[0], "decoder": cfg.options(),
            "stats": result.stats.to_dict()}


def shipped_model(name: str = "llada-tiny") -> Path:
    """Where the repository's reference checkpoints live (models/<name>)."""
    return Path(__file__).resolve().parents[1] / "models" / name


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: answer held-out task prompts with the shipped llada-tiny, once with the
    default fast decoder and once with LLaDA's vanilla decoder, and compare."""
    import dlm_jax

    path = Path(args.model) if args.model else shipped_model()
    if not args.model and not path.exists():
        return _demo_random(args)
    from training.data import TASKS, make_split
    from training.evaluate import evaluate

    handle = dlm_jax.load(path)
    print(f"model: {path} ({dlm_jax.param_count(handle.config):,} parameters, {handle.config.attention})",
          file=sys.stderr)
    gen = args.gen_len or 64
    decoders = {"fast (prefix cache + threshold 0.9)": dlm_jax.decode_config(gen_len=gen, block_len=32),
                "vanilla (no cache, top-k, steps = gen)": dlm_jax.decode_config(gen_len=gen, block_len=32, cache="none",
                                                                                rule="topk", steps=gen)}
    summary = {}
    for name, cfg in decoders.items():
        print(f"\n== {name}")
        total = {"correct": 0, "n": 0, "nfe": 0.0, "seconds": 0.0}
        for task in TASKS:
            report = evaluate(handle, task, cfg, n=args.per_task, batch_size=args.per_task, progress=False,
                              keep=args.per_task)
            for s_ in report["samples"]:
                mark = "ok " if s_["correct"] else "BAD"
                print(f"[{mark}] {task:8s} {s_['prompt']!r} -> {s_['completion']!r} (expected {s_['answer']!r})")
            total["correct"] += round(report["accuracy"] * report["n"])
            total["n"] += report["n"]
            total["nfe"] += report["mean_nfe"] * report["n"]
            total["seconds"] += report["seconds"]
        summary[name] = {"accuracy": total["correct"] / total["n"], "mean_nfe": total["nfe"] / total["n"],
                         "seconds": round(total["seconds"], 3)}
        print(json.dumps(summary[name]))
    fast, vanilla = summary.values()
    print(json.dumps({"speedup_vs_vanilla": round(vanilla["seconds"] / max(fast["seconds"], 1e-9), 2),
                      "nfe_ratio": round(fast["mean_nfe"] / max(vanilla["mean_nfe"], 1e-9), 3)}))
    return 0


def _demo_random(args: argparse.Namespace) -> int:
    """Without a shipped model: save and reload a random tiny model through the HF layout and
    decode with the fast and vanilla presets (the text is noise)."""
    import numpy as np

    import dlm_jax

    from dlm_jax.models._params import tiny_byte_config

    tok, cfg = tiny_byte_config()
    model = dlm_jax.init_model(cfg, seed=args.seed or 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = dlm_jax.save_pretrained(model, Path(tmp) / "tiny", tokenizer=tok)
        handle = dlm_jax.load(path)
    same = all(np.array_equal(a, b) for a, b in zip(dlm_jax.get_params(model).values(),
                                                    dlm_jax.get_params(handle.model).values()))
    print(f"model: random-initialised {dlm_jax.param_count(cfg):,}-parameter {cfg.attention} transformer "
          f"(untrained: its text is noise); save/load round trip identical: {same}", file=sys.stderr)
    args.gen_len, args.block_len = args.gen_len or 32, args.block_len or 16
    for name in ("fast-dllm", "llada"):
        args.preset = name
        report = _run_generate(handle, args.prompt, decode_config(args), chat=False, stream=False)
        print(json.dumps({"preset": name, **report}, ensure_ascii=False))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import dlm_jax

    cfg = decode_config(args)  # bad options fail before the model loads
    handle = dlm_jax.load(args.model)
    report = _run_generate(handle, args.prompt, cfg, chat=args.chat, stream=True)
    print(json.dumps(report["stats"]), file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import dlm_jax

    cfg, family = dlm_jax.load_config(args.model, strict=not args.lenient)
    print(json.dumps({"family": family.name, "parameters": dlm_jax.param_count(cfg),
                      "config": cfg.to_dict()}, indent=2))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import dlm_jax

    model = dlm_jax.load_pretrained(args.model)
    try:
        tok = dlm_jax.load_tokenizer(args.model)
    except dlm_jax.CheckpointError:
        tok = None
    dlm_jax.save_pretrained(model, args.out, family=args.family, tokenizer=tok, overwrite=args.overwrite)
    print(f"wrote {args.out} ({args.family})")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from buckets._profile import profile_model

    profile_model(args.model, out=Path(args.out), windows=args.windows, caches=args.caches,
                  batch=args.batch, repeats=args.repeats)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from training.config import RunConfig
    from training.loop import train

    run = RunConfig.load(args.config)  # every key checked before anything is built
    out = Path(args.out or Path("runs") / Path(args.config).stem)
    result = train(run, out, resume=not args.fresh)
    print(json.dumps({"steps": result.steps, "final_loss": result.final_loss, "seconds": round(result.seconds, 1),
                      "tokens_per_second": round(result.tokens_per_second), "model": str(result.model_dir),
                      "resumed_from": result.resumed_from}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import dlm_jax
    from training.evaluate import evaluate

    cfg = decode_config(args)
    handle = dlm_jax.load(args.model)
    report = evaluate(handle, args.task, cfg, n=args.n, batch_size=args.batch, keep=args.show)
    report["decoder"] = cfg.options()
    print(json.dumps(report, indent=2, ensure_ascii=False))
    return 0


def _add_decode_options(p: argparse.ArgumentParser) -> None:
    from dlm_jax.runtime.registry import add_cli_options

    p.add_argument("--prompt", default=DEMO_PROMPT, help="prompt text")
    add_cli_options(p)


def build_parser() -> argparse.ArgumentParser:
    from dlm_jax.checkpoint._families import FAMILIES

    parser = argparse.ArgumentParser(prog="dlm-jax", description="Diffusion LMs from training to phones.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="answer held-out task prompts with the shipped model, fast vs vanilla")
    p.add_argument("--model", help="checkpoint directory (default: the shipped models/llada-tiny)")
    p.add_argument("--per-task", type=int, default=3, help="held-out prompts per task")
    _add_decode_options(p)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("generate", help="decode a prompt, printing text as blocks commit")
    p.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_decode_options(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("inspect", help="print a checkpoint's family, config and size")
    p.add_argument("--model", required=True)
    p.add_argument("--lenient", action="store_true", help="ignore unknown config keys")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("convert", help="rewrite a checkpoint in another family's layout")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--family", default="dlm_jax", choices=sorted(FAMILIES))
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("train", help="train a model from a TOML config (resumes if interrupted)")
    p.add_argument("--config", required=True, help="e.g. examples/configs/llada-tiny.toml")
    p.add_argument("--out", help="run directory (default runs/<config name>)")
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("eval", help="task accuracy, NFE and tokens/s of a model under a decoder setting")
    p.add_argument("--model", required=True)
    p.add_argument("--task", required=True, help="addition, sorting or gsm_lite")
    p.add_argument("--n", type=int, default=200, help="held-out examples")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--show", type=int, default=3, help="sample completions to print")
    _add_decode_options(p)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("profile", help="median step latency per bucket: JSON table + PNG plot")
    p.add_argument("--model", help="checkpoint directory (default: a random tiny model)")
    p.add_argument("--out", default="latency", help="output prefix (writes .json and .png)")
    p.add_argument("--windows", type=int, nargs="*", help="window buckets to measure")
    p.add_argument("--caches", type=int, nargs="*", help="cache buckets to measure")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.set_defaults(func=cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from dlm_jax._errors import CheckpointError, ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The `dlm-jax` command line."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DEMO_PROMPT = "Q: 12+30=? A:"


def _tiny_config():
    from dlm_jax import ByteTokenizer, ModelConfig

    tok = ByteTokenizer()
    return tok, ModelConfig(
        vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
        ffn_hidden=128, attention="bidirectional", max_seq_len=256,
        mask_token_id=tok.mask_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
        bos_token_id=tok.bos_id)


def _decode_loop(model, tok, prompt: str, args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from dlm_jax._vanilla import generate_vanilla

    ids = np.asarray([tok.encode(prompt)], dtype=np.int32)
    if ids.shape[1] == 0:
        raise SystemExit("error: the prompt is empty")
    p = ids.shape[1]
    bar = tqdm(total=args.gen // args.block, desc="blocks", unit="block", file=sys.stderr)

    def on_block(blk: int, x: np.ndarray) -> None:
        bar.update(1)
        lo, hi = p + blk * args.block, p + (blk + 1) * args.block
        bar.write(f"[block {blk}] {tok.decode(x[0, lo:hi])!r}", file=sys.stderr)

    result = generate_vanilla(model, ids, gen_len=args.gen, steps=args.steps, block_len=args.block,
                              temperature=args.temperature, seed=args.seed, on_block=on_block)
    bar.close()
    text = tok.decode(result.tokens[0, p:])
    print(json.dumps({"prompt": prompt, "completion": text, "nfe": result.nfe,
                      "seconds": round(result.seconds, 3),
                      "tokens_per_second": round(args.gen / result.seconds, 1)}, ensure_ascii=False))


def cmd_demo(args: argparse.Namespace) -> int:
    """Build a random tiny model, save and reload it through the HF layout, and decode."""
    import dlm_jax

    tok, cfg = _tiny_config()
    model = dlm_jax.init_model(cfg, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = dlm_jax.save_pretrained(model, Path(tmp) / "tiny", tokenizer=tok)
        reloaded = dlm_jax.load_pretrained(path)
        tok = dlm_jax.load_tokenizer(path)
    same = all(np.array_equal(a, reloaded_p) for a, reloaded_p in
               zip(dlm_jax.get_params(model).values(), dlm_jax.get_params(reloaded).values()))
    print(f"model: random-initialised {dlm_jax.param_count(cfg):,}-parameter {cfg.attention} "
          f"transformer (untrained: its text is noise); save/load round trip identical: {same}",
          file=sys.stderr)
    _decode_loop(reloaded, tok, args.prompt, args)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import dlm_jax

    model = dlm_jax.load_pretrained(args.model)
    tok = dlm_jax.load_tokenizer(args.model)
    _decode_loop(model, tok, args.prompt, args)
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


def _add_decode_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEMO_PROMPT, help="prompt text")
    p.add_argument("--gen", type=int, default=32, help="tokens to generate")
    p.add_argument("--steps", type=int, default=32, help="denoising steps in total")
    p.add_argument("--block", type=int, default=16, help="semi-autoregressive block length")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    from dlm_jax.checkpoint import FAMILIES

    parser = argparse.ArgumentParser(prog="dlm-jax", description=__doc__.strip() + " Diffusion LMs from training to phones.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="save, reload and decode a random tiny model (no weights needed)")
    _add_decode_options(p)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("generate", help="decode with LLaDA's low-confidence remasking (no cache)")
    p.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from dlm_jax import CheckpointError, ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

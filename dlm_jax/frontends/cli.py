"""The `dlm-jax` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dlm_jax.frontends._report import _interrupts_redelivered, _one_line, _Parser, report_errors
from dlm_jax.runtime import registry
from dlm_jax.runtime.registry import decode_options

DEMO_PROMPT = "564+894="  # an addition prompt of the shipped models' task mix


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _check_prompts(prompts: Sequence[str]) -> None:
    """Prompts typed on the command line must be UTF-8 (Python keeps undecodable argv bytes
    as lone surrogates, which no tokenizer can encode)."""
    from dlm_jax._errors import InputError

    for p in prompts:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = p[e.start].encode("utf-8", "surrogateescape")
            raise InputError(f"--prompt {p!r} is not valid UTF-8 (byte 0x{bad.hex()} at character {e.start})") from None


def _load(args: argparse.Namespace, path: str | Path):
    """`dlm_jax.load` with the model flags (--strict, --no-verify / --verify-full,
    --mask-token-id, --lora); a bundle (`dlm-jax export`) loads into the LiteRT runner instead.
    `path` may be a Hugging Face model id in the local cache (`dlm_jax._hub`; --model resolves
    it while parsing already)."""
    import dlm_jax
    from dlm_jax._errors import ConfigError
    from dlm_jax._hub import resolve_checkpoint
    from dlm_jax.executors.bundle_files import BUNDLE_FILE

    path = resolve_checkpoint(path)
    if (Path(path) / BUNDLE_FILE).exists():
        if getattr(args, "mesh", None):
            raise ConfigError(f"--mesh {args.mesh}: {path} is a bundle, which runs on one device (LiteRT); "
                              f"mesh decoding takes a checkpoint")
        if getattr(args, "lora", None):
            raise ConfigError(f"--lora {args.lora}: a bundle carries its adapters from its export "
                              f"(dlm-jax export --lora); {path} is a bundle")
        if getattr(args, "weight_quant", None):
            raise ConfigError(f"--quant {args.weight_quant}: {path} is a bundle, quantized at its export "
                              f"(dlm-jax export --quant)")
        if getattr(args, "dtype", None):
            raise ConfigError(f"--dtype {args.dtype}: {path} is a bundle, whose weights and arithmetic were fixed "
                              f"at its export; --dtype takes a checkpoint")
        return _load_bundle(args, path)
    if getattr(args, "entry_point", False):
        _persistent_compile_cache()

    mask = getattr(args, "mask_token_id", None)
    overrides = {} if mask is None else {"mask_token_id": mask}
    if getattr(args, "dtype", None):  # activations and weights alike
        overrides |= {"dtype": args.dtype, "param_dtype": args.dtype}
    mesh = _mesh_setup(args)
    handle = dlm_jax.load(path, strict=args.strict, verify=args.verify_manifest, executor=getattr(args, "executor", None),
                          lora=getattr(args, "lora", None), expert_slots=getattr(args, "expert_slots", None),
                          quant=getattr(args, "weight_quant", None), **({"mesh": mesh} if mesh else {}),
                          **overrides)
    handle.executor.set_progress(_export_progress())  # the bundle cache draws its exports
    return handle


def _mesh_setup(args: argparse.Namespace):
    """The `--mesh` of a decode command (a `MeshShape`, or None), after joining the processes of
    `--coordinator` (`jax.distributed.initialize`). As the command's own process, on a CPU it
    also splits the host into as many devices as this process's part of the mesh needs (XLA's
    host device count, unless XLA_FLAGS already sets one): both must happen before JAX starts
    its backends."""
    from dlm_jax._errors import ConfigError

    mesh = getattr(args, "mesh", None)
    coordinator = getattr(args, "coordinator", None)
    processes, rank = getattr(args, "num_processes", None), getattr(args, "process_id", None)
    if coordinator is None:
        if processes is not None or rank is not None:
            raise ConfigError("--num-processes / --process-id need --coordinator HOST:PORT (the first process's address)")
        processes = 1
    elif processes is None or rank is None:
        raise ConfigError(f"--coordinator {coordinator} needs --num-processes N and --process-id I (0 <= I < N)")
    elif not 0 <= rank < processes:
        raise ConfigError(f"--process-id {rank} must be in 0 .. {processes - 1} (--num-processes {processes})")
    if mesh is not None and getattr(args, "entry_point", False):
        if mesh.size % processes:
            raise ConfigError(f"--mesh {mesh} ({mesh.size} devices) does not divide over {processes} processes")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={mesh.size // processes}".strip()
    if coordinator is not None:
        from dlm_jax.executors.sharding import join_processes

        if getattr(args, "entry_point", False):
            _native_stdout_to_stderr()
        join_processes(coordinator, num_processes=processes, process_id=rank)
    return mesh


def _native_stdout_to_stderr() -> None:
    """Send what native code writes to the process's stdout to stderr, keeping Python's own
    output (the command's results) on stdout: in a run of several CPU processes, gloo prints a
    line per connection to stdout (file descriptor 1), which would land among the completions.
    For the command's own process only (it swaps file descriptor 1)."""
    sys.stdout.flush()
    results = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(results, "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                           buffering=1 if sys.stdout.line_buffering else -1)


def _export_progress():
    """A `progress(stage, done, total)` drawing one bar per export on stderr."""
    from tqdm import tqdm

    bar = [None]

    def progress(stage: str, done: int, total: int) -> None:
        if not stage.startswith("convert"):
            return
        if done == 1:
            bar[0] = tqdm(total=total, desc="exporting to the bundle cache (once per bucket)", unit="bucket",
                          file=sys.stderr, disable=None)
        bar[0].update(1)
        if done == total:
            bar[0].close()

    return progress


def _persistent_compile_cache() -> None:
    """Keep compiled buckets across runs of a command (~/.cache/dlm-jax/xla, or
    DLM_JAX_CACHE_DIR; "off" disables it): a second `generate` skips XLA compilation. An
    unwritable location only means compiling again. Not for `main(argv)` called from Python,
    whose JAX settings are the caller's."""
    import os

    if os.environ.get("DLM_JAX_CACHE_DIR", "").lower() == "off":
        return
    from dlm_jax.executors._compile import enable_persistent_cache

    try:
        enable_persistent_cache()
    except OSError:
        pass


def _chat(args: argparse.Namespace) -> bool | None:
    """--chat / --raw, else None: the prompt format recorded in the checkpoint."""
    return True if args.chat else False if args.raw else None


def decode_config(args: argparse.Namespace):
    """The preset named by --preset, with every decode option given on the command line."""
    from dlm_jax.runtime.registry import config_from_args

    return config_from_args(args)


def _run_generate(handle, prompts: list, cfg, *, chat: bool | None, stream: bool, max_batch: int | None = None,
                  suffixes: list[str] | None = None) -> dict:
    """Decode `prompts` (texts or token-id lists) as one batch, each before its suffix when
    `suffixes` are given (infilling); with `stream`, print the completions (one prompt: as its
    blocks commit; a batch: one line each when done; ids, space-separated, for a checkpoint
    without a tokenizer)."""
    shown = [""]
    single = len(prompts) == 1 and handle.has_tokenizer

    def on_block(i: int, texts: list[str]) -> None:
        new = texts[0][len(shown[0]):]
        shown[0] = texts[0]
        print(new, end="", flush=True)

    result = handle.generate(prompts, cfg, chat=chat, on_block=on_block if stream and single else None,
                             max_batch=max_batch, suffixes=suffixes)
    completions = result.texts if result.texts is not None else [" ".join(map(str, t)) for t in result.token_ids]
    if stream:
        if single:
            print(result.texts[0][len(shown[0]):], flush=True)
        else:
            print("\n".join(completions), flush=True)
    report = {"prompts": prompts, **({"suffixes": suffixes} if suffixes is not None else {}),
              "completions": completions, "decoder": decode_options(cfg), "stats": result.stats.to_dict()}
    if result.logprobs is not None:
        report["logprobs"] = [_logprobs_json(handle, ids, lp) for ids, lp in zip(result.token_ids, result.logprobs)]
    return report


def _logprobs_json(handle, ids: list[int], lp) -> dict:
    """A completion's tokens with their log-probabilities and likeliest alternatives (`--logprobs`)."""
    piece = (lambda t: handle.tokenizer.decode([int(t)])) if handle.has_tokenizer else str
    return {"tokens": [piece(t) for t in ids], "logprobs": [round(float(v), 6) for v in lp.logprob],
            "top_logprobs": [{piece(t): round(float(v), 6) for t, v in zip(top, values)}
                             for top, values in zip(lp.top_ids, lp.top_logprob)]}


def shipped_model(name: str = "llada-tiny") -> Path:
    """A shipped checkpoint: inside the installed package (`dlm_jax/_shipped/<name>`, package
    data of the wheel: llada-tiny), else the source checkout's `models/<name>`."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "_shipped" / name
    return installed if installed.is_dir() else package.parent / "models" / name


def _label(cfg) -> str:
    """A decoder's name from its options, e.g. `prefix cache + threshold 0.9, block 32, gen 64`."""
    o = decode_options(cfg)
    if o["cache"] == "ar":
        return f"left to right, gen {cfg.gen_len}"
    if o["cache"] == "isd":
        extra = "".join(f", {k} {o[k]}" for k, d in (("verify", "exact"), ("proposal", "argmax"), ("relax", 0.0))
                        if o[k] != d)
        return f"isd stride {o['stride']}{extra}, gen {cfg.gen_len}"
    rule = o["rule"]
    if rule == "topk":
        rule += f", {o['steps'] or cfg.gen_len} steps"
    else:
        param = {"threshold": "threshold", "factor": "factor", "factor_paper": "factor", "frechet": "delta"}.get(rule)
        rule += f" {o[param]}" if param else ""
    return f"{o['cache']} cache + {rule}, block {o['block_len']}, gen {cfg.gen_len}"


def demo_decoders(args: argparse.Namespace) -> dict:
    """The demo's two decoders: the one the decode flags describe (default: Fast-dLLM's prefix
    cache + threshold 0.9, block 32, generation 64), and LLaDA's vanilla decoder (no cache,
    top-k, one step per token) with the same block, length and sampling options; for ISD (a
    causal model), left-to-right decoding with the same length and sampling options."""
    if args.gen_len is None:
        args.gen_len = 64
    chosen = decode_config(args)
    if decode_options(chosen)["cache"] in ("isd", "ar"):
        sampling = {k: v for k, v in decode_options(chosen).items() if k in ("temperature", "top_k", "top_p", "seed")}
        from dlm_jax.runtime.registry import preset

        vanilla = preset("ar", gen_len=chosen.gen_len, **sampling)
    else:
        vanilla = registry.decode_config(chosen, cache="none", rule="topk", steps=chosen.gen_len)
    return {_label(chosen): chosen, f"vanilla: {_label(vanilla)}": vanilla}


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: answer held-out task prompts (or the --prompt texts) with the shipped
    llada-tiny, once with the decoder the flags choose (default the fast one) and once with
    LLaDA's vanilla decoder, and compare."""
    import dlm_jax

    if args.prompt:
        _check_prompts(args.prompt)
    decoders = demo_decoders(args)  # bad options fail before the model loads
    path = Path(args.model) if args.model else shipped_model()
    if not args.model and not path.exists():
        return _demo_random(args, decoders)
    handle = _load(args, path)
    print(f"model: {path} ({dlm_jax.param_count(handle.config):,} parameters, {handle.config.attention}, "
          f"{handle.prompt_format} prompts)", file=sys.stderr)
    summary = {}
    for name, cfg in decoders.items():
        print(f"\n== {name}")
        summary[name] = (_demo_prompts(handle, cfg, args) if args.prompt else _demo_tasks(handle, cfg, args))
        print(json.dumps(summary[name]))
    chosen, vanilla = summary.values()
    print(json.dumps({"speedup_vs_vanilla": round(vanilla["seconds"] / max(chosen["seconds"], 1e-9), 2),
                      "nfe_ratio": round(chosen["mean_nfe"] / max(vanilla["mean_nfe"], 1e-9), 3)}))
    return 0


def _demo_tasks(handle, cfg, args: argparse.Namespace) -> dict:
    from dlm_jax.training.data import TASKS
    from dlm_jax.training.evaluate import evaluate

    total = {"correct": 0, "n": 0, "nfe": 0.0, "seconds": 0.0}
    for task in TASKS:
        report = evaluate(handle, task, cfg, n=args.per_task, max_batch=args.per_task, progress=False,
                          keep=args.per_task, chat=_chat(args))
        for s_ in report["samples"]:
            mark = "ok " if s_["correct"] else "BAD"
            print(f"[{mark}] {task:8s} {s_['prompt']!r} -> {s_['completion']!r} (expected {s_['answer']!r})")
        total["correct"] += round(report["accuracy"] * report["n"])
        total["n"] += report["n"]
        total["nfe"] += report["mean_nfe"] * report["n"]
        total["seconds"] += report["seconds"]
    return {"accuracy": total["correct"] / total["n"], "mean_nfe": total["nfe"] / total["n"],
            "seconds": round(total["seconds"], 3)}


def _demo_prompts(handle, cfg, args: argparse.Namespace) -> dict:
    """The --prompt texts, decoded as one batch."""
    import time

    chat = _chat(args)
    handle.decoder.warmup([len(handle.encode(p, chat=chat)) for p in args.prompt], cfg)
    t0 = time.perf_counter()
    result = handle.generate(args.prompt, cfg, chat=chat)
    seconds = time.perf_counter() - t0
    for prompt, text in zip(args.prompt, result.texts):
        print(f"{prompt!r} -> {text!r}")
    nfe = result.stats.request_nfe
    return {"mean_nfe": sum(nfe) / len(nfe), "seconds": round(seconds, 3)}


def _demo_random(args: argparse.Namespace, decoders: dict) -> int:
    """Without a shipped model: save and reload a random tiny model through the HF layout and
    decode with the demo's decoders (the text is noise)."""
    import numpy as np

    import dlm_jax

    from dlm_jax.models._params import tiny_byte_config

    tok, cfg = tiny_byte_config()
    model = dlm_jax.init_model(cfg, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = dlm_jax.save_pretrained(model, Path(tmp) / "tiny", tokenizer=tok)
        handle = dlm_jax.load(path, executor=args.executor, quant=args.weight_quant)
    saved, loaded = dlm_jax.get_params(model), dlm_jax.get_params(handle.model)  # by name (a stack orders them apart)
    same = saved.keys() == loaded.keys() and all(np.array_equal(saved[k], loaded[k]) for k in saved)
    print(f"model: random-initialised {dlm_jax.param_count(cfg):,}-parameter {cfg.attention} transformer "
          f"(untrained: its text is noise); save/load round trip identical: {same}", file=sys.stderr)
    for name, dcfg in decoders.items():
        report = _run_generate(handle, args.prompt or [DEMO_PROMPT], dcfg, chat=_chat(args), stream=False)
        print(json.dumps({"decoder_name": name, **report}, ensure_ascii=False))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    _check_prompts(args.prompt or [])
    cfg = decode_config(args)  # bad options fail before the model loads
    prompts = args.prompt or args.prompt_ids
    suffixes = _suffix_texts(args, prompts)
    handle = _load(args, args.model)
    _need_tokenizer(handle, suffixes)
    report = _run_generate(handle, prompts, cfg, chat=_chat(args), stream=True, max_batch=args.max_batch,
                           suffixes=suffixes)
    print(json.dumps(report["stats"]), file=sys.stderr)
    for i, logprobs in enumerate(report.get("logprobs", [])):  # --logprobs N: a line per completion
        print(json.dumps({"completion": i, **logprobs}, ensure_ascii=False), file=sys.stderr)
    return 0


def _suffix_texts(args: argparse.Namespace, prompts: list) -> list[str] | None:
    """`--suffix-text`, one per prompt (a single one for all of them), or None."""
    suffixes = getattr(args, "suffix_text", None)
    if suffixes is None:
        return None
    from dlm_jax._errors import InputError

    if len(suffixes) not in (1, len(prompts)):
        raise InputError(f"{len(suffixes)} --suffix-text for {len(prompts)} prompts: give one for all, or one per prompt")
    _check_prompts(suffixes)
    return suffixes * len(prompts) if len(suffixes) == 1 else suffixes


def _need_tokenizer(handle, suffixes: list[str] | None) -> None:
    if suffixes is not None and not handle.has_tokenizer:
        from dlm_jax._errors import InputError

        raise InputError("--suffix-text is text: this checkpoint has no tokenizer")


def _add_suffix_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suffix-text", action="append", metavar="TEXT",
                   help="text that follows the completion (infilling: the completion is decoded between the prompt "
                        "and it; fed as it is); once for every prompt, or once per prompt in their order")


def cmd_serve(args: argparse.Namespace) -> int:
    from dlm_jax.frontends import server

    cfg = decode_config(args)  # bad options fail before the model loads
    if args.coordinator:
        from dlm_jax._errors import ConfigError

        raise ConfigError(f"--coordinator {args.coordinator}: serve runs on one process (its requests arrive at "
                          f"times other processes do not share); --mesh spans that process's devices")
    name = args.served_model_name or server.default_name(args.model)
    sock = server.bind(args.host, args.port)  # a port in use fails before the model loads, too
    sock.close()
    handle = _load(args, args.model)
    service = server.Service(handle, cfg, name=name, max_batch=args.max_batch, max_waiting=args.max_waiting,
                             max_tokens=args.max_tokens, max_body=args.max_body, warmup=args.warmup,
                             warmup_sampling=args.warmup_sampling, warmup_infill=args.warmup_infill or 0)
    return server.serve(service, host=args.host, port=args.port, grace=args.grace, log_level=args.log_level)


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535; 0: any free port)")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds >= 0")
    return value


def _load_bundle(args: argparse.Namespace, path: str | Path):
    from dlm_jax.executors.runner import load_bundle

    handle = load_bundle(path, accelerator=getattr(args, "accelerator", None) or "cpu",
                         threads=getattr(args, "threads", 2), cpu_fallback=getattr(args, "cpu_fallback", False),
                         verify=getattr(args, "verify_manifest", True),
                         **({"memory_budget_mb": args.memory_budget} if getattr(args, "memory_budget", None) else {}),
                         **({"oracle": True} if getattr(args, "oracle", False) else {}),
                         **({"prefetch": True} if getattr(args, "prefetch", False) else {}),
                         on_note=lambda note: print(f"note: {note}", file=sys.stderr))
    return handle


def cmd_run(args: argparse.Namespace) -> int:
    """Decode with an exported bundle through LiteRT: no JAX, the bundle's decode defaults
    unless --preset or decode flags say otherwise."""
    from dlm_jax.executors.runner import Bundle
    from dlm_jax.runtime.registry import PRESETS, build, options

    _check_prompts(args.prompt or [])
    bundle = Bundle.open(args.bundle, verify=args.verify_manifest)
    if args.accelerator is None:
        args.accelerator = bundle.accelerator
    given = {name: getattr(args, name) for name in options() if getattr(args, name, None) is not None}
    cfg = build(given, base=PRESETS[args.preset] if args.preset else bundle.meta.get("decode", {}))
    if args.lora and not bundle.gated:
        from dlm_jax._errors import ConfigError

        raise ConfigError(f"--lora {args.lora}: the bundle {args.bundle} has no adapters (its signatures take no "
                          f"lora_gate input); export it with --lora {args.lora}")
    prompts = args.prompt or args.prompt_ids
    suffixes = _suffix_texts(args, prompts)
    handle = _load_bundle(args, args.bundle)
    _need_tokenizer(handle, suffixes)
    if handle.accelerator_note:
        print(f"warning: {handle.accelerator_note}", file=sys.stderr)
    report = _run_generate(handle, prompts, cfg, chat=_chat(args), stream=True, max_batch=args.max_batch,
                           suffixes=suffixes)
    cold = getattr(handle.executor, "cold", None)
    extra = {"neurons": cold.counters.to_dict()} if cold is not None else {}
    print(json.dumps({**report["stats"], "bundle": bundle.describe(), **extra}), file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint -> a LiteRT bundle (one signature per bucket) with a progress bar."""
    from tqdm import tqdm

    from dlm_jax._errors import ConfigError
    from dlm_jax.tflite_export.bundle import buckets_for_prompts, export_bundle, parse_bucket
    from dlm_jax.tflite_export.gguf import GGUF_QUANTS

    if args.format == "gguf":
        return _export_gguf(args)
    if args.quant in GGUF_QUANTS:
        raise ConfigError(f"--quant {args.quant} is a GGUF quantisation: pass --format gguf (bundles take "
                          f"none, int8, int4 or int4-outliers)")
    from dlm_jax._hub import resolve_checkpoint
    from dlm_jax.checkpoint._io import refuse_stored_quant

    if (source := resolve_checkpoint(args.model)).is_dir():  # before a sparse export's calibration loads it
        refuse_stored_quant(source, "a LiteRT bundle (its own int8 / int4 with --quant)")
    cfg = decode_config(args)
    if args.buckets:
        keys = [parse_bucket(b) for b in args.buckets]
    else:
        import dlm_jax

        model_cfg, _ = dlm_jax.load_config(args.model, strict=args.strict)
        keys = buckets_for_prompts(model_cfg, cfg, max_prompt=args.for_prompts or 64, batches=args.batch)
    if args.memory_budget is not None and not args.sparse:
        raise ConfigError("--memory-budget plans a sparse bundle: pass --sparse with it")
    sparse, report = None, None
    if args.sparse:
        from dlm_jax.techniques.powerinfer.sparse import sparse_export

        if args.memory_budget is None:
            raise ConfigError("--sparse needs --memory-budget MB (what the bundle may keep in memory)")
        args.executor = "jax"  # the calibration decodes read ffn_active
        handle = _load(args, args.model)
        print("calibrating the neuron plan (activation statistics, predictor)", file=sys.stderr)
        sparse, report = sparse_export(handle, cfg, keys, budget_mb=args.memory_budget, cluster=args.cluster)
    bar = tqdm(total=len(keys), desc="export", unit="program" if args.partition or sparse else "bucket",
               file=sys.stderr, disable=None)

    def progress(stage: str, done: int, total: int) -> None:
        bar.set_postfix_str(stage)
        if stage.startswith("convert"):
            bar.total = total
            bar.update(1)

    try:
        result = export_bundle(args.model, args.out, keys=keys, decode=cfg, quant=args.quant, target=args.target,
                               add=args.add, overwrite=args.overwrite, verify=args.verify_manifest, strict=args.strict,
                               progress=progress, latency_repeats=args.latency_repeats, lora=args.lora,
                               partition=args.partition, sparse=sparse)
    finally:
        bar.close()
    print(json.dumps({"bundle": str(result.path), "buckets": len(result.keys), "added": len(result.added),
                      "model_bytes": result.model_bytes, "quant": args.quant, "target": args.target,
                      "partitioned": bool(args.partition or sparse),
                      **({"predictor": {"recall": report.recall, "window_recall": report.window_recall}}
                         if report else {}),
                      "seconds": round(result.seconds, 1)}))
    return 0


def _export_gguf(args: argparse.Namespace) -> int:
    """`export --format gguf`: one GGUF file llama.cpp's LLaDA loader reads."""
    from dlm_jax._errors import ConfigError
    from dlm_jax.tflite_export.gguf import GGUF_QUANTS, export_gguf

    quant = "f32" if args.quant == "none" else args.quant
    if quant not in GGUF_QUANTS:
        raise ConfigError(f"--quant {args.quant} is a bundle quantisation; GGUF takes {', '.join(GGUF_QUANTS)}")
    bundle_only = {"--buckets": args.buckets, "--for-prompts": args.for_prompts, "--add": args.add,
                   "--partition": args.partition, "--sparse": args.sparse, "--lora": args.lora,
                   "--memory-budget": args.memory_budget, "--target": args.target != "cpu"}
    if given := [flag for flag, value in bundle_only.items() if value]:
        raise ConfigError(f"{', '.join(given)} apply to bundles, not to --format gguf")
    result = export_gguf(args.model, args.out, quant=quant, verify=args.verify_manifest, strict=args.strict,
                         overwrite=args.overwrite)
    print(json.dumps({"gguf": str(result.path), "quant": quant, "bytes": result.bytes, "tensors": result.tensors,
                      "types": result.types, "seconds": round(result.seconds, 2)}))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import dlm_jax

    from dlm_jax._hub import resolve_checkpoint
    from dlm_jax.checkpoint._io import stored_quant, stored_quant_float, stored_quant_layout

    cfg, family = dlm_jax.load_config(args.model, strict=args.strict)
    path = resolve_checkpoint(args.model)
    quant = stored_quant(path) if path.is_dir() else None  # stored weight-only quantized: loads so, and only so
    stored = {"weight_quant": quant} if quant is None else {
        "weight_quant": quant, "weight_quant_float": sorted(stored_quant_float(path))}
    if quant is not None and (layout := stored_quant_layout(path)) is not None:  # published pre-quantized
        stored["weight_quant_stored"] = layout
    print(json.dumps({"family": family.name, "parameters": dlm_jax.param_count(cfg), **stored,
                      "config": cfg.to_dict()}, indent=2))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """`plan`: the bytes per device of every mesh of --devices devices, from the config alone
    (`dlm_jax.planner`); exit status 1 when no mesh fits."""
    from dlm_jax._errors import ConfigError

    if not args.memory > 0:
        raise ConfigError(f"--memory {args.memory:g}: GiB per device must be > 0")
    from dlm_jax.planner import format_plan, plan, read_config

    from dlm_jax._hub import resolve_checkpoint
    from dlm_jax.checkpoint._io import CONFIG_NAME, stored_quant, stored_quant_float

    cfg, family = read_config(args.model, strict=args.strict)
    if args.dtype:  # as `--dtype` loads it on the decode commands
        cfg = cfg.replace(dtype=args.dtype, param_dtype=args.dtype)
    if args.context is not None and args.context > cfg.max_seq_len:
        raise ConfigError(f"--context {args.context} exceeds the model's max_seq_len {cfg.max_seq_len}")
    source = resolve_checkpoint(args.model)
    directory = source if source.is_dir() else source.parent if source.name == CONFIG_NAME else None
    quant = args.weight_quant
    stored = stored_quant(directory) if directory is not None else None
    if stored is not None:  # stored quantized: it loads so, and only so (as `dlm_jax.load`)
        if quant not in (None, stored):
            raise ConfigError(f"--quant {quant}: {args.model} is stored weight-only quantized as {stored!r}; plan it "
                              f"with --quant {stored} or without --quant")
        quant = stored
    keep = stored_quant_float(directory) if stored is not None else frozenset()  # (a pre-quantized one's float kernels)
    result = plan(cfg, devices=args.devices, memory_gib=args.memory, batch=args.batch, context=args.context,
                  quant=quant, quant_float=keep)
    if args.json:
        print(json.dumps({"model": args.model, "family": family, **result.to_dict()}, indent=2))
    else:
        print(format_plan(result, model=f"{args.model}, {family}"))
    return 0 if result.pick is not None else 1


def cmd_convert(args: argparse.Namespace) -> int:
    from dlm_jax.checkpoint import convert_checkpoint

    convert_checkpoint(args.model, args.out, family=args.family, overwrite=args.overwrite, strict=args.strict,
                       verify=args.verify_manifest)
    print(f"wrote {args.out} ({args.family})")
    return 0


def cmd_manifest(args: argparse.Namespace) -> int:
    """Record a directory's current files in its manifest.json, after config.json or tokenizer
    files were edited by hand (loading warns until then); one line on what changed."""
    from dlm_jax._integrity import rewrite_manifest

    print(rewrite_manifest(args.directory, force=args.force).summary())
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from dlm_jax.buckets._profile import profile_model

    profile_model(args.model, out=Path(args.out), windows=args.windows, caches=args.caches,
                  batch=args.batch, repeats=args.repeats, quant=args.weight_quant)
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    """`cache list` / `cache clear`: the bundle cache's entries (all, or those of --model)."""
    from dlm_jax.tflite_export import cache_admin
    from dlm_jax.executors.bundle_cache import model_entries

    from dlm_jax._hub import resolve_checkpoint

    root = cache_admin.cache_root()
    if args.model is not None:
        args.model = str(resolve_checkpoint(args.model))  # a Hugging Face model id: its cached snapshot
    if args.model is not None and not Path(args.model).is_dir():
        from dlm_jax._errors import CheckpointError

        raise CheckpointError(f"--model {args.model}: no such checkpoint directory")
    found = model_entries(args.model, root) if args.model else cache_admin.entries(root)
    if args.action == "list":
        print(json.dumps(cache_admin.describe(found, root), indent=2) if args.json
              else cache_admin.table(found, root, args.model))
        return 0
    print(cache_admin.cleared([e for e in found if cache_admin.remove_entry(e.path)], root))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import shlex

    from dlm_jax.training.config import RunConfig
    from dlm_jax.training.loop import TrainingInterrupted, train

    run = RunConfig.load(args.config)  # every key checked before anything is built
    out = Path(args.out or Path("runs") / Path(args.config).stem)
    try:
        result = train(run, out, resume=not args.fresh, replace=args.replace)
    except KeyboardInterrupt as e:  # Ctrl-C: train saved a checkpoint; say how to go on, no traceback
        where = f"interrupted at step {e.step}" if isinstance(e, TrainingInterrupted) else "interrupted"
        print(f"{where}; resume with: dlm-jax train --config {shlex.quote(str(args.config))} "
              f"--out {shlex.quote(str(out))}", file=sys.stderr)
        return 130
    print(json.dumps({"steps": result.steps, "final_loss": result.final_loss, "seconds": round(result.seconds, 1),
                      "tokens_per_second": round(result.tokens_per_second), "model": str(result.model_dir),
                      "resumed_from": result.resumed_from,
                      "replaced": str(result.replaced) if result.replaced else None}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from dlm_jax.training.evaluate import evaluate

    cfg = decode_config(args)
    handle = _load(args, args.model)
    report = evaluate(handle, args.task, cfg, n=args.n, max_batch=args.max_batch, keep=args.show, chat=_chat(args))
    report["decoder"] = decode_options(cfg)
    print(json.dumps(report, indent=2, ensure_ascii=False))
    return 0


def cmd_lm_eval(args: argparse.Namespace) -> int:
    """lm-evaluation-harness's command line with the model "dlm-jax" (`dlm_jax.frontends.lmeval`), which
    loads lm-eval only here: it is an optional extra."""
    from dlm_jax.frontends.lmeval import run

    return run(args.lm_eval_args)


def _add_max_batch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="prompts decoding at once on the continuous-batching engine (default: the batch "
                        "bucket that holds them all, at most the largest whose K/V fit)")


def _add_decode_options(p: argparse.ArgumentParser) -> None:
    from dlm_jax.runtime.registry import add_cli_options

    add_cli_options(p)


def token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integer token ids") from None
    if not ids:
        raise argparse.ArgumentTypeError("an empty list of token ids")
    return ids


def _add_prompt_options(p: argparse.ArgumentParser, *, required: bool, help_: str, ids: bool = False) -> None:
    given = p.add_mutually_exclusive_group(required=required) if ids else p
    given.add_argument("--prompt", action="append", required=required and not ids,
                       help=help_ + "; repeat to decode a batch")
    if ids:
        given.add_argument("--prompt-ids", action="append", type=token_ids, metavar="IDS",
                           help="a prompt as token ids ('12 7 99'), e.g. for a checkpoint without tokenizer "
                                "files; repeat to decode a batch")
    _add_format_options(p)


def _add_format_options(p: argparse.ArgumentParser) -> None:
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--chat", action="store_true",
                     help="wrap prompts in the chat template (default: the prompt format the checkpoint records)")
    fmt.add_argument("--raw", action="store_true", help="feed prompt text as it is, without the chat template")


def _add_executor_option(p: argparse.ArgumentParser) -> None:
    from dlm_jax.api import EXECUTOR_CHOICES

    p.add_argument("--executor", choices=EXECUTOR_CHOICES,
                   help="what runs the decode steps: auto (default, or $DLM_JAX_EXECUTOR) is, on a CPU, the "
                        "LiteRT runner over a bundle cache (~/.cache/dlm-jax/bundles, or $DLM_JAX_BUNDLE_CACHE) "
                        "for decodes whose buckets it holds and JAX for the others, while a background process "
                        "exports them ($DLM_JAX_BACKGROUND_EXPORT=0: off); JAX on a GPU/TPU. jax: the JAX "
                        "executor; litert: the LiteRT runner, exporting what the cache lacks first")
    _add_quant_option(p)
    _add_dtype_option(p)
    p.add_argument("--expert-slots", type=int, metavar="S", help="split expert execution of an MoE model: S routed "
                   "experts per layer in the compiled step, the rest on a NumPy CPU path; --experts moves them "
                   "(previous-step hits, --expert-budget S + shared); JAX executor")
    _add_mesh_options(p)


def mesh_shape(text: str):
    from dlm_jax._errors import ConfigError
    from dlm_jax._partition import MeshShape

    try:
        return MeshShape.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_mesh_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", type=mesh_shape, metavar="tp=N[,ep=M][,dp=K]",
                   help="decode on a device mesh (docs/mesh.md): tp splits heads, FFN neurons and the vocabulary, "
                        "ep an MoE model's experts, dp the batch rows; JAX executor. On a CPU the host is split "
                        "into that many devices")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="several processes, one mesh: the first process's address (jax.distributed); every "
                        "process runs the same command with its own --process-id")
    p.add_argument("--num-processes", type=positive_int, metavar="N", help="processes of --coordinator's run")
    p.add_argument("--process-id", type=int, metavar="I", help="this process's rank, 0 .. N-1 (0 hosts the coordinator)")


def _add_dtype_option(p: argparse.ArgumentParser) -> None:
    from dlm_jax._config import DTYPES

    p.add_argument("--dtype", choices=DTYPES,
                   help="the dtype of the weights and the arithmetic, JAX executor (default: the checkpoint's, as "
                        "its config.json records): bfloat16 halves a float32 checkpoint's bytes on a GPU")


def _add_quant_option(p: argparse.ArgumentParser) -> None:
    # dest weight_quant: `export --quant` (a bundle's quantisation) is another option
    p.add_argument("--quant", dest="weight_quant", type=_weight_quant_arg, metavar="{int8,fp8,int4,uint4}[-gN]",
                   help="weight-only quantization at load, JAX executor: int8, fp8 (e4m3), int4 or uint4 (4-bit "
                        "with zero points) weights with a scale per output channel, or with -gN per output channel "
                        "and group of N input rows (int8-g128, int4-g32), dequantised inside the matmuls (default: "
                        "the weights as stored)")


def _weight_quant_arg(text: str) -> str:
    """A --quant value of the decode commands (`dlm_jax._config.weight_quant_parts`; the module
    `dlm_jax.models.quant` imports JAX)."""
    from dlm_jax._config import weight_quant_parts
    from dlm_jax._errors import ConfigError

    try:
        weight_quant_parts(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _checkpoint_arg(text: str) -> str:
    """A --model / --lora value: a path as given, or a Hugging Face model id `org/name[@revision]`
    resolved to its snapshot in the local cache; one not cached is a one-line usage error
    giving the download command (`dlm_jax._hub`)."""
    from dlm_jax._errors import CheckpointError
    from dlm_jax._hub import parse_hub_id, snapshot_path

    hub = parse_hub_id(text)
    if hub is None:
        return text  # a path (missing ones fail where they are read, naming them)
    try:
        return str(snapshot_path(*hub))
    except CheckpointError as e:
        raise argparse.ArgumentTypeError(_one_line(e)) from None


def _add_lora_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", metavar="DIR", type=_checkpoint_arg,
                   help="LoRA adapters made for this checkpoint (adapter_config.json + adapter_model.safetensors; "
                        "R-ISD: on mask rows only), or a Hugging Face model id of them in the local cache")


def _add_model_options(p: argparse.ArgumentParser, *, verify: bool = True, mask: bool = True) -> None:
    """The checkpoint flags. Also makes the command's --model (added before this) take a Hugging
    Face model id, `org/name[@revision]`, from the local cache: resolved to its snapshot
    directory while parsing, so every command that reads args.model (export, inspect, convert,
    ...) gets a directory; one not cached is a one-line usage error giving the download command."""
    for action in p._actions:
        if action.dest == "model" and action.type is None:
            action.type = _checkpoint_arg
            action.help = (action.help or "checkpoint directory") + (
                ", or a Hugging Face model id org/name[@revision] in the local cache (hf download org/name)")
    p.add_argument("--strict", action="store_true",
                   help="refuse config.json keys this loader does not know (default: warn and ignore them)")
    if verify:
        check = p.add_mutually_exclusive_group()
        check.add_argument("--no-verify", dest="verify_manifest", action="store_false", default=True,
                           help="skip checking the files against the checkpoint's manifest (size and sha256)")
        check.add_argument("--verify-full", dest="verify_manifest", action="store_const", const="full", default=True,
                           help="hash every byte of every file the manifest lists (default: files over 64 MiB by "
                                "size and sampled chunks)")
    if mask:
        p.add_argument("--mask-token-id", type=int, metavar="ID",
                       help="the mask token id, for a checkpoint whose config and tokenizer declare none")


def build_parser() -> argparse.ArgumentParser:
    from dlm_jax.checkpoint._families import FAMILIES
    from dlm_jax.executors.runner import ACCELERATORS
    from dlm_jax.runtime.step import SIGNATURE_FORMAT
    from dlm_jax.tflite_export.bundle import QUANT_MODES, TARGETS
    from dlm_jax.tflite_export.gguf import GGUF_QUANTS

    parser = _Parser(prog="dlm-jax", description="Diffusion LMs from training to phones.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="answer held-out task prompts with the shipped model, fast vs vanilla")
    p.add_argument("--model", help="checkpoint directory (default: the shipped models/llada-tiny)")
    p.add_argument("--per-task", type=positive_int, default=3, help="held-out prompts per task")
    _add_prompt_options(p, required=False, help_="decode this text instead of the held-out task prompts")
    _add_model_options(p)
    _add_lora_option(p)
    _add_executor_option(p)
    _add_decode_options(p)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("generate", help="decode prompts, printing text as blocks commit (stats on stderr)")
    _add_max_batch(p)
    p.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    _add_prompt_options(p, required=True, help_="prompt text", ids=True)
    _add_suffix_option(p)
    _add_model_options(p)
    _add_lora_option(p)
    _add_executor_option(p)
    _add_decode_options(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the continuous-batching engine "
                                     "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port_number, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients name in their requests (default: the checkpoint directory's name)")
    _add_max_batch(p)
    p.add_argument("--max-waiting", type=positive_int, default=64,
                   help="requests that may wait for a batch row; more are answered 429 with Retry-After (default 64)")
    p.add_argument("--max-tokens", type=positive_int, metavar="T",
                   help="slots per request, prompt + generation (default: the model's limit)")
    p.add_argument("--max-body", type=positive_int, default=1 << 20, metavar="BYTES",
                   help="largest request body (default 1 MiB; larger: 413)")
    p.add_argument("--grace", type=positive_float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds running requests get to finish before they are cancelled (default 30)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="report healthy at once; programs then compile when a request first needs them")
    p.add_argument("--warmup-sampling", action="store_true",
                   help="warm up the programs of requests that sample, set penalties or a logit_bias (up to 64 "
                        "entries), or ask for logprobs too (about twice the warm-up)")
    p.add_argument("--warmup-infill", type=positive_int, metavar="N",
                   help="warm up the programs of requests with a suffix (infilling) of up to N tokens too (one set "
                        "per size of the slots after a generation: 8, 16, ...; bidirectional models; with "
                        "--warmup-sampling, suffix requests that sample too)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info adds a line per request; default warning)")
    _add_model_options(p)
    _add_lora_option(p)
    _add_executor_option(p)
    for action in p._actions:
        if action.dest == "executor":
            action.default = "jax"
            action.help = "what runs the decode steps (default jax: compiled at warm-up; " + action.help.split(": ", 1)[1]
    _add_decode_options(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("export", help="export a checkpoint as a LiteRT bundle: one .tflite signature per bucket, "
                                      "tokenizer, decode defaults, latency table, lowering plan, manifest")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--out", required=True, help="bundle directory to write")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--buckets", nargs="+", metavar="NAME",
                       help=f"buckets by signature name, e.g. step_w32_p64_r32 ({SIGNATURE_FORMAT})")
    given.add_argument("--for-prompts", type=positive_int, metavar="N",
                       help="every bucket the decode options need for prompts of up to N tokens (default 64)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1],
                   help="batch sizes to export buckets for (with --for-prompts; default 1)")
    p.add_argument("--format", default="bundle", choices=["bundle", "gguf"],
                   help="bundle (default): a LiteRT bundle directory; gguf: one GGUF file for llama.cpp "
                        "(architecture llada; --out names the file)")
    p.add_argument("--quant", default="none", choices=[*QUANT_MODES, *GGUF_QUANTS],
                   help="weight quantisation. Bundles, with LiteRT's quantised kernels: none (default, float32), "
                        "int8, int4, int4-outliers (PowerInfer-2's INT4 per channel + INT8 outlier channels in "
                        "the NPU programs of a partitioned bundle). GGUF: f32 (default), f16, q8_0, q4_0")
    p.add_argument("--target", default="cpu", choices=list(TARGETS),
                   help="the runner's default accelerator; qualcomm-* compiles ahead of time (needs the vendor SDK)")
    p.add_argument("--add", action="store_true", help="add the buckets to the bundle already at --out")
    p.add_argument("--overwrite", action="store_true", help="replace the bundle already at --out")
    p.add_argument("--latency-repeats", type=positive_int, default=5, help="runs per bucket for the latency table")
    p.add_argument("--partition", action="store_true",
                   help="write the lowering's NPU/CPU partition as the programs that run: tile-aligned NPU bodies, "
                        "a CPU head, the embedding as a CPU table")
    p.add_argument("--sparse", action="store_true",
                   help="a partitioned bundle of an activation-sparse (ReLU-family FFN) model: hot neurons on the "
                        "NPU, cold ones on the CPU from a neuron-bundled flash file (PowerInfer-2); needs "
                        "--memory-budget")
    p.add_argument("--memory-budget", type=float, metavar="MB",
                   help="with --sparse: the memory the bundle may use (hot neurons, programs, neuron cache)")
    p.add_argument("--cluster", type=positive_int, default=128,
                   help="with --sparse: neurons per hot cluster (hot counts are whole clusters; default 128)")
    _add_model_options(p, mask=False)
    _add_lora_option(p)
    _add_decode_options(p)
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("run", help="decode prompts with an exported bundle through LiteRT (no JAX), streaming text")
    _add_max_batch(p)
    p.add_argument("bundle", help="bundle directory (dlm-jax export)")
    _add_prompt_options(p, required=True, help_="prompt text", ids=True)
    _add_suffix_option(p)
    p.add_argument("--accelerator", choices=ACCELERATORS,
                   help="LiteRT accelerator (default: the bundle's target; cpu is XNNPACK)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (default 2; 0: LiteRT decides)")
    p.add_argument("--cpu-fallback", action="store_true",
                   help="let ops the GPU/NPU cannot run fall back to the CPU instead of refusing the bundle")
    p.add_argument("--no-verify", dest="verify_manifest", action="store_false",
                   help="skip checking the bundle's files against its manifest")
    p.add_argument("--memory-budget", type=float, metavar="MB",
                   help="a sparse bundle: keep at most this much in memory (the rest of the FFN is read from its "
                        "flash file as needed); default: every neuron once read stays")
    p.add_argument("--oracle", action="store_true",
                   help="a sparse bundle: pick cold neurons by their true activations instead of the predictor "
                        "(exact; reads every gate row: for measurements)")
    p.add_argument("--prefetch", action="store_true",
                   help="a sparse bundle: read the likeliest cold neurons ahead (background reads) into an empty "
                        "neuron cache")
    _add_lora_option(p)
    _add_decode_options(p)
    p.set_defaults(func=cmd_run, preset=None)
    p = sub.add_parser("inspect", help="print a checkpoint's family, config and size")
    p.add_argument("--model", required=True)
    _add_model_options(p, verify=False, mask=False)
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("plan", help="bytes per device of each decode mesh (tp, ep, dp) of N devices, from the config "
                                    "alone, and the mesh to pick (docs/mesh.md)")
    p.add_argument("--model", required=True, help="checkpoint directory or config.json file")
    p.add_argument("--devices", type=positive_int, required=True, help="devices of the mesh")
    p.add_argument("--memory", type=float, required=True, metavar="GIB", help="memory of each device, GiB")
    p.add_argument("--batch", type=positive_int, default=1, help="batch rows (the engine's) (default 1)")
    p.add_argument("--context", type=positive_int, help="positions per row (default: the model's max_seq_len)")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_quant_option(p)
    _add_dtype_option(p)
    _add_model_options(p, verify=False, mask=False)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("convert", help="rewrite a checkpoint in another family's layout")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--family", default="dlm_jax", choices=sorted(FAMILIES))
    p.add_argument("--overwrite", action="store_true")
    _add_model_options(p, mask=False)
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("manifest", help="record a checkpoint's current files in its manifest.json (after editing "
                                        "config.json or tokenizer files by hand; prints what changed)")
    p.add_argument("directory", help="checkpoint (or bundle) directory")
    p.add_argument("--force", action="store_true",
                   help="also record weight files whose bytes changed (refused by default: likelier corrupt than "
                        "edited)")
    p.set_defaults(func=cmd_manifest)
    p = sub.add_parser("train", help="train a model from a TOML config (resumes the run in --out; Ctrl-C saves "
                                      "a checkpoint)")
    p.add_argument("--config", required=True, help="e.g. examples/configs/llada-tiny.toml")
    p.add_argument("--out", help="run directory (default runs/<config name>); a run there is resumed, its "
                                 "config must match but for [train] steps, log_every, checkpoint_every, "
                                 "keep_checkpoints, mesh_data and mesh_model")
    p.add_argument("--fresh", action="store_true",
                   help="start a new run instead of resuming; refused if --out already holds files (see --replace)")
    p.add_argument("--replace", action="store_true",
                   help="start a new run, first moving whatever --out holds aside to <out>.old-<date-time> "
                        "(one rename; nothing is deleted)")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("eval", help="task accuracy, NFE and tokens/s of a model under a decoder setting")
    p.add_argument("--model", required=True)
    p.add_argument("--task", required=True, help="addition, sorting or gsm_lite")
    p.add_argument("--n", type=positive_int, default=200, help="held-out examples")
    _add_max_batch(p)
    p.add_argument("--show", type=int, default=3, help="sample completions to print")
    _add_format_options(p)
    _add_model_options(p)
    _add_lora_option(p)
    _add_executor_option(p)
    _add_decode_options(p)
    p.set_defaults(func=cmd_eval)
    # Every argument goes to lm-eval untouched: "+" as the prefix makes `--model ...` plain
    # words here, which REMAINDER keeps (with "-", argparse would refuse them as unknown flags).
    p = sub.add_parser("lm-eval", add_help=False, prefix_chars="+",
                       help="lm-evaluation-harness with the model \"dlm-jax\" (dlm-jax lm-eval --help; needs "
                            "dlm-jax[lmeval])")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_lm_eval)
    p = sub.add_parser("profile", help="median step latency per bucket: JSON table + PNG plot")
    p.add_argument("--model", help="checkpoint directory (default: a random tiny model)")
    p.add_argument("--out", default="latency", help="output prefix (writes .json and .png)")
    p.add_argument("--windows", type=int, nargs="*", help="window buckets to measure")
    p.add_argument("--caches", type=int, nargs="*", help="cache buckets to measure")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=20)
    _add_quant_option(p)
    p.set_defaults(func=cmd_profile)
    p = sub.add_parser("cache", help="list or clear the bundle cache (the LiteRT bundles exported on first use; "
                                     "$DLM_JAX_BUNDLE_CACHE, limit $DLM_JAX_BUNDLE_CACHE_MB)")
    actions = p.add_subparsers(dest="action", required=True)
    q = actions.add_parser("list", help="each entry: model, fingerprint, MB, parts, buckets, last use; the total "
                                        "and the limit")
    q.add_argument("--json", action="store_true", help="print JSON")
    q2 = actions.add_parser("clear", help="remove every entry, or those of --model, and print the MB freed")
    for q in (q, q2):
        q.add_argument("--model", metavar="DIR", help="only the entries of this checkpoint (its fingerprint, or "
                                                      "recorded as their source)")
    p.set_defaults(func=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A user's mistake (a bad option, file or input) or an environment
    failure (a read-only, full or missing output location) ends in one `error:` line on stderr
    and a non-zero exit, never a traceback."""
    args = build_parser().parse_args(argv)
    args.entry_point = argv is None  # the process is this command (not a caller's Python)
    # train holds Ctrl-C during its checkpoint saves itself (dlm_jax.training.loop._ctrl_c_after).
    redeliver = args.entry_point and args.command != "train"
    with _interrupts_redelivered() if redeliver else contextlib.nullcontext():
        return _dispatch(args)  # LiteRT's teardown log is hushed at exit (`dlm_jax.executors._litert`)


def _dispatch(args: argparse.Namespace) -> int:
    return report_errors(lambda: args.func(args), interrupted=_interrupt_note(args))


def _interrupt_note(args: argparse.Namespace) -> str:
    """What an interrupted command left behind (writers publish by rename, so nothing partial)."""
    if args.command == "export":
        return f"; {args.out} unchanged (written by rename only when complete)"
    if args.command == "cache":
        return "; entries are removed whole, by rename"
    return ""


if __name__ == "__main__":
    sys.exit(main())

"""dlm-jax against Fast-dLLM's released LLaDA generators, on the same weights and the same GPU.

    .venv/bin/python benchmarks/gpu.py --peer-src ~/src/Fast-dLLM --checkpoint ~/ckpt/llada-8b-peaked
    .venv/bin/python benchmarks/gpu.py --small --peer-src ~/src/Fast-dLLM      (the correctness half; a CPU will do)

The checkpoint is a random LLaDA-8B-shaped model (d 4096, 32 layers, 32 heads without GQA,
MLP 12288, vocab 126464, mask id 126336, bf16) built and saved by Fast-dLLM's own modeling code
(`LLaDAModelLM(config, init_params=True)`, seeded, `save_pretrained(safe_serialization=True)`),
then reused. Its head is peaked so that threshold 0.9 commits several tokens per step, as a
trained model does: the output projection is rescaled to logits of standard deviation
`--logit-std`, and the query/key and residual-branch output projections are scaled
(`--qk-scale`, `--branch-scale`) so that masked positions see different contexts and predict
different tokens (without them every mask predicts the same token).

Both sides decode the same prompts (`--prompt-len` seeded random ids below the mask id),
generation 256, block 32, threshold 0.9, temperature 0, with the prefix and the dual cache at
batch 1, 8, 16 and 32. Each side runs in its own process (so neither holds GPU memory while the
other runs): Fast-dLLM's `generate_with_prefix_cache` / `generate_with_dual_cache` imported from
`--peer-src` (cloned into ~/.cache/dlm-jax/peers when not given), loaded with their
`LLaDAModelLM.from_pretrained(path, torch_dtype=...)`; dlm-jax through `dlm_jax.load(path,
executor="jax")` and `Model.decoder.decode`. Per case: one untimed decode (for dlm-jax its first
decode, without a warm-up: the compiles it waits for included), then the median of `--reps`
timed ones. A second dlm-jax process times its first decodes over the persistent compilation
cache the first one filled.

`--quant none int8 int8-g128 fp8` (default none; several allowed): dlm-jax decodes each case once per
weight mode (`dlm_jax.load(path, quant=...)`, int8 per channel or per 128 input rows, or fp8 e4m3), each mode loaded
in turn, unquantized first, with one mode's weights on the device at a time; a quantized case
is named with its mode ("prefix b8 int8"). Fast-dLLM runs unquantized: a quantized case is
timed against its case of the same batch and cache (ratio, token agreement), its answers are
compared with dlm-jax's unquantized ones of that case (`vs_unquantized`: the share of identical
answers, the token agreement, the median-step ratio, whose batch-1 int8 value is a target), and
it does not count for `correct` (quantization changes answers by design). The second process
times the first mode only. `--attention NAME` sets `$DLM_JAX_ATTENTION` for dlm-jax (how its
steps read the resident K/V: `dlm_jax.executors.jax_executor.RESIDENT_ATTENTION`), and
`--projections fused` sets `$DLM_JAX_PROJECTIONS` (q/k/v and gate/up each one GEMM), each
recorded in the settings. `--budget-s SECONDS`: once the run has spent it, the workers skip their remaining
cases (a process started past it loads nothing), recorded as "skipped: time budget", so that a
command sized to a lease writes the report of what it measured; under `--work` a result with a
skipped case is measured again. `--peer-budget-s SECONDS` caps Fast-dLLM's worker alone (its
load included, counted from its start), so that the dlm-jax side, which runs after it, keeps the
rest of `--budget-s`; `--second-budget-s SECONDS` keeps that much of it for the second dlm-jax
process (the first one stops its cases that much sooner).

`--shape small` in full mode runs the table's code path at the tiny shape on any device (no GPU
required: the dry run of `benchmarks/gpu_lease.sh`); the 8B shape requires a GPU.

`--profile`: after a case's timed decodes, dlm-jax decodes it once more under
`jax.profiler.trace` and records the ten costliest device kernels of that decode per step
(kernel ms over the decode's NFE, calls per step, share of all kernel time: the case's
`dlm_jax.profile`, one table per case in the report). On a CPU the trace has no device plane
and the host's XLA ops are counted instead (`profile.source`). A profile that fails is the
case's `profile.error`; the run goes on.

Fast-dLLM's code is never edited; what this script changes in memory is listed in the report
(`peer.shims`): the per-row `replace_position` fix of their dual cache (it indexes the cache
with the positions of all rows at once, which fails past batch 1), a batched `x` where their
generators build one row, and small compatibility shims for transformers 5.

`--small`: a tiny float32 twin (d 256, 2 layers, vocab 1024) at batch 1 and 2, prompt 32,
generation 64, which must give token-identical answers with equal NFE on both sides (exit
status 1 otherwise). Writes <out>.json, <out>.md and <out>.png.

Every result carries its run record (`run`: the UTC date, the machine, the command, the
versions with dlm-jax's commit, and the free-text `--note`s). `--sides fast_dllm` (or `dlm_jax`)
runs one side alone: its cases are timed, not compared (e.g. Fast-dLLM at a batch dlm-jax does
not reach).

`--merge PART.json [PART.json ...] --out PATH` combines results this script wrote, on several
machines or days, into one, without measuring:

    .venv/bin/python benchmarks/gpu.py --merge benchmarks/results/gpu_parts/*.json --out benchmarks/results/gpu

The full-mode parts make the table (`cases`: each case from one part, in batch order; the
settings' batches and caches their union); the first part gives the settings, checkpoint,
devices, versions, Fast-dLLM's identity, load times and peak memory; targets and `correct` are
computed from the merged cases; `--small` parts go to `small`. `parts` keeps every part's run
record, device and cases, and `sources` names the part each field and case came from. A case in
several parts takes each side (Fast-dLLM, dlm-jax) from the first part, in the order given, that
measured it: e.g. a `--sides dlm_jax` run after one whose budget skipped dlm-jax's cases. A row
whose sides come from two parts gets its ratio from their times and compares no answers
(`agrees` None: the tokens stay with each run); a side measured again in a later part is listed
in `superseded`, with its time. A part that is not a result of this script (no run record), a
merged result, and parts of one mode with another checkpoint recipe or decode setting
(`MERGE_MATCH`) are refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _hardware import warm_page_cache  # both sides' load times start from the page cache
from _profile import kernel_table, top_kernels

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER_URL = "https://github.com/NVlabs/Fast-dLLM"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlm-jax"
MARKER = "dlm_jax_benchmark.json"  # the recipe a checkpoint was written with
SIDES = ("fast_dllm", "dlm_jax")
CACHES = ("prefix", "dual")
# dlm-jax's weight modes (`dlm_jax.load(quant=...)`; "none": as stored). Fast-dLLM runs unquantized.
QUANTS = ("none", "int8", "int8-g128", "fp8", "int4-g128")  # -g128: grouped scales (`quant="int8-g128"`)
SKIPPED = "skipped: time budget"  # a case `--budget-s` left unmeasured

# LLaDA-8B-Instruct's architecture (its config.json) and the tiny twin of `--small`.
SHAPES: dict[str, dict[str, Any]] = {
    "llada-8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
                     vocab_size=126464, embedding_size=126464, mask_token_id=126336, eos_token_id=126081,
                     pad_token_id=126081, max_sequence_length=4096),
    "small": dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=768, vocab_size=1024,
                  embedding_size=1024, mask_token_id=1000, eos_token_id=1001, pad_token_id=1001,
                  max_sequence_length=512),
}
# The rest of LLaDA-8B's config.json: what dlm-jax's `llada` family reader accepts.
LLADA_KEYS: dict[str, Any] = dict(
    activation_type="silu", block_type="llama", rope=True, rope_theta=500000.0, layer_norm_type="rms",
    rms_norm_eps=1e-5, weight_tying=False, include_bias=False, include_qkv_bias=False, scale_logits=False,
    input_emb_norm=False, attention_layer_norm=False, alibi=False, flash_attention=False, bias_for_layer_norm=False,
    block_group_size=1, init_fn="mitchell", init_std=0.02, attention_dropout=0.0, embedding_dropout=0.0,
    residual_dropout=0.0, multi_query_attention=None, init_device="cpu")
# Mode defaults; a flag given on the command line wins.
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "full": dict(shape="llada-8b", dtype="bfloat16", batches=[1, 8, 16, 32], reps=3, prompt_len=128, gen_len=256,
                 checkpoint=CACHE / "bench" / "llada-8b-peaked", out=ROOT / "benchmarks" / "results" / "gpu"),
    "small": dict(shape="small", dtype="float32", batches=[1, 2], reps=1, prompt_len=32, gen_len=64,
                  checkpoint=CACHE / "bench" / "llada-small-peaked",
                  out=Path(tempfile.gettempdir()) / "dlm-jax-gpu-small" / "gpu"),
}
# HBM bandwidth (TB/s) and dense bf16 tensor-core peak (TFLOP/s) by device name, most specific first.
DEVICES: tuple[tuple[str, float, float], ...] = (
    ("H200", 4.8, 989.0), ("H100 NVL", 3.9, 835.0), ("H100 PCIe", 2.0, 756.0), ("H100", 3.35, 989.0),
    ("A100-SXM4-80GB", 2.039, 312.0), ("A100 80GB PCIe", 1.935, 312.0), ("A100", 1.555, 312.0),
    ("L40S", 0.864, 362.0))
TARGETS = dict(ratio_b1=5.0, ratio_b8=3.0, step_over_weight_read=1.5, load_over_torch=2.0,
               first_decode_s=15.0, second_process_s=3.0, int8_step_over_unquantized_b1=0.6)
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="the correctness half: a tiny float32 model, batch 1 and 2")
    p.add_argument("--peer-src", type=Path, help="a checkout of NVlabs/Fast-dLLM (default: clone it into "
                   f"{CACHE / 'peers'})")
    p.add_argument("--checkpoint", type=Path, help="where the random checkpoint is written, or reused if present")
    p.add_argument("--out", type=Path, help="report path without suffix (writes .json, .md, .png)")
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    p.add_argument("--reps", type=int, help="timed decodes per case and side (after one untimed)")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--gen-len", type=int)
    p.add_argument("--block-len", type=int, default=32)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--dtype", choices=("bfloat16", "float32"))
    p.add_argument("--quant", nargs="+", choices=QUANTS, default=["none"],
                   help="dlm-jax's weight modes, each a case of its own (default none: weights as stored); "
                   "Fast-dLLM runs unquantized and each quantized case is compared with its unquantized one")
    p.add_argument("--attention", help="how dlm-jax's steps read the resident K/V ($DLM_JAX_ATTENTION of the JAX "
                   "executor: one of dlm_jax.executors.jax_executor.RESIDENT_ATTENTION; default the executor's)")
    p.add_argument("--projections", choices=("separate", "fused"), help="dlm-jax's projections ($DLM_JAX_PROJECTIONS "
                   "of the JAX executor: fused runs q/k/v and gate/up each as one GEMM; default the executor's)")
    p.add_argument("--budget-s", type=float, metavar="SECONDS", help="time budget of the whole run: once spent, "
                   "the workers skip their remaining cases (reported as skipped) so that a report is still written")
    p.add_argument("--peer-budget-s", type=float, metavar="SECONDS", help="time budget of Fast-dLLM's worker "
                   "alone (its load included): once spent, it skips its remaining cases, so that dlm-jax's side "
                   "keeps the rest of --budget-s")
    p.add_argument("--profile", action="store_true", help="after each case's timed decodes, one more dlm-jax "
                   "decode under jax.profiler: its ten costliest kernels per step (the report's kernel tables)")
    p.add_argument("--second-budget-s", type=float, metavar="SECONDS", help="of --budget-s, kept for the second "
                   "dlm-jax process (the cached first decodes): the first one skips its remaining cases that much "
                   "sooner")
    p.add_argument("--shape", choices=sorted(SHAPES), help="the checkpoint's shape (default: llada-8b in full mode, "
                   "small with --small); full mode needs a GPU only at llada-8b")
    p.add_argument("--seed", type=int, default=0, help="of the weights and the prompts")
    p.add_argument("--init-device", choices=("cpu", "cuda"), help="where Fast-dLLM's code initializes the random "
                   "checkpoint's weights (default: cuda for the 8B shape of the full mode, whose 8B weights take "
                   "minutes on a CPU, else cpu); part of the recipe (the same seed gives other weights on each)")
    p.add_argument("--logit-std", type=float, default=20.0, help="standard deviation of the peaked head's logits")
    p.add_argument("--qk-scale", type=float, default=4.0, help="factor on the query and key projections")
    p.add_argument("--branch-scale", type=float, default=8.0, help="factor on attn_out and ff_out of each block")
    p.add_argument("--tie-tol", type=float, help="answers that part after a decision this close in logits (default "
                   "0.01 in float32, 1.0 in bfloat16) count as agreeing: a numerical near tie, not a difference")
    p.add_argument("--hbm-tbps", type=float, help="HBM bandwidth in TB/s (default: by device name)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak in TFLOP/s (default: by device name)")
    p.add_argument("--xla-cache", type=Path, help="persistent compilation cache (default: a fresh one, removed after)")
    p.add_argument("--no-second-process", action="store_true", help="skip the warm-cache dlm-jax process")
    p.add_argument("--work", type=Path, help="keep each process's spec and result here (default: a temporary folder, "
                   "removed after); a process whose result is there for the same spec is not run again, so a run "
                   "cut short goes on where it stopped, or its report is made elsewhere from the copied folder")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES),
                   help="which sides run (default both); one side alone is timed, not compared")
    p.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="a remark on this run, kept in the result's run record (repeatable)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="PART.json",
                   help="measure nothing: combine these results of this script into --out (each part's run "
                   "record kept, each case's part named)")
    p.add_argument("--worker", choices=("write", *SIDES), help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # a worker's: time.time() of --budget-s's end
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and fill the mode's defaults (`MODE_DEFAULTS`) for every flag not given."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.worker:
        return args
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.merge:
        given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                 if k not in ("merge", "out", "argv") and v != p.get_default(k)]
        if given:
            p.error(f"--merge measures nothing: it takes only --out (not {' '.join(given)})")
        args.mode = "merge"
        args.out = args.out or MODE_DEFAULTS["full"]["out"]
        return args
    args.mode = "small" if args.small else "full"
    for key, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for name in ("prompt_len", "gen_len", "block_len", "reps"):
        if getattr(args, name) < (0 if name == "reps" else 1):
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is too small")
    if args.gen_len % args.block_len:
        p.error(f"--block-len={args.block_len} must divide --gen-len={args.gen_len}")
    if args.tie_tol is None:
        args.tie_tol = 0.01 if args.dtype == "float32" else 1.0
    if min(args.batches) < 1:
        p.error(f"--batches {args.batches}: each must be at least 1")
    if not 0 < args.threshold <= 1:
        p.error(f"--threshold={args.threshold} must be in (0, 1]")
    for name in ("budget_s", "peer_budget_s", "second_budget_s"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    # Each mode once, unquantized first: its first decode is the fresh process's (the targets').
    args.quant = [q for q in QUANTS if q in args.quant]
    if args.attention is not None:
        from dlm_jax.executors.jax_executor import RESIDENT_ATTENTION  # (imports JAX: only when asked)

        if args.attention not in RESIDENT_ATTENTION:
            p.error(f"--attention {args.attention!r}: known {', '.join(RESIDENT_ATTENTION)}")
    if args.init_device is None:
        args.init_device = "cuda" if needs_gpu(args) else "cpu"
    args.deadline = None if args.budget_s is None else time.time() + args.budget_s
    return args


def case_name(batch: int, cache: str, quant: str = "none") -> str:
    """A case's name: "prefix b8", with the quant mode when there is one ("prefix b8 int8")."""
    return f"{cache} b{batch}" + ("" if quant == "none" else f" {quant}")


def row_quant(row: dict[str, Any]) -> str:
    """A result row's quant mode (rows written before `--quant` existed hold none)."""
    return row.get("quant", "none")


def over_budget(deadline: float | None) -> bool:
    return deadline is not None and time.time() >= deadline


# ---------------------------------------------------------------------------------------------
# Fast-dLLM's sources: found or cloned, loaded, patched in memory (never edited)


def peer_source(given: Path | None, *, cache: Path = CACHE / "peers") -> tuple[Path, bool]:
    """The Fast-dLLM checkout to import from, and whether it was cloned now. Without `given`,
    clones NVlabs/Fast-dLLM into `cache` once; exits with one line naming --peer-src if it can't."""
    def check(src: Path) -> Path:
        if not (src / "llada" / "generate.py").is_file() or not (src / "llada" / "model" / "modeling_llada.py").is_file():
            raise SystemExit(f"error: --peer-src {src} is not a Fast-dLLM checkout (no llada/generate.py or "
                             f"llada/model/modeling_llada.py)")
        return src.resolve()

    if given is not None:
        return check(given.expanduser()), False
    dest = cache / "Fast-dLLM"
    if (dest / "llada" / "generate.py").is_file():
        return check(dest), False
    log(f"cloning {PEER_URL} into {dest}")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".clone-", dir=cache))
    try:
        proc = subprocess.run(["git", "clone", "--quiet", "--depth", "1", PEER_URL, str(tmp / "repo")],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        proc = subprocess.CompletedProcess([], 1, "", str(e))
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = (proc.stderr.strip().splitlines() or ["git clone failed"])[-1]
        raise SystemExit(f"error: could not clone {PEER_URL} ({reason}); pass --peer-src PATH, a checkout of it")
    (tmp / "repo").rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return check(dest), True


def peer_identity(src: Path) -> dict[str, Any]:
    """The commit of a checkout (when it is a git work tree, else the COMMIT file that
    benchmarks/peer_src.sh writes beside the sources it copies) and the sha256 of the files used."""
    commit = None
    try:  # a checkout of its own, not a copy inside some other work tree
        proc = subprocess.run(["git", "-C", str(src), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        top, head = (proc.stdout.split() + ["", ""])[:2]
        if proc.returncode == 0 and Path(top).resolve() == src.resolve():
            commit = head
    except OSError:
        pass
    if commit is None and (src / "COMMIT").is_file():
        commit = (src / "COMMIT").read_text().strip() or None
    files = ("llada/generate.py", "llada/model/modeling_llada.py", "llada/model/configuration_llada.py")
    return {"src": str(src), "commit": commit,
            "sha256": {f: hashlib.sha256((src / f).read_bytes()).hexdigest()[:16] for f in files}}


def scatter_rows(past, new, cols):
    """Fast-dLLM's dual-cache write, one row at a time: `past` [B, H, L, D] takes `new`
    [B, H, S, D] at row b's S positions, where `cols` [B*S] holds the positions of every row in
    row-major order (`replace_position.nonzero(as_tuple=True)[1]`, what their code computes).
    Their `past[:, :, cols] = new` writes all B*S positions into every row and raises for B > 1.
    In place; returns `past`. At B = 1 it is their indexing exactly."""
    import torch

    b, h, s, d = new.shape
    if cols.numel() != b * s:
        raise ValueError(f"replace_position marks {cols.numel()} positions, expected {b} rows x {s}")
    if b == 1:
        past[:, :, cols] = new
        return past
    rows = torch.arange(b, device=cols.device).repeat_interleave(s)
    past[rows, :, cols] = new.permute(0, 2, 1, 3).reshape(b * s, h, d)
    return past


@dataclasses.dataclass(frozen=True)
class SourcePatch:
    """A text substitution in one function of Fast-dLLM, compiled in memory in the function's
    own module namespace. `missing` says what it means when `old` is not in the source."""

    name: str
    target: str  # "generate.<function>" or "modeling.<Class>.<method>"
    old: str
    new: str
    why: str
    missing: str


PATCHES: tuple[SourcePatch, ...] = (
    SourcePatch("per-row replace_position (key)", "modeling.LLaDABlock.attention",
                "past_key[:, :, replace_indices] = k", "past_key = _dlm_jax_scatter_rows(past_key, k, replace_indices)",
                "the dual cache indexes the cache with the positions of all rows at once: fails for batch > 1",
                "not found: this version writes the dual cache another way"),
    SourcePatch("per-row replace_position (value)", "modeling.LLaDABlock.attention",
                "past_value[:, :, replace_indices] = v",
                "past_value = _dlm_jax_scatter_rows(past_value, v, replace_indices)",
                "as for the key", "not found: this version writes the dual cache another way"),
    *(SourcePatch(f"batched x ({fn})", f"generate.{fn}", "torch.full((1, prompt.shape[1] + gen_length)",
                  "torch.full((prompt.shape[0], prompt.shape[1] + gen_length)",
                  "this version builds the canvas with one row whatever the batch",
                  "not needed: this version builds one row per prompt")
      for fn in ("generate_with_prefix_cache", "generate_with_dual_cache")),
)


def _patch_function(fn: Callable, edits: Sequence[SourcePatch]) -> tuple[Callable, list[bool]]:
    """`fn` recompiled with each edit whose `old` text it holds; and which ones applied."""
    src = textwrap.dedent(inspect.getsource(fn))
    if "self.__" in src:  # name mangling would differ outside the class body
        raise RuntimeError(f"cannot patch {fn.__qualname__}: it uses a private attribute")
    applied = []
    for e in edits:
        applied.append(src.count(e.old) == 1)
        src = src.replace(e.old, e.new) if applied[-1] else src
    if not any(applied):
        return fn, applied
    scope: dict[str, Any] = {}
    exec(compile(src, f"<{fn.__module__}.{fn.__qualname__}, patched by benchmarks/gpu.py>", "exec"),
         sys.modules[fn.__module__].__dict__, scope)  # (a decorated function's __globals__ are its wrapper's)
    return scope[fn.__name__], applied


@dataclasses.dataclass
class Peer:
    """Fast-dLLM's LLaDA code, loaded: the generators, the model and config classes, and every
    shim and patch applied (`shims`, for the report)."""

    generate: Any  # the llada/generate.py module
    modeling: Any  # llada/model/modeling_llada.py
    shims: list[dict[str, Any]]

    @property
    def model_class(self):
        return self.modeling.LLaDAModelLM

    @property
    def config_class(self):
        return self.modeling.LLaDAConfig

    def generator(self, cache: str) -> Callable:
        return getattr(self.generate, f"generate_with_{cache}_cache")


def load_peer(src: Path, *, device: str) -> Peer:
    """Import Fast-dLLM's `llada/generate.py` from `src` (both its import styles: the released
    `from model.modeling_llada import ...` and the later package-relative one), apply `PATCHES`
    and the compatibility shims this environment needs, and return them."""
    import importlib

    import torch
    import transformers

    for path in (src / "llada", src):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    generate = importlib.import_module("llada.generate")
    modeling = sys.modules[generate.LLaDAModelLM.__module__]
    modeling._dlm_jax_scatter_rows = scatter_rows
    shims: list[dict[str, Any]] = []
    by_target: dict[str, list[SourcePatch]] = {}
    for patch in PATCHES:
        by_target.setdefault(patch.target, []).append(patch)
    for target, edits in by_target.items():
        module_name, *path = target.split(".")
        owner = generate if module_name == "generate" else modeling
        for attr in path[:-1]:
            owner = getattr(owner, attr)
        new, applied = _patch_function(getattr(owner, path[-1]), edits)
        setattr(owner, path[-1], new)
        for e, ok in zip(edits, applied):
            shims.append({"name": e.name, "kind": "source patch", "target": target, "applied": ok,
                          "why": e.why, "old": e.old, "new": e.new, **({} if ok else {"note": e.missing})})

    cls = modeling.LLaDAModelLM
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        # transformers 5 sets `all_tied_weights_keys` in `post_init`, which the class never calls;
        # it has no tied keys (with weight tying it reads wte directly, no tied parameter).
        init = cls.__init__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if not hasattr(self, "all_tied_weights_keys"):
                self.all_tied_weights_keys = {}

        cls.__init__ = __init__
        tie = cls.tie_weights
        cls.tie_weights = lambda self, *args, **kwargs: tie(self)
        shims += [
            {"name": "all_tied_weights_keys", "kind": "compatibility", "target": "modeling.LLaDAModelLM.__init__",
             "applied": True, "why": f"transformers {transformers.__version__} reads it in from_pretrained; "
             "it is set by post_init(), which LLaDAModelLM never calls: set to {} (no tied parameters)"},
            {"name": "tie_weights(**kwargs)", "kind": "compatibility", "target": "modeling.LLaDAModelLM.tie_weights",
             "applied": True, "why": "transformers 5 calls tie_weights(missing_keys=..., recompute_mapping=...); "
             "their override takes no arguments: called without them"},
            {"name": "config.use_cache", "kind": "compatibility", "target": "loaded model's config",
             "applied": True, "why": "transformers 5's PretrainedConfig drops the use_cache argument LLaDAConfig "
             "passes; LLaDAModelLM.forward reads it when not given: set to False, LLaDAConfig's default"}]
    if device == "cpu":
        # Their `@torch.compile()` around scaled_dot_product_attention: inductor builds C++ for
        # every new shape on a CPU (seconds each); eager runs the same function.
        torch._dynamo.config.disable = True
        shims.append({"name": "torch.compile off on CPU", "kind": "compatibility",
                      "target": "modeling.scaled_dot_product_attention", "applied": True,
                      "why": "their @torch.compile() wrapper compiles C++ per shape on a CPU; eager runs the same "
                      "F.scaled_dot_product_attention (a GPU keeps it compiled)"})
    return Peer(generate, modeling, shims)


def loaded(peer: Peer, model) -> Any:
    """A model from `from_pretrained`, with the config shim applied."""
    if not hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model.eval()


class ForwardProbe:
    """Wraps a model's `forward` (on the instance) to watch Fast-dLLM decode.

    While `active` (the untimed decode: the probe syncs with the device), it counts forward
    passes, the idle ones (cached calls whose block has no mask left: Fast-dLLM as released in
    June 2025 checks for a finished block only after a cached step, later versions check first),
    and per pass and row the decision margin in logits: how far the pass's decisions were from
    flipping (the top-2 logit gap of every slot it commits, the distance of every other masked
    slot's confidence to the threshold, and the choice of the forced slot), with the pass at
    which each generated slot was committed. Two frameworks whose logits differ by less than a
    pass's margin make the same decisions in it (`first_divergence`)."""

    def __init__(self, model, *, mask_id: int, block_len: int, prompt_len: int, threshold: float):
        self.active = True
        self.mask_id, self.block_len, self.prompt_len, self.threshold = mask_id, block_len, prompt_len, threshold
        self.reset()
        inner = model.forward

        def forward(input_ids=None, *args: Any, **kwargs: Any):
            out = inner(input_ids, *args, **kwargs)
            if self.active:
                self._watch(input_ids, out.logits, cached=kwargs.get("past_key_values") is not None)
            return out

        model.forward = forward

    def reset(self) -> None:
        self.calls = self.idle = 0
        self.margins: list[list[float]] = []  # [pass][row]
        self.commit_pass: dict[tuple[int, int], int] = {}  # (row, generated slot) -> pass
        self._start = 0

    def _watch(self, ids, logits, *, cached: bool) -> None:
        import torch

        if not cached:  # a full forward opens the first block with a mask left
            gen = (ids[0, self.prompt_len:] == self.mask_id).nonzero()
            self._start = self.prompt_len + (int(gen[0, 0]) // self.block_len) * self.block_len if len(gen) else 0
        lo = 0 if cached else self._start
        ids, logits = ids[:, lo:lo + self.block_len], logits[:, lo:lo + self.block_len].float()
        masked = ids == self.mask_id
        self.calls += 1
        self.idle += cached and not bool(masked.any())
        top2 = logits.topk(2, dim=-1).values
        gap = top2[..., 0] - top2[..., 1]
        log_odds = top2[..., 0] - torch.logsumexp(logits, -1)
        log_odds = log_odds - torch.log1p(-log_odds.exp().clamp(max=1 - 1e-12))  # log(p / (1 - p))
        cut = math.log(self.threshold / (1 - self.threshold)) if self.threshold < 1 else math.inf
        row_margins = []
        for r in range(ids.shape[0]):
            m = masked[r]
            if not bool(m.any()):
                row_margins.append(math.inf)
                continue
            lo_r = torch.where(m, log_odds[r], torch.tensor(-math.inf, device=ids.device))
            forced = int(lo_r.argmax())
            commit = m & (lo_r >= cut)
            commit[forced] = True
            margins = [float(gap[r][commit].min()), float((lo_r[m & ~commit] - cut).abs().min() / 2)
                       if bool((m & ~commit).any()) else math.inf]
            if float(lo_r[forced]) < cut and int(m.sum()) > 1:  # which slot is forced
                margins.append(float(lo_r[forced] - lo_r[m].topk(2).values[1]) / 2)
            row_margins.append(min(margins))
            for j in commit.nonzero()[:, 0].tolist():
                self.commit_pass.setdefault((r, self._start + j - self.prompt_len), len(self.margins))
        self.margins.append(row_margins)


def first_divergence(a: list[list[int]], b: list[list[int]], *, margins: list[list[float]],
                     commit_pass: dict[str, int]) -> dict[str, Any] | None:
    """Where answers `a` (Fast-dLLM, probed) and `b` first part, and whether a near tie explains
    it: decisions can first differ at pass t only if t's margin is below the logit difference of
    the two sides, and a slot committed at pass s with no differing decision up to s holds the
    same token. Returns None for equal answers, else the earliest pass committing a differing
    slot and the smallest margin up to it, per differing row (the smallest over rows)."""
    worst = None
    for r, (ra, rb) in enumerate(zip(a, b)):
        diff = [i for i, (x, y) in enumerate(zip(ra, rb)) if x != y]
        if not diff:
            continue
        s = min(commit_pass.get(f"{r},{i}", len(margins) - 1) for i in diff)
        m = min(step[r] for step in margins[:s + 1])
        if worst is None or m < worst["min_margin"] or math.isinf(worst["min_margin"]):
            worst = {"row": r, "slot": min(diff), "pass": s, "min_margin": m}
    return worst


# ---------------------------------------------------------------------------------------------
# The checkpoint


def needs_gpu(args: argparse.Namespace) -> bool:
    """The full mode at the 8B shape: its workers refuse to run without CUDA, and its checkpoint
    is initialized there."""
    return args.mode == "full" and args.shape == "llada-8b"


def recipe(args: argparse.Namespace) -> dict[str, Any]:
    """The random checkpoint's recipe (`init_device` only when not the CPU: the recipes of the
    checkpoints written before it existed, on the CPU, lack it)."""
    init = {} if getattr(args, "init_device", "cpu") == "cpu" else {"init_device": args.init_device}
    return {"shape": args.shape, **SHAPES[args.shape], "dtype": args.dtype, "seed": args.seed,
            "logit_std": args.logit_std, "qk_scale": args.qk_scale, "branch_scale": args.branch_scale, **init}


def build_peer_model(peer: Peer, config: Any, device: str | None = None) -> Any:
    """Fast-dLLM's `LLaDAModelLM` of `config` with its own initialization (seed first). It
    always builds on the CPU (about 35 ns a parameter on two cores here: minutes for 8B); with
    `device`, its inner `LLaDAModel` is built and initialized there by the same code
    (`init_device`) and handed to it."""
    if device is None:
        return peer.model_class(config, init_params=True).eval()
    inner = peer.modeling.create_model_config_from_pretrained_config(config)
    inner.init_device = device
    return peer.model_class(config, model=peer.modeling.LLaDAModel(inner, init_params=True)).eval()


def checkpoint_state(path: Path, want: dict[str, Any]) -> str:
    """"reuse" (written with this recipe), "write" (absent) or "foreign" (a checkpoint this
    script did not write: used as it is). Exits on one written with another recipe."""
    if not (path / "config.json").exists():
        return "write"
    if not (path / MARKER).exists():
        return "foreign"
    have = json.loads((path / MARKER).read_text())["recipe"]
    if have != want:
        diff = {k: (have.get(k), want.get(k)) for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k)}
        raise SystemExit(f"error: {path} was written with another recipe {diff} (have, want); "
                         f"remove it or pass another --checkpoint")
    return "reuse"


def write_checkpoint(peer: Peer, path: Path, rec: dict[str, Any]) -> dict[str, Any]:
    """Build the model with Fast-dLLM's code and init (seeded), peak it, save it."""
    import torch

    shape = {k: rec[k] for k in SHAPES[rec["shape"]]}
    torch.manual_seed(rec["seed"])
    t0 = time.perf_counter()
    config = peer.config_class(**LLADA_KEYS, **shape)
    model = build_peer_model(peer, config, rec.get("init_device"))
    tr = model.model.transformer
    with torch.no_grad():
        for block in tr.blocks:
            for lin in (block.q_proj, block.k_proj):
                lin.weight.mul_(rec["qk_scale"])
            for lin in (block.attn_out, block.ff_out):
                lin.weight.mul_(rec["branch_scale"])
        # Logits ~ N(0, logit_std^2): the final RMSNorm leaves unit-RMS features.
        head = tr.ff_out.weight
        head.mul_(rec["logit_std"] / (head.float().std().item() * math.sqrt(shape["d_model"])))
    model.to(getattr(torch, rec["dtype"]))
    model.to("cpu")  # (saved from host memory, wherever it was initialized)
    params = sum(p.numel() for p in model.parameters())
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / MARKER).write_text(json.dumps({"recipe": rec, "params": params, "written_by": "benchmarks/gpu.py"}, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return {"params": params, "write_seconds": round(time.perf_counter() - t0, 1)}


def make_prompts(n: int, length: int, *, vocab_below: int, avoid: Sequence[int], seed: int) -> list[list[int]]:
    """`n` prompts of `length` random ids in [0, vocab_below) (below the mask id), none in `avoid`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_below, (n, length))
    for bad in avoid:
        while (hit := ids == bad).any():
            ids[hit] = rng.integers(0, vocab_below, int(hit.sum()))
    return ids.tolist()


# ---------------------------------------------------------------------------------------------
# Workers (one process each)


def _torch_sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# What a measuring worker that measured nothing stands as (the keys its result always has).
EMPTY_RESULT = {
    "fast_dllm": {"device": None, "torch": None, "transformers": None, "load_seconds": None, "shims": [],
                  "params": None, "cases": {}},
    "dlm_jax": {"device": None, "jax": None, "load_seconds": None, "params": None, "config": None,
                "attention": None, "projections": None, "cases": {}},
}


def fast_dllm_worker(spec: dict[str, Any], *, deadline: float | None = None) -> dict[str, Any]:
    """Fast-dLLM's side: load with their from_pretrained, then per case one untimed and `reps`
    timed decodes with their generator; past `deadline` (time.time()) each remaining case is
    recorded as skipped (none of them run: the model is not loaded)."""
    if over_budget(deadline):
        keys = [case_name(c["batch"], c["cache"]) for c in spec["cases"]]
        log(f"fast-dllm: {SKIPPED} ({', '.join(keys)})")
        return {**EMPTY_RESULT["fast_dllm"], "cases": {k: {"skipped": SKIPPED} for k in keys}, "skipped": keys}
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (torch's default, made sure)
    if spec["require_gpu"] and device != "cuda":
        raise SystemExit("error: torch sees no CUDA device; install a CUDA build of torch (the test extra)")
    peer = load_peer(Path(spec["peer_src"]), device=device)
    path, dtype = Path(spec["checkpoint"]), getattr(torch, spec["dtype"])
    warm_page_cache(path)
    t0 = time.perf_counter()
    model = loaded(peer, peer.model_class.from_pretrained(path, torch_dtype=dtype).to(device))
    _torch_sync(torch, device)
    load_s = time.perf_counter() - t0
    probe = ForwardProbe(model, mask_id=spec["mask_id"], block_len=spec["block_len"], prompt_len=spec["prompt_len"],
                         threshold=spec["threshold"])
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                           "load_seconds": round(load_s, 3), "shims": peer.shims,
                           "params": sum(p.numel() for p in model.parameters()), "cases": {}}
    log(f"fast-dllm: loaded in {load_s:.1f} s on {out['device']}")
    for case in spec["cases"]:
        batch, cache = case["batch"], case["cache"]
        if over_budget(deadline):
            out["cases"][case_name(batch, cache)] = {"skipped": SKIPPED}
            out.setdefault("skipped", []).append(case_name(batch, cache))
            log(f"fast-dllm {case_name(batch, cache)}: {SKIPPED}")
            continue
        prompt = torch.tensor(spec["prompts"][:batch], dtype=torch.long, device=device)
        fn = peer.generator(cache)
        gen = spec["gen_len"]

        def run() -> tuple[Any, int, float]:
            t = time.perf_counter()
            x, nfe = fn(model, prompt, steps=gen, gen_length=gen, block_length=spec["block_len"], temperature=0.0,
                        remasking="low_confidence", mask_id=spec["mask_id"], threshold=spec["threshold"])
            _torch_sync(torch, device)
            return x, nfe, time.perf_counter() - t

        key = f"{cache} b{batch}"
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        probe.reset()
        probe.active = True
        try:
            x, nfe, first = run()
        except Exception as e:  # noqa: BLE001 - one failing case is reported, the rest still run
            out["cases"][key] = {"error": f"{type(e).__name__}: {e}"}
            log(f"fast-dllm {key}: FAILED {type(e).__name__}: {e}")
            continue
        tokens = x[:, spec["prompt_len"]:].tolist()
        seconds, same = [], True
        probe.active = False
        for _ in range(spec["reps"]):
            x2, _, s = run()
            seconds.append(s)
            same &= x2[:, spec["prompt_len"]:].tolist() == tokens
        out["cases"][key] = {
            "nfe": int(nfe), "forward_calls": probe.calls, "idle_forwards": probe.idle,
            "first_seconds": round(first, 4), "seconds": [round(s, 4) for s in seconds], "deterministic": same,
            "tokens": tokens, "margins": probe.margins,
            "commit_pass": {f"{r},{i}": p for (r, i), p in probe.commit_pass.items()},
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}
        log(f"fast-dllm {key}: NFE {nfe} ({probe.idle} idle), first {first:.2f} s (probed), "
            f"timed {[round(s, 3) for s in seconds]}")
        save_partial(spec, out)
    return out


def worker_quants(spec: dict[str, Any], *, second: bool) -> list[str]:
    """The quant modes a dlm-jax process decodes, in `QUANTS` order (unquantized first): all of
    `spec["quants"]` in the first process; in the second (first decodes over the persistent
    cache) only the first of them."""
    quants = [q for q in QUANTS if q in spec.get("quants", ["none"])]
    return quants[:1] if second else quants


def dlm_jax_worker(spec: dict[str, Any], *, second: bool, deadline: float | None = None) -> dict[str, Any]:
    """dlm-jax's side. First process: per quant mode (`worker_quants`), load (one mode's weights
    on the device at a time), then per case the first decode (warm-up compiles included) and
    `reps` timed decodes. Second process (`second`): only each case's first decode, over the
    persistent compilation cache the first process filled. Past `deadline` (time.time()) each
    remaining case is recorded as skipped, and a mode none of whose cases is left is not loaded."""
    if over_budget(deadline):  # spent before this process began: nothing loads
        keys = [case_name(c["batch"], c["cache"], q) for q in worker_quants(spec, second=second) for c in spec["cases"]]
        log(f"dlm-jax: {SKIPPED} ({', '.join(keys)})")
        return {**EMPTY_RESULT["dlm_jax"], "cases": {k: {"skipped": SKIPPED} for k in keys}, "skipped": keys}
    import gc

    import jax
    from flax import nnx

    import dlm_jax
    from dlm_jax.executors._compile import XlaCompileCounter, enable_persistent_cache
    from dlm_jax.executors.jax_executor import ATTENTION_ENV
    from dlm_jax.models.quant import weight_bytes

    if spec.get("attention"):
        os.environ[ATTENTION_ENV] = spec["attention"]  # what JaxExecutor reads
    if spec.get("projections"):
        os.environ["DLM_JAX_PROJECTIONS"] = spec["projections"]  # (dlm_jax.models._fuse.PROJECTIONS_ENV)
    enable_persistent_cache(spec["xla_cache"])
    hits = [0]  # executables the persistent cache served (XlaCompileCounter counts those too)
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.__setitem__(0, hits[0] + (event == "/jax/compilation_cache/cache_hits")))
    if spec["dtype"] == "float32":  # XLA may run float32 dots in TF32 on a GPU by default
        jax.config.update("jax_default_matmul_precision", "highest")
    dev = jax.devices()[0]
    if spec["require_gpu"] and dev.platform != "gpu":
        raise SystemExit(f"error: JAX sees no GPU ({dev}); install the cuda extra: pip install -e '.[cuda]'")
    path = Path(spec["checkpoint"])
    out: dict[str, Any] = {"device": f"{dev.platform}: {dev.device_kind}", "jax": jax.__version__,
                           "load_seconds": None, "params": None, "config": None, "attention": None,
                           "projections": None, "load_seconds_by_quant": {}, "weight_bytes": {}, "cases": {}}
    name = "dlm-jax" + (" (second process)" if second else "")

    def skip(key: str, entry: dict[str, Any]) -> None:
        out["cases"][key] = entry
        if entry.get("skipped"):
            out.setdefault("skipped", []).append(key)
        log(f"{name} {key}: {entry.get('skipped') or 'FAILED ' + entry.get('error', '')}")
        save_partial(spec, out)

    for quant in worker_quants(spec, second=second):
        keys = [case_name(c["batch"], c["cache"], quant) for c in spec["cases"]]
        if over_budget(deadline):
            for key in keys:
                skip(key, {"skipped": SKIPPED})
            continue
        warm_page_cache(path)
        t0 = time.perf_counter()
        try:
            m = dlm_jax.load(path, executor="jax", dtype=spec["dtype"], param_dtype=spec["dtype"],
                             quant=None if quant == "none" else quant)
            jax.block_until_ready([v.get_value() for _, v in nnx.to_flat_state(nnx.state(m.model, nnx.Param))])
        except Exception as e:  # noqa: BLE001 - a mode this device cannot run (fp8) fails its cases, not the run
            for key in keys:
                skip(key, {"error": f"{type(e).__name__}: {e}"})
            continue
        load_s = time.perf_counter() - t0
        out["load_seconds_by_quant"][quant] = round(load_s, 3)
        out["weight_bytes"][quant] = weight_bytes(m.model)
        if out["load_seconds"] is None:  # the first mode's (unquantized when asked): the load target's
            out["load_seconds"] = round(load_s, 3)
        out["params"], out["config"] = dlm_jax.param_count(m.config), m.config.to_dict()
        out["attention"] = getattr(m.executor, "attention", None)
        out["projections"] = getattr(m.executor, "projections", None)
        log(f"{name}: loaded ({quant}) in {load_s:.1f} s on {out['device']}, attention {out['attention']}")
        for case, key in zip(spec["cases"], keys):
            if over_budget(deadline):
                skip(key, {"skipped": SKIPPED})
                continue
            entry = dlm_jax_case(m, spec, case, second=second, hits=hits, counter=XlaCompileCounter)
            if "error" in entry:
                skip(key, entry)
                continue
            out["cases"][key] = entry
            log(f"{name} {key}: first decode {entry['first_seconds']:.2f} s ({entry['xla_programs']} XLA programs, "
                f"{entry['xla_cache_hits']} from the persistent cache)"
                + ("" if second else f", NFE {entry['nfe']}, timed {entry['seconds']}"))
            save_partial(spec, out)
        del m  # its weights leave the device before the next mode's load
        gc.collect()
    mem = dev.memory_stats() or {}
    out["peak_memory_bytes"] = mem.get("peak_bytes_in_use")
    return out


def dlm_jax_case(m, spec: dict[str, Any], case: dict[str, Any], *, second: bool, hits: list[int],
                 counter) -> dict[str, Any]:
    """One case of `dlm_jax_worker` on the loaded model `m`: its first decode, then (first
    process) `reps` timed ones; {"error": ...} when the first decode fails."""
    import dlm_jax

    ids = spec["prompts"][:case["batch"]]
    cfg = dlm_jax.decode_config(gen_len=spec["gen_len"], block_len=spec["block_len"], cache=case["cache"],
                                rule="threshold", threshold=spec["threshold"])
    compiles, hit0 = counter.count(), hits[0]
    t = time.perf_counter()
    try:
        res = m.decoder.decode(ids, cfg)  # no warm-up: it compiles what it reaches, ahead where it can
    except Exception as e:  # noqa: BLE001 - one failing case is reported, the rest still run
        return {"error": f"{type(e).__name__}: {e}"}
    first = time.perf_counter() - t
    s1 = res.stats
    entry: dict[str, Any] = {"first_seconds": round(first, 4), "first_compiles": s1.compiles,
                             "first_compile_seconds": round(s1.compile_seconds, 3),
                             "first_compile_wait_seconds": round(s1.compile_wait_seconds, 3),
                             "xla_programs": counter.count() - compiles, "xla_cache_hits": hits[0] - hit0}
    tokens = [s.tolist() for s in res.sequences]
    if not second:
        seconds, same = [], True
        for _ in range(spec["reps"]):
            t = time.perf_counter()
            res = m.decoder.decode(ids, cfg)
            seconds.append(time.perf_counter() - t)
            same &= [s.tolist() for s in res.sequences] == tokens
        stats = res.stats.to_dict()
        steps = res.stats.step_seconds
        entry.update(
            seconds=[round(s, 4) for s in seconds], deterministic=same, tokens=tokens, nfe=stats["nfe"],
            request_nfe=stats["request_nfe"], compiles_during_decode=stats["compiles"],
            median_step_seconds=stats["median_step_seconds"],
            mean_step_seconds=sum(steps) / len(steps) if steps else None,
            median_host_seconds=stats.get("median_host_seconds"), buckets=stats["buckets"],
            h2d_bytes=stats.get("h2d_bytes"), d2h_bytes=stats.get("d2h_bytes"))
        if spec.get("profile"):
            entry["profile"] = profile_decode(lambda: m.decoder.decode(ids, cfg))
    return entry


def profile_decode(decode: Callable[[], Any], *, n: int = 10) -> dict[str, Any]:
    """One decode (`decode()`, returning a `DecodeResult`) under `jax.profiler.trace` in a
    temporary folder: its `n` costliest kernels per step (`top_kernels` over the decode's NFE),
    with the NFE and the decode's seconds under the profiler; {"error": ...} if anything fails
    (a profiler this build lacks, a trace it cannot read), so the run goes on."""
    import jax

    trace = tempfile.mkdtemp(prefix="dlm-jax-gpu-trace-")
    try:
        t = time.perf_counter()
        with jax.profiler.trace(trace):
            res = decode()
        seconds = time.perf_counter() - t
        nfe = int(res.stats.to_dict()["nfe"])
        prof = top_kernels(trace, max(nfe, 1), n)
        return prof if "error" in prof else {**prof, "nfe": nfe, "seconds": round(seconds, 4)}
    except Exception as e:  # noqa: BLE001 - a failing profile is recorded, never stops the run
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    finally:
        shutil.rmtree(trace, ignore_errors=True)


def write_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    peer = load_peer(Path(spec["peer_src"]), device="cpu" if not torch.cuda.is_available() else "cuda")
    return write_checkpoint(peer, Path(spec["checkpoint"]), spec["recipe"])


# A measuring worker still running this long past its deadline (a case in flight when the
# budget ran out: a cold 8B compile takes a minute) is stopped, so that the report is written
# before the caller's own time limit (benchmarks/gpu_lease.sh allows 55 s past --budget-s).
KILL_AFTER_S = 30.0


def run_worker(kind: str, spec_path: Path, result: Path, *, extra: Sequence[str] = (), kill_at: float | None = None,
               argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run one worker in a fresh process (its log goes to our stderr) and read its result.

    A measuring worker (fast_dllm, dlm_jax) that fails, or is still running at `kill_at`
    (time.time(); stopped then), stands as what it saved after its last case (`save_partial`,
    or `EMPTY_RESULT`), with `ended` saying why: one case's crash or a lease's clock costs that
    worker's remaining cases, not the report. The checkpoint writer's failure ends the run."""
    cmd = list(argv or [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", str(spec_path),
                        *extra])
    proc = subprocess.Popen(cmd, stdout=sys.stderr)
    try:
        rc = proc.wait(timeout=None if kill_at is None else max(0.0, kill_at - time.time()))
        ended = None if rc == 0 else f"exit status {rc}"
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ended = f"stopped {KILL_AFTER_S:.0f} s past its time budget"
    if ended is None:
        return json.loads(result.read_text())
    if kind not in EMPTY_RESULT:
        raise SystemExit(f"error: the {kind} process failed ({ended}; its log is above)")
    partial = Path(str(result) + ".partial")
    out = {**EMPTY_RESULT[kind], **(json.loads(partial.read_text()) if partial.exists() else {})}
    log(f"{kind} worker: {ended}; its result is what it saved after its last case ({len(out['cases'])} cases)")
    return {**out, "ended": ended}


# ---------------------------------------------------------------------------------------------
# Comparison, limits, targets


def device_limits(name: str, *, hbm_tbps: float | None = None, peak_tflops: float | None = None) -> dict[str, Any]:
    """HBM bandwidth and bf16 peak for a device name (e.g. "NVIDIA H100 80GB HBM3"), flags first."""
    row = next((r for r in DEVICES if r[0].lower() in name.lower()), None)
    return {"hbm_tbps": hbm_tbps or (row[1] if row else None),
            "peak_tflops": peak_tflops or (row[2] if row else None),
            "source": "flags" if hbm_tbps or peak_tflops else (f"table ({row[0]})" if row else "unknown device")}


def step_cost(bucket: str, cfg: dict[str, Any], itemsize: int, *,
              weight_itemsize: int | None = None) -> tuple[float, float]:
    """(FLOPs, bytes read) of one step in a dlm-jax bucket ("b{B}_w{W}_p{P}_r{R}"): the matmuls
    of the window, attention over cache + window, the head on the logit rows; every weight but
    the embedding table (`weight_itemsize` bytes each, default `itemsize`: 1 for int8 / fp8),
    and the cached K/V (`itemsize`)."""
    b, w, p, r = (int(v) for v in re.match(r"b(\d+)_w(\d+)_p(\d+)_r(\d+)", bucket).groups())
    d, layers, heads, kv, dh = cfg["d_model"], cfg["n_layers"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    per_layer = d * heads * dh * 2 + d * kv * dh * 2 + 3 * d * cfg["ffn_hidden"]
    flops = 2 * b * w * layers * per_layer + 4 * b * w * (p + w) * layers * heads * dh + 2 * b * r * d * cfg["vocab_size"]
    weights = layers * per_layer + cfg["vocab_size"] * d
    return float(flops), float(weights * (weight_itemsize or itemsize) + b * p * layers * 2 * kv * dh * itemsize)


def case_limits(buckets: dict[str, int], cfg: dict[str, Any], *, itemsize: int, limits: dict[str, Any],
                weight_itemsize: int | None = None) -> dict[str, Any]:
    """Per-step limits of a decode: the weight read alone, and the mean roofline over its steps
    (weights of `weight_itemsize` bytes, default `itemsize`; see `step_cost`)."""
    if not limits["hbm_tbps"] or not limits["peak_tflops"]:
        return {}
    bw, peak = limits["hbm_tbps"] * 1e12, limits["peak_tflops"] * 1e12
    weights = step_cost("b1_w1_p0_r0", cfg, itemsize, weight_itemsize=weight_itemsize)[1]
    steps = sum(buckets.values())
    flop_s = roof_s = 0.0
    for key, n in buckets.items():
        flops, nbytes = step_cost(key, cfg, itemsize, weight_itemsize=weight_itemsize)
        flop_s += n * flops / peak
        roof_s += n * max(flops / peak, nbytes / bw)
    return {"weight_read_s": weights / bw, "flop_s": flop_s / steps, "roofline_s": roof_s / steps}


def decode_roofline_s(row: dict[str, Any]) -> float | None:
    """Seconds dlm-jax's decode of a case (a `compare` row) would take with each of its steps at
    that step's roofline (`case_limits`' mean roofline times its steps): the least a decode of
    its NFE and buckets can take on the device; None where not computed."""
    steps = sum((row["dlm_jax"].get("buckets") or {}).values())
    roof = (row.get("limits") or {}).get("roofline_s")
    return roof * steps if roof and steps else None


def ratio_at_roofline(row: dict[str, Any]) -> float | None:
    """Fast-dLLM's time over `decode_roofline_s`: the ratio dlm-jax would reach with every step at
    its roofline, the most its NFE allows; a ratio target above it is out of reach on the device
    without fewer forward passes."""
    roof, fs = decode_roofline_s(row), row["fast_dllm"].get("seconds")
    return fs / roof if roof and fs else None


def compare(spec: dict[str, Any], fd: dict[str, Any], dj: dict[str, Any], dj2: dict[str, Any] | None,
            limits: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case (batch, cache, quant; in that order): both sides' times, NFE, tokens
    compared, ratio, dlm-jax's limits. Fast-dLLM runs unquantized: a quantized case takes its
    case of the same batch and cache, and compares its answers also with dlm-jax's unquantized
    ones (`vs_unquantized`); its `agrees` is None (quantization changes answers by design)."""
    rows = []
    itemsize = 2 if spec["dtype"] == "bfloat16" else 4
    gen = spec["gen_len"]
    for case, quant in ((c, q) for c in spec["cases"] for q in spec.get("quants", ["none"])):
        key, base = case_name(case["batch"], case["cache"], quant), case_name(case["batch"], case["cache"])
        f, j = fd["cases"].get(base, {}), dj["cases"].get(key, {})
        row: dict[str, Any] = {"case": key, **case, "quant": quant}
        for side, r in (("fast_dllm", f), ("dlm_jax", j)):
            med = statistics.median(r["seconds"]) if r.get("seconds") else None
            row[side] = {**{k: v for k, v in r.items() if k not in ("tokens", "seconds")},
                         "all_seconds": r.get("seconds"), "seconds": med,
                         "per_answer_s": med / case["batch"] if med else None,
                         "tokens_per_s": case["batch"] * gen / med if med else None}
        if dj2 is not None and key in dj2["cases"] and "first_seconds" in dj2["cases"][key]:
            row["dlm_jax"]["second_process_first_seconds"] = dj2["cases"][key]["first_seconds"]
            row["dlm_jax"]["second_process_xla_cache_hits"] = dj2["cases"][key]["xla_cache_hits"]
        row["fast_dllm"].pop("margins", None)
        row["fast_dllm"].pop("commit_pass", None)
        row["same_tokens"] = row["token_agreement"] = row["nfe_equal"] = row["divergence"] = None
        # Not measured (a side not asked for, or skipped by --budget-s) is no disagreement.
        row["agrees"] = None if quant != "none" or f.get("skipped") or j.get("skipped") else False
        if "tokens" in f and "tokens" in j:
            a, b = f["tokens"], j["tokens"]
            row["same_tokens"] = a == b
            row["token_agreement"] = token_agreement(a, b)
            # NFE as dlm-jax counts it: Fast-dLLM's forward passes less the idle ones.
            row["nfe_equal"] = f["forward_calls"] - f["idle_forwards"] == j["nfe"]
            if quant == "none":
                div = first_divergence(a, b, margins=f["margins"], commit_pass=f["commit_pass"])
                if div is not None:
                    div["near_tie"] = div["min_margin"] < spec["tie_tol"]
                row["divergence"] = div
                # Equal answers and NFE, or answers that part after a near tie (a numerical difference).
                row["agrees"] = (row["same_tokens"] and row["nfe_equal"]) or bool(div and div["near_tie"])
        if quant != "none":
            own = dj["cases"].get(base, {})
            row["vs_unquantized"] = None if "tokens" not in j or "tokens" not in own else {
                "same_answers": sum(x == y for x, y in zip(j["tokens"], own["tokens"])) / len(own["tokens"]),
                "token_agreement": token_agreement(own["tokens"], j["tokens"]),
                "step_ratio": (j["median_step_seconds"] / own["median_step_seconds"]
                               if j.get("median_step_seconds") and own.get("median_step_seconds") else None)}
        fs, js = row["fast_dllm"]["seconds"], row["dlm_jax"]["seconds"]
        row["ratio"] = fs / js if fs and js else None
        if j.get("buckets"):
            lim = case_limits(j["buckets"], dj["config"], itemsize=itemsize, limits=limits,
                              weight_itemsize=1 if quant != "none" else None)
            if lim and j.get("median_step_seconds"):
                lim["median_step_over_weight_read"] = j["median_step_seconds"] / lim["weight_read_s"]
            row["limits"] = lim
        rows.append(row)
    return rows


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of `a`'s tokens that `b` holds at the same row and position."""
    return sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)


def targets(rows: list[dict[str, Any]], load: dict[str, float | None]) -> list[dict[str, Any]]:
    """The issue's targets, each {target, value, limit, pass}; pass is None where not measured.
    All but the int8 one are of the unquantized cases; the int8 step's ratio to the unquantized
    one at batch 1 is listed where both were measured."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, *, at_least: bool, bound: float | None = None) -> None:
        ok = None if value is None else (value >= limit if at_least else value <= limit)
        out.append({"target": name, "value": None if value is None else round(value, 3), "limit": limit, "pass": ok}
                   | ({} if bound is None else {"at_roofline": round(bound, 3)}))

    def pick(batch: int, cache: str, quant: str = "none") -> dict[str, Any] | None:
        return next((r for r in rows if r["batch"] == batch and r["cache"] == cache and row_quant(r) == quant), None)

    for batch, limit in ((1, TARGETS["ratio_b1"]), (8, TARGETS["ratio_b8"])):
        for cache in CACHES:
            r = pick(batch, cache)
            add(f"Fast-dLLM s / dlm-jax s, {cache} b{batch}", r and r["ratio"], limit, at_least=True,
                bound=r and ratio_at_roofline(r))
    for cache in CACHES:
        r = pick(1, cache)
        lim = (r or {}).get("limits") or {}
        add(f"dlm-jax median step / weight-read limit, {cache} b1", lim.get("median_step_over_weight_read"),
            TARGETS["step_over_weight_read"], at_least=False)
    for cache in CACHES:
        step_ratio = ((pick(1, cache, "int8") or {}).get("vs_unquantized") or {}).get("step_ratio")
        if step_ratio is not None:  # both steps measured
            add(f"dlm-jax int8 median step / unquantized median step, {cache} b1", step_ratio,
                TARGETS["int8_step_over_unquantized_b1"], at_least=False)
    rows = [r for r in rows if row_quant(r) == "none"]  # a fresh process's first decode: unquantized
    fd, dj = load.get("fast_dllm"), load.get("dlm_jax")
    add("dlm-jax load s / Fast-dLLM load s", dj / fd if fd and dj else None, TARGETS["load_over_torch"], at_least=False)
    firsts = [r["dlm_jax"].get("first_seconds") for r in rows if r["dlm_jax"].get("first_seconds") is not None]
    add("dlm-jax first decode s (cold cache, worst case)", max(firsts) if firsts else None,
        TARGETS["first_decode_s"], at_least=False)
    seconds = [r["dlm_jax"].get("second_process_first_seconds") for r in rows]
    seconds = [s for s in seconds if s is not None]
    add("dlm-jax first decode s, second process (worst case)", max(seconds) if seconds else None,
        TARGETS["second_process_s"], at_least=False)
    return out


# ---------------------------------------------------------------------------------------------
# Report


def _f(v: Any, fmt: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int):
        return str(v)
    return format(v, fmt) if isinstance(v, float) else str(v)


def verdict(row: dict[str, Any]) -> str:
    """How a case's answers compare, in a few words."""
    if row_quant(row) != "none":
        own = row.get("vs_unquantized")
        return "not compared" if own is None else (
            f"{own['same_answers']:.0%} of answers = dlm-jax unquantized (token agreement {own['token_agreement']:.3f})")
    if row["same_tokens"] is None:
        return "not compared"
    if row["same_tokens"] and row["nfe_equal"]:
        return "identical"
    div = row["divergence"]
    if div is None:
        return "same tokens, NFE DIFFER"
    where = f"row {div['row']} pass {div['pass']}, margin {div['min_margin']:.2g}"
    return f"part after a near tie ({where})" if div["near_tie"] else f"DIFFER ({where})"


def _gib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**30:.2f}"


def markdown(report: dict[str, Any]) -> str:
    s, dev = report["settings"], report["device"]
    lines = [f"# dlm-jax against Fast-dLLM on {dev['jax'] or dev['torch']}"
             + (" (--small)" if report["mode"] == "small" else ""), "",
             f"Checkpoint: random LLaDA `{report['checkpoint']['recipe'].get('shape')}` shape, "
             f"{report['checkpoint'].get('params', 0) / 1e9:.3f}B parameters, {s['dtype']}, peaked head (recipe in the "
             f"JSON). Prompt {s['prompt_len']}, generation {s['gen_len']}, block {s['block_len']}, threshold "
             f"{s['threshold']}, temperature 0. Median of {s['reps']} timed decodes after one untimed."
             + (f" dlm-jax attention: {s['attention']}." if s.get("attention") else "")
             + (f" dlm-jax projections: {s['projections']}." if s.get("projections") not in (None, "separate") else "")
             + (f" A case named with int8 / fp8 is dlm-jax with those weights (`dlm_jax.load(quant=...)`), "
                f"timed against Fast-dLLM's unquantized case; its answers are compared with dlm-jax's unquantized "
                f"ones, its token agreement with Fast-dLLM's." if any(q != "none" for q in s.get("quants", [])) else "")
             + (f" Time budget {s['budget_s']} s: a case left when it was spent is marked skipped."
                if s.get("budget_s") else ""), "",
             f"Devices: dlm-jax {dev['jax']}, Fast-dLLM {dev['torch']}; jax {report['versions']['jax']}, torch "
             f"{report['versions']['torch']}, transformers {report['versions']['transformers']}. Fast-dLLM "
             f"{report['peer']['commit'] or report['peer']['sha256']}.", "",
             "| case | Fast-dLLM s | dlm-jax s | ratio | s/answer FD / DJ | tok/s FD / DJ | NFE FD (idle) / DJ | "
             "answers | token agreement | DJ step ms | weight-read ms | roofline ms | DJ s at roofline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["cases"]:
        fd, dj, lim = r["fast_dllm"], r["dlm_jax"], r.get("limits") or {}
        ms = lambda v: None if v is None else v * 1e3  # noqa: E731
        lines.append(
            f"| {r['case']} | {_f(fd['seconds'])} | {_f(dj['seconds'])} | {_f(r['ratio'], '.2f')} | "
            f"{_f(fd['per_answer_s'])} / {_f(dj['per_answer_s'])} | {_f(fd['tokens_per_s'], '.0f')} / "
            f"{_f(dj['tokens_per_s'], '.0f')} | {_f(fd.get('nfe'))} ({_f(fd.get('idle_forwards'))}) / {_f(dj.get('nfe'))} | "
            f"{verdict(r)} | {_f(r['token_agreement'], '.3f')} | {_f(ms(dj.get('median_step_seconds')), '.2f')} | "
            f"{_f(ms(lim.get('weight_read_s')), '.2f')} | {_f(ms(lim.get('roofline_s')), '.2f')} | "
            f"{_f(decode_roofline_s(r))} |")
    lines += ["", "| case | DJ first decode s (programs it compiled) | DJ first decode s (2nd process) | FD first run s | "
              "peak GiB FD | errors |", "|---|---|---|---|---|---|"]
    for r in report["cases"]:
        fd, dj = r["fast_dllm"], r["dlm_jax"]
        err = "; ".join(f"{side}: {r[side].get('error') or r[side]['skipped']}" for side in SIDES
                        if r[side].get("error") or r[side].get("skipped")) or ""
        made = "" if dj.get("xla_programs") is None else f" ({dj['xla_programs']})"
        lines.append(f"| {r['case']} | {_f(dj.get('first_seconds'), '.2f')}{made} | "
                     f"{_f(dj.get('second_process_first_seconds'), '.2f')} | {_f(fd.get('first_seconds'), '.2f')} | "
                     f"{_gib(fd.get('peak_memory_bytes'))} | {err} |")
    lines += profile_tables(report["cases"])
    load, mem = report["load_seconds"], report["peak_memory_bytes"]
    lines += ["", f"Load: dlm-jax {_f(load['dlm_jax'], '.1f')} s, Fast-dLLM {_f(load['fast_dllm'], '.1f')} s (files in the "
              f"page cache). Peak GPU memory: dlm-jax {_gib(mem['dlm_jax'])} GiB (whole process), Fast-dLLM "
              f"{_gib(mem['fast_dllm'])} GiB (largest case).", "",
              "| target | value | limit | pass | at the roofline |", "|---|---|---|---|---|"]
    mark = {True: "PASS", False: "FAIL", None: "not measured"}
    lines += [f"| {t['target']} | {_f(t['value'])} | {t['limit']} | {mark[t['pass']]} | {_f(t.get('at_roofline'), '.2f')} |"
              for t in report["targets"]]
    lines += ["", "DJ s at roofline: dlm-jax's decode with each step at its roofline (the device's bandwidth and "
              "peak FLOPs of the table above, over the bytes and FLOPs of the step's bucket), its NFE and buckets as "
              "measured. At the roofline: the ratio dlm-jax would reach there, the most its NFE allows; a ratio "
              "target above it needs fewer forward passes, not a faster step."]
    applied = [sh for sh in report["peer"]["shims"] if sh["applied"]]
    lines += ["", "What this script changes in Fast-dLLM's code, in memory (their files are not edited):", ""]
    lines += [f"- {sh['name']} ({sh['target']}): {sh['why']}" for sh in applied]
    lines += [f"- {n}" for n in report["notes"] + report.get("run", {}).get("notes", [])]
    if report.get("small"):
        sm = report["small"]
        lines += ["", f"Correctness half (`--small`, {sm['settings']['dtype']}, {sm['device']['jax']}): "
                  f"answers {'agree' if sm['correct'] else 'DIFFER'}.", "",
                  "| case | answers | token agreement | NFE FD (idle) / DJ |", "|---|---|---|---|"]
        lines += [f"| {r['case']} | {verdict(r)} | {_f(r['token_agreement'], '.3f')} | {_f(r['fast_dllm'].get('nfe'))} "
                  f"({_f(r['fast_dllm'].get('idle_forwards'))}) / {_f(r['dlm_jax'].get('nfe'))} |" for r in sm["cases"]]
    if report.get("parts"):
        lines += ["", "Merged by `benchmarks/gpu.py --merge` from these results (load, peak memory, devices, versions "
                  "and Fast-dLLM's identity above are the first full-mode part's):", ""]
        for i, part in enumerate(report["parts"], 1):
            run = part["run"]
            lines.append(f"{i}. `{part['file']}` ({part['mode']}; {', '.join(part['cases'])}): {run['date']}, "
                         f"{run['machine']}, {part['device']['jax'] or part['device']['torch']}; `{run['command']}`"
                         + (f". Reconstructed {run['reconstructed']}" if run.get("reconstructed") else ""))
            lines += [f"   - {n}" for n in run.get("notes", [])]
        two = {case: src for case, src in report["sources"]["cases"].items() if isinstance(src, dict)}
        if two:
            lines += ["", "Cases whose sides come from two parts (ratio from their times; answers not compared "
                      "across runs): " + "; ".join(f"{case} (Fast-dLLM {src['fast_dllm']}, dlm-jax {src['dlm_jax']})"
                                                   for case, src in two.items()) + "."]
        if report.get("superseded"):
            lines += ["", "Measured again in a later part, not in the table (the first part's measurement is): "
                      + "; ".join(f"{s['case']} {s['side']} {_f(s['seconds'])} s in {s['part']}"
                                  for s in report["superseded"]) + "."]
    return "\n".join(lines) + "\n"


def profile_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: per case profiled by `--profile`, its costliest kernels per step (or the
    profile's error); nothing for cases without a profile (parts written before it)."""
    lines: list[str] = []
    for r in rows:
        prof = r["dlm_jax"].get("profile")
        if not prof:
            continue
        if "top" not in prof:
            lines += ["", f"Kernels of dlm-jax's decode, {r['case']}: profile failed ({prof.get('error')})."]
            continue
        dj = r["dlm_jax"]
        # A step's time outside its kernels: the request's and the predictions' transfers, the
        # launches, the waits (the host's decisions between steps are apart, `median_host_seconds`).
        # Device kernels only: a CPU's traced ops run slower under the profiler than in the timed decodes.
        outside = ("" if dj.get("mean_step_seconds") is None or prof.get("source") != "device" else
                   f"; the timed decodes' mean step {dj['mean_step_seconds'] * 1e3:.2f} ms, "
                   f"{dj['mean_step_seconds'] * 1e3 - prof['kernel_ms_per_step']:.2f} ms of it outside the kernels"
                   + ("" if dj.get("median_host_seconds") is None else
                      f", and {dj['median_host_seconds'] * 1e3:.2f} ms of host decisions between steps (median)"))
        lines += ["", f"Kernels of dlm-jax's decode, {r['case']} ({prof['source']}, "
                  f"{prof['kernel_ms_per_step']:.2f} ms of kernels per step over NFE {prof.get('nfe', '-')}{outside}):",
                  "", *kernel_table(prof)]
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["cases"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    quants = [q for q in QUANTS if any(row_quant(r) == q for r in rows)]
    for side, style in (("dlm_jax", "-o"), ("fast_dllm", "--s")):
        for cache, quant in ((c, q) for c in CACHES for q in (quants if side == "dlm_jax" else ["none"])):
            pts = sorted((r["batch"], r[side]["tokens_per_s"]) for r in rows
                         if r["cache"] == cache and row_quant(r) == quant and r[side].get("tokens_per_s"))
            if pts:
                ax1.plot(*zip(*pts), style, label=f"{side.replace('_', '-')} {cache}"
                         + ("" if quant == "none" else f" {quant}"))
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch")
    ax1.set_ylabel("generated tokens / s")
    ax1.set_title("throughput")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    labels = [r["case"] for r in rows]
    x = range(len(rows))
    step = [1e3 * (r["dlm_jax"].get("median_step_seconds") or float("nan")) for r in rows]
    ax2.bar([i - 0.2 for i in x], step, 0.4, label="dlm-jax median step")
    for key, style, name in (("weight_read_s", "k_", "weight-read limit"), ("roofline_s", "r_", "roofline (mean)")):
        vals = [1e3 * ((r.get("limits") or {}).get(key) or float("nan")) for r in rows]
        ax2.plot([i + 0.2 for i in x], vals, style, markersize=14, label=name)
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels, rotation=45, fontsize=8)
    ax2.set_ylabel("ms per step")
    ax2.set_title("dlm-jax step time against its limits")
    ax2.grid(axis="y", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(f"dlm-jax vs Fast-dLLM, {report['device']['jax']}, {report['settings']['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Merge (--merge): results of several runs in one


# What every part of one mode must share: their cases decode the same checkpoint recipe the same way.
MERGE_MATCH = ("prompt_len", "gen_len", "block_len", "threshold", "dtype", "temperature", "seed")
PART_KEYS = ("mode", "settings", "checkpoint", "device", "versions", "peer", "load_seconds", "peak_memory_bytes",
             "cases", "notes", "run")
RUN_KEYS = ("date", "machine", "command", "versions")


def part_name(path: Path) -> str:
    """How a part is named in the merged result: its path in the repository, else as given."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def read_part(path: Path) -> dict[str, Any]:
    """A result this script wrote, with its run record; exits with one line on anything else."""
    try:
        rep = json.loads(path.read_text())
    except OSError as e:
        raise SystemExit(f"error: --merge {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --merge {path} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(rep, dict) or rep.get("benchmark") != "benchmarks/gpu.py":
        raise SystemExit(f"error: --merge {path} is not a benchmarks/gpu.py result")
    if "parts" in rep:
        raise SystemExit(f"error: --merge {path} is itself a merged result: merge its parts")
    if missing := [k for k in PART_KEYS if k not in rep]:
        raise SystemExit(f"error: --merge {path} is not a benchmarks/gpu.py result (no {', '.join(missing)})")
    if not isinstance(rep["run"], dict) or (missing := [k for k in RUN_KEYS if k not in rep["run"]]):
        raise SystemExit(f"error: --merge {path} has no run record ({', '.join(missing or RUN_KEYS)} missing)")
    if rep["mode"] not in MODE_DEFAULTS:
        raise SystemExit(f"error: --merge {path} has mode {rep['mode']!r}, not one of {', '.join(MODE_DEFAULTS)}")
    return rep


def _measured(row: dict[str, Any], side: str) -> bool:
    return row[side].get("seconds") is not None


def _check_group(group: list[tuple[str, dict[str, Any]]]) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict]]:
    """Parts of one mode: same recipe and `MERGE_MATCH` settings. Returns the rows (each side
    of a case from the first part that measured it, see the module docstring), {case: part, or
    {side: part} for a row of two parts}, and the superseded measurements."""
    first, base = group[0]
    for name, rep in group:
        have, want = rep["checkpoint"].get("recipe") or {}, base["checkpoint"].get("recipe") or {}
        if have != want:
            diff = {k: (have.get(k), want.get(k)) for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k)}
            raise SystemExit(f"error: --merge {name} has another checkpoint recipe than {first}: {diff} (its, first's)")
        for k in MERGE_MATCH:
            if rep["settings"].get(k) != base["settings"].get(k):
                raise SystemExit(f"error: --merge {name} has {k} {rep['settings'].get(k)!r}, {first} "
                                 f"{base['settings'].get(k)!r}: the cases of one table must decode alike")
    found: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, rep in group:
        for row in rep["cases"]:
            found.setdefault(row["case"], []).append((name, row))
    rows, where, superseded = [], {}, []
    for case, held in found.items():
        side_of = {side: next(((n, r) for n, r in held if _measured(r, side)), None) for side in SIDES}
        for side, other in (SIDES, SIDES[::-1]):  # a side no part measured: the other side's part's row
            side_of[side] = side_of[side] or side_of[other] or held[0]
        superseded += [{"case": case, "side": side, "part": n, "seconds": r[side]["seconds"],
                        "kept": side_of[side][0]} for side in SIDES for n, r in held
                       if _measured(r, side) and n != side_of[side][0]]
        (fd_part, fd_row), (dj_part, dj_row) = side_of["fast_dllm"], side_of["dlm_jax"]
        if fd_part == dj_part:
            rows.append(fd_row)
            where[case] = fd_part
            continue
        fs, js = fd_row["fast_dllm"]["seconds"], dj_row["dlm_jax"]["seconds"]
        rows.append({**dj_row, "fast_dllm": fd_row["fast_dllm"], "same_tokens": None, "token_agreement": None,
                     "nfe_equal": None, "divergence": None, "agrees": None, "ratio": fs / js if fs and js else None})
        where[case] = {"fast_dllm": fd_part, "dlm_jax": dj_part}
    return rows, where, superseded


def _union(group: list[tuple[str, dict[str, Any]]], settings: dict[str, Any]) -> dict[str, Any]:
    batches = sorted({b for _, rep in group for b in rep["settings"]["batches"]})
    caches = [c for c in CACHES if any(c in rep["settings"]["caches"] for _, rep in group)]
    if not any("quants" in rep["settings"] for _, rep in group):  # parts older than --quant: as they were
        return {**settings, "batches": batches, "caches": caches}
    quants = [q for q in QUANTS if any(q in rep["settings"].get("quants", ["none"]) for _, rep in group)]
    return {**settings, "batches": batches, "caches": caches, "quants": quants}


def _in_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # A run's order: batch, then cache, then quant mode.
    return sorted(rows, key=lambda r: (r["batch"], CACHES.index(r["cache"]), QUANTS.index(row_quant(r))))


def merge(parts: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One report from `parts` ([(name, result of `read_part`)], the first full-mode one the base;
    see the module docstring). Exits with one line on parts that cannot share a table."""
    full = [(n, r) for n, r in parts if r["mode"] == "full"]
    small = [(n, r) for n, r in parts if r["mode"] == "small"]
    if not full:
        raise SystemExit("error: --merge needs a full-mode part (the table); --small parts go beside it")
    rows, where, superseded = _check_group(full)
    srows, small_where, small_superseded = _check_group(small) if small else ([], {}, [])
    first, base = full[0]
    rows = _in_order(rows)
    notes = list(dict.fromkeys(n for _, rep in parts for n in rep["notes"]))  # the script's own notes, once each
    report: dict[str, Any] = {
        "benchmark": "benchmarks/gpu.py", "mode": "full", "settings": _union(full, base["settings"]),
        **{k: base[k] for k in ("checkpoint", "device", "versions", "peer", "load_seconds", "peak_memory_bytes")},
        "cases": rows, "targets": targets(rows, base["load_seconds"]),
        "correct": all(r["agrees"] for r in rows if r["agrees"] is not None), "notes": notes}
    if superseded or small_superseded:
        report["superseded"] = superseded + small_superseded
    if small:
        srows = _in_order(srows)
        report["small"] = {"settings": _union(small, small[0][1]["settings"]), "device": small[0][1]["device"],
                           "checkpoint": small[0][1]["checkpoint"], "cases": srows,
                           "correct": all(r["agrees"] for r in srows if r["agrees"] is not None)}
    report["parts"] = [{"file": name, "mode": rep["mode"], "device": rep["device"],
                        "cases": [r["case"] for r in rep["cases"]], "run": rep["run"]} for name, rep in parts]
    report["sources"] = {
        **{k: first for k in ("settings", "checkpoint", "device", "versions", "peer", "load_seconds",
                              "peak_memory_bytes")},
        "settings.batches": "union of the full-mode parts", "settings.caches": "union of the full-mode parts",
        **({"settings.quants": "union of the full-mode parts (a part without quants: none)"}
           if "quants" in report["settings"] else {}),
        "targets": "computed from the merged cases", "correct": "computed from the merged cases",
        "notes": "every part's, once each", "cases": where, **({"small": small_where} if small else {}),
        **({"superseded": "measured again in a later part: each side is taken from the first part that measured it"}
           if "superseded" in report else {})}
    return report


# ---------------------------------------------------------------------------------------------
# Main


def run(args: argparse.Namespace) -> dict[str, Any]:
    src, cloned = peer_source(args.peer_src)
    rec = recipe(args)
    shape = SHAPES[args.shape]
    ckpt = args.checkpoint.expanduser()
    keep = args.work is not None
    work = args.work.expanduser() if keep else Path(tempfile.mkdtemp(prefix="dlm-jax-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    xla_cache = args.xla_cache or work / "xla"
    cases = [{"batch": b, "cache": c} for b in args.batches for c in args.caches]
    spec = {"peer_src": str(src), "checkpoint": str(ckpt), "recipe": rec, "dtype": args.dtype,
            "require_gpu": needs_gpu(args), "mask_id": shape["mask_token_id"], "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "block_len": args.block_len, "threshold": args.threshold, "reps": args.reps,
            "xla_cache": str(xla_cache), "cases": cases, "tie_tol": args.tie_tol, "quants": args.quant,
            "attention": args.attention, "projections": args.projections, "profile": args.profile,
            "prompts": make_prompts(max(args.batches), args.prompt_len, vocab_below=shape["mask_token_id"],
                                    avoid=[shape["eos_token_id"]], seed=args.seed)}
    try:
        state = checkpoint_state(ckpt, rec)
        written: dict[str, Any] = {}
        if state == "write" and all(_done(side_spec(spec, k), work, k) for k in ("write", *args.sides)):
            state = "reuse"  # every result is in --work: the report needs no checkpoint
            written = json.loads((work / "write.json").read_text())
        elif state == "write":
            log(f"writing the checkpoint to {ckpt} with Fast-dLLM's code")
            written = _worker(spec, work, "write")
        elif state == "foreign":
            log(f"{ckpt} was not written by this script: used as it is")
        # A side not run stands as a process that decoded nothing (its cases compare as not run).
        fd = _worker(side_spec(spec, "fast_dllm"), work, "fast_dllm", deadline=peer_deadline(args)) if (
            "fast_dllm" in args.sides) else dict(EMPTY_RESULT["fast_dllm"])
        dj = (_worker(spec, work, "dlm_jax", deadline=first_deadline(args)) if "dlm_jax" in args.sides
              else dict(EMPTY_RESULT["dlm_jax"]))
        dj2 = (None if args.no_second_process or "dlm_jax" not in args.sides
               else _worker(spec, work, "dlm_jax", second=True, deadline=args.deadline))
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    limits = device_limits(dj["device"] or fd["device"], hbm_tbps=args.hbm_tbps, peak_tflops=args.peak_tflops)
    if args.dtype != "bfloat16" and not (args.hbm_tbps and args.peak_tflops):
        limits = {**limits, "hbm_tbps": None, "peak_tflops": None, "source": "not computed for float32"}
    rows = compare(spec, fd, dj, dj2, limits)
    if len(set(args.sides)) < len(SIDES):
        for r in rows:
            r["agrees"] = None  # not compared: one side was asked for
    load = {"fast_dllm": fd["load_seconds"], "dlm_jax": dj["load_seconds"]}
    fd_mem = [r["fast_dllm"].get("peak_memory_bytes") for r in rows if r["fast_dllm"].get("peak_memory_bytes")]
    notes = []
    if any(r["fast_dllm"].get("idle_forwards") for r in rows):
        notes.append("Fast-dLLM's NFE counts idle forwards (a cached step after a block its full forward already "
                     "finished: this version checks for a finished block after a cached step); NFE is compared "
                     "without them.")
    if fd["params"] and dj["params"] and fd["params"] != dj["params"]:
        notes.append(f"parameter counts differ: Fast-dLLM {fd['params']}, dlm-jax {dj['params']}")
    notes += [f"the {side} process ended early ({res['ended']}): its cases after the last it saved are not "
              f"measured" for side, res in (("Fast-dLLM", fd), ("dlm-jax", dj), ("dlm-jax second", dj2))
              if res and res.get("ended")]
    skipped = [f"{side} {key}" for side, res in (("Fast-dLLM", fd), ("dlm-jax", dj), ("dlm-jax second process", dj2))
               for key in (res or {}).get("skipped", [])]
    if skipped:
        notes.append(f"--budget-s {args.budget_s} was spent before these cases ran: {', '.join(skipped)}")
    correct = all(r["agrees"] for r in rows if r["agrees"] is not None)
    versions = {"jax": dj["jax"], "torch": fd["torch"], "transformers": fd["transformers"],
                "python": platform.python_version()}
    report = {
        "benchmark": "benchmarks/gpu.py", "mode": args.mode,
        "settings": {k: spec[k] for k in ("prompt_len", "gen_len", "block_len", "threshold", "reps", "dtype")}
        | {"temperature": 0.0, "batches": args.batches, "caches": args.caches, "seed": args.seed,
           "untimed_runs": 1, "xla_cache": "given" if args.xla_cache else "fresh (removed after)",
           "quants": args.quant, "attention": dj.get("attention") or args.attention,
           "projections": dj.get("projections") or args.projections, "budget_s": args.budget_s,
           "peer_budget_s": args.peer_budget_s, "second_budget_s": args.second_budget_s, "profile": args.profile},
        "checkpoint": {"path": str(ckpt), "state": state, "recipe": rec if state != "foreign" else {},
                       "params": dj["params"] or fd["params"], **written},
        "device": {"jax": dj["device"], "torch": fd["device"], **limits},
        "versions": versions,
        "peer": {**peer_identity(src), "cloned_now": cloned, "shims": fd["shims"]},
        "load_seconds": load,
        "peak_memory_bytes": {"dlm_jax": dj.get("peak_memory_bytes"), "fast_dllm": max(fd_mem) if fd_mem else None},
        "cases": rows, "targets": targets(rows, load), "correct": correct, "notes": notes,
        "run": run_record(args, versions)}
    return report


def side_spec(spec: dict[str, Any], kind: str) -> dict[str, Any]:
    """What a worker of `kind` is given: Fast-dLLM's spec lacks dlm-jax's own options (quant
    modes, attention, projections, profile), so that changing them does not measure Fast-dLLM again
    under --work."""
    own = ("quants", "attention", "projections", "profile")
    return {k: v for k, v in spec.items() if k not in own} if kind == "fast_dllm" else spec


def peer_deadline(args: argparse.Namespace) -> float | None:
    """Fast-dLLM's worker's deadline (time.time()): the end of --budget-s, or sooner the end of
    --peer-budget-s counted from now (the worker's start)."""
    ends = [d for d in (args.deadline, None if args.peer_budget_s is None else time.time() + args.peer_budget_s)
            if d is not None]
    return min(ends) if ends else None


def first_deadline(args: argparse.Namespace) -> float | None:
    """The first dlm-jax process's deadline: the end of --budget-s less --second-budget-s."""
    if args.deadline is None:
        return None
    return args.deadline - (args.second_budget_s or 0.0)


def run_record(args: argparse.Namespace, versions: dict[str, Any]) -> dict[str, Any]:
    """What a result says of its own run: the UTC date, the machine, the command as given, the
    versions (with dlm-jax's commit, "+dirty" for uncommitted changes) and the `--note`s."""
    commit = None
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
        if head.returncode == 0:
            commit = head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": f"{platform.node()} ({platform.platform()}, {os.cpu_count()} CPU cores)",
            "command": shlex.join(["benchmarks/gpu.py", *args.argv]),
            "versions": {**versions, "dlm_jax_commit": commit}, "notes": list(args.note)}


def _worker_spec(spec: dict[str, Any], work: Path, kind: str, second: bool) -> tuple[str, Path, Path]:
    name = kind + ("2" if second else "")
    result = work / f"{name}.json"
    return json.dumps({**spec, "result": str(result), "second": second}), work / f"{name}.spec.json", result


def _done(spec: dict[str, Any], work: Path, kind: str, *, second: bool = False) -> bool:
    """Whether `work` holds this worker's result for this very spec (from an earlier run), with
    no case a time budget skipped (such a result is measured again)."""
    text, spec_path, result = _worker_spec(spec, work, kind, second)
    return (result.is_file() and spec_path.is_file() and spec_path.read_text() == text
            and not json.loads(result.read_text()).get("skipped"))


def _worker(spec: dict[str, Any], work: Path, kind: str, *, second: bool = False,
            deadline: float | None = None) -> dict[str, Any]:
    text, spec_path, result = _worker_spec(spec, work, kind, second)
    if _done(spec, work, kind, second=second):
        log(f"{result.stem}: result reused from {result}")
        return json.loads(result.read_text())
    result.unlink(missing_ok=True)
    spec_path.write_text(text)
    return run_worker(kind, spec_path, result, extra=() if deadline is None else ("--deadline", repr(deadline)),
                      kill_at=None if deadline is None else deadline + KILL_AFTER_S)


def save_partial(spec: dict[str, Any], out: dict[str, Any]) -> None:
    """After each case: what a worker has so far, beside its result (a run cut short keeps it)."""
    Path(spec["result"] + ".partial").write_text(json.dumps(out))


def worker_main(kind: str, spec_path: Path, *, deadline: float | None = None) -> None:
    spec = json.loads(spec_path.read_text())
    if kind == "write":
        out = write_worker(spec)
    elif kind == "fast_dllm":
        out = fast_dllm_worker(spec, deadline=deadline)
    else:
        out = dlm_jax_worker(spec, second=spec["second"], deadline=deadline)
    Path(spec["result"]).write_text(json.dumps(out))


def print_targets(report: dict[str, Any]) -> None:
    for t in report["targets"]:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        print(f"{mark}  {t['target']}: {_f(t['value'])} (limit {t['limit']})")
    for r in report["cases"]:
        print(f"{r['case']}: NFE Fast-dLLM {r['fast_dllm'].get('nfe')} (idle {r['fast_dllm'].get('idle_forwards')}), "
              f"dlm-jax {r['dlm_jax'].get('nfe')}; answers {verdict(r)}, token agreement "
              f"{_f(r['token_agreement'])}, ratio {_f(r['ratio'], '.2f')}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.spec, deadline=args.deadline)
        return 0
    report = merge([(part_name(path), read_part(path)) for path in args.merge]) if args.merge else run(args)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print_targets(report)
    print(f"wrote {out}.json, .md, .png" + (f" from {len(args.merge)} parts" if args.merge else "")
          + f"; answers {'agree' if report['correct'] else 'DIFFER'}")
    return 0 if report["correct"] or args.mode != "small" else 1


if __name__ == "__main__":
    sys.exit(main())

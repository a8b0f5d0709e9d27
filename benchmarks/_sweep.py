"""What the kernel sweeps share (`kernel_sweep.py`: the attention kernel's tilings,
`quant_sweep.py`: the quantized GEMM kernel's): a tiling named on the command line, their
common flags, the device they run on (a GPU, Pallas's interpreter, or a compile-only target),
and their reports written after every case."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from dlm_jax._integrity import atomic_write


def tiling_type(presets: dict[str, Any], fields: dict[str, str], make: Callable[..., Any]):
    """An argparse type: a preset's name, or `key=value,...` pairs (`fields`: the command
    line's key -> the tiling's field; the rest the default's), as (name, tiling made by
    `make`); anything else refused in one line."""
    def parse(spec: str) -> tuple[str, Any]:
        if spec in presets:
            return spec, presets[spec]
        values = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            if key not in fields or not value.isdigit():
                raise argparse.ArgumentTypeError(f"{spec!r}: a preset ({', '.join(presets)}) or key=value pairs of "
                                                 f"{', '.join(fields)}")
            values[fields[key]] = int(value)
        try:
            return spec, make(**values)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def add_flags(p: argparse.ArgumentParser, presets: dict[str, Any], fields: dict[str, str], make: Callable[..., Any],
              *, layers: int, layers_help: str | None = None) -> None:
    """The flags both sweeps take: --tilings (presets or key=value lists), --layers, --calls,
    --reps, --stand-in, --target, --seed, --note, --out."""
    p.add_argument("--tilings", type=tiling_type(presets, fields, make), nargs="+",
                   default=list(presets.items()),
                   help=f"presets ({', '.join(presets)}) or key=value lists ({', '.join(fields)})")
    p.add_argument("--layers", type=int, default=layers, help=layers_help)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--stand-in", action="store_true", help="the kernel in Pallas's interpreter (any device)")
    p.add_argument("--target", metavar="GPU", help="compile for this GPU without one, no timing (as gpu_step.py "
                   "--target: h200 or a GpuTargetConfigProto text file; needs JAX's CUDA plugin)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", action="append", default=[], metavar="TEXT")
    p.add_argument("--out", type=Path, required=True)


def parse(p: argparse.ArgumentParser, argv: list[str] | None, positive: tuple[str, ...]):
    """(args, the compile-only target device or None): the flags `positive` names ("layers",
    "batches") take positive numbers (one or a list); each tiling at most once; a run without a
    GPU needs --stand-in or --target (each refused in one line)."""
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    values = [v for name in positive for v in (lambda a: a if isinstance(a, list) else [a])(getattr(args, name))]
    if min(values) < 1:
        p.error(f"{', '.join('--' + n for n in positive)} take positive numbers")
    if len({n for n, _ in args.tilings}) < len(args.tilings):
        p.error("--tilings: each at most once")
    target = None
    if args.target:
        from gpu_step import compile_only_device

        target = compile_only_device(args.target)
    elif not args.stand_in and jax.default_backend() != "gpu":
        p.error(f"the kernel needs a GPU and JAX's backend here is {jax.default_backend()!r}; --stand-in runs it in "
                "Pallas's interpreter, --target compiles it for a GPU without one")
    return args, target


def rank(case: dict[str, Any], good: dict[str, dict], baseline: str, time: str) -> None:
    """The fastest of the passing kernel forms `good` (by `time`) into `case`: its name
    (`best`), its time over the `baseline` form's (`best_over_<baseline>`), and, where the
    default tiling passed, over the default's and the default's over the baseline's."""
    if not good:
        return
    base = case["forms"][baseline][time]
    best = min(good, key=lambda n: good[n][time])
    case["best"] = best
    case[f"best_over_{baseline}"] = good[best][time] / base
    if "pallas:default" in good:
        case["best_over_default"] = good[best][time] / good["pallas:default"][time]
        case[f"default_over_{baseline}"] = good["pallas:default"][time] / base


def copy_gbps() -> float:
    """The device's copy bandwidth (`gpu_step.copy_bandwidth`: a large array copied), GB/s."""
    from gpu_step import copy_bandwidth

    return copy_bandwidth() / 1e9


def write(rep: dict[str, Any], out: Path, markdown: Callable[[dict], str], plot: Callable[[dict, Path], None]) -> None:
    """The report as <out>.json and .md, and (timed or interpreted, not compile-only) .png."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out.with_suffix(".json"), json.dumps(rep, indent=1) + "\n")
    atomic_write(out.with_suffix(".md"), markdown(rep))
    if rep["mode"] != "compile only":
        plot(rep, out.with_suffix(".png"))

"""The one registry of decoding strategies: names -> objects, presets, flat options and the
command line options generated from them (NumPy only).

Every strategy class registered here is a frozen dataclass whose fields are its options;
its field metadata carries the help text (and `choices`). The flat option namespace is the
union of those fields, plus the selectors (`cache`, `rule`, `revision`) that pick a class and
`gen_len`. Options are validated once, by the chosen classes' constructors; an option given
explicitly that the chosen strategies do not take is an error naming who takes it.

Adding a commit rule: write the class (fields + `select`, usually a `PerStepRule`) in
`commit.py` and add one line to `RULES`. Its options, presets and CLI flags follow.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any, NamedTuple

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.commit import (FactorRule, FrechetRule, NoCommit, PaperFactorRule, ThresholdRule,
                                    TopKSchedule)
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.placement import NoPlacement
from dlm_jax.runtime.proposer import Proposer
from dlm_jax.runtime.revision import NoRevision
from dlm_jax.runtime.scheduler import DualCache, NoCache, PrefixCache
from dlm_jax.techniques.isd.strided import LeftToRight, Strided
from dlm_jax.techniques.lladacpp.dppr import ProgressiveRevision
from dlm_jax.techniques.lladacpp.mbsd import SpeculativeWindow
from dlm_jax.techniques.tide.experts import ExpertPolicy

SCHEDULERS: dict[str, type] = {
    "none": NoCache,  # LLaDA: the whole sequence every step
    "prefix": PrefixCache,  # Fast-dLLM prefix cache
    "dual": DualCache,  # Fast-dLLM dual cache
    "mbsd": SpeculativeWindow,  # llada.cpp multi-block speculative windows
    "isd": Strided,  # I-DLM introspective strided decoding (causal, logit-shift models)
    "ar": LeftToRight,  # left to right, one token per forward (causal, logit-shift models)
}
RULES: dict[str, type] = {
    "topk": TopKSchedule,  # LLaDA low-confidence remasking, fixed steps
    "threshold": ThresholdRule,  # Fast-dLLM
    "factor": FactorRule,  # Fast-dLLM, as released
    "factor_paper": PaperFactorRule,  # Fast-dLLM, as the paper states it
    "frechet": FrechetRule,  # Fast-dLLM++
    "none": NoCommit,  # the schedule accepts its own proposals (isd, ar)
}
REVISIONS: dict[str, type] = {
    "none": NoRevision,
    "dppr": ProgressiveRevision,  # llada.cpp dual-path progressive revision
}
PLACEMENTS: dict[str, type] = {
    "none": NoPlacement,  # everything where the executor put it (PowerInfer-2 places neurons offline, at export)
    "experts": ExpertPolicy,  # TIDE's interval expert refresh and its baselines (MoE models)
}


class Selector(NamedTuple):
    option: str  # the flat option that names the class
    field: str  # the DecodeConfig field it fills
    table: dict[str, type]
    default: str
    help: str
    implied_by: tuple[tuple[str, str], ...] = ()  # (option, name): changing the option, not the selector, picks name


SELECTORS: tuple[Selector, ...] = (
    Selector("cache", "scheduler", SCHEDULERS, "prefix", "cache mode / block schedule"),
    Selector("rule", "rule", RULES, "threshold", "commit rule"),
    Selector("revision", "revision", REVISIONS, "none", "revision policy"),
    Selector("placement", "placement", PLACEMENTS, "none", "expert / neuron placement policy",
             implied_by=(("experts", "experts"),)),
)

PRESETS: dict[str, dict[str, Any]] = {
    # LLaDA: full forward every step, one token per step, low-confidence remasking.
    "llada": {"cache": "none", "rule": "topk", "block_len": 32},
    # Fast-dLLM: prefix (or dual) cache, confidence threshold 0.9, block 32.
    "fast-dllm": {"cache": "prefix", "rule": "threshold", "threshold": 0.9, "block_len": 32},
    "fast-dllm-dual": {"cache": "dual", "rule": "threshold", "threshold": 0.9, "block_len": 32},
    "fast-dllm-factor": {"cache": "prefix", "rule": "factor", "factor": 1.0, "block_len": 32},
    # Fast-dLLM++: prefix cache, Frechet delta 0.25, block 32.
    "frechet": {"cache": "prefix", "rule": "frechet", "delta": 0.25, "block_len": 32},
    # llada.cpp: sliding multi-block speculative windows (look-ahead at 4 undecided slots),
    # tokens visible at 0.7 (the threshold rule) and stable at 0.9, CPU-path refresh of 8
    # visible tokens per step, stable slots request no logits.
    "llada-cpp": {"cache": "mbsd", "rule": "threshold", "threshold": 0.7, "draft_threshold": 0.7,
                  "revision": "dppr", "theta_stable": 0.9, "theta_visible": 0.7, "revisit": "remask",
                  "block_len": 32},
    # I-DLM: introspective strided decoding, stride 4, lossless acceptance (causal, logit-shift models).
    "isd": {"cache": "isd", "stride": 4},
    # Left to right: one token per forward over the K/V cache (causal, logit-shift models).
    "ar": {"cache": "ar"},
}

# Short flags the command line has always used.
FLAGS = {"gen_len": "--gen", "block_len": "--block"}


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    help: str
    choices: tuple | None = None
    owners: tuple[str, ...] = ()  # "selector=name" of the classes that take it; () = always used


def _fields(cls: type) -> list[dataclasses.Field]:
    """A class's flat options: its init fields but those marked `metadata={"option": False}`
    (values made by code, such as calibrated expert sets, kept with the object)."""
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("option", True)]


@functools.cache
def _field_type(cls: type, name: str) -> type:
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def options() -> dict[str, Option]:
    """Every flat decode option, from the registered classes (made once per state of the
    tables: a request's options are checked against it, at every `submit`)."""
    global _OPTIONS
    key = tuple((sel.option, tuple(sel.table.items())) for sel in SELECTORS)
    made = _OPTIONS
    if made is None or made[0] != key:
        made = _OPTIONS = (key, _make_options())
    return dict(made[1])


_OPTIONS: tuple | None = None  # (the tables it was made from, the options)


def _make_options() -> dict[str, Option]:
    out: dict[str, Option] = {"gen_len": Option("gen_len", int, 128, "tokens to generate per request")}
    for sel in SELECTORS:
        out[sel.option] = Option(sel.option, str, sel.default, sel.help, tuple(sel.table))
    first: dict[str, tuple[type, dataclasses.Field]] = {}
    takers: dict[str, list[tuple[Selector, str]]] = {}
    for sel in SELECTORS:
        for name, cls in sel.table.items():
            for f in _fields(cls):
                first.setdefault(f.name, (cls, f))
                takers.setdefault(f.name, []).append((sel, name))
    for f in _fields(Proposer):
        first.setdefault(f.name, (Proposer, f))
    for name, (cls, f) in first.items():
        who = takers.get(name, [])
        # Taken by every choice of its selector (or by the proposer): always used.
        always = not who or any(set(sel.table) <= {n for s, n in who if s is sel} for sel, _ in who)
        owners = () if always else tuple(f"{sel.option}={n!r}" for sel, n in who)
        default = f.default if f.default is not dataclasses.MISSING else None
        out[name] = Option(name, _field_type(cls, name), default, f.metadata.get("help", ""),
                           f.metadata.get("choices"), owners)
    return out


def _build_part(cls: type, merged: Mapping[str, Any], used: set[str]) -> Any:
    kwargs = {f.name: merged[f.name] for f in _fields(cls) if f.name in merged}
    used.update(kwargs)
    return cls(**kwargs)


def build(changes: Mapping[str, Any], *, base: DecodeConfig | Mapping[str, Any] | None = None) -> DecodeConfig:
    """A `DecodeConfig` from flat options `changes` over `base` (a preset's options, or a
    config whose untouched strategies are kept as they are).

    A selector may be given a name or an object (`rule=FrechetRule(0.1)`).

    Raises:
      ConfigError: an unknown option or name, an invalid value (named by the class that
        validates it), or an option given that the chosen strategies do not take.
    """
    known = options()
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise ConfigError(f"unknown decode option(s) {unknown}; known: {sorted(known)}")
    keep = base if isinstance(base, DecodeConfig) else None
    merged = {**(decode_options(keep) if keep else dict(base or {})), **changes}
    used = {"gen_len"} | {sel.option for sel in SELECTORS}
    parts: dict[str, Any] = {}
    for sel in SELECTORS:
        default = sel.default
        if sel.field == "rule" and type(parts["scheduler"]).commit_rule is not None:
            default = _class_name(type(parts["scheduler"]).commit_rule, RULES)  # a schedule that accepts its own proposals
        implied = next((name for option, name in sel.implied_by if option in changes), None)
        choice = changes.get(sel.option, implied or merged.get(sel.option, default))
        if not isinstance(choice, str):  # an object
            parts[sel.field] = choice
            continue
        if choice not in sel.table:
            raise ConfigError(f"{sel.option}={choice!r} is not one of {tuple(sel.table)}")
        cls = sel.table[choice]
        current = getattr(keep, sel.field, None) if keep else None
        if type(current) is cls and not {f.name for f in _fields(cls)} & set(changes):
            parts[sel.field] = current  # untouched: keep the object itself
            used.update(f.name for f in _fields(cls))
        else:
            parts[sel.field] = _build_part(cls, merged, used)
    parts["proposer"] = _build_part(Proposer, merged, used)
    for name in changes:
        if name not in used:
            owners = known[name].owners
            where = owners[0] if len(owners) == 1 else " or ".join(owners)
            raise ConfigError(f"{name}={changes[name]!r} applies to {where} only")
    needs = type(parts["scheduler"]).commit_rule
    if needs is not None and type(parts["rule"]) is not needs:
        raise ConfigError(f"cache={_name_of(parts['scheduler'], SCHEDULERS)!r} accepts its own proposals and takes "
                          f"rule={_class_name(needs, RULES)!r}, not rule={_name_of(parts['rule'], RULES)!r}")
    if parts["proposer"].remasking == "random" and not isinstance(parts["rule"], TopKSchedule):
        raise ConfigError("remasking='random' applies to rule='topk' only")
    return DecodeConfig(gen_len=merged.get("gen_len", 128), **parts)


def decode_config(base: DecodeConfig | None = None, /, **options: Any) -> DecodeConfig:
    """A `DecodeConfig` from flat options, e.g. `decode_config(cache="dual", rule="frechet",
    delta=0.25, block_len=32, gen_len=64)`; unnamed options take the defaults (prefix cache,
    threshold 0.9, block 32, greedy). With a `base` config, a copy of it with those options
    changed, by flat name (`temperature=1.0`, `cache="dual"`) or by object
    (`rule=FrechetRule(0.1)`); its untouched strategies are kept as they are."""
    return build(options, base=base)


def preset(name: str, **options: Any) -> DecodeConfig:
    """A paper's decoder (`PRESETS`), with any options changed."""
    if name not in PRESETS:
        raise ConfigError(f"unknown decode preset {name!r}; known: {sorted(PRESETS)}")
    return build(options, base=PRESETS[name])


def _class_name(cls: type, table: dict[str, type]) -> str:
    return next((name for name, c in table.items() if c is cls), cls.__name__)


def _name_of(obj: Any, table: dict[str, type]) -> str:
    return _class_name(type(obj), table)


def decode_options(cfg: DecodeConfig) -> dict[str, Any]:
    """The flat option names and values that describe `cfg` (as the CLI spells them:
    selectors by registered name, then each object's fields); `decode_config(**opts)` rebuilds
    it for registered strategies."""
    out: dict[str, Any] = {"gen_len": cfg.gen_len}
    for sel in SELECTORS:
        obj = getattr(cfg, sel.field)
        out[sel.option] = _name_of(obj, sel.table)
        if dataclasses.is_dataclass(obj):
            out.update({f.name: getattr(obj, f.name) for f in _fields(type(obj))})
    out.update({f.name: getattr(cfg.proposer, f.name) for f in _fields(Proposer)})
    return out


# --------------------------------------------------------------------------- command line


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """One flag per option (`--gen`, `--block`, `--cache`, `--rule`, `--threshold`, ...), all
    defaulting to None so only what was typed overrides a preset."""
    parser.add_argument("--preset", default="fast-dllm", choices=sorted(PRESETS),
                        help="decoder preset (default fast-dllm); the options below override it, and an "
                             "option that neither sets takes the default shown")
    for opt in options().values():
        flag = FLAGS.get(opt.name, "--" + opt.name.replace("_", "-"))
        default = "" if opt.default is None or opt.type is bool else f"; default {opt.default}"
        help_ = opt.help + default + (f" [{', '.join(opt.owners)}]" if opt.owners else "")
        if opt.type is bool:
            parser.add_argument(flag, dest=opt.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_)
        else:
            parser.add_argument(flag, dest=opt.name, type=opt.type, choices=opt.choices, default=None,
                                help=help_)


def config_from_args(args: argparse.Namespace) -> DecodeConfig:
    """The preset named by `--preset` with every option typed on the command line."""
    given = {name: getattr(args, name) for name in options() if getattr(args, name, None) is not None}
    return preset(args.preset, **given)

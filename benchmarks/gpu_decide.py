"""The GPU's attention form and projections, chosen from one lease's timed steps.

    python3 benchmarks/gpu_decide.py --steps $OUT/decide_steps.json --check $OUT/attention_check.json \
        --out $OUT/decide                                                 (by benchmarks/gpu_lease.sh)

`--steps` is a `benchmarks/gpu_step.py` report with the JAX executor's steps timed in several
variants in one run (`--attention split pallas --projections separate fused`; weights
unquantized, layers unrolled), `--check` an `attention_check.py` report of the same device.
The baseline is the executor's default on a GPU (`split`, `separate`). A variant is a candidate
where it timed every step the baseline timed, and where its attention is not the split form,
where the check passed that form in every case of the steps' shape (finite, and within the
check's margins of the split form's errors against float32): an unchecked or failing kernel is
never chosen for its speed. Its score is the geometric mean, over the steps, of its step time
over the baseline's. The lowest score wins if it is at least `--margin` (default 3%) under 1;
otherwise the baseline stays.

Prints one line, `ATTENTION=<form> PROJECTIONS=<layout>`, which the lease's later parts take
(gpu.py `--attention` / `--projections`: the table measured in the chosen form), and writes
<out>.json and <out>.md with every variant's times, score and why it was or was not a
candidate. Imports neither JAX nor NumPy. Exit status 1, with one line on stderr and nothing on
stdout, where there is nothing to decide from (no steps report, or the baseline untimed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dlm_jax._integrity import atomic_write, atomic_write_json  # noqa: E402 (imports neither JAX nor NumPy)

BASELINE = ("split", "separate")


def form_passes(forms: dict[str, dict[str, Any]], name: str, margins: dict[str, float]) -> bool:
    """One `attention_check.py` case's form `name` against float32: finite, no error, and (a
    form other than split) its mean and largest errors within `margins` times the split form's."""
    row, base = forms.get(name), forms.get("split")
    if not row or "error" in row or not row.get("finite"):
        return False
    if name == "split":
        return True
    if not base or "error" in base:
        return False
    return (row["mean_error"] <= margins["mean"] * base["mean_error"]
            and row["max_error"] <= margins["max"] * base["max_error"])


def checked(check: dict[str, Any] | None, form: str, shape: str) -> str | None:
    """Why `form` may not be chosen at `shape` by the check (None: it passed every case there)."""
    if form == "split":
        return None
    if check is None:
        return "no attention check"
    cases = [c for c in check.get("cases", []) if c.get("shape") == shape and form in c.get("forms", {})]
    if not cases:
        return f"the attention check has no {shape} case of {form}"
    failed = [f"b{c['batch']} {c['kind']}" for c in cases if not form_passes(c["forms"], form, check["margins"])]
    return f"failed the attention check ({', '.join(failed)})" if failed else None


def decide(steps: dict[str, Any], check: dict[str, Any] | None, margin: float = 0.03) -> dict[str, Any]:
    """The decision: every variant's step times, score and standing, and the choice."""
    timed: dict[tuple[str, str], dict[str, float]] = {}
    errors: dict[tuple[str, str], str] = {}
    for c in steps.get("cases", []):
        if (c.get("quant") or "none") != "none" or (c.get("layers") or "unrolled") != "unrolled":
            continue  # (a case the executor refused names its layers None: the default)
        variant = (c.get("attention"), c.get("projections", "separate"))
        if c.get("step_ms") is not None:
            timed.setdefault(variant, {})[f"b{c['batch']} {c['kind']}"] = float(c["step_ms"])
        else:
            timed.setdefault(variant, {})
            errors.setdefault(variant, c.get("error") or "not timed")
    base = timed.get(BASELINE, {})
    out: dict[str, Any] = {"benchmark": "benchmarks/gpu_decide.py", "device": steps.get("device", {}),
                           "shape": steps.get("shape"), "steps_command": steps.get("command"),
                           "check": None if check is None else {"command": check.get("command"), "pass": check.get("pass"),
                                                                "margins": check.get("margins")},
                           "baseline": list(BASELINE), "margin": margin, "steps": sorted(base), "variants": []}
    if not base:
        out["choice"] = None
        out["reason"] = f"the baseline {'/'.join(BASELINE)} was not timed" + (
            f" ({errors[BASELINE]})" if BASELINE in errors else "")
        return out
    for variant in sorted(timed):
        ms = timed[variant]
        row: dict[str, Any] = {"attention": variant[0], "projections": variant[1], "step_ms": ms}
        missing = [s for s in base if s not in ms]
        why = (f"untimed: {', '.join(missing)}" + (f" ({errors[variant]})" if variant in errors else "")
               if missing else checked(check, variant[0], steps.get("shape", "")))
        if not missing:
            row["score"] = math.exp(sum(math.log(ms[s] / base[s]) for s in base) / len(base))
        row["candidate"] = why is None
        if why:
            row["why_not"] = why
        out["variants"].append(row)
    best = min((r for r in out["variants"] if r["candidate"]), key=lambda r: r["score"])
    won = best["score"] <= 1 - margin
    chosen = (best["attention"], best["projections"]) if won else BASELINE
    out["choice"] = {"attention": chosen[0], "projections": chosen[1]}
    out["reason"] = (f"{'/'.join(chosen)} takes {best['score']:.3f}x the baseline's step time "
                     f"(geometric mean over {len(base)} steps)" if won else
                     f"no candidate is {margin:.0%} faster than the baseline (the best, "
                     f"{best['attention']}/{best['projections']}, {best['score']:.3f}x)")
    return out


def markdown(d: dict[str, Any]) -> str:
    dev = d.get("device", {})
    lines = [f"# The GPU's attention form and projections: {dev.get('kind', '?')} ({dev.get('backend', '?')})", "",
             f"Steps: `{d.get('steps_command')}` ({d.get('shape')}); check: "
             + (f"`{d['check']['command']}`" if d.get("check") else "none") + ". Baseline "
             f"{'/'.join(d['baseline'])} (the executor's default on a GPU); a candidate must time every step and "
             f"(a form other than split) pass the attention check; it wins at a score (geometric mean of its step "
             f"times over the baseline's) of at most {1 - d['margin']:.2f}.", "",
             "| attention | projections | " + " | ".join(f"{s} ms" for s in d["steps"]) + " | score | candidate |",
             "|---|---|" + "---:|" * len(d["steps"]) + "---:|---|"]
    for r in d["variants"]:
        cells = " | ".join(f"{r['step_ms'][s]:.2f}" if s in r["step_ms"] else "-" for s in d["steps"])
        score = f"{r['score']:.3f}" if "score" in r else "-"
        lines.append(f"| {r['attention']} | {r['projections']} | {cells} | {score} | "
                     f"{'yes' if r['candidate'] else 'no: ' + r['why_not']} |")
    choice = d.get("choice")
    lines += ["", f"Choice: {choice['attention']} / {choice['projections']}: {d['reason']}." if choice
              else f"No choice: {d['reason']}.", ""]
    return "\n".join(lines)


def write(d: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_name(out.name + ".json"), d, indent=1)
    atomic_write(out.with_name(out.name + ".md"), markdown(d))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=Path, required=True, help="gpu_step.py's report of the variants, timed in one run")
    p.add_argument("--check", type=Path, help="attention_check.py's report of the same device")
    p.add_argument("--margin", type=float, default=0.03, help="how much faster than the baseline a variant must be")
    p.add_argument("--out", type=Path, required=True)
    return p


def _read(path: Path | None, what: str) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {what} {path}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    steps = _read(args.steps, "steps report")
    if steps is None:
        print(f"gpu_decide: no steps report at {args.steps}: nothing decided", file=sys.stderr)
        return 1
    d = decide(steps, _read(args.check, "attention check"), args.margin)
    write(d, args.out)
    if d["choice"] is None:
        print(f"gpu_decide: {d['reason']}: nothing decided", file=sys.stderr)
        return 1
    print(f"ATTENTION={d['choice']['attention']} PROJECTIONS={d['choice']['projections']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a GPU lease's later call still has to measure (`benchmarks/gpu_lease.sh`, `PARTS=rest`).

A device machine stays warm 30 s after a call, so the second call of a lease has to be one
fixed command: `PARTS=rest` runs what the calls before it on that machine left. Two questions,
answered from the files those calls left in `$WORK`, each printed for the script to read:

    python benchmarks/lease_rest.py parts STATE PART...   the PARTs (the script's order) still to run
    python benchmarks/lease_rest.py unmeasured REPORT      a gpu.py report's cases left unmeasured

STATE holds a line `CALL PART STATUS` for each part a call ran (`ok`: exit 0; `fail`, `skip`:
cut for time, `cut`: ended, but its budget skipped cases). A part is done when every line of
the last call that ran it says `ok`; a part no call ran is still to run. `unmeasured` prints
`DUAL_BATCHES="..." DUAL_QUANTS="..."` (every batch and quant mode that has a dlm-jax case with
no step time: skipped by `--budget-s`, or never reached by a worker that ended), or nothing when
every case was measured; a case that failed with an error is not tried again. Imports neither
JAX nor NumPy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

QUANT_ORDER = ("none", "int8", "int8-g128", "fp8")


def parts_left(state: str, parts: list[str]) -> list[str]:
    """The `parts`, in their order, that the last call to run each did not end with all `ok`."""
    last: dict[str, tuple[int, bool]] = {}
    for line in state.splitlines():
        fields = line.split()
        if len(fields) != 3 or not fields[0].isdigit():
            continue
        call, part, ok = int(fields[0]), fields[1], fields[2] == "ok"
        seen = last.get(part)
        if seen is None or call > seen[0]:
            last[part] = (call, ok)
        elif call == seen[0]:
            last[part] = (call, seen[1] and ok)
    return [p for p in parts if not last.get(p, (0, False))[1]]


def unmeasured(report: dict) -> tuple[list[int], list[str]]:
    """The batches and quant modes of `report`'s dlm-jax cases that hold no step time and no
    error (skipped by the budget, or not reached)."""
    batches, quants = set(), set()
    for case in report.get("cases", []):
        side = case.get("dlm_jax") or {}
        if side.get("median_step_seconds") is None and not side.get("error"):
            batches.add(int(case["batch"]))
            quants.add(case.get("quant") or "none")
    order = {q: i for i, q in enumerate(QUANT_ORDER)}
    return sorted(batches), sorted(quants, key=lambda q: (order.get(q, len(order)), q))


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "parts":
        path = Path(argv[1])
        print(" ".join(parts_left(path.read_text() if path.is_file() else "", argv[2:])))
        return 0
    if len(argv) == 2 and argv[0] == "unmeasured":
        try:
            report = json.loads(Path(argv[1]).read_text())
        except (OSError, ValueError) as e:
            print(f"error: {argv[1]}: {e}", file=sys.stderr)
            return 1
        batches, quants = unmeasured(report)
        if batches:
            print(f'DUAL_BATCHES="{" ".join(map(str, batches))}" DUAL_QUANTS="{" ".join(quants)}"')
        return 0
    print("usage: lease_rest.py parts STATE PART... | unmeasured REPORT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

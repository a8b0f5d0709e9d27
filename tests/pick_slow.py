"""Keep the default pass under its five minutes: move its longest tests to the slow pass.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider --durations=0 > durations.txt
    .venv/bin/python tests/pick_slow.py durations.txt

reads the `--durations=0` report of a default pass (two workers, empty caches), and adds to
tests/slow_by_time.txt every test whose setup, call and teardown took `--over` seconds or more
(default 2), except the tests named in KEEP (each feature's one end-to-end check stays in the
default pass) and the docs' blocks (their cost word, docs/development.md). tests/conftest.py
marks the listed tests `slow`; CI runs them in its slow pass. Lines already in the list stay (a
test earns its way back by a hand edit); the file is rewritten whole, through a temporary file.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import tempfile
from pathlib import Path

LIST = Path(__file__).with_name("slow_by_time.txt")

# Each feature's end-to-end check, kept in the default pass however long it takes.
KEEP = ("tests/test_docs.py::",  # the docs' blocks carry their own cost word
        "tests/frontends/test_server.py::test_openai_client_completions_and_chat",
        "tests/executors/test_runner.py::test_runner_decodes_exactly_like_jax",
        "tests/runtime/test_engine_invariance.py::test_requests_joining_a_running_batch",
        "tests/test_bfloat16.py::test_decodes_in_bfloat16_like_float32",
        "tests/training/test_shipped_models.py::test_shipped_model_answers_heldout_prompts[llada-tiny",
        "tests/training/test_step.py::test_one_step_equals_the_update_by_hand",
        "tests/runtime/test_reference_semantics.py::",
        "tests/runtime/test_warmup.py::test_no_compile_after_warmup",
        "tests/runtime/test_infill.py::test_infilled_requests_are_the_same_alone_and_batched",
        "tests/runtime/test_logprobs.py::test_left_to_right_logprobs_are_transformers",
        "tests/techniques/isd/test_isd.py::test_greedy_isd_emits_left_to_right_tokens_in_fewer_forwards",
        "tests/models/test_moe_dispatch.py::test_model_logits_equal_dense_experts",
        "tests/checkpoint/test_parity.py::",
        "tests/frontends/test_lmeval.py::test_causal_loglikelihood_is_the_exact_autoregressive_sum",
        # (its AutoRound checkpoint is made for the file's other default tests anyway)
        "tests/checkpoint/test_gptq_checkpoint.py::test_gptq_checkpoint_matches_autorounds_kernel[qwen3-4-16-True")

HEADER = """\
# Tests of the default pass that took 2 s or more on two cores from empty caches: they run in
# the slow pass only (tests/conftest.py marks them `slow`), so that the default pass stays
# under five minutes. Written by tests/pick_slow.py from a `--durations=0` report; seconds
# (setup + call + teardown, one worker), then the test's id. Delete a line to bring a test back.
"""

ROW = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(.+?)\s*$")


def read_durations(text: str) -> dict[str, float]:
    """Seconds per test id (setup, call and teardown summed) from pytest's --durations report."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            seconds[match.group(3)] += float(match.group(1))
    return dict(seconds)


def read_list(path: Path | None = None) -> dict[str, float]:
    """The listed test ids with their recorded seconds."""
    path = path or LIST
    listed: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                seconds, test = line.split(None, 1)
                listed[test.strip()] = float(seconds)
    return listed


def pick(seconds: dict[str, float], over: float) -> dict[str, float]:
    return {test: s for test, s in seconds.items() if s >= over and not test.startswith(KEEP)}


def write_list(listed: dict[str, float], path: Path | None = None) -> None:
    path = path or LIST
    rows = sorted(listed.items(), key=lambda item: (-item[1], item[0]))
    text = HEADER + "".join(f"{s:5.2f}  {test}\n" for test, s in rows)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("durations", type=Path, help="a default pass's --durations=0 report")
    parser.add_argument("--over", type=float, default=2.0, help="seconds at which a test moves (default 2)")
    args = parser.parse_args(argv)
    seconds = read_durations(args.durations.read_text())
    if not seconds:
        parser.error(f"{args.durations}: no --durations rows (run pytest with --durations=0)")
    listed = read_list()
    new = {test: s for test, s in pick(seconds, args.over).items() if test not in listed}
    write_list({**listed, **new})
    print(f"{len(new)} tests added ({sum(new.values()):.1f} s of one worker), {len(listed) + len(new)} listed")


if __name__ == "__main__":
    main()

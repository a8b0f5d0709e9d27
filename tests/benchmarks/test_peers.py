"""`benchmarks/peers.py` and `benchmarks/_llamacpp.py`: the sequence llama.cpp's block schedule
decodes, its output parsed as it prints it, and how the best settings are picked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _llamacpp  # noqa: E402
import peers  # noqa: E402

# What llama-diffusion-cli prints (log prefix, progress bar, timing line, then the text).
OUTPUT = ("0.00.021.882 I diffusion_params: - block_length              u32              = 32\n"
          "0.00.022.027 I diffusion step: 0/16 [          ] 0%0.00.570.624 I diffusion step: 15/16 [=====] 93%"
          "0.00.598.729 I \ntotal time: 577.87ms, time per step: 36.12ms, sampling time per step: 0.06ms\n"
          "0.00.598.884 I \n13 33 37\n")


def test_block_schedule_rounds_the_sequence_up_to_whole_blocks_counted_from_zero():
    shape = _llamacpp.RunShape(n_input=20, gen=64, block=32, steps_per_block=8)
    assert shape.max_length == 96  # 84 rounded up: blocks [20,52), [52,84), [84,96)
    assert shape.blocks == 3 and shape.steps == 24
    args = shape.args()
    assert args[args.index("-ub") + 1] == "96" and args[args.index("--diffusion-steps") + 1] == "24"
    assert "--diffusion-block-length" in args and "--diffusion-eps" not in args


def test_timestep_schedule_decodes_exactly_prompt_plus_generation():
    shape = _llamacpp.RunShape(n_input=20, gen=64, block=0, steps_per_block=64)
    assert (shape.max_length, shape.blocks, shape.steps) == (84, 1, 64)
    assert "--diffusion-eps" in shape.args() and "--diffusion-block-length" not in shape.args()


def test_output_is_parsed_past_the_log_prefixes():
    assert _llamacpp.parse_output(OUTPUT) == ("13 33 37", 577.87, 36.12)
    assert _llamacpp.parse_output(OUTPUT.split("total time")[0]) is None  # the lost-last-lines case


def _row(engine, setting, acc, s):
    return {"engine": engine, "setting": setting, "accuracy": acc, "mean_seconds": s}


def test_best_is_the_fastest_within_a_point_and_our_answer_may_not_fall_below_it():
    rows = [_row("llama.cpp", "a", 0.80, 2.0), _row("llama.cpp", "b", 0.795, 1.0), _row("llama.cpp", "c", 0.70, 0.1),
            _row("dlm-jax", "x", 0.79, 0.05), _row("dlm-jax", "y", 0.78, 0.01), _row("dlm-jax", "z", 0.81, 0.5)]
    peer = peers.best(rows, "llama.cpp")
    assert peer["setting"] == "b"  # 0.795 is within a point of 0.80; 0.70 is not
    assert peers.answer_to(rows, peer)["setting"] == "x"  # y is 1.5 points below b
    assert peers.best(rows, "fast-dllm") is None


@pytest.mark.slow
def test_end_to_end_on_the_tiny_model_writes_every_report(tmp_path):
    engines = ["dlm-jax"] + (["llama.cpp"] if _llamacpp.built_binary() else [])
    out = tmp_path / "peers"
    assert peers.main(["--model", str(ROOT / "models" / "llada-tiny"), "--n", "1", "--gen", "32", "--no-int8",
                       "--llama-quants", "q4_0", "--llama-steps", "4", "--same-n", "1", "--engines", *engines,
                       "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert {r["engine"] for r in result["settings"]} == set(engines)
    assert all(r["n"] == 3 for r in result["settings"])  # one prompt of each task
    assert out.with_suffix(".png").stat().st_size > 0 and "Every setting" in out.with_suffix(".md").read_text()

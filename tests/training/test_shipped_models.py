"""The reference checkpoints in models/: they load with `load_pretrained`, stay within the size
limit, carry a measured model card, and answer held-out task prompts well above chance
(`ar-tiny`, a purely autoregressive base at the chance floor, ships for R-ISD's lossless check
only: tests/techniques/isd/test_isd.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dlm_jax
from dlm_jax.runtime import decode_config
from dlm_jax.training.data import TASKS
from dlm_jax.training.evaluate import evaluate
from dlm_jax.training.ship import MAX_MB

MODELS = Path(__file__).resolve().parents[2] / "models"


# Size limits above dlm_jax.training.ship's default (`--max-mb`): llada-12m ships bfloat16 weights.
SIZE_LIMIT_MB = {"llada-12m": 26.0, "moe-tiny": 20.0}


@pytest.mark.parametrize("name, attention", [("llada-tiny", "bidirectional"), ("idlm-tiny", "causal"),
                                             ("llada-12m", "bidirectional"), ("ar-tiny", "causal"),
                                             ("moe-tiny", "bidirectional")])
def test_shipped_checkpoint_loads_and_has_a_card(name, attention):
    path = MODELS / name
    model = dlm_jax.load_pretrained(path)
    assert model.config.attention == attention
    assert model.config.logit_shift == (attention == "causal")
    assert model.config.param_dtype == "float32"  # whatever the storage dtype, it loads as float32
    assert all(v.dtype == "float32" for v in dlm_jax.get_params(model).values())
    assert sum(f.stat().st_size for f in path.iterdir()) <= SIZE_LIMIT_MB.get(name, MAX_MB) * 2**20
    card = (path / "README.md").read_text()
    for needle in ("dlm-jax train --config examples/configs/", "steps:", "wall time:", "final training loss:",
                   "Held-out accuracy"):
        assert needle in card, needle
    for task in TASKS.values():  # measured on the task sizes the generators have now
        assert f"`{task!r}`" in card, f"{name}'s card was measured on other sizes than {task!r}"
    evals = json.loads((path / "eval.json").read_text())
    for per_task in evals["results"].values():
        assert set(per_task) == set(TASKS)
    assert set(evals["chance"]) == set(TASKS) and "| chance:" in card


FAST = decode_config(gen_len=32, block_len=32)  # prefix cache + threshold 0.9
VANILLA = decode_config(gen_len=32, block_len=32, cache="none", rule="topk")  # a token per step
IN_ORDER = decode_config(gen_len=64, block_len=1, cache="none", rule="topk")  # left to right


@pytest.mark.parametrize("name, task, cfg, floor", [
    ("llada-tiny", "addition", FAST, 0.75), ("llada-tiny", "sorting", FAST, 0.75),
    ("llada-tiny", "gsm_lite", FAST, 0.25),  # 34% on the card's 100 prompts
    ("llada-12m", "sorting", FAST, 0.75),
    ("idlm-tiny", "addition", VANILLA, 0.75),
    pytest.param("idlm-tiny", "gsm_lite", IN_ORDER, 0.4, marks=pytest.mark.slow),  # 74% on the card's 100 prompts
    pytest.param("moe-tiny", "addition", FAST, 0.75, marks=pytest.mark.slow),  # 98% on the card's 50 prompts
])
def test_shipped_model_answers_heldout_prompts(name, task, cfg, floor):
    report = evaluate(dlm_jax.load(MODELS / name), task, cfg, n=16, progress=False)
    # Chance (one fixed answer for every prompt) is 1-6%: see the cards' chance rows.
    assert report["accuracy"] >= floor

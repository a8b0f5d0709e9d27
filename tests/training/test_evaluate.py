"""The chance floor that model cards report beside measured accuracy."""

from __future__ import annotations

from collections import Counter

from dlm_jax.training.data import TASKS, make_split, final_result
from dlm_jax.training.evaluate import chance_accuracy


def test_chance_is_the_most_frequent_final_answer():
    examples = make_split(TASKS["gsm_lite"], 200, split="heldout")
    top = Counter(final_result(ex.answer) for ex in examples).most_common(1)[0][1]
    assert chance_accuracy("gsm_lite", n=200) == top / 200
    assert chance_accuracy("gsm_lite", n=200) >= 0.03  # small running totals repeat: not ~0


def test_chance_is_small_for_exact_lists_and_sums():
    assert chance_accuracy("sorting", n=200) <= 0.02
    assert chance_accuracy("addition", n=200) <= 0.05

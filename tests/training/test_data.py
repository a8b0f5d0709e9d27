"""training/data.py: seeded verifiable tasks, disjoint splits, code corpus, encoding, batches."""

import json
import re

import numpy as np
import pytest

from dlm_jax import ByteTokenizer
from dlm_jax.training.data import (HELDOUT_FRACTION, MAX_ANSWER_CHARS, MAX_PROMPT_CHARS, TASKS, AdditionTask,
                           LengthBuckets,
                           Batches, Example, GsmLiteTask, SortingTask, code_corpus, count_carries,
                           encode_sft, is_heldout, make_split, mix, final_result, pack_corpus)

TOK = ByteTokenizer()
NAMES = sorted(TASKS)


def _samples(task, n, seed=0):
    rng = np.random.default_rng(seed)
    return [task.sample(rng) for _ in range(n)]


def _corrupt(ex: Example) -> str:
    """A wrong answer of the same shape."""
    if ex.task == "sorting":
        values = [int(t) for t in ex.answer.split()]
        values[-1] += 1  # the list is no longer the sorted input
        return " ".join(map(str, values))
    if ex.task == "gsm_lite":
        return re.sub(r"=(\d+)$", lambda m: f"={int(m.group(1)) + 1}", ex.answer)  # the last result
    return ex.answer[:-1] + str((int(ex.answer[-1]) + 1) % 10)


def test_default_tasks():
    assert isinstance(TASKS["addition"], AdditionTask)
    assert isinstance(TASKS["sorting"], SortingTask)
    assert isinstance(TASKS["gsm_lite"], GsmLiteTask)
    assert all(TASKS[k].name == k for k in TASKS)


@pytest.mark.parametrize("name", NAMES)
def test_sampling_is_deterministic(name):
    task = TASKS[name]
    assert _samples(task, 50, seed=1) == _samples(task, 50, seed=1)
    assert _samples(task, 50, seed=1) != _samples(task, 50, seed=2)
    assert make_split(task, 30, split="train", seed=3) == make_split(task, 30, split="train", seed=3)
    assert make_split(task, 30, split="train", seed=3) != make_split(task, 30, split="train", seed=4)


@pytest.mark.parametrize("name", NAMES)
def test_scores_own_answer_and_rejects_corruption(name):
    task = TASKS[name]
    for ex in _samples(task, 500):
        assert ex.task == name
        assert len(ex.prompt) <= MAX_PROMPT_CHARS and len(ex.answer) <= MAX_ANSWER_CHARS, ex
        assert task.score(ex.answer, ex), ex
        assert task.score(" " + ex.answer + "\nand some trailing text 123", ex), ex
        assert not task.score(_corrupt(ex), ex), ex
        assert not task.score("", ex)


def test_score_parsing_details():
    add = TASKS["addition"]
    ex = Example("addition", "48213+97345=", "145558")
    assert add.score("145558", ex) and add.score("Answer: 145558.", ex) and add.score("145558 done", ex)
    assert not add.score("1455589", ex) and not add.score("14555", ex)
    srt = TASKS["sorting"]
    ex = Example("sorting", "sort: 42 7 19 88 3", "3 7 19 42 88")
    assert srt.score("3 7 19 42 88\nsort: 1 2", ex) and srt.score("3, 7, 19, 42, 88", ex)
    assert not srt.score("3 7 19 42 88 90", ex) and not srt.score("3 7 19 42", ex)
    gsm = TASKS["gsm_lite"]
    ex = Example("gsm_lite", "...", "12+5=17, -3=14")
    assert gsm.score("12+5=17, -3=14", ex) and gsm.score("12+5=18, -3= 14.", ex)  # the last result counts
    assert not gsm.score("14", ex) and not gsm.score("12+5=17, -3=140", ex)
    assert not gsm.score("12+5=17, -3=14, +1=15", ex)  # a step too many
    assert final_result("1+2=3, *2=6") == 6 and final_result("no working") is None


def test_addition_carry_bias():
    task = AdditionTask(min_digits=2, max_digits=4, hard_fraction=0.85, min_carries=2, same_length=False)
    carries, lengths = [], set()
    for ex in _samples(task, 2000):
        a, b = map(int, ex.prompt.rstrip("=").split("+"))
        assert ex.prompt == f"{a}+{b}=" and int(ex.answer) == a + b
        assert 2 <= len(str(a)) <= 4 and 2 <= len(str(b)) <= 4
        carries.append(count_carries(a, b))
        lengths.add((len(str(a)), len(str(b))))
    assert np.mean(np.array(carries) >= 2) >= 0.85  # unbiased sampling gives ~0.63
    assert len(lengths) == 9  # operands of different lengths are drawn independently
    assert count_carries(48213, 97345) == 2 and count_carries(100, 200) == 0 and count_carries(999, 1) == 3


def test_default_addition_operands_line_up():
    task, carries, digits = TASKS["addition"], [], set()
    for ex in _samples(task, 1000):
        a, b = map(int, ex.prompt.rstrip("=").split("+"))
        assert len(str(a)) == len(str(b)) and int(ex.answer) == a + b
        digits.add(len(str(a)))
        carries.append(count_carries(a, b))
    assert digits == set(range(task.min_digits, task.max_digits + 1))
    assert np.mean(np.array(carries) >= 1) >= 0.8


def test_sorting_answers():
    task = TASKS["sorting"]
    lengths = set()
    for ex in _samples(task, 1000):
        assert ex.prompt.startswith("sort: ")
        given = [int(t) for t in ex.prompt[len("sort: "):].split()]
        answer = [int(t) for t in ex.answer.split()]
        assert task.min_len <= len(given) <= task.max_len and all(0 <= v <= task.max_value for v in given)
        lengths.add(len(given))
        assert answer == sorted(answer) and sorted(given) == sorted(answer)
    assert lengths == set(range(task.min_len, task.max_len + 1))


def test_gsm_lite_working_is_consistent():
    """A running total: the first step restates the start, later ones start from the previous
    result; every result is written once and the last one is the answer."""
    step = re.compile(r"(\d*)([+*-])(\d+)=(\d+)")
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    seen_ops = set()
    for ex in _samples(TASKS["gsm_lite"], 1000):
        assert ex.prompt.endswith("?")
        steps = ex.answer.split(", ")
        assert 2 <= len(steps) <= 4, ex
        start = int(re.match(r"\w+ has (\d+) ", ex.prompt).group(1))
        assert 2 <= start <= 20, ex
        value = start
        for i, s in enumerate(steps):
            m = step.fullmatch(s)
            assert m, (s, ex)
            assert m.group(1) == (str(start) if i == 0 else ""), ex
            op, b, c = m.group(2), int(m.group(3)), int(m.group(4))
            assert ops[op](value, b) == c and 0 <= c < 1000, ex
            assert str(b) in ex.prompt or op == "*", ex
            seen_ops.add(op)
            value = c
        assert final_result(ex.answer) == value
    assert seen_ops == {"+", "-", "*"}


@pytest.mark.parametrize("name", NAMES)
def test_splits_are_disjoint(name):
    task = TASKS[name]
    train = make_split(task, 2000, split="train", seed=0)
    held = make_split(task, 200, split="heldout", seed=0)
    assert len(train) == 2000 and len(held) == 200
    train_prompts, held_prompts = {e.prompt for e in train}, {e.prompt for e in held}
    assert len(train_prompts) == 2000 and len(held_prompts) == 200  # distinct within a split
    assert not train_prompts & held_prompts
    assert all(is_heldout(p) for p in held_prompts) and not any(is_heldout(p) for p in train_prompts)
    # a different seed's held-out set still never meets this train set
    assert not train_prompts & {e.prompt for e in make_split(task, 200, split="heldout", seed=1)}


def test_heldout_fraction():
    for name in NAMES:
        frac = np.mean([is_heldout(e.prompt) for e in _samples(TASKS[name], 5000, seed=7)])
        assert abs(frac - HELDOUT_FRACTION) < 0.025, (name, frac)
    assert is_heldout("48213+97345=") == is_heldout("48213+97345=")


def test_split_errors():
    tiny = SortingTask(min_len=1, max_len=1, max_value=9)  # 10 prompts in all
    with pytest.raises(RuntimeError, match="too small"):
        make_split(tiny, 5, split="heldout")
    with pytest.raises(ValueError, match="split"):
        make_split(TASKS["addition"], 5, split="test")


def test_code_corpus():
    text = code_corpus(200_000, seed=0)
    assert 200_000 - 4 < len(text.encode("utf-8")) <= 200_000
    assert text.startswith("# ==== ") and "def " in text and "import " in text
    assert text == code_corpus(200_000, seed=0)
    assert text != code_corpus(200_000, seed=1)
    headers = re.findall(r"^# ==== (.*) ====$", text, flags=re.M)
    assert len(headers) >= 2
    assert not any(part in {"test", "tests", "idlelib", "lib2to3", "site-packages"}
                   for h in headers for part in h.split("/")[:-1])
    with pytest.raises(ValueError):
        code_corpus(0)


def test_code_corpus_missing_stdlib(monkeypatch, tmp_path):
    import sysconfig
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(RuntimeError, match="no Python source"):
        code_corpus(1000)


def test_encode_sft_layout():
    examples = [Example("t", "1+2=", "3"), Example("t", "sort: 3 1", "1 3")]
    out = encode_sft(TOK, examples, 24)
    assert set(out) == {"tokens", "prompt_mask", "response_mask"}
    assert out["tokens"].shape == (2, 24) and out["tokens"].dtype == np.int32
    assert out["prompt_mask"].dtype == bool and (out["response_mask"] == ~out["prompt_mask"]).all()
    for row, ex in enumerate(examples):
        p = TOK.apply_chat([{"role": "user", "content": ex.prompt}])
        a = TOK.encode(ex.answer)
        toks = out["tokens"][row]
        assert list(toks[:len(p)]) == p
        assert list(toks[len(p):len(p) + len(a)]) == a
        assert (toks[len(p) + len(a):] == TOK.eos_id).all()
        assert out["prompt_mask"][row, :len(p)].all() and not out["prompt_mask"][row, len(p):].any()
    assert TOK.decode(out["tokens"][1], skip_special=True) == "sort: 3 11 3"


def test_encode_sft_overflow():
    ex = Example("t", "1+2=", "3")
    need = len(TOK.apply_chat([{"role": "user", "content": "1+2="}])) + 1 + 1
    encode_sft(TOK, [ex], need)  # exactly fits: one EOS
    with pytest.raises(ValueError, match=r"example 1 .*do not fit seq_len=" + str(need - 1)):
        encode_sft(TOK, [Example("t", "1", "2"), ex], need - 1)


@pytest.mark.parametrize("name", NAMES)
def test_encode_task_examples(name):
    out = encode_sft(TOK, make_split(TASKS[name], 100, split="train"), 256)
    assert out["tokens"].shape == (100, 256) and (out["tokens"][:, -1] == TOK.eos_id).all()


def test_pack_corpus():
    text = "abc\n" * 30_000  # 120_000 bytes, more than one encoding chunk
    rows = pack_corpus(TOK, text, 64)
    assert rows.shape == (120_000 // 64, 64) and rows.dtype == np.int32
    assert TOK.decode(rows.reshape(-1)) == text[:rows.size]
    with pytest.raises(ValueError, match="fewer than one row"):
        pack_corpus(TOK, "short", 64)


def test_batches_resume():
    n = 53
    arrays = {"tokens": np.arange(n * 4, dtype=np.int32).reshape(n, 4), "flag": np.arange(n) % 2 == 0}
    ref = Batches(arrays, 8, seed=5)
    expected = [next(ref) for _ in range(20)]  # 6 batches per epoch: crosses epochs
    assert all(b["tokens"].shape == (8, 4) and b["flag"].shape == (8,) for b in expected)
    first_epoch = np.concatenate([b["tokens"][:, 0] for b in expected[:6]]) // 4
    assert len(set(first_epoch.tolist())) == 48  # no row twice within an epoch
    assert not np.array_equal(first_epoch, np.arange(48))  # shuffled
    for k in (0, 3, 6, 11):
        it = Batches(arrays, 8, seed=5)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(it.state()))
        resumed = Batches.restore(arrays, 8, state)
        for want in expected[k:]:
            got = next(resumed)
            assert all(np.array_equal(got[key], want[key]) for key in arrays)
    other = Batches(arrays, 8, seed=6)
    assert not np.array_equal(next(other)["tokens"], expected[0]["tokens"])
    with pytest.raises(ValueError):
        Batches.restore(arrays, 4, ref.state())


def test_mix_proportions():
    seq = 16
    a = encode_sft(TOK, make_split(TASKS["addition"], 50, split="train"), seq + 16)
    a = {k: v[:, :seq] for k, v in a.items()}
    corpus = np.full((40, seq), 7, np.int32)
    sort = encode_sft(TOK, [Example("sorting", "s", "1")] * 5, seq)
    sort["tokens"][:] = 9
    out = mix({"add": a, "code": corpus, "sort": sort}, {"add": 0.5, "code": 0.3, "sort": 0.2}, 1000, seed=0)
    assert set(out) == {"tokens", "prompt_mask", "response_mask"}
    assert all(v.shape == (1000, seq) for v in out.values())
    is_code = (out["tokens"] == 7).all(axis=1)
    is_sort = (out["tokens"] == 9).all(axis=1)
    assert abs(is_code.mean() - 0.3) < 0.03 and abs(is_sort.mean() - 0.2) < 0.03
    assert abs((~is_code & ~is_sort).mean() - 0.5) < 0.03
    assert not out["prompt_mask"][is_code].any() and out["response_mask"][is_code].all()
    assert out["prompt_mask"][~is_code & ~is_sort].any(axis=1).all()
    assert not is_code[:300].all() and is_code[:300].any()  # rows are shuffled together
    again = mix({"add": a, "code": corpus, "sort": sort}, {"add": 0.5, "code": 0.3, "sort": 0.2}, 1000, seed=0)
    assert all(np.array_equal(out[k], again[k]) for k in out)
    with pytest.raises(ValueError):
        mix({"add": a}, {"code": 1.0}, 10, seed=0)
    with pytest.raises(ValueError):
        mix({"add": a, "x": np.zeros((3, seq + 1), np.int32)}, {"add": 1.0, "x": 1.0}, 10, seed=0)


def _bucket_sets():
    sets = {name: encode_sft(TOK, make_split(TASKS[name], 64, split="train"), 256)
            for name in ("addition", "sorting", "gsm_lite")}
    return sets


def test_length_buckets_cut_only_eos_fill_and_resume():
    sets = _bucket_sets()
    weights = {"addition": 1.0, "sorting": 1.0, "gsm_lite": 1.0}
    lb = LengthBuckets(sets, weights, (32, 64, 128, 256), 1024, seed=3, long_tail_prob=0.3,
                       eos_id=TOK.eos_id, multiple_of=2)
    assert lb.home == {"addition": 0, "sorting": 1, "gsm_lite": 3}
    assert sorted(lb.shapes()) == [(4, 256), (8, 128), (16, 64), (32, 32)]
    seen = set()
    first = [next(lb) for _ in range(60)]
    for batch in first:
        rows, length = batch["tokens"].shape
        assert rows * length == 1024 and rows % 2 == 0
        seen.add(length)
    assert seen == {32, 64, 128, 256}
    # Rows are exact prefixes of encoded rows, every one ends in EOS fill.
    for batch in first:
        assert (batch["tokens"][:, -1] == TOK.eos_id).all()
        assert not batch["prompt_mask"][:, -1].any()
    state = lb.state()
    after = [next(lb) for _ in range(5)]
    again = LengthBuckets(sets, weights, (32, 64, 128, 256), 1024, seed=3, long_tail_prob=0.3,
                          eos_id=TOK.eos_id, multiple_of=2).restore(state)
    for a, b in zip(after, [next(again) for _ in range(5)]):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="seed"):
        LengthBuckets(sets, weights, (32, 64, 128, 256), 1024, seed=4, eos_id=TOK.eos_id).restore(state)


def test_length_buckets_without_long_tail_use_home_bucket():
    sets = _bucket_sets()
    lb = LengthBuckets(sets, {"addition": 1.0, "sorting": 0.0, "gsm_lite": 0.0}, (32, 64, 128, 256),
                       1024, seed=0, eos_id=TOK.eos_id)
    for _ in range(10):
        b = next(lb)
        assert b["tokens"].shape == (32, 32)
        full = sets["addition"]["tokens"]
        # each row is the first 32 tokens of an encoded addition row
        assert all(any(np.array_equal(r, f[:32]) for f in full) for r in b["tokens"][:4])


@pytest.mark.parametrize("kwargs, match", [
    (dict(buckets=(64, 32, 256)), "strictly increasing"),
    (dict(buckets=(32, 64, 128)), "longest bucket 128"),
    (dict(tokens=1000), "whole number of rows"),
    (dict(long_tail_prob=1.5), "long_tail_prob"),
])
def test_length_buckets_bad_input(kwargs, match):
    sets = _bucket_sets()
    with pytest.raises(ValueError, match=match):
        LengthBuckets(sets, {k: 1.0 for k in sets}, kwargs.get("buckets", (32, 64, 128, 256)),
                      kwargs.get("tokens", 1024), seed=0, eos_id=TOK.eos_id,
                      long_tail_prob=kwargs.get("long_tail_prob", 0.0))


@pytest.mark.parametrize("make, match", [
    (lambda: AdditionTask(min_digits=3, max_digits=2), "min_digits"),
    (lambda: SortingTask(max_len=40), "longer than"),
    (lambda: GsmLiteTask(max_steps=5), "max_steps"),
    (lambda: GsmLiteTask(max_start=1), "max_start"),
])
def test_task_sizes_are_checked(make, match):
    with pytest.raises(ValueError, match=match):
        make()

"""Training data: seeded task generators with verifiable answers, disjoint train / held-out
splits, a Python code corpus from the standard library, and tokenised, resumable batches.

NumPy and the standard library only (no JAX), so data preparation runs anywhere.

    task = TASKS["addition"]
    train = make_split(task, 2000, split="train", seed=0)
    sft = encode_sft(tokenizer, train, seq_len=96)            # tokens, prompt_mask, response_mask
    code = pack_corpus(tokenizer, code_corpus(1_000_000), 96)  # [N, 96] int32
    data = mix({"addition": sft, "code": code}, {"addition": 0.7, "code": 0.3}, 10_000, seed=0)
    for batch in Batches(data, 32, seed=0): ...                # state() / Batches.restore(...)

Tasks keep every prompt <= 120 characters and every answer <= 60 characters, so prompt +
answer fit a few hundred byte-level tokens.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

MAX_PROMPT_CHARS = 120
MAX_ANSWER_CHARS = 60
HELDOUT_FRACTION = 0.1


@dataclass(frozen=True)
class Example:
    """One supervised example: `answer` is the full target text (no EOS)."""

    task: str
    prompt: str
    answer: str


class Task(Protocol):
    name: str

    def sample(self, rng: np.random.Generator) -> Example: ...

    def score(self, completion: str, example: Example) -> bool: ...


# ----------------------------------------------------------------------------------------------
# Answer parsing

_RESULT_RE = re.compile(r"=\s*(-?\d+)")
_LEADING_INT_RE = re.compile(r"\s*(-?\d+)")
_LEADING_INTS_RE = re.compile(r"\s*(\d+(?:[ \t,]+\d+)*)")


def _after_answer_tag(text: str) -> str:
    """The text after the first "Answer:" if there is one, else the whole text."""
    i = text.find("Answer:")
    return text[i + len("Answer:"):] if i >= 0 else text


def _leading_int(text: str) -> int | None:
    m = _LEADING_INT_RE.match(_after_answer_tag(text))
    return int(m.group(1)) if m else None


def _leading_ints(text: str) -> list[int] | None:
    m = _LEADING_INTS_RE.match(_after_answer_tag(text))
    return [int(t) for t in re.split(r"[ \t,]+", m.group(1))] if m else None


def final_result(text: str) -> int | None:
    """The integer after the last "=" in `text` (a GSM-lite working's last result), or None."""
    found = _RESULT_RE.findall(text)
    return int(found[-1]) if found else None


# ----------------------------------------------------------------------------------------------
# Tasks


def count_carries(a: int, b: int) -> int:
    """Number of carries when adding non-negative `a` and `b` in base 10."""
    carries = carry = 0
    while a or b:
        carry = 1 if a % 10 + b % 10 + carry >= 10 else 0
        carries += carry
        a //= 10
        b //= 10
    return carries


@dataclass(frozen=True)
class AdditionTask:
    """`"482+973="` -> `"1455"`. With probability `hard_fraction` an example is redrawn (up to 64
    times) until it has at least `min_carries` carries, so carry chains dominate. With
    `same_length` both operands have the same number of digits (digits line up at fixed offsets)."""

    min_digits: int = 2
    max_digits: int = 3
    hard_fraction: float = 0.5
    min_carries: int = 1
    same_length: bool = True
    name: str = "addition"

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if 2 * self.max_digits + 2 > MAX_PROMPT_CHARS:
            raise ValueError(f"max_digits={self.max_digits} makes prompts longer than {MAX_PROMPT_CHARS} chars")

    def _digits(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.min_digits, self.max_digits + 1))

    @staticmethod
    def _number(rng: np.random.Generator, digits: int) -> int:
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return int(rng.integers(low, 10 ** digits))

    def sample(self, rng: np.random.Generator) -> Example:
        hard = bool(rng.random() < self.hard_fraction)
        for _ in range(64):
            digits = self._digits(rng)
            a = self._number(rng, digits)
            b = self._number(rng, digits if self.same_length else self._digits(rng))
            if not hard or count_carries(a, b) >= self.min_carries:
                break
        return Example(self.name, f"{a}+{b}=", str(a + b))

    def score(self, completion: str, example: Example) -> bool:
        return _leading_int(completion) == int(example.answer)


@dataclass(frozen=True)
class SortingTask:
    """`"sort: 12 7 19 3"` -> `"3 7 12 19"` (ascending; duplicates allowed)."""

    min_len: int = 3
    max_len: int = 7
    max_value: int = 50
    name: str = "sorting"

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len or self.max_value < 0:
            raise ValueError(f"bad SortingTask sizes: {self}")
        width = len(str(self.max_value)) + 1
        if len("sort:") + self.max_len * width > MAX_PROMPT_CHARS:
            raise ValueError(f"{self} makes prompts longer than {MAX_PROMPT_CHARS} chars")
        if self.max_len * width - 1 > MAX_ANSWER_CHARS:
            raise ValueError(f"{self} makes answers longer than {MAX_ANSWER_CHARS} chars")

    def sample(self, rng: np.random.Generator) -> Example:
        n = int(rng.integers(self.min_len, self.max_len + 1))
        values = [int(v) for v in rng.integers(0, self.max_value + 1, size=n)]
        return Example(self.name, "sort: " + " ".join(map(str, values)),
                       " ".join(map(str, sorted(values))))

    def score(self, completion: str, example: Example) -> bool:
        return _leading_ints(completion) == [int(t) for t in example.answer.split()]


# (name, subject pronoun, object pronoun, possessive)
_PEOPLE = (("Ana", "She", "her", "her"), ("Ben", "He", "him", "his"), ("Cara", "She", "her", "her"),
           ("Dev", "He", "him", "his"), ("Eve", "She", "her", "her"), ("Finn", "He", "him", "his"),
           ("Gia", "She", "her", "her"), ("Hugo", "He", "him", "his"), ("Ivy", "She", "her", "her"),
           ("Jay", "He", "him", "his"), ("Kim", "She", "her", "her"), ("Leo", "He", "him", "his"),
           ("Mia", "She", "her", "her"), ("Omar", "He", "him", "his"), ("Pia", "She", "her", "her"),
           ("Raj", "He", "him", "his"), ("Sam", "He", "him", "his"), ("Tia", "She", "her", "her"),
           ("Uma", "She", "her", "her"), ("Zed", "He", "him", "his"))
_OBJECTS = ("pens", "apples", "books", "coins", "cards", "eggs", "shells", "stamps", "rocks",
            "balls", "cups", "pears", "toys", "beads", "keys", "plums", "marbles", "stickers")
# (operation, template); {P} subject pronoun, {O} another person, {b} the operand.
_ADD_TEMPLATES = ("{P} buys {b} more.", "{P} finds {b} more.", "{O} gives {o} {b} more.",
                  "{P} gets {b} more.", "{P} wins {b} more.")
_SUB_TEMPLATES = ("{P} gives {b} to {O}.", "{P} loses {b}.", "{P} sells {b}.",
                  "{P} gives away {b}.")
_MUL_TEMPLATES = {2: "{P} doubles {p} {obj}.", 3: "{P} triples {p} {obj}."}


@dataclass(frozen=True)
class GsmLiteTask:
    """Templated multi-step word problems with small non-negative integers (< 1000).

    "Ana has 12 pens. She buys 5 more. She gives 3 to Ben. How many pens does Ana have now?"
    -> "12+5=17, -3=14". The working keeps a running total: each step starts from the previous
    result without restating it, so every intermediate result is written exactly once (a masked
    result can only be worked out, never copied from elsewhere in the answer), and the answer is
    the last result. Scored by the integer after the last "=".
    """

    min_steps: int = 2
    max_steps: int = 4
    max_operand: int = 9
    max_start: int = 20
    name: str = "gsm_lite"

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps <= 4:
            raise ValueError(f"need 1 <= min_steps <= max_steps <= 4, got {self.min_steps}, {self.max_steps}")
        if not 1 <= self.max_operand <= 99:
            raise ValueError(f"max_operand must be in [1, 99], got {self.max_operand}")
        if not 2 <= self.max_start <= 99:
            raise ValueError(f"max_start must be in [2, 99], got {self.max_start}")

    def _attempt(self, rng: np.random.Generator) -> Example:
        pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
        name, subj, obj_pron, poss = pick(_PEOPLE)
        others = [p[0] for p in _PEOPLE if p[0] != name]
        obj = pick(_OBJECTS)
        cur = int(rng.integers(2, self.max_start + 1))
        sentences = [f"{name} has {cur} {obj}."]
        working: list[str] = []
        for _ in range(int(rng.integers(self.min_steps, self.max_steps + 1))):
            ops = ["add"] * 3
            if cur >= 2:
                ops += ["sub"] * 3
            if cur * 2 < 1000 and cur <= 60:
                ops.append("mul")
            op = pick(ops)
            fields = {"P": subj, "o": obj_pron, "p": poss, "obj": obj, "O": pick(others)}
            if op == "add":
                b = int(rng.integers(1, self.max_operand + 1))
                new, sym, template = cur + b, "+", pick(_ADD_TEMPLATES)
            elif op == "sub":
                b = int(rng.integers(1, min(cur - 1, self.max_operand) + 1))
                new, sym, template = cur - b, "-", pick(_SUB_TEMPLATES)
            else:
                b = 3 if cur * 3 < 1000 and cur <= 30 and rng.random() < 0.3 else 2
                new, sym, template = cur * b, "*", _MUL_TEMPLATES[b]
            sentences.append(template.format(b=b, **fields))
            working.append(f"{cur if not working else ''}{sym}{b}={new}")
            cur = new
        question = f"How many {obj} does {name} have now?"
        prompt = " ".join([*sentences, question])
        if len(prompt) > MAX_PROMPT_CHARS:
            prompt = " ".join([*sentences, "How many now?"])
        return Example(self.name, prompt, ", ".join(working))

    def sample(self, rng: np.random.Generator) -> Example:
        for _ in range(100):
            ex = self._attempt(rng)
            if len(ex.prompt) <= MAX_PROMPT_CHARS and len(ex.answer) <= MAX_ANSWER_CHARS:
                return ex
        raise RuntimeError(f"{self}: no example within {MAX_PROMPT_CHARS}/{MAX_ANSWER_CHARS} chars "
                           f"after 100 attempts")

    def score(self, completion: str, example: Example) -> bool:
        got = final_result(completion)
        return got is not None and got == final_result(example.answer)


TASKS: dict[str, Task] = {"addition": AdditionTask(), "sorting": SortingTask(), "gsm_lite": GsmLiteTask()}


def task_settings(names: Iterable[str] | None = None) -> dict[str, str]:
    """The default generators' sizes by task name (their reprs), for model cards and results."""
    return {name: repr(TASKS[name]) for name in (TASKS if names is None else names)}


# ----------------------------------------------------------------------------------------------
# Splits


def is_heldout(prompt: str) -> bool:
    """Stable split membership: blake2b of the prompt falls in the bottom HELDOUT_FRACTION."""
    h = int.from_bytes(hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest(), "big")
    return h < int(HELDOUT_FRACTION * 2 ** 64)


def make_split(task: Task, n: int, *, split: Literal["train", "heldout"], seed: int = 0) -> list[Example]:
    """`n` distinct-prompt examples of `split`. Train and held-out are disjoint by construction
    (membership is a hash of the prompt), and the result is a function of (task, n, split, seed)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    want_heldout = split == "heldout"
    rng = np.random.default_rng([seed, int(want_heldout), zlib.crc32(task.name.encode("utf-8"))])
    max_attempts = 100 * n + 1000
    seen: set[str] = set()
    out: list[Example] = []
    attempts = 0
    while len(out) < n:
        if attempts >= max_attempts:
            raise RuntimeError(f"make_split({task.name!r}, n={n}, split={split!r}): only {len(out)} "
                               f"distinct {split} examples after {max_attempts} draws; the task's "
                               f"example space is too small for this n")
        attempts += 1
        ex = task.sample(rng)
        if ex.prompt in seen or is_heldout(ex.prompt) != want_heldout:
            continue
        seen.add(ex.prompt)
        out.append(ex)
    return out


# ----------------------------------------------------------------------------------------------
# Code corpus

_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages",
                            "__pycache__", "lib2to3"})


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def code_corpus(max_bytes: int = 2_000_000, *, seed: int = 0) -> str:
    """Python source from the standard library: files sorted, shuffled with `seed`, each preceded
    by a `# ==== path ====` line, concatenated and cut to at most `max_bytes` UTF-8 bytes."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_sources()
    if not files:
        raise RuntimeError(f"no Python source files found under the standard library at {root}")
    order = np.random.default_rng(seed).permutation(len(files))
    parts: list[bytes] = []
    total = 0
    for i in order:
        path = files[int(i)]
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not source.strip():
            continue
        if not source.endswith("\n"):
            source += "\n"
        chunk = f"# ==== {path.relative_to(root).as_posix()} ====\n{source}".encode("utf-8")
        parts.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    if not parts:
        raise RuntimeError(f"no readable Python source files under {root}")
    return b"".join(parts)[:max_bytes].decode("utf-8", errors="ignore")


# ----------------------------------------------------------------------------------------------
# Tokenisation


def encode_sft(tokenizer: Any, examples: Sequence[Example], seq_len: int) -> dict[str, np.ndarray]:
    """Rows of chat-formatted prompt, answer, then EOS to the end (the EOS fill is part of the
    response, LLaDA-style). Returns `tokens` [N, seq_len] int32, `prompt_mask` and
    `response_mask` [N, seq_len] bool (complementary)."""
    if tokenizer.eos_id is None:
        raise ValueError("the tokenizer has no EOS token")
    tokens = np.full((len(examples), seq_len), tokenizer.eos_id, np.int32)
    prompt_mask = np.zeros((len(examples), seq_len), bool)
    for i, ex in enumerate(examples):
        p = tokenizer.apply_chat([{"role": "user", "content": ex.prompt}])
        a = tokenizer.encode(ex.answer)
        if len(p) + len(a) + 1 > seq_len:
            raise ValueError(f"example {i} ({ex.task}): prompt {len(p)} + answer {len(a)} + 1 EOS "
                             f"= {len(p) + len(a) + 1} tokens do not fit seq_len={seq_len}")
        tokens[i, :len(p)] = p
        tokens[i, len(p):len(p) + len(a)] = a
        prompt_mask[i, :len(p)] = True
    return {"tokens": tokens, "prompt_mask": prompt_mask, "response_mask": ~prompt_mask}


def _chunks(text: str, size: int = 1 << 16) -> Iterator[str]:
    """Pieces of about `size` chars, cut after a newline where possible (special-token strings
    never contain one, so they are never split)."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            nl = text.rfind("\n", start, end)
            if nl >= start:
                end = nl + 1
        yield text[start:end]
        start = end


def pack_corpus(tokenizer: Any, text: str, seq_len: int) -> np.ndarray:
    """`text` encoded (in chunks) and cut into consecutive [N, seq_len] int32 rows; the remainder
    is dropped. Every token is response (no prompt)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    ids = np.concatenate([np.asarray(tokenizer.encode(c), np.int32) for c in _chunks(text)] or
                         [np.zeros(0, np.int32)])
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"text encodes to {len(ids)} tokens, fewer than one row of seq_len={seq_len}")
    return ids[:n * seq_len].reshape(n, seq_len)


# ----------------------------------------------------------------------------------------------
# Batches and mixtures


class Batches:
    """Endless, deterministic, resumable batches: each epoch visits the rows in a permutation
    seeded by (seed, epoch); the last partial batch of an epoch is dropped."""

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, *, seed: int,
                 epoch: int = 0, position: int = 0):
        if not arrays:
            raise ValueError("Batches needs at least one array")
        sizes = {k: len(v) for k, v in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"arrays differ in their number of rows: {sizes}")
        self.num_rows = next(iter(sizes.values()))
        if not 1 <= batch_size <= self.num_rows:
            raise ValueError(f"batch_size must be in [1, {self.num_rows}] (rows), got {batch_size}")
        self.arrays = dict(arrays)
        self.batch_size = batch_size
        self.seed = int(seed)
        self.steps_per_epoch = self.num_rows // batch_size
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise ValueError(f"bad position: epoch {epoch}, position {position} "
                             f"(steps per epoch {self.steps_per_epoch})")
        self.epoch = int(epoch)
        self.position = int(position)
        self._perm_epoch = -1
        self._perm = np.zeros(0, np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
            self._perm_epoch = self.epoch
        return self._perm

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        start = self.position * self.batch_size
        idx = self._permutation()[start:start + self.batch_size]
        batch = {k: v[idx] for k, v in self.arrays.items()}
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state(self) -> dict[str, int]:
        """JSON-serialisable position of the next batch."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "num_rows": self.num_rows}

    @classmethod
    def restore(cls, arrays: Mapping[str, np.ndarray], batch_size: int, state: Mapping[str, int]) -> Batches:
        """The iterator that continues exactly where the one that produced `state` stopped."""
        b = cls(arrays, batch_size, seed=int(state["seed"]), epoch=int(state["epoch"]),
                position=int(state["position"]))
        for key, have in (("batch_size", b.batch_size), ("num_rows", b.num_rows)):
            if key in state and int(state[key]) != have:
                raise ValueError(f"state was saved with {key}={state[key]}, restoring with {have}")
        return b


def _mixture_weights(datasets: Mapping[str, Any], weights: Mapping[str, float]) -> tuple[list[str], np.ndarray]:
    """Dataset names (sorted) and their weights normalised to sum to 1, after checking both
    name the same non-empty set and the weights are finite, non-negative and not all zero."""
    if set(weights) != set(datasets) or not datasets:
        raise ValueError(f"weights {sorted(weights)} and datasets {sorted(datasets)} name different sets")
    names = sorted(datasets)
    w = np.array([float(weights[k]) for k in names])
    if (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero: {dict(weights)}")
    return names, w / w.sum()


class LengthBuckets:
    """Endless, deterministic batches of a fixed token budget, cut to a length bucket.

    Rows are encoded at the longest bucket with an EOS fill. Each step draws one dataset (by
    `weights`), the shortest bucket that holds every row of that dataset (its "home" bucket),
    and, with probability `long_tail_prob`, a uniformly drawn longer bucket instead, so the
    model also sees long EOS tails (the decoder asks for generation lengths well past the
    answer). The batch has `tokens_per_batch // length` rows drawn with replacement and is the
    rows' first `length` tokens. A batch is a function of (seed, step) alone, so resuming is
    restoring the step.

    Short tasks thus cost a few dozen tokens per example instead of a full-length row.
    """

    def __init__(self, datasets: Mapping[str, Mapping[str, np.ndarray]], weights: Mapping[str, float],
                 buckets: Sequence[int], tokens_per_batch: int, *, seed: int, long_tail_prob: float = 0.0,
                 eos_id: int, multiple_of: int = 1):
        self.buckets = tuple(int(b) for b in buckets)
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] <= 0:
            raise ValueError(f"buckets must be positive and strictly increasing, got {list(buckets)}")
        if not 0.0 <= long_tail_prob <= 1.0:
            raise ValueError(f"long_tail_prob must be in [0, 1], got {long_tail_prob}")
        for b in self.buckets:
            rows = tokens_per_batch // b
            if tokens_per_batch % b or rows % multiple_of:
                raise ValueError(f"bucket {b}: tokens_per_batch={tokens_per_batch} must split into a "
                                 f"whole number of rows divisible by {multiple_of}")
        self.names, self.p = _mixture_weights(datasets, weights)
        self.sets = {k: _as_dataset(datasets[k]) for k in self.names}
        self.home: dict[str, int] = {}
        for k in self.names:
            tokens = self.sets[k]["tokens"]
            if tokens.shape[1] != self.buckets[-1]:
                raise ValueError(f"dataset {k!r} rows have {tokens.shape[1]} tokens, expected the "
                                 f"longest bucket {self.buckets[-1]}")
            # Length needed: the last token that is not the trailing EOS fill, plus one EOS.
            not_eos = tokens != eos_id
            last = np.where(not_eos.any(1), tokens.shape[1] - np.argmax(not_eos[:, ::-1], axis=1), 0)
            need = int(min(last.max() + 1, tokens.shape[1]))
            self.home[k] = next(i for i, b in enumerate(self.buckets) if b >= need)
        self.tokens_per_batch = int(tokens_per_batch)
        self.long_tail_prob = float(long_tail_prob)
        self.seed = int(seed)
        self.step = 0

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, length) a batch can have."""
        lo = min(self.home.values())
        return [(self.tokens_per_batch // b, b) for b in self.buckets[lo:]]

    def __iter__(self) -> LengthBuckets:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.step, 0x1b])
        name = self.names[int(rng.choice(len(self.names), p=self.p))]
        home = self.home[name]
        i = home
        if home + 1 < len(self.buckets) and rng.random() < self.long_tail_prob:
            i = int(rng.integers(home + 1, len(self.buckets)))
        length = self.buckets[i]
        data = self.sets[name]
        idx = rng.integers(0, len(data["tokens"]), size=self.tokens_per_batch // length)
        self.step += 1
        return {k: v[idx, :length] for k, v in data.items()}

    def state(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed, "tokens_per_batch": self.tokens_per_batch}

    def restore(self, state: Mapping[str, int]) -> LengthBuckets:
        """Continue where the iterator that produced `state` stopped."""
        for key, have in (("seed", self.seed), ("tokens_per_batch", self.tokens_per_batch)):
            if int(state[key]) != have:
                raise ValueError(f"state was saved with {key}={state[key]}, restoring with {have}")
        self.step = int(state["step"])
        return self


def _as_dataset(data: Mapping[str, np.ndarray] | np.ndarray) -> dict[str, np.ndarray]:
    """An encoded dataset with prompt/response masks; bare token arrays are all response."""
    d = {"tokens": data} if isinstance(data, np.ndarray) else dict(data)
    if "tokens" not in d:
        raise ValueError(f"dataset has no 'tokens' array (keys {sorted(d)})")
    if "prompt_mask" not in d:
        d["prompt_mask"] = np.zeros(d["tokens"].shape, bool)
    if "response_mask" not in d:
        d["response_mask"] = ~d["prompt_mask"]
    return d


def mix(datasets: Mapping[str, Mapping[str, np.ndarray] | np.ndarray], weights: Mapping[str, float],
        n: int, *, seed: int) -> dict[str, np.ndarray]:
    """`n` rows drawn with replacement, `round(n * w / sum(w))` of them (largest remainder) from
    each dataset, then shuffled. Corpus rows (bare arrays or dicts without masks) get an all-False
    `prompt_mask`. Datasets must share seq_len and keys."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    names, w = _mixture_weights(datasets, weights)
    sets = {k: _as_dataset(datasets[k]) for k in names}
    keys = set(sets[names[0]])
    for k in names:
        if set(sets[k]) != keys:
            raise ValueError(f"dataset {k!r} has keys {sorted(sets[k])}, expected {sorted(keys)}")
        if sets[k]["tokens"].shape[1:] != sets[names[0]]["tokens"].shape[1:]:
            raise ValueError(f"dataset {k!r} has rows of shape {sets[k]['tokens'].shape[1:]}, "
                             f"{names[0]!r} {sets[names[0]]['tokens'].shape[1:]}")
    share = n * w
    counts = np.floor(share).astype(np.int64)
    for i in np.argsort(-(share - counts), kind="stable")[:n - counts.sum()]:
        counts[i] += 1
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {key: [] for key in keys}
    for k, c in zip(names, counts):
        if c == 0:
            continue
        rows = len(sets[k]["tokens"])
        if rows == 0:
            raise ValueError(f"dataset {k!r} is empty but has weight {weights[k]}")
        idx = rng.integers(0, rows, size=int(c))
        for key in keys:
            parts[key].append(sets[k][key][idx])
    order = rng.permutation(n)
    return {key: np.concatenate(v)[order] for key, v in parts.items()}

"""Training run configuration: one TOML file with [model], [train] and [data] tables.

Every key is checked before anything is built: an unknown key, a missing required key or an
impossible shape fails with the table and key named.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    objective: str
    steps: int
    batch_size: int
    seq_len: int
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.98
    seed: int = 0
    log_every: int = 50
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    mesh_data: int = -1  # -1: every device not used by the model axis
    mesh_model: int = 1
    compute_dtype: str = "float32"  # "bfloat16" for mixed precision (params stay float32)
    # Length-bucketed batches (training.data.LengthBuckets): each step is one task's rows cut to
    # the shortest bucket that holds them (batch_size * seq_len tokens per step); empty = every
    # row is seq_len long. The last bucket must be seq_len.
    length_buckets: tuple[int, ...] = ()
    long_tail_prob: float = 0.0  # chance a step uses a longer bucket than its task needs
    # An HF-layout model (path from the working directory) whose weights start the run instead of
    # a random init, e.g. an autoregressive model adapted to diffusion (Dream, LLaDA 2.0). Its
    # parameter shapes must match [model]; attention and logit shift come from [model].
    init_from: str = ""
    # masked_diffusion's clean-position term (training.objectives): with clean_loss_weight > 0,
    # corrupt_prob of the visible response tokens become random regular tokens and
    # clean_loss_weight x the mean cross-entropy of the true token at every visible response
    # position is added to the loss. 0 (the default): off, the plain LLaDA loss.
    clean_loss_weight: float = 0.0
    corrupt_prob: float = 0.0

    def objective_options(self) -> dict[str, float]:
        """The [train] keys passed on to the objective (training.objectives.get_objective)."""
        return {"clean_loss_weight": self.clean_loss_weight, "corrupt_prob": self.corrupt_prob}

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "log_every", "checkpoint_every", "keep_checkpoints",
                     "mesh_model"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"[train] {name}={getattr(self, name)} must be > 0")
        if not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(f"[train] warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
        if self.learning_rate <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"[train] learning_rate={self.learning_rate} must be > 0 and "
                              f"min_lr_ratio={self.min_lr_ratio} in [0, 1]")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"[train] compute_dtype={self.compute_dtype!r} is not float32 or bfloat16")
        if self.clean_loss_weight < 0 or not 0.0 <= self.corrupt_prob < 1.0:
            raise ConfigError(f"[train] clean_loss_weight={self.clean_loss_weight} must be >= 0 and "
                              f"corrupt_prob={self.corrupt_prob} in [0, 1)")
        if not 0.0 <= self.long_tail_prob <= 1.0:
            raise ConfigError(f"[train] long_tail_prob={self.long_tail_prob} must be in [0, 1]")
        b = list(self.length_buckets)
        if b:
            if b != sorted(set(b)) or b[0] <= 0 or b[-1] != self.seq_len:
                raise ConfigError(f"[train] length_buckets={b} must be positive, strictly increasing "
                                  f"and end at seq_len={self.seq_len}")
            bad = [x for x in b if (self.batch_size * self.seq_len) % x]
            if bad:
                raise ConfigError(f"[train] length_buckets {bad} do not divide the batch's "
                                  f"batch_size * seq_len = {self.batch_size * self.seq_len} tokens")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    tasks: dict[str, float]  # task name -> mixture weight ("code" = the stdlib corpus)
    train_examples: int = 20000  # per task
    heldout_examples: int = 200  # per task
    corpus_bytes: int = 500_000
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    source: str = "<dict>"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<dict>") -> RunConfig:
        unknown = sorted(set(raw) - {"model", "train", "data"})
        if unknown:
            raise ConfigError(f"{source}: unknown tables {unknown} (expected [model], [train], [data])")
        parts = {}
        for table, kind in (("model", ModelConfig), ("train", TrainConfig), ("data", DataConfig)):
            values = dict(raw.get(table, {}))
            known = {f.name for f in dataclasses.fields(kind)}
            bad = sorted(set(values) - known)
            if bad:
                raise ConfigError(f"{source}: unknown key(s) {bad} in [{table}]")
            for key in ("dense_layers", "length_buckets"):
                if key in values and isinstance(values[key], list):
                    values[key] = tuple(values[key])
            try:
                parts[table] = kind(**values)
            except TypeError as e:
                raise ConfigError(f"{source}: [{table}] {e}") from None
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        cfg = cls(parts["model"], parts["train"], parts["data"], source)
        cfg._check_shapes()
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        return cls.from_dict(raw, source=str(path))

    def _check_shapes(self) -> None:
        from training.objectives import get_objective

        m, t = self.model, self.train
        try:
            get_objective(t.objective, m, **t.objective_options())
        except ConfigError as e:
            raise ConfigError(f"{self.source}: [train] {e}") from None
        from dlm_jax._tokenizer import ByteTokenizer

        ids = ByteTokenizer().vocab_size  # training encodes with the byte tokenizer
        if m.vocab_size < ids:
            raise ConfigError(f"{self.source}: [model] vocab_size={m.vocab_size} is smaller than the byte "
                              f"tokenizer's {ids} ids; set vocab_size >= {ids}")
        if t.seq_len > m.max_seq_len:
            raise ConfigError(f"{self.source}: [train] seq_len={t.seq_len} exceeds [model] max_seq_len={m.max_seq_len}")
        if t.objective in ("block_diffusion", "introspective"):
            for length in (t.seq_len, *t.length_buckets):
                if length % m.block_size:
                    what = "seq_len" if length == t.seq_len else "length_buckets entry"
                    raise ConfigError(f"{self.source}: [model] block_size={m.block_size} must divide "
                                      f"[train] {what}={length} for {t.objective!r}")
        from training.data import TASKS

        unknown = sorted(set(self.data.tasks) - set(TASKS) - {"code"})
        if unknown:
            raise ConfigError(f"{self.source}: [data] tasks has unknown task(s) {unknown}; "
                              f"known: {sorted(TASKS) + ['code']}")
        if not self.data.tasks or any(w <= 0 for w in self.data.tasks.values()):
            raise ConfigError(f"{self.source}: [data] tasks needs at least one task with weight > 0")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "train": dataclasses.asdict(self.train),
                "data": dataclasses.asdict(self.data)}

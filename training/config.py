"""Training run configuration: one TOML file with [model], [train] and [data] tables, and an
optional [lora] table (R-ISD: train gated LoRA adapters on a frozen `init_from` base).

Every key is checked before anything is built: an unknown key, a missing required key or an
impossible shape fails with the table and key named.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from dlm_jax._config import SPARSE_FFN_KINDS, ModelConfig
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
    # Length-bucketed batches (dlm_jax.training.data.LengthBuckets): each step is one task's rows cut to
    # the shortest bucket that holds them (batch_size * seq_len tokens per step); empty = every
    # row is seq_len long. The last bucket must be seq_len.
    length_buckets: tuple[int, ...] = ()
    long_tail_prob: float = 0.0  # chance a step uses a longer bucket than its task needs
    # An HF-layout model (path from the working directory) whose weights start the run instead of
    # a random init, e.g. an autoregressive model adapted to diffusion (Dream, LLaDA 2.0). Its
    # parameter shapes must match [model]; attention and logit shift come from [model].
    init_from: str = ""
    # With init_from: take only the parameters whose names and shapes match [model] (e.g. the
    # attention and embeddings of a dense model for an MoE one), the rest as initialised.
    init_partial: bool = False
    # masked_diffusion's clean-position term (dlm_jax.training.objectives): with clean_loss_weight > 0,
    # corrupt_prob of the visible response tokens become random regular tokens and
    # clean_loss_weight x the mean cross-entropy of the true token at every visible response
    # position is added to the loss. 0 (the default): off, the plain LLaDA loss.
    clean_loss_weight: float = 0.0
    corrupt_prob: float = 0.0
    # introspective's clean-stream scale: absent (or "auto"), the Eq. 2 auto-balance
    # L = CE_mask + sg(CE_mask / CE_clean) CE_clean; a number, the fixed L = CE_mask + ce_alpha CE_clean
    # (I-DLM's early curriculum stages use 0.2).
    ce_alpha: float | None = None
    # introspective's stride curriculum: [[steps, N], ...] stages run in order, stage N training
    # noisy blocks of N - 1 masks (instead of [model] block_size) so the model supports strides
    # <= N; the stages' steps add up to [train] steps. Empty: block_size masks throughout.
    stride_curriculum: tuple[tuple[int, int], ...] = ()
    # MoE load balancing without an auxiliary loss (LLaDA2.0, DeepSeek-V3): after each step every
    # routed expert's selection bias moves by this much towards balance, up when the expert took
    # fewer than the mean number of tokens, down when more ([model] router_bias). 0: off.
    expert_bias_rate: float = 0.0
    # Activation sparsity for a ReLU-family FFN ([model] ffn = "relu" or "reglu"; ProSparse-style):
    # this times the mean FFN neuron activation (over layers, tokens and neurons) joins the loss,
    # pushing most neurons to exactly zero per token (PowerInfer-2's sparse FFN). 0: off.
    activation_l1: float = 0.0

    def objective_options(self) -> dict[str, float | None]:
        """The [train] keys passed on to the objective (dlm_jax.training.objectives.get_objective);
        `ce_alpha` only when set (absent: introspective's auto-balance)."""
        fixed = {} if self.ce_alpha is None else {"ce_alpha": self.ce_alpha}
        return {"clean_loss_weight": self.clean_loss_weight, "corrupt_prob": self.corrupt_prob, **fixed}

    def stride_at(self, step: int) -> int | None:
        """The curriculum's stride N at `step` (0-based), None without a curriculum."""
        for steps, stride in self.stride_curriculum:
            if step < steps:
                return stride
            step -= steps
        return self.stride_curriculum[-1][1] if self.stride_curriculum else None

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
        if not 0.0 <= self.expert_bias_rate < float("inf"):
            raise ConfigError(f"[train] expert_bias_rate={self.expert_bias_rate} must be >= 0")
        if not 0.0 <= self.activation_l1 < float("inf"):
            raise ConfigError(f"[train] activation_l1={self.activation_l1} must be >= 0")
        if not 0.0 <= self.long_tail_prob <= 1.0:
            raise ConfigError(f"[train] long_tail_prob={self.long_tail_prob} must be in [0, 1]")
        if self.ce_alpha is not None and (isinstance(self.ce_alpha, bool) or not isinstance(self.ce_alpha, (int, float))
                                          or not 0 <= self.ce_alpha < float("inf")):
            raise ConfigError(f"[train] ce_alpha={self.ce_alpha!r} must be \"auto\" or a number >= 0")
        self._check_curriculum()
        b = list(self.length_buckets)
        if b:
            if b != sorted(set(b)) or b[0] <= 0 or b[-1] != self.seq_len:
                raise ConfigError(f"[train] length_buckets={b} must be positive, strictly increasing "
                                  f"and end at seq_len={self.seq_len}")
            bad = [x for x in b if (self.batch_size * self.seq_len) % x]
            if bad:
                raise ConfigError(f"[train] length_buckets {bad} do not divide the batch's "
                                  f"batch_size * seq_len = {self.batch_size * self.seq_len} tokens")


    def _check_curriculum(self) -> None:
        stages = self.stride_curriculum
        for stage in stages:
            if (not isinstance(stage, tuple) or len(stage) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in stage)
                    or stage[0] <= 0 or stage[1] < 2):
                raise ConfigError(f"[train] stride_curriculum entry {list(stage) if isinstance(stage, tuple) else stage!r} "
                                  f"must be [steps > 0, stride N >= 2]")
        if stages and sum(n for n, _ in stages) != self.steps:
            raise ConfigError(f"[train] stride_curriculum stages add up to {sum(n for n, _ in stages)} steps, "
                              f"not steps={self.steps}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    tasks: dict[str, float]  # task name -> mixture weight ("code" = the stdlib corpus)
    train_examples: int = 20000  # per task
    heldout_examples: int = 200  # per task
    corpus_bytes: int = 500_000
    seed: int = 0


def _lora_spec(**values: Any):
    """[lora] rank, alpha, targets -> a LoraSpec (errors name the table)."""
    from dlm_jax.techniques.isd.lora import LoraSpec

    try:
        return LoraSpec(**values)
    except ConfigError as e:
        raise ConfigError(f"[lora] {e}") from None


TABLES = ("model", "train", "data", "lora")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    source: str = "<dict>"
    # [lora]: rank, alpha, targets of gated LoRA adapters (dlm_jax.techniques.isd.LoraSpec). With it the
    # run is R-ISD: the `init_from` base stays frozen, only the adapters train (gate 1 on [MASK]
    # rows, 0 on clean rows) and the run writes them as a PEFT-layout adapter directory.
    lora: Any = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<dict>") -> RunConfig:
        unknown = sorted(set(raw) - set(TABLES))
        if unknown:
            raise ConfigError(f"{source}: unknown tables {unknown} (expected [model], [train], [data], [lora])")
        parts = {}
        from dlm_jax.techniques.isd.lora import LoraSpec

        kinds = (("model", ModelConfig, ModelConfig), ("train", TrainConfig, TrainConfig),
                 ("data", DataConfig, DataConfig), ("lora", LoraSpec, _lora_spec))
        for table, kind, make in kinds:
            if table == "lora" and table not in raw:
                parts[table] = None
                continue
            values = raw.get(table, {})
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{table}] must be a table, got {values!r}")
            values = dict(values)
            known = {f.name for f in dataclasses.fields(kind)}
            bad = sorted(set(values) - known)
            if bad:
                raise ConfigError(f"{source}: unknown key(s) {bad} in [{table}]")
            for key in ("dense_layers", "length_buckets", "targets"):
                if key in values and isinstance(values[key], list):
                    values[key] = tuple(values[key])
            if table == "train":
                if values.get("ce_alpha") == "auto":
                    values["ce_alpha"] = None
                if isinstance(values.get("stride_curriculum"), list):
                    values["stride_curriculum"] = tuple(tuple(x) if isinstance(x, list) else x
                                                        for x in values["stride_curriculum"])
            try:
                parts[table] = make(**values)
            except TypeError as e:
                raise ConfigError(f"{source}: [{table}] {e}") from None
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        cfg = cls(parts["model"], parts["train"], parts["data"], source, parts["lora"])
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
        from dlm_jax.training.objectives import get_objective

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
        if t.expert_bias_rate and not m.router_bias:
            raise ConfigError(f"{self.source}: [train] expert_bias_rate balances the experts through their "
                              f"selection bias; it needs [model] ffn = \"moe\" with router_bias = true")
        if t.activation_l1 and m.ffn not in SPARSE_FFN_KINDS:
            raise ConfigError(f"{self.source}: [train] activation_l1 sparsifies a ReLU-family FFN; [model] "
                              f"ffn={m.ffn!r} is not one of {SPARSE_FFN_KINDS}")
        if t.stride_curriculum and t.objective != "introspective":
            raise ConfigError(f"{self.source}: [train] stride_curriculum is an option of the 'introspective' "
                              f"objective, not {t.objective!r}")
        if self.lora is not None:
            if t.objective != "introspective":
                raise ConfigError(f"{self.source}: [lora] trains R-ISD adapters with the 'introspective' objective, "
                                  f"not [train] objective={t.objective!r}")
            if not t.init_from:
                raise ConfigError(f"{self.source}: [lora] needs [train] init_from, the frozen base model's directory")
        if t.objective in ("block_diffusion", "introspective"):
            for length in (t.seq_len, *t.length_buckets):
                if length % m.block_size:
                    what = "seq_len" if length == t.seq_len else "length_buckets entry"
                    raise ConfigError(f"{self.source}: [model] block_size={m.block_size} must divide "
                                      f"[train] {what}={length} for {t.objective!r}")
        from dlm_jax.training.data import TASKS

        unknown = sorted(set(self.data.tasks) - set(TASKS) - {"code"})
        if unknown:
            raise ConfigError(f"{self.source}: [data] tasks has unknown task(s) {unknown}; "
                              f"known: {sorted(TASKS) + ['code']}")
        if not self.data.tasks or any(w <= 0 for w in self.data.tasks.values()):
            raise ConfigError(f"{self.source}: [data] tasks needs at least one task with weight > 0")

    def to_dict(self) -> dict[str, Any]:
        out = {"model": self.model.to_dict(), "train": dataclasses.asdict(self.train),
               "data": dataclasses.asdict(self.data)}
        if self.lora is not None:
            out["lora"] = dataclasses.asdict(self.lora)
        return out

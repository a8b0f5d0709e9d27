"""`DecodeConfig`: every decoder setting in one validated object, plus paper presets."""

from __future__ import annotations

import dataclasses
from typing import Any

from dlm_jax._errors import ConfigError

CACHE_MODES = ("none", "prefix", "dual")
RULES = ("topk", "threshold", "factor", "frechet")
CONFIDENCES = ("prob", "margin", "entropy")
REMASKING = ("low_confidence", "random")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How to decode.

    Attributes:
      gen_len: tokens to generate per request.
      block_len: semi-autoregressive block length; must divide gen_len.
      steps: total denoising steps for `rule="topk"` (LLaDA's schedule); default gen_len.
      cache: `none` (full sequence every step, LLaDA), `prefix` or `dual` (Fast-dLLM).
      rule: `topk` (LLaDA), `threshold`, `factor` (Fast-dLLM) or `frechet` (Fast-dLLM++).
      threshold, factor, delta: the parameters of those rules.
      confidence: what rules rank by: top-1 `prob`, top-2 `margin`, or negative `entropy`.
      remasking: `low_confidence` or `random` (LLaDA; random ranks by uniform noise).
      temperature: 0 = greedy; > 0 = Gumbel-max sampling in float64 as LLaDA does.
      seed: sampling / random-remasking seed (per request, so batching does not change it).
      stop_on_eos_block: a block decoded entirely to EOS ends that request.
      defer_eos: positions predicted as EOS get confidence 0, so they commit last (LLaDA's
        `confidence_eos_eot_inf`).
    """

    gen_len: int = 128
    block_len: int = 32
    steps: int | None = None
    cache: str = "prefix"
    rule: str = "threshold"
    threshold: float = 0.9
    factor: float = 1.0
    delta: float = 0.25
    confidence: str = "prob"
    remasking: str = "low_confidence"
    temperature: float = 0.0
    seed: int = 0
    stop_on_eos_block: bool = True
    defer_eos: bool = False

    def __post_init__(self) -> None:
        if self.gen_len <= 0 or self.block_len <= 0:
            raise ConfigError(f"DecodeConfig gen_len={self.gen_len} and block_len={self.block_len} must be > 0")
        if self.gen_len % self.block_len:
            raise ConfigError(f"DecodeConfig.block_len={self.block_len} must divide gen_len={self.gen_len}")
        for name, allowed in (("cache", CACHE_MODES), ("rule", RULES), ("confidence", CONFIDENCES),
                              ("remasking", REMASKING)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"DecodeConfig.{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.steps is not None:
            if self.rule != "topk":
                raise ConfigError(f"DecodeConfig.steps={self.steps} applies to rule='topk' only")
            if self.steps <= 0 or self.steps % self.n_blocks:
                raise ConfigError(f"DecodeConfig.steps={self.steps} must be a positive multiple of "
                                  f"the number of blocks ({self.n_blocks})")
        if self.remasking == "random" and self.rule != "topk":
            raise ConfigError("DecodeConfig.remasking='random' applies to rule='topk' only")
        if not 0 < self.threshold <= 1:
            raise ConfigError(f"DecodeConfig.threshold={self.threshold} must be in (0, 1]")
        if self.factor <= 0:
            raise ConfigError(f"DecodeConfig.factor={self.factor} must be > 0")
        if not 0 <= self.delta < 1:
            raise ConfigError(f"DecodeConfig.delta={self.delta} must be in [0, 1)")
        if self.temperature < 0:
            raise ConfigError(f"DecodeConfig.temperature={self.temperature} must be >= 0")

    @property
    def n_blocks(self) -> int:
        return self.gen_len // self.block_len

    @property
    def steps_per_block(self) -> int:
        return (self.steps or self.gen_len) // self.n_blocks

    @property
    def rule_params(self) -> dict[str, Any]:
        return {"threshold": {"threshold": self.threshold}, "factor": {"factor": self.factor},
                "frechet": {"delta": self.delta}}.get(self.rule, {})

    def replace(self, **changes: Any) -> DecodeConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, DecodeConfig] = {
    # LLaDA: full forward every step, one token per step, low-confidence remasking.
    "llada": DecodeConfig(cache="none", rule="topk", block_len=32),
    # Fast-dLLM: prefix cache, confidence threshold 0.9, block 32.
    "fast-dllm": DecodeConfig(cache="prefix", rule="threshold", threshold=0.9, block_len=32),
    "fast-dllm-dual": DecodeConfig(cache="dual", rule="threshold", threshold=0.9, block_len=32),
    "fast-dllm-factor": DecodeConfig(cache="prefix", rule="factor", factor=1.0, block_len=32),
    # Fast-dLLM++: prefix cache, Frechet delta 0.25, block 32.
    "frechet": DecodeConfig(cache="prefix", rule="frechet", delta=0.25, block_len=32),
}


def preset(name: str, **changes: Any) -> DecodeConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown decode preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**changes)

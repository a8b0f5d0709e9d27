"""`DecodeConfig`: how to decode, as strategy objects (NumPy only).

A decode is a generation length plus five objects: a scheduler (which slots each step
computes and caches), a proposer (outputs -> tokens and confidences), a commit rule (what
to keep, and when a unit is done) and a revision policy (what to revisit; none by default).
Build one from names with `decode_config(...)` / `preset(...)` (see `registry`), or pass
objects directly:

    DecodeConfig(gen_len=64, scheduler=DualCache(block_len=32), rule=FrechetRule(0.25))
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.commit import CommitRule, ThresholdRule
from dlm_jax.runtime.proposer import Proposer
from dlm_jax.runtime.revision import NoRevision, RevisionPolicy
from dlm_jax.runtime.scheduler import PrefixCache, Scheduler


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Attributes:
      gen_len: tokens to generate per request.
      scheduler: block schedule and cache mode (default Fast-dLLM's prefix cache, block 32).
      rule: commit rule (default Fast-dLLM's threshold 0.9).
      proposer: greedy or sampled proposals, confidence kind, EOS deferral.
      revision: revision policy (default none).
    """

    gen_len: int = 128
    scheduler: Scheduler = PrefixCache()
    rule: CommitRule = ThresholdRule()
    proposer: Proposer = Proposer()
    revision: RevisionPolicy = NoRevision()

    def __post_init__(self) -> None:
        g = self.gen_len
        if not isinstance(g, numbers.Integral) or isinstance(g, bool) or g <= 0:
            raise ConfigError(f"gen_len={g!r} must be a positive integer")
        for name, kind in (("scheduler", Scheduler), ("rule", CommitRule), ("proposer", Proposer),
                           ("revision", RevisionPolicy)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"DecodeConfig.{name}={getattr(self, name)!r} is not a {kind.__name__}")
        self.rule.check(units=self.units, gen_len=self.gen_len)

    @property
    def units(self) -> int:
        """Commit units (blocks) in the generation."""
        return self.scheduler.units(self.gen_len)

    def options(self) -> dict[str, Any]:
        """The flat option names and values that describe this config (as the CLI spells
        them); `decode_config(**cfg.options())` rebuilds it for registered strategies."""
        from dlm_jax.runtime.registry import describe

        return describe(self)

    def replace(self, **options: Any) -> DecodeConfig:
        """A copy with some options changed, by flat name (`temperature=1.0`, `cache="dual"`)
        or by object (`rule=FrechetRule(0.1)`); untouched strategies are kept as they are."""
        from dlm_jax.runtime.registry import build

        return build(options, base=self)

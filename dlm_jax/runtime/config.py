"""`DecodeConfig`: how to decode, as strategy objects (NumPy only).

A decode is a generation length plus five objects: a scheduler (which slots each step
computes and caches), a proposer (outputs -> tokens and confidences), a commit rule (what
to keep, and when a unit is done), a revision policy (what to revisit; none by default) and
a placement policy (which experts or neurons the executor keeps resident; none by default).
Pass objects directly, or build one from names with `decode_config(...)` / `preset(...)`
(`runtime.registry`, the one module that knows every technique's strategies by name):

    DecodeConfig(gen_len=64, scheduler=DualCache(block_len=32), rule=FrechetRule(0.25))
    decode_config(cfg, temperature=1.0)       # a copy with flat options changed
    decode_options(cfg)["cache"]              # its flat options, as the CLI spells them
"""

from __future__ import annotations

import dataclasses
import numbers

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.commit import CommitRule, ThresholdRule
from dlm_jax.runtime.placement import NoPlacement, PlacementPolicy
from dlm_jax.runtime.proposer import Proposer
from dlm_jax.runtime.revision import NoRevision, RevisionPolicy
from dlm_jax.runtime.scheduler import PrefixCache, Scheduler

__all__ = ["DecodeConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Attributes:
      gen_len: tokens to generate per request.
      scheduler: block schedule and cache mode (default Fast-dLLM's prefix cache, block 32).
      rule: commit rule (default Fast-dLLM's threshold 0.9).
      proposer: greedy or sampled proposals, confidence kind, EOS deferral.
      revision: revision policy (default none).
      placement: expert / neuron placement policy (default none).
    """

    gen_len: int = 128
    scheduler: Scheduler = PrefixCache()
    rule: CommitRule = ThresholdRule()
    proposer: Proposer = Proposer()
    revision: RevisionPolicy = NoRevision()
    placement: PlacementPolicy = NoPlacement()

    def __post_init__(self) -> None:
        g = self.gen_len
        if not isinstance(g, numbers.Integral) or isinstance(g, bool) or g <= 0:
            raise ConfigError(f"gen_len={g!r} must be a positive integer")
        for name, kind in (("scheduler", Scheduler), ("rule", CommitRule), ("proposer", Proposer),
                           ("revision", RevisionPolicy), ("placement", PlacementPolicy)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"DecodeConfig.{name}={getattr(self, name)!r} is not a {kind.__name__}")
        self.rule.check(units=self.units, gen_len=self.gen_len)
        needs = self.scheduler.commit_rule
        if needs is not None and type(self.rule) is not needs:
            raise ConfigError(f"{type(self.scheduler).__name__} accepts its own proposals and takes "
                              f"{needs.__name__}, not {type(self.rule).__name__}")

    @property
    def units(self) -> int:
        """Commit units (blocks) in the generation."""
        return self.scheduler.units(self.gen_len)

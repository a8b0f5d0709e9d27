"""`DecodeConfig`: how to decode, as strategy objects (NumPy only).

A decode is a generation length plus five objects: a scheduler (which slots each step
computes and caches), a proposer (outputs -> tokens and confidences), a commit rule (what
to keep, and when a unit is done), a revision policy (what to revisit; none by default) and
a placement policy (which experts or neurons the executor keeps resident; none by default).
Build one from names with `decode_config(...)` / `preset(...)` (see `registry`), or pass
objects directly:

    DecodeConfig(gen_len=64, scheduler=DualCache(block_len=32), rule=FrechetRule(0.25))

The class lives in `registry` beside the name tables its `options()` and `replace()` read
(one module, so the two never import each other); this module is its usual address.
"""

from dlm_jax.runtime.registry import DecodeConfig

__all__ = ["DecodeConfig"]

"""The NumPy-only host runtime: decode config, cache strategies, commit rules, the block-wise
decode loop and the Executor boundary. Nothing here imports JAX."""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "DecodeConfig": "dlm_jax.runtime.config",
    "PRESETS": "dlm_jax.runtime.config",
    "preset": "dlm_jax.runtime.config",
    "BlockDecoder": "dlm_jax.runtime.decoder",
    "DecodeOutput": "dlm_jax.runtime.decoder",
    "DecodeStats": "dlm_jax.runtime.decoder",
    "CacheStrategy": "dlm_jax.runtime.cache",
    "NoCache": "dlm_jax.runtime.cache",
    "PrefixCache": "dlm_jax.runtime.cache",
    "DualCache": "dlm_jax.runtime.cache",
    "make_cache": "dlm_jax.runtime.cache",
    "CommitRule": "dlm_jax.runtime.commit",
    "TopKRule": "dlm_jax.runtime.commit",
    "ThresholdRule": "dlm_jax.runtime.commit",
    "FactorRule": "dlm_jax.runtime.commit",
    "FrechetRule": "dlm_jax.runtime.commit",
    "make_rule": "dlm_jax.runtime.commit",
    "confidence_scores": "dlm_jax.runtime.commit",
    "num_transfer_tokens": "dlm_jax.runtime.commit",
    "Executor": "dlm_jax.runtime.step",
    "StepInputs": "dlm_jax.runtime.step",
    "StepOutputs": "dlm_jax.runtime.step",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

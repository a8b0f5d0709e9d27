"""The shared transformer, its masks and parameter helpers (masks import without JAX). A
technique's model-side pieces live with the technique: R-ISD's gated LoRA in
`dlm_jax.techniques.isd`, TIDE's split experts in `dlm_jax.techniques.tide`."""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "attention_mask": "dlm_jax._masks",
    "padded_mask": "dlm_jax._masks",
    "visibility_from_positions": "dlm_jax._masks",
    "fuse_projections": "dlm_jax.models._fuse",
    "get_params": "dlm_jax.models._params",
    "init_model": "dlm_jax.models._params",
    "model_from_params": "dlm_jax.models._params",
    "param_count": "dlm_jax.models._params",
    "param_shapes": "dlm_jax.models._params",
    "ModelOutput": "dlm_jax.models._transformer",
    "Transformer": "dlm_jax.models._transformer",
    "apply_rope": "dlm_jax.models._transformer",
    "attend": "dlm_jax.models._transformer",
    "rope_tables": "dlm_jax.models._transformer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

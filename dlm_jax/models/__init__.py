"""The shared transformer, its masks, parameter helpers and gated LoRA adapters (masks import
without JAX)."""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "attention_mask": "dlm_jax._masks",
    "padded_mask": "dlm_jax._masks",
    "visibility_from_positions": "dlm_jax._masks",
    "get_params": "dlm_jax.models._params",
    "init_model": "dlm_jax.models._params",
    "model_from_params": "dlm_jax.models._params",
    "param_count": "dlm_jax.models._params",
    "param_shapes": "dlm_jax.models._params",
    "LORA_TARGETS": "dlm_jax.models._lora",
    "LoraParam": "dlm_jax.models._lora",
    "LoraSpec": "dlm_jax.models._lora",
    "attach_lora": "dlm_jax.models._lora",
    "lora_params": "dlm_jax.models._lora",
    "lora_spec": "dlm_jax.models._lora",
    "mask_rows_gate": "dlm_jax.models._lora",
    "remove_lora": "dlm_jax.models._lora",
    "set_lora_params": "dlm_jax.models._lora",
    "CpuExperts": "dlm_jax.models._split",
    "split_experts": "dlm_jax.models._split",
    "ModelOutput": "dlm_jax.models._transformer",
    "Transformer": "dlm_jax.models._transformer",
    "apply_rope": "dlm_jax.models._transformer",
    "attend": "dlm_jax.models._transformer",
    "rope_tables": "dlm_jax.models._transformer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

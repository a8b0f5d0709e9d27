"""The shared transformer, its masks and parameter helpers."""

from dlm_jax.models._masks import attention_mask, padded_mask, visibility_from_positions
from dlm_jax.models._params import (get_params, init_model, model_from_params, param_count,
                                    param_shapes)
from dlm_jax.models._transformer import ModelOutput, Transformer, apply_rope, attend, rope_tables

__all__ = [
    "ModelOutput", "Transformer", "apply_rope", "attend", "attention_mask", "get_params",
    "init_model", "model_from_params", "padded_mask", "param_count", "param_shapes",
    "rope_tables", "visibility_from_positions",
]

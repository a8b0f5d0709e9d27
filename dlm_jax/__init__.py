"""dlm-jax: diffusion language models from training meshes to phone NPUs.

    model = dlm_jax.load_pretrained("path/to/checkpoint")     # any supported HF family
    tokenizer = dlm_jax.load_tokenizer("path/to/checkpoint")
    out = model(tokens, positions=..., mask=..., k_cache=..., v_cache=...)
"""

from dlm_jax._config import ConfigError, ModelConfig
from dlm_jax._tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from dlm_jax.checkpoint import (FAMILIES, CheckpointError, load_config, load_pretrained,
                                save_pretrained)
from dlm_jax.models import (ModelOutput, Transformer, attention_mask, get_params, init_model,
                            model_from_params, padded_mask, param_count,
                            visibility_from_positions)

__version__ = "0.1.0"

__all__ = [
    "FAMILIES", "ByteTokenizer", "CheckpointError", "ConfigError", "HFTokenizer", "ModelConfig",
    "ModelOutput", "Tokenizer", "Transformer", "attention_mask", "get_params", "init_model",
    "load_config", "load_pretrained", "load_tokenizer", "model_from_params", "padded_mask",
    "param_count", "save_pretrained", "visibility_from_positions",
]

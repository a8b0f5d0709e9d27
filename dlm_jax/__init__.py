"""dlm-jax: diffusion language models from training meshes to phone NPUs.

    model = dlm_jax.load("models/llada-tiny")                # or any supported HF checkpoint
    result = model.generate("564+894=", dlm_jax.preset("frechet", gen_len=32))
    print(result.texts[0], result.stats.nfe)

Exports load lazily: the NumPy-only parts (configs, tokenizers, safetensors) never import JAX.
"""

from dlm_jax._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "dlm_jax._errors",
    "DecodeConfig": "dlm_jax.runtime.config",
    "PRESETS": "dlm_jax.runtime.registry",
    "decode_config": "dlm_jax.runtime.registry",
    "preset": "dlm_jax.runtime.registry",
    "Model": "dlm_jax._model",
    "GenerateResult": "dlm_jax._model",
    "load": "dlm_jax.api",
    "CheckpointError": "dlm_jax._errors",
    "InputError": "dlm_jax._errors",
    "ModelConfig": "dlm_jax._config",
    "ByteTokenizer": "dlm_jax._tokenizer",
    "HFTokenizer": "dlm_jax._tokenizer",
    "Tokenizer": "dlm_jax._tokenizer",
    "load_tokenizer": "dlm_jax._tokenizer",
    "FAMILIES": "dlm_jax.checkpoint._families",
    "convert_checkpoint": "dlm_jax.checkpoint._io",
    "load_config": "dlm_jax.checkpoint._io",
    "load_pretrained": "dlm_jax.checkpoint._io",
    "save_pretrained": "dlm_jax.checkpoint._io",
    "load_adapted": "dlm_jax.checkpoint._adapters",
    "load_adapters": "dlm_jax.checkpoint._adapters",
    "save_adapters": "dlm_jax.checkpoint._adapters",
    "LoraSpec": "dlm_jax.models._lora",
    "attach_lora": "dlm_jax.models._lora",
    "lora_params": "dlm_jax.models._lora",
    "set_lora_params": "dlm_jax.models._lora",
    "ModelOutput": "dlm_jax.models._transformer",
    "Transformer": "dlm_jax.models._transformer",
    "attention_mask": "dlm_jax._masks",
    "padded_mask": "dlm_jax._masks",
    "visibility_from_positions": "dlm_jax._masks",
    "get_params": "dlm_jax.models._params",
    "init_model": "dlm_jax.models._params",
    "model_from_params": "dlm_jax.models._params",
    "param_count": "dlm_jax.models._params",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

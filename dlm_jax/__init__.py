"""dlm-jax: diffusion language models from training meshes to phone NPUs.

    model = dlm_jax.load("models/llada-tiny")                # or any supported HF checkpoint
    result = model.generate("564+894=", dlm_jax.preset("frechet", gen_len=32))
    print(result.texts[0], result.stats.nfe)

Exports load lazily: the NumPy-only parts (configs, tokenizers, safetensors) never import JAX.
"""

import sys
from pathlib import Path

from dlm_jax._lazy import lazy_exports

# The mission's top-level folders are this package's subpackages: `dlm_jax.lowering`,
# `dlm_jax.tflite_export`, `dlm_jax.training`, `dlm_jax.buckets`. A wheel installs them inside
# `dlm_jax/` (pyproject's package-dir), so nothing generic lands in site-packages; in a source
# checkout run from its root (PYTHONPATH=.) they are the sibling folders, found by this finder.
SUBPACKAGE_FOLDERS = ("buckets", "lowering", "tflite_export", "training")


class _SiblingFolders:
    """Finds `dlm_jax.<folder>` in the checkout's `<folder>/` when this package has none."""

    root = Path(__file__).resolve().parent.parent

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        import importlib.util

        package, _, folder = name.partition(".")
        init = cls.root / folder / "__init__.py"
        if package != __name__ or folder not in SUBPACKAGE_FOLDERS or not init.is_file():
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])


if not (Path(__file__).parent / "lowering").is_dir() and _SiblingFolders not in sys.meta_path:
    sys.meta_path.append(_SiblingFolders)

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "dlm_jax._errors",
    "DecodeConfig": "dlm_jax.runtime.config",
    "PRESETS": "dlm_jax.runtime.registry",
    "decode_config": "dlm_jax.runtime.registry",
    "decode_options": "dlm_jax.runtime.registry",
    "preset": "dlm_jax.runtime.registry",
    "Model": "dlm_jax._model",
    "Engine": "dlm_jax._engine",
    "Completion": "dlm_jax._engine",
    "GenerateResult": "dlm_jax._model",
    "load": "dlm_jax.api",
    "MeshShape": "dlm_jax._partition",
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
    "load_adapted": "dlm_jax.techniques.isd.adapters",
    "load_adapters": "dlm_jax.techniques.isd.adapters",
    "save_adapters": "dlm_jax.techniques.isd.adapters",
    "LoraSpec": "dlm_jax.techniques.isd.lora",
    "attach_lora": "dlm_jax.techniques.isd.lora",
    "lora_params": "dlm_jax.techniques.isd.lora",
    "set_lora_params": "dlm_jax.techniques.isd.lora",
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

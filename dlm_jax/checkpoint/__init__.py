"""Checkpoint I/O: HF `config.json` + safetensors for every supported family.

The safetensors reader/writer and the family tables import without JAX; `load_pretrained`
and `save_pretrained` import it on first use.
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "CheckpointError": "dlm_jax._errors",
    "FAMILIES": "dlm_jax.checkpoint._families",
    "Family": "dlm_jax.checkpoint._families",
    "family_for": "dlm_jax.checkpoint._families",
    "get_family": "dlm_jax.checkpoint._families",
    "load_config": "dlm_jax.checkpoint._io",
    "load_pretrained": "dlm_jax.checkpoint._io",
    "save_pretrained": "dlm_jax.checkpoint._io",
    "load_file": "dlm_jax.checkpoint._safetensors",
    "read_header": "dlm_jax.checkpoint._safetensors",
    "save_file": "dlm_jax.checkpoint._safetensors",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

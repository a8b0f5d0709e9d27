"""Checkpoint I/O: HF `config.json` + safetensors for every supported family.

The safetensors reader/writer and the family tables import without JAX; `load_pretrained`,
`save_pretrained` and `convert_checkpoint` import it on first use. `write_manifest(path)`
(re)writes a checkpoint directory's manifest.json after its files were edited by hand;
`verify_manifest(path)` checks the files against it. `save_adapters` / `load_adapters` /
`load_adapted`: LoRA adapters in PEFT's layout beside a base checkpoint (`_adapters`).
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "CheckpointError": "dlm_jax._errors",
    "FAMILIES": "dlm_jax.checkpoint._families",
    "Family": "dlm_jax.checkpoint._families",
    "family_for": "dlm_jax.checkpoint._families",
    "get_family": "dlm_jax.checkpoint._families",
    "load_adapted": "dlm_jax.techniques.isd.adapters",
    "load_adapters": "dlm_jax.techniques.isd.adapters",
    "read_adapter_config": "dlm_jax.techniques.isd.adapters",
    "save_adapters": "dlm_jax.techniques.isd.adapters",
    "convert_checkpoint": "dlm_jax.checkpoint._io",
    "load_config": "dlm_jax.checkpoint._io",
    "load_pretrained": "dlm_jax.checkpoint._io",
    "save_pretrained": "dlm_jax.checkpoint._io",
    "load_file": "dlm_jax.checkpoint._safetensors",
    "read_header": "dlm_jax.checkpoint._safetensors",
    "save_file": "dlm_jax.checkpoint._safetensors",
    "verify_manifest": "dlm_jax._integrity",
    "write_manifest": "dlm_jax._integrity",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

"""Checkpoint I/O: HF `config.json` + safetensors for every supported family."""

from dlm_jax.checkpoint._families import FAMILIES, Family, family_for, get_family
from dlm_jax.checkpoint._io import load_config, load_pretrained, save_pretrained
from dlm_jax.checkpoint._safetensors import CheckpointError, load_file, read_header, save_file

__all__ = [
    "FAMILIES", "CheckpointError", "Family", "family_for", "get_family", "load_config",
    "load_file", "load_pretrained", "read_header", "save_file", "save_pretrained",
]

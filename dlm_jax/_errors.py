"""Error types shared by every part of dlm-jax (no JAX import)."""


class ConfigError(ValueError):
    """A model or decode configuration value is invalid; the message names the field."""


class CheckpointError(ValueError):
    """A checkpoint (config, tensor file, index or tokenizer) is missing, corrupt or inconsistent;
    the message names the file and the tensor or key."""


class InputError(ConfigError):
    """A request's input (a prompt, its token ids, a seed) is invalid; the message names it."""

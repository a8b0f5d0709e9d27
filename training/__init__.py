"""Training on a device mesh: objectives (`dlm_jax.training.objectives`), data (`dlm_jax.training.data`), the
loop with orbax checkpoints and resume (`dlm_jax.training.loop`), run configs (`dlm_jax.training.config`) and
task evaluation (`dlm_jax.training.evaluate`). Submodules import what they need; this package imports
nothing eagerly (`dlm_jax.training.data` is NumPy-only)."""

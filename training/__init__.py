"""Training on a device mesh: objectives (`training.objectives`), data (`training.data`), the
loop with orbax checkpoints and resume (`training.loop`), run configs (`training.config`) and
task evaluation (`training.evaluate`). Submodules import what they need; this package imports
nothing eagerly (`training.data` is NumPy-only)."""

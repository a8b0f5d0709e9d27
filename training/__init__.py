"""Training on a device mesh: objectives, data, the loop, orbax checkpoints, LoRA.
Nothing is implemented here yet (see DESIGN.md).
"""

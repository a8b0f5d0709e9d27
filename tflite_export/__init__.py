"""StableHLO -> `.tflite` through litert-converter, bundle writing and verification, the
on-device runner and vendor NPU AOT. Nothing is implemented here yet (see DESIGN.md).
"""

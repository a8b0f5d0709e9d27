"""StableHLO -> `.tflite` through litert-converter, bundle writing and verification, the
on-device runner and vendor NPU AOT (see DESIGN.md).

So far: `tflite_export._convert` lowers JAX functions (weights closed over), converts them to
TFLite builtin ops and merges them into one multi-signature flatbuffer, one signature per
decode bucket (`step_w8_p8_r8`), written atomically. Imports nothing eagerly.
"""

"""StableHLO -> `.tflite` through litert-converter, bundle writing and verification, the
on-device runner and vendor NPU AOT (see DESIGN.md).

So far: JAX functions (weights closed over) lowered, converted to TFLite builtin ops and
merged into one multi-signature flatbuffer, one signature per decode bucket
(`step_w8_p8_r8`), named and shaped by the step contract (`dlm_jax.runtime.step`), written
atomically. Imports nothing eagerly.
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "Signature": "tflite_export._convert",
    "convert_signatures": "tflite_export._convert",
    "decode_signature": "tflite_export._convert",
    "decode_signature_name": "tflite_export._convert",
    "export_signatures": "tflite_export._convert",
    "lower_to_stablehlo": "tflite_export._convert",
    "tflite_op_names": "tflite_export._convert",
    "write_tflite": "tflite_export._convert",
    "read_tflite": "tflite_export._convert",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

"""StableHLO -> `.tflite` through litert-converter, and bundles (see DESIGN.md).

JAX functions (weights closed over) are lowered, converted to TFLite builtin ops and merged
into one multi-signature flatbuffer, one signature per decode bucket (`step_w8_p8_r8`), named
and shaped by the step contract (`dlm_jax.runtime.step`). `export_bundle` (behind
`dlm-jax export`) writes a bundle directory around it: quantised weights through LiteRT's
quantizer, tokenizer, decode defaults, latency table, lowering plan and manifest; the
on-device runner that reads it is `dlm_jax.runner` (no JAX). Qualcomm targets compile ahead of
time through `ai_edge_litert.aot` when the vendor SDK is installed. Imports nothing eagerly.
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
    "QUANT_MODES": "tflite_export.bundle",
    "buckets_for_prompts": "tflite_export.bundle",
    "export_bundle": "tflite_export.bundle",
    "parse_bucket": "tflite_export.bundle",
    "quantize_tflite": "tflite_export.bundle",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

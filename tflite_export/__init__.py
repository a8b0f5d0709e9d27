"""StableHLO -> `.tflite` through litert-converter, and bundles (docs/bundles.md).

JAX functions (weights closed over) are lowered, converted to TFLite builtin ops and merged
into one multi-signature flatbuffer, one signature per decode bucket (`step_w8_p8_r8`), named
and shaped by the step contract (`dlm_jax.runtime.step`). `export_bundle` (behind
`dlm-jax export`) writes a bundle directory around it: quantised weights through LiteRT's
quantizer, tokenizer, decode defaults, latency table, lowering plan and manifest; the
on-device runner that reads it is `dlm_jax.executors.runner` (no JAX). Qualcomm targets compile ahead of
time through `ai_edge_litert.aot` when the vendor SDK is installed. Imports nothing eagerly.
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "Signature": "dlm_jax.tflite_export._convert",
    "convert_signatures": "dlm_jax.tflite_export._convert",
    "decode_signature": "dlm_jax.tflite_export._convert",
    "decode_signature_name": "dlm_jax.tflite_export._convert",
    "export_signatures": "dlm_jax.tflite_export._convert",
    "lower_to_stablehlo": "dlm_jax.tflite_export._convert",
    "tflite_op_names": "dlm_jax.tflite_export._convert",
    "write_tflite": "dlm_jax.tflite_export._convert",
    "read_tflite": "dlm_jax.tflite_export._convert",
    "QUANT_MODES": "dlm_jax.tflite_export.bundle",
    "buckets_for_prompts": "dlm_jax.tflite_export.bundle",
    "export_bundle": "dlm_jax.tflite_export.bundle",
    "parse_bucket": "dlm_jax.tflite_export.bundle",
    "quantize_tflite": "dlm_jax.tflite_export.bundle",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

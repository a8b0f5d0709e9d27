"""The llada-tiny decode step exported once per test process: three buckets in one `.tflite`
(a P == 0 bucket among them), the way the exporter ships them."""

from __future__ import annotations

import functools
from pathlib import Path

from dlm_jax.runtime.buckets import BucketKey

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "llada-tiny"
KEYS = (BucketKey(1, 32, 64, 32), BucketKey(1, 64, 128, 8), BucketKey(1, 8, 0, 8))


@functools.cache
def tiny_step() -> tuple[object, bytes]:
    """(ModelConfig, .tflite bytes with one signature per bucket of KEYS)."""
    from flax import nnx

    import dlm_jax
    from dlm_jax.tflite_export import convert_signatures, decode_signature

    model = dlm_jax.load(str(MODEL_DIR)).model
    graphdef, state = nnx.split(model)
    return model.config, convert_signatures([decode_signature(graphdef, state, model.config, k) for k in KEYS])

"""Static token buckets, from the tools' side: latency profiling of an executor into
latency tables (`profile_executor`, `dlm-jax profile`).

The bucket types, padding and latency tables live in the host runtime
(`dlm_jax.runtime.buckets`, `dlm_jax.runtime.latency`) and per-bucket AOT compilation in the
JAX executor (`dlm_jax.executors._compile`); they are re-exported here. This package depends on
`dlm_jax`, never the reverse.
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "BucketKey": "dlm_jax.runtime.buckets",
    "BucketSet": "dlm_jax.runtime.buckets",
    "DEFAULT_BATCH_BUCKETS": "dlm_jax.runtime.buckets",
    "DEFAULT_WINDOW_BUCKETS": "dlm_jax.runtime.buckets",
    "cache_buckets": "dlm_jax.runtime.buckets",
    "pad_axis": "dlm_jax.runtime.buckets",
    "window_buckets": "dlm_jax.runtime.buckets",
    "LatencyEntry": "dlm_jax.runtime.latency",
    "LatencyTable": "dlm_jax.runtime.latency",
    "CompiledBuckets": "dlm_jax.executors._compile",
    "XlaCompileCounter": "dlm_jax.executors._compile",
    "enable_persistent_cache": "dlm_jax.executors._compile",
    "profile_executor": "dlm_jax.buckets._profile",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

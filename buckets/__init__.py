"""Static token buckets: bucket sets and padding (NumPy), per-bucket AOT compilation with a
compile counter and the persistent cache, latency profiling into latency tables."""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "BucketKey": "buckets._sets",
    "BucketSet": "buckets._sets",
    "DEFAULT_BATCH_BUCKETS": "buckets._sets",
    "DEFAULT_WINDOW_BUCKETS": "buckets._sets",
    "cache_buckets": "buckets._sets",
    "pad_axis": "buckets._sets",
    "window_buckets": "buckets._sets",
    "LatencyEntry": "buckets._latency",
    "LatencyTable": "buckets._latency",
    "profile_executor": "buckets._profile",
    "CompiledBuckets": "buckets._compile",
    "XlaCompileCounter": "buckets._compile",
    "enable_persistent_cache": "buckets._compile",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

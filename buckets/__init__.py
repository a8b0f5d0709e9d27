"""Static token buckets: bucket sets, padding, per-bucket AOT compilation, latency tables.

Planned contents (see DESIGN.md, "Packages"): window and cache bucket sets, bucket selection
and padding helpers, ahead-of-time compilation per bucket with a compile counter and JAX's
persistent cache, and latency profiling into JSON tables and plots. Nothing is implemented
here yet.
"""

"""llada.cpp (Chen et al., "llada.cpp: diffusion LLM inference on phone NPUs"): docs/techniques/lladacpp.md.

    mbsd         multi-block speculative decoding: `SpeculativeWindow`, a scheduler whose window
                 slides past committed tokens and drafts into later blocks, priced by the bucket
                 latency table (`runtime.latency`)
    dppr         dual-path progressive revision: `ProgressiveRevision`, a revision policy
                 (IV -> V -> S token states, in-window and leave-one-out re-scoring)
    refresh      DPPR's CPU path: `Refresher`, a `runtime.cpu_path.CpuPath` that re-scores and
                 refreshes visible tokens beside the main step
    somr         the swap-optimised memory planner of a lowered step (`plan_memory`, `plan_bundle`)
    paging       the paging-only baseline SOMR is compared with
    _plan_check  the rules a memory plan must keep

Options: `--cache mbsd` (`window_width`, `sliding`, `trigger`, `allowance`, `latency`,
`max_window`, `suffix`, `draft_input`, `draft_threshold`, `skip_stable`), `--revision dppr`
(`theta_stable`, `theta_visible`, `revise`, `refresh_rows`, `revisit`, `window_probes`);
preset `llada-cpp`. The NPU/CPU split of a step is the lowering's (`dlm_jax.lowering.partition`),
run by the partitioned executor (`dlm_jax.executors.partitioned`).
Tests: tests/techniques/lladacpp/. Benchmarks: benchmarks/lladacpp.py, benchmarks/somr.py.
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "SpeculativeWindow": "dlm_jax.techniques.lladacpp.mbsd",
    "ProgressiveRevision": "dlm_jax.techniques.lladacpp.dppr",
    "Refresher": "dlm_jax.techniques.lladacpp.refresh",
    "MemoryPlan": "dlm_jax.techniques.lladacpp.somr",
    "plan_memory": "dlm_jax.techniques.lladacpp.somr",
    "plan_bundle": "dlm_jax.techniques.lladacpp.somr",
    "paging_only": "dlm_jax.techniques.lladacpp.paging",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

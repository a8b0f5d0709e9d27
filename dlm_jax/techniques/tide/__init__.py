"""TIDE (I/O-aware expert placement for MoE diffusion LLMs): docs/techniques/tide.md.

    experts   `ExpertPolicy` (a placement policy: interval refresh of each layer's resident
              experts every tau steps of a block, and its baselines), the residency accounting,
              the drift / miss-curve estimates, the cost model and the tau solver, `calibrate`
    split     split expert execution: `split_experts` gives each MoE layer of a model slots for
              B resident experts and computes the others' assignments on a NumPy CPU path
              (`CpuExperts`, through `jax.pure_callback`); the JAX executor's `place` moves
              experts into the slots

Options: `--experts` (`expert_budget`, `tau`, `hits`, `expert_seed`; `tau auto` and
`experts static` are calibrated by a probe decode, `PlacementPolicy.probe`), `--expert-slots S`
(split execution, JAX only). Tests: tests/techniques/tide/. Benchmark: benchmarks/tide.py.
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "ExpertPolicy": "dlm_jax.techniques.tide.experts",
    "ExpertPlacement": "dlm_jax.techniques.tide.experts",
    "ExpertCosts": "dlm_jax.techniques.tide.experts",
    "calibrate": "dlm_jax.techniques.tide.experts",
    "solve_tau": "dlm_jax.techniques.tide.experts",
    "expert_counts": "dlm_jax.techniques.tide.experts",
    "CpuExperts": "dlm_jax.techniques.tide.split",
    "split_experts": "dlm_jax.techniques.tide.split",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

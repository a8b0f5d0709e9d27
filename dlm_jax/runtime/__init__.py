"""The loop core: the NumPy-only host runtime. Nothing here imports JAX (it runs unchanged
beside a LiteRT bundle on a device) and nothing but the registry names a technique: the papers'
strategies live in `dlm_jax.techniques` and plug in through the hook bases defined here.

    hooks      HookBase: every strategy base declares its hooks, checked at class definition
    state      DecodeState (per-slot tokens, TokenState, confidence, positions), RequestStatus
    kvstore    KVStore (NumPy per-slot K/V with versions: what a HostKVCache holds)
    kvcache    KVCache protocol (the decode's K/V, held by the executor), HostKVCache (NumPy K/V
               fed to a dense step)
    scheduler  Scheduler protocol, StepPlan; NoCache / PrefixCache / DualCache block schedules
    step       the step contract, both forms (StepInputs dense, SlotStep by index; StepOutputs),
               the visibility rule, Executor, Capabilities
    cpu_path   CpuPath (work beside the main steps), CpuExecutor
    inputs     StepInputBuilder (plans -> SlotSteps padded to a bucket)
    proposer   Proposer (greedy / Gumbel sampling, confidence kinds, random order, deferred EOS)
    commit     commit rules (top-k schedule, threshold, factor, Frechet, none) and their unit life
    revision   RevisionPolicy protocol, NoRevision
    placement  PlacementPolicy protocol, NoPlacement
    config     DecodeConfig (the strategy objects of one decode)
    registry   names -> strategies, presets, flat options, CLI flags (the one core module that
               imports the techniques, `dlm_jax.techniques`)
    decoder    Decoder (the loop, also as a generator of steps: `steps`), DecodeStats, DecodeOutput
    engine     Engine (continuous batching: each request its own loop, steps of one shape in one
               call over a pooled K/V cache), Request, RequestStats
    buckets    BucketKey, BucketSet, padding
    latency    LatencyTable (median step latency per bucket), PhoneCostModel
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "DecodeState": "dlm_jax.runtime.state",
    "RequestStatus": "dlm_jax.runtime.state",
    "TokenState": "dlm_jax.runtime.state",
    "KVStore": "dlm_jax.runtime.kvstore",
    "Engine": "dlm_jax.runtime.engine",
    "KVCache": "dlm_jax.runtime.kvcache",
    "HostKVCache": "dlm_jax.runtime.kvcache",
    "SlotStep": "dlm_jax.runtime.step",
    "BlockScheduler": "dlm_jax.runtime.scheduler",
    "DualCache": "dlm_jax.runtime.scheduler",
    "NoCache": "dlm_jax.runtime.scheduler",
    "PlanShape": "dlm_jax.runtime.scheduler",
    "PrefixCache": "dlm_jax.runtime.scheduler",
    "Scheduler": "dlm_jax.runtime.scheduler",
    "StepPlan": "dlm_jax.runtime.scheduler",
    "Capabilities": "dlm_jax.runtime.step",
    "Executor": "dlm_jax.runtime.step",
    "OutputRequest": "dlm_jax.runtime.step",
    "StepInputs": "dlm_jax.runtime.step",
    "StepOutputs": "dlm_jax.runtime.step",
    "StepInputBuilder": "dlm_jax.runtime.inputs",
    "Proposal": "dlm_jax.runtime.proposer",
    "Proposer": "dlm_jax.runtime.proposer",
    "CommitRule": "dlm_jax.runtime.commit",
    "FactorRule": "dlm_jax.runtime.commit",
    "FrechetRule": "dlm_jax.runtime.commit",
    "PaperFactorRule": "dlm_jax.runtime.commit",
    "PerStepRule": "dlm_jax.runtime.commit",
    "ThresholdRule": "dlm_jax.runtime.commit",
    "TopKRule": "dlm_jax.runtime.commit",
    "TopKSchedule": "dlm_jax.runtime.commit",
    "confidence_scores": "dlm_jax.runtime.proposer",
    "num_transfer_tokens": "dlm_jax.runtime.commit",
    "NoCommit": "dlm_jax.runtime.commit",
    "NoRevision": "dlm_jax.runtime.revision",
    "PlacementPolicy": "dlm_jax.runtime.placement",
    "NoPlacement": "dlm_jax.runtime.placement",
    "CpuPath": "dlm_jax.runtime.cpu_path",
    "CpuExecutor": "dlm_jax.runtime.cpu_path",
    "RevisionPolicy": "dlm_jax.runtime.revision",
    "DecodeConfig": "dlm_jax.runtime.config",
    "PRESETS": "dlm_jax.runtime.registry",
    "registry": "dlm_jax.runtime.registry",
    "decode_config": "dlm_jax.runtime.registry",
    "decode_options": "dlm_jax.runtime.registry",
    "preset": "dlm_jax.runtime.registry",
    "Decoder": "dlm_jax.runtime.decoder",
    "DecodeOutput": "dlm_jax.runtime.decoder",
    "DecodeStats": "dlm_jax.runtime.decoder",
    "BucketKey": "dlm_jax.runtime.buckets",
    "BucketSet": "dlm_jax.runtime.buckets",
    "LatencyTable": "dlm_jax.runtime.latency",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

"""The NumPy-only host runtime. Nothing here imports JAX: it runs unchanged beside a LiteRT
bundle on a device.

    state      DecodeState (per-slot tokens, TokenState, confidence, positions), RequestStatus
    kvstore    KVStore (NumPy per-slot K/V with versions: what a HostKVCache holds)
    kvcache    KVCache protocol (the decode's K/V, held by the executor), SlotStep (a step as
               indices), HostKVCache (NumPy K/V fed to a dense step), slot_visibility
    scheduler  Scheduler protocol, StepPlan; NoCache / PrefixCache / DualCache block schedules
    step       the step contract (tensor specs, StepInputs / StepOutputs), Executor, Capabilities
    inputs     StepInputBuilder (plans -> SlotSteps padded to a bucket)
    proposer   Proposer (greedy / Gumbel sampling, confidence kinds, random order, deferred EOS)
    commit     commit rules (top-k schedule, threshold, factor, Frechet, none) and their unit life
    isd        Strided (I-DLM's introspective strided decoding), LeftToRight, Acceptance (its rule),
               renewal_tpf
    revision   RevisionPolicy protocol, NoRevision
    config     DecodeConfig (the strategy objects of one decode)
    registry   names -> strategies, presets, flat options, CLI flags
    decoder    Decoder (the loop), DecodeStats, DecodeOutput
    buckets    BucketKey, BucketSet, padding; latency: LatencyTable
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "DecodeState": "dlm_jax.runtime.state",
    "RequestStatus": "dlm_jax.runtime.state",
    "TokenState": "dlm_jax.runtime.state",
    "KVStore": "dlm_jax.runtime.kvstore",
    "KVCache": "dlm_jax.runtime.kvcache",
    "HostKVCache": "dlm_jax.runtime.kvcache",
    "SlotStep": "dlm_jax.runtime.kvcache",
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
    "Strided": "dlm_jax.runtime.isd",
    "LeftToRight": "dlm_jax.runtime.isd",
    "Acceptance": "dlm_jax.runtime.isd",
    "renewal_tpf": "dlm_jax.runtime.isd",
    "NoRevision": "dlm_jax.runtime.revision",
    "RevisionPolicy": "dlm_jax.runtime.revision",
    "DecodeConfig": "dlm_jax.runtime.config",
    "PRESETS": "dlm_jax.runtime.registry",
    "registry": "dlm_jax.runtime.registry",
    "decode_config": "dlm_jax.runtime.registry",
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

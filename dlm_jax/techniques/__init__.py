"""The papers' techniques, one package each. Each plugs into the loop core (`dlm_jax.runtime`)
through its hook bases (Scheduler, RevisionPolicy, PlacementPolicy, CpuPath, Executor) and is
named to users by the registry (`dlm_jax.runtime.registry`), the one core module that imports
them. No technique imports another (`tests/test_import_graph.py`).

    lladacpp    llada.cpp: multi-block speculative decoding (MBSD), dual-path progressive
                revision (DPPR) and its CPU path, the swap-optimised memory planner (SOMR)
    isd         I-DLM: introspective strided decoding (ISD), left-to-right decoding, and R-ISD's
                gated LoRA adapters
    tide        TIDE: I/O-aware expert placement for MoE models, split expert execution
    powerinfer  PowerInfer-2: neuron statistics, the hot/cold planner, activation predictors,
                the neuron cache, the flash file and its reader, the cold path, the sparse
                bundle's export, INT4 + INT8-outlier NPU quantisation, the pipeline simulator

LLaDA's and Fast-dLLM's block schedules and commit rules, Fast-dLLM++'s Frechet rule
included, are the loop core's own (`runtime.scheduler`, `runtime.commit`). Each package's
`__init__` lists its parts, its options, its tests and its benchmark; `docs/techniques/` has a
page per technique.
"""

"""Executors: what runs a decode's compiled steps and holds its K/V (`runtime.step.Executor`).

    jax_executor        `JaxExecutor`: one AOT-compiled program per bucket (`_compile`), K/V
                        resident on the device (`DeviceKVCache`); every model, every dtype
    sharding            `MeshPlacement`: the JAX executor's arrays on a device mesh (tp, ep,
                        dp), several processes (`join_processes`)
    runner              `LiteRTExecutor`: an exported bundle on LiteRT (no JAX), `load_bundle`
    partitioned         `PartitionedExecutor`: a partitioned bundle's NPU programs and CPU heads
                        (`partition_contract` names them), with PowerInfer-2's cold path
    bundle_cache        `BundleCacheExecutor`: the LiteRT runner over buckets exported on first use
    auto                `AutoExecutor`: the CPU default, JAX until the bundle cache holds a
                        decode's buckets
    _litert             one LiteRT environment per process, output reading, the exit hush
    _logits             `DeviceLogits`: a step's logits kept on its device, and the proposer's
                        rules over them there (sampling, penalties, bias, logprobs)
    bundle_files        a bundle directory's file names, spelled once

`dlm_jax.testing.MockExecutor` is the scripted executor of the tests.
"""

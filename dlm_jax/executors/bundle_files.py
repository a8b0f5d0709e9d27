"""A bundle directory, by file name: the one place the names are spelled. The exporter
(`dlm_jax.tflite_export.bundle`) writes them, the executors (`runner`, `partitioned`) and the
bundle cache (`dlm_jax.tflite_export.cache_admin`, `merge`) read them (NumPy only).

    bundle.json            format and version, model config, buckets (a signature each),
                           quantisation, target, decode defaults, prompt format, adapters,
                           partition; `files` names the optional files below
    model.tflite           one signature per bucket, each weight stored once (partitioned:
                           the NPU programs only)
    cpu.tflite             a partitioned bundle's CPU heads
    cpu.safetensors        a partitioned bundle's embedding table (read by NumPy)
    ffn.flash              a sparse bundle's neuron-bundled FFN weights (PowerInfer-2)
    neurons.json           a sparse bundle's hot/cold neuron plan
    predictor.safetensors  a sparse bundle's activation predictor
    latency.json           measured step latency per bucket
    plan.json              the lowering plan: partition and memory plan per signature
    manifest.json          sizes and digests of every file (`dlm_jax._integrity`)
"""

BUNDLE_FORMAT = "dlm-jax-bundle"
BUNDLE_VERSION = 1
BUNDLE_FILE = "bundle.json"
MODEL_FILE = "model.tflite"
CPU_PROGRAMS_FILE = "cpu.tflite"
CPU_WEIGHTS_FILE = "cpu.safetensors"
FLASH_FILE = "ffn.flash"
NEURONS_FILE = "neurons.json"
PREDICTOR_FILE = "predictor.safetensors"
LATENCY_FILE = "latency.json"
PLAN_FILE = "plan.json"

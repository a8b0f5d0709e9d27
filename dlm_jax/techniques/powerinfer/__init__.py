"""PowerInfer-2 (fast LLM inference on a smartphone: neuron clusters with flash offload):
docs/techniques/powerinfer.md.

Host side (NumPy):
    neurons        what a decode activates: `NeuronTrace`, `ActivationStats`, bit packing
    neuron_plan    the offline hot/cold planner under a memory budget (`plan_neurons`)
    predictor      activation predictors (`LowRankPredictor`, `OraclePredictor`)
    neuron_cache   `NeuronCache`: cold neurons read from flash, least recently used out
    flash          the neuron-bundled flash file `ffn.flash` (`write_flash`, `FlashFile`)
    flash_io       `FlashReader` (positioned, O_DIRECT reads), `ReaderThread`
    cold_path      `ColdPath`: predictor, cache and flash reads between a sparse bundle's
                   layer programs (run by `dlm_jax.executors.partitioned`)
Offline (JAX, at export):
    sparse         statistics of real decode windows, the predictor's training, the plan, and
                   `sparse_export` (`dlm-jax export --sparse`)
    npu_quant      INT4 per channel + INT8 outlier input channels for the NPU programs
                   (`--quant int4-outliers`)
Model of the phone:
    pipeline       the neuron pipeline as a discrete-event simulation, Fig 14's ablation
    _neuron_memory, _pipeline_trace   its memory prices and decode traces

Options: `dlm-jax export --partition --sparse --memory-budget MB [--quant int4-outliers]`,
`dlm-jax run BUNDLE --memory-budget MB [--oracle] [--prefetch]`. Tests:
tests/techniques/powerinfer/. Benchmarks: benchmarks/powerinfer.py, benchmarks/powerinfer_sim.py,
benchmarks/npu_quant.py.
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "NeuronTrace": "dlm_jax.techniques.powerinfer.neurons",
    "ActivationStats": "dlm_jax.techniques.powerinfer.neurons",
    "plan_neurons": "dlm_jax.techniques.powerinfer.neuron_plan",
    "NeuronPlan": "dlm_jax.techniques.powerinfer.neuron_plan",
    "LowRankPredictor": "dlm_jax.techniques.powerinfer.predictor",
    "OraclePredictor": "dlm_jax.techniques.powerinfer.predictor",
    "NeuronCache": "dlm_jax.techniques.powerinfer.neuron_cache",
    "write_flash": "dlm_jax.techniques.powerinfer.flash",
    "FlashFile": "dlm_jax.techniques.powerinfer.flash",
    "FlashReader": "dlm_jax.techniques.powerinfer.flash_io",
    "ColdPath": "dlm_jax.techniques.powerinfer.cold_path",
    "sparse_export": "dlm_jax.techniques.powerinfer.sparse",
    "quantize_npu": "dlm_jax.techniques.powerinfer.npu_quant",
    "simulate": "dlm_jax.techniques.powerinfer.pipeline",
    "ablation": "dlm_jax.techniques.powerinfer.pipeline",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

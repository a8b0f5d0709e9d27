"""I-DLM (introspective diffusion language models): docs/techniques/isd.md.

    strided    `Strided` (introspective strided decoding: propose N-1 tokens and verify the
               previous proposals in one forward, lossless acceptance), `LeftToRight` (one
               token per forward), `Acceptance` (the acceptance rule), `renewal_tpf`
    lora       R-ISD's gated LoRA adapters: `attach_lora`, `LoraSpec`, `lora_params`, ...
               (the gate itself is part of the step contract: `runtime.step.mask_rows_gate`)
    adapters   adapter checkpoints: `save_adapters`, `load_adapters`, `load_adapted`

Options: `--cache isd` (`stride`, `verify`, `proposal`, `relax`, `iar`), `--cache ar`;
presets `isd`, `ar`; `--lora DIR` on every command that loads a model. Training: the
`[lora]` section of a run config (`dlm_jax.training.config`), `dlm_jax.training.ship_adapters`.
Tests: tests/techniques/isd/, tests/training/test_risd.py. Benchmark: benchmarks/isd.py.
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS = {
    "Strided": "dlm_jax.techniques.isd.strided",
    "LeftToRight": "dlm_jax.techniques.isd.strided",
    "Acceptance": "dlm_jax.techniques.isd.strided",
    "renewal_tpf": "dlm_jax.techniques.isd.strided",
    "LORA_TARGETS": "dlm_jax.techniques.isd.lora",
    "LoraParam": "dlm_jax.techniques.isd.lora",
    "LoraSpec": "dlm_jax.techniques.isd.lora",
    "attach_lora": "dlm_jax.techniques.isd.lora",
    "lora_params": "dlm_jax.techniques.isd.lora",
    "lora_spec": "dlm_jax.techniques.isd.lora",
    "remove_lora": "dlm_jax.techniques.isd.lora",
    "set_lora_params": "dlm_jax.techniques.isd.lora",
    "mask_rows_gate": "dlm_jax.runtime.step",
    "save_adapters": "dlm_jax.techniques.isd.adapters",
    "load_adapters": "dlm_jax.techniques.isd.adapters",
    "load_adapted": "dlm_jax.techniques.isd.adapters",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

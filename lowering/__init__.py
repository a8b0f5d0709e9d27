"""Lowering: tile padding to hardware tiles, tiled weight layouts, quantisation, NPU/CPU
partitioning and the memory planner (docs/architecture.md, docs/techniques/lladacpp.md). NumPy
only: importing it never loads JAX.
"""

from dlm_jax._lazy import lazy_exports

_EXPORTS: dict[str, str] = {}
# tiles: 32x32 tile padding, tiled weight layout, tile-reading matmul, stepwise tile cost
_EXPORTS.update({name: "dlm_jax.lowering.tiles" for name in (
    "TILE", "TileCost", "TiledLayout", "crop_from_tiles", "pad_to_tiles", "row_shuffle_inner_product",
    "tile_cost", "tiled_matmul")})
# quant: GGML Q4_0, per-channel INT8/INT4, INT4 + INT8 outlier channels, fake-quant schemes
_EXPORTS.update({name: "dlm_jax.lowering.quant" for name in (
    "MixedInt4", "PerChannel", "QUANT_SCHEMES", "WeightError", "dequantize_q4_0", "fake_quantize",
    "quantize_int4", "quantize_int8", "quantize_mixed", "quantize_per_channel", "quantize_q4_0",
    "salience", "weight_error")})
# graph: the lowered step as data, read from a .tflite signature or built from a ModelConfig
_EXPORTS.update({name: "dlm_jax.lowering.graph" for name in (
    "Op", "StepGraph", "Tensor", "op_flops", "read_tflite_graph", "signatures")})
_EXPORTS["analytic_graph"] = "dlm_jax.lowering._analytic"
# partition: NPU/CPU assignment per bucket (the function is `dlm_jax.lowering.partition.partition`: a package
# attribute of that name would be shadowed by the submodule once it is imported)
_EXPORTS.update({name: "dlm_jax.lowering.partition" for name in ("Partition", "find_lm_head")})
# memory: swap-optimized memory planner, its checker, the cost model and the paging-only baseline
_EXPORTS.update({name: "dlm_jax.techniques.lladacpp.somr" for name in (
    "MemoryPlan", "PlanError", "check_plan", "plan_bundle", "plan_memory", "simulate")})
_EXPORTS.update({"CostModel": "dlm_jax.lowering.costs", "UfsModel": "dlm_jax.lowering.costs", "PagingResult": "dlm_jax.techniques.lladacpp.paging",
                 "paging_only": "dlm_jax.techniques.lladacpp.paging"})
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

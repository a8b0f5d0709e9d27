"""benchmarks/_profile.py: what a kernel's name says it does, and the kernel table with all
kernels' time by kind. A GPU step's kernels beside its GEMMs (norms, RoPE, softmax, the K/V
write) are where a step over its weight-read limit may lose its time; a name put in the
wrong kind would send that search to the wrong place."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _profile import kernel_kind, kernel_table  # noqa: E402


@pytest.mark.parametrize("name, kind", [
    # names from the H200 profiles in benchmarks/results/gpu.json and gpu_step_parts/
    ("gemm_fusion_dot_449", "gemm"),
    ("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN", "gemm"),
    ("input_scatter_fusion_1", "data movement"),
    ("input_transpose_fusion_32", "data movement"),
    ("wrapped_concatenate", "data movement"),
    ("input_concatenate_fusion_95", "data movement"),
    ("input_reduce_fusion_67", "other"),
    ("input_exponential_reduce_fusion_31", "other"),
    ("loop_multiply_fusion_31", "other"),
    ("fusion_1874", "other"),
    # names of the forms other libraries give (none in our profiles yet)
    ("cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_64x4_tn_align8", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_kernel0", "attention"),
    ("__gpu$xla.gpu.triton", "attention"),  # the Pallas kernel's custom call in the HLO (`hlo_kernels`)
    ("dlm_jax_attention", "attention"),  # ... and its name on the device
    ("loop_dynamic_update_slice_fusion", "data movement"),
    ("dot.12", "gemm"),  # a CPU trace's XLA op names
    ("ynn_fusion.25", "gemm"),
    ("fusion.2", "other"),
])
def test_kernels_are_sorted_by_what_their_names_say(name, kind):
    assert kernel_kind(name) == kind


def test_the_table_ends_with_all_kernels_by_kind_where_a_profile_has_them():
    top = [{"kernel": "gemm_fusion_dot_449", "ms_per_step": 5.0, "calls_per_step": 64.0, "share": 2 / 3}]
    kinds = [{"kind": "gemm", "ms_per_step": 5.0, "share": 2 / 3}, {"kind": "other", "ms_per_step": 2.5, "share": 1 / 3}]
    lines = kernel_table({"top": top, "kernels": 7, "kinds": kinds})
    assert lines[2] == "| `gemm_fusion_dot_449` | 5.000 | 64.0 | 66.7% |"
    assert lines[-1] == "All 7 kernels by kind: gemm 5.000 ms (66.7%), other 2.500 ms (33.3%)."
    assert kernel_table({"top": top})[-1] == lines[2]  # a profile from before the kinds: its table alone

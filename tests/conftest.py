"""Shared fixtures and the `slow` / `device` markers (off unless asked for)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Commands run by tests share one persistent XLA cache (the CLI keeps compiled buckets there),
# apart from the user's own ~/.cache.
os.environ.setdefault("DLM_JAX_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"dlm-jax-tests-xla-{os.getuid()}"))
# The test processes themselves too: many tests compile the same buckets of the same models.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["DLM_JAX_CACHE_DIR"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Tests are about the executor they name, the JAX one by default; the default executor
# (auto: the LiteRT runner over the bundle cache on a CPU) is tested where a test clears this
# (tests/executors/test_bundle_cache.py, the docs' commands: tests/test_docs.py). Its cache is private to the tests.
os.environ.setdefault("DLM_JAX_EXECUTOR", "jax")
# No compiles ahead of use in the background: a compile still running after a test would be
# counted by the next one's compile count. tests/runtime/test_prefetch.py turns them on.
os.environ.setdefault("DLM_JAX_COMPILE_THREADS", "0")
os.environ.setdefault("DLM_JAX_BUNDLE_CACHE", os.path.join(tempfile.gettempdir(), f"dlm-jax-tests-bundles-{os.getuid()}"))
# The default executor exports in a background process that outlives the test: off, but where
# tests/executors/test_auto.py turns it on.
os.environ.setdefault("DLM_JAX_BACKGROUND_EXPORT", "0")

import pytest  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")
    parser.addoption("--device", action="store_true", help="run tests that need an accelerator")
    parser.addoption("--users-compile", action="store_true",
                     help="compile as users do (XLA's optimisations; CI's pass of the tests marked users_compile)")


def _jaxlib() -> tuple[int, ...]:
    """The installed jaxlib's release, read without importing JAX (flags must come first)."""
    from importlib.metadata import version

    return tuple(int(x) for x in version("jaxlib").split(".")[:2] if x.isdigit())


def pytest_configure(config: pytest.Config) -> None:
    # The default pass's programs are tiny and run a few times each: compiling them dominates
    # its time, so XLA compiles them at backend optimisation level 0 without its expensive LLVM
    # passes (JAX's `jax_disable_most_optimizations`: "useful if the cost of optimization is
    # greater than that of running a less-optimized program"): about a fifth less CPU time, and
    # the default pass passes whole under it. Two XLA:CPU flags halve what is left of a compile
    # (measured on llada-tiny's and idlm-tiny's decodes: 3.0 s of backend compile to 1.5 s, the
    # decodes' own time unchanged): the classic elemental emitters in place of the MLIR fusion
    # emitters, and each program's LLVM module in one piece rather than split for parallel
    # codegen (two workers share two cores). Set before any test module imports JAX; the
    # commands tests run inherit them. The slow pass compiles so too (about two thirds of its
    # time under XLA's defaults, measured), and may take the default pass's programs from the
    # persistent cache, whose keys include these options (hits not counted). Tests whose
    # claim is about the programs users run (batch invariance: XLA's optimisations reorder sums,
    # and may do so differently for each batch bucket) are marked `users_compile`, and CI runs them once
    # more with --users-compile, which keeps XLA's defaults. jaxlib 0.11 has no classic emitters
    # left, and XLA ends the process at a flag it does not know: the first flag is for older ones.
    if not config.getoption("--users-compile"):
        os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
        fast = (("--xla_cpu_use_fusion_emitters=false",) if _jaxlib() < (0, 11) else ()) + (
            "--xla_cpu_parallel_codegen_split_count=1",)
        flags = os.environ.get("XLA_FLAGS", "").split()
        os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in fast if f.split("=")[0] not in
                                                    {g.split("=")[0] for g in flags}])


# The files that take longest, first (measured with --durations=0 on 2 cores, seconds of one
# worker, 2026-12-03): `make test` hands whole files to its workers (--dist loadfile) in
# collection order, and a long file started last keeps one worker busy after the other has run
# out of work.
LONGEST_FILES = ("tests/test_docs.py",  # 21 s
                 "tests/frontends/test_server.py",  # 16 s
                 "tests/executors/test_in_place_attention.py",  # 14 s
                 "tests/executors/test_runner.py",  # 13 s
                 "tests/checkpoint/test_compressed_tensors.py",  # 12 s
                 "tests/checkpoint/test_gptq_checkpoint.py",  # 12 s (AutoRound's import and quantization)
                 "tests/techniques/lladacpp/test_lladacpp.py",  # 10 s
                 "tests/runtime/test_reference_semantics.py",  # 10 s
                 "tests/runtime/test_infill.py",  # 10 s
                 "tests/runtime/test_warmup.py",  # 10 s
                 "tests/runtime/test_decoder.py")  # 10 s


# The slow pass's longest tests, first (a prefix of their ids; measured with --durations=0 on 2
# cores, 2026-12-02, seconds of one worker: XLA's defaults, then the default pass's compile). .ci/run hands the slow pass's tests to its workers
# one at a time (--dist load --maxschedchunk 1): longest first, the two workers end together
# (as whole files they did not: the mesh tests' 1,200 s kept one worker busy long after the other
# had run out of work, and CI's 90 minutes ran out).
SLOW_LONGEST = ("tests/executors/test_mesh.py::test_every_preset_on_expert_and_data_parallel_meshes",  # 60-330 s
                "tests/test_docs.py::test_console_block[docs/techniques/powerinfer.md:161]",  # 60-150 s
                "tests/benchmarks/test_quant_jax.py::test_quant_jax_reports_the_floor_beside_int8",  # 50-100 s
                "tests/benchmarks/test_tide.py::test_tide_benchmark_reports_its_targets",  # 190 s
                "tests/benchmarks/test_serve.py::test_small_run_against_the_real_server",  # 160 s
                "tests/executors/test_mesh.py::test_every_preset_on_tensor_parallel_meshes",  # 45-105 s
                "tests/executors/test_mesh.py::test_logits_stay_on_a_mesh_of_this_processs_devices",  # 90 s
                "tests/runtime/test_engine_invariance.py::test_every_preset_is_batch_invariant",  # 5-70 s
                "tests/test_packaging.py::test_built_wheel_installs_and_demo_uses_the_shipped_model",  # 60 s
                "tests/executors/test_runner.py::test_a_bundle_exported_for_llada_cpp_holds_every_bucket_it_needs",
                "tests/executors/test_mesh.py::test_two_processes_decode_as_one",  # 55 s
                "tests/benchmarks/test_powerinfer.py::test_powerinfer_benchmark_runs_and_reports",  # 55 s
                "tests/techniques/isd/test_isd.py::test_sampled_isd_total_variation_below_one_percent",  # 40-55 s
                "tests/benchmarks/test_peer.py::test_default_executor_benchmark_compares_the_commands",  # 50 s
                "tests/runtime/test_device_logits.py::test_an_engine_warmed_for_isd_judges",  # 50 s
                "tests/runtime/test_resident.py::test_tokens_equal_the_dense_path",  # 1-47 s
                "tests/benchmarks/test_isd.py::test_isd_benchmark_reports_its_targets",  # 47 s
                "tests/test_bfloat16.py::test_decodes_in_bfloat16_like_float32",  # 5-42 s
                "tests/benchmarks/test_serve_start.py::",  # 39 s
                "tests/test_bfloat16.py::test_decodes_with_a_gpu_s_defaults_like_the_cpu_s",  # 5-36 s
                "tests/runtime/test_infill.py::test_tides_calibration_probe_decodes_the_suffix_too",  # 36 s
                "tests/executors/test_mesh.py::test_serve_on_a_mesh_answers_as_one_device",  # 35 s
                "tests/frontends/test_lmeval.py::test_cli_run_scores_as_dlm_jax_eval",  # 33 s
                "tests/benchmarks/test_first_decode.py::",  # 20-32 s
                "tests/test_docs.py::test_training_block",  # 31 s
                "tests/techniques/tide/test_moe_reduced_precision.py::",  # 25-30 s
                "tests/frontends/test_server.py::test_infill_and_sampling_warm_ups_together",  # 30 s
                "tests/executors/test_fused_projections.py::",  # 30 s
                "tests/techniques/tide/test_expert_policy.py::",  # 20-28 s
                "tests/runtime/test_device_logits.py::",  # 27 s
                "tests/executors/test_mesh.py::")  # 15-27 s


def _slow_rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(SLOW_LONGEST) if nodeid.startswith(prefix)), len(SLOW_LONGEST))


def _whole_suite(config: pytest.Config) -> bool:
    """Whether this session collects every test (no file or directory of its own named)."""
    tests = Path(config.rootpath, "tests")
    return all(Path(config.invocation_params.dir, arg).resolve() == tests for arg in config.args)


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: `-m slow` sees the marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The default pass's longest tests run in the slow pass (tests/slow_by_time.txt, written by
    # tests/pick_slow.py from a --durations report), so that the default pass stays under five minutes.
    from tests.pick_slow import read_list

    listed = read_list()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    if _whole_suite(config):
        gone = sorted(set(listed) - {item.nodeid for item in items})
        if gone:
            raise pytest.UsageError(f"tests/slow_by_time.txt names {len(gone)} test(s) that do not exist "
                                    f"(renamed or removed? delete their lines): {', '.join(gone[:5])}")
    if config.getoption("--runslow"):
        items.sort(key=lambda item: _slow_rank(item.nodeid))  # stable: the rest as collected
    else:
        first = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(pytest.mark.skip(reason="slow: pass --runslow"))
        if "device" in item.keywords and not config.getoption("--device"):
            item.add_marker(pytest.mark.skip(reason="needs an accelerator: pass --device"))

"""Shared fixtures and the `slow` / `device` markers (off unless asked for)."""

from __future__ import annotations

import os
import tempfile

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


def pytest_configure(config: pytest.Config) -> None:
    # The default pass's programs are tiny and run a few times each: compiling them dominates
    # its time, so XLA compiles them at backend optimisation level 0 without its expensive LLVM
    # passes (JAX's `jax_disable_most_optimizations`: "useful if the cost of optimization is
    # greater than that of running a less-optimized program"): about a fifth less CPU time, and
    # the default pass passes whole under it. Set before any test module imports JAX; the
    # commands tests run inherit it. The slow pass (--runslow: long training runs and decodes,
    # where running time counts) compiles as users do.
    if not config.getoption("--runslow"):
        os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


# The files that take longest, first (measured with --durations=0 on 2 cores, seconds of one
# worker, 2026-11-29): `make test` hands whole files to its workers (--dist loadfile) in
# collection order, and a long file started last keeps one worker busy after the other has run
# out of work.
LONGEST_FILES = ("tests/test_docs.py",  # 53 s
                 "tests/techniques/isd/test_isd.py",  # 32 s
                 "tests/models/test_cache_equivalence.py",  # 25 s
                 "tests/frontends/test_server.py",  # 22 s
                 "tests/executors/test_fused_projections.py",  # 20 s
                 "tests/training/test_run_safety.py",  # 16 s
                 "tests/checkpoint/test_parity.py",  # 15 s
                 "tests/executors/test_runner.py",  # 15 s
                 "tests/frontends/test_lmeval.py",  # 15 s
                 "tests/training/test_shipped_models.py",  # 14 s
                 "tests/techniques/lladacpp/test_lladacpp.py",  # 14 s
                 "tests/models/test_moe_dispatch.py",  # 13 s
                 "tests/models/test_quant.py")  # 13 s


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest as collected
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(pytest.mark.skip(reason="slow: pass --runslow"))
        if "device" in item.keywords and not config.getoption("--device"):
            item.add_marker(pytest.mark.skip(reason="needs an accelerator: pass --device"))

"""The default executor on a CPU (`dlm_jax.executors.auto.AutoExecutor`): a decode never waits for an
export (JAX runs it while a background process exports), the next decode after the export runs on
LiteRT with the same tokens, and a failed or disabled background export leaves decodes on JAX."""

from __future__ import annotations

from pathlib import Path

import pytest

import dlm_jax
from dlm_jax.api import resolve_executor
from dlm_jax.executors.auto import BACKGROUND_ENV, AutoExecutor

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "llada-tiny"
CFG = dict(gen_len=32)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DLM_JAX_BUNDLE_CACHE", str(tmp_path / "bundles"))
    monkeypatch.delenv("DLM_JAX_EXECUTOR", raising=False)
    return tmp_path / "bundles"


def test_auto_on_a_cpu_is_jax_then_litert_unless_the_model_is_overridden(cache):
    model = dlm_jax.load(TINY)
    assert isinstance(model.executor, AutoExecutor)
    assert resolve_executor(None, model.config) == "jax-then-litert"
    assert resolve_executor("auto", model.config.replace(dtype="bfloat16")) == "jax"
    # An overridden model cannot be exported by another process (it loads the stored one).
    assert not isinstance(dlm_jax.load(TINY, max_seq_len=256).executor, AutoExecutor)


def test_with_background_export_off_a_first_decode_runs_on_jax_and_starts_nothing(cache, monkeypatch):
    monkeypatch.setenv(BACKGROUND_ENV, "0")
    model = dlm_jax.load(TINY)
    res = model.generate(["564+894="], dlm_jax.preset("fast-dllm", **CFG))
    assert res.texts == ["1458"] and model.executor.current == "jax"
    assert res.stats.exports == 0 and model.executor._export.started == 0
    assert not cache.exists() or not any(cache.glob("*/part-*"))


def test_a_failed_background_export_is_not_started_again(cache, monkeypatch):
    """A child that refuses (here: told to export another model's entry) exits non-zero; the
    decodes go on with JAX and no second child is started."""
    monkeypatch.setenv(BACKGROUND_ENV, "1")
    model = dlm_jax.load(TINY)
    model.executor._export.source = str(ROOT / "models" / "llada-12m")  # names another cache entry
    model.generate(["564+894="], dlm_jax.preset("fast-dllm", **CFG))
    assert model.executor._export.started == 1
    assert model.executor.wait_for_export(300) == 2
    res = model.generate(["66+76="], dlm_jax.preset("fast-dllm", **CFG))
    assert res.texts == ["142"] and model.executor.current == "jax"
    assert model.executor._export.started == 1 and model.executor._export.failed == 2
    log = next(cache.glob("*.export.log")).read_text()
    assert "names the cache entry" in log and "nothing exported" in log


@pytest.mark.slow  # (4 s: an export)
def test_a_decode_during_a_background_export_equals_the_decodes_after_it(cache, monkeypatch):
    monkeypatch.setenv(BACKGROUND_ENV, "1")
    cfg = dlm_jax.preset("fast-dllm", **CFG)
    prompts = ["564+894=", "sort: 37 44 13 33 47 48"]
    model = dlm_jax.load(TINY)
    during = model.generate(prompts, cfg)
    assert model.executor.current == "jax" and during.stats.exports == 0  # nothing exported in this process
    assert model.executor.exporting or model.executor._export.started == 1
    assert model.executor.wait_for_export(600) == 0
    after = model.generate(prompts, cfg)
    assert model.executor.current == "litert" and after.stats.exports == 0
    assert after.token_ids == during.token_ids
    # A new process finds the buckets cached: its first decode runs on LiteRT, same tokens.
    fresh = dlm_jax.load(TINY)
    again = fresh.generate(prompts, cfg)
    assert fresh.executor.current == "litert" and fresh.executor._export.started == 0
    assert again.token_ids == during.token_ids

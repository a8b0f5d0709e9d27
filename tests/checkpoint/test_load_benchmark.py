"""`benchmarks/load.py` runs end to end on a tiny checkpoint, and the loader it compares against
(main's, before streaming loads) gives the parameters the streaming loader gives, bit for bit,
in every layout (dense, experts, tied head, LLaDA's names)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import dlm_jax  # noqa: E402

from .hf_models import build, llama_to_llada  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import load  # noqa: E402


def _check_fields(result, loaders):
    assert {"machine", "params", "checkpoint_mib", "shards", "repeats", "loaders"} <= result.keys()
    assert result["machine"]["cores"] >= 1 and result["machine"]["cpu"]
    assert result["params"] == 172_352 and result["shards"] == 1 and result["checkpoint_mib"] > 0
    assert list(result["loaders"]) == loaders
    for r in result["loaders"].values():
        assert r["seconds"] > 0 and len(r["runs"]) == result["repeats"]
        assert r["peak_rss_mib"] >= r["rss_before_mib"] > 0 and r["device"]
    for name in loaders:
        assert f"| {name} |" in load.markdown(result)


@pytest.mark.slow  # (3 s, as most benchmark scripts' runs: CI's slow pass runs it)
def test_benchmark_reports_every_field(tmp_path):
    """One loader, one process, the checkpoint written by dlm-jax in the Llama layout (starting
    torch and transformers takes seconds: the slow test runs the benchmark as it is)."""
    spec = load.SIZES["tiny"]
    cfg = dlm_jax.ModelConfig(vocab_size=spec["vocab_size"], d_model=spec["hidden_size"],
                              n_layers=spec["num_hidden_layers"], n_heads=spec["num_attention_heads"],
                              ffn_hidden=spec["intermediate_size"], attention="causal", logit_shift=True,
                              param_dtype="bfloat16", mask_token_id=spec["vocab_size"] - 1)
    dlm_jax.save_pretrained(dlm_jax.init_model(cfg), load.checkpoint_path(tmp_path, "tiny"), family="llama")
    _check_fields(load.run(size="tiny", repeats=1, directory=tmp_path, loaders=["dlm_jax"]), ["dlm_jax"])


@pytest.mark.slow
def test_benchmark_against_torch_and_main(tmp_path):
    result = load.run(size="tiny", repeats=1, directory=tmp_path, baseline=True)
    _check_fields(result, ["dlm_jax", "dlm_jax_params", "dlm_jax_before", "torch"])
    r = result["loaders"]
    assert result["ratio"] == pytest.approx(r["dlm_jax"]["seconds"] / r["torch"]["seconds"], rel=0.01)
    assert result["ratio_params"] == pytest.approx(r["dlm_jax_params"]["seconds"] / r["torch"]["seconds"], rel=0.01)
    assert result["speedup_over_before"] == pytest.approx(r["dlm_jax_before"]["seconds"] / r["dlm_jax"]["seconds"], rel=0.01)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_tied", "llada"])
def test_streaming_loader_gives_main_loaders_parameters(kind, tmp_path):
    if kind == "llada":
        build("llama").save_pretrained(tmp_path / "llama")
        llama_to_llada(tmp_path / "llama", tmp_path / "src", mask_token_id=95)
    else:
        build(kind).save_pretrained(tmp_path / "src")
    for overrides in ({}, {"param_dtype": "bfloat16"}):
        ours = dlm_jax.get_params(dlm_jax.load_pretrained(tmp_path / "src", **overrides))
        before = dlm_jax.get_params(load._before_load_pretrained(tmp_path / "src", **overrides))
        assert ours.keys() == before.keys()
        for name in ours:
            assert ours[name].dtype == before[name].dtype, name
            np.testing.assert_array_equal(ours[name].view(np.uint8), before[name].view(np.uint8), err_msg=name)

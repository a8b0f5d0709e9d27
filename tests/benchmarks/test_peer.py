"""The PyTorch peer decodes exactly like dlm-jax (same tokens and NFE for every cache mode and
both rules, batch 1 and 3), so the speed ratios of `benchmarks/peer.py` compare the same work;
and both speed benchmarks run end to end on a small case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dlm_jax  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _models import prompts_for  # noqa: E402
from torch_decoder import TorchModel, decode  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    handle = dlm_jax.load(ROOT / "models" / "llada-tiny")
    return handle, TorchModel(dlm_jax.get_params(handle.model), handle.config, threads=1)


def test_peer_logits_match_the_jax_model(pair):
    handle, peer = pair
    tokens = np.array([handle.encode("564+894=")], np.int32)
    want = np.asarray(handle.model(tokens).logits)
    got, _ = peer.forward(torch.from_numpy(tokens).long(), torch.arange(tokens.shape[1]), slice(None))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


# Batch 3 (rows of one length side by side) in the default pass for every mode under the
# threshold rule; batch 1 (the same decode on one row) and the top-k rule in the slow pass.
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("mode", ["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", ["threshold", pytest.param("topk", marks=pytest.mark.slow)])
def test_peer_decodes_like_dlm_jax(pair, mode, rule, batch):
    handle, peer = pair
    prompts = prompts_for("llada-tiny", handle, batch)
    kw = {"threshold": 0.9} if rule == "threshold" else {"steps": 32}
    out = handle.decoder.decode(prompts, dlm_jax.decode_config(gen_len=64, block_len=32, cache=mode, rule=rule, **kw))
    seqs, nfe = decode(peer, prompts, gen_len=64, block_len=32, mode=mode, rule=rule, **kw)
    assert nfe == out.stats.nfe
    for a, b in zip(seqs, out.sequences):
        np.testing.assert_array_equal(a, b)


def test_peer_refuses_what_it_cannot_run(pair):
    handle, peer = pair
    with pytest.raises(ValueError, match="one length"):
        decode(peer, [[1, 2], [1, 2, 3]], gen_len=32)
    causal = dlm_jax.load(ROOT / "models" / "idlm-tiny")
    with pytest.raises(ValueError, match="dense bidirectional"):
        TorchModel(dlm_jax.get_params(causal.model), causal.config)


@pytest.mark.slow  # about 15 s: runs the peer benchmark end to end
def test_peer_benchmark_runs_and_checks_tokens(tmp_path):
    out = tmp_path / "peer"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer.py"), "--models", "llada-tiny",
                           "--gens", "32", "--batches", "1", "--modes", "prefix", "--no-litert", "llada-tiny",
                           "--no-memory", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    (case,) = report["cases"]
    assert case["same_tokens_as_torch"] == {"jax": True} and case["same_nfe_as_torch"] == {"jax": True}
    assert case["torch_over"]["jax"] > 0 and report["targets"]["all_tokens_and_nfe_equal"]
    # the warm-up (the decoder's, with the decode's slots) leaves nothing to build in a timed decode
    assert case["built_while_timed"] == {"jax": 0, "torch": 0}
    assert out.with_suffix(".png").stat().st_size > 0 and "| llada-tiny prefix 32 |" in out.with_suffix(".md").read_text()


@pytest.mark.slow  # about 12 s: runs the roofline benchmark end to end
def test_roofline_benchmark_splits_every_step(tmp_path):
    out = tmp_path / "roofline"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "roofline.py"), "--models", "llada-tiny",
                           "--gens", "32", "--modes", "prefix", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (decode_,) = json.loads(out.with_suffix(".json").read_text())["models"][0]["decodes"]
    assert sum(b["steps"] for b in decode_["buckets"]) == decode_["nfe"]
    phases = decode_["phase_seconds"]
    assert set(phases) == {"prep", "h2d", "compute", "d2h", "decide"} and all(v > 0 for v in phases.values())
    for b in decode_["buckets"]:
        assert b["flops"] > 0 and b["bytes"] > 0 and 0 <= b["padding_waste"] < 1 and b["gflops"] > 0
        assert 0 < b["live"]["window"] <= int(b["bucket"].split("_w")[1].split("_")[0])


@pytest.mark.slow  # about 25 s: exports a bundle cache and runs four CLI processes
def test_default_executor_benchmark_compares_the_commands(tmp_path):
    """`benchmarks/default_executor.py` on one small case: both executors' cold and warm runs of
    `dlm-jax generate`, with equal tokens."""
    out = tmp_path / "default"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "default_executor.py"), "--models", "llada-tiny",
                           "--caches", "dual", "--gen", "32", "--warm", "1", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (case,) = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert case["same_tokens"] and case["same_nfe"]
    for ex in ("jax", "auto"):
        assert case[ex]["cold_wall_s"] > 0 and case[ex]["warm_decode_s"] > 0 and case[ex]["peak_rss_mb"] > 0
    assert out.with_suffix(".png").stat().st_size > 0 and "| llada-tiny dual 32 |" in out.with_suffix(".md").read_text()

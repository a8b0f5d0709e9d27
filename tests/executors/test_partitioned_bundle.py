"""The partitioned bundle: the lowering's NPU/CPU split is the programs that run (tile-aligned
NPU bodies, a CPU head, the embedding as a NumPy table), and it decodes exactly like the
unpartitioned bundle of the same weights in float32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.executors.partition_contract import Programs, tiled
from dlm_jax.executors.partitioned import pad_window
from dlm_jax.executors.runner import load_bundle
from dlm_jax.runtime import BucketKey
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.tflite_export.bundle import _Sizes, export_bundle
from dlm_jax.training.data import TASKS, make_split

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [dlm_jax.decode_config(cache="prefix", rule="threshold", gen_len=32, block_len=16),
           dlm_jax.decode_config(cache="none", rule="topk", gen_len=32, block_len=16, steps=16),
           dlm_jax.decode_config(cache="dual", rule="threshold", gen_len=32, block_len=16)]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    model = dlm_jax.load(ROOT / "models" / "llada-tiny")
    prompts = [model.encode(ex.prompt) for t in TASKS for ex in make_split(TASKS[t], 1, split="heldout")]
    decoder = Decoder(_Sizes(model.config), model.config)
    keys = set()
    for cfg in CONFIGS:
        for prompt in prompts:
            keys |= set(decoder.bucket_keys([len(prompt)], cfg))
    root = tmp_path_factory.mktemp("bundles")
    for name, partition in (("plain", False), ("part", True)):
        export_bundle(ROOT / "models" / "llada-tiny", root / name, keys=keys, decode=CONFIGS[0], latency_repeats=1,
                      partition=partition)
    return model, root, prompts, sorted(keys)


@pytest.mark.slow  # (over the default suite's 5-minute budget on 2 cores; .ci/run runs the slow tests)
def test_the_bundle_records_its_programs_and_their_devices(bundles):
    _, root, _, keys = bundles
    meta = json.loads((root / "part" / "bundle.json").read_text())
    part = meta["partition"]
    programs = Programs.for_keys(keys)
    assert part["tile"] == 32 and not part["sparse"]
    assert len(part["npu"]) == len(programs.bodies) and all(n.startswith("npu_w") for n in part["npu"])
    assert all(int(n.split("_w")[1].split("_")[0]) % 32 == 0 for n in part["npu"])  # tile-aligned rows
    assert "embedding (NumPy)" in part["cpu"] and any(n.startswith("head_r") for n in part["cpu"])
    plan = json.loads((root / "part" / "plan.json").read_text())
    assert plan["partitioned"] and set(plan["programs"]) == set(part["npu"]) | {
        n for n in part["cpu"] if n.startswith("head_")}
    assert all(plan["programs"][n]["device"] == "npu" for n in part["npu"])


@pytest.mark.slow  # (over the default suite's 5-minute budget on 2 cores; .ci/run runs the slow tests)
def test_partitioned_decodes_exactly_like_the_unpartitioned_bundle(bundles):
    model, root, prompts, _ = bundles
    plain, part = load_bundle(root / "plain"), load_bundle(root / "part")
    for cfg in CONFIGS:
        for prompt in prompts:
            want = plain.decoder.decode([prompt], cfg)
            got = part.decoder.decode([prompt], cfg)
            np.testing.assert_array_equal(got.sequences[0], want.sequences[0])
            assert got.stats.nfe == want.stats.nfe


def test_rows_pad_to_the_tile_and_padding_is_invisible():
    from dlm_jax.runtime.step import StepInputs

    b, w, p = 1, 5, 3
    vis = np.ones((b, w, p + w), bool)
    inputs = StepInputs(tokens=np.zeros((b, w), np.int32), positions=np.arange(w, dtype=np.int32)[None] + p,
                        visibility=vis, k_cache=np.zeros((2, b, p, 1, 4), np.float32),
                        v_cache=np.zeros((2, b, p, 1, 4), np.float32), logit_rows=np.zeros((b, 1), np.int32))
    hidden, positions, padded = pad_window(inputs, np.ones((b, w, 8), np.float32))
    assert hidden.shape == (1, tiled(w), 8) and not hidden[:, w:].any()
    assert padded.shape == (1, 32, p + 32)
    assert padded[:, :w, :p + w].all() and not padded[:, :w, p + w:].any()  # no real row sees a padded one
    assert (padded[:, w:, p:].sum(-1) == 1).all() and padded[0, w, p + w]  # padded rows see themselves only


def test_mixture_of_experts_and_activity_buckets_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="neither routed experts nor neuron activity"):
        Programs.for_keys([BucketKey(1, 8, 8, 8, ffn_active=True)])
    with pytest.raises(ConfigError, match="MoE"):
        export_bundle(ROOT / "models" / "moe-tiny", tmp_path / "b", keys=[BucketKey(1, 32, 32, 32)],
                      decode=CONFIGS[0], partition=True)

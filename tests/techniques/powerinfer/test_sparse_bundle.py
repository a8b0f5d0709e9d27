"""The sparse bundle: each layer's hot neurons run in its NPU program, the cold ones on the
CPU path from a neuron cache over the bundle's flash file. With oracle activations it decodes
exactly like the unpartitioned bundle; with the predictor it decodes; a budget below the
resident part is refused naming both numbers; a damaged flash file is named when the bundle
opens."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dlm_jax
from dlm_jax import CheckpointError, ConfigError
from dlm_jax.executors.runner import Bundle, load_bundle
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.testing import tiny_checkpoint
from dlm_jax.tflite_export.bundle import _Sizes, export_bundle
from dlm_jax.techniques.powerinfer.sparse import (decode_statistics, ffn_samples, neuron_bytes, plan_sparse, record_windows,
                                  train_predictor)

# A module fixture exports a sparse bundle (about 9 s on 2 cores): over the default suite's
# 5-minute budget; .ci/run runs the slow tests.
pytestmark = pytest.mark.slow

CONFIG = dlm_jax.decode_config(cache="prefix", rule="threshold", gen_len=16, block_len=8)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse")
    path = tiny_checkpoint(root / "m", seed=3, ffn="reglu", ffn_hidden=96)
    model = dlm_jax.load(path)
    prompts = [model.encode(p, chat=False) for p in ("12+34=", "sort 5 3 1:", "abc")]
    stats = decode_statistics(model, prompts, CONFIG)
    predictor, report = train_predictor(ffn_samples(model.model, record_windows(model, prompts, CONFIG)),
                                        model.config, steps=60, batch=64)
    keys = set()
    decoder = Decoder(_Sizes(model.config), model.config)
    for p in prompts:
        keys |= set(decoder.bucket_keys([len(p)], CONFIG))
    plan = plan_sparse(model.config, stats, predictor, windows=[32], budget_mb=1.0, resident_bytes=20_000,
                       cluster=32)
    export_bundle(path, root / "sparse", keys=keys, decode=CONFIG, latency_repeats=0, sparse=plan)
    export_bundle(path, root / "plain", keys=keys, decode=CONFIG, latency_repeats=0)
    return model, root, prompts, plan, report


def test_oracle_sparse_decodes_exactly_like_the_dense_bundle(sparse):
    model, root, prompts, plan, _ = sparse
    plain = load_bundle(root / "plain")
    oracle = load_bundle(root / "sparse", oracle=True)
    for prompt in prompts:
        want = plain.decoder.decode([prompt], CONFIG)
        got = oracle.decoder.decode([prompt], CONFIG)
        np.testing.assert_array_equal(got.sequences[0], want.sequences[0])
        assert got.stats.nfe == want.stats.nfe
    counters = oracle.executor.cold.counters
    assert counters.neurons > 0 and counters.misses + counters.prefetched > 0 and counters.bytes_read > 0


def test_the_bundle_holds_the_plan_flash_file_and_predictor(sparse):
    model, root, _, plan, report = sparse
    meta = json.loads((root / "sparse" / "bundle.json").read_text())
    part = meta["partition"]
    assert part["sparse"] and part["neuron_bytes"] == neuron_bytes(model.config)
    assert all(f"_l{i}_" in " ".join(part["npu"]) for i in range(model.config.n_layers))
    for name in (part["flash"], part["neurons"], part["predictor"]):
        assert (root / "sparse" / name).is_file()
    hot = json.loads((root / "sparse" / part["neurons"]).read_text())["hot"]
    assert all(h % 32 == 0 and 0 < h < 96 for counts in hot.values() for h in counts)  # whole clusters, some cold
    assert len(report.recall) == model.config.n_layers


def test_predicted_sparse_decodes_and_counts_its_reads(sparse):
    _, root, prompts, _, _ = sparse
    runner = load_bundle(root / "sparse", memory_budget_mb=1.0, pipeline=False)
    out = runner.decoder.decode([prompts[0]], CONFIG)
    assert out.sequences[0].shape[0] > 0
    c = runner.executor.cold.counters
    assert c.requests > 0 and c.bytes_read >= c.misses * 4096  # one aligned bundle or more per miss run


def test_the_prefetch_region_turns_cold_start_misses_into_hits_and_keeps_tokens(sparse):
    _, root, prompts, _, _ = sparse
    runs = {}
    for ahead in (False, True):
        runner = load_bundle(root / "sparse", memory_budget_mb=1.0, oracle=True, prefetch=ahead)
        cold = runner.executor.cold
        runner.decoder.warmup([len(prompts[0])], CONFIG)
        cold.reset()  # a cold start, as after loading
        cold.read_ahead(wait=True)  # (the decode would queue it at its first step; waiting makes the count exact)
        out = runner.decoder.decode([prompts[0]], CONFIG)
        c = cold.counters
        assert cold.cache.resident_bytes <= cold.cache.capacity_bytes  # the budget holds with the prefetch
        runs[ahead] = (out.sequences[0], c.misses, c.prefetched, c.hits)
        cold.close()
    np.testing.assert_array_equal(runs[True][0], runs[False][0])  # prefetch is lossless
    assert runs[False][2] == 0 and runs[True][2] > 0
    assert runs[True][1] < runs[False][1] and runs[True][3] > runs[False][3]


def test_prefetch_takes_each_layers_next_cold_neurons_in_plan_order():
    from dlm_jax.techniques.powerinfer.cold_path import prefetch_order

    prob = np.array([[0.9, 0.5, 0.0, 0.3], [0.8, 0.7, 0.6, 0.05]])
    order = np.array([[0, 1, 3, 2], [0, 1, 2, 3]])  # hottest first
    first_cold = np.array([1, 0])  # layer 0's neuron 0 is hot
    got = prefetch_order(prob, order, first_cold, 4)
    assert [g.tolist() for g in got] == [[1], [0, 1, 2]]  # 0.8, 0.7, 0.6, 0.5 shared out; never the hot one
    got = prefetch_order(prob, order, first_cold, 100)
    assert [g.tolist() for g in got] == [[1, 3], [0, 1, 2, 3]]  # a never-active neuron (p = 0) is not read
    with pytest.raises(ConfigError, match="must agree"):
        prefetch_order(prob, order[:1], first_cold, 2)


def test_a_budget_below_the_resident_part_names_both_numbers(sparse):
    _, root, _, _, _ = sparse
    with pytest.raises(ConfigError, match=r"memory budget 0.01 MB is below the resident minimum [0-9.]+ MB"):
        load_bundle(root / "sparse", memory_budget_mb=0.01)


def test_a_damaged_flash_file_is_named_when_the_bundle_opens(sparse, tmp_path):
    import shutil

    _, root, _, _, _ = sparse
    copy = tmp_path / "b"
    shutil.copytree(root / "sparse", copy)
    flash = copy / "ffn.flash"
    data = bytearray(flash.read_bytes())
    data[-100] ^= 0xFF
    flash.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="ffn.flash"):
        Bundle.open(copy)


def test_sparse_needs_a_relu_family_model(tmp_path):
    path = tiny_checkpoint(tmp_path / "m", seed=0)
    model = dlm_jax.load(path)
    with pytest.raises(ConfigError, match="ReLU-family"):
        export_bundle(path, tmp_path / "b", keys=[dlm_jax.runtime.BucketKey(1, 8, 8, 8)], decode=CONFIG,
                      sparse=object(), model=model.model, tokenizer=model.tokenizer)

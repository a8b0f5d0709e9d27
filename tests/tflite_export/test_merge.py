"""Merging bundles (`dlm_jax.tflite_export.merge`), what the bundle cache compacts an entry with.

A merged bundle must decode exactly the tokens its parts decode, hold every signature of
every part, store each weight once (about one part's size, not their sum), keep decoding in a
process that opened a part before it was removed, and refuse what it cannot merge.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import dlm_jax
from dlm_jax import CheckpointError, ConfigError
from dlm_jax._integrity import write_manifest
from dlm_jax.executors.runner import Bundle, LiteRTExecutor, load_bundle, zero_inputs
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.tflite_export.bundle import _Sizes, export_bundle
from dlm_jax.tflite_export.cache_admin import remove_tree
from dlm_jax.tflite_export.merge import merge_bundles, merge_tflite

TINY = Path(__file__).resolve().parents[2] / "models" / "llada-tiny"
DECODE = dlm_jax.decode_config(cache="dual", gen_len=32)
# A short and a long prompt: the dual cache's buckets for one are not the other's.
PROMPTS = ["564+894=", "12+34=46 56+78=134 90+12=102 345+67=412 564+894="]


def _export_parts(tmp: Path, quant: str = "none") -> tuple[dict[str, Path], Path]:
    """Two bundles of llada-tiny (with its tokenizer), one per prompt, two buckets each; their
    merge. Returns ({prompt: part}, merged)."""
    model = dlm_jax.load(TINY, executor="jax")
    decoder = Decoder(_Sizes(model.config), model.config)
    out = {}
    for i, prompt in enumerate(PROMPTS):
        keys = decoder.bucket_keys([len(model.encode(prompt))], DECODE)
        out[prompt] = export_bundle(TINY, tmp / f"part-{i}", keys=keys, decode=DECODE, quant=quant,
                                    latency_repeats=0, plan=False).path
    assert not set(Bundle.open(out[PROMPTS[0]]).keys) & set(Bundle.open(out[PROMPTS[1]]).keys)
    return out, merge_bundles(list(out.values()), tmp / "merged").path


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return _export_parts(tmp_path_factory.mktemp("merge"))


def _data_buffers(bundle: Path) -> list[bytes]:
    from ai_edge_litert import schema_py_generated as schema

    model = schema.Model.GetRootAs((bundle / "model.tflite").read_bytes(), 0)
    return [model.Buffers(i).DataAsNumpy().tobytes() for i in range(model.BuffersLength())
            if model.Buffers(i).DataLength()]


def _signatures(bundle: Path) -> dict[str, dict]:
    from ai_edge_litert.compiled_model import CompiledModel

    return CompiledModel.from_buffer((bundle / "model.tflite").read_bytes()).get_signature_list()


def test_a_merged_bundle_decodes_the_same_tokens_as_its_parts(parts):
    separate, merged = parts
    through_merged = load_bundle(merged)
    for prompt, part in separate.items():
        want = load_bundle(part).generate(prompt, DECODE)
        got = through_merged.generate(prompt, DECODE)
        assert got.token_ids == want.token_ids and got.stats.nfe == want.stats.nfe
        assert got.stats.buckets == want.stats.buckets


@pytest.mark.slow
def test_quantised_bundles_merge_too_their_constants_read_from_after_the_flatbuffer(tmp_path):
    """The quantizer keeps constants after the flatbuffer (`offset`/`size`): the merge reads
    them in, stores each once, and the merged bundle decodes what its parts decode."""
    separate, merged = _export_parts(tmp_path, quant="int8")
    through_merged = load_bundle(merged)
    for prompt, part in separate.items():
        assert through_merged.generate(prompt, DECODE).token_ids == load_bundle(part).generate(prompt, DECODE).token_ids
    sizes = [(p / "model.tflite").stat().st_size for p in separate.values()]
    assert max(sizes) < (merged / "model.tflite").stat().st_size < sum(sizes)
    assert Bundle.open(merged).quant == "int8"


def test_a_merged_bundle_holds_every_signature_of_every_part_and_the_union_of_buckets(parts):
    separate, merged = parts
    signatures = _signatures(merged)
    for part in separate.values():
        for name, io in _signatures(part).items():
            assert signatures[name] == io
    assert sorted(Bundle.open(merged).keys) == sorted(k for p in separate.values() for k in Bundle.open(p).keys)
    meta = json.loads((merged / "bundle.json").read_text())
    assert meta["merged_from"] == 2 and meta["bytes"]["model"] == (merged / "model.tflite").stat().st_size
    assert (merged / "tokenizer.json").exists() or any(merged.glob("tokenizer*"))


def test_a_merged_bundle_stores_each_weight_once(parts):
    separate, merged = parts
    sizes = [(p / "model.tflite").stat().st_size for p in separate.values()]
    merged_size = (merged / "model.tflite").stat().st_size
    weights = 4 * dlm_jax.param_count(Bundle.open(merged).config)
    assert merged_size < sum(sizes)
    # The weights once, plus each part's graphs (what is not constant data).
    graphs = sum(size - sum(map(len, _data_buffers(p))) for size, p in zip(sizes, separate.values()))
    data = _data_buffers(merged)
    assert merged_size <= sum(map(len, data)) + 1.1 * graphs
    digests = [hashlib.sha256(b).digest() for b in data]
    assert len(set(digests)) == len(digests)  # no buffer twice
    big = sum(len(b) for b in data if len(b) >= 4096)  # the weight matrices
    assert 0.95 * weights <= big <= 1.02 * weights


def test_a_signature_given_twice_is_merged_once_with_its_subgraph(parts):
    from ai_edge_litert import schema_py_generated as schema

    content = (next(iter(parts[0].values())) / "model.tflite").read_bytes()
    twice = schema.Model.GetRootAs(merge_tflite([content, content]), 0)
    once = schema.Model.GetRootAs(content, 0)
    assert twice.SignatureDefsLength() == twice.SubgraphsLength() == once.SubgraphsLength()


def test_an_opened_part_keeps_decoding_after_its_directory_is_removed(parts, tmp_path):
    separate, _ = parts
    copy = tmp_path / "part"
    shutil.copytree(separate[PROMPTS[0]], copy)
    runner = LiteRTExecutor(Bundle.open(copy))
    key = Bundle.open(copy).keys[0]
    inputs = zero_inputs(runner.config, key)
    before = runner.step(inputs)
    remove_tree(copy)
    assert not copy.exists()
    after = runner.step(inputs)
    np.testing.assert_array_equal(after.top_token, before.top_token)


def test_merging_refuses_external_or_broken_buffers_and_bundles_of_other_models(parts, tmp_path, monkeypatch):
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    separate, _ = parts
    first = next(iter(separate.values()))
    content = (first / "model.tflite").read_bytes()

    def changed(change) -> bytes:
        model = schema.ModelT.InitFromPackedBuf(content, 0)
        change(model)
        builder = flatbuffers.Builder(0)
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())

    def past_the_end(model):
        model.buffers[1].offset, model.buffers[1].size = 1 << 32, 16

    def external(model):
        model.externalBuffers = [schema.ExternalBufferT()]

    with pytest.raises(ConfigError, match="past the end of the file"):
        merge_tflite([changed(past_the_end)])
    with pytest.raises(ConfigError, match="external buffers"):
        merge_tflite([content, changed(external)])
    monkeypatch.setattr("dlm_jax.tflite_export.merge._FLATBUFFER_LIMIT", 1000)
    with pytest.raises(ConfigError, match="exceed what one flatbuffer holds"):
        merge_tflite([content])
    monkeypatch.undo()
    other = tmp_path / "other"
    shutil.copytree(first, other)
    meta = json.loads((other / "bundle.json").read_text())
    meta["config"]["n_layers"] += 1
    (other / "bundle.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="sha256|truncated"):  # the manifest no longer matches
        merge_bundles([first, other], tmp_path / "out")
    write_manifest(other)
    with pytest.raises(ConfigError, match="cannot merge"):
        merge_bundles([first, other], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))

"""The lowered step graph: read from the real llada-tiny `.tflite`, built analytically from its
config, and the two agree.

The analytic graph plans models too large to convert here (LLaDA-8B); if its weights or
matmul shapes drifted from what the exporter really emits, every plan made from it would
price and place the wrong tensors with no error anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from dlm_jax import ModelConfig
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.lowering._analytic import analytic_graph
from dlm_jax.lowering.graph import (MATMUL_OPS, Op, StepGraph, Tensor, op_flops, read_tflite_graph,
                            signatures)
from tests.lowering._tiny_step import KEYS, tiny_step
from dlm_jax.tflite_export import decode_signature_name

LLADA_8B = ModelConfig(vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=12288,
                       dtype="float16", param_dtype="float16")


@pytest.fixture(scope="module")
def exported():
    return tiny_step()


@pytest.fixture(scope="module")
def graphs(exported):
    _, content = exported
    return {key: read_tflite_graph(content, decode_signature_name(key)) for key in KEYS}


def matmul_weights(graph: StepGraph) -> Counter:
    return Counter(graph.tensors[w].shape for op in graph.ops if op.opcode in MATMUL_OPS for w in graph.weights(op))


def boundary_shapes(graph: StepGraph, kind: str) -> list:
    return sorted(graph.tensors[t].shape for t in (*graph.inputs, *graph.outputs) if graph.tensors[t].kind == kind)


def test_signatures_are_listed_in_file_order(exported):
    assert signatures(exported[1]) == [decode_signature_name(k) for k in KEYS]


def test_unknown_signature_is_named(exported):
    with pytest.raises(KeyError, match="step_w999"):
        read_tflite_graph(exported[1], "step_w999")


def test_tensor_kinds_follow_the_step_contract(graphs):
    g = graphs[KEYS[0]]
    by_suffix = {t.name.rsplit("_r32_", 1)[-1]: t for t in g.tensors if t.name.startswith("step_w32_p64_r32_")}
    assert by_suffix["k_cache"].kind == by_suffix["v_cache"].kind == "kv"
    assert by_suffix["k_new_output"].kind == by_suffix["v_new_output"].kind == "kv"
    assert by_suffix["tokens"].kind == by_suffix["logit_rows"].kind == "input"
    assert by_suffix["top_token_output"].kind == "output"
    assert by_suffix["k_cache"].shape == (4, 1, 64, 2, 32)
    opcodes = {op.opcode for op in g.ops}
    assert {"FULLY_CONNECTED", "BATCH_MATMUL", "SOFTMAX", "ARG_MAX", "REDUCE_MAX"} <= opcodes
    assert all(t.nbytes > 0 for t in g.tensors if t.kind == "weight")


def test_weights_shared_across_signatures_are_one_buffer(graphs, exported):
    config, _ = exported
    params = 2 * 264 * 128 + 4 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 384 * 128 + 2 * 128) + 128
    for g in graphs.values():
        big = [g.tensors[w] for w in g.used_weights() if g.tensors[w].nbytes >= 1024]
        assert sum(t.nbytes for t in big) == (params - 9 * 128) * 4
    shared = {g.tensors[w].buffer for g in graphs.values() for w in g.used_weights() if g.tensors[w].nbytes >= 1024}
    assert len(shared) == 4 * 7 + 2  # one buffer per matrix, whichever signature reads it


def test_weight_bytes_count_a_shared_buffer_once():
    tensors = (Tensor(0, "x", (4,), "float32", 16, "input"), Tensor(1, "w", (4, 4), "float32", 64, "weight", 7),
               Tensor(2, "w_alias", (4, 4), "float32", 64, "weight", 7), Tensor(3, "y", (4,), "float32", 16, "output"))
    g = StepGraph("s", (Op(0, "FULLY_CONNECTED", (0, 1), (3,)), Op(1, "ADD", (3, 2), (3,))), tensors, (0,), (3,))
    assert g.weight_bytes() == 64


def test_lifetimes_span_definition_to_last_use(graphs):
    for g in graphs.values():
        live, producer = g.lifetimes(), g.producers()
        last = len(g.ops) - 1
        for t, (first, end) in live.items():
            assert g.tensors[t].kind != "weight" and 0 <= first <= end <= last
            if t in g.inputs:
                assert first == 0
            elif t in producer:
                assert first == producer[t]
            if t in g.outputs:
                assert end == last
        readers = {t: pos for pos, op in enumerate(g.ops) for t in op.inputs}
        assert all(live[t][1] >= pos for t, pos in readers.items() if t in live)


@pytest.mark.parametrize("key", KEYS[:2], ids=decode_signature_name)
def test_analytic_graph_matches_the_exported_one(graphs, exported, key):
    config, _ = exported
    real, model = graphs[key], analytic_graph(config, key)
    assert real.signature == model.signature
    assert matmul_weights(model) == matmul_weights(real)
    big = lambda g: sorted(g.tensors[w].nbytes for w in g.used_weights() if g.tensors[w].nbytes >= 512)  # noqa: E731
    assert big(model) == big(real)  # matrices and norm scales, byte for byte
    assert 0 <= real.weight_bytes() - model.weight_bytes() < 1024  # op parameters (shapes, axes) only
    matmul_flops = lambda g: sum(op_flops(g, op) for op in g.ops if op.opcode in MATMUL_OPS)  # noqa: E731
    assert matmul_flops(model) == matmul_flops(real)
    for kind in ("kv", "input", "output"):
        assert boundary_shapes(model, kind) == boundary_shapes(real, kind), kind


def test_matmul_flops_pad_rows_to_32_token_tiles(graphs):
    g = graphs[KEYS[2]]  # window 8
    fc = next(op for op in g.ops if op.opcode == "FULLY_CONNECTED")
    assert op_flops(g, fc, tile=32) == 4 * op_flops(g, fc)
    g32 = graphs[KEYS[0]]
    assert all(op_flops(g32, op, tile=32) == op_flops(g32, op) for op in g32.ops if op.opcode == "FULLY_CONNECTED")


def test_llada_8b_q4_0_weights():
    g = analytic_graph(LLADA_8B, BucketKey(1, 32, 512, 32), weight_bytes_per_param=18 / 32, vector_bytes_per_param=4)
    matrices = 32 * (4 * 4096 * 4096 + 3 * 4096 * 12288) + 2 * 126464 * 4096
    vectors = (2 * 32 + 1) * 4096
    assert sum(matmul_weights(g).values()) == 32 * 7 + 1
    assert g.weight_bytes() == matrices * 18 // 32 + vectors * 4 + 64 * 4  # + RoPE frequencies
    kv = [t for t in g.tensors if t.kind == "kv"]
    assert {t.shape for t in kv} == {(32, 1, 512, 32, 128), (32, 1, 32, 32, 128)}
    assert all(t.nbytes == 2 * t.elements for t in kv)  # float16 activations and cache


def test_graph_json_round_trip(graphs):
    g = graphs[KEYS[1]]
    again = StepGraph.from_json(g.to_json())
    assert again == g
    sub = g.subgraph([op.index for op in g.ops[10:50]])
    assert StepGraph.from_json(json.dumps(json.loads(sub.to_json()))) == sub


def test_subgraph_boundary_tensors(graphs):
    g = graphs[KEYS[0]]
    keep = [op.index for op in g.ops[20:60]]
    sub = g.subgraph(keep)
    assert [op.index for op in sub.ops] == keep
    defined = {t for op in sub.ops for t in op.outputs}
    assert not set(sub.inputs) & defined
    assert all(g.tensors[t].kind != "weight" for t in sub.inputs)
    later = {t for op in g.ops[60:] for t in op.inputs}
    assert set(sub.outputs) == defined & (later | set(g.outputs))


def test_lowering_imports_without_jax_or_flax():
    code = ("import sys, dlm_jax.lowering, dlm_jax.lowering.graph, dlm_jax.lowering.partition, dlm_jax.techniques.lladacpp.somr, dlm_jax.techniques.lladacpp.paging\n"
            "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

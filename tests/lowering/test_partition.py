"""The NPU/CPU partition of the real llada-tiny step, per bucket.

Putting the LM head or the sampling tail on the NPU (or a dense layer on the CPU) would not
change a token, only the phone's latency and memory: nothing downstream would notice, so the
assignment itself is pinned here.
"""

from __future__ import annotations

import json

import pytest

from dlm_jax.lowering._analytic import analytic_graph

from dlm_jax.lowering.graph import MATMUL_OPS, StepGraph, op_flops, read_tflite_graph
from dlm_jax.lowering.partition import CPU_ROLES, Partition, partition
from tests.lowering._tiny_step import KEYS, tiny_step
from dlm_jax.tflite_export import decode_signature_name

BUCKETS = KEYS[:2]  # W=32 with 32 logit rows, W=64 with 8


@pytest.fixture(scope="module")
def graphs() -> dict:
    config, content = tiny_step()
    return {key: read_tflite_graph(content, decode_signature_name(key)) for key in BUCKETS}


@pytest.fixture(scope="module")
def parts(graphs) -> dict:
    config, _ = tiny_step()
    return {key: partition(g, vocab_size=config.vocab_size) for key, g in graphs.items()}


def by_device(graph: StepGraph, part: Partition, device: str) -> list:
    return [op for op, d in zip(graph.ops, part.devices) if d == device]


@pytest.mark.parametrize("key", BUCKETS, ids=decode_signature_name)
def test_lm_head_and_tail_run_on_the_cpu(graphs, parts, key):
    g, p = graphs[key], parts[key]
    head = next(op for op in g.ops if op.index == p.lm_head)
    assert head.opcode == "FULLY_CONNECTED" and g.tensors[g.weights(head)[0]].shape == (264, 128)
    assert p.devices[g.ops.index(head)] == "cpu"
    cpu = by_device(g, p, "cpu")
    assert {"ARG_MAX", "REDUCE_MAX", "GATHER_ND"} <= {op.opcode for op in cpu}
    assert all(op.opcode not in MATMUL_OPS or op.index == p.lm_head for op in cpu)
    assert {r for r, d in zip(p.roles, p.devices) if d == "cpu"} <= CPU_ROLES
    # the head sees only the R selected rows
    assert g.tensors[head.outputs[0]].shape == (1, key.rows, 264)


@pytest.mark.parametrize("key", BUCKETS, ids=decode_signature_name)
def test_dense_layers_attention_and_norms_run_on_the_npu(graphs, parts, key):
    g, p = graphs[key], parts[key]
    npu = by_device(g, p, "npu")
    assert sum(op.opcode == "FULLY_CONNECTED" for op in npu) == 4 * 7
    assert sum(op.opcode == "BATCH_MATMUL" for op in npu) == 4 * 2
    assert sum(op.opcode == "SOFTMAX" for op in npu) == 4
    assert sum(op.opcode == "RSQRT" for op in npu) == 4 * 2 + 1  # final norm too
    assert p.npu.ops + p.cpu.ops == len(g.ops) and p.npu.ops == len(npu)


@pytest.mark.parametrize("key", BUCKETS, ids=decode_signature_name)
def test_flops_weights_and_boundary(graphs, parts, key):
    g, p = graphs[key], parts[key]
    npu = by_device(g, p, "npu")
    assert p.npu.flops == sum(op_flops(g, op, tile=32) for op in npu)
    assert p.npu.flops >= p.npu.flops_unpadded
    assert (p.npu.flops == p.npu.flops_unpadded) == (key.window % 32 == 0)
    assert p.cpu.flops == p.cpu.flops_unpadded  # no tiles on the CPU
    big = lambda ops: {w for op in ops for w in g.weights(op) if g.tensors[w].nbytes >= 1024}  # noqa: E731
    assert not big(npu) & big(by_device(g, p, "cpu"))  # no matrix is read on both sides
    assert 0 <= p.npu.weight_bytes + p.cpu.weight_bytes - g.weight_bytes() < 1024  # shared: shape constants only
    assert p.cpu.weight_bytes >= 2 * 264 * 128 * 4  # embedding table and LM head
    to_host = [c.name for c in p.boundary if c.src == "npu" and c.dst == "cpu"]
    assert any(n.endswith("_k_new_output") for n in to_host) and any(n.endswith("_v_new_output") for n in to_host)
    hidden = key.window * 128 * 4
    assert any(c.src == "npu" and c.dst == "cpu" and c.nbytes == hidden for c in p.boundary)  # final hidden
    assert any(c.src == "cpu" and c.dst == "npu" and c.nbytes == hidden for c in p.boundary)  # embeddings
    assert all(c.src != c.dst for c in p.boundary)


def test_sparse_refresh_is_listed_as_a_cpu_program(parts):
    programs = {name: device for name, device, _ in parts[BUCKETS[0]].programs}
    assert programs["sparse_refresh"] == "cpu"


def test_partition_is_json_data(parts):
    for p in parts.values():
        text = p.to_json()
        assert Partition.from_json(text) == p
        assert json.loads(text)["npu"]["ops"] == p.npu.ops


def test_analytic_graph_splits_the_same_way(graphs, parts):
    config, _ = tiny_step()
    key = BUCKETS[0]
    model = partition(analytic_graph(config, key))
    real = parts[key]
    assert model.npu.weight_bytes == pytest.approx(real.npu.weight_bytes, abs=1024)
    assert model.cpu.weight_bytes == pytest.approx(real.cpu.weight_bytes, abs=1024)
    g = analytic_graph(config, key)
    mm = lambda g, p: sum(op_flops(g, op, tile=32) for op, d in zip(g.ops, p.devices)  # noqa: E731
                          if d == "npu" and op.opcode in MATMUL_OPS)
    assert mm(g, model) == mm(graphs[key], real)


def test_cpu_target_and_bad_target(graphs):
    g = graphs[BUCKETS[0]]
    everything = partition(g, target="cpu")
    assert set(everything.devices) == {"cpu"} and everything.npu.ops == 0
    with pytest.raises(ValueError, match="'gpu'"):
        partition(g, target="gpu")

"""Quantised bundles store int8 / int4 weights that LiteRT's kernels consume directly (no
DEQUANTIZE op, no float copy of the weights), shrink the file accordingly and still decode."""

from __future__ import annotations

from pathlib import Path

import pytest

import dlm_jax
from dlm_jax.executors.runner import load_bundle
from dlm_jax.tflite_export import tflite_op_names
from dlm_jax.tflite_export.bundle import export_bundle, parse_bucket

ROOT = Path(__file__).resolve().parents[2]
KEYS = [parse_bucket("step_w64_p0_r32")]


def weight_types(content: bytes) -> dict[str, int]:
    """Tensor type name -> bytes of the constant weight operands of FULLY_CONNECTED ops."""
    from ai_edge_litert import schema_py_generated as schema

    names = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    model = schema.Model.GetRootAs(content, 0)
    codes = [max(model.OperatorCodes(i).BuiltinCode(), model.OperatorCodes(i).DeprecatedBuiltinCode())
             for i in range(model.OperatorCodesLength())]
    out: dict[str, int] = {}
    sg = model.Subgraphs(0)
    for j in range(sg.OperatorsLength()):
        op = sg.Operators(j)
        if codes[op.OpcodeIndex()] != schema.BuiltinOperator.FULLY_CONNECTED:
            continue
        weight = sg.Tensors(op.Inputs(1))
        buffer = model.Buffers(weight.Buffer())
        size = buffer.DataLength() or buffer.Size()  # inline data, or an offset/size past the flatbuffer
        if size:
            out[names[weight.Type()]] = out.get(names[weight.Type()], 0) + size
    return out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    cfg = dlm_jax.decode_config(cache="none", rule="topk", steps=32, gen_len=32)
    root = tmp_path_factory.mktemp("quant")
    return {q: export_bundle(ROOT / "models" / "llada-tiny", root / q, keys=KEYS, decode=cfg, quant=q,
                             latency_repeats=1) for q in ("none", "int8", "int4")}


def test_quantised_weights_are_stored_as_integers_and_read_directly(bundles):
    fp32 = (bundles["none"].path / "model.tflite").read_bytes()
    assert set(weight_types(fp32)) == {"FLOAT32"}
    for quant, kind, most in (("int8", "INT8", 0.40), ("int4", "INT4", 0.30)):
        content = (bundles[quant].path / "model.tflite").read_bytes()
        types = weight_types(content)
        assert set(types) == {kind}, (quant, types)
        assert len(content) < most * len(fp32), (quant, len(content), len(fp32))
        ops = set().union(*tflite_op_names(content).values())
        assert "DEQUANTIZE" not in ops and "FULLY_CONNECTED" in ops, ops


def test_int8_bundle_answers_like_fp32(bundles):
    cfg = dlm_jax.decode_config(cache="none", rule="topk", steps=32, gen_len=32)
    answers = {}
    for quant, bundle in bundles.items():
        runner = load_bundle(bundle.path)
        answers[quant] = [runner.generate(p, cfg).texts[0] for p in ("564+894=", "66+76=")]
    assert answers["none"] == ["1458", "142"]
    assert answers["int8"] == answers["none"]
    assert len(answers["int4"]) == 2  # int4 costs accuracy (benchmarks/runner.py reports it); it decodes

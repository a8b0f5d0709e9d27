"""The JAX executor's programs trace a model's blocks of one structure once
(`dlm_jax.models._transformer.layers_traced_once`): the compiled program must be the one the
block-by-block trace gives, instruction for instruction, so that tokens, speed and the
persistent cache's entries are those of the plain trace."""

from __future__ import annotations

import contextlib
import re

import jax
import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax.executors import jax_executor
from dlm_jax.executors._compile import jitted
from dlm_jax.models import _transformer
from dlm_jax.runtime.buckets import BucketKey


def instructions(compiled) -> list[str]:
    """The compiled HLO's instructions, without their metadata (source lines, op names) and
    with the numbers XLA appends to names dropped."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    return [re.sub(r"\.\d+\b", "", line) for line in text.splitlines() if line.lstrip().startswith(("%", "ROOT"))]


def lowered(spec, build):
    fn, specs = jitted(build, spec)
    return fn.lower(*specs)


@pytest.mark.parametrize("name, load_options", [
    ("llada-tiny", {"dtype": "bfloat16"}),  # bfloat16: where XLA's rounding would show a different program
    pytest.param("moe-tiny", {}, marks=pytest.mark.slow),  # routed experts, with their outputs (about 5.5 s)
    ("idlm-tiny", {"lora": "models/idlm-tiny/risd"}),  # LoRA gates, an extra input
    ("llada-tiny", {"quant": "int8-g32"}),  # quantized projections (their rule names: one per block structure)
])
def test_blocks_are_traced_once_into_the_programs_of_the_plain_trace(monkeypatch, name, load_options):
    m = dlm_jax.load(f"models/{name}", executor="jax", **load_options)
    ex, cfg = m.executor, m.config
    calls = []
    block_call = _transformer.Block.__call__

    def counted(self, *args):
        calls.append(type(self.ffn).__name__)
        return block_call(self, *args)

    monkeypatch.setattr(_transformer.Block, "__call__", counted)
    moe = cfg.ffn == "moe"
    resident = (BucketKey(2, 16, 32, 16, router_topk=moe), ex.capacity(64))
    dense = BucketKey(1, 32, 0, 8, full_logits=True)
    once = [lowered(resident, ex._build_resident), lowered(dense, ex._build)]
    structures = len({nnx.graphdef(b) for b in m.model.layers})
    assert len(calls) == 2 * structures < 2 * cfg.n_layers  # one trace per structure and program
    calls.clear()
    monkeypatch.setattr(jax_executor, "layers_traced_once", contextlib.nullcontext)
    plain = [lowered(resident, ex._build_resident), lowered(dense, ex._build)]
    assert len(calls) == 2 * cfg.n_layers  # (the plain trace calls every block)
    for a, b in zip(once, plain):
        x, y = a.compile(), b.compile()
        assert instructions(x) == instructions(y)
        assert x.cost_analysis()["bytes accessed"] == y.cost_analysis()["bytes accessed"]


def test_an_eager_forward_and_a_litert_trace_call_every_block(monkeypatch):
    """Outside a trace (eager) and in a LiteRT lowering, blocks are called one by one as
    before: an eager call through a fresh jitted function would compile on every call, and
    the TFLite converter is given the graph it was given before."""
    m = dlm_jax.load("models/llada-tiny", executor="jax")
    calls = []
    block_call = _transformer.Block.__call__
    monkeypatch.setattr(_transformer.Block, "__call__", lambda self, *a: calls.append(1) or block_call(self, *a))
    tokens = np.zeros((1, 8), np.int32)
    with _transformer.layers_traced_once():
        m.model(tokens)  # eager
    assert len(calls) == m.config.n_layers
    calls.clear()

    def traced(t):
        with _transformer.layers_traced_once(), _transformer.litert_lowering():
            return m.model(t).logits

    jax.jit(traced).lower(tokens)
    assert len(calls) == m.config.n_layers

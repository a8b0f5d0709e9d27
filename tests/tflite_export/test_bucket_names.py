"""Bucket names round-trip: `parse_bucket`, which reads the names `dlm-jax export --buckets` and
the bundle cache's background exporter (`dlm_jax.tflite_export.background`, handed `signature_name`s by
`dlm_jax.executors.auto`) take, reads back every name `signature_name` writes, and refuses a
malformed one in one line naming what is wrong."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlm_jax import ConfigError
from dlm_jax.frontends.cli import build_parser
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.step import Capabilities, signature_name
from dlm_jax.tflite_export.bundle import parse_bucket

_SIZE = st.integers(1, 1 << 20)
# Every key a bucket set can hold: positive batch, window and rows, any cache (0: none), any flags.
KEYS = st.builds(BucketKey, batch=_SIZE, window=_SIZE, cache=st.integers(0, 1 << 20), rows=_SIZE,
                 full_logits=st.booleans(), router_topk=st.booleans(), ffn_active=st.booleans())


@given(KEYS)
def test_parse_bucket_reads_every_name_signature_name_writes(key):
    """Guards buckets with routed experts (`_topk`, an MoE model's expert placement) or neuron
    activity (`_act`, a sparse FFN's) that `parse_bucket` refused as "not a signature name":
    the background export of the bundle cache exited with that error in its log, and the
    decode silently stayed on the JAX executor."""
    assert parse_bucket(signature_name(key)) == key


def test_names_as_documented():
    """The format spelled out by hand (batch after rows, then the flags in order)."""
    assert parse_bucket("step_w32_p64_r16_b4_full_topk_act") == BucketKey(4, 32, 64, 16, True, True, True)
    assert parse_bucket("step_w8_p8_r8_act") == BucketKey(1, 8, 8, 8, ffn_active=True)
    assert parse_bucket(" step_w64_p0_r32_topk\n") == BucketKey(1, 64, 0, 32, router_topk=True)
    caps = dataclasses.replace(Capabilities.for_length(96), outputs=frozenset({"kv", "logits", "router_topk",
                                                                              "ffn_active"}))
    for flags in ((False, False, False), (True, True, True)):
        key = caps.select(batch=3, window=20, cache=40, rows=9, logits=flags[0], router_topk=flags[1],
                          ffn_active=flags[2])
        args = build_parser().parse_args(["export", "--model", "m", "--out", "o", "--buckets", signature_name(key)])
        assert [parse_bucket(b) for b in args.buckets] == [key]


@pytest.mark.parametrize("name, problem", [
    ("w32p64", "not a signature name like step_w32_p64_r32"),
    ("step_w32_p64", "not a signature name like step_w32_p64_r32"),
    ("step_w32_p64_r32_act_topk", "suffix '_act_topk'"),  # flags out of order
    ("step_w32_p64_r32_full_full", "suffix '_full_full'"),  # a flag twice
    ("step_w32_p64_r32_moe", "suffix '_moe'"),
    ("step_w32_p64_r32_full_b2", "suffix '_full_b2'"),  # batch after a flag
    ("step_w0_p0_r8", "window 0"),
    ("step_w32_p64_r32_b0", "batch 0"),
])
def test_malformed_names_are_one_line_errors(name, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        parse_bucket(name)
    assert "\n" not in str(err.value)
    if "suffix" in problem or "like" in problem:  # the format it names lists every flag
        assert "[_full][_topk][_act]" in str(err.value)

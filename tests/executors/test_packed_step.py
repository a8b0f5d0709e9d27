"""A resident step's request and predictions, each one array (the GPU-step issue).

Per decode step the host sends the `SlotStep` and reads back the rows' predictions. Each host
array a compiled call takes is a transfer of its own, and each output read back another, so
the JAX executor packs the ten request arrays into one int32 array (`pack_request`, undone in
the program by `unpack_request`) and the four predictions into one (`pack_predictions`,
`unpack_predictions`). The silent failures guarded here: a field landing in another's columns
or losing its dtype on the way (a bool read as 0/1 ints, a float read as its bits), a
prediction's bits changed in the round trip, and a step going back to one transfer per array.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dlm_jax.executors.jax_executor import (JaxExecutor, pack_predictions, pack_request, request_layout,
                                            unpack_predictions, unpack_request)
from dlm_jax.runtime import Decoder, preset
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.step import request_specs
from dlm_jax.testing import sharp_model


@pytest.mark.parametrize("cache,gated", [(0, False), (12, True)])
def test_the_packed_request_unpacks_to_the_step_s_arrays(cache, gated):
    """Every field back in its shape, dtype and values, a cache-less bucket's empty `read`
    and a gated model's float `lora_gate` included."""
    key = BucketKey(3, 5, cache, 4)
    rng = np.random.default_rng(cache)
    arrays = {}
    for name, shape, dtype in request_specs(key, gated=gated):
        arrays[name] = (rng.random(shape) < 0.5 if dtype == "bool" else
                        rng.standard_normal(shape).astype(np.float32) if dtype == "float32" else
                        rng.integers(-1, 2**31 - 1, shape, dtype=np.int32))
    layout = request_layout(key, gated)
    packed = pack_request(arrays, layout)
    assert packed.dtype == np.int32
    assert packed.shape == (3, 6 * 5 + cache + 4 + 2 + (5 if gated else 0))
    out = jax.jit(lambda p: unpack_request(p, layout))(packed)
    assert [name for name, *_ in layout] == list(arrays)
    for (name, *_), x in zip(layout, out):
        assert x.dtype == arrays[name].dtype, name
        np.testing.assert_array_equal(np.asarray(x), arrays[name], err_msg=name)


def test_the_predictions_come_back_bit_for_bit():
    """Tokens at the int32 limits and probabilities that are zero, denormal, one or NaN: every
    bit returns (the floats travel as their bits, in integers)."""
    tokens = np.array([[-1, 0, 126463, 2**31 - 1]], np.int32)
    probs = np.array([[0.0, 1e-45, 1.0, np.nan]], np.float32)
    named = {"top_token": tokens, "top_prob": probs, "second_prob": probs[:, ::-1].copy(), "entropy": -probs}
    packed = jax.jit(lambda n: pack_predictions(dict(n)))(named)
    assert packed.dtype == np.int32 and packed.shape == (4, 1, 4)
    back = unpack_predictions(np.asarray(packed))
    for name, x in named.items():
        assert back[name].dtype == x.dtype
        np.testing.assert_array_equal(back[name].view(np.int32), x.view(np.int32), err_msg=name)


@pytest.mark.parametrize("attention", ["split", "gather"])
def test_a_decode_step_sends_one_array_and_reads_one_back(attention, monkeypatch):
    """Each step of a decode passes its program one host array (the packed request; the cache
    and weights are already on the device) and reads one array back (no optional outputs
    asked): one transfer each way. Before, ten and four."""
    model = sharp_model()
    ex = JaxExecutor(model, attention=attention)
    sent, read = [], []
    compiled = ex._resident.get

    def counted(spec):
        exe = compiled(spec)

        def call(*args):
            sent.append(sum(isinstance(a, np.ndarray) for a in args))
            return exe(*args)

        return call

    fetch = ex._get
    monkeypatch.setattr(ex._resident, "get", counted)
    monkeypatch.setattr(ex, "_get", lambda named: read.append(len(named)) or fetch(named))
    out = Decoder(ex, model.config).decode([[5, 17, 3, 44], [8, 1]], preset("fast-dllm-dual", gen_len=32))
    assert out.stats.nfe > 2
    assert sent and set(sent) == {1}, sent
    assert set(read) == {1}, read

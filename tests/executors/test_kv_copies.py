"""The K/V copies of the LiteRT runner: what LiteRT's Python API lets a caller bind in place,
and that `Transfers` counts exactly the bytes the runner copies into LiteRT's buffers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dlm_jax
from dlm_jax.executors.runner import load_bundle, native_stderr_captured
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.tflite_export.bundle import _Sizes, export_bundle
from dlm_jax.training.data import TASKS, make_split

ROOT = Path(__file__).resolve().parents[2]
# Without and with the CPU path (snapshots); theta_stable keeps slots revisable so it refreshes.
CONFIGS = {"fast-dllm-dual": {}, "llada-cpp": {"theta_stable": 0.99}}


def _config(preset: str):
    return dlm_jax.preset(preset, gen_len=32, **CONFIGS[preset])


def _aligned(a: np.ndarray) -> np.ndarray:
    raw = np.zeros(a.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_litert_binds_caller_memory_in_place_only_as_a_rank_1_buffer():
    """Why the runner copies the K/V into LiteRT's buffers every step (`_Signature.run`):
    `TensorBuffer.create_from_host_memory` is read in place (a write to the array is seen by
    the next run) but takes no shape, and a static rank-2 input refuses the rank-1 buffer. If
    this fails, LiteRT has gained a shaped binding: gather the K/V straight into it."""
    import jax
    import jax.numpy as jnp
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.hardware_accelerator import HardwareAccelerator
    from ai_edge_litert.tensor_buffer import TensorBuffer

    from dlm_jax.tflite_export._convert import Signature, convert_signatures

    sigs = [Signature("flat", lambda x: (x[:4] * 2.0,), (jax.ShapeDtypeStruct((64,), jnp.float32),), ["x"], ["y"]),
            Signature("shaped", lambda x: (x[0, :4] * 2.0,), (jax.ShapeDtypeStruct((4, 16), jnp.float32),), ["x"],
                      ["y"])]
    with native_stderr_captured():
        model = CompiledModel.from_buffer(convert_signatures(sigs), hardware_accel=HardwareAccelerator.CPU)
        flat, shaped = model.get_signature_index("flat"), model.get_signature_index("shaped")
        out = model.create_output_buffers(flat)
        x = _aligned(np.arange(64, dtype=np.float32))
        buffer = TensorBuffer.create_from_host_memory(x)
        model.run_by_index(flat, [buffer], out)
        np.testing.assert_array_equal(out[0].read(4, np.float32), [0, 2, 4, 6])
        x[:4] = [10, 20, 30, 40]  # through the array only
        model.run_by_index(flat, [buffer], out)
        np.testing.assert_array_equal(out[0].read(4, np.float32), [20, 40, 60, 80])

        shaped_buffer = TensorBuffer.create_from_host_memory(_aligned(np.ones((4, 16), np.float32)))
        assert shaped_buffer.get_tensor_details()["shape"] == [64]
        with pytest.raises(RuntimeError):
            model.run_by_index(shaped, [shaped_buffer], model.create_output_buffers(shaped))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(JAX model, runner, prompt) over a llada-tiny bundle holding the buckets of `CONFIGS`."""
    jax_model = dlm_jax.load(ROOT / "models" / "llada-tiny")
    prompt = jax_model.encode(make_split(TASKS["gsm_lite"], 2, split="heldout")[0].prompt)
    decoder = Decoder(_Sizes(jax_model.config), jax_model.config)
    keys = set()
    for preset in CONFIGS:
        keys |= set(decoder.bucket_keys([len(prompt)], _config(preset)))
    out = tmp_path_factory.mktemp("bundle") / "llada-tiny"
    export_bundle(ROOT / "models" / "llada-tiny", out, keys=sorted(keys), decode=_config("fast-dllm-dual"),
                  latency_repeats=0, plan=False)
    return jax_model, load_bundle(out), prompt


@pytest.mark.slow  # its bundle export takes about 10 s: the default suite keeps within its 5 minutes
@pytest.mark.parametrize("preset", CONFIGS)
def test_transfers_count_the_bytes_copied_into_litert(models, preset, monkeypatch):
    """Every step the runner writes each input, the gathered K/V included, into LiteRT's
    buffers; the decode's `h2d_bytes` are exactly those bytes, and the tokens are JAX's."""
    from ai_edge_litert.tensor_buffer import TensorBuffer

    jax_model, runner, prompt = models
    cfg = _config(preset)
    runner.decoder.decode([prompt], cfg)  # every signature set up (warm-up writes are not the decode's)
    written = []
    write = TensorBuffer.write
    monkeypatch.setattr(TensorBuffer, "write", lambda self, a: (written.append(a.nbytes), write(self, a))[1])
    got = runner.decoder.decode([prompt], cfg)
    want = jax_model.decoder.decode([prompt], cfg)
    np.testing.assert_array_equal(got.sequences[0], want.sequences[0])
    assert got.stats.nfe == want.stats.nfe > 1
    assert sum(got.stats.h2d_bytes) == sum(written) > 0
    if preset == "llada-cpp":
        assert got.stats.counters.get("refresh_steps", 0) > 0  # the CPU path ran (snapshots counted too)

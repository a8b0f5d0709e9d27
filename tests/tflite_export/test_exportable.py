"""The decode program stays exportable: two buckets go into ONE `.tflite` (one signature
each) through litert-converter, run under ai-edge-litert with the JAX executor's results, and
use TFLite builtin ops only. Both sides follow the one step contract (`dlm_jax.runtime.step`):
the signature's tensors and the executor's outputs have its names, shapes and dtypes."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime import BucketKey, OutputRequest, StepInputs
from dlm_jax.runtime.step import INPUT_NAMES, input_specs, output_names, output_specs
from dlm_jax.testing import TINY
from dlm_jax import CheckpointError, _integrity
from dlm_jax.tflite_export import (convert_signatures, decode_signature, decode_signature_name, export_signatures,
                           read_tflite, tflite_op_names, write_tflite)

from ai_edge_litert.interpreter import Interpreter  # noqa: E402  (a runtime dependency: never skipped)

CFG = TINY
KEYS = [BucketKey(batch=1, window=8, cache=8, rows=8),
        BucketKey(batch=1, window=16, cache=8, rows=8)]
ATOL = 1e-5
HEAD_SCALE = 30.0


@pytest.fixture(scope="module")
def model():
    """The tiny random model with its head scaled up: a plain init gives near-uniform rows
    whose top-2 probabilities can differ by ~1e-6, too close to float noise for an exact
    argmax comparison; scaled, top-1 probabilities spread over ~0.15-0.7."""
    model = dlm_jax.init_model(dlm_jax.ModelConfig(**CFG))
    params = {name: value * (HEAD_SCALE if name.startswith("lm_head") else 1.0)
              for name, value in dlm_jax.get_params(model).items()}
    return dlm_jax.model_from_params(model.config, params)


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    """Both buckets in one file, written atomically; returns its bytes."""
    graphdef, state = nnx.split(model)
    folder = tmp_path_factory.mktemp("tflite")
    path = folder / "decode.tflite"
    export_signatures([decode_signature(graphdef, state, model.config, k) for k in KEYS], path)
    # No temporary file left behind; the manifest holds its size and sha256; umask permissions.
    assert sorted(os.listdir(folder)) == ["decode.manifest.json", "decode.tflite"]
    assert read_tflite(path) == path.read_bytes()
    assert path.stat().st_mode & 0o777 == 0o666 & ~_integrity.umask()
    return path.read_bytes()


def test_a_flipped_byte_in_a_tflite_file_is_named(exported, tmp_path):
    path = tmp_path / "decode.tflite"
    write_tflite(path, exported)
    data = bytearray(exported)
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="decode.tflite: sha256 differs"):
        read_tflite(path)
    assert read_tflite(path, verify=False) == bytes(data)


@pytest.fixture(scope="module")
def interpreter(exported):
    return Interpreter(model_content=exported)


def random_inputs(cfg, key: BucketKey, seed: int = 0) -> StepInputs:
    """Inputs of bucket `key` with random contents, shaped as the contract says."""
    rng = np.random.default_rng(seed)
    b, w, p, r = key.batch, key.window, key.cache, key.rows
    visibility = rng.random((b, w, p + w)) < 0.7
    visibility[:, np.arange(w), p + np.arange(w)] = True  # every row sees itself
    cache = (cfg.n_layers, b, p, cfg.n_kv_heads, cfg.head_dim)
    return StepInputs(
        tokens=rng.integers(0, cfg.vocab_size, (b, w), dtype=np.int32),
        positions=np.broadcast_to(np.arange(p, p + w, dtype=np.int32), (b, w)).copy(),
        visibility=visibility,
        k_cache=rng.standard_normal(cache, dtype=np.float32),
        v_cache=rng.standard_normal(cache, dtype=np.float32),
        logit_rows=np.broadcast_to(np.arange(r, dtype=np.int32), (b, r)).copy(),
        want=OutputRequest(kv=True, logits=key.full_logits),
    )


def run_litert(interpreter, key: BucketKey, inputs: StepInputs) -> dict[str, np.ndarray]:
    runner = interpreter.get_signature_runner(decode_signature_name(key))
    taken = runner.get_input_details()
    return runner(**{name: a for name, a in zip(INPUT_NAMES, inputs.arrays()) if name in taken})


def assert_parity(got: dict[str, np.ndarray], want) -> None:
    names = [name for name in output_names(BucketKey(1, 1, 1, 1, want.logits is not None))]
    assert set(got) == set(names)
    for name in names:
        expected = getattr(want, name)
        assert got[name].shape == expected.shape and got[name].dtype == expected.dtype, name
        if name == "top_token":
            np.testing.assert_array_equal(got[name], expected)
        else:
            np.testing.assert_allclose(got[name], expected, rtol=0, atol=ATOL, err_msg=name)


def test_signatures_follow_the_step_contract(model, interpreter):
    sigs = interpreter.get_signature_list()
    assert set(sigs) == {"step_w8_p8_r8", "step_w16_p8_r8"}
    for key in KEYS:
        runner = interpreter.get_signature_runner(decode_signature_name(key))
        details = {**runner.get_input_details(), **runner.get_output_details()}
        for name, shape, dtype in input_specs(model.config, key) + output_specs(model.config, key):
            assert tuple(details[name]["shape"]) == shape, name
            assert np.dtype(details[name]["dtype"]) == np.dtype(dtype), name
        assert set(details) == set(INPUT_NAMES) | set(output_names(key))


def test_executor_follows_the_step_contract(model):
    """The JAX executor returns the contract's outputs, shapes and dtypes; the window K/V only
    when asked, the logits only in a logits bucket."""
    key = BucketKey(batch=2, window=16, cache=8, rows=8, full_logits=True)
    inputs = random_inputs(model.config, key)
    out = JaxExecutor(model).step(inputs)
    for name, shape, dtype in output_specs(model.config, key):
        value = getattr(out, name)
        assert value.shape == shape and value.dtype == np.dtype(dtype), name
    lean = JaxExecutor(model).step(dataclasses.replace(random_inputs(model.config, KEYS[0]),
                                                       want=OutputRequest(kv=False)))
    assert lean.k_new is None and lean.v_new is None and lean.logits is None


@pytest.mark.parametrize("key", KEYS, ids=decode_signature_name)
def test_parity_with_jax_executor(model, interpreter, key):
    inputs = random_inputs(model.config, key, seed=key.window)
    assert not inputs.visibility.all()
    want = JaxExecutor(model).step(inputs)
    top2_gap = (want.top_prob - want.second_prob).min()
    assert top2_gap > 1e-4, "inputs leave the argmax within float noise; pick another seed"
    assert_parity(run_litert(interpreter, key, inputs), want)


def test_empty_cache_bucket(model):
    """P == 0: the signature takes no cache inputs (zero-size tensors the program ignores and
    LiteRT buffers cannot hold), and still matches."""
    key = BucketKey(batch=1, window=8, cache=0, rows=8)
    graphdef, state = nnx.split(model)
    content = convert_signatures([decode_signature(graphdef, state, model.config, key)])
    details = Interpreter(model_content=content).get_signature_runner(decode_signature_name(key)).get_input_details()
    assert set(details) == set(INPUT_NAMES) - {"k_cache", "v_cache"}
    inputs = random_inputs(model.config, key)
    assert_parity(run_litert(Interpreter(model_content=content), key, inputs),
                  JaxExecutor(model).step(inputs))


def test_builtin_ops_only(exported):
    ops = tflite_op_names(exported)
    print({name: sorted(names) for name, names in ops.items()})
    assert set(ops) == {"step_w8_p8_r8", "step_w16_p8_r8"}  # no extra (control-flow) subgraphs
    used = set().union(*ops.values())
    assert not {op for op in used if op.startswith(("CUSTOM", "STABLEHLO_", "BUILTIN_"))}, used
    assert {"FULLY_CONNECTED", "BATCH_MATMUL"} <= used

"""Streaming loads: tensors go from the file to the device in their stored dtype, one at a time.

Guards against a loader that still produces the right parameters while widening a bfloat16
checkpoint to float32 on the way (twice the memory, silently), or holding a whole host copy of
the model beside the device one (an 8B model needs 32 GB instead of 16), or that mixes up a
parameter's tensors when several threads read them.
"""

import json
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax.checkpoint import _names, _stream, get_family, load_file, save_file
from dlm_jax.models import param_shapes
from dlm_jax.testing import tiny_config

BF16 = np.dtype(ml_dtypes.bfloat16)


def _reference(path, cfg, family="dlm_jax"):
    """{name: host array} read the plain way: every tensor, `_names.from_checkpoint`, a cast."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    scheme = get_family(family).scheme
    return {name: _names.from_checkpoint(name, [tensors[s] for s in scheme.sources(name, spec.shape)])
            .astype(spec.dtype) for name, spec in param_shapes(cfg).items()}


def _assert_identical(model, ref):
    params = dlm_jax.get_params(model)
    assert params.keys() == ref.keys()
    for name, value in params.items():
        assert value.dtype == ref[name].dtype, name
        np.testing.assert_array_equal(value.view(np.uint8), ref[name].view(np.uint8), err_msg=name)


@pytest.fixture
def bf16_moe(tmp_path):
    """A sharded bf16 checkpoint with stacked experts, a dense layer, a tied head and norms."""
    cfg = tiny_config(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16, n_shared_experts=1,
                      router="sigmoid", router_bias=True, dense_layers=(0,), tie_embeddings=True,
                      qk_norm=True, param_dtype="bfloat16")
    return cfg, dlm_jax.save_pretrained(dlm_jax.init_model(cfg, seed=3), tmp_path / "m", max_shard_bytes=8_000)


# Tensors under DEVICE_TRANSFORM_BYTES are transposed / cast on the host; 0 sends all to the device.
@pytest.mark.parametrize("device_bytes", [_stream.DEVICE_TRANSFORM_BYTES, 0])
def test_bfloat16_is_read_and_placed_as_bfloat16(bf16_moe, monkeypatch, device_bytes):
    """Every host buffer read and every transform stays bfloat16; the parameters are device
    arrays equal bit for bit to the stored tensors."""
    cfg, path = bf16_moe
    monkeypatch.setattr(_stream, "DEVICE_TRANSFORM_BYTES", device_bytes)
    seen = []
    read_host, to_param = _stream.read_host, _stream.to_param

    def spy_read(kind, infos):
        out = read_host(kind, infos)
        seen.append(("read", out.dtype))
        return out

    def spy_transform(x, *, kind, dtype):
        seen.append(("transform", x.dtype, np.dtype(dtype)))
        assert isinstance(x, jax.Array) == (device_bytes == 0)
        return to_param(x, kind=kind, dtype=dtype)

    monkeypatch.setattr(_stream, "read_host", spy_read)
    monkeypatch.setattr(_stream, "to_param", spy_transform)
    model = dlm_jax.load_pretrained(path, param_dtype="bfloat16")
    assert model.config.param_dtype == "bfloat16"
    reads = [s[1] for s in seen if s[0] == "read"]
    assert len(reads) == len(param_shapes(cfg))
    # Only the router's score bias is float32: the model keeps it so, and so does the file.
    assert reads.count(BF16) == len(reads) - 1 and reads.count(np.dtype("float32")) == 1
    assert all(s[1] == s[2] for s in seen if s[0] == "transform"), seen  # transposes, never a cast
    for name, value in dlm_jax.get_params(model).items():
        assert value.dtype == (np.float32 if name.endswith("expert_bias") else BF16), name
    for leaf in jax.tree.leaves(nnx.state(model)):
        assert isinstance(leaf, jax.Array) and leaf.devices() == {jax.devices()[0]}
    _assert_identical(model, _reference(path, cfg))
    # The spies see a cast when one is asked for: float32 parameters from the bf16 file.
    seen.clear()
    wide = dlm_jax.load_pretrained(path, param_dtype="float32")
    assert ("transform", BF16, np.dtype("float32")) in seen
    _assert_identical(wide, _reference(path, wide.config))


@pytest.mark.parametrize("workers, device_bytes", [(1, _stream.DEVICE_TRANSFORM_BYTES), (3, 0)])
def test_threads_and_casts_give_the_plain_reading(tmp_path, workers, device_bytes, monkeypatch):
    """A cast on the device rounds like NumPy's; any number of threads gives the same."""
    monkeypatch.setattr(_stream, "DEVICE_TRANSFORM_BYTES", device_bytes)
    cfg = tiny_config(qkv_bias=True, attention="causal", logit_shift=True)
    path = dlm_jax.save_pretrained(dlm_jax.init_model(cfg, seed=1), tmp_path / "m", family="qwen2",
                                   max_shard_bytes=6_000)
    load_params = _stream.load_params
    monkeypatch.setattr(_stream, "load_params", lambda *a, **k: load_params(*a, **{**k, "workers": workers}))
    for dtype in ("float32", "bfloat16", "float16"):
        model = dlm_jax.load_pretrained(path, param_dtype=dtype)
        _assert_identical(model, _reference(path, model.config, "qwen2"))


def test_an_error_in_one_thread_names_its_tensor(tmp_path):
    """A shard cut short after the headers were read fails with the tensor named, not a hang."""
    from dlm_jax import CheckpointError
    from dlm_jax.checkpoint._io import _tensor_index

    path = dlm_jax.save_pretrained(dlm_jax.init_model(tiny_config()), tmp_path / "m")
    plan = {"embed.embedding": [_tensor_index(path)["model.embed_tokens.weight"]]}
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.embed_tokens\.weight' is truncated"):
        _stream.load_params(plan, {"embed.embedding": np.dtype("float32")}, workers=2)


# Loads the checkpoint in a fresh process; VmHWM is that process's own peak RSS (ru_maxrss is
# not: a child started by fork and exec inherits the parent's).
_PEAK = """
import json, sys, jax, dlm_jax
import dlm_jax.checkpoint._io  # the loader's modules (flax among them) are part of the baseline
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
jax.block_until_ready(jax.numpy.ones(8) + 1)
before = status("VmRSS")
model = dlm_jax.load_pretrained(sys.argv[1])
jax.block_until_ready(jax.live_arrays())
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_of_a_load_is_about_one_model(tmp_path):
    """A ~220 MB bf16 checkpoint loads with a peak RSS under 1.3x its size above the interpreter's
    (1.1x here; main's loader, with a host copy of every tensor beside the device one, 1.85x)."""
    cfg = dlm_jax.ModelConfig(vocab_size=16384, d_model=1024, n_layers=6, n_heads=8, ffn_hidden=2816,
                              param_dtype="bfloat16", max_seq_len=256)
    family = get_family("dlm_jax")
    path = tmp_path / "m"
    path.mkdir()
    tensors = {}
    for name, spec in param_shapes(cfg).items():
        (src,) = family.scheme.sources(name, spec.shape)
        tensors[src] = np.full(_names.checkpoint_shape(name, spec.shape), 0.5, BF16)
    save_file(tensors, path / "model.safetensors")
    nbytes = (path / "model.safetensors").stat().st_size
    del tensors
    (path / "config.json").write_text(json.dumps(family.config_to_json(cfg)))  # no manifest: nothing to hash
    out = subprocess.run([sys.executable, "-c", _PEAK, str(path)], check=True, capture_output=True, text=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    growth = rss["peak"] - rss["before"]
    assert 200e6 < nbytes < 250e6
    assert growth < 1.3 * nbytes, f"peak grew {growth / 2**20:.0f} MiB for a {nbytes / 2**20:.0f} MiB checkpoint"


def test_the_abstract_model_is_the_one_a_real_build_gives():
    """Loads fill a model built under `nnx.eval_shape` with a stand-in for `nnx.Rngs` (a real
    one costs seconds at 8B): same graph, same names, shapes and dtypes."""
    from dlm_jax.models import _params
    from dlm_jax.models._transformer import Transformer

    cfg = tiny_config(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=16, n_shared_experts=1,
                      router="sigmoid", router_bias=True, dense_layers=(0,), qk_norm=True, qkv_bias=True)
    ours = nnx.split(_params._abstract_model(cfg))
    real = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    assert ours[0] == real[0]
    assert jax.tree.map(lambda s: (s.shape, s.dtype), ours[1]) == jax.tree.map(lambda s: (s.shape, s.dtype), real[1])

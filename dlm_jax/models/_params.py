"""Building models and moving their parameters in and out as flat `{dotted.path: array}` dicts.

Flat dotted names (`layers.0.attn.q_proj.kernel`) are the one key space shared by checkpoint
families, exporters and tests.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlm_jax._config import ModelConfig
from dlm_jax.models._fuse import split_fused_params
from dlm_jax.models._transformer import Transformer
from dlm_jax.models.quant import quantize


def init_model(cfg: ModelConfig, *, seed: int = 0) -> Transformer:
    """A randomly initialised model."""
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def _path_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


class _ShapeOnlyRngs:
    """Stands in for `nnx.Rngs` while a model is built under `nnx.eval_shape`: every stream
    (`rngs.params()`, ...) gives the same key. Only shapes come out of that build, and a real
    `Rngs` bumps a traced counter per draw, which makes JAX re-scan the whole trace so far each
    time (quadratic: seconds at 8B parameters, for nothing)."""

    def __getattr__(self, stream: str) -> _ShapeOnlyRngs:
        if stream.startswith("_"):
            raise AttributeError(stream)
        return self

    def __call__(self) -> jax.Array:
        return jax.random.key(0)


@functools.lru_cache(maxsize=4)
def _abstract_model(cfg: ModelConfig, quant: str | None = None,
                    quant_float: frozenset[str] = frozenset()) -> Transformer:
    """The model of `cfg` with `jax.ShapeDtypeStruct`s for arrays (read, never mutated);
    weight-only quantized to `quant` (`dlm_jax.models.quant.quantize`, but the weights named in
    `quant_float`) unless None."""
    def build() -> Transformer:
        model = Transformer(cfg, rngs=_ShapeOnlyRngs())
        return model if quant is None else quantize(model, quant, keep=quant_float)

    return nnx.eval_shape(build)


def param_shapes(cfg: ModelConfig, *, quant: str | None = None,
                 quant_float: frozenset[str] = frozenset()) -> dict[str, jax.ShapeDtypeStruct]:
    """Name -> shape/dtype of every parameter, without allocating any (of the model quantized
    to `quant`, int8 / float8 kernels and float32 scales, unless None; the weights named in
    `quant_float`, "lm_head" say, stay float)."""
    state = nnx.state(_abstract_model(cfg, quant, frozenset(quant_float)), nnx.Param)
    return {_path_name(p): v.get_value() for p, v in nnx.to_flat_state(state)}


def get_params(model: Transformer) -> dict[str, np.ndarray]:
    """Name -> host copy of every parameter. Layers stacked for a scan (`dlm_jax.models._scan`)
    are named per layer as the unstacked model names them, and fused projections
    (`dlm_jax.models._fuse`) by the projections they hold, so a checkpoint saved from a
    stacked or fused model, or its fingerprint, is the one of the model before."""
    state = nnx.state(model, nnx.Param)
    out = {}
    for p, v in nnx.to_flat_state(state):
        name, value = _path_name(p), np.asarray(v.get_value())
        if name.startswith(_STACKED):
            out.update({f"layers.{i}.{name[len(_STACKED):]}": layer for i, layer in enumerate(value)})
        else:
            out[name] = value
    return split_fused_params(out, model.config)


_STACKED = "layers.block."  # a `StackedLayers`' one block, its arrays [L, ...]


def model_from_params(cfg: ModelConfig, params: Mapping[str, np.ndarray | jax.Array], *,
                      quant: str | None = None, quant_float: frozenset[str] = frozenset()) -> Transformer:
    """Build a model whose parameters are exactly `params` (names and shapes must match).

    No random initialisation runs: the module graph is built abstractly and filled in. A
    device array already in the parameter's dtype is used as it is (no copy); anything else is
    converted once (`jnp.asarray`). `quant` ("int8" / "fp8"): the model is weight-only
    quantized (`dlm_jax.models.quant`) and `params` hold its quantized kernels and scales
    (`param_shapes(cfg, quant=quant, quant_float=quant_float)` names them; the weights named in
    `quant_float` float); no float kernel is made for the others.
    """
    graphdef, state = nnx.split(_abstract_model(cfg, quant, frozenset(quant_float)))
    flat = []
    expected = set()
    for path, var in nnx.to_flat_state(state):
        name = _path_name(path)
        expected.add(name)
        if name not in params:
            raise KeyError(f"parameter {name!r} is missing")
        spec = var.get_value()
        value = params[name]
        if tuple(np.shape(value)) != tuple(spec.shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(np.shape(value))}, expected {tuple(spec.shape)}")
        flat.append((path, var.replace(jnp.asarray(value, dtype=spec.dtype))))
    extra = sorted(set(params) - expected)
    if extra:
        raise KeyError(f"unexpected parameters: {extra[:5]}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def param_count(model_or_cfg: Transformer | ModelConfig) -> int:
    if isinstance(model_or_cfg, ModelConfig):
        return int(sum(np.prod(s.shape) for s in param_shapes(model_or_cfg).values()))
    return int(sum(v.size for v in get_params(model_or_cfg).values()))


def tiny_byte_config():
    """(ByteTokenizer, ModelConfig) of the small random model used by the demo fallback and
    the profiler when no checkpoint is given."""
    from dlm_jax._tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return tok, ModelConfig(
        vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
        ffn_hidden=128, attention="bidirectional", max_seq_len=256,
        mask_token_id=tok.mask_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
        bos_token_id=tok.bos_id)

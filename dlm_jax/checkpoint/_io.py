"""`load_pretrained` / `save_pretrained` / `convert_checkpoint`: HF-layout checkpoints in and out.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json` (plus tokenizer files, see `dlm_jax._tokenizer`). Saving writes
everything into a temporary sibling directory and renames it into place, so an interrupted or
failed save never leaves a half-written checkpoint behind; the directory and its files get the
permissions the umask gives. `manifest.json` lists every file written with its size and sha256;
`load_pretrained` verifies it before reading tensors (`verify=False` skips that; checkpoints
without a manifest, such as those transformers writes, load as before). Weight files must match
(big ones are checked by size and sampled chunks, `verify="full"` hashes every byte:
`dlm_jax._integrity.verify_manifest`); the text files people edit by hand (config.json,
tokenizer files, chat templates) only warn, once per load, naming the files and
`dlm-jax manifest DIR`, which records them anew (`dlm_jax._integrity.rewrite_manifest`).

A checkpoint path may also be a Hugging Face model id, `org/name` or `org/name@revision`, which
loads from the local Hugging Face cache (`dlm_jax._hub`; an existing directory always wins).

Unknown `config.json` keys are ignored with a warning (`strict=True` refuses them); keys that
change the computation are always checked (see `_families`). A config without
`mask_token_id` gets the mask token its tokenizer files declare, if any.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from dlm_jax import _integrity
from dlm_jax._config import WEIGHT_QUANTS, ConfigError, ModelConfig, weight_quant_parts
from dlm_jax._hub import resolve_checkpoint
from dlm_jax._tokenizer import declared_mask_token_id
from dlm_jax.checkpoint import _names, _prequantized, _stream
from dlm_jax.checkpoint._families import Family, family_for, get_family
from dlm_jax._errors import CheckpointError
from dlm_jax.checkpoint._safetensors import TensorInfo, read_header, save_file
from dlm_jax.models import get_params, model_from_params, param_shapes
from dlm_jax.models._transformer import Transformer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = _integrity.MANIFEST_NAME
# Files `convert_checkpoint` carries over byte for byte (the tokenizer's, the generation defaults).
CARRIED_FILES: tuple[str, ...] = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt")
_RESERVED = (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, MANIFEST_NAME)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def load_config(path: str | os.PathLike, *, strict: bool = False,
                **overrides: Any) -> tuple[ModelConfig, Family]:
    """The `ModelConfig` and family of the checkpoint directory `path`.

    Args:
      strict: refuse `config.json` keys this loader does not use (default: ignore them with one
        warning naming them). Keys that change the computation are checked either way.
      overrides: replace config fields after parsing (e.g. `attention="bidirectional"` to run
        a Llama checkpoint as a LLaDA-style model, `mask_token_id=N`).

    Without `mask_token_id` in config.json (and no override), the mask token that the tokenizer
    files of `path` declare is used (tokenizer_config.json / special_tokens_map.json
    `mask_token`, or a known mask token in tokenizer.json); with none, it stays None.
    """
    path = resolve_checkpoint(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    source = str(path / CONFIG_NAME)
    data = _read_json(path / CONFIG_NAME)
    family = family_for(data, source=source)
    cfg = family.config_from_json(data, source=source, strict=strict)
    if cfg.mask_token_id is None and "mask_token_id" not in overrides:
        cfg = _mask_from_tokenizer(cfg, path)
    if overrides:
        try:
            cfg = cfg.replace(**overrides)
        except TypeError as e:
            raise ConfigError(f"bad override for {source}: {e}") from None
    return cfg, family


def _mask_from_tokenizer(cfg: ModelConfig, path: Path) -> ModelConfig:
    mask = declared_mask_token_id(path)
    if mask is None:
        return cfg
    if not 0 <= mask < cfg.embedding_rows:
        warnings.warn(f"{path}: the tokenizer's mask token id {mask} is outside the embedding table "
                      f"[0, {cfg.embedding_rows}); not using it", UserWarning, stacklevel=3)
        return cfg
    return cfg.replace(mask_token_id=mask)


def _tensor_index(path: Path) -> dict[str, TensorInfo]:
    """Name -> location of every tensor of the checkpoint, headers validated."""
    index_path = path / INDEX_NAME
    if index_path.exists():
        index = _read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: has no 'weight_map' object")
        files = sorted(set(weight_map.values()))
    elif (path / WEIGHTS_NAME).exists():
        weight_map, files = None, [WEIGHTS_NAME]
    else:
        raise CheckpointError(f"{path}: has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    infos: dict[str, TensorInfo] = {}
    for file in files:
        if not (path / file).exists():
            raise CheckpointError(f"{index_path}: lists shard {file!r}, which does not exist")
        header, _ = read_header(path / file)
        for name, info in header.items():
            if name in infos:
                raise CheckpointError(f"{path / file}: tensor {name!r} also appears in {infos[name].path.name}")
            infos[name] = info
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in infos or infos[name].path.name != file:
                raise CheckpointError(f"{index_path}: tensor {name!r} is not in its shard {file!r}")
    return infos


def checkpoint_files(path: Path) -> list[str]:
    """The files of the checkpoint directory `path` that loading it reads: config, weights (the
    index and the shards it names), tokenizer and generation files."""
    names = [CONFIG_NAME, *CARRIED_FILES, WEIGHTS_NAME, INDEX_NAME]
    if (path / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((path / INDEX_NAME).read_text(encoding="utf-8")).get("weight_map", {})
            names += sorted({f for f in weight_map.values() if isinstance(f, str)})
        except (ValueError, AttributeError, UnicodeDecodeError):
            pass  # `_tensor_index` names what is wrong with it
    return [n for n in dict.fromkeys(names) if (path / n).is_file()]


def verify_checkpoint(path: str | os.PathLike, verify: bool | str = True) -> bool:
    """Check the checkpoint directory `path` against its manifest, if it has one (`verify`:
    True, "full" or False, as for `load_pretrained`). Returns whether a manifest was checked.

    Weight files (and other binary files) must match: a difference is an error naming the file.
    The text files people edit by hand (`_integrity.is_editable`: config.json, tokenizer files,
    chat templates, ...) that differ from the manifest, or that loading reads but the manifest
    does not list, give one warning naming them and `dlm-jax manifest DIR`: an edited
    config.json is a user's choice, not corruption, and refusing it only taught people to pass
    --no-verify, which skips the weights' check too.
    """
    if verify not in (True, False, None, "full"):
        raise ConfigError(f"verify={verify!r}: expected True, False or 'full'")
    path = Path(path)
    if not verify or not path.is_dir():
        return False
    return _integrity.verify_manifest(path, full=verify == "full", editable=_integrity.is_editable,
                                      expected=checkpoint_files(path))


def load_pretrained(path: str | os.PathLike, *, strict: bool = False, verify: bool | str = True,
                    placement=None, **overrides: Any) -> Transformer:
    """Load an HF-layout checkpoint (any supported family) into a `Transformer`.

    Args:
      path: checkpoint directory, or a Hugging Face model id (`org/name[@revision]`) in the
        local Hugging Face cache (`dlm_jax._hub`).
      strict: refuse config keys this loader does not use (default: warn once and ignore them).
      verify: check the files `manifest.json` lists before reading anything (`verify_checkpoint`:
        weights by size and sha256, big ones by size and sampled chunks; "full": every byte of
        every file; hand-edited text files warn); a checkpoint without a manifest loads unchecked.
      placement: a `dlm_jax.executors.sharding.MeshPlacement`: each parameter goes onto its
        shards of the mesh as it loads (the partition rules, `dlm_jax._partition`), so no device
        ever holds more than its share of the model plus the parameters in flight.
      overrides: `ModelConfig` fields to change after parsing (attention, logit_shift,
        mask_token_id, dtype, param_dtype, block_size, ...).

    Every tensor is checked (names, shapes) before any is read; then each goes straight from
    its file onto the default JAX device in its stored dtype and is transposed and cast to
    `param_dtype` there (`_stream`): no float32 detour, and never a second copy of the model.

    Raises:
      CheckpointError: missing/corrupt files (a file that differs from the manifest is named),
        missing, unexpected or mis-shaped tensors.
      ConfigError: unknown architecture, unsupported config values (unknown keys if strict).
    """
    path = resolve_checkpoint(path)
    verify_checkpoint(path, verify)
    cfg, family = load_config(path, strict=strict, **overrides)
    place = None if placement is None else (lambda name, x: placement.put(x, placement.leaf(name, x.shape)))
    data = _read_json(path / CONFIG_NAME)
    prequantized = _prequantized.layout(data, str(path / CONFIG_NAME))
    if prequantized is not None:
        return _load_prequantized(path, cfg, family, prequantized, place)
    quant, keep = stored_quant(path), _stored_quant_float(data, path)
    specs = param_shapes(cfg, quant=quant, quant_float=keep)
    quantized = _quantized_kernels(specs)
    plan = _plan(path, cfg, family, {name: tuple(s.shape) for name, s in specs.items()}, quantized=quantized)
    int4 = frozenset(name for name, s in specs.items() if np.dtype(s.dtype) == _INT4)
    params = _stream.load_params(plan, {name: np.dtype(np.int8) if name in int4 else s.dtype
                                        for name, s in specs.items()}, place=place)
    for name in int4:
        params[name] = _narrow_int4(params[name], plan[name], name)
    return model_from_params(cfg, params, quant=quant, quant_float=keep)


def _narrow_int4(x: jax.Array, infos, name: str) -> jax.Array:
    """An int4 kernel from the int8 tensors a dlm-jax checkpoint stores it in (safetensors has no
    4-bit integer type), refusing other dtypes and values outside int4's [-8, 7]."""
    for info in infos:
        if info.dtype != np.int8:
            raise CheckpointError(f"{info.path}: tensor {info.name!r} is {info.dtype}, expected int8 holding "
                                  f"the int4 kernel {name!r}")
    lo, hi = int(jax.numpy.min(x)), int(jax.numpy.max(x))
    if lo < -8 or hi > 7:
        for info in infos:  # (a kernel of several tensors, experts say: name the one out of range)
            data = info.read()
            if data.size and (int(data.min()) < -8 or int(data.max()) > 7):
                lo, hi = int(data.min()), int(data.max())
                break
        raise CheckpointError(f"{info.path}: tensor {info.name!r} holds values {lo}..{hi}, outside the "
                              f"int4 range [-8, 7] of {name!r}")
    return x.astype(jax.numpy.int4)


def stored_quant_layout(path: str | os.PathLike) -> str | None:
    """How the pre-quantized checkpoint directory `path` stores its quantized weights, in one
    line (`_prequantized.Layout.describe`), or None (a float checkpoint, or one dlm-jax saved)."""
    path = Path(path)
    layout = _prequantized.layout(_read_json(path / CONFIG_NAME), str(path / CONFIG_NAME))
    return None if layout is None else layout.describe()


def stored_quant_float(path: str | os.PathLike) -> frozenset[str]:
    """The weights that the checkpoint directory `path`, stored quantized (`stored_quant`), holds
    in float although dlm-jax's quantization covers them (`dlm_jax.models.quant.quantized_weights`'
    names: "lm_head", "layers.1.ffn.gate"): a pre-quantized checkpoint's kernels without scales,
    the head by default. Empty for a float checkpoint, which `quant=` quantizes whole."""
    path = Path(path)
    data = _read_json(path / CONFIG_NAME)
    prequantized = _prequantized.layout(data, str(path / CONFIG_NAME))
    if prequantized is None:
        return _stored_quant_float(data, path)
    cfg, family = load_config(path)
    return _prequantized_float(path, cfg, family, prequantized, _tensor_index(path))


def _stored_quant_float(data: dict[str, Any], path: Path) -> frozenset[str]:
    """The weights a dlm-jax checkpoint stored quantized holds in float (config.json
    `weight_quant_float`, written for a model loaded from a pre-quantized checkpoint with float
    kernels; `weight_quant_head: false`, an earlier version's, is ["lm_head"])."""
    if data.get("model_type") != "dlm_jax":
        return frozenset()
    head = data.get("weight_quant_head", True)
    if not isinstance(head, bool):
        raise ConfigError(f"{path / CONFIG_NAME}: weight_quant_head={head!r}: expected true or false")
    names = data.get("weight_quant_float", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{path / CONFIG_NAME}: weight_quant_float={names!r}: expected a list of weight names")
    return frozenset(names) | (frozenset() if head else frozenset({"lm_head"}))


def _prequantized_float(path: Path, cfg: ModelConfig, family: Family, layout: _prequantized.Layout,
                        index: Mapping[str, Any]) -> frozenset[str]:
    """The weights dlm-jax quantizes (`quantized_weights`) that a pre-quantized checkpoint stores
    in float: its tensors have no scales beside them and a float dtype (`ignore` /
    `modules_to_not_convert`: the head by default; a model's experts, which llm-compressor leaves
    float where transformers holds them fused). A weight stored in several tensors (experts, a
    fused projection) must be quantized in all or none."""
    from dlm_jax.models._params import _abstract_model
    from dlm_jax.models.quant import quantized_weights

    shapes = {name: tuple(s.shape) for name, s in param_shapes(cfg).items()}
    out = set()
    for weight, _, _ in quantized_weights(_abstract_model(cfg)):
        param = weight + ".kernel" if weight + ".kernel" in shapes else weight
        bases = sorted({src.partition("#")[0] for src in family.scheme.sources(param, shapes[param])})
        stored = [layout.name(b, "scale") in index or (layout.name(b, "weight") in index if layout.packed else
                                                         b in index and np.dtype(index[b].dtype) in _QUANT_DTYPES)
                  for b in bases]  # (a quantized weight without its scales: named missing below)
        if all(stored):
            continue
        if any(stored):
            raise CheckpointError(f"{path}: {weight!r} is stored partly quantized ({sum(stored)} of its "
                                  f"{len(bases)} tensors, {bases[stored.index(True)]!r} quantized, "
                                  f"{bases[stored.index(False)]!r} not); dlm-jax holds a weight whole, "
                                  f"quantized or float")
        out.add(weight)
    return frozenset(out)


def _load_prequantized(path: Path, cfg: ModelConfig, family: Family, layout: _prequantized.Layout,
                       place) -> Transformer:
    """A pre-quantized checkpoint (`_prequantized`: fine-grained FP8, compressed-tensors) as a
    model weight-only quantized to `layout.mode`: its int8 / float8 kernels as stored (packed
    ones unpacked on the host), its scales reshaped to dlm-jax's."""
    index = _tensor_index(path)
    scheme = family.scheme
    keep = _prequantized_float(path, cfg, family, layout, index)
    try:
        specs = param_shapes(cfg, quant=layout.mode, quant_float=keep)
    except ConfigError as e:  # a kernel's input width neither a multiple of the group nor at most it
        raise ConfigError(f"{path}: its quantization ({layout.strategy}"
                          + (f" {list(layout.block)}" if layout.block else "") + f") does not fit this model ({e})"
                          ) from None
    quantized = _quantized_kernels(specs)
    # scale parameter -> its kernel, in the model's order; kernel -> {"zero": its zero points (uint4),
    # "g_idx": its row-to-group map (act-order)} where it has them
    scale_of, sides = {}, {}
    for name in (n for n in specs if n in quantized):
        side = (lambda s: name[:-len(".qkernel")] + f".{s}") if name.endswith(".qkernel") else (
            lambda s: f"{name}_{s}")
        scale_of[side("scale")] = name
        sides[name] = {s: side(s) for s in ("zero", "g_idx") if side(s) in specs}
    held = {p for named in sides.values() for p in named.values()}
    shapes = {name: tuple(s.shape) for name, s in specs.items() if name not in scale_of and name not in held}

    def bases(kernel: str) -> list[tuple[str, str]]:  # (float weight name, row block "" or "k") per source
        return [src.partition("#")[::2] for src in scheme.sources(kernel, shapes[kernel], quantized=True, qsuffix="")]

    beside = {layout.name(base, role) for kernel in scale_of.values() for base, _ in bases(kernel)
              for role in layout.roles}
    planned = {n: s for n, s in shapes.items() if not (layout.packed and n in quantized)}
    plan = _plan(path, cfg, family, planned, quantized=quantized, qsuffix=layout.weight_suffix,  # names, shapes, dtypes
                 also_used=frozenset(beside & set(index)), index=index)
    missing = sorted(beside - set(index))
    if missing:
        raise CheckpointError(f"{path}: missing quantized tensors {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    for name in quantized & set(plan):
        for info in plan[name]:
            if info.dtype != np.dtype(specs[name].dtype):  # (a cast between int8 and float8 would make new weights)
                raise CheckpointError(f"{info.path}: tensor {info.name!r} is {info.dtype}, expected "
                                      f"{np.dtype(specs[name].dtype)} for quantization {layout.mode!r}")
    fused = scheme._fused_parts(shapes)

    def rows_of(base: str, k: str) -> slice:  # a row block of a fused weight: its rows of the fused tensors
        if not k:
            return slice(None)
        sizes = [shp[0] for _, shp in fused[base]]
        return slice(sum(sizes[:int(k)]), sum(sizes[:int(k) + 1]))

    params: dict[str, Any] = {}

    def put(name: str, value: np.ndarray) -> None:  # on the device at once: the host holds one kernel at a time
        if tuple(value.shape) != tuple(specs[name].shape):
            raise CheckpointError(f"{path}: the quantized tensors of {name!r} give shape {tuple(value.shape)}, "
                                  f"expected {tuple(specs[name].shape)}")
        params[name] = jax.device_put(value) if place is None else place(name, jax.device_put(value))

    for scale, kernel in scale_of.items():
        reads = [_prequantized.read_weight(index, base, layout=layout, rows=rows_of(base, k), where=str(path))
                 for base, k in bases(kernel)]
        kernels = [r.kernel for r in reads if r.kernel is not None]
        stacked = _names.layout(scale) == _names.STACKED
        put(scale, np.stack([r.scales for r in reads]) if stacked else reads[0].scales)
        for role, param in sides[kernel].items():  # (the layout gives them exactly where the mode holds them)
            values = [getattr(r, role) for r in reads]
            if role == "g_idx" and not stacked and any(not np.array_equal(v, values[0]) for v in values):
                raise CheckpointError(f"{path}: the tensors of {kernel!r} map their input rows to groups "
                                      f"differently (g_idx); dlm-jax holds one map a weight")
            put(param, np.stack(values) if stacked else values[0])
        if layout.packed:
            put(kernel, np.ascontiguousarray(_names.from_layout(_names.layout(kernel), np.stack(kernels) if stacked
                                                                else kernels[0]), dtype=specs[kernel].dtype))
    params.update(_stream.load_params(plan, {name: specs[name].dtype for name in plan}, place=place))
    return model_from_params(cfg, params, quant=layout.mode, quant_float=keep)


# The dtypes of weight-only quantized kernels (`dlm_jax.models.quant`): int8, float8_e4m3fn, int4
# (stored as int8: safetensors has no 4-bit integer type).
_INT4 = np.dtype(ml_dtypes.int4)
_QUANT_DTYPES = (np.dtype(np.int8), np.dtype(ml_dtypes.float8_e4m3fn), _INT4)


def _quantized_kernels(specs: Mapping[str, Any]) -> frozenset[str]:
    """The parameters of `specs` (name -> shape/dtype) that hold weight-only quantized kernels:
    int8 / float8 / int4, but uint4's int8 zero points."""
    return frozenset(name for name, s in specs.items()
                     if np.dtype(s.dtype) in _QUANT_DTYPES and not _names.is_zero_points(name))


def stored_quant(path: str | os.PathLike) -> str | None:
    """The weight-only quantization ("int8" / "fp8", grouped "int8-g32") the checkpoint directory
    `path` is stored in (config.json `weight_quant`, written by `save_pretrained` for a quantized
    model; a pre-quantized checkpoint's `quantization_config`, `_prequantized`), or None."""
    data = _read_json(Path(path) / CONFIG_NAME)
    prequantized = _prequantized.layout(data, str(Path(path) / CONFIG_NAME))
    if prequantized is not None:
        return prequantized.mode
    quant = data.get("weight_quant") if data.get("model_type") == "dlm_jax" else None  # (only it stores one)
    if quant is not None:
        try:
            weight_quant_parts(quant)
        except ConfigError:
            raise ConfigError(f"{Path(path) / CONFIG_NAME}: weight_quant={quant!r} is not supported "
                              f"(supported: {', '.join(WEIGHT_QUANTS)}, each with an optional group: "
                              f"'int8-g128')") from None
    return quant


def refuse_stored_quant(path: str | os.PathLike, what: str) -> None:
    """One line, before any weight is read, when `path` is stored weight-only quantized: `what`
    (an export) starts from float weights; the checkpoint it was quantized from is the input."""
    if Path(path).is_dir() and (quant := stored_quant(path)) is not None:
        raise ConfigError(f"{path} is stored weight-only quantized ({quant}, for the JAX executor); {what} "
                          f"starts from float weights: give the checkpoint it was quantized from")


def _plan(path: Path, cfg: ModelConfig, family: Family, shapes: Mapping[str, tuple[int, ...]], *,
          quantized: frozenset[str] = frozenset(), qsuffix: str = _names.QKERNEL_SUFFIX,
          also_used: frozenset[str] = frozenset(),
          index: Mapping[str, TensorInfo] | None = None) -> dict[str, list[TensorInfo]]:
    """Parameter name -> its checkpoint tensors, every header, name and shape checked (a fused
    tensor's row blocks stand for its parts, see `NameScheme.split`); the parameters named in
    `quantized` hold int8 / float8 kernels (`NameScheme.sources`, their names with `qsuffix`),
    the others float ones; `also_used`: tensors read by other means (a pre-quantized
    checkpoint's scales and packed weights)."""
    infos = family.scheme.split(_tensor_index(path) if index is None else index, shapes)
    used: set[str] = set(also_used)
    missing: list[str] = []
    plan: dict[str, list[TensorInfo]] = {}
    for name, sources in _names.iter_sources(family.scheme, shapes, quantized=quantized, qsuffix=qsuffix):
        want = _names.checkpoint_shape(name, shapes[name])
        found = []
        for src in sources:
            if src not in infos:
                missing.append(src.split("#", 1)[0])  # a fused tensor's part: the fused tensor
                continue
            if infos[src].shape != want:
                raise CheckpointError(f"{infos[src].path}: tensor {src!r} has shape {infos[src].shape}, "
                                      f"expected {want} for this config")
            if name in quantized and infos[src].dtype not in _QUANT_DTYPES:  # (a cast would make new weights)
                raise CheckpointError(f"{infos[src].path}: tensor {src!r} is {infos[src].dtype}, "
                                      f"expected a weight-only quantized kernel (int8 or float8_e4m3fn)")
            if _names.is_zero_points(name):  # uint4's, as a dlm-jax checkpoint stores them
                if infos[src].dtype != np.int8:
                    raise CheckpointError(f"{infos[src].path}: tensor {src!r} is {infos[src].dtype}, expected "
                                          f"int8 zero points")
            elif name not in quantized and infos[src].dtype in _QUANT_DTYPES:  # a cast would drop its scales
                raise CheckpointError(f"{infos[src].path}: tensor {src!r} is {infos[src].dtype}, where dlm-jax "
                                      f"holds {name!r} in float")
            found.append(infos[src])
            used.add(src)
        plan[name] = found
    missing = list(dict.fromkeys(missing))
    if missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    if cfg.tie_embeddings:  # some tied checkpoints still carry a copy of the head
        used.add(family.scheme.top["lm_head.kernel"])
    unexpected = sorted(n for n in set(infos) - used if not family.scheme.is_ignorable(n))
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensors {unexpected[:8]}"
                              + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
                              + f" for family {family.name!r} with this config")
    return plan


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def save_pretrained(model: Transformer, path: str | os.PathLike, *, family: str = "dlm_jax",
                    tokenizer: Any = None, overwrite: bool = False,
                    max_shard_bytes: int = 2 * 1024**3,
                    extra_files: Mapping[str, str | os.PathLike | bytes] | None = None) -> Path:
    """Write `model` (and optionally its tokenizer) as an HF-layout checkpoint at `path`.

    Args:
      family: the layout to write: `dlm_jax` (every setting kept) or an HF family
        (`llada`, `llada2`, `dream`, `qwen2`, `llama`, `qwen3`, `qwen3_moe`, `dots1`) when the model's
        settings fit it.
      tokenizer: anything with `save(directory)`, written beside the weights.
      overwrite: replace an existing checkpoint at `path` (atomically).
      max_shard_bytes: above this the weights are split into indexed shards.
      extra_files: more files to write, name -> bytes or a file to copy byte for byte (they
        replace same-named tokenizer files; config, weights and manifest names are refused).

    Everything goes into one temporary directory renamed into place; `manifest.json` lists
    every file (size, sha256); the directory and files get the umask's permissions.

    A weight-only quantized model (`dlm_jax.models.quant`, `model.quant`) saves only in the
    `dlm_jax` family: each quantized kernel as its int8 / float8_e4m3fn tensor (int4: int8) named as
    the float kernel's with `.qkernel` appended, and its float32 scales [out] (grouped: [groups,
    out], as held) with `.scale`
    (`NameScheme.sources`); config.json records `weight_quant`, and `load_pretrained` builds
    the quantized model from them.
    """
    path = Path(path)
    fam = get_family(family)
    config = fam.config_to_json(model.config)  # fails before anything is written
    quant = getattr(model, "quant", None)
    if quant is not None:
        if fam.name != "dlm_jax":
            raise CheckpointError(f"a weight-only quantized model ({quant}) saves only with family='dlm_jax', "
                                  f"not {fam.name!r}")
        config["weight_quant"] = quant
        keep = sorted(getattr(model, "quant_float", ()))
        if keep:
            config["weight_quant_float"] = keep  # (loaded from a pre-quantized checkpoint with float kernels)
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path}: already exists (pass overwrite=True to replace it)")
    extra = dict(extra_files or {})
    for name in extra:
        if name in _RESERVED or Path(name).name != name or name.startswith("."):
            raise CheckpointError(f"extra file {name!r}: not a plain file name, or one save_pretrained writes itself")
    tensors: dict[str, np.ndarray] = {}
    for name, value in get_params(model).items():
        quantized = quant is not None and value.dtype in _QUANT_DTYPES and not _names.is_zero_points(name)
        for src, arr in zip(fam.scheme.sources(name, value.shape, quantized=quantized),
                            _names.to_checkpoint(name, value)):
            tensors[src] = arr.astype(np.int8) if arr.dtype == _INT4 else arr  # (no int4 in safetensors)
    tensors = fam.scheme.join(tensors)  # fused tensors (LLaDA2.0's query_key_value) from their parts
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _integrity.make_temp_dir(path.parent, prefix=f".{path.name}.tmp-")
    try:
        with open(tmp / CONFIG_NAME, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        shards = _shards(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], tmp / WEIGHTS_NAME)
        else:
            weight_map = {}
            for k, shard in enumerate(shards, start=1):
                file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / file)
                weight_map.update({name: file for name in shard})
            total = int(sum(t.nbytes for t in tensors.values()))
            with open(tmp / INDEX_NAME, "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        if tokenizer is not None:
            tokenizer.save(tmp)
        for name, source in extra.items():
            (tmp / name).write_bytes(source if isinstance(source, bytes) else Path(source).read_bytes())
        _integrity.publish_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, family: str = "dlm_jax",
                       overwrite: bool = False, strict: bool = False, verify: bool | str = True) -> Path:
    """Load the checkpoint `src` and save it at `dst` in `family`'s layout.

    The tokenizer files and generation_config.json of `src` (`CARRIED_FILES`) are carried over
    byte for byte; every setting the target family can store is kept (`block_size` included)
    and one it cannot store fails with the field named before anything is written. The result
    appears atomically, with a manifest. `strict` and `verify` apply to loading `src` (a
    directory or a cached Hugging Face model id).
    """
    src, dst = resolve_checkpoint(src), Path(dst)
    fam = get_family(family)
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst}: already exists (pass overwrite=True to replace it)")
    verify_checkpoint(src, verify)
    cfg, _ = load_config(src, strict=strict)
    fam.config_to_json(cfg)  # a setting the family cannot store fails before the weights are read
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the config's warnings were given just above
        model = load_pretrained(src, strict=strict, verify=False)
    carried = {name: (src / name).read_bytes() for name in CARRIED_FILES if (src / name).is_file()}
    return save_pretrained(model, dst, family=family, overwrite=overwrite, extra_files=carried)

"""`load_pretrained` / `save_pretrained`: HF-layout checkpoints in and out.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json` (plus tokenizer files, see `dlm_jax.tokenizers`). Saving writes
everything into a temporary sibling directory and renames it into place, so an interrupted or
failed save never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dlm_jax._config import ConfigError, ModelConfig
from dlm_jax.checkpoint import _names
from dlm_jax.checkpoint._families import Family, family_for, get_family
from dlm_jax._errors import CheckpointError
from dlm_jax.checkpoint._safetensors import TensorInfo, read_header, save_file
from dlm_jax.models import get_params, model_from_params, param_shapes
from dlm_jax.models._transformer import Transformer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


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


def load_config(path: str | os.PathLike, *, strict: bool = True,
                **overrides: Any) -> tuple[ModelConfig, Family]:
    """The `ModelConfig` and family of the checkpoint directory `path`.

    `overrides` replace config fields after parsing (e.g. `attention="bidirectional"` to run
    a Llama checkpoint as a LLaDA-style model).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    source = str(path / CONFIG_NAME)
    data = _read_json(path / CONFIG_NAME)
    family = family_for(data, source=source)
    cfg = family.config_from_json(data, source=source, strict=strict)
    if overrides:
        try:
            cfg = cfg.replace(**overrides)
        except TypeError as e:
            raise ConfigError(f"bad override for {source}: {e}") from None
    return cfg, family


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


def load_pretrained(path: str | os.PathLike, *, strict: bool = True,
                    **overrides: Any) -> Transformer:
    """Load an HF-layout checkpoint (any supported family) into a `Transformer`.

    Args:
      path: checkpoint directory.
      strict: reject config keys this loader does not understand.
      overrides: `ModelConfig` fields to change after parsing (attention, logit_shift,
        mask_token_id, dtype, param_dtype, block_size, ...).

    Raises:
      CheckpointError: missing/corrupt files, missing, unexpected or mis-shaped tensors.
      ConfigError: unknown architecture, unknown or unsupported config keys.
    """
    path = Path(path)
    cfg, family = load_config(path, strict=strict, **overrides)
    infos = _tensor_index(path)
    shapes = {name: tuple(s.shape) for name, s in param_shapes(cfg).items()}
    used: set[str] = set()
    missing: list[str] = []
    plan: dict[str, list[TensorInfo]] = {}
    for name, sources in _names.iter_sources(family.scheme, shapes):
        want = _names.checkpoint_shape(name, shapes[name])
        found = []
        for src in sources:
            if src not in infos:
                missing.append(src)
                continue
            if infos[src].shape != want:
                raise CheckpointError(f"{infos[src].path}: tensor {src!r} has shape {infos[src].shape}, "
                                      f"expected {want} for this config")
            found.append(infos[src])
            used.add(src)
        plan[name] = found
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
    params = {name: _names.from_checkpoint(name, [i.read() for i in found])
              for name, found in plan.items()}
    return model_from_params(cfg, params)


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
                    max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Write `model` (and optionally its tokenizer) as an HF-layout checkpoint at `path`.

    Args:
      family: the layout to write: `dlm_jax` (every setting kept) or an HF family
        (`llada`, `dream`, `qwen2`, `llama`, `qwen3`, `qwen3_moe`, `dots1`) when the model's
        settings fit it.
      tokenizer: anything with `save(directory)`, written beside the weights.
      overwrite: replace an existing checkpoint at `path` (atomically).
      max_shard_bytes: above this the weights are split into indexed shards.
    """
    path = Path(path)
    fam = get_family(family)
    config = fam.config_to_json(model.config)  # fails before anything is written
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path}: already exists (pass overwrite=True to replace it)")
    tensors: dict[str, np.ndarray] = {}
    for name, value in get_params(model).items():
        for src, arr in zip(fam.scheme.sources(name, value.shape), _names.to_checkpoint(name, value)):
            tensors[src] = arr
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
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
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` to `dst`; an existing `dst` is swapped out, then removed."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.rmdir(old)
    os.replace(dst, old)
    try:
        os.replace(src, dst)
    except BaseException:
        os.replace(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)

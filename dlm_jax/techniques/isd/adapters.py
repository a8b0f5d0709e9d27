"""LoRA adapter files in PEFT's layout, beside (never inside) the base checkpoint they were made on.

    save_adapters(model, "models/idlm-tiny/risd", base="models/idlm-tiny")
    model = load_adapted("models/idlm-tiny", "models/idlm-tiny/risd")   # base + adapters, checked

An adapter directory holds:
- `adapter_config.json`: PEFT's keys (`peft_type: "LORA"`, `r`, `lora_alpha`, `target_modules`,
  `base_model_name_or_path`, `task_type: "CAUSAL_LM"`, ...) plus a `dlm_jax` object: the base
  model's shape summary (`base_config`), its family, the sha256 of its weight files as its
  `manifest.json` records them (`base_weights_sha256`), the adapted projections by dlm-jax name and
  the gate rule (R-ISD: 1 on [MASK] rows, 0 elsewhere);
- `adapter_model.safetensors`: `base_model.model.<HF module>.lora_A.weight` [r, in] and
  `....lora_B.weight` [out, r], HF module names as the base family's `NameScheme` names them
  (`model.layers.0.self_attn.q_proj`);
- `manifest.json` (`dlm_jax._integrity`), verified before anything is read.

Adapters made for another base fail with a one-line `ConfigError` naming adapter_config.json and
what differs: a shape field of the base config, a tensor shape, or a weight file's sha256.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from dlm_jax import _integrity
from dlm_jax._config import ModelConfig
from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax.checkpoint._families import get_family
from dlm_jax.checkpoint._io import INDEX_NAME, WEIGHTS_NAME, load_config, load_pretrained
from dlm_jax.checkpoint._safetensors import read_header, save_file
from dlm_jax.techniques.isd.lora import (LoraSpec, attach_lora, kernel_name, lora_params, lora_spec,
                                  set_lora_params)
from dlm_jax.models._params import param_shapes
from dlm_jax.models._transformer import Transformer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
FORMAT_VERSION = 1
GATE_RULE = "mask_rows"  # lora_gate = 1.0 on rows whose input token is mask_token_id, else 0.0
# ModelConfig fields that fix the base model's parameter shapes (and what its rows mean).
SHAPE_FIELDS = ("vocab_size", "embedding_rows", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "ffn", "ffn_hidden", "n_experts", "moe_ffn_hidden", "n_shared_experts", "dense_layers",
                "qkv_bias", "qk_norm", "tie_embeddings", "attention", "logit_shift", "mask_token_id")
_SUFFIX = {"lora_a": ".lora_A.weight", "lora_b": ".lora_B.weight"}


def base_summary(cfg: ModelConfig) -> dict[str, Any]:
    """The shape-defining fields of a model config, as they read back from JSON."""
    return json.loads(json.dumps({f: getattr(cfg, f) for f in SHAPE_FIELDS}))


def base_weights_sha256(base: str | os.PathLike) -> dict[str, str]:
    """{weight file: sha256} of the checkpoint at `base`, from its manifest.json (hashed here
    when it has none)."""
    base = Path(base)
    table = _integrity.read_manifest(base)
    if table is not None:
        found = {f: e["sha256"] for f, e in table.items() if f.endswith(".safetensors")}
        if found:
            return dict(sorted(found.items()))
    if (base / INDEX_NAME).exists():
        files = sorted(set(json.loads((base / INDEX_NAME).read_text())["weight_map"].values()))
    else:
        files = [WEIGHTS_NAME]
    return {f: _integrity.file_digest(base / f)["sha256"] for f in files}


def _module_names(cfg: ModelConfig, family: str) -> dict[str, str]:
    """dlm-jax kernel name -> HF module name (checkpoint name without `.weight`) of every
    linear that can carry an adapter."""
    scheme = get_family(family).scheme
    out = {}
    for name, spec in param_shapes(cfg).items():
        if name.endswith("_proj.kernel"):  # attention and dense/shared FFN projections
            hf = scheme.sources(name, tuple(spec.shape))[0]
            if "#" in hf:  # a row block of a fused tensor (LLaDA2.0's q/k/v): no module of its own
                continue
            out[name] = hf[: -len(".weight")] if hf.endswith(".weight") else hf
    return out


def save_adapters(model: Transformer, path: str | os.PathLike, *, base: str | os.PathLike,
                  base_name: str | None = None, overwrite: bool = False) -> Path:
    """Write the adapters of `model` (see `dlm_jax.techniques.isd.attach_lora`) at `path` in PEFT's
    layout, for the base checkpoint directory `base` (its config must have the model's shapes;
    its weight files' sha256 are recorded). `base_name`: `base_model_name_or_path` (default:
    `base` as given). The directory appears atomically, with a manifest.

    Raises:
      ValueError: the model has no adapters.
      ConfigError: `base` is not the model's base (shape fields differ).
        Or an adapted projection is a part of a fused checkpoint tensor (LLaDA2.0's q/k/v).
      CheckpointError: `path` exists and not `overwrite`.
    """
    spec = lora_spec(model)
    if spec is None:
        raise ValueError("the model has no LoRA adapters to save (attach_lora first)")
    path, base = Path(path), Path(base)
    base_cfg, family = load_config(base)
    mine, theirs = base_summary(model.config), base_summary(base_cfg)
    diff = [k for k in SHAPE_FIELDS if mine[k] != theirs[k]]
    if diff:
        k = diff[0]
        raise ConfigError(f"{base / 'config.json'}: not this model's base ({k}={theirs[k]!r}, the model has {mine[k]!r})")
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path}: already exists (pass overwrite=True to replace it)")
    modules = _module_names(model.config, family.name)
    fused = sorted({kernel_name(n) for n in lora_params(model)} - modules.keys())
    if fused:
        raise ConfigError(f"family {family.name!r} stores {fused[0]} as part of a fused projection, which PEFT "
                          f"adapts as one module; adapters on it cannot be saved for this base")
    tensors = {}
    for name, value in lora_params(model).items():
        kind = name.rsplit(".", 1)[1]
        tensors[PEFT_PREFIX + modules[kernel_name(name)] + _SUFFIX[kind]] = np.ascontiguousarray(value.T)
    adapted = sorted({modules[kernel_name(n)] for n in lora_params(model)})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank,
        "lora_alpha": int(spec.alpha) if spec.alpha.is_integer() else spec.alpha,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in adapted}),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "base_model_name_or_path": str(base) if base_name is None else base_name,
        "dlm_jax": {"format_version": FORMAT_VERSION, "targets": list(spec.targets), "gate": GATE_RULE,
                    "base_family": family.name, "base_config": theirs,
                    "base_weights_sha256": base_weights_sha256(base)},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _integrity.make_temp_dir(path.parent, prefix=f".{path.name}.tmp-")
    try:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        _integrity.publish_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed adapter_config.json of the adapter directory `path` (checked to be a dlm-jax
    LoRA adapter)."""
    file = Path(path) / ADAPTER_CONFIG
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file not found") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("peft_type") != "LORA":
        raise CheckpointError(f"{file}: not a LoRA adapter config (peft_type={data.get('peft_type') if isinstance(data, dict) else None!r})")
    ours = data.get("dlm_jax")
    if not isinstance(ours, dict) or not {"base_config", "base_weights_sha256", "base_family"} <= set(ours):
        raise CheckpointError(f"{file}: has no 'dlm_jax' object with base_config, base_family and base_weights_sha256")
    return data


def load_adapters(path: str | os.PathLike, model: Transformer, *, base: str | os.PathLike | None = None,
                  verify: bool = True) -> Transformer:
    """Attach the adapters saved at `path` to `model` (in place; returned for chaining).

    Args:
      base: the base checkpoint directory `model` was loaded from; its weight files' sha256
        (from its manifest) must be those the adapters recorded. None: only shapes are checked.
      verify: check the adapter files against their manifest first.

    Raises:
      ConfigError: one line naming adapter_config.json and what differs (a base config shape
        field, a tensor's shape, a base weight file's sha256), or the model already has other
        adapters.
      CheckpointError: missing or corrupt adapter files.
    """
    path = Path(path)
    if verify:
        _integrity.verify_manifest(path)
    data = read_adapter_config(path)
    file, ours = path / ADAPTER_CONFIG, data["dlm_jax"]
    recorded, actual = ours["base_config"], base_summary(model.config)
    for k in SHAPE_FIELDS:
        if recorded.get(k) != actual[k]:
            raise ConfigError(f"{file}: adapters made for another base model: {k}={recorded.get(k)!r} there, "
                              f"{actual[k]!r} in this model")
    if base is not None:
        have = base_weights_sha256(base)
        for f, digest in ours["base_weights_sha256"].items():
            if have.get(f) != digest:
                raise ConfigError(f"{file}: adapters made for another base model: base weight file {f} has sha256 "
                                  f"{digest[:16]}..., {Path(base) / f} has {str(have.get(f, 'none'))[:16]}...")
    try:
        spec = LoraSpec(rank=data["r"], alpha=data["lora_alpha"], targets=tuple(ours.get("targets", ())))
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{file}: bad LoRA settings ({e})") from None
    by_module = {m: k for k, m in _module_names(model.config, ours["base_family"]).items()}
    infos, _ = read_header(path / ADAPTER_WEIGHTS)
    params: dict[str, np.ndarray] = {}
    for key, info in infos.items():
        kind = next((k for k, s in _SUFFIX.items() if key.endswith(s)), None)
        module = key[len(PEFT_PREFIX): -len(_SUFFIX[kind])] if kind and key.startswith(PEFT_PREFIX) else None
        if module not in by_module:
            raise ConfigError(f"{file}: adapters made for another base model: {ADAPTER_WEIGHTS} tensor {key!r} "
                              f"adapts no linear layer of this model")
        owner, proj = by_module[module].rsplit(".", 2)[:2]
        params[f"{owner}.lora.{proj}.{kind}"] = info.read().T
    current = lora_spec(model)
    if current is None:
        attach_lora(model, spec)
    elif current != spec:
        raise ConfigError(f"{file}: the model already has other LoRA adapters ({current}); remove_lora first")
    want = {k: v.shape for k, v in lora_params(model).items()}
    for name in sorted(set(want) | set(params)):
        got = params[name].shape if name in params else None
        if got != want.get(name):
            what = "missing" if got is None else f"shape {got[::-1]} (stored)"
            raise ConfigError(f"{file}: adapters made for another base model: the adapter of {kernel_name(name)} is "
                              f"{what}, this model needs {None if name not in want else want[name][::-1]}")
    return set_lora_params(model, params)


def load_adapted(base: str | os.PathLike, adapters: str | os.PathLike, *, verify: bool = True,
                 **overrides: Any) -> Transformer:
    """`load_pretrained(base)` with the adapters at `adapters` attached, their recorded base
    hash checked against `base`."""
    return load_adapters(adapters, load_pretrained(base, verify=verify, **overrides), base=base, verify=verify)

"""The on-device runner: decode from an exported bundle with LiteRT and the host runtime.

Imports NumPy, `ai_edge_litert` and the NumPy-only host runtime, never JAX or Flax: this is
what ships next to a phone app. A bundle (written by `dlm-jax export`, see
`dlm_jax.tflite_export.bundle`) is a directory whose files `dlm_jax.executors.bundle_files` names
and describes: `bundle.json`, `model.tflite` (one signature per bucket, one shared copy of the
weights), the checkpoint's tokenizer files, optional `latency.json` / `plan.json`, and a
`manifest.json` checked when the bundle is opened. A partitioned bundle (`export --partition`,
`--sparse`) holds the programs of the lowering's NPU/CPU split instead
(`dlm_jax.executors.partition_contract`) and the files beside them;
`dlm_jax.executors.partitioned.PartitionedExecutor` runs it.

    model = dlm_jax.executors.runner.load_bundle("bundles/llada-tiny")       # a BundleModel (a dlm_jax.Model)
    print(model.generate("564+894=", model.decode_defaults).texts[0])

`LiteRTExecutor` implements the step contract (`dlm_jax.runtime.step`) over LiteRT's
`CompiledModel` (XNNPACK on CPU; GPU or NPU where the machine has one), so the decoder, commit
rules and caches are the very ones the JAX executor drives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax._model import Model, stored_tokenizer
from dlm_jax._tokenizer import Tokenizer
from dlm_jax.executors._litert import (ACCELERATORS, compiled_model, native_stderr_captured,  # noqa: F401
                             read_outputs, zero_inputs)
from dlm_jax.executors.bundle_files import BUNDLE_FILE, BUNDLE_FORMAT, BUNDLE_VERSION, MODEL_FILE
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.step import (BuildCounts, Capabilities, Executor, StepInputs, StepOutputs, output_specs,
                                  signature_inputs, signature_name)



def key_to_dict(key: BucketKey) -> dict[str, Any]:
    return {"batch": key.batch, "window": key.window, "cache": key.cache, "rows": key.rows,
            "logits": key.full_logits, "router_topk": key.router_topk, "ffn_active": key.ffn_active,
            "signature": signature_name(key)}


def key_from_dict(entry: dict[str, Any]) -> BucketKey:
    return BucketKey(int(entry["batch"]), int(entry["window"]), int(entry["cache"]), int(entry["rows"]),
                     bool(entry.get("logits", False)), bool(entry.get("router_topk", False)),
                     bool(entry.get("ffn_active", False)))


@dataclasses.dataclass(frozen=True)
class Bundle:
    """An opened bundle: its directory and `bundle.json`, checked against the manifest."""

    path: Path
    meta: dict[str, Any]

    @classmethod
    def open(cls, path: str | os.PathLike, *, verify: bool = True) -> Bundle:
        """Read `bundle.json`; with `verify`, check every file against `manifest.json` first
        (a truncated or modified file is named).

        Raises:
          CheckpointError: not a bundle, an unknown format version, a file that fails its check.
        """
        from dlm_jax._integrity import verify_manifest

        path = Path(path)
        meta_path = path / BUNDLE_FILE
        if not meta_path.is_file():
            what = "does not exist" if not path.exists() else f"has no {BUNDLE_FILE}"
            raise CheckpointError(f"{path}: {what}; not a bundle (make one with dlm-jax export)")
        if verify:
            verify_manifest(path, required=True)
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if meta.get("format") != BUNDLE_FORMAT:
                raise ValueError(f"format {meta.get('format')!r} is not {BUNDLE_FORMAT!r}")
            if meta.get("version") != BUNDLE_VERSION:
                raise ValueError(f"version {meta.get('version')!r}; this runner reads version {BUNDLE_VERSION}")
            ModelConfig.from_dict(meta["config"])
            [key_from_dict(b) for b in meta["buckets"]]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{meta_path}: not a readable bundle description ({e})") from None
        return cls(path, meta)

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.meta["config"])

    @property
    def keys(self) -> list[BucketKey]:
        return sorted(key_from_dict(b) for b in self.meta["buckets"])

    @property
    def quant(self) -> str:
        return self.meta.get("quant", {}).get("mode", "none")

    @property
    def accelerator(self) -> str:
        """The accelerator of `ACCELERATORS` the bundle was exported for: its target's, a
        vendor NPU target (`qualcomm-*`) counting as "npu"."""
        target = self.meta.get("target", "cpu")
        return target if target in ACCELERATORS else "npu"

    @property
    def model_path(self) -> Path:
        return self.path / self.meta.get("model", MODEL_FILE)

    @property
    def gated(self) -> bool:
        """Whether the bundle's model carries LoRA adapters: every signature takes `lora_gate`."""
        return bool(self.meta.get("lora"))

    def decode_defaults(self) -> DecodeConfig:
        """The decode options recorded at export, as a `DecodeConfig`."""
        from dlm_jax.runtime.registry import build

        return build(self.meta.get("decode", {}))

    def describe(self) -> dict[str, Any]:
        partitioned = "partition" in self.meta  # its programs are not named after the buckets
        return {"bundle": str(self.path), "quant": self.quant, "target": self.meta.get("target"),
                "buckets": [str(k) if partitioned else signature_name(k) for k in self.keys],
                **({"programs": len(self.meta["partition"]["npu"]) + len(self.meta["partition"]["cpu"])}
                   if partitioned else {}),
                "model_bytes": self.model_path.stat().st_size}


class _Signature:
    """One bucket's signature with its input and output buffers, made once and reused."""

    def __init__(self, model, config: ModelConfig, key: BucketKey, gated: bool = False):
        name = signature_name(key)
        self.name = name
        self.index = model.get_signature_index(name)
        listed = model.get_signature_list()[name]
        self.input_names: list[str] = list(listed["inputs"])
        self.output_names: list[str] = list(listed["outputs"])
        self.inputs = model.create_input_buffers(self.index)
        self.outputs = model.create_output_buffers(self.index)
        self.out_specs = {n: (shape, np.dtype(dtype)) for n, shape, dtype in output_specs(config, key)}
        wanted = {n for n, _, _ in signature_inputs(config, key, gated=gated)}
        if set(self.input_names) != wanted or set(self.output_names) != set(self.out_specs):
            raise CheckpointError(f"signature {name}: inputs {self.input_names} / outputs {self.output_names} do "
                                  f"not follow the step contract (expected {sorted(wanted)} / "
                                  f"{sorted(self.out_specs)})")

    def run(self, model, inputs: StepInputs, timings: dict[str, float] | None = None) -> StepOutputs:
        """Copy the inputs into the buffers, run, read back the outputs asked for.

        Writing `k_cache`/`v_cache` is a second host copy of the K/V the cache gathered, every
        step: ai_edge_litert 2.3.0 has no way to hand LiteRT caller memory for them. Its
        `TensorBuffer.create_from_host_memory` (read in place) takes no shape, so the buffer is
        rank 1 ([num_elements]), which LiteRT refuses for these static 5-D inputs ("Cannot
        auto-resize tensor k_cache: no dims_signature exists"); and a `TensorBuffer` offers no
        view of its own memory (no lock or host-memory access in Python; `read` copies)."""
        t0 = time.perf_counter()
        for name, buffer in zip(self.input_names, self.inputs):
            buffer.write(getattr(inputs, name))
        t1 = time.perf_counter()
        model.run_by_index(self.index, self.inputs, self.outputs)
        t2 = time.perf_counter()
        skip = set() if inputs.want.kv else {"k_new", "v_new"}
        if not inputs.want.logits:
            skip.add("logits")
        named = read_outputs(self.output_names, self.outputs, self.out_specs, skip)
        if timings is not None:
            timings.update(h2d=t1 - t0, compute=t2 - t1, d2h=time.perf_counter() - t2)
        return StepOutputs.from_named(named)


class LiteRTExecutor(Executor):
    """Executor over a bundle's `.tflite`: one signature per bucket, run by LiteRT's
    `CompiledModel` on `accelerator` (cpu: XNNPACK with `threads` threads; gpu; npu).

    `cpu_fallback` lets a GPU/NPU run place the ops that accelerator cannot take on the CPU;
    without it, a model the accelerator cannot run whole is refused."""

    def __init__(self, bundle: Bundle, *, accelerator: str = "cpu", threads: int = 2, cpu_fallback: bool = False):
        self.bundle = bundle
        self.config = bundle.config
        self.accelerator = accelerator
        self._content = bundle.model_path.read_bytes()  # LiteRT reads from this buffer: keep it alive
        self._model = compiled_model(self._content, accelerator=accelerator, threads=threads,
                                     cpu_fallback=cpu_fallback, owner=self)
        self.fully_accelerated = bool(self._model.is_fully_accelerated())
        keys = bundle.keys
        hint = (f"the bundle {bundle.path} has no bucket for this decode: add buckets with dlm-jax export "
                f"--model <checkpoint> --out {bundle.path} --add --for-prompts <prompt tokens> and the decode "
                f"options you run with")
        self._capabilities = dataclasses.replace(Capabilities.from_keys(keys), missing_hint=hint,
                                                 inputs=frozenset({"lora_gate"} if bundle.gated else ()))
        self._signatures: dict[BucketKey, _Signature] = {}
        self._setup_seconds = 0.0
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def _signature(self, key: BucketKey) -> _Signature:
        sig = self._signatures.get(key)
        if sig is None:
            # A bucket returning more (logits, routed experts, neuron activity) also serves a step not reading them.
            wider = (dataclasses.replace(key, full_logits=key.full_logits or a, router_topk=key.router_topk or b,
                                         ffn_active=key.ffn_active or c)
                     for c in (False, True) for a, b in ((False, False), (True, False), (False, True), (True, True)))
            stored = next((k for k in wider if k in self._capabilities.keys), key)
            if stored not in self._capabilities.keys:
                raise ConfigError(f"no signature {signature_name(key)} in {self.bundle.path} "
                                  f"({len(self._capabilities.keys)} buckets)")
            t0 = time.perf_counter()
            sig = _Signature(self._model, self.config, stored, self.bundle.gated)
            self._signatures[key] = sig
            self._setup_seconds += time.perf_counter() - t0
        return sig

    def warmup(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False) -> int:
        """Create the buffers of every bucket in `keys` and run each once; returns how many were new."""
        new = [k for k in dict.fromkeys(keys) if k not in self._signatures]
        for key in new:
            self.step(zero_inputs(self.config, key, gated=self.bundle.gated))
        return len(new)

    def close(self) -> None:
        """Release the compiled model and its buffers now."""
        import gc

        with self._lock, native_stderr_captured():
            self._signatures.clear()
            self._model = None
            gc.collect()

    def build_counts(self) -> BuildCounts:
        """Signatures set up so far (their buffers created; XNNPACK packs on the first run)."""
        return BuildCounts(compiles=len(self._signatures), compile_seconds=self._setup_seconds)

    def step(self, inputs: StepInputs, *, timings: dict[str, float] | None = None) -> StepOutputs:
        """Run one step; with `timings`, the seconds spent writing the input buffers ("h2d"),
        running the signature ("compute") and reading the outputs ("d2h")."""
        key = inputs.key
        with self._lock:
            if key in self._signatures:
                return self._signatures[key].run(self._model, inputs, timings)
            with native_stderr_captured():  # a first run sets LiteRT up, which it logs
                return self._signature(key).run(self._model, inputs, timings)


class BundleModel(Model):
    """A `Model` that decodes from a bundle with LiteRT: `generate`, `encode`,
    `prompt_format` as for a checkpoint, plus the opened `bundle`, its `decode_defaults` (the
    decode options recorded at export) and `accelerator_note` (set when the accelerator runs
    only part of the model and the rest falls back to the CPU; else None)."""

    def __init__(self, bundle: Bundle, tokenizer: Tokenizer, *, executor: Executor,
                 decode_defaults: DecodeConfig, accelerator_note: str | None = None):
        super().__init__(None, tokenizer, executor=executor, config=bundle.config)
        self.bundle = bundle
        self.decode_defaults = decode_defaults
        self.accelerator_note = accelerator_note


def bundle_executor(bundle: Bundle, *, accelerator: str = "cpu", threads: int = 2, cpu_fallback: bool = False,
                    **neurons: Any) -> Executor:
    """The executor of an opened bundle: `LiteRTExecutor`, or for a partitioned bundle
    `dlm_jax.executors.partitioned.PartitionedExecutor` (`neurons`: its cold-path options,
    `memory_budget_mb`, `oracle`, `pipeline`, `direct`, `on_note`, `audit`, `prefetch`)."""
    if "partition" in bundle.meta:
        from dlm_jax.executors.partitioned import open_executor

        return open_executor(bundle, accelerator=accelerator, threads=threads, cpu_fallback=cpu_fallback, **neurons)
    if neurons.get("memory_budget_mb") is not None:
        raise ConfigError(f"{bundle.path} is not a sparse bundle: a memory budget applies to bundles exported "
                          "with --sparse")
    return LiteRTExecutor(bundle, accelerator=accelerator, threads=threads, cpu_fallback=cpu_fallback)


def load_bundle(path: str | os.PathLike, *, accelerator: str = "cpu", threads: int = 2,
                cpu_fallback: bool = False, verify: bool = True, **neurons: Any) -> BundleModel:
    """Open a bundle and return a `BundleModel` that decodes it with LiteRT on `accelerator`
    (`neurons`: a sparse bundle's cold-path options, see `bundle_executor`)."""
    bundle = Bundle.open(path, verify=verify)
    tokenizer = stored_tokenizer(bundle.path)
    executor = bundle_executor(bundle, accelerator=accelerator, threads=threads, cpu_fallback=cpu_fallback,
                               **neurons)
    note = None
    if accelerator != "cpu" and not getattr(executor, "fully_accelerated", True):
        note = f"the {accelerator} runs only part of {bundle.model_path.name}; the remaining ops fall back to the CPU"
    return BundleModel(bundle, tokenizer, executor=executor, decode_defaults=bundle.decode_defaults(),
                       accelerator_note=note)

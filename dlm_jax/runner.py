"""The on-device runner: decode from an exported bundle with LiteRT and the host runtime.

Imports NumPy, `ai_edge_litert` and the NumPy-only host runtime, never JAX or Flax: this is
what ships next to a phone app. A bundle (written by `dlm-jax export`, see
`tflite_export.bundle`) is a directory:

    bundle.json       format, model config, buckets (signature per bucket), quantisation,
                      target, decode defaults, prompt format, versions
    model.tflite      one signature per bucket, one shared copy of the weights
    tokenizer files   as the checkpoint had them (tokenizer.json / tokenizer_config.json / ...)
    latency.json      measured step latency per bucket (this runner, CPU)
    plan.json         the lowering plan: partition and memory plan per signature
    manifest.json     size and sha256 of every file above, checked when the bundle is opened

    model = dlm_jax.runner.load_bundle("bundles/llada-tiny")       # a BundleModel (a dlm_jax.Model)
    print(model.generate("564+894=", model.decode_defaults).texts[0])

`LiteRTExecutor` implements the step contract (`dlm_jax.runtime.step`) over LiteRT's
`CompiledModel` (XNNPACK on CPU; GPU or NPU where the machine has one), so the decoder, commit
rules and caches are the very ones the JAX executor drives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax._model import Model, stored_tokenizer
from dlm_jax._tokenizer import Tokenizer
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.step import (BuildCounts, Capabilities, Executor, OutputRequest, StepInputs, StepOutputs,
                                  input_specs, output_specs, signature_inputs, signature_name)

BUNDLE_FORMAT = "dlm-jax-bundle"
BUNDLE_VERSION = 1
BUNDLE_FILE = "bundle.json"
MODEL_FILE = "model.tflite"
ACCELERATORS = ("cpu", "gpu", "npu")


def key_to_dict(key: BucketKey) -> dict[str, Any]:
    return {"batch": key.batch, "window": key.window, "cache": key.cache, "rows": key.rows,
            "logits": key.full_logits, "router_topk": key.router_topk, "signature": signature_name(key)}


def key_from_dict(entry: dict[str, Any]) -> BucketKey:
    return BucketKey(int(entry["batch"]), int(entry["window"]), int(entry["cache"]), int(entry["rows"]),
                     bool(entry.get("logits", False)), bool(entry.get("router_topk", False)))


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
        return {"bundle": str(self.path), "quant": self.quant, "target": self.meta.get("target"),
                "buckets": [signature_name(k) for k in self.keys],
                "model_bytes": self.model_path.stat().st_size}


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[list[str]]:
    """Route the native libraries' stderr (LiteRT logs every delegate it creates) into a
    buffer for the duration; the captured lines are yielded to the caller, who may report
    them on failure."""
    lines: list[str] = []
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to redirect
        yield lines
        return
    with tempfile.TemporaryFile() as sink:
        try:
            os.dup2(sink.fileno(), 2)
            yield lines
        finally:
            _flush_c_stdio()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode("utf-8", "replace").splitlines())


def _flush_c_stdio() -> None:
    """Flush the C library's stdio buffers (native logs reach the descriptor only then)."""
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _accelerator_flags(name: str, *, cpu_fallback: bool):
    from ai_edge_litert.hardware_accelerator import HardwareAccelerator as HA

    flags = {"cpu": HA.CPU, "gpu": HA.GPU, "npu": HA.NPU}[name]
    return flags | HA.CPU if cpu_fallback and name != "cpu" else flags


def _reason(error: Exception, log: Sequence[str]) -> str:
    """The most telling line of a LiteRT failure (its own message is a source-location chain)."""
    telling = [line for line in log if "ERROR" in line or "Failed" in line]
    text = " ".join(str(error).split())
    for line in reversed(telling or [text]):
        line = " ".join(line.split("]", 1)[-1].split()) if "]" in line else line
        if line:
            return line
    return text


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
        named = {}
        for name, buffer in zip(self.output_names, self.outputs):
            if name in skip:
                continue
            shape, dtype = self.out_specs[name]
            named[name] = buffer.read(int(np.prod(shape)), dtype).reshape(shape)
        if timings is not None:
            timings.update(h2d=t1 - t0, compute=t2 - t1, d2h=time.perf_counter() - t2)
        return StepOutputs.from_named(named)


class LiteRTExecutor(Executor):
    """Executor over a bundle's `.tflite`: one signature per bucket, run by LiteRT's
    `CompiledModel` on `accelerator` (cpu: XNNPACK with `threads` threads; gpu; npu).

    `cpu_fallback` lets a GPU/NPU run place the ops that accelerator cannot take on the CPU;
    without it, a model the accelerator cannot run whole is refused."""

    def __init__(self, bundle: Bundle, *, accelerator: str = "cpu", threads: int = 2, cpu_fallback: bool = False):
        if accelerator not in ACCELERATORS:
            raise ConfigError(f"unknown accelerator {accelerator!r}; known: {', '.join(ACCELERATORS)}")
        if threads < 0:
            raise ConfigError(f"threads={threads} must be >= 0 (0: LiteRT decides)")
        from ai_edge_litert.compiled_model import CompiledModel
        from ai_edge_litert.cpu_options import CpuOptions
        from ai_edge_litert.options import Options

        self.bundle = bundle
        self.config = bundle.config
        self.accelerator = accelerator
        self._content = bundle.model_path.read_bytes()  # LiteRT reads from this buffer: keep it alive
        # XNNPACK packs the weights of every signature it prepares; with a weight cache file the
        # signatures share one packed copy (without it, memory grows by a copy per bucket).
        self._cache_dir = tempfile.mkdtemp(prefix="dlm-jax-xnnpack-")
        weakref.finalize(self, shutil.rmtree, self._cache_dir, ignore_errors=True)
        cache = os.path.join(self._cache_dir, "weights.xnnpack_cache")
        options = Options(hardware_accelerators=_accelerator_flags(accelerator, cpu_fallback=cpu_fallback),
                          cpu_options=CpuOptions(num_threads=threads, xnnpack_weight_cache_path=cache))
        with native_stderr_captured() as log:
            try:
                self._model = CompiledModel.from_buffer(self._content, options=options)
            except RuntimeError as e:
                error = e
            else:
                error = None
        if error is not None:
            fallback = "" if cpu_fallback or accelerator == "cpu" else "; --cpu-fallback runs what it cannot take on the CPU"
            raise ConfigError(f"accelerator {accelerator!r} is not available on this machine "
                              f"(LiteRT: {_reason(error, log)}){fallback}") from None
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
            # A bucket returning more (logits, routed experts) also serves a step not reading them.
            wider = (dataclasses.replace(key, full_logits=key.full_logits or a, router_topk=key.router_topk or b)
                     for a, b in ((False, False), (True, False), (False, True), (True, True)))
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


def quiet_native_exit() -> None:
    """Send the native stderr to /dev/null for the rest of the process: LiteRT logs each
    accelerator it tears down at exit, after the last line a command prints."""
    import sys

    sys.stderr.flush()
    _flush_c_stdio()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def zero_inputs(config: ModelConfig, key: BucketKey, *, gated: bool = False) -> StepInputs:
    """A step of bucket `key` with zero inputs and every slot visible (warm-up, timing); a
    gated bundle's (LoRA adapters) with a zero `lora_gate`."""
    arrays = {name: np.zeros(shape, dtype) for name, shape, dtype in input_specs(config, key)}
    arrays["visibility"][...] = True
    if gated:
        arrays["lora_gate"] = np.zeros((key.batch, key.window), np.float32)
    return StepInputs(**arrays, want=OutputRequest(kv=True, logits=key.full_logits, router_topk=key.router_topk))


class BundleModel(Model):
    """A `Model` that decodes from a bundle with LiteRT: `generate`, `encode`,
    `prompt_format` as for a checkpoint, plus the opened `bundle`, its `decode_defaults` (the
    decode options recorded at export) and `accelerator_note` (set when the accelerator runs
    only part of the model and the rest falls back to the CPU; else None)."""

    def __init__(self, bundle: Bundle, tokenizer: Tokenizer, *, executor: LiteRTExecutor,
                 decode_defaults: DecodeConfig, accelerator_note: str | None = None):
        super().__init__(None, tokenizer, executor=executor, config=bundle.config)
        self.bundle = bundle
        self.decode_defaults = decode_defaults
        self.accelerator_note = accelerator_note


def load_bundle(path: str | os.PathLike, *, accelerator: str = "cpu", threads: int = 2,
                cpu_fallback: bool = False, verify: bool = True) -> BundleModel:
    """Open a bundle and return a `BundleModel` that decodes it with LiteRT on `accelerator`."""
    bundle = Bundle.open(path, verify=verify)
    tokenizer = stored_tokenizer(bundle.path)
    executor = LiteRTExecutor(bundle, accelerator=accelerator, threads=threads, cpu_fallback=cpu_fallback)
    note = None
    if accelerator != "cpu" and not executor.fully_accelerated:
        note = f"the {accelerator} runs only part of {bundle.model_path.name}; the remaining ops fall back to the CPU"
    return BundleModel(bundle, tokenizer, executor=executor, decode_defaults=bundle.decode_defaults(),
                       accelerator_note=note)

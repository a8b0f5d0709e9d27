"""`dlm-jax export`: a checkpoint -> a bundle directory the runner (`dlm_jax.executors.runner`) decodes from.

    keys = buckets_for_prompts(config, decode, max_prompt=64, batches=(1,))
    export_bundle("models/llada-tiny", "bundles/llada-tiny", keys=keys, quant="int8", decode=decode)

One `.tflite` holds one signature per bucket; the converter stores each constant once, so the
weights are shared and a bucket adds only its graph (`bundle.json` records the bytes per
bucket). Quantisation uses LiteRT's own quantised kernels through `ai-edge-quantizer`
recipes (`QUANT_MODES`): weights stored as int8 / int4 constants that XNNPACK's
dynamic-range FULLY_CONNECTED kernels consume directly (activations quantised per row at run
time), not float weights with DEQUANTIZE ops, which would run at float speed from float memory.

The bundle is built in a temporary sibling directory and renamed into place, so an
interrupted export leaves the previous bundle (or nothing) behind, never a half-written one.
Qualcomm targets compile ahead of time through `ai_edge_litert.aot`, which needs the vendor
SDK package; without it the export stops before writing anything, naming the package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dlm_jax._config import SPARSE_FFN_KINDS
from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax._model import MissingTokenizer, stored_tokenizer
from dlm_jax.executors.bundle_files import (BUNDLE_FILE, BUNDLE_FORMAT, BUNDLE_VERSION, CPU_PROGRAMS_FILE,
                                           CPU_WEIGHTS_FILE, FLASH_FILE, LATENCY_FILE, MODEL_FILE, NEURONS_FILE,
                                           PLAN_FILE, PREDICTOR_FILE)
from dlm_jax.executors.runner import Bundle, bundle_executor, key_to_dict, native_stderr_captured, zero_inputs
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.registry import decode_options
from dlm_jax.runtime.step import parse_signature_name

if TYPE_CHECKING:
    from dlm_jax._tokenizer import Tokenizer
    from dlm_jax.models._transformer import Transformer

QUANT_MODES: dict[str, str] = {
    "none": "float32 weights and activations",
    "int8": "ai-edge-quantizer dynamic_wi8_afp32: int8 weights, one symmetric scale per output channel; "
            "FULLY_CONNECTED quantises its input per row at run time (XNNPACK qd8-f32-qc8w)",
    "int4": "ai-edge-quantizer dynamic int4 BLOCKWISE_32: int4 weights in blocks of 32 along the input "
            "dimension with one scale each (Q4_0's granularity); FULLY_CONNECTED quantises its input at "
            "run time (XNNPACK qd8-f32-qb4w)",
    "int4-outliers": "PowerInfer-2's NPU quantisation (partitioned bundles): each NPU linear split on its input "
                     "channels, the top 1% by AWQ salience INT8 channelwise, the rest INT4 channelwise, two "
                     "FULLY_CONNECTED ops (XNNPACK qd8-f32-qc4w + qd8-f32-qc8w); the CPU head int8 channelwise",
}
TARGETS: dict[str, str | None] = {"cpu": None, "gpu": None, "npu": None,
                                  "qualcomm-sm8650": "SM8650", "qualcomm-sm8750": "SM8750",
                                  "qualcomm-sm8850": "SM8850"}
QUALCOMM_SDK_PACKAGE = "ai-edge-litert-sdk-qualcomm"


def parse_bucket(text: str) -> BucketKey:
    """A bucket from its signature name (`step_w32_p64_r32`, `_b4` for batch 4, then `_full`,
    `_topk`, `_act` for its optional outputs), as bundles and error messages print them
    (`dlm_jax.runtime.step.parse_signature_name`, the inverse of `signature_name`)."""
    return parse_signature_name(text)


class _Sizes:
    """The executor stand-in a `Decoder` needs to enumerate buckets: the JAX executor's
    default bucket sets for the model's length."""

    def __init__(self, config):
        import dataclasses

        from dlm_jax.runtime.step import Capabilities, model_outputs

        # an MoE model's bundle can return the routed experts (`--experts`), a sparse FFN's its neuron activity
        caps = Capabilities.for_length(config.max_seq_len)
        caps = dataclasses.replace(caps, outputs=caps.outputs | model_outputs(config))
        self.capabilities = caps


def buckets_for_prompts(config, decode, *, max_prompt: int, batches: Sequence[int] = (1,)) -> list[BucketKey]:
    """Every bucket a decode with `decode` options needs for prompts of 1..`max_prompt` tokens
    in batches of each size in `batches` (the decoder's own `bucket_keys`)."""
    from dlm_jax.runtime.decoder import Decoder

    decoder = Decoder(_Sizes(config), config)
    if max_prompt <= 0:
        raise ConfigError(f"--for-prompts {max_prompt} must be a positive number of tokens")
    limit = decoder.max_tokens - decode.gen_len
    if max_prompt > limit:
        raise ConfigError(f"prompts of {max_prompt} tokens + gen_len {decode.gen_len} exceed the model's "
                          f"{decoder.max_tokens} tokens; the longest prompt this decode allows is {limit}")
    keys: set[BucketKey] = set()
    for batch in batches:
        for n in range(1, max_prompt + 1):
            keys.update(decoder.bucket_keys([n] * batch, decode))
    return sorted(keys)


def quantize_tflite(content: bytes, mode: str) -> bytes:
    """`content` with its weights quantised by LiteRT's quantizer (`QUANT_MODES`)."""
    if mode not in QUANT_MODES:
        raise ConfigError(f"unknown quantisation {mode!r}; known: {', '.join(QUANT_MODES)}")
    if mode == "none":
        return content
    if mode == "int4-outliers":
        raise ConfigError("int4-outliers quantises the NPU programs of a partitioned bundle (pass --partition)")
    from ai_edge_quantizer import qtyping, quantizer, recipe, recipe_manager

    if mode == "int8":
        rcp = recipe.dynamic_wi8_afp32()
    else:
        manager = recipe_manager.RecipeManager()
        manager.add_dynamic_config(regex=".*", operation_name=qtyping.TFLOperationName.ALL_SUPPORTED, num_bits=4,
                                   granularity=qtyping.QuantGranularity.BLOCKWISE_32)
        rcp = manager.get_quantization_recipe()
    # The quantizer prints a size summary and progress bars; the exporter shows its own.
    with native_stderr_captured(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return bytes(quantizer.Quantizer(content, rcp).quantize().quantized_model)


def qualcomm_target(target: str):
    """The `ai_edge_litert.aot` target of a `qualcomm-*` name, after checking the vendor SDK
    package is importable.

    Raises:
      ConfigError: naming the missing package (its install downloads the vendor SDK).
    """
    from ai_edge_litert.aot.vendors.qualcomm import target as qnn

    soc = qnn.Target(soc_model=qnn.SocModel(TARGETS[target]))
    try:
        import ai_edge_litert_sdk_qualcomm  # noqa: F401
    except ImportError:
        raise ConfigError(f"--target {target} compiles ahead of time for the {soc!r} NPU with the Qualcomm AI "
                          f"Engine Direct SDK, and its Python package {QUALCOMM_SDK_PACKAGE} is not installed "
                          f"(pip install {QUALCOMM_SDK_PACKAGE}; its install fetches the SDK from the vendor). "
                          f"Export with --target npu for LiteRT's on-device compilation instead") from None
    return soc


def aot_compile_qualcomm(content: bytes, soc) -> bytes:
    """`content` compiled for a Qualcomm SoC by LiteRT's AOT flow (needs the vendor SDK)."""
    import tempfile

    from ai_edge_litert.aot import aot_compile
    from ai_edge_litert.aot.core import aot_types

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / MODEL_FILE
        src.write_bytes(content)
        result = aot_compile.aot_compile(str(src), output_dir=tmp, target=soc, keep_going=False)
        models = [m for _, m in getattr(result, "models_with_backend", [])]
        if not models:
            raise ConfigError(f"ahead-of-time compilation for {soc!r} produced no model: {result}")
        model: aot_types.Model = models[0]
        return model.model_bytes


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("dlm-jax", "jax", "litert-converter", "ai-edge-litert", "ai-edge-quantizer"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _measure_latency(bundle_dir: Path, keys: Sequence[BucketKey], repeats: int) -> dict[str, Any]:
    """Median step latency of every bucket with the runner on this CPU (XNNPACK, 2 threads)."""
    import gc
    import platform

    bundle = Bundle.open(bundle_dir, verify=False)
    executor = bundle_executor(bundle, accelerator="cpu", threads=2)
    entries = []
    for key in keys:
        inputs = zero_inputs(executor.config, key, gated=bundle.gated)
        executor.step(inputs)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            executor.step(inputs)
            times.append((time.perf_counter() - t0) * 1e3)
        entries.append({"window": key.window, "cache": key.cache, "batch": key.batch, "rows": key.rows,
                        "median_ms": float(np.median(times)), "p10_ms": float(np.percentile(times, 10)),
                        "p90_ms": float(np.percentile(times, 90))})
    with native_stderr_captured():  # LiteRT logs its teardown
        del executor
        gc.collect()
    return {"device": f"litert-xnnpack-2threads ({platform.machine()})", "model": {}, "entries": entries}


def _lowering_plan(content: bytes, config, keys: Sequence[BucketKey], quant: str, params) -> dict[str, Any]:
    """Partition and memory plan per signature (`dlm_jax.techniques.lladacpp.somr.plan_bundle`), the
    quantisation of this `.tflite`, and the NPU-side mixed precision a QNN path would use
    (PowerInfer-2's INT4 per channel + INT8 outlier input channels): its rule and, per linear
    weight, the outlier channels and the weight error."""
    from dlm_jax.techniques.lladacpp.somr import plan_bundle
    from dlm_jax.lowering.quant import quantize_mixed, weight_error

    plan = plan_bundle(content, config, list(keys))
    plan["quantization"] = {"mode": quant, "method": QUANT_MODES[quant]}
    npu, rule = {}, None
    for name, value in sorted(params.items()):
        if np.ndim(value) != 2 or name.startswith("embed"):
            continue
        w = np.asarray(value, np.float32).T  # kernel [in, out] -> W [out, in]
        mixed = quantize_mixed(w)
        rule = mixed.rule
        npu[name] = {"outlier_channels": mixed.outliers.tolist(),
                     "rel_error": round(weight_error(w, mixed.dequantize()).rel_fro, 6)}
    plan["npu_quantization"] = {"rule": rule, "weights": npu}
    return plan


@dataclasses.dataclass(frozen=True)
class SparseExport:
    """What a sparse bundle needs beyond the model: the neuron plan (`dlm_jax.techniques.powerinfer.neuron_plan.NeuronPlan`:
    each layer's neurons hottest first and the hot count per window bucket), the hot neurons'
    cluster size (hot counts round down to whole clusters; each cluster is one NPU constant),
    the activation predictor and the activation statistics it was planned from."""

    plan: Any  # NeuronPlan
    predictor: Any = None  # LowRankPredictor
    stats: Any = None  # ActivationStats
    cluster: int = 128
    flash_dtype: str = "float32"

    def hot_count(self, layer: int, window: int) -> int:
        return int(self.plan.hot[self.plan.bucket(window)][layer]) // self.cluster * self.cluster

    def clusters(self, programs, n_layers: int) -> dict[tuple[int, int], list[np.ndarray]]:
        """{(layer, tiled window): the hot clusters' neuron indices}, for the export."""
        out = {}
        for _, w, _ in programs.bodies:
            for i in range(n_layers):
                n = self.hot_count(i, w) // self.cluster
                out[(i, w)] = [self.plan.order[i][c * self.cluster:(c + 1) * self.cluster] for c in range(n)]
        return out


def _write_partition(tmp: Path, model, programs, sparse: SparseExport | None) -> dict[str, Any]:
    """The partitioned bundle's CPU-side files (embedding table; for a sparse bundle the flash
    file, the neuron plan and the predictor) and `bundle.json`'s "partition" entry."""
    from dlm_jax.checkpoint._safetensors import save_file
    from dlm_jax.models._params import get_params
    from dlm_jax.executors.partition_contract import describe

    params = get_params(model)
    save_file({"embedding": np.ascontiguousarray(params["embed.embedding"])}, tmp / CPU_WEIGHTS_FILE)
    extra: dict[str, Any] = {"cpu_weights": CPU_WEIGHTS_FILE, "cpu_programs": CPU_PROGRAMS_FILE}
    if sparse is not None:
        from dlm_jax.techniques.powerinfer.flash import write_flash

        cfg = model.config
        layers = []
        for i in range(cfg.n_layers):
            pre = f"layers.{i}.ffn."
            layer = {"up": params[pre + "up_proj.kernel"].T, "down": params[pre + "down_proj.kernel"].T}
            if cfg.ffn == "reglu":
                layer["gate"] = params[pre + "gate_proj.kernel"].T
            layers.append(layer)
        # laid out in the plan's order (hottest first): cold neurons of similar activation
        # probability are flash neighbours, and a read-ahead is one run per layer
        header = write_flash(tmp / FLASH_FILE, layers, kind=cfg.ffn, dtype=sparse.flash_dtype,
                             order=sparse.plan.order)
        hot = {str(w): [sparse.hot_count(i, w) for i in range(cfg.n_layers)] for _, w, _ in programs.bodies}
        neurons = {"plan": sparse.plan.to_dict(), "cluster": sparse.cluster, "hot": hot,
                   **({"stats": sparse.stats.to_dict()} if sparse.stats is not None else {})}
        (tmp / NEURONS_FILE).write_text(json.dumps(neurons) + "\n")
        extra.update(flash=FLASH_FILE, neurons=NEURONS_FILE, neuron_bytes=header.bundle_bytes)
        if sparse.predictor is not None:
            save_file(sparse.predictor.to_arrays(), tmp / PREDICTOR_FILE)
            extra["predictor"] = PREDICTOR_FILE
    return describe(programs, model.config, sparse=sparse is not None, extra=extra)


def _partition_plan(content: bytes, cpu_content: bytes, partition: dict[str, Any]) -> dict[str, Any]:
    """The lowering plan of a partitioned bundle, per program that runs: its ops, the NPU
    programs' memory plan."""
    from dlm_jax.lowering.graph import read_tflite_graph
    from dlm_jax.techniques.lladacpp.somr import plan_memory

    out: dict[str, Any] = {"format": "dlm-jax-lowering-plan", "version": 2, "partitioned": True, "programs": {}}
    for name in partition["npu"]:
        graph = read_tflite_graph(content, name)
        out["programs"][name] = {"device": "npu", "ops": len(graph.ops),
                                 "memory": plan_memory(graph).to_dict()}
    for name in partition["cpu"]:
        if name.startswith("head_"):
            out["programs"][name] = {"device": "cpu", "ops": len(read_tflite_graph(cpu_content, name).ops)}
    return out


def load_checkpoint(model_dir: str | os.PathLike, *, strict: bool = False,
                    verify: bool = True) -> tuple[Transformer, Tokenizer | MissingTokenizer]:
    """The Flax model and the tokenizer of a checkpoint (a `MissingTokenizer`, which saves
    nothing, when it ships none)."""
    from dlm_jax.checkpoint._io import load_pretrained, refuse_stored_quant

    refuse_stored_quant(model_dir, "a LiteRT bundle (its own int8 / int4 with --quant)")
    return load_pretrained(model_dir, strict=strict, verify=verify), stored_tokenizer(model_dir)


@dataclasses.dataclass
class ExportResult:
    path: Path
    keys: list[BucketKey]
    added: list[BucketKey]
    model_bytes: int
    seconds: float


def export_bundle(model_dir: str | os.PathLike, out: str | os.PathLike, *, keys: Iterable[BucketKey],
                  decode, quant: str = "none", target: str = "cpu", add: bool = False, overwrite: bool = False,
                  latency_repeats: int = 5, verify: bool = True, strict: bool = False,
                  progress: Callable[[str, int, int], None] | None = None, model: Transformer | None = None,
                  tokenizer: Tokenizer | None = None, plan: bool = True,
                  lora: str | os.PathLike | None = None, partition: bool = False,
                  sparse: SparseExport | None = None, outlier_fraction: float | None = None) -> ExportResult:
    """Export the checkpoint at `model_dir` as a bundle at `out`.

    Args:
      keys: the buckets to export (`buckets_for_prompts`, `parse_bucket`).
      decode: the `DecodeConfig` recorded as the bundle's decode defaults.
      lora: LoRA adapters made for the checkpoint (R-ISD): baked into the model, and every
        signature takes a `lora_gate` input (1.0 on the rows they apply to).
      quant: "none", "int8" or "int4" (`QUANT_MODES`).
      target: "cpu", "gpu", "npu" (the runner's default accelerator; one portable `.tflite`)
        or "qualcomm-sm8650" / "sm8750" / "sm8850" (ahead-of-time compiled; needs the SDK).
      add: `out` is a bundle of this model: keep its buckets and add `keys`.
      overwrite: replace whatever bundle `out` holds.
      progress: `progress(stage, done, total)` as signatures convert.
      verify, strict: as for `dlm_jax.load` (manifest check; refuse unknown config keys).
      model: the checkpoint's Flax model already loaded, exported as it is with `tokenizer`
        (None: the bundle holds no tokenizer files); None (default) loads both from `model_dir`.
      plan: write `plan.json` (lowering plan and NPU mixed precision); latency_repeats=0
        leaves `latency.json` out. The bundle cache (`dlm_jax.executors.bundle_cache`) skips both.
      partition: write the lowering's partition as the programs that run
        (`dlm_jax.executors.partition_contract`): tile-aligned NPU body programs, a CPU head, the
        embedding as a CPU table (`cpu.safetensors`).
      sparse: a partitioned bundle of an activation-sparse model whose layers run only their
        hot neurons on the NPU; the cold ones come from the neuron-bundled flash file
        (`ffn.flash`) through the runner's cold path (`SparseExport`).
      outlier_fraction: with quant="int4-outliers", the share of input channels kept INT8
        (default 1%; 0: INT4 per channel alone, QNN's scheme, for comparison).

    Raises:
      ConfigError: an unknown quantisation or target, a missing vendor SDK, an existing bundle
        at `out` without `add` / `overwrite`, or one of another model or quantisation.
    """
    from dlm_jax._integrity import make_temp_dir, replace_dir, write_manifest
    from dlm_jax.models._params import get_params, param_count
    from flax import nnx

    from dlm_jax.tflite_export._convert import convert_signatures, decode_signature

    t0 = time.perf_counter()
    if quant not in QUANT_MODES:
        raise ConfigError(f"unknown quantisation {quant!r}; known: {', '.join(QUANT_MODES)}")
    if target not in TARGETS:
        raise ConfigError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    soc = qualcomm_target(target) if TARGETS[target] else None
    out = Path(out)
    keys = sorted(set(keys))
    if not keys:
        raise ConfigError("no buckets to export")
    if model is None:
        model, tokenizer = load_checkpoint(model_dir, strict=strict, verify=verify)
    else:
        from dlm_jax.models._fuse import layout_refusal

        if (reason := layout_refusal(model)) is not None:
            raise ConfigError(f"export_bundle(model=...): {reason}; a bundle is exported from the checkpoint's "
                              f"layout: pass a model loaded without that (or model=None: loaded from {model_dir})")
    adapters = None
    if lora is not None:
        from dlm_jax.techniques.isd.adapters import load_adapters, read_adapter_config

        load_adapters(lora, model, base=model_dir, verify=verify)
        recorded = read_adapter_config(lora)
        adapters = {"path": str(lora), "r": recorded["r"], "lora_alpha": recorded["lora_alpha"],
                    "target_modules": recorded.get("target_modules")}
    config = model.config
    partition = partition or sparse is not None
    if partition:
        from dlm_jax.executors.partition_contract import check_partitionable

        check_partitionable(config)
        if add:
            raise ConfigError("--add does not apply to a partitioned bundle: export every bucket at once")
        if adapters is not None:
            raise ConfigError("a partitioned bundle of a model with LoRA adapters is not supported")
    if quant == "int4-outliers" and not partition:
        raise ConfigError("--quant int4-outliers quantises the NPU programs of a partitioned bundle: "
                          "add --partition (or --sparse)")
    if sparse is not None and config.ffn not in SPARSE_FFN_KINDS:
        raise ConfigError(f"--sparse needs a ReLU-family FFN (ffn = relu or reglu); this model's is {config.ffn!r}")
    existing = _existing_keys(out, config, quant, target, add=add, overwrite=overwrite, lora=adapters)
    added = [k for k in keys if k not in existing]
    keys = sorted(set(keys) | set(existing))

    graphdef, state = nnx.split(model)
    done = [0]

    def tick(name: str) -> None:
        done[0] += 1
        if progress is not None:
            progress(f"convert {name}", done[0], len(keys))

    npu = None
    if partition:
        from dlm_jax.executors.partition_contract import Programs
        from dlm_jax.tflite_export.partition import partition_signatures

        programs = Programs.for_keys(keys)
        hot = None if sparse is None else sparse.clusters(programs, config.n_layers)
        if quant == "int4-outliers":
            from dlm_jax.techniques.powerinfer.npu_quant import NpuQuant, activation_stats, calibration_sequences

            if progress is not None:
                progress("calibration (salience)", 0, 1)
            sequences = calibration_sequences(tokenizer)
            npu = NpuQuant(stats=activation_stats(model, sequences) if sequences else None,
                           **({} if outlier_fraction is None else {"fraction": outlier_fraction}))
        signatures = partition_signatures(model, programs, hot=hot, npu=npu)
        keys_total = len(signatures)

        def tick(name: str) -> None:  # noqa: F811 (progress over programs, not buckets)
            done[0] += 1
            if progress is not None:
                progress(f"convert {name}", done[0], keys_total)
    else:
        signatures = [decode_signature(graphdef, state, config, k, gated=adapters is not None) for k in keys]
    cpu_content = None
    if partition:  # the CPU programs (heads) in their own file: an NPU compiler gets the NPU programs only
        heads = [sig for sig in signatures if sig.name.startswith("head_")]
        signatures = [sig for sig in signatures if not sig.name.startswith("head_")]
        cpu_content = quantize_tflite(convert_signatures(heads, progress=tick),
                                      "int8" if npu is not None else quant)
    content = convert_signatures(signatures, progress=tick)
    float_bytes = len(content)
    if progress is not None:
        progress(f"quantize ({quant})", 0, 1)
    if npu is not None:
        from dlm_jax.techniques.powerinfer.npu_quant import quantize_npu

        content = quantize_npu(content)
    else:
        content = quantize_tflite(content, quant)
    if soc is not None:
        content = aot_compile_qualcomm(content, soc)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        (tmp / MODEL_FILE).write_bytes(content)
        if cpu_content is not None:

            (tmp / CPU_PROGRAMS_FILE).write_bytes(cpu_content)
        if tokenizer is not None:
            tokenizer.save(tmp)
        meta = {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "model": MODEL_FILE,
                "source": str(model_dir), "config": config.to_dict(),
                "buckets": [key_to_dict(k) for k in keys],
                "quant": {"mode": quant, "method": QUANT_MODES[quant]}, "target": target,
                "decode": decode_options(decode), "prompt_format": getattr(tokenizer, "prompt_format", "raw"),
                **({"lora": adapters} if adapters else {}),
                "bytes": {"model": len(content), "float_model": float_bytes,
                          "weights_float32": int(4 * param_count(config))},
                "files": {**({"latency": LATENCY_FILE} if soc is None and latency_repeats > 0 else {}),
                          **({"plan": PLAN_FILE} if plan else {})},
                "versions": _versions()}
        if partition:
            meta["partition"] = _write_partition(tmp, model, programs, sparse)
        (tmp / BUNDLE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if plan:
            if progress is not None:
                progress("lowering plan", 0, 1)
            lowering = (_partition_plan(content, cpu_content, meta["partition"]) if partition
                        else _lowering_plan(content, config, keys, quant, get_params(model)))
            if partition:
                lowering["quantization"] = ({"mode": quant, "method": QUANT_MODES[quant]} if npu is None
                                            else {**npu.plan(), "method": QUANT_MODES[quant]})
            (tmp / PLAN_FILE).write_text(json.dumps(lowering, indent=1) + "\n")
        if soc is None and latency_repeats > 0:
            if progress is not None:
                progress("latency table", 0, 1)
            latency = _measure_latency(tmp, keys, latency_repeats)
            latency["model"] = {"source": str(model_dir), "quant": quant}
            (tmp / LATENCY_FILE).write_text(json.dumps(latency, indent=2) + "\n")
        write_manifest(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out, keys, added, len(content), time.perf_counter() - t0)


def _existing_keys(out: Path, config, quant: str, target: str, *, add: bool, overwrite: bool,
                   lora: dict | None = None) -> list[BucketKey]:
    """The buckets of the bundle at `out` to keep (with `add`), after checking it may be replaced."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return []
    if not (out / BUNDLE_FILE).exists():
        raise ConfigError(f"{out} exists and is not a bundle; choose another --out (nothing was written)")
    if not (add or overwrite):
        raise ConfigError(f"{out} already holds a bundle: pass --add to add these buckets to it, or "
                          f"--overwrite to replace it")
    if overwrite and not add:
        return []
    try:
        old = Bundle.open(out)
    except CheckpointError as e:
        raise ConfigError(f"cannot add to {out}: {e}; pass --overwrite to replace it") from None
    if old.config.to_dict() != config.to_dict():
        raise ConfigError(f"cannot add to {out}: it holds another model (its config differs); "
                          f"pass --overwrite to replace it")
    if old.quant != quant or old.meta.get("target") != target:
        raise ConfigError(f"cannot add to {out}: it is quant={old.quant} target={old.meta.get('target')}, "
                          f"this export quant={quant} target={target}")
    if old.meta.get("lora") != lora:
        raise ConfigError(f"cannot add to {out}: its LoRA adapters ({(old.meta.get('lora') or {}).get('path')}) "
                          f"are not this export's ({(lora or {}).get('path')}); pass --overwrite to replace it")
    return old.keys

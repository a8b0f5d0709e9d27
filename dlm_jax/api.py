"""The Python decode API: `dlm_jax.load(path).generate(prompts, dlm_jax.preset(...))`.

`load` reads a checkpoint and builds its executor from `EXECUTORS`, the one table of
executor names (`"auto"` picks one of them per machine); the `Model` it returns
(`dlm_jax._model`) sits below this module and below every executor.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax._model import GenerateResult, MissingTokenizer, Model, Prompt, stored_tokenizer  # noqa: F401 (re-exported)
from dlm_jax.runtime.step import Executor

if TYPE_CHECKING:
    from dlm_jax.models._transformer import Transformer

class ExecutorFactory(Protocol):
    """Builds the executor of a loaded checkpoint: `model`, read from `source`."""

    def __call__(self, model: Transformer, *, source: str | os.PathLike) -> Executor: ...


def jax_executor(model: Transformer, *, source: str | os.PathLike = "", layers: str | None = None,
                 mesh=None, projections: str | None = None) -> Executor:
    """The JAX executor over `model` (`dlm_jax.executors.jax_executor.JaxExecutor`: compiled per bucket;
    `layers` "unrolled" or "scan", default `$DLM_JAX_LAYERS`; `projections` "separate" or
    "fused", default `$DLM_JAX_PROJECTIONS`; `mesh` a `MeshPlacement` or `MeshShape`: decoding
    on a device mesh)."""
    from dlm_jax.executors._compile import enable_default_cache
    from dlm_jax.executors.jax_executor import JaxExecutor

    enable_default_cache()  # compiled buckets persist across processes
    return JaxExecutor(model, layers=layers, mesh=mesh, projections=projections)


def litert_executor(model: Transformer, *, source: str | os.PathLike = "") -> Executor:
    """The LiteRT runner over the bundle cache of `model` (`dlm_jax.executors.bundle_cache`), whose
    entry is named after `source`, its checkpoint directory: the first decode that needs a
    bucket exports it, once per model and machine."""
    from dlm_jax.executors.bundle_cache import BundleCacheExecutor

    return BundleCacheExecutor(model, source=source)


def jax_then_litert_executor(model: Transformer, *, source: str | os.PathLike = "") -> Executor:
    """What "auto" runs on a CPU (`dlm_jax.executors.auto.AutoExecutor`): the JAX executor for a
    decode whose buckets the bundle cache lacks (exported meanwhile by a background process at
    the lowest priority), the LiteRT runner for one whose buckets it holds."""
    from dlm_jax.executors.auto import AutoExecutor

    # Unrolled and separate: the bundle cache exports this same model, layer by layer, by the
    # checkpoint's names (`$DLM_JAX_LAYERS` / `$DLM_JAX_PROJECTIONS` do not apply here).
    return AutoExecutor(jax_executor(model, layers="unrolled", projections="separate"),
                        litert_executor(model, source=source), source=source)


EXECUTORS: dict[str, ExecutorFactory] = {"jax": jax_executor, "litert": litert_executor,
                                         "jax-then-litert": jax_then_litert_executor}
AUTO = "auto"
EXECUTOR_CHOICES = (AUTO, "jax", "litert")  # what `load(executor=...)` and `--executor` accept
EXECUTOR_ENV = "DLM_JAX_EXECUTOR"


def _check_executor(name: str) -> None:
    if name not in EXECUTOR_CHOICES:
        raise ConfigError(f"unknown executor {name!r}; known: {', '.join(EXECUTOR_CHOICES)}")


def auto_executor(config: ModelConfig) -> str:
    """The faster executor here. On a CPU-only JAX, for a float32 model, the LiteRT runner over
    the bundle cache (it decodes faster there: `benchmarks/results/peer.md`) once the cache
    holds a decode's buckets, and JAX until then, while a background process exports them
    (`jax-then-litert`: a first decode is never slower than JAX's for an export). The JAX
    executor on an accelerator (GPU/TPU), for another dtype, and for an MoE model (expert
    placement reads the step output `router_topk`, which bundles do not carry)."""
    import jax

    float32 = config.dtype == "float32" and config.param_dtype == "float32"
    return "jax-then-litert" if jax.default_backend() == "cpu" and float32 and config.ffn != "moe" else "jax"


def resolve_executor(name: str | None, config: ModelConfig) -> str:
    """The key of `EXECUTORS` that `load(executor=name)` uses. None takes `$DLM_JAX_EXECUTOR`,
    else "auto" (`auto_executor`)."""
    name = name or os.environ.get(EXECUTOR_ENV) or AUTO
    _check_executor(name)
    return auto_executor(config) if name == AUTO else name


def load(path: str | os.PathLike, *, strict: bool = False, verify: bool | str = True, executor: str | None = None,
         lora: str | os.PathLike | None = None, expert_slots: int | None = None, quant: str | None = None,
         mesh=None, **overrides: Any) -> Model:
    """Load a checkpoint directory (model + tokenizer) ready to generate.

    Args:
      path: a checkpoint directory, or a Hugging Face model id `org/name` (`org/name@revision`)
        already in the local Hugging Face cache (`hf download org/name` puts it there; nothing
        is downloaded here). An existing directory always wins; a `Path` is always a path.
        The cached snapshot directory is what loads (and what the bundle cache names).
      strict: refuse config.json keys this loader does not know (default: warn once).
      verify: check the files against the checkpoint's manifest if it has one: weights by size
        and sha256 (big files by size and sampled chunks), "full" hashes every byte; a
        hand-edited config or tokenizer file warns once instead of refusing the checkpoint
        (`dlm_jax.checkpoint._io.verify_checkpoint`). False skips the check.
      executor: a name of `EXECUTOR_CHOICES`: "auto" (default, or `$DLM_JAX_EXECUTOR`;
        `resolve_executor`), "jax" or "litert". "litert" decodes with the LiteRT runner over
        a bundle cache (`dlm_jax.executors.bundle_cache.BundleCacheExecutor`): the first decode that
        needs a bucket exports it, once per model and machine. "auto" on a CPU decodes with
        JAX until the bundle cache holds a decode's buckets, which a background process
        exports meanwhile (`dlm_jax.executors.auto`), then with the LiteRT runner. `model.model`
        is the Flax model either way.
      lora: a directory of LoRA adapters made for this checkpoint (`adapter_config.json` +
        `adapter_model.safetensors`, PEFT's layout; R-ISD), or a cached Hugging Face model id
        of one: attached to the model, gated per
        row by the step's `lora_gate` (1 on [MASK] rows). Adapters made for another base are
        refused naming the file. They decode on the JAX executor.
      expert_slots: split execution of an MoE model (`dlm_jax.techniques.tide.split_experts`): every MoE
        layer's compiled step holds this many routed experts in slots and computes the others'
        assignments on a NumPy CPU path; an expert placement (`--experts`, previous-step hits,
        budget = slots + shared experts) moves experts into the slots between steps. JAX only.
      quant: weight-only quantization at load for the JAX executor (`dlm_jax.models.quant`):
        "int8" (symmetric, per output channel) or "fp8" (float8_e4m3fn, per output channel)
        for the attention, FFN, expert and head matmuls, dequantised inside them; None
        (default) keeps the weights as stored. "auto" then picks the JAX executor; the LiteRT
        executor is refused (bundles quantize at export: `dlm-jax export --quant`), and so is
        `expert_slots`. A checkpoint saved quantized (`save_pretrained` of such a model, config
        `weight_quant`) loads quantized from its stored int8 / fp8 weights and scales; another
        `quant` than the stored one is refused.
      mesh: decode on a device mesh (docs/mesh.md): `"tp=N[,ep=M][,dp=K]"`, a
        mapping of the same, a `dlm_jax.MeshShape`, or a `dlm_jax.executors.sharding.MeshPlacement`
        over chosen devices. Tensor parallel (tp) splits attention heads, FFN neurons and the
        vocabulary, expert parallel (ep) an MoE model's routed experts, data parallel (dp) the K/V
        cache's rows and each step's batch rows; parameters stream from the files onto their
        shards. A mesh that does not divide the heads, experts or devices, or whose per-device
        share (`dlm_jax.planner`) does not fit a device's memory, is refused before any weight is
        read. The JAX executor only ("auto" picks it). With several processes
        (`jax.distributed.initialize` first) the mesh spans every process's devices and each
        process runs the same decode.
      overrides: `ModelConfig` fields to change (`mask_token_id=N` for a checkpoint that
        declares none, `attention=...`, `dtype=...`).

    A checkpoint without tokenizer files loads too: token-id prompts decode, text raises.
    """
    from dlm_jax._hub import resolve_checkpoint
    from dlm_jax.checkpoint._io import load_pretrained, stored_quant

    path = resolve_checkpoint(path)  # a cached Hugging Face model id: its snapshot directory
    if executor is not None:  # before the weights load
        _check_executor(executor)
    if quant is not None:
        from dlm_jax.models.quant import check_quant

        check_quant(quant)
    stored = stored_quant(path) if path.is_dir() else None  # (no directory: load_pretrained names it)
    if stored is not None:  # saved quantized: it loads as stored, and only as stored
        if quant not in (None, stored):
            raise ConfigError(f"quant={quant!r}: {path} is stored weight-only quantized as {stored!r}; "
                              f"load it with quant={stored!r} or None")
        quant = stored
        if executor == "litert":  # refused before any weight loads (one named by the environment: below)
            raise _stored_quant_refusal(path, stored, executor)
    if quant is not None:
        if expert_slots is not None:
            raise ConfigError(f"quant={quant!r} with expert_slots={expert_slots} (split expert execution) is not "
                              f"supported; drop one of them")
    placement = None
    if mesh is not None:  # checked against the config, the devices and their memory before any weight loads
        if executor not in (None, AUTO, "jax"):
            raise ConfigError(f"mesh {mesh}: mesh decoding runs on the JAX executor, not {executor!r}")
        from dlm_jax.checkpoint._io import stored_quant_float

        keep = stored_quant_float(path) if stored is not None else frozenset()  # (a pre-quantized one's float kernels)
        placement = mesh_placement(path, mesh, expert_slots=expert_slots, quant=quant, quant_float=keep, **overrides)
        executor = "jax"
    model = load_pretrained(path, strict=strict, verify=verify, placement=placement, **overrides)
    tokenizer = stored_tokenizer(path)
    name = resolve_executor(executor, model.config)
    if overrides and name == "jax-then-litert":
        name = "jax"  # a background export loads the checkpoint as stored, not as overridden here
    dtypes = {overrides[k] for k in ("dtype", "param_dtype") if k in overrides} - {"float32"}
    if dtypes and name == "litert":  # its bundles are exported from the files as stored, in float32
        raise ConfigError(f"dtype {', '.join(sorted(dtypes))}: the LiteRT runner (executor 'litert') decodes "
                          f"float32 bundles (or ones quantized at their export); decode in "
                          f"{', '.join(sorted(dtypes))} on the JAX executor (executor='jax' or 'auto'; --executor jax)")
    if quant is not None:
        if executor in (None, AUTO) and name == "jax-then-litert":
            name = "jax"
        elif name != "jax" and stored is not None:
            raise _stored_quant_refusal(path, stored, name)
        elif name != "jax":
            raise ConfigError(f"quant={quant!r} runs on the JAX executor, not {name!r}; a bundle quantizes at "
                              f"export (dlm-jax export --quant int8)")
    if lora is not None:
        from dlm_jax.techniques.isd.adapters import load_adapters

        lora = resolve_checkpoint(lora)  # a cached Hugging Face model id of the adapters: their snapshot

        if executor in (None, AUTO):
            name = "jax"
        elif name != "jax":
            raise ConfigError(f"LoRA adapters ({lora}) decode on the JAX executor or in a bundle exported with "
                              f"them; the {name} executor (the bundle cache) does not carry adapters yet: pass "
                              f"executor='jax' (--executor jax), or dlm-jax export --lora")
        load_adapters(lora, model, base=path, verify=verify)
    if expert_slots is not None:
        from dlm_jax.techniques.tide.split import split_experts

        if model.config.ffn != "moe":
            raise ConfigError(f"expert_slots={expert_slots}: the model has no MoE layers to split")
        if executor not in (None, AUTO, "jax"):
            raise ConfigError(f"split expert execution (expert_slots) runs on the JAX executor, not {executor!r}")
        name = "jax"
        split_experts(model, model.config.moe_layers, expert_slots)
    if quant is not None and getattr(model, "quant", None) != quant:  # (one stored quantized loads quantized)
        from dlm_jax.models.quant import quantize

        quantize(model, quant)  # after the adapters attach (they stay as stored)
    factory = EXECUTORS[name]
    if placement is not None:
        return Model(model, tokenizer, executor=jax_executor(model, source=path, mesh=placement))
    return Model(model, tokenizer, executor=factory(model, source=path))


def _stored_quant_refusal(path, stored: str, executor: str) -> ConfigError:
    return ConfigError(f"{path} is stored weight-only quantized as {stored!r}: it decodes on the JAX executor, "
                       f"not {executor!r} (executor='jax' or 'auto'; --executor jax)")


def mesh_placement(path, mesh, *, expert_slots: int | None = None, quant: str | None = None,
                   quant_float: frozenset[str] = frozenset(), batch: int = 1, context: int | None = None,
                   **overrides: Any):
    """The `MeshPlacement` a checkpoint at `path` decodes on: `mesh` parsed and checked against
    the checkpoint's config (heads, experts, expert slots), the devices JAX sees, and their
    memory (the planner's per-device share of the weights, a K/V cache of `batch` rows of
    `context` positions and a step's activations; by default one row of 256: what any decode
    needs, since a decode's cache is sized by its own prompt and generation). Reads the config
    only; refuses in one line."""
    from dlm_jax._partition import MeshShape
    from dlm_jax.checkpoint._io import load_config

    shape = MeshShape.parse(mesh) if not hasattr(mesh, "mesh") else mesh.shape
    config = load_config(path, **overrides)[0]
    import jax

    shape.check(config, devices=jax.device_count(), expert_slots=expert_slots)
    from dlm_jax.executors.sharding import MeshPlacement, device_memory
    from dlm_jax.planner import check_fits

    placement = (mesh if hasattr(mesh, "mesh") else MeshPlacement(shape)).for_model(config, quant)
    memory = device_memory(placement)
    if memory is not None:
        check_fits(config, shape, memory_bytes=memory, batch=batch,
                   context=min(context or 256, config.max_seq_len), quant=quant, quant_float=quant_float)
    return placement

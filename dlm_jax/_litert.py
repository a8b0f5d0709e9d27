"""LiteRT plumbing shared by the bundle executors (`dlm_jax.runner`, `dlm_jax.partitioned`):
compiled models on an accelerator, native log capture, zero step inputs. NumPy and
`ai_edge_litert` only, never JAX."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.step import OutputRequest, StepInputs, input_specs

ACCELERATORS = ("cpu", "gpu", "npu")


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


def compiled_model(content: bytes, *, accelerator: str = "cpu", threads: int = 2, cpu_fallback: bool = False,
                   owner: object = None):
    """LiteRT's `CompiledModel` over `content` (which the caller keeps alive) on `accelerator`
    (cpu: XNNPACK with `threads` threads). XNNPACK packs the weights of every signature it
    prepares; with a weight cache file the signatures share one packed copy (without it,
    memory grows by a copy per bucket); the file goes when `owner` (default: the model) does.

    Raises:
      ConfigError: an unknown accelerator, bad `threads`, or one this machine does not have.
    """
    if accelerator not in ACCELERATORS:
        raise ConfigError(f"unknown accelerator {accelerator!r}; known: {', '.join(ACCELERATORS)}")
    if threads < 0:
        raise ConfigError(f"threads={threads} must be >= 0 (0: LiteRT decides)")
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.options import Options

    cache_dir = tempfile.mkdtemp(prefix="dlm-jax-xnnpack-")
    cache = os.path.join(cache_dir, "weights.xnnpack_cache")
    options = Options(hardware_accelerators=_accelerator_flags(accelerator, cpu_fallback=cpu_fallback),
                      cpu_options=CpuOptions(num_threads=threads, xnnpack_weight_cache_path=cache))
    with native_stderr_captured() as log:
        try:
            model = CompiledModel.from_buffer(content, options=options)
        except RuntimeError as e:
            error = e
        else:
            error = None
    if error is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)
        fallback = "" if cpu_fallback or accelerator == "cpu" else "; --cpu-fallback runs what it cannot take on the CPU"
        raise ConfigError(f"accelerator {accelerator!r} is not available on this machine "
                          f"(LiteRT: {_reason(error, log)}){fallback}") from None
    weakref.finalize(owner if owner is not None else model, shutil.rmtree, cache_dir, ignore_errors=True)
    return model


def zero_inputs(config: ModelConfig, key: BucketKey, *, gated: bool = False) -> StepInputs:
    """A step of bucket `key` with zero inputs and every slot visible (warm-up, timing); a
    gated bundle's (LoRA adapters) with a zero `lora_gate`."""
    arrays = {name: np.zeros(shape, dtype) for name, shape, dtype in input_specs(config, key)}
    arrays["visibility"][...] = True
    if gated:
        arrays["lora_gate"] = np.zeros((key.batch, key.window), np.float32)
    return StepInputs(**arrays, want=OutputRequest(kv=True, logits=key.full_logits, router_topk=key.router_topk,
                                                   ffn_active=key.ffn_active))


def read_outputs(names, buffers, specs, skip=frozenset()) -> dict[str, np.ndarray]:
    """The output buffers of one run as arrays, `specs[name]` = (shape, dtype), those in
    `skip` left unread (a copy saved)."""
    out = {}
    for name, buffer in zip(names, buffers):
        if name not in skip:
            shape, dtype = specs[name]
            out[name] = buffer.read(int(np.prod(shape)), dtype).reshape(shape)
    return out

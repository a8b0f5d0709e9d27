"""LiteRT plumbing shared by the bundle executors (`dlm_jax.executors.runner`, `dlm_jax.executors.partitioned`):
compiled models on an accelerator, native log capture, zero step inputs. NumPy and
`ai_edge_litert` only, never JAX."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.step import OutputRequest, StepInputs, input_specs

ACCELERATORS = ("cpu", "gpu", "npu")
NATIVE_LOGS_ENV = "DLM_JAX_NATIVE_LOGS"  # "1": let LiteRT's native log lines through


def native_logs_wanted() -> bool:
    """Whether the user asked for the native libraries' log lines (`DLM_JAX_NATIVE_LOGS=1`)."""
    return os.environ.get(NATIVE_LOGS_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


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


def _hush_native_stderr() -> None:
    """At interpreter exit (registered when this module, LiteRT's way into a process, is
    imported): the native stderr (descriptor 2) goes to /dev/null, since LiteRT logs each
    accelerator it tears down (`INFO: [accelerator_registry.cc:43] DestroyAccelerator ...`)
    after the program's last line. Python's own `sys.stderr` moves to a duplicate of the
    original descriptor first, so what Python still prints while it shuts down (an exception
    ignored in a finaliser) reaches the terminal; only native writes are dropped. A traceback
    that ends the program is printed before exit handlers run. `DLM_JAX_NATIVE_LOGS=1` keeps
    every native line."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
    _flush_c_stdio()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all
        return
    try:
        stream = open(saved, "w", buffering=1, encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                      errors="backslashreplace", closefd=True)
        sys.stderr = sys.__stderr__ = stream  # the shutdown restores sys.stderr from sys.__stderr__
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:
        pass


if not native_logs_wanted():
    atexit.register(_hush_native_stderr)


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


_environment = None
_environment_lock = threading.Lock()


def environment():
    """The process's one LiteRT `Environment`, shared by every compiled model. LiteRT tears an
    environment's accelerators down (and logs each, natively) when its last model goes; a
    module-level one goes only at interpreter exit, after `_hush_native_stderr` has quieted the
    native stderr, so dropping a model mid-process prints nothing."""
    global _environment
    with _environment_lock:
        if _environment is None:
            from ai_edge_litert import compiled_model as cm
            from ai_edge_litert.environment import Environment, EnvironmentOptions

            with native_stderr_captured():  # it logs each accelerator it registers
                _environment = Environment.create(options=EnvironmentOptions(
                    runtime_path=os.path.dirname(os.path.abspath(cm.__file__))))
        return _environment


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
            model = CompiledModel.from_buffer(content, options=options, environment=environment())
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

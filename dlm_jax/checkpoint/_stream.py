"""Checkpoint tensors streamed onto the JAX device, one parameter at a time, in their stored dtype.

A parameter's checkpoint tensors are read from their files into one fresh host buffer in the
stored dtype (page aligned, so the JAX CPU client adopts it without a copy), put on the
default device, and turned into dlm-jax's layout and `param_dtype` there (`_names.from_layout`
and a cast, one program per shape): a bfloat16 checkpoint loaded as bfloat16 is never widened,
a cast happens once per tensor, and a transpose runs where it is cheaper than NumPy's (XLA's is
several times faster for bfloat16, also on a CPU). Tensors under a MiB are transformed on the
host instead: that takes less time than compiling a program for their shape.

A few threads read, transfer and transform parameters side by side (file reads and transfers
release the GIL); each waits until its parameter is ready on the device before taking the next,
so at most `workers` host buffers are alive at once: a load never holds a second copy of the
model on the host, nor on the device.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from dlm_jax.checkpoint import _names
from dlm_jax.checkpoint._safetensors import TensorInfo

MAX_WORKERS = 8
DEVICE_TRANSFORM_BYTES = 1 << 20  # smaller tensors are transposed / cast on the host (`load_param`)
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed C-contiguous array in pages of its own (an anonymous mmap, page aligned): freed,
    it goes back to the system at once, where malloc would keep it in a thread's arena. Its
    pages are mapped up front (MAP_POPULATE, on Linux): a third faster than a fault per page."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=_MAP_FLAGS), dtype=dtype).reshape(shape)


def read_host(kind: str, infos: Sequence[TensorInfo]) -> np.ndarray:
    """The checkpoint tensors of one parameter in one host array, as stored: [E, *shape] for
    the experts of an EXPERTS parameter, else its one tensor."""
    first = infos[0]
    if kind not in (_names.EXPERTS, _names.STACKED):
        return first.read(host_buffer(first.shape, first.dtype))
    if any(i.dtype != first.dtype for i in infos):  # a mixed-dtype expert set: promote as NumPy does
        return np.stack([i.read() for i in infos])
    out = host_buffer((len(infos), *first.shape), first.dtype)
    for k, info in enumerate(infos):
        info.read(out[k])
    return out


@functools.partial(jax.jit, static_argnames=("kind", "dtype"))
def _on_device(x: jax.Array, *, kind: str, dtype: np.dtype) -> jax.Array:
    x = _names.from_layout(kind, x)
    return x if x.dtype == dtype else x.astype(dtype)


def to_param(x: np.ndarray | jax.Array, *, kind: str, dtype: np.dtype) -> np.ndarray | jax.Array:
    """The checkpoint tensors `x` (as `read_host` gives them) -> the parameter in `dtype` (cast
    only where the dtypes differ): on the device for a device array, with NumPy for a host one."""
    if isinstance(x, jax.Array):
        return _on_device(x, kind=kind, dtype=np.dtype(dtype))
    return np.ascontiguousarray(_names.from_layout(kind, x), dtype=dtype)


def load_param(name: str, infos: Sequence[TensorInfo], dtype: np.dtype, place=None) -> jax.Array:
    """One parameter on the default device (or where `place(name, array)` puts it: a mesh's
    shards), ready; its host buffer is released on return.

    A tensor under `DEVICE_TRANSFORM_BYTES` is transposed / cast on the host: NumPy does that
    in less time than compiling a device program for its shape would take (tiny models have
    nothing else); larger ones on the device, where each shape compiles once for all layers.
    """
    kind = _names.layout(name)
    host = read_host(kind, infos)
    if kind == _names.PLAIN and host.dtype == dtype:
        value = jax.device_put(host)
    elif host.nbytes < DEVICE_TRANSFORM_BYTES:
        value = jax.device_put(to_param(host, kind=kind, dtype=dtype))
    else:
        value = to_param(jax.device_put(host), kind=kind, dtype=dtype)
    if place is not None:
        value = place(name, value)
    return value.block_until_ready()


def load_params(plan: Mapping[str, Sequence[TensorInfo]], dtypes: Mapping[str, np.dtype], *,
                workers: int | None = None, place=None) -> dict[str, jax.Array]:
    """{name: device array} for every parameter of `plan` (name -> its checkpoint tensors, in
    `_names.NameScheme.sources` order), each in `dtypes[name]`, read by `workers` threads
    (default: one per core, at most `MAX_WORKERS`) in file order; `place(name, array)`: where
    each goes once loaded (default: the default device)."""
    workers = workers or min(MAX_WORKERS, os.cpu_count() or 1)
    order = sorted(plan, key=lambda n: (str(plan[n][0].path), plan[n][0].begin))
    if workers <= 1:
        return {name: load_param(name, plan[name], dtypes[name], place) for name in order}
    pool = ThreadPoolExecutor(workers, thread_name_prefix="dlm-jax-load")
    try:
        futures = {name: pool.submit(load_param, name, plan[name], dtypes[name], place) for name in order}
        return {name: futures[name].result() for name in order}
    finally:  # on an error, the parameters not started yet are not read at all
        pool.shutdown(wait=True, cancel_futures=True)

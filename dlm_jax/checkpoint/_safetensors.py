"""A validating safetensors reader and writer over NumPy (bfloat16 and float8 via ml_dtypes).

The format: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
raw little-endian tensor bytes. Reading checks every offset against the file size before
touching data, so a truncated or corrupted file fails with its name and the tensor at fault
instead of a bare decoder error.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from dlm_jax._errors import CheckpointError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range."""

    __slots__ = ("path", "name", "dtype", "shape", "begin", "end")

    def __init__(self, path: Path, name: str, dtype: np.dtype, shape: tuple[int, ...],
                 begin: int, end: int):
        self.path, self.name, self.dtype, self.shape = path, name, dtype, shape
        self.begin, self.end = begin, end

    def read(self, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor in its stored dtype, read straight from the file into `out` (a C-contiguous
        array of its dtype and shape, which is returned) or a new array: one copy, no decoding."""
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif out.dtype != self.dtype or out.shape != self.shape or not out.flags.c_contiguous:
            raise ValueError(f"tensor {self.name!r} is {self.shape} {self.dtype}; cannot read it into "
                             f"a{'' if out.flags.c_contiguous else ' non-contiguous'} {out.shape} {out.dtype} array")
        view = memoryview(out.reshape(-1).view(np.uint8))
        try:
            with open(self.path, "rb", buffering=0) as f:
                f.seek(self.begin)
                done = 0
                while done < len(view):
                    n = f.readinto(view[done:])
                    if not n:
                        raise CheckpointError(f"{self.path}: tensor {self.name!r} is truncated")
                    done += n
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read tensor {self.name!r} ({e.strerror})") from None
        return out


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of one safetensors file.

    Returns ({name: TensorInfo}, metadata). Raises CheckpointError naming the file (and the
    tensor) when the file is truncated, the header is not JSON, a dtype is unknown, or an
    offset range disagrees with the shape or falls outside the file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors file (header of {n} bytes, file of {size})")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read tensor file ({e.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + n
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except KeyError as e:
            raise CheckpointError(f"{path}: tensor {name!r} has an unknown dtype or no {e}") from None
        except (TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {end - begin} bytes but shape {shape} "
                f"{entry['dtype']} needs {nbytes}")
        if start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {start + end} but the file has {size} bytes "
                f"(truncated)")
        infos[name] = TensorInfo(path, name, dtype, shape, start + begin, start + end)
    return infos, metadata


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one file."""
    infos, _ = read_header(path)
    return {name: info.read() for name, info in infos.items()}


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike, *,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` to `path` (readable by `safetensors` and `transformers`).

    The caller is responsible for atomicity (dlm-jax writes into a temporary directory that
    is renamed into place once complete).
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise CheckpointError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot store")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays:
            f.write(arr.tobytes())
        f.flush()
        os.fsync(f.fileno())

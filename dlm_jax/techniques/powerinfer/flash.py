"""PowerInfer-2's neuron-bundled flash file for a sparse gated-ReLU FFN (NumPy + stdlib only).

The FFN is out = down(relu(gate(x)) * up(x)) ("reglu") or out = down(relu(up(x))) ("relu").
Neuron i of a layer is gate row i [D], up row i [D] and down column i [D]: a sparse decode step
needs all of them together or none, so the file stores them side by side as one *bundle*, and
fetching a neuron that flash holds is one aligned positioned read.

`ffn.flash` layout (little-endian):

    [0, data_offset)   header: b"DLMFLASH", uint32 version (1), uint32 JSON length, the UTF-8
                       JSON (FlashHeader's fields), zero padding. data_offset is a multiple of
                       4096 (and of `alignment` when that is larger).
    layer l            from layer_offsets[l]: neurons[l] bundles of `stride` bytes each. The
                       bundle at position p holds neuron n = order[l][p] (n = p without an
                       `order`): gate row n, up row n, down column n (relu: up, down), D
                       values of `dtype` each, then zeros up to `stride` (bundle_bytes rounded
                       up to `alignment`).

Every bundle starts on an `alignment` boundary (4 KiB by default) and is a whole number of
alignment units long, so a run of consecutive bundles is one read usable with O_DIRECT. The
optional `order` lays each layer's neurons out in a planner's order (a sparse bundle: hottest
first), so neurons of similar activation probability are neighbours on flash and a read ahead
of the likeliest cold neurons is one sequential read per layer.
`sha256[l]` is the digest of layer l's whole region, padding included.

- `write_flash`: arrays -> file (through a temporary sibling and a rename).
- `FlashFile.open`, `FlashHeader`: the validated header; `read_all`: every layer back;
  `drop_page_cache`. Reading neuron subsets at run time is `flash_io`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax._integrity import atomic_file

MAGIC = b"DLMFLASH"
VERSION = 1
HEADER_BLOCK = 4096  # the header region is a whole number of these
DEFAULT_ALIGNMENT = 4096
MIN_ALIGNMENT = 512
KINDS: dict[str, tuple[str, ...]] = {"reglu": ("gate", "up", "down"), "relu": ("up", "down")}
DTYPES: dict[str, str] = {"float32": "<f4", "float16": "<f2"}
_PREAMBLE = struct.Struct("<8sII")  # magic, version, JSON length
_MAX_JSON = 64 << 20  # a header claiming more is garbage, not a large model
_CHUNK = 64 << 20  # bytes per write / hash step: a layer is never held whole while writing
_SHA_PLACEHOLDER = "0" * 64

Layer = dict[str, np.ndarray]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_alignment(alignment: Any) -> int:
    if not _is_int(alignment) or alignment < MIN_ALIGNMENT or alignment & (alignment - 1):
        raise ConfigError(f"alignment={alignment!r} must be a power of two >= {MIN_ALIGNMENT}")
    return int(alignment)


# ----------------------------------------------------------------------------------- header


@dataclasses.dataclass(frozen=True)
class FlashHeader:
    """The header's JSON: shapes, encoding and where each layer's bundles are."""

    layers: int
    d_model: int
    neurons: tuple[int, ...]  # F per layer
    kind: str  # "reglu" | "relu"
    dtype: str  # "float32" | "float16"
    bundle_bytes: int  # the bundle's values, no padding
    stride: int  # bundle_bytes rounded up to `alignment`
    alignment: int
    data_offset: int  # the header's size: layer 0 starts here
    layer_offsets: tuple[int, ...]
    sha256: tuple[str, ...]  # hex digest of each layer's region
    order: tuple[tuple[int, ...], ...] | None = None  # per layer: the neuron at each position

    def positions(self, layer: int) -> np.ndarray:
        """int64 [F]: each neuron's position in `layer` (the inverse of `order`)."""
        cache = self.__dict__.setdefault("_positions", {})
        pos = cache.get(layer)
        if pos is None:
            n = self.neurons[layer]
            if self.order is None:
                pos = np.arange(n, dtype=np.int64)
            else:
                pos = np.empty(n, np.int64)
                pos[np.asarray(self.order[layer], np.int64)] = np.arange(n)
            cache[layer] = pos
        return pos

    @property
    def parts(self) -> tuple[str, ...]:
        """The vectors of a bundle, in file order."""
        return KINDS[self.kind]

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    @property
    def nbytes(self) -> int:
        """The size the whole file must have."""
        return self.layer_offsets[-1] + self.layer_nbytes(self.layers - 1)

    def layer_nbytes(self, layer: int) -> int:
        return self.neurons[layer] * self.stride

    def check_layer(self, layer: Any) -> int:
        if not _is_int(layer) or not 0 <= layer < self.layers:
            raise ConfigError(f"layer={layer!r} is out of range [0, {self.layers})")
        return int(layer)

    def bundle_offset(self, layer: int, neuron: int) -> int:
        """The byte offset of `neuron`'s bundle in `layer` (a multiple of `alignment`)."""
        layer = self.check_layer(layer)
        if not _is_int(neuron) or not 0 <= neuron < self.neurons[layer]:
            raise ConfigError(f"neuron={neuron!r} is out of range [0, {self.neurons[layer]}) in layer {layer}")
        return self.position_offset(layer, int(self.positions(layer)[int(neuron)]))

    def position_offset(self, layer: int, position: int) -> int:
        """The byte offset of the bundle at `position` of `layer`."""
        return self.layer_offsets[layer] + int(position) * self.stride

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["order"] is None:
            del out["order"]  # files without an order read as before
        else:
            out["order"] = [list(o) for o in out["order"]]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "flash header") -> FlashHeader:
        """A header from its JSON object, checked for self-consistency.

        Raises:
          CheckpointError: "<source>: not a dlm-jax flash file (<the first problem>)".
        """
        try:
            header = cls._parse(data)
            header._check()
        except (ValueError, TypeError, KeyError) as e:
            reason = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise CheckpointError(f"{source}: not a dlm-jax flash file ({reason})") from None
        return header

    @classmethod
    def _parse(cls, data: Any) -> FlashHeader:
        if not isinstance(data, dict):
            raise TypeError("the header JSON is not an object")
        fields = {}
        for f in dataclasses.fields(cls):
            if f.name == "order":
                value = data.get("order")
                if value is not None:
                    if not isinstance(value, list) or not all(isinstance(o, list) for o in value):
                        raise ValueError("order is not a list of lists")
                    value = tuple(tuple(o) for o in value)
                fields[f.name] = value
                continue
            value = data[f.name]
            if f.name in ("neurons", "layer_offsets", "sha256"):
                if not isinstance(value, list):
                    raise ValueError(f"{f.name} is not a list")
                value = tuple(value)
            fields[f.name] = value
        return cls(**fields)

    def _check(self) -> None:
        for name in ("layers", "d_model", "bundle_bytes", "stride", "alignment", "data_offset"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is not a positive integer")
        if self.kind not in KINDS or self.dtype not in DTYPES:
            raise ValueError(f"kind={self.kind!r}, dtype={self.dtype!r} are not one of {sorted(KINDS)}, "
                             f"{sorted(DTYPES)}")
        try:
            _check_alignment(self.alignment)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        lengths = {len(self.neurons), len(self.layer_offsets), len(self.sha256)}
        if lengths != {self.layers}:
            raise ValueError(f"neurons, layer_offsets and sha256 do not all have {self.layers} entries")
        if not all(_is_int(f) and f >= 1 for f in self.neurons):
            raise ValueError(f"neurons={list(self.neurons)} are not all positive integers")
        if self.bundle_bytes != len(self.parts) * self.d_model * self.np_dtype.itemsize:
            raise ValueError(f"bundle_bytes={self.bundle_bytes} does not fit {self.kind}, d_model={self.d_model}, "
                             f"{self.dtype}")
        if self.stride != _round_up(self.bundle_bytes, self.alignment):
            raise ValueError(f"stride={self.stride} is not bundle_bytes rounded up to {self.alignment}")
        if self.data_offset % max(HEADER_BLOCK, self.alignment):
            raise ValueError(f"data_offset={self.data_offset} is not a multiple of {max(HEADER_BLOCK, self.alignment)}")
        if list(self.layer_offsets) != _layer_offsets(self.data_offset, self.neurons, self.stride):
            raise ValueError("layer_offsets do not follow from data_offset, neurons and stride")
        if not all(isinstance(s, str) and len(s) == 64 and set(s) <= set("0123456789abcdef") for s in self.sha256):
            raise ValueError("sha256 entries are not 64-digit hex digests")
        if self.order is not None:
            if len(self.order) != self.layers:
                raise ValueError(f"order has {len(self.order)} layers, not {self.layers}")
            for i, (o, f) in enumerate(zip(self.order, self.neurons)):
                if sorted(o) != list(range(f)):
                    raise ValueError(f"order of layer {i} is not a permutation of its {f} neurons")


def _layer_offsets(data_offset: int, neurons: Sequence[int], stride: int) -> list[int]:
    offsets, at = [], data_offset
    for f in neurons:
        offsets.append(at)
        at += f * stride
    return offsets


def _header_json(header: FlashHeader) -> bytes:
    return json.dumps(header.to_dict(), separators=(",", ":")).encode("utf-8")


def _plan(d_model: int, neurons: Sequence[int], kind: str, dtype: str, alignment: int,
          order: tuple[tuple[int, ...], ...] | None = None) -> FlashHeader:
    """The header of a file with these shapes (placeholder digests: they have the real ones'
    length, so the header's size is final). The data offset grows until the JSON fits."""
    bundle_bytes = len(KINDS[kind]) * d_model * np.dtype(DTYPES[dtype]).itemsize
    stride = _round_up(bundle_bytes, alignment)
    block = max(HEADER_BLOCK, alignment)
    data_offset = block
    while True:
        header = FlashHeader(layers=len(neurons), d_model=d_model, neurons=tuple(neurons), kind=kind, dtype=dtype,
                             bundle_bytes=bundle_bytes, stride=stride, alignment=alignment, data_offset=data_offset,
                             layer_offsets=tuple(_layer_offsets(data_offset, neurons, stride)),
                             sha256=(_SHA_PLACEHOLDER,) * len(neurons), order=order)
        size = _round_up(_PREAMBLE.size + len(_header_json(header)), block)
        if size <= data_offset:
            return header
        data_offset = size


def _encode_header(header: FlashHeader) -> bytes:
    """The header region: preamble, JSON, zeros up to data_offset."""
    body = _header_json(header)
    raw = _PREAMBLE.pack(MAGIC, VERSION, len(body)) + body
    if len(raw) > header.data_offset:  # _plan sized it; digests never change the length
        raise AssertionError(f"flash header of {len(raw)} bytes does not fit {header.data_offset}")
    return raw + bytes(header.data_offset - len(raw))


# ------------------------------------------------------------------------------------ write


def _check_options(kind: Any, dtype: Any, alignment: Any) -> int:
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r} must be one of {sorted(KINDS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    return _check_alignment(alignment)


def _check_array(layer: int, name: str, value: Any, ndim: int = 2) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind not in "fiu" and array.dtype.name != "bfloat16":
        raise ConfigError(f"layer {layer} {name!r} has dtype {array.dtype}; expected real numbers")
    if array.ndim != ndim:
        raise ConfigError(f"layer {layer} {name!r} has shape {array.shape}; expected {ndim} axes")
    return array


def _check_layer(index: int, layer: Any, kind: str) -> tuple[np.ndarray, ...]:
    """One layer's arrays as bundle rows [F, D] each, in file order (down transposed)."""
    parts = KINDS[kind]
    if not isinstance(layer, dict) or set(layer) != set(parts):
        keys = sorted(layer) if isinstance(layer, dict) else type(layer).__name__
        raise ConfigError(f"layer {index} has {keys}; kind={kind!r} needs exactly {sorted(parts)}")
    up = _check_array(index, "up", layer["up"])
    down = _check_array(index, "down", layer["down"])
    f, d = up.shape
    if f < 1 or d < 1 or down.shape != (d, f):
        raise ConfigError(f"layer {index} has up {up.shape}, down {down.shape}; expected up [F, D], down [D, F], "
                          f"F and D >= 1")
    if kind == "reglu":
        gate = _check_array(index, "gate", layer["gate"])
        if gate.shape != up.shape:
            raise ConfigError(f"layer {index} has gate {gate.shape}, up {up.shape}; expected both [F, D]")
        return gate, up, down.T
    return up, down.T


def _write_layer(f: Any, rows: tuple[np.ndarray, ...], header: FlashHeader) -> str:
    """Append one layer's bundles to `f`; the hex sha256 of the bytes written."""
    d, dtype = header.d_model, header.np_dtype
    n = rows[0].shape[0]
    step = max(1, _CHUNK // header.stride)
    digest = hashlib.sha256()
    for start in range(0, n, step):
        stop = min(n, start + step)
        block = np.zeros((stop - start, header.stride // dtype.itemsize), dtype)
        for k, part in enumerate(rows):
            block[:, k * d:(k + 1) * d] = part[start:stop]
        data = memoryview(block).cast("B")
        digest.update(data)
        f.write(data)
    return digest.hexdigest()


def write_flash(path: str | os.PathLike, layers: Sequence[Layer], *, kind: str = "reglu", dtype: str = "float32",
                alignment: int = DEFAULT_ALIGNMENT, order: Sequence[Sequence[int]] | None = None) -> FlashHeader:
    """Write `layers` (dicts of "gate" [F, D] (reglu only), "up" [F, D], "down" [D, F]) as a
    neuron-bundled flash file at `path`; the values are cast to `dtype`. `order`: per layer, the
    neurons in the order to lay them out (a permutation; default their index order).

    The file is written beside `path` under a temporary name, synced and renamed into place,
    so a failed write leaves no partial file. Returns the header written.

    Raises:
      ConfigError: a bad option, or a layer with missing keys or inconsistent shapes.
      CheckpointError: the file cannot be written.
    """
    alignment = _check_options(kind, dtype, alignment)
    if isinstance(layers, dict) or not isinstance(layers, Sequence) or not layers:
        raise ConfigError(f"layers must be a non-empty list of dicts, not {type(layers).__name__}")
    rows = [_check_layer(i, layer, kind) for i, layer in enumerate(layers)]
    widths = sorted({r[0].shape[1] for r in rows})
    if len(widths) > 1:
        raise ConfigError(f"layers have d_model {widths}; every layer needs the same D")
    perm = None
    if order is not None:
        if len(order) != len(rows):
            raise ConfigError(f"order has {len(order)} layers, the FFN {len(rows)}")
        perm = []
        for i, (o, r) in enumerate(zip(order, rows)):
            o = np.asarray(o)
            if o.shape != (r[0].shape[0],) or o.dtype.kind not in "iu" or \
                    not np.array_equal(np.sort(o), np.arange(r[0].shape[0])):
                raise ConfigError(f"order of layer {i} is not a permutation of its {r[0].shape[0]} neurons")
            perm.append(tuple(int(v) for v in o))
        rows = [tuple(part[np.asarray(o)] for part in r) for o, r in zip(perm, rows)]
        perm = tuple(perm)
    header = _plan(widths[0], [r[0].shape[0] for r in rows], kind, dtype, alignment, perm)
    path = Path(path)
    try:
        return _write_file(path, header, rows)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write the flash file ({e.strerror or e})") from e


def _write_file(path: Path, header: FlashHeader, rows: list[tuple[np.ndarray, ...]]) -> FlashHeader:
    with atomic_file(path) as f:
        f.write(bytes(header.data_offset))  # the header goes last, once the digests are known
        digests = tuple(_write_layer(f, layer_rows, header) for layer_rows in rows)
        header = dataclasses.replace(header, sha256=digests)
        f.seek(0)
        f.write(_encode_header(header))
    return header


# ------------------------------------------------------------------------------------- open


def _not_flash(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a dlm-jax flash file ({reason})")


def _read_header(f: Any, path: Path) -> FlashHeader:
    pre = f.read(_PREAMBLE.size)
    if len(pre) < _PREAMBLE.size:
        raise _not_flash(path, f"{len(pre)} bytes, shorter than the {_PREAMBLE.size}-byte preamble")
    magic, version, length = _PREAMBLE.unpack(pre)
    if magic != MAGIC:
        raise _not_flash(path, f"magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _not_flash(path, f"version {version}; this reader reads version {VERSION}")
    if length > _MAX_JSON:
        raise _not_flash(path, f"header JSON length {length} is implausible")
    raw = f.read(length)
    if len(raw) < length:
        raise _not_flash(path, f"header JSON truncated at {len(raw)} of {length} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError both
        raise _not_flash(path, f"header JSON: {e}") from None
    header = FlashHeader.from_dict(data, source=str(path))
    if header.data_offset < _PREAMBLE.size + length:
        raise _not_flash(path, f"data_offset={header.data_offset} is inside the header")
    return header


def _hash_region(f: Any, offset: int, size: int) -> str:
    digest = hashlib.sha256()
    f.seek(offset)
    while size > 0:
        chunk = f.read(min(size, 1 << 20))
        if not chunk:
            break
        digest.update(chunk)
        size -= len(chunk)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class FlashFile:
    """An opened (validated) flash file: its path, header and size. Holds no descriptor."""

    path: Path
    header: FlashHeader
    nbytes: int

    @classmethod
    def open(cls, path: str | os.PathLike, *, verify: bool = False) -> FlashFile:
        """Read and check the header and the file's size; with `verify`, every layer's sha256.

        Raises:
          CheckpointError: naming `path` and the problem: unreadable, not a flash file (bad
            magic, version or header JSON), truncated (both sizes), or a layer whose bytes
            differ from its digest.
        """
        path = Path(path)
        try:
            with open(path, "rb") as f:
                header = _read_header(f, path)
                size = os.fstat(f.fileno()).st_size
                if size != header.nbytes:
                    raise CheckpointError(f"{path}: truncated or modified ({size} bytes; the header says "
                                          f"{header.nbytes})")
                if verify:
                    _verify(f, header, path)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read the flash file ({e.strerror or e})") from e
        return cls(path, header, size)


def _verify(f: Any, header: FlashHeader, path: Path) -> None:
    for layer in range(header.layers):
        actual = _hash_region(f, header.layer_offsets[layer], header.layer_nbytes(layer))
        if actual != header.sha256[layer]:
            raise CheckpointError(f"{path}: layer {layer} does not match its sha256 (corrupt or modified; "
                                  f"open with verify=False to skip the check)")


def _as_flash(flash_file: FlashFile | str | os.PathLike) -> FlashFile:
    return flash_file if isinstance(flash_file, FlashFile) else FlashFile.open(flash_file)


def _split(rows: np.ndarray, header: FlashHeader, dtype: np.dtype | type) -> Layer:
    """Bundle rows [n, stride / itemsize] -> {"gate": [n, D], "up": [n, D], "down": [D, n]}
    (fresh C-contiguous arrays of `dtype`)."""
    d = header.d_model
    out = {}
    for k, name in enumerate(header.parts):
        part = rows[:, k * d:(k + 1) * d]
        out[name] = np.array(part.T if name == "down" else part, dtype=dtype, order="C")
    return out


def read_all(flash_file: FlashFile | str | os.PathLike) -> list[Layer]:
    """Every layer's arrays in the file's dtype, as `write_flash` took them (bitwise equal
    after the cast to that dtype): for tests and for models held wholly in memory."""
    flash_file = _as_flash(flash_file)
    header, path = flash_file.header, flash_file.path
    out = []
    with open(path, "rb") as f:
        for layer in range(header.layers):
            size = header.layer_nbytes(layer)
            f.seek(header.layer_offsets[layer])
            raw = f.read(size)
            if len(raw) != size:
                raise CheckpointError(f"{path}: layer {layer} is truncated ({len(raw)} of {size} bytes)")
            rows = np.frombuffer(raw, header.np_dtype).reshape(header.neurons[layer], -1)
            if header.order is not None:  # positions -> neuron order
                rows = rows[header.positions(layer)]
            out.append(_split(rows, header, header.np_dtype))
    return out


def drop_page_cache(path: str | os.PathLike) -> bool:
    """Ask the kernel to drop `path`'s cached pages (so the next read comes from the device:
    cold-read benchmarks). Best effort: False where posix_fadvise is missing or refused.
    Dirty pages stay (write_flash syncs before it renames, so a finished file has none).

    Raises:
      CheckpointError: `path` cannot be opened.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror or e})") from e
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True

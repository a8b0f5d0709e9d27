"""Merge bundles of one model into one bundle, its weights stored once.

The bundle cache (`dlm_jax.executors.bundle_cache`) exports a model's buckets as they are first needed,
one bundle per export, and each export's `.tflite` holds its own copy of every weight (a 25M
model's entry held 3.4 copies). `merge_tflite` joins `.tflite` flatbuffers through the schema's
object API (`ai_edge_litert.schema_py_generated`): the subgraphs and signatures of all models
side by side (buffer, operator code and subgraph indices remapped), constant buffers deduped
by their bytes, so one weight is one buffer however many models held it; operator codes
merged by (builtin code, custom code, version); of a signature name two models hold, the first
model's is kept, with only the subgraphs the kept signatures run. The graphs are not touched,
so a signature computes in the merged model exactly what it computed in its own (quantised
bundles merge alike: their int8 / int4 constants dedupe by bytes as float ones do). `merge_bundles` writes the
merged `.tflite` as a bundle (the union of the buckets in `bundle.json`, a manifest) through
a temporary sibling directory renamed into place.

Buffers a model keeps after its flatbuffer (`offset`/`size`, as the quantizer writes them) are
read in and packed inline. Refused (`ConfigError`): a merged model whose constants exceed what
one flatbuffer holds (2 GB), external buffers (in other files), partitioned bundles (two
`.tflite` files and CPU-side tables), and bundles of different models, quantisations, targets
or adapters.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from dlm_jax._errors import ConfigError
from dlm_jax.executors.bundle_files import BUNDLE_FILE, MODEL_FILE
from dlm_jax.executors.runner import Bundle, key_to_dict

_ALIGN = 16  # as the converter aligns constant buffers: XNNPACK and NEON loads read them in place
_MIN_RUNTIME = "min_runtime_version"
_FLATBUFFER_LIMIT = 2**31 - (64 << 20)  # flatbuffers address 2 GB; the graphs need room too
_DROPPED_FILES = ("latency", "plan")  # per-bucket measurements of one part: not the merged bundle's


def _schema():
    from ai_edge_litert import schema_py_generated as schema

    return schema


def _pack_buffer(self, builder):
    """`BufferT.Pack` with its data aligned to `_ALIGN` bytes (the generated one aligns bytes to 1)."""
    schema = _schema()
    data = None
    if self.data is not None and len(self.data):
        payload = memoryview(self.data).cast("B")
        builder.StartVector(1, len(payload), _ALIGN)
        builder.head -= len(payload)
        builder.Bytes[builder.head:builder.head + len(payload)] = payload
        data = builder.EndVector()
    schema.BufferStart(builder)
    if data is not None:
        schema.BufferAddData(builder, data)
    return schema.BufferEnd(builder)


def _version(text: bytes) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.rstrip(b"\0").decode().split("."))
    except ValueError:
        return ()


def _inline(model, content: bytes, what: str) -> None:
    """Read the buffers `model` keeps after its flatbuffer (`offset`/`size` into `content`, as
    the quantizer writes them) into the model, to be packed inline; refuse the ones kept in
    other files (external buffers)."""
    import numpy as np

    if model.externalBuffers or model.externalBufferGroups or any(
            t.externalBuffer for sg in model.subgraphs or [] for t in sg.tensors or []):
        raise ConfigError(f"{what} keeps tensors in external buffers; merging such models is not supported")
    if any(op.largeCustomOptionsSize for sg in model.subgraphs or [] for op in sg.operators or []):
        raise ConfigError(f"{what} keeps custom options outside the flatbuffer; merging such models is not supported")
    for b in model.buffers or []:
        if b.offset > 1:
            if b.offset + b.size > len(content):
                raise ConfigError(f"{what}: a buffer at bytes {b.offset}..{b.offset + b.size} lies past the "
                                  f"end of the file ({len(content)} bytes)")
            b.data = np.frombuffer(content, np.uint8, count=b.size, offset=b.offset)
        b.offset = b.size = 0


def _subgraph_refs(options) -> list[tuple[str, int | list[int]]]:
    """The (field, subgraph index or indices) an op's options hold: WHILE / IF / CALL bodies,
    StableHLO reduce, sort, scatter, composite decompositions, case branches."""
    if options is None:
        return []
    return [(name, value) for name, value in vars(options).items()
            if "subgraph" in name.lower() and isinstance(value, (int, list))]


def _reachable(model, roots: list[int]) -> list[int]:
    """The subgraphs the signatures' subgraphs `roots` run, themselves included, in order."""
    found, todo = set(roots), list(roots)
    while todo:
        for op in model.subgraphs[todo.pop()].operators or []:
            for options in (op.builtinOptions, op.builtinOptions2):
                for _, value in _subgraph_refs(options):
                    for i in value if isinstance(value, list) else [value]:
                        if i >= 0 and i not in found:
                            found.add(i)
                            todo.append(i)
    return sorted(found)


def _name(text: str | bytes | None) -> str:
    return text.decode() if isinstance(text, bytes) else text or ""


class _Merged:
    """The model being built: its buffers (each distinct constant once), operator codes,
    subgraphs, signatures and metadata."""

    def __init__(self):
        schema = _schema()
        self.model = schema.ModelT()
        self.model.version = 3
        self.model.description = "dlm-jax merged bundle"
        self.model.buffers = [schema.BufferT()]  # buffer 0: the empty sentinel
        self.model.operatorCodes, self.model.subgraphs, self.model.signatureDefs = [], [], []
        self.by_bytes: dict[bytes, int] = {}
        self.opcodes: dict[tuple, int] = {}
        self.metadata: dict[str, bytes] = {}

    def buffer(self, buf) -> int:
        """The index of `buf` here: a new empty buffer for an empty one (every tensor has its
        own, as the converter writes them), the one of the same bytes for constant data."""
        buffers = self.model.buffers
        if buf.data is None or not len(buf.data):
            buffers.append(_schema().BufferT())
            return len(buffers) - 1
        key = hashlib.sha256(memoryview(buf.data).cast("B")).digest()
        if key not in self.by_bytes:
            buffers.append(buf)
            self.by_bytes[key] = len(buffers) - 1
        return self.by_bytes[key]

    def opcode(self, code) -> int:
        key = (code.builtinCode, code.deprecatedBuiltinCode, _name(code.customCode), code.version)
        if key not in self.opcodes:
            self.opcodes[key] = len(self.model.operatorCodes)
            self.model.operatorCodes.append(code)
        return self.opcodes[key]

    def add(self, model, content: bytes, what: str) -> None:
        """Add the signatures of `model` (read from `content`) this one lacks, with the
        subgraphs they run."""
        _inline(model, content, what)
        names = [_name(sd.signatureKey) for sd in model.signatureDefs or []]
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"{what} has {'no signatures' if not names else 'a signature name twice'}")
        have = {_name(sd.signatureKey) for sd in self.model.signatureDefs}
        kept = [sd for name, sd in zip(names, model.signatureDefs) if name not in have]
        where = {old: len(self.model.subgraphs) + i
                 for i, old in enumerate(_reachable(model, [sd.subgraphIndex for sd in kept]))}
        buffers = {0: 0}
        codes = [self.opcode(code) for code in model.operatorCodes or []]
        for old in where:
            sg = model.subgraphs[old]
            for t in sg.tensors or []:
                if t.buffer not in buffers:
                    buffers[t.buffer] = self.buffer(model.buffers[t.buffer])
                t.buffer = buffers[t.buffer]
            for op in sg.operators or []:
                op.opcodeIndex = codes[op.opcodeIndex]
                op.debugMetadataIndex = -1
                for options in (op.builtinOptions, op.builtinOptions2):
                    for field, value in _subgraph_refs(options):
                        setattr(options, field, [where.get(v, v) for v in value] if isinstance(value, list)
                                else where.get(value, value))
            sg.debugMetadataIndex = -1  # debug metadata is per model: not carried over
            self.model.subgraphs.append(sg)
        for sd in kept:
            sd.subgraphIndex = where[sd.subgraphIndex]
            self.model.signatureDefs.append(sd)
        for md in model.metadata or []:
            name, data = _name(md.name), model.buffers[md.buffer].data
            value = b"" if data is None else bytes(memoryview(data).cast("B"))
            if name != "debug_metadata" and (name not in self.metadata or (
                    name == _MIN_RUNTIME and _version(value) > _version(self.metadata[name]))):
                self.metadata[name] = value  # the newest runtime any model needs

    def pack(self, size_hint: int) -> bytes:
        import flatbuffers

        schema = _schema()
        self.model.metadata = []
        for name, value in self.metadata.items():
            buf = schema.BufferT()
            buf.data = bytearray(value)
            self.model.buffers.append(buf)
            md = schema.MetadataT()
            md.name, md.buffer = name, len(self.model.buffers) - 1
            self.model.metadata.append(md)
        for buf in self.model.buffers:
            buf.Pack = _pack_buffer.__get__(buf)
        builder = flatbuffers.Builder(size_hint)
        builder.Finish(self.model.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())


def merge_tflite(contents: Sequence[bytes]) -> bytes:
    """One `.tflite` holding every signature of `contents` (of a name given twice, the first)
    with the subgraphs they run, each distinct constant buffer stored once.

    Raises:
      ConfigError: a model with external buffers, without signatures, or naming one twice.
    """
    merged = _Merged()
    for n, content in enumerate(contents):
        merged.add(_schema().ModelT.InitFromPackedBuf(content, 0), content, f"model {n}")
    data = sum(len(b.data) for b in merged.model.buffers if b.data is not None)
    if data >= _FLATBUFFER_LIMIT:
        raise ConfigError(f"the merged model's constants ({data / 1e9:.2f} GB) exceed what one flatbuffer holds "
                          f"(2 GB); merging such models is not supported")
    return merged.pack(data + (16 << 20))


def merge_bundles(parts: Sequence[str | Path], out: str | Path) -> Bundle:
    """Write one bundle at `out` holding every bucket of the bundles `parts` (of one model,
    quantisation, target and adapters), its `.tflite` merged by `merge_tflite`; an existing
    bundle at `out` is replaced. Other files (a tokenizer) come from the first part; the latency
    table and lowering plan, which describe one part's buckets, are left out.

    Raises:
      ConfigError: no parts, a partitioned bundle, parts of different models.
      CheckpointError: a part that fails its manifest check.
    """
    from dlm_jax._integrity import MANIFEST_NAME, make_temp_dir, publish_dir

    bundles = [Bundle.open(p) for p in parts]
    if not bundles:
        raise ConfigError("no bundles to merge")
    first = bundles[0]
    for b in bundles:
        if "partition" in b.meta:
            raise ConfigError(f"{b.path} is a partitioned bundle; its programs are not merged")
        same = ("config", "quant", "target", "lora")
        if any(b.meta.get(k) != first.meta.get(k) for k in same):
            raise ConfigError(f"cannot merge {b.path} into {first.path}: their {', '.join(same)} differ")
    content = merge_tflite([b.model_path.read_bytes() for b in bundles])
    keys = sorted({k for b in bundles for k in b.keys})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        skip = {BUNDLE_FILE, first.meta.get("model", MODEL_FILE), MANIFEST_NAME,
                *(first.meta.get("files", {}).get(k) for k in _DROPPED_FILES)}
        for f in first.path.iterdir():
            if f.is_file() and f.name not in skip and not f.name.startswith("."):
                shutil.copy2(f, tmp / f.name)
        (tmp / MODEL_FILE).write_bytes(content)
        meta = {**first.meta, "model": MODEL_FILE, "buckets": [key_to_dict(k) for k in keys],
                "bytes": {**first.meta.get("bytes", {}), "model": len(content)},
                "files": {k: v for k, v in first.meta.get("files", {}).items() if k not in _DROPPED_FILES},
                "merged_from": sum(b.meta.get("merged_from", 1) for b in bundles)}
        meta["bytes"].pop("float_model", None)  # the converter's size of one part
        (tmp / BUNDLE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Bundle.open(out, verify=False)

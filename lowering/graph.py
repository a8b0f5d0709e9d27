"""The lowered decode step as data: ops in execution order over typed tensors.

Partitioning (`dlm_jax.lowering.partition`) and the memory planner (`dlm_jax.techniques.lladacpp.somr`) read only this
structure, so both work the same on a graph read from an exported `.tflite` signature
(`read_tflite_graph`) and on one built analytically from a `ModelConfig`
(`dlm_jax.lowering._analytic.analytic_graph`, for models too large to convert here, e.g. LLaDA-8B).

Tensor kinds: `weight` (a constant buffer), `kv` (the `k_cache`/`v_cache` inputs and the
`k_new`/`v_new` outputs), `input`, `output` (the rest of the step contract) and `activation`.
Positions (`lifetimes`) count ops in this graph's order; `Op.index` keeps the op's index in
the graph it was read from, so a `subgraph` still names ops by their original index.
NumPy only; the flatbuffer schema module is imported when a `.tflite` is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from typing import Any

KINDS = ("weight", "kv", "input", "output", "activation")
KV_NAMES = frozenset({"k_cache", "v_cache", "k_new", "v_new"})
MATMUL_OPS = frozenset({"FULLY_CONNECTED", "BATCH_MATMUL"})
TILE = 32  # NPU matmul row tile (HMX 32x32 tiles, llada.cpp §2.2)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor: `buffer` is the flatbuffer buffer index of a constant (tensors sharing a
    buffer are one allocation), -1 when the tensor owns its storage."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    buffer: int = -1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"tensor {self.name!r}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Op:
    index: int
    opcode: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


class JsonText:
    """JSON text of a plan dataclass that has `to_dict` / `from_dict` (reloads equal)."""

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))


@dataclasses.dataclass(frozen=True)
class StepGraph(JsonText):
    """A step program: `ops` in execution order; `inputs`/`outputs` are the tensors that
    enter and leave it (the signature's, or a subgraph's boundary tensors)."""

    signature: str
    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()

    def weights(self, op: Op) -> tuple[int, ...]:
        """The op's constant inputs, each once, in input order."""
        return tuple(dict.fromkeys(i for i in op.inputs if self.tensors[i].kind == "weight"))

    def used_weights(self) -> tuple[int, ...]:
        """Every weight some op reads, in first-consumption order."""
        return tuple(dict.fromkeys(w for op in self.ops for w in self.weights(op)))

    def weight_bytes(self, tensors: Iterable[int] | None = None) -> int:
        """Bytes of the weights read by this graph's ops (or of `tensors`), each shared
        buffer counted once."""
        seen: dict[Any, int] = {}
        for w in (self.used_weights() if tensors is None else tensors):
            t = self.tensors[w]
            seen[t.buffer if t.buffer >= 0 else ("own", w)] = t.nbytes
        return sum(seen.values())

    def lifetimes(self) -> dict[int, tuple[int, int]]:
        """(first, last) op position of every non-weight tensor the ops touch: first = its
        defining op (0 for a graph input), last = its last reader (the final position for a
        graph output, the defining position when nothing reads it)."""
        live: dict[int, list[int]] = {t: [0, 0] for t in self.inputs}
        for pos, op in enumerate(self.ops):
            for t in op.inputs:
                if self.tensors[t].kind != "weight":
                    live.setdefault(t, [0, 0])[1] = pos
            for t in op.outputs:
                live.setdefault(t, [pos, pos])
        for t in self.outputs:
            live.setdefault(t, [0, 0])[1] = len(self.ops) - 1
        return {t: (a, b) for t, (a, b) in live.items()}

    def producers(self) -> dict[int, int]:
        """Tensor -> position of the op that defines it."""
        return {t: pos for pos, op in enumerate(self.ops) for t in op.outputs}

    def subgraph(self, op_indices: Iterable[int], *, signature: str | None = None) -> StepGraph:
        """The ops whose `Op.index` is in `op_indices` (order kept). Non-weight tensors read
        but not defined inside become its inputs; tensors defined inside and read outside
        (or step outputs) become its outputs."""
        keep = set(op_indices)
        inner = tuple(op for op in self.ops if op.index in keep)
        defined = {t for op in inner for t in op.outputs}
        read_inside = {t for op in inner for t in op.inputs if self.tensors[t].kind != "weight"}
        read_outside = {t for op in self.ops if op.index not in keep for t in op.inputs}
        ins = tuple(sorted(read_inside - defined))
        outs = tuple(sorted(t for t in defined if t in read_outside or t in self.outputs))
        return StepGraph(signature or self.signature, inner, self.tensors, ins, outs)

    def to_dict(self) -> dict[str, Any]:
        return {"signature": self.signature, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "tensors": [[t.index, t.name, list(t.shape), t.dtype, t.nbytes, t.kind, t.buffer]
                            for t in self.tensors],
                "ops": [[o.index, o.opcode, list(o.inputs), list(o.outputs)] for o in self.ops]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepGraph:
        tensors = tuple(Tensor(i, n, tuple(s), d, b, k, buf) for i, n, s, d, b, k, buf in data["tensors"])
        ops = tuple(Op(i, c, tuple(a), tuple(b)) for i, c, a, b in data["ops"])
        return cls(data["signature"], ops, tensors, tuple(data["inputs"]), tuple(data["outputs"]))



# --- FLOPs ------------------------------------------------------------------------------------

def ceil_to(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def matmul_dims(graph: StepGraph, op: Op) -> tuple[int, int, int, int]:
    """(batch, M, K, N) of a FULLY_CONNECTED ([.., K] x weight [N, K]) or BATCH_MATMUL
    ([.., M, K] x [.., K, N], either side possibly transposed) op."""
    out = graph.tensors[op.outputs[0]].shape
    a = graph.tensors[op.inputs[0]].shape
    b = graph.tensors[op.inputs[1]].shape
    if op.opcode == "FULLY_CONNECTED":
        n, k = b[0], b[-1]
        return 1, math.prod(out) // max(n, 1), k, n
    m, n = out[-2], out[-1]
    k = a[-1] if a[-2] == m else a[-2]
    return math.prod(out[:-2]), m, k, n


def op_flops(graph: StepGraph, op: Op, *, tile: int = 1) -> int:
    """Floating-point operations of one op. Matmuls: 2 * batch * ceil_tile(M) * K * N (pass
    `tile=32` for the NPU's 32-token tiles). Any other op: one per element of its largest
    non-weight operand (a plausibility count; these ops are bandwidth-bound)."""
    if op.opcode in MATMUL_OPS:
        batch, m, k, n = matmul_dims(graph, op)
        return 2 * batch * ceil_to(m, tile) * k * n
    sizes = [graph.tensors[t].elements for t in (*op.inputs, *op.outputs) if graph.tensors[t].kind != "weight"]
    return max(sizes, default=0)


# --- reading a .tflite -------------------------------------------------------------------------

def _schema():
    from ai_edge_litert import schema_py_generated as schema

    return schema


def signatures(content: bytes) -> list[str]:
    """Signature keys of a `.tflite` flatbuffer, in file order."""
    model = _schema().Model.GetRootAs(content, 0)
    return [model.SignatureDefs(i).SignatureKey().decode() for i in range(model.SignatureDefsLength())]


def opcode_names(model, schema) -> list[str]:
    builtin = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    names = []
    for i in range(model.OperatorCodesLength()):
        oc = model.OperatorCodes(i)
        code = max(oc.BuiltinCode(), oc.DeprecatedBuiltinCode())
        if code == schema.BuiltinOperator.CUSTOM:
            names.append("CUSTOM:" + (oc.CustomCode() or b"").decode())
        else:
            names.append(builtin.get(code, f"BUILTIN_{code}"))
    return names


def read_tflite_graph(content: bytes, signature: str) -> StepGraph:
    """The subgraph of `signature` as a StepGraph; weights are the tensors whose buffer holds
    data (inline, or by offset in a large model)."""
    schema = _schema()
    model = schema.Model.GetRootAs(content, 0)
    sig = next((model.SignatureDefs(i) for i in range(model.SignatureDefsLength())
                if model.SignatureDefs(i).SignatureKey().decode() == signature), None)
    if sig is None:
        raise KeyError(f"no signature {signature!r} in this .tflite (has {signatures(content)})")
    io_kind: dict[int, str] = {}
    for i in range(sig.InputsLength()):
        name, idx = sig.Inputs(i).Name().decode(), sig.Inputs(i).TensorIndex()
        io_kind[idx] = "kv" if name in KV_NAMES else "input"
    for i in range(sig.OutputsLength()):
        name, idx = sig.Outputs(i).Name().decode(), sig.Outputs(i).TensorIndex()
        io_kind[idx] = "kv" if name in KV_NAMES else "output"
    sg = model.Subgraphs(sig.SubgraphIndex())
    type_names = {v: k.lower() for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    tensors = tuple(_read_tensor(model, sg.Tensors(i), i, type_names, io_kind) for i in range(sg.TensorsLength()))
    opcodes = opcode_names(model, schema)
    ops = []
    for j in range(sg.OperatorsLength()):
        op = sg.Operators(j)
        ins = tuple(int(i) for i in (op.InputsAsNumpy() if op.InputsLength() else ()) if i >= 0)
        outs = tuple(int(i) for i in (op.OutputsAsNumpy() if op.OutputsLength() else ()) if i >= 0)
        ops.append(Op(j, opcodes[op.OpcodeIndex()], ins, outs))
    ins = tuple(int(i) for i in sg.InputsAsNumpy())
    outs = tuple(int(i) for i in sg.OutputsAsNumpy())
    return StepGraph(signature, tuple(ops), tensors, ins, outs)


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "int16": 2, "int8": 1,
             "uint8": 1, "bool": 1, "float64": 8, "uint32": 4, "uint16": 2, "uint64": 8}


def _read_tensor(model, t, index: int, type_names: dict[int, str], io_kind: dict[int, str]) -> Tensor:
    shape = tuple(int(d) for d in t.ShapeAsNumpy()) if t.ShapeLength() else ()
    dtype = type_names.get(t.Type(), f"type{t.Type()}")
    buf = model.Buffers(t.Buffer()) if t.Buffer() > 0 else None
    stored = 0 if buf is None else (buf.DataLength() or (buf.Size() if buf.Offset() > 1 else 0))
    if stored:
        return Tensor(index, t.Name().decode(), shape, dtype, int(stored), "weight", int(t.Buffer()))
    nbytes = math.ceil(math.prod(shape) * _ITEMSIZE.get(dtype, 4))
    return Tensor(index, t.Name().decode(), shape, dtype, nbytes, io_kind.get(index, "activation"))

"""JAX functions -> one multi-signature `.tflite` through litert-converter.

Each signature is a JAX function of arrays only (model weights closed over, so they become
constants and the flatbuffer is self-contained) plus example `jax.ShapeDtypeStruct`s. It is
lowered with `jax.jit(fn).lower(*specs)`, its StableHLO (as bytecode) parsed into a litert-converter
MLIR context, converted to TFL ops (`run_convert_to_tfl_passes`), its `main` renamed to the
signature name (public symbols must not collide when merging) and tagged with `set_signature`;
the modules are merged (`merge_modules`) and exported as one flatbuffer.

    sigs = [decode_signature(graphdef, state, config, BucketKey(1, w, 8, 8)) for w in (8, 16)]
    content = convert_signatures(sigs)        # bytes
    write_tflite("decode.tflite", content)    # atomic

`tflite_op_names` lists the operator codes per signature straight from the flatbuffer.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

class Signature(NamedTuple):
    """One exported entry point. A plain 5-tuple in this order works as well."""

    name: str
    fn: Callable[..., Any]  # arrays in, a tuple of arrays out
    specs: Sequence[Any]  # jax.ShapeDtypeStruct per input
    input_names: Sequence[str]
    output_names: Sequence[str]


def decode_signature_name(key) -> str:
    """Stable signature name of a bucket (`dlm_jax.runtime.step.signature_name`)."""
    from dlm_jax.runtime.step import signature_name

    return signature_name(key)


def decode_signature(graphdef, state, config, key, *, gated: bool = False) -> Signature:
    """The decode program (`dlm_jax.executors.jax_executor.decode_step`) of one bucket as a `Signature`,
    weights closed over; inputs and outputs named, shaped and ordered by the step contract
    (`dlm_jax.runtime.step`), so `logits` [B, R, V] is added when `key.full_logits`. A
    cache-less bucket (P == 0) takes no cache inputs (`signature_inputs`); a model with LoRA
    adapters (`gated`) takes `lora_gate` last."""
    import jax
    import jax.numpy as jnp

    from dlm_jax.executors.jax_executor import decode_step
    from dlm_jax.runtime.step import input_specs, output_names, signature_inputs, signature_name

    step = functools.partial(decode_step, graphdef, state, full_logits=key.full_logits, router_topk=key.router_topk,
                             ffn_active=key.ffn_active,
                             mask_id=config.mask_token_id)
    outputs = output_names(key)
    taken = signature_inputs(config, key, gated=gated)
    names = [name for name, _, _ in taken]
    empty = {name: jnp.zeros(shape, dtype) for name, shape, dtype in input_specs(config, key) if name not in names}

    def fn(*inputs):
        named = step(**{**empty, **dict(zip(names, inputs))})
        return tuple(named[name] for name in outputs)

    specs = tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for _, shape, dtype in taken)
    return Signature(signature_name(key), fn, specs, names, outputs)


def lower_to_stablehlo(fn: Callable[..., Any], specs: Sequence[Any]) -> bytes:
    """`jax.jit(fn, keep_unused=True).lower(*specs)` as MLIR bytecode: its `main` takes exactly
    `specs`, used or not (P == 0 ignores the caches; the default `keep_unused=False` would drop
    them from the signature). Closed-over arrays lower to constants. Bytecode, not text: the
    text of a 30M-parameter model's constants is 235 MB and takes 20x longer to parse."""
    import io

    import jax

    module = jax.jit(fn, keep_unused=True).lower(*specs).compiler_ir("stablehlo")
    buffer = io.BytesIO()
    module.operation.write_bytecode(buffer)
    return buffer.getvalue()


def _new_context():
    from litert_converter import converter_api_ext
    from litert_converter.mlir import ir

    ctx = ir.Context()
    converter_api_ext.prepare_mlir_context(ctx)
    return ctx


def _main_func(module):
    from litert_converter.mlir import ir

    for op in module.body.operations:
        if (op.operation.name == "func.func"
                and ir.StringAttr(op.attributes["sym_name"]).value == "main"):
            return op
    raise ValueError("lowered module has no func.func @main")


def _check_arity(func, sig: Signature) -> None:
    from litert_converter.mlir import ir

    ftype = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    if len(ftype.inputs) != len(sig.specs) or len(sig.input_names) != len(sig.specs):
        raise ValueError(f"signature {sig.name!r}: main takes {len(ftype.inputs)} arguments, "
                         f"{len(sig.specs)} specs, {len(sig.input_names)} input names "
                         "(closed-over arrays must lower to constants)")
    if len(ftype.results) != len(sig.output_names):
        raise ValueError(f"signature {sig.name!r}: main returns {len(ftype.results)} values, "
                         f"{len(sig.output_names)} output names given")


def convert_signatures(signatures: Iterable[Signature | tuple], *, config=None,
                       progress: Callable[[str], None] | None = None) -> bytes:
    """Lower, convert and merge `signatures` into one `.tflite` flatbuffer (bytes).
    `config` is a `converter_api_ext.ConvertToTFLConfig` (default settings if None);
    `progress(name)` is called as each signature has been lowered and converted."""
    from litert_converter import converter_api_ext
    from litert_converter.mlir import ir, passmanager

    from dlm_jax.models._transformer import litert_lowering

    sigs = [Signature(*s) for s in signatures]
    if not sigs:
        raise ValueError("no signatures to convert")
    names = [s.name for s in sigs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate signature names: {names}")
    if config is None:
        config = converter_api_ext.ConvertToTFLConfig()

    ctx = _new_context()
    with ctx, ir.Location.unknown():
        modules = []
        for sig in sigs:
            with litert_lowering():
                module = ir.Module.parse(lower_to_stablehlo(sig.fn, sig.specs))
            func = _main_func(module)
            _check_arity(func, sig)
            converter_api_ext.run_convert_to_tfl_passes(module, passmanager.PassManager(), config)
            func = _main_func(module)
            func.attributes["sym_name"] = ir.StringAttr.get(sig.name)
            converter_api_ext.set_signature(func.operation, sig.name, list(sig.input_names),
                                            list(sig.output_names))
            modules.append(module)
            if progress is not None:
                progress(sig.name)
        merged = modules[0] if len(modules) == 1 else converter_api_ext.merge_modules(modules)
        return converter_api_ext.export_flatbuffer_to_bytes(merged.operation)


def write_tflite(path: str | os.PathLike[str], content: bytes) -> str:
    """Write `content` to `path` atomically (temporary file in the same folder, then
    `os.replace`) with its manifest (`<stem>.manifest.json`: size and sha256). Returns the path."""
    from dlm_jax._integrity import atomic_write, manifest_name, write_manifest

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    atomic_write(path, content)
    write_manifest(folder, [os.path.basename(path)], name=manifest_name(path))
    return path


def read_tflite(path: str | os.PathLike[str], *, verify: bool = True) -> bytes:
    """The bytes of a `.tflite` file, checked against its manifest when it has one (a flipped
    byte names the file instead of running a corrupt graph)."""
    from dlm_jax._integrity import manifest_name, verify_manifest

    folder = os.path.dirname(os.path.abspath(path))
    if verify:
        verify_manifest(folder, name=manifest_name(path), files=[os.path.basename(path)])
    with open(path, "rb") as f:
        return f.read()


def export_signatures(signatures: Iterable[Signature | tuple], path: str | os.PathLike[str], *,
                      config=None) -> str:
    """`convert_signatures` then `write_tflite`."""
    return write_tflite(path, convert_signatures(signatures, config=config))


def tflite_op_names(content: bytes) -> dict[str, set[str]]:
    """Operator names used by each signature's subgraph, read from the flatbuffer: builtin
    ops by their `BuiltinOperator` name (`FULLY_CONNECTED`, `STABLEHLO_ADD`, ...), custom ops
    as `CUSTOM:<code>` (Flex ops are `CUSTOM:Flex...`). Subgraphs no signature points at
    (control-flow bodies) are listed under `<subgraph i>`."""
    from ai_edge_litert import schema_py_generated as schema

    from dlm_jax.lowering.graph import opcode_names

    model = schema.Model.GetRootAs(content, 0)
    codes = opcode_names(model, schema)
    sig_of = {}
    for i in range(model.SignatureDefsLength()):
        sd = model.SignatureDefs(i)
        sig_of[sd.SubgraphIndex()] = sd.SignatureKey().decode()
    ops: dict[str, set[str]] = {}
    for s in range(model.SubgraphsLength()):
        sg = model.Subgraphs(s)
        names = {codes[sg.Operators(j).OpcodeIndex()] for j in range(sg.OperatorsLength())}
        ops.setdefault(sig_of.get(s, f"<subgraph {s}>"), set()).update(names)
    return ops

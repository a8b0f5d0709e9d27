"""The layers of a `Transformer` stacked along [L] and run under `jax.lax.scan`.

A compiled step over `Transformer` runs its L blocks in a Python loop, so XLA sees L copies
of a block and compiles each; under a scan it sees one, whatever L, and compiles 3.3-4.6x
faster at 32 layers on the CPU (`benchmarks/results/compile_scan.md`). The JAX executor's
`layers="scan"` uses this module.

Ownership of the weights: `stack_layers(model)` moves the blocks' parameters into one
`[L, ...]` array per parameter, one parameter at a time (its L per-layer arrays stacked, then
deleted), so at any moment at most one parameter's stack exists twice (the largest, an MLP
projection, is under a quarter of the weights at LLaDA-8B) and never the whole model: no
second copy of the weights outlives the stacking. The model keeps working: its `layers` become a
`StackedLayers`, which yields each block over its slices of the stacked arrays when iterated
(inside a jitted forward, slices of the traced weights; eagerly, one layer's copy at a time),
so `Transformer.__call__` (lm-eval's log-likelihoods, calibration) runs as before.
`ScannedTransformer` shares the model's modules (the same arrays) and replaces the layer loop
by the scan.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from dlm_jax._errors import ConfigError
from dlm_jax.models._transformer import Block, ModelOutput, Routing, Transformer


class StackedLayers(nnx.Module):
    """L blocks of one structure as one `Block` whose arrays carry a leading [L] axis.

    Indexing or iterating yields per-layer `Block`s over slices of the stacked arrays (what
    `Transformer.__call__` needs); writing into those blocks does not reach the stack."""

    stacked = True  # what code below this module checks (`quant.quantize`) without importing it

    def __init__(self, block: Block, n: int):
        self.block = block
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Block:
        if not -self.n <= i < self.n:
            raise IndexError(f"layer {i} of {self.n}")
        graphdef, state = nnx.split(self.block)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))

    def __iter__(self) -> Iterator[Block]:
        return (self[i] for i in range(self.n))


def scan_refusal(model: Transformer) -> str | None:
    """Why the blocks of `model` cannot be stacked (None: they can): blocks of different
    structures (MoE and dense layers), split experts (their slots move one layer at a time),
    LoRA adapters (a gate per layer the executor feeds by name)."""
    if isinstance(model.layers, StackedLayers):
        return None
    blocks = list(model.layers)
    if any(getattr(b.ffn, "slot_of", None) is not None for b in blocks):
        return "split experts (expert_slots) are placed one layer at a time"
    if any(getattr(owner, "lora", None) for b in blocks for _, owner in nnx.iter_graph(b)
           if isinstance(owner, nnx.Module)):
        return "LoRA adapters are attached to its layers"
    first = nnx.graphdef(blocks[0])
    for i, b in enumerate(blocks[1:], 1):
        if nnx.graphdef(b) != first:
            kinds = [type(x.ffn).__name__ for x in (blocks[0], b)]
            if kinds[0] == kinds[1] and getattr(model, "quant_float", None):  # some quantized, some float
                floats = sorted(getattr(model, "quant_float", ()))
                return (f"layers 0 and {i} differ in which weights are quantized (the checkpoint keeps "
                        f"{', '.join(floats[:3])}{', ...' if len(floats) > 3 else ''} float)")
            return f"layers 0 and {i} differ in structure ({kinds[0]} / {kinds[1]})"
    return None


def shared_arrays(model) -> frozenset[int]:
    """`id`s of the arrays that fill more than one parameter of `model` (`model_from_params`
    keeps an array that needs no cast as it is, so one array can back several): joining must
    not delete them."""
    seen, shared = set(), set()
    for leaf in jax.tree.leaves(nnx.state(model)):
        (shared if id(leaf) in seen else seen).add(id(leaf))
    return frozenset(shared)


def joined_consuming(leaves: list, join, shape: tuple[int, ...], keep: frozenset[int] = frozenset()):
    """`join(leaves)`, each leaf deleted once joined (the result now holds it: what stacking
    layers and fusing projections do, so that no weight is held twice) but those whose `id` is
    in `keep` (`shared_arrays`: still used elsewhere); abstract leaves
    (`jax.ShapeDtypeStruct`): a struct of the joined `shape`."""
    if isinstance(leaves[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, leaves[0].dtype)
    out = join(leaves)
    for x in leaves:
        if isinstance(x, jax.Array) and not x.is_deleted() and id(x) not in keep:
            x.delete()
    return out


def _stack(leaves: list, keep: frozenset[int]):
    """[n, ...] of equal leaves, deleting them once stacked (abstract leaves: their shape)."""
    return joined_consuming(leaves, jnp.stack, (len(leaves), *leaves[0].shape), keep)


def stack_layers(model: Transformer) -> StackedLayers:
    """Move the blocks of `model` into a `StackedLayers` in place (`model.layers` becomes it);
    returns it. Each parameter's per-layer arrays are deleted once stacked (see the module
    docstring); an abstract model (`nnx.eval_shape`) stacks into abstract arrays. Raises
    ConfigError naming the reason where the blocks do not stack (`scan_refusal`)."""
    if isinstance(model.layers, StackedLayers):
        return model.layers
    reason = scan_refusal(model)
    if reason is not None:
        raise ConfigError(f"layers='scan' needs every layer of one structure, and {reason}: use layers='unrolled'")
    blocks = list(model.layers)
    graphdef, first = nnx.split(blocks[0])
    treedef = jax.tree.structure(first)
    keep = shared_arrays(model)
    per_layer = [jax.tree.leaves(nnx.state(block)) for block in blocks]
    # One parameter at a time across the layers: only its [L, ...] stack exists twice.
    stacked = [_stack([layer[j] for layer in per_layer], keep) for j in range(len(per_layer[0]))]
    del per_layer
    layers = StackedLayers(nnx.merge(graphdef, jax.tree.unflatten(treedef, stacked)), len(blocks))
    model.layers = layers
    return layers


class ScannedTransformer(nnx.Module):
    """`Transformer` with the layer loop run by `jax.lax.scan` over `StackedLayers`.

    Shares the modules of the model it was built from (`stack_layers` stacks its layers in
    place first); `__call__` takes and returns what `Transformer.__call__` does."""

    def __init__(self, model: Transformer):
        stack_layers(model)
        self.config = model.config
        self.embed = model.embed
        self.layers = model.layers
        self.final_norm = model.final_norm
        self.lm_head = model.lm_head

    head = Transformer.head
    layer_inputs = Transformer.layer_inputs
    output = Transformer.output

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None, mask: jax.Array | None = None,
                 k_cache: jax.Array | None = None, v_cache: jax.Array | None = None,
                 logit_rows: jax.Array | None = None, lora_gate: jax.Array | None = None,
                 router_topk: bool = False, ffn_act: bool = False) -> ModelOutput:
        x, cos, sin, mask = self.layer_inputs(tokens, positions, mask, k_cache, v_cache)
        if lora_gate is not None and tuple(lora_gate.shape) != tuple(tokens.shape):
            raise ValueError(f"lora_gate has shape {tuple(lora_gate.shape)}, "
                             f"expected the tokens' {tuple(tokens.shape)}")
        graphdef, stacked = nnx.split(self.layers.block)

        def body(x, xs):
            params, kc, vc = xs
            x, k, v, extra = nnx.merge(graphdef, params)(x, cos, sin, mask, kc, vc, lora_gate)
            routed = isinstance(extra, Routing)
            topk = extra.experts.reshape(*tokens.shape, -1) if routed and router_topk else None
            act = extra if extra is not None and not routed and ffn_act else None
            return x, (k, v, topk, act)

        if isinstance(k_cache, (tuple, list)):  # a resident cache's layers, each an array of its own: stacked
            k_cache, v_cache = jnp.stack(k_cache), jnp.stack(v_cache)  # (a copy per step) to scan over
        x, (ks, vs, topk, acts) = jax.lax.scan(body, x, (stacked, k_cache, v_cache))
        return ModelOutput(self.output(x, logit_rows), ks, vs, topk, acts)


LAYERS = ("unrolled", "scan")
LAYERS_ENV = "DLM_JAX_LAYERS"


def choose_layers(model: Transformer, layers: str | None) -> str:
    """How the JAX executor runs the blocks of `model`: `layers`, else `$DLM_JAX_LAYERS`, else
    "unrolled". "scan" asked for by name is refused (ConfigError, with the reason) where the
    blocks do not stack (`scan_refusal`); asked for by the environment, it falls back to
    "unrolled" with a warning naming the reason, so one setting serves every model."""
    chosen = layers or os.environ.get(LAYERS_ENV) or "unrolled"
    if chosen not in LAYERS:
        source = f"layers={layers!r}" if layers else f"{LAYERS_ENV}={chosen!r}"
        raise ConfigError(f"{source}: expected one of {', '.join(LAYERS)}")
    if chosen == "scan" and (reason := scan_refusal(model)) is not None:
        if layers:
            raise ConfigError(f"layers='scan' needs every layer of one structure, and {reason}: use layers='unrolled'")
        warnings.warn(f"{LAYERS_ENV}=scan: {reason}; its layers run unrolled", stacklevel=3)
        return "unrolled"
    return chosen

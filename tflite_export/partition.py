"""The partitioned bundle's programs as `.tflite` signatures (`dlm_jax.executors.partition_contract`
names and shapes them).

The NPU body runs the model's own blocks over a tile-aligned window (rows padded to 32 by the
host; an FFN width that is not a multiple of 32 padded with zero neurons here). In a sparse
bundle each layer is its own program and computes only its hot neurons: cluster by cluster
(`cluster` neurons each, the neuron plan's order), each cluster's gate / up / down slices one
constant, so the programs of every window share them (the converter stores identical
constants once; a slice of a larger constant would be folded into a new one per program).
The CPU head is the model's final norm and LM head over the gathered rows, with the decode
step's prediction tail (`dlm_jax.executors.jax_executor.predictions`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dlm_jax.executors.partition_contract import (Programs, body_inputs, body_name, body_outputs, head_name, head_outputs,
                                        tiled)
from dlm_jax.tflite_export._convert import Signature


def pad_ffn(model):
    """`model` with its dense FFN width padded to a whole number of tiles (zero neurons add
    nothing: relu(0) * 0 and silu(0) * 0 are 0); `model` itself when it already is."""
    import dataclasses

    from dlm_jax.models._params import get_params, model_from_params

    cfg = model.config
    width = tiled(cfg.ffn_hidden)
    if width == cfg.ffn_hidden:
        return model
    params = {}
    for name, value in get_params(model).items():
        if ".ffn." in name and name.endswith(("gate_proj.kernel", "up_proj.kernel")):
            value = np.pad(value, [(0, 0), (0, width - value.shape[1])])
        elif ".ffn." in name and name.endswith("down_proj.kernel"):
            value = np.pad(value, [(0, width - value.shape[0]), (0, 0)])
        params[name] = value
    return model_from_params(dataclasses.replace(cfg, ffn_hidden=width), params)


def _specs(inputs):
    import jax
    import jax.numpy as jnp

    return tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for _, shape, dtype in inputs)


def body_signature(model, batch: int, window: int, cache: int) -> Signature:
    """Every layer of `model` over a tiled window: (hidden, k_new, v_new). (`model` may be an
    `NpuQuant.split_model` copy: its linears then run split for INT4 + INT8 outliers.)"""
    import jax.numpy as jnp

    from dlm_jax.models._transformer import rope_tables

    cfg = model.config
    inputs = body_inputs(cfg, batch, window, cache)

    def fn(hidden, positions, visibility, *kv):
        cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
        x, ks, vs = hidden, [], []
        for i, block in enumerate(model.layers):
            x, k, v, _ = block(x, cos, sin, visibility, kv[0][i] if kv else None, kv[1][i] if kv else None)
            ks.append(k)
            vs.append(v)
        return x, jnp.stack(ks), jnp.stack(vs)

    return Signature(body_name(batch, window, cache), fn, _specs(inputs), [n for n, _, _ in inputs],
                     body_outputs())


def layer_signature(model, layer: int, batch: int, window: int, cache: int,
                    clusters: Sequence[np.ndarray], *, npu=None, ffn_weights=None) -> Signature:
    """Layer `layer` of `model` over a tiled window with only the neurons of `clusters` (index
    arrays into its FFN) in its FFN: (hidden + attention + hot FFN, the FFN input, k_new, v_new).
    `npu` (`dlm_jax.techniques.powerinfer.npu_quant.NpuQuant`): `model` is its split copy, and each cluster's
    constants run split too; `ffn_weights`: the layer's (gate, up, down) [F, D] when `model`'s
    FFN is not a plain linear any more."""
    import jax
    import jax.numpy as jnp

    from dlm_jax.models._transformer import rope_tables

    cfg = model.config
    block = model.layers[layer]
    gate, up, down = ffn_weights if ffn_weights is not None else ffn_rows(block.ffn)
    parts = [(None if gate is None else np.ascontiguousarray(gate[c]), np.ascontiguousarray(up[c]),
              np.ascontiguousarray(down[c])) for c in clusters]
    inputs = body_inputs(cfg, batch, window, cache, layer)
    pre = f"layers.{layer}.ffn."
    down_act = None if npu is None or npu.stats is None else npu.stats.get(pre + "down_proj")
    shared = None
    if npu is not None:  # every cluster's gate / up reads the FFN input: the layer's split of it
        from dlm_jax.techniques.powerinfer.npu_quant import Slices

        names = [pre + "gate_proj", pre + "up_proj"] if gate is not None else [pre + "up_proj"]
        shared = npu.choose(names, [m.T for m in (gate, up) if m is not None])

    def matmul(x, kernel, name, *, act=None, slices=None, outliers=None):
        if npu is None:
            return x @ jnp.asarray(kernel)
        return npu.cluster_matmul(pre + name, x, kernel, outliers=outliers, act=act, slices=slices)

    def fn(hidden, positions, visibility, *kv):
        cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
        attn, k, v = block.attn(block.attn_norm(hidden), cos, sin, visibility,
                                kv[0] if kv else None, kv[1] if kv else None)
        h = hidden + attn
        x = block.ffn_norm(h)
        ffn_in = None if npu is None else Slices()
        for c, (g, u, d) in zip(clusters, parts):
            tag = f"hot{int(c[0])}x{len(c)}."  # a cluster is named by its first neuron and size
            up_x = matmul(x, u.T, tag + "up", slices=ffn_in, outliers=shared)
            if g is None:
                act = jax.nn.relu(up_x)
            else:
                act = jax.nn.relu(matmul(x, g.T, tag + "gate", slices=ffn_in, outliers=shared)) * up_x
            h = h + matmul(act, d, tag + "down", act=None if down_act is None else down_act[c])
        return h, x, k, v

    return Signature(body_name(batch, window, cache, layer), fn, _specs(inputs), [n for n, _, _ in inputs],
                     body_outputs(layer))


def head_signature(model, batch: int, rows: int, full_logits: bool) -> Signature:
    """Final norm, LM head and the prediction tail over gathered rows [B, R, D]."""
    import jax
    import jax.numpy as jnp

    from dlm_jax.executors.jax_executor import predictions

    cfg = model.config

    def fn(hidden_rows):
        named = predictions(model.head(model.final_norm(hidden_rows)), mask_id=cfg.mask_token_id,
                            full_logits=full_logits)
        return tuple(named[n] for n in head_outputs(full_logits))

    spec = (jax.ShapeDtypeStruct((batch, rows, cfg.d_model), jnp.dtype(cfg.dtype)),)
    return Signature(head_name(batch, rows, full_logits), fn, spec, ["rows"], head_outputs(full_logits))


def ffn_rows(ffn) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """A dense FFN's (gate, up, down) as [F, D] rows per neuron (gate None for relu): neuron
    i's gate row, up row and down column."""
    gate = None if ffn.gate_proj is None else np.asarray(ffn.gate_proj.kernel[...]).T
    return gate, np.asarray(ffn.up_proj.kernel[...]).T, np.asarray(ffn.down_proj.kernel[...])


def partition_signatures(model, programs: Programs, *, hot: dict | None = None, npu=None) -> list[Signature]:
    """The signatures of `programs`. `hot`: a sparse bundle's hot clusters, {(layer, tiled
    window): [index arrays]}; None: a dense bundle (one body per window). `npu`
    (`dlm_jax.techniques.powerinfer.npu_quant.NpuQuant`): the NPU programs' linears split for INT4 + INT8
    outliers (the head is built from the unsplit model)."""
    model = pad_ffn(model) if hot is None else model
    body = model if npu is None else npu.split_model(model, ffn=hot is None)
    sigs = []
    for b, w, p in programs.bodies:
        if hot is None:
            sigs.append(body_signature(body, b, w, p))
        else:
            sigs.extend(layer_signature(body, i, b, w, p, hot[(i, w)], npu=npu,
                                        ffn_weights=ffn_rows(model.layers[i].ffn))
                        for i in range(model.config.n_layers))
    sigs.extend(head_signature(model, b, r, f) for b, r, f in programs.heads)
    return sigs

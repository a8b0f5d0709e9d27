"""PowerInfer-2's NPU quantisation, as the partitioned bundle's NPU programs compute it
(PowerInfer-2 §2.3.1 footnote 2, §7.6): INT4 per channel with INT8 outlier input channels
(`--quant int4-outliers`).

NPUs quantise per output channel and have no group-wise INT4, so every linear of an NPU program
(attention q/k/v/o, the FFN or its hot neuron clusters) is split on its input channels K:

    y = x @ W4 + x[..., outliers] @ W8        (W4: INT4, zero on the outlier channels)

where `outliers` are the top 1% of input channels by AWQ salience (mean |x_j| over calibration
activations x ||W[:, j]||; `dlm_jax.lowering.quant.quantize_mixed` picks them; linears that read one
activation, q/k/v and gate/up, share them), W4 holds the other channels in INT4 (zeros on the
outliers: y = W4[:, inliers] x[inliers] exactly, without copying the activation) and W8 the
outliers in INT8, each with one symmetric scale per output channel (max |w| / 7 and / 127); a
single outlier channel gets a zero companion channel, since the converter turns a 1-deep
product into a float multiply. The two products are two FULLY_CONNECTED ops, each in its own name
scope; LiteRT's quantizer (`ai-edge-quantizer`) turns the first into INT4 channelwise and the
second into INT8 channelwise weights by those scopes, with the same rounding as
`dlm_jax.lowering.quant` (round half to even, narrow range), so the integers in the `.tflite` are the
plan's. XNNPACK runs them as dynamic-range kernels (activations quantised per row at run time,
qd8-f32-qc4w / qc8w). The outlier channels are taken with static slices (one concatenation
when they are not adjacent): no gather, no transpose.

The CPU programs (the head) use LiteRT's int8 channelwise recipe (`QUANT_MODES["int8"]`): the
split is the NPU's constraint, not the CPU's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from dlm_jax._errors import ConfigError

MODE = "int4-outliers"
INT4_SCOPE = "npu_int4_inliers"
INT8_SCOPE = "npu_int8_outliers"
FRACTION = 0.01  # share of input channels kept in INT8 (our choice; the paper gives no share)
CALIBRATION_PER_TASK = 8
LINEARS = (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("ffn", ("gate_proj", "up_proj", "down_proj")))
# linears that read the same activation share its outlier channels (AWQ's salience is per input)
GROUPS = (("attn", ("q_proj", "k_proj", "v_proj")), ("attn", ("o_proj",)), ("ffn", ("gate_proj", "up_proj")),
          ("ffn", ("down_proj",)))


def channel_runs(idx: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, stop)] of the consecutive runs of the sorted channel indices `idx`."""
    idx = [int(i) for i in idx]
    runs: list[tuple[int, int]] = []
    for i in idx:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def take_channels(x, idx: Sequence[int]):
    """x[..., idx] for sorted static `idx`, as static slices (one concatenation when there are
    several runs): what a tile compiler turns into strided copies, not a gather."""
    import jax.numpy as jnp
    from jax import lax

    parts = [lax.slice_in_dim(x, a, b, axis=x.ndim - 1) for a, b in channel_runs(idx)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


class Slices:
    """The channel split of one activation, made once per traced program: the linears that read
    the same input (q/k/v; gate/up and every hot cluster's gate/up) share its outlier channels,
    so their inlier and outlier slices are one pair of ops, not one per linear."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, ...], tuple[Any, Any]] = {}

    def take(self, x, idx: np.ndarray):
        key = tuple(int(i) for i in idx)
        hit = self._last.get(key)
        if hit is None or hit[0] is not x:
            hit = self._last[key] = (x, take_channels(x, idx))
        return hit[1]


def split_matmul(x, kernel: np.ndarray, outliers: np.ndarray, slices: Slices | None = None):
    """x [..., K] @ kernel [K, N] as the NPU runs it: an INT4-scope product of the whole
    activation with the kernel's outlier rows zeroed (its per-channel scales then cover the
    inliers only, and no copy of the activation is made), plus an INT8-scope product of the
    outlier channels with their rows, summed (the quantizer quantises each by its scope)."""
    import jax
    import jax.numpy as jnp

    slices = slices if slices is not None else Slices()
    kernel = np.asarray(kernel, np.float32)
    inliers = kernel.copy()
    inliers[outliers] = 0
    with jax.named_scope(INT4_SCOPE):
        y = x @ jnp.asarray(inliers)
    if len(outliers):
        with jax.named_scope(INT8_SCOPE):
            xo, wo = slices.take(x, outliers), kernel[outliers]
            if len(outliers) == 1:  # a 1-deep product converts to a float MUL: pad with a zero channel
                xo = jnp.concatenate([xo, jnp.zeros_like(xo)], axis=-1)
                wo = np.concatenate([wo, np.zeros_like(wo)])
            y = y + xo @ jnp.asarray(wo)
    return y


class SplitLinear:
    """A stand-in for a model's `nnx.Linear` in an exported program: `split_matmul` plus the
    bias. `kernel` [K, N] float32, `outliers` sorted int64 indices into K, `slices` shared
    with the linears of the same input."""

    def __init__(self, kernel: np.ndarray, bias: np.ndarray | None, outliers: np.ndarray, slices: Slices):
        self.kernel = np.asarray(kernel, np.float32)
        self.bias = None if bias is None else np.asarray(bias, np.float32)
        self.outliers = np.asarray(outliers, np.int64)
        self.slices = slices

    def __call__(self, x):
        import jax.numpy as jnp

        y = split_matmul(x, self.kernel, self.outliers, self.slices)
        return y if self.bias is None else y + jnp.asarray(self.bias)


def _linears(model):
    """(name, parent module, attribute, nnx.Linear) of every dense linear of every layer."""
    for i, block in enumerate(model.layers):
        for part, names in LINEARS:
            parent = getattr(block, part)
            for attr in names:
                linear = getattr(parent, attr, None)
                if linear is not None and hasattr(linear, "kernel"):
                    yield f"layers.{i}.{part}.{attr}", parent, attr, linear


class _Recorder:
    """Wraps a linear inside a traced forward pass: keeps sum |x| per input channel over the
    valid rows (`valid` [B, T]) for the trace to return."""

    def __init__(self, linear, valid):
        self.linear = linear
        self.valid = valid
        self.total = None

    def __call__(self, x):
        import jax.numpy as jnp

        self.total = jnp.einsum("btk,bt->k", jnp.abs(x.astype(jnp.float32)), self.valid)
        return self.linear(x)


def activation_stats(model, sequences: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """mean |x| per input channel of every linear's input (name -> [K]) over full forward
    passes of `sequences` (token ids, cut to the model's length): one compiled pass over the
    batch, right-padded, the padding masked out of attention and of the statistics. The model
    is not changed."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dlm_jax._masks import padded_mask

    from dlm_jax.models._fuse import layout_refusal

    if not sequences:
        raise ConfigError("activation statistics need at least one calibration sequence")
    if (reason := layout_refusal(model)) is not None:
        raise ConfigError(f"activation statistics name the checkpoint's linears, and {reason}: load the model again")
    cfg = model.config
    sequences = [list(s)[:cfg.max_seq_len] for s in sequences]  # statistics need no more than the model takes
    length = max(len(s) for s in sequences)
    tokens = np.zeros((len(sequences), length), np.int32)
    valid = np.zeros(tokens.shape, bool)
    for i, seq in enumerate(sequences):
        tokens[i, :len(seq)] = seq
        valid[i, :len(seq)] = True
    mask = padded_mask(cfg.attention, valid, block_size=cfg.block_size)
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    probe = nnx.clone(model)
    names = []
    weights = jnp.asarray(valid, jnp.float32)
    for name, parent, attr, linear in list(_linears(probe)):
        setattr(parent, attr, _Recorder(linear, weights))
        names.append((name, parent, attr))

    def sums(tokens, positions, mask):
        probe(tokens, positions=positions, mask=mask)
        return [getattr(parent, attr).total for _, parent, attr in names]

    totals = jax.jit(sums)(tokens, positions, mask)
    rows = max(int(valid.sum()), 1)
    return {name: np.asarray(t, np.float32) / rows for (name, _, _), t in zip(names, totals)}


def calibration_sequences(tokenizer, per_task: int = CALIBRATION_PER_TASK) -> list[list[int]]:
    """Token ids of calibration examples (the task generators' training split, never the
    held-out prompts: prompt in the tokenizer's prompt format, then the answer) for the
    activation statistics; [] without a tokenizer (weight salience only; the plan says so)."""
    if tokenizer is None:
        return []
    from dlm_jax.training.data import TASKS, make_split

    out = []
    for task in TASKS:
        for ex in make_split(TASKS[task], per_task, split="train", seed=1):
            ids = (tokenizer.apply_chat([{"role": "user", "content": ex.prompt}])
                   if getattr(tokenizer, "prompt_format", "raw") == "chat" else tokenizer.encode(ex.prompt))
            out.append(list(ids) + list(tokenizer.encode(ex.answer)))
    return out


@dataclasses.dataclass
class NpuQuant:
    """The split of an export's NPU programs: calibration statistics per linear (None: weight
    salience only), the outlier share, and what was chosen (`chosen`: name -> plan entry,
    filled as programs are built; `plan()` is `plan.json`'s record)."""

    stats: dict[str, np.ndarray] | None = None
    fraction: float = FRACTION
    chosen: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    rule: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"NpuQuant fraction={self.fraction!r} must be in [0, 1] (0: INT4 alone)")

    def choose(self, names: Sequence[str], kernels: Sequence[np.ndarray], act: np.ndarray | None = None, *,
               outliers: np.ndarray | None = None) -> np.ndarray:
        """The outlier input channels shared by `kernels` ([K, N_i] each, one input; recorded
        under `names`): the top `fraction` by salience over their stacked rows (`act`: the
        input's mean |x|, default the statistics of `names[0]`), or the given `outliers`."""
        from dlm_jax.lowering.quant import quantize_int4, quantize_int8, quantize_mixed, weight_error

        if names[0] in self.chosen:  # the same constants in another program
            return np.asarray(self.chosen[names[0]]["outlier_channels"], np.int64)
        mats = [np.asarray(k, np.float32).T for k in kernels]  # [out, in]
        if outliers is not None:
            outliers = np.asarray(outliers, np.int64)
        elif self.fraction == 0:  # INT4 per channel alone (QNN's scheme): the ablation without outliers
            self.rule = {"name": "int4 per channel, no outliers", "fraction": 0.0}
            outliers = np.zeros(0, np.int64)
        else:
            if act is None and self.stats is not None:
                act = self.stats.get(names[0])
            mixed = quantize_mixed(np.concatenate(mats), fraction=self.fraction, act_mean_abs=act)
            self.rule = {**{k: v for k, v in mixed.rule.items() if k != "n_outliers"},  # per weight below
                         "shared": "linears reading one activation (q/k/v, gate/up) share its outlier channels, "
                                   "chosen over their stacked rows"}
            outliers = mixed.outliers
        for name, w in zip(names, mats):
            inliers = np.setdiff1d(np.arange(w.shape[1]), outliers)
            w_hat = np.empty_like(w)
            w_hat[:, inliers] = quantize_int4(w[:, inliers]).dequantize()
            if outliers.size:
                w_hat[:, outliers] = quantize_int8(w[:, outliers]).dequantize()
            self.chosen[name] = {"outlier_channels": outliers.tolist(), "shape_out_in": list(w.shape),
                                 "rel_error": round(weight_error(w, w_hat).rel_fro, 6)}
        return outliers

    def split_model(self, model, *, ffn: bool = True):
        """A copy of `model` whose linears are `SplitLinear`s (the model is not changed);
        `ffn=False` leaves the FFN alone (a sparse bundle's programs hold hot clusters instead,
        split by `cluster_matmul`)."""
        from flax import nnx

        out = nnx.clone(model)
        for i, block in enumerate(out.layers):
            for part, attrs in GROUPS:
                if part == "ffn" and not ffn:
                    continue
                parent = getattr(block, part)
                linears = [(a, getattr(parent, a, None)) for a in attrs]
                linears = [(a, lin) for a, lin in linears if lin is not None and hasattr(lin, "kernel")]
                if not linears:
                    continue
                kernels = [np.asarray(lin.kernel[...], np.float32) for _, lin in linears]
                outliers = self.choose([f"layers.{i}.{part}.{a}" for a, _ in linears], kernels)
                slices = Slices()
                for (a, lin), kernel in zip(linears, kernels):
                    bias = None if getattr(lin, "bias", None) is None else np.asarray(lin.bias[...], np.float32)
                    setattr(parent, a, SplitLinear(kernel, bias, outliers, slices))
        return out

    def cluster_matmul(self, name: str, x, kernel: np.ndarray, *, outliers: np.ndarray | None = None,
                       act: np.ndarray | None = None, slices: Slices | None = None):
        """x @ kernel [K, N] for one hot neuron cluster's constant (recorded under `name`), with
        the given outlier channels (its input's, shared) or its own (`act`: its input's mean |x|)."""
        return split_matmul(x, kernel, self.choose([name], [kernel], act, outliers=outliers), slices)

    def plan(self) -> dict[str, Any]:
        return {"mode": MODE, "rule": self.rule, "calibrated": self.stats is not None,
                "int4_scope": INT4_SCOPE, "int8_scope": INT8_SCOPE, "weights": dict(sorted(self.chosen.items()))}


def quantize_npu(content: bytes) -> bytes:
    """`content` (NPU programs built with `NpuQuant`) with each scope's FULLY_CONNECTED weights
    quantised: INT4 channelwise in `INT4_SCOPE`, INT8 channelwise in `INT8_SCOPE`.

    Raises:
      ConfigError: a FULLY_CONNECTED with float weights left (a linear outside the split).
    """
    import contextlib
    import io

    from ai_edge_quantizer import qtyping, quantizer, recipe_manager

    from dlm_jax.executors._litert import native_stderr_captured

    manager = recipe_manager.RecipeManager()
    for scope, bits in ((INT4_SCOPE, 4), (INT8_SCOPE, 8)):
        manager.add_dynamic_config(regex=f".*{scope}.*", operation_name=qtyping.TFLOperationName.FULLY_CONNECTED,
                                   num_bits=bits, granularity=qtyping.QuantGranularity.CHANNELWISE)
    with native_stderr_captured(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        out = bytes(quantizer.Quantizer(content, manager.get_quantization_recipe()).quantize().quantized_model)
    counts = weight_types(out)
    if counts.get("float32"):
        raise ConfigError(f"{counts['float32']} FULLY_CONNECTED ops of the NPU programs kept float weights")
    return out


_TYPES = {0: "float32", 1: "float16", 9: "int8", 17: "int4"}


def _read(content: bytes):
    from ai_edge_quantizer.utils import tfl_flatbuffer_utils as fb

    return fb.read_model(bytearray(content))


def constant_bytes(content: bytes) -> int:
    """Bytes of the distinct constant buffers of `content` (the weights, each stored once
    however many programs share it), as against the graph around them."""
    model = _read(content)
    seen = {}
    for sg in model.subgraphs:
        for t in sg.tensors:
            if t.buffer and t.buffer not in seen:
                b = model.buffers[t.buffer]
                seen[t.buffer] = len(b.data) if b.data is not None else int(b.size or 0)
    return sum(seen.values())


def _fc_weight_tensors(content: bytes):
    """(weight type, weight tensor, its buffer) of every FULLY_CONNECTED op of `content`."""
    model = _read(content)
    for sg in model.subgraphs:
        for op in sg.operators:
            if model.operatorCodes[op.opcodeIndex].builtinCode == 9:  # FULLY_CONNECTED
                t = sg.tensors[op.inputs[1]]
                yield _TYPES.get(int(t.type), str(t.type)), t, model.buffers[t.buffer] if t.buffer else None


def weight_types(content: bytes) -> dict[str, int]:
    """How many FULLY_CONNECTED ops of `content` have weights of each type."""
    counts: dict[str, int] = {}
    for kind, _, _ in _fc_weight_tensors(content):
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def quantized_weights(content: bytes) -> dict[str, dict[str, Any]]:
    """Every FULLY_CONNECTED weight constant of `content` by tensor name: its type, shape
    [out, in], raw bytes and per-channel scales (for tests and the plan's checks)."""
    found = {}
    for kind, t, buf in _fc_weight_tensors(content):
        if buf is not None and buf.data is not None:
            name = t.name.decode() if isinstance(t.name, bytes) else str(t.name)
            found[name] = {"type": kind, "shape": list(t.shape), "buffer": buf.data,
                           "scale": None if t.quantization is None else t.quantization.scale}
    return found

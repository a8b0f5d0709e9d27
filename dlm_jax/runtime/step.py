"""The step contract: what one compiled decode step takes and returns, and the Executor
protocol that runs it (NumPy only).

This module is the one place that names, shapes, orders and types the step's tensors, in both
forms a step takes: dense (`StepInputs`: tokens, positions, a visibility mask and the gathered
K/V; the `.tflite` signatures and `HostKVCache`) and by index (`SlotStep`: the slots a step
reads and writes; what every `KVCache` receives, and what the JAX executor's device programs
take, `request_specs`). The visibility rule between the two is written once (`visibility`,
for NumPy and `jax.numpy` alike). The JAX executor lowers its programs from these specs, the
`.tflite` exporter names its signature tensors from `INPUTS` / `output_specs`, and an
on-device runner checks a bundle against them.

Axes: B batch, W window bucket, P cache bucket, R logit-row bucket, L layers, Hkv key/value
heads, Dh head width, V vocabulary, M MoE layers, K experts per token, F32 words of 32 FFN
neurons. Inputs are padded to their bucket sizes; the bucket key is read off their shapes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.buckets import (DEFAULT_BATCH_BUCKETS, KEY_FLAGS, BucketKey, BucketSet, cache_buckets,
                                     window_buckets)
from dlm_jax.runtime.hooks import HookBase
from dlm_jax._masks import attention_rule


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the step: its name, axes (symbols above; `P+W` is a sum) and dtype
    (`model` = the model's compute dtype). `output` names the `OutputRequest` flag that
    asks for an optional output; None = always produced."""

    name: str
    axes: tuple[str, ...]
    dtype: str
    output: str | None = None

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(sum(sizes[a] for a in axis.split("+")) for axis in self.axes)


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("tokens", ("B", "W"), "int32"),  # mask id where undecided, anything at padding
    TensorSpec("positions", ("B", "W"), "int32"),  # absolute positions (RoPE)
    TensorSpec("visibility", ("B", "W", "P+W"), "bool"),  # cache slots first, then window slots
    TensorSpec("k_cache", ("L", "B", "P", "Hkv", "Dh"), "model"),
    TensorSpec("v_cache", ("L", "B", "P", "Hkv", "Dh"), "model"),
    TensorSpec("logit_rows", ("B", "R"), "int32"),  # window rows whose predictions are wanted
)
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("top_token", ("B", "R"), "int32"),  # argmax token per requested row (never the mask)
    TensorSpec("top_prob", ("B", "R"), "float32"),  # its probability
    TensorSpec("second_prob", ("B", "R"), "float32"),  # runner-up probability (margin confidence)
    TensorSpec("entropy", ("B", "R"), "float32"),  # entropy of the row's distribution (nats)
    TensorSpec("k_new", ("L", "B", "W", "Hkv", "Dh"), "model", output="kv"),  # window keys, post-RoPE
    TensorSpec("v_new", ("L", "B", "W", "Hkv", "Dh"), "model", output="kv"),
    TensorSpec("logits", ("B", "R", "V"), "float32", output="logits"),  # rows' logits (sampling, ISD)
    # each MoE layer's routed experts per window row (expert placement, TIDE)
    TensorSpec("router_topk", ("M", "B", "W", "K"), "int32", output="router_topk"),
    # each layer's active FFN neurons per window row, bit-packed: bit j of word w is neuron
    # 32 w + j (`dlm_jax.techniques.powerinfer.neurons.unpack_active`; PowerInfer-2's activation traces)
    TensorSpec("ffn_active", ("L", "B", "W", "F32"), "int32", output="ffn_active"),
)
INPUT_NAMES: tuple[str, ...] = tuple(s.name for s in INPUTS)


def model_outputs(config: ModelConfig) -> frozenset[str]:
    """The optional outputs a model's step can return beyond K/V and logits: the routed
    experts of an MoE model, the neuron activity of a ReLU-family FFN."""
    from dlm_jax._config import SPARSE_FFN_KINDS

    return frozenset(({"router_topk"} if config.ffn == "moe" else set())
                     | ({"ffn_active"} if config.ffn in SPARSE_FFN_KINDS else set()))


def axis_sizes(config: ModelConfig, key: BucketKey) -> dict[str, int]:
    return {"B": key.batch, "W": key.window, "P": key.cache, "R": key.rows, "L": config.n_layers,
            "Hkv": config.n_kv_heads, "Dh": config.head_dim, "V": config.vocab_size,
            "M": len(config.moe_layers), "K": config.n_experts_per_tok, "F32": -(-config.ffn_hidden // 32)}


def _dtype(spec: TensorSpec, config: ModelConfig) -> str:
    return config.dtype if spec.dtype == "model" else spec.dtype


def input_specs(config: ModelConfig, key: BucketKey) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every input of bucket `key`, in argument order."""
    sizes = axis_sizes(config, key)
    return [(s.name, s.shape(sizes), _dtype(s, config)) for s in INPUTS]


def output_specs(config: ModelConfig, key: BucketKey) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every output a program of bucket `key` returns, in order. A
    compiled program always returns the window K/V; it returns logits, routed experts and
    neuron activity only when the key asks (`key.full_logits`, `key.router_topk`,
    `key.ffn_active`), so those flags are part of the bucket and other buckets pay nothing
    for them."""
    sizes = axis_sizes(config, key)
    return [(s.name, s.shape(sizes), _dtype(s, config)) for s in _outputs(key)]


SIGNATURE_FORMAT = "step_w<window>_p<cache>_r<rows>[_b<batch>]" + "".join(f"[{s}]" for _, s in KEY_FLAGS)
_SIGNATURE = re.compile(r"step_w([0-9]+)_p([0-9]+)_r([0-9]+)(?:_b([0-9]+))?(.*)", re.DOTALL)
_SIGNATURE_FLAGS = re.compile("".join(f"({re.escape(s)})?" for _, s in KEY_FLAGS))


def signature_name(key: BucketKey) -> str:
    """Stable name of a bucket's exported signature (`SIGNATURE_FORMAT`): `step_w8_p8_r8`
    (`_b2` appended for batch 2, then `_full` when rows' logits are returned, `_topk` when
    routed experts are, `_act` when neuron activity is: `KEY_FLAGS`)."""
    name = f"step_w{key.window}_p{key.cache}_r{key.rows}"
    if key.batch != 1:
        name += f"_b{key.batch}"
    return name + key.flag_suffix


def parse_signature_name(text: str) -> BucketKey:
    """The bucket a signature name names (`signature_name`'s inverse; surrounding blanks ignored).

    Raises:
      ConfigError: `text` is not a name in `SIGNATURE_FORMAT`, or names an empty batch,
        window or rows.
    """
    m = _SIGNATURE.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"bucket {text!r} is not a signature name like step_w32_p64_r32 ({SIGNATURE_FORMAT})")
    w, p, r, b, rest = m.groups()
    flags = _SIGNATURE_FLAGS.fullmatch(rest)
    if not flags:
        raise ConfigError(f"bucket {text!r}: unknown or misplaced suffix {rest!r} (the flags come after the "
                          f"sizes, each at most once, in this order: {SIGNATURE_FORMAT})")
    key = BucketKey(int(b or 1), int(w), int(p), int(r),
                    **{field: bool(given) for (field, _), given in zip(KEY_FLAGS, flags.groups())})
    for axis in ("batch", "window", "rows"):
        if getattr(key, axis) == 0:
            raise ConfigError(f"bucket {text!r}: {axis} 0 holds no token (batch, window and rows are >= 1)")
    return key


def signature_inputs(config: ModelConfig, key: BucketKey, *, gated: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """The inputs an exported signature takes: `input_specs` less the cache inputs of a
    cache-less bucket (P == 0 makes them zero-size tensors, which LiteRT buffers cannot hold;
    the program ignores them); with `gated` (a model with LoRA adapters), `lora_gate` [B, W]
    float32 last."""
    taken = [s for s in input_specs(config, key) if not (key.cache == 0 and s[0] in ("k_cache", "v_cache"))]
    return taken + ([LORA_GATE_SPEC(key)] if gated else [])


def LORA_GATE_SPEC(key: BucketKey) -> tuple[str, tuple[int, ...], str]:  # noqa: N802 (a spec, like INPUTS)
    """`lora_gate`'s (name, shape, dtype) in bucket `key`: 1.0 on the rows whose adapters apply."""
    return (LORA_GATE.name, LORA_GATE.shape({"B": key.batch, "W": key.window}), LORA_GATE.dtype)


def output_names(key: BucketKey) -> tuple[str, ...]:
    return tuple(s.name for s in _outputs(key))


def _outputs(key: BucketKey) -> list[TensorSpec]:
    asked = {"kv": True, None: True, "logits": key.full_logits, "router_topk": key.router_topk,
             "ffn_active": key.ffn_active}
    return [s for s in OUTPUTS if asked[s.output]]


@dataclasses.dataclass(frozen=True)
class OutputRequest:
    """Which optional outputs a step needs on the host. `kv`: the window's K/V (only on steps
    that store them, so other steps copy nothing back); `logits`: the rows' logits,
    `router_topk`: the MoE layers' routed experts, `ffn_active`: the FFN neurons each row
    activates (each selects a program that returns them)."""

    kv: bool = True
    logits: bool = False
    router_topk: bool = False
    ffn_active: bool = False
    # The rows' logits stay where the step ran (`StepOutputs.logits` is then a `DeviceLogits`)
    # for a proposer that samples, adjusts and reads log-probabilities there
    # (`Proposer.logits_on`); only an executor whose `Capabilities.logits_on` names a
    # platform is asked.
    device_logits: bool = False


class DeviceLogits:
    """What the host runtime asks of rows' logits [B, R, V] kept on the device that ran the
    step; an executor's own class derives from it (the JAX executor's:
    `dlm_jax.executors._logits.DeviceLogits`). Only small answers come back; `np.asarray`
    reads the rows back whole, for a rule with no device form.

    - `shape`; `logits[:, :k]`: the first k predicted rows; `rows(index)`: some batch rows.
    - `answer(asks)` (a class method): each `LogitsAsk`'s answer, the asks of one step's
      logits together, one device call per kind (an engine's call answers all its requests'
      proposals at once, not one sync per request).
    """

    __slots__ = ()

    @classmethod
    def answer(cls, asks: Sequence[LogitsAsk]) -> list:
        raise NotImplementedError(f"{cls.__name__} answers no asks")


@dataclasses.dataclass(frozen=True, eq=False)
class LogitsAsk:
    """A question to a step's logits kept on the device, about the rows of the view `logits`
    (a `DeviceLogits`). A decode generator (`Decoder.steps`) yields it after the step's
    outputs, for its driver to answer with `answer` (the engine gathers those of all requests
    of one call)."""

    logits: DeviceLogits


@dataclasses.dataclass(frozen=True, eq=False)
class ProposeAsk(LogitsAsk):
    """The proposer's (x0 int32, top1, top2, entropy float32, argmax int32) [B, R] for the
    view's rows, after the penalties and bias (argmax: the adjusted logits', x0 where the row
    does not sample): `draw` [B] bool rows that sample (the others take the argmax),
    `seeds` [B] uint32 their noise, `count_ids` [B, G] the committed token ids per row (-1:
    none) when a penalty is set."""

    draw: np.ndarray
    seeds: np.ndarray
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    count_ids: np.ndarray | None = None
    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class LogprobsAsk(LogitsAsk):
    """(logprob [m] float32, top ids [m, k] int32, top logprobs [m, k] float32) of `tokens` [m]
    at rows (`b` [m] of the view, `i` [m] predicted row), under softmax of their logits
    (temperature 1), with each distribution's k likeliest tokens (ties: the lower id)."""

    b: np.ndarray
    i: np.ndarray
    tokens: np.ndarray
    k: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class JudgeAsk(LogitsAsk):
    """What a rule that verifies drafts (ISD's acceptance, `techniques.isd.strided`) needs of
    the distributions at m drafts: `tokens` [m] each draft, judged by the anchor row `i` [m] of
    view row `b` [m] of `logits` (p), proposed from row `qi` [m] of view row `qb` [m] of `q`, the
    logits of the step that proposed it (a view of an earlier step's; None: no q). Each draft's
    sampler: `temperature` (0: only the untempered answers are used), `top_k`, `top_p`, per
    draft [m] (a call joins several requests' asks). `anchors` [m]: the anchor's own token;
    `use_q` [m]: the residual a rejection draws from is max(0, p - q), else p without the
    draft; `seeds` [m] uint32: that draw's noise. With the decode's penalties or bias
    (`Proposer.adjusted`): `count_ids` [m, G] the ids its generation held committed at this
    step (-1: none), which adjust p, `q_count_ids` [m, G'] those at the step that proposed the
    draft, which adjust q, `presence` and `frequency` its penalties, `bias` its (id, value)s.

    The answer, each [m]: (p(draft), q(draft) under the sampler's filter and temperature (1
    where no q); softmax at temperature 1 of p at the draft and at the anchor, of q at the
    draft (float32); the residual's draw, int32: the token a rejection emits)."""

    b: np.ndarray
    i: np.ndarray
    tokens: np.ndarray
    anchors: np.ndarray
    seeds: np.ndarray
    use_q: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    q: DeviceLogits | None = None
    qb: np.ndarray | None = None
    qi: np.ndarray | None = None
    count_ids: np.ndarray | None = None
    q_count_ids: np.ndarray | None = None
    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()


def answer(asks: Sequence[LogitsAsk]) -> list:
    """Each ask's answer, in order (`DeviceLogits.answer`, by the class of its logits)."""
    out: list = [None] * len(asks)
    by: dict[type, list[int]] = {}
    for j, ask in enumerate(asks):
        by.setdefault(type(ask.logits), []).append(j)
    for cls, js in by.items():
        for j, got in zip(js, cls.answer([asks[j] for j in js])):
            out[j] = got
    return out


def is_device_logits(x: Any) -> bool:
    """Whether `x` is logits kept on a device (`DeviceLogits`' protocol), not a host array."""
    return isinstance(x, DeviceLogits)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    tokens: np.ndarray  # [B, W] int32
    positions: np.ndarray  # [B, W] int32
    visibility: np.ndarray  # [B, W, P+W] bool
    k_cache: np.ndarray  # [L, B, P, Hkv, Dh]
    v_cache: np.ndarray  # [L, B, P, Hkv, Dh]
    logit_rows: np.ndarray  # [B, R] int32
    want: OutputRequest = OutputRequest()
    # [B, W] float32, 1.0 on [MASK] rows: the rows whose LoRA adapters apply (R-ISD), for an
    # executor over a model with adapters (`Capabilities.inputs`); None otherwise.
    lora_gate: np.ndarray | None = None

    @property
    def key(self) -> BucketKey:
        b, w = self.tokens.shape
        return BucketKey(b, w, self.k_cache.shape[2], self.logit_rows.shape[1], self.want.logits,
                         self.want.router_topk, self.want.ffn_active)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The inputs in `INPUTS` order."""
        return tuple(getattr(self, name) for name in INPUT_NAMES)


@dataclasses.dataclass(frozen=True, eq=False)
class SlotStep:
    """One step of a decode, as indices into the decode's [B, S] slot grid, padded to `key`.

    tokens, positions: [B, W] the window rows' inputs (padding rows: anything).
    q_valid: [B, W] bool, rows that are real (not bucket padding, not left padding).
    read: [B, P] int32, per batch row the slots whose stored K/V that row reads, in order
      (-1: none, padding). A [P] list shared by every row is broadcast to [B, P].
    read_len: [B] int32, how many of its `read` row's columns each batch row reads (a row's
      cache length when rows hold caches of different lengths, ISD); None: all of them.
    probes: [B, W] bool, leave-one-out rows: no other row sees their keys ([W]: broadcast).
    hide: [B, W] int32 key column (0..P+W, cache columns first, per batch row) a row may not
      see (-1: none; [W]: broadcast).
    write: [B, W] int32 the slot each window row's K/V are stored to, per batch row (-1: not
      stored).
    logit_rows: [B, R] int32 rows whose predictions are returned.
    rows: [B] int32, the cache row each batch row reads and writes (a pooled cache: batch rows
      of several requests, each at its own cache row); -1 marks a padding batch row, which
      reads nothing, writes nothing and whose outputs mean nothing. None: batch row b is
      cache row b.
    want: `logits` asks for the rows' logits; `kv` keeps the rows' K/V (`StepOutputs.kv`) for
      a later `KVCache.write` instead of storing them now.
    written_only: read slots count only in the batch rows that have stored them (the CPU
      path); otherwise wherever the row is valid.
    geometry: equal numbers mark steps of one decode whose arrays other than tokens and write
      are identical (a cache may reuse what it built from them); None: no reuse.
    """

    key: BucketKey
    tokens: np.ndarray
    positions: np.ndarray
    q_valid: np.ndarray
    read: np.ndarray
    probes: np.ndarray
    hide: np.ndarray
    write: np.ndarray
    logit_rows: np.ndarray
    want: OutputRequest = OutputRequest(kv=False)
    written_only: bool = False
    geometry: int | None = None
    read_len: np.ndarray | None = None
    lora_gate: np.ndarray | None = None  # [B, W] float32 (`StepInputs.lora_gate`), for a gated executor
    rows: np.ndarray | None = None  # [B] int32 cache row per batch row (-1: padding row); None: identity

    def __post_init__(self):
        # Shared lists ([P] reads, [W] probes and hide: every row of one decode alike) are
        # broadcast to the per-row form every cache and device program takes.
        b = self.tokens.shape[0]
        for name in ("read", "probes", "hide"):
            value = getattr(self, name)
            if value.ndim == 1:
                object.__setattr__(self, name, np.ascontiguousarray(np.broadcast_to(value, (b, len(value)))))

    def lengths(self) -> np.ndarray:
        """[B] int32 `read_len`, all of `read` where it is None."""
        if self.read_len is not None:
            return self.read_len
        return np.full(self.tokens.shape[0], self.read.shape[1], np.int32)

    def cache_rows(self) -> np.ndarray:
        """[B] int32 `rows`, `arange(B)` where it is None."""
        if self.rows is not None:
            return self.rows
        return _identity_rows(self.tokens.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-step arrays a device receives, by name."""
        return {"tokens": self.tokens, "positions": self.positions, "q_valid": self.q_valid, "read": self.read,
                "read_len": self.lengths(), "probes": self.probes, "hide": self.hide, "write": self.write,
                "logit_rows": self.logit_rows, "rows": self.cache_rows(),
                **({} if self.lora_gate is None else {"lora_gate": self.lora_gate})}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())

    def widened(self, cache: int) -> SlotStep:
        """The same step in read bucket `cache` (at least its own): each row's `read` padded with
        -1, its hidden window columns (`hide`, numbered after the read columns) moved with
        them, `read_len` kept. Attention that masks the cache's slots from the read list sees
        the same columns; attention over the gathered columns sees more padding."""
        own = self.read.shape[1]
        if cache == own:
            return self
        if cache < own:
            raise ValueError(f"a step reading {own} slots cannot be widened to {cache}")
        return dataclasses.replace(
            self, key=dataclasses.replace(self.key, cache=cache), read_len=self.lengths(),
            read=np.pad(self.read, ((0, 0), (0, cache - own)), constant_values=-1),
            hide=np.where(self.hide >= own, self.hide + (cache - own), self.hide).astype(np.int32))

    def widened_window(self, window: int) -> SlotStep:
        """The same step in window bucket `window` (at least its own): the rows past its own
        are padding, as a bucket's are: not real (`q_valid`, so no row sees their keys), storing
        nothing (`write` -1), hiding nothing. The requested logit rows and the read list stay,
        and so do the hidden columns (window columns are numbered after the read ones). A
        program of the wider window computes the same rows; its outputs along the window
        (`router_topk`, `ffn_active`) have `window` rows, this step's first."""
        own = self.tokens.shape[1]
        if window == own:
            return self
        if window < own:
            raise ValueError(f"a step of window {own} cannot be widened to {window}")

        def pad(a: np.ndarray | None, value) -> np.ndarray | None:
            return None if a is None else np.pad(a, ((0, 0), (0, window - own)), constant_values=value)

        return dataclasses.replace(
            self, key=dataclasses.replace(self.key, window=window), tokens=pad(self.tokens, 0),
            positions=pad(self.positions, 0), q_valid=pad(self.q_valid, False), probes=pad(self.probes, False),
            hide=pad(self.hide, -1), write=pad(self.write, -1), lora_gate=pad(self.lora_gate, 0))



_IDENTITY: dict[int, np.ndarray] = {}


def _identity_rows(batch: int) -> np.ndarray:
    if batch not in _IDENTITY:
        rows = np.arange(batch, dtype=np.int32)
        rows.flags.writeable = False
        _IDENTITY[batch] = rows
    return _IDENTITY[batch]


# --------------------------------------------------------------------------- by index
# The same step as indices into the decode's [B, S] slot grid: what the host sends every step
# to an executor that holds the decode's K/V itself (`KVCache.step`). A dense executor's
# `StepInputs` are built from it (`runtime.kvcache.HostKVCache`), the JAX executor builds the
# visibility on its device from the same arrays: both through `visibility` below.

REQUEST: tuple[TensorSpec, ...] = (
    TensorSpec("tokens", ("B", "W"), "int32"),
    TensorSpec("positions", ("B", "W"), "int32"),
    TensorSpec("q_valid", ("B", "W"), "bool"),  # rows that are real (not bucket or left padding)
    TensorSpec("read", ("B", "P"), "int32"),  # per batch row, slots whose stored K/V it reads (-1: none)
    TensorSpec("read_len", ("B",), "int32"),  # how many of its `read` row each batch row reads
    TensorSpec("probes", ("B", "W"), "bool"),  # leave-one-out rows: no other row sees their keys
    TensorSpec("hide", ("B", "W"), "int32"),  # a key column (cache columns first) the row may not see (-1: none)
    TensorSpec("write", ("B", "W"), "int32"),  # the slot each row's K/V go to, per batch row (-1: none)
    TensorSpec("logit_rows", ("B", "R"), "int32"),
    TensorSpec("rows", ("B",), "int32"),  # the cache row of each batch row (-1: a padding row)
)
LORA_GATE = TensorSpec("lora_gate", ("B", "W"), "float32")  # a gated model's: 1.0 where adapters apply
# What a CPU path's view of a snapshot takes (the read slots are resolved when it is taken).
VIEW_NAMES: tuple[str, ...] = ("tokens", "positions", "q_valid", "probes", "hide", "logit_rows")


def request_specs(key: BucketKey, *, gated: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every `SlotStep` array a device step of bucket `key` takes, in
    order (`lora_gate` last, for a model with adapters)."""
    sizes = {"B": key.batch, "W": key.window, "P": key.cache, "R": key.rows}
    return [(s.name, s.shape(sizes), s.dtype) for s in REQUEST + ((LORA_GATE,) if gated else ())]


def mask_rows_gate(tokens, mask_id: int):
    """`lora_gate` of window `tokens` [B, W] (NumPy or JAX): 1.0 on rows fed the mask (R-ISD's
    proposal rows, and bucket padding), 0.0 on rows fed a token (base weights only). The one
    definition of the gate, for the host runtime, the JAX programs and the log-likelihoods."""
    return (tokens == mask_id).astype("float32")


def visibility(xp, config: ModelConfig, positions, q_valid, k_pos, k_ok, probes, hide):
    """[B, W, P+W] bool: what each window row may attend to, for array module `xp` (NumPy on
    the host, `jax.numpy` in a compiled step): the one definition of a step's visibility.

    positions, q_valid: [B, W] the rows' positions and reality; k_pos, k_ok: [B, P] the read
    slots' positions and whether each row may read them. Cache columns come first, then the
    window's rows, seen by the attention rule where valid. A probe row's key is seen by that
    row only; `hide` [B, W] takes one more column from a row (-1: none); probes are [B, W]."""
    b, p, w = positions.shape[0], k_pos.shape[1], positions.shape[1]
    keys = xp.concatenate([k_pos, positions], axis=1)
    vis = attention_rule(config.attention, positions[:, :, None], keys[:, None, :], config.block_size)
    vis = vis & xp.concatenate([k_ok, q_valid], axis=1)[:, None, :]
    col = xp.arange(p + w)
    probe_col = xp.concatenate([xp.zeros((b, p), bool), probes], axis=1)  # [B, P+W]
    own = col[None, :] == (p + xp.arange(w))[:, None]  # [W, P+W]
    vis = xp.where(probe_col[:, None, :], own[None], vis)
    return vis & ~(col[None, None, :] == hide[:, :, None])


def slot_visibility(config: ModelConfig, req: SlotStep, positions: np.ndarray, valid: np.ndarray,
                    written: np.ndarray | None = None) -> np.ndarray:
    """[B, W, P+W] bool: `visibility` of `req` on the host, from the slot `positions` / `valid`
    [B, S] of the step's batch rows (and `written` [B, S] for `req.written_only`): a pooled
    cache passes its rows `req.rows`, with a padding row's `valid` all False."""
    read = req.read  # [B, P]
    ok = read >= 0
    idx = np.where(ok, read, 0)
    k_ok = (ok & np.take_along_axis(valid, idx, axis=1)
            & (np.arange(read.shape[1])[None, :] < req.lengths()[:, None]))
    if req.written_only:
        k_ok = k_ok & np.take_along_axis(written, idx, axis=1)
    return visibility(np, config, req.positions, req.q_valid, np.where(ok, np.take_along_axis(positions, idx, axis=1), 0),
                      k_ok, req.probes, req.hide)


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    top_token: np.ndarray  # [B, R] int32
    top_prob: np.ndarray  # [B, R] float32
    second_prob: np.ndarray  # [B, R] float32
    entropy: np.ndarray  # [B, R] float32
    k_new: np.ndarray | None = None  # [L, B, W, Hkv, Dh] when asked (`want.kv`)
    v_new: np.ndarray | None = None
    # [B, R, V] float32 when asked (`want.logits`); a `DeviceLogits` with `want.device_logits`
    logits: np.ndarray | None = None
    router_topk: np.ndarray | None = None  # [M, B, W, K] int32 when asked (`want.router_topk`)
    ffn_active: np.ndarray | None = None  # [L, B, W, F32] int32 bit-packed when asked (`want.ffn_active`)
    kv: Any = None  # a KV cache's snapshot step: the rows' K/V, where the step ran, for `KVCache.write`

    @classmethod
    def from_named(cls, named: Mapping[str, Any]) -> StepOutputs:
        """From `{output name: array}`; outputs not present stay None."""
        return cls(**{s.name: (None if named.get(s.name) is None else named[s.name]
                               if is_device_logits(named[s.name]) else np.asarray(named[s.name]))
                      for s in OUTPUTS if s.name in named})


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an executor can run. `keys` is a fixed set of buckets (a LiteRT bundle has one
    signature per bucket); None means any combination of the four size sets (the JAX
    executor compiles a bucket on first use). `outputs` lists the optional outputs it can
    produce (`kv`, `logits`, `router_topk`, `ffn_active`)."""

    batches: BucketSet
    windows: BucketSet
    caches: BucketSet
    rows: BucketSet
    keys: frozenset[BucketKey] | None = None
    outputs: frozenset[str] = frozenset({"kv", "logits"})
    missing_hint: str = ""  # appended to the error for a step no bucket holds (how to get one)
    inputs: frozenset[str] = frozenset()  # optional step inputs it takes: "lora_gate" (a model with adapters)
    expert_slots: int = 0  # resident experts per split MoE layer (`Executor.place`); 0: no split layers
    # The platform ("cpu", "gpu", "tpu") where it can keep a step's logits and run the
    # proposer's rules over them (`OutputRequest.device_logits`); "": on the host only.
    logits_on: str = ""

    @classmethod
    def for_length(cls, max_len: int, *, batches: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> Capabilities:
        """The default sets for sequences up to `max_len`: tile-aligned windows (rows use the
        same sizes), doubling cache buckets, batches 1-8."""
        windows = window_buckets(max_len)
        return cls(BucketSet(tuple(batches), "batch bucket"), windows, cache_buckets(max_len),
                   BucketSet(windows.sizes, "row bucket"))

    @classmethod
    def from_keys(cls, keys: Iterable[BucketKey]) -> Capabilities:
        """A fixed set of buckets; the size sets are the sizes it contains."""
        keys = frozenset(keys)
        if not keys:
            raise ConfigError("an executor with a fixed bucket set needs at least one bucket")
        outputs = ({"kv"} | ({"logits"} if any(k.full_logits for k in keys) else set())
                   | ({"router_topk"} if any(k.router_topk for k in keys) else set())
                   | ({"ffn_active"} if any(k.ffn_active for k in keys) else set()))

        def sizes(field: str, name: str) -> BucketSet:
            return BucketSet(tuple(sorted({getattr(k, field) for k in keys})), name)

        return cls(sizes("batch", "batch bucket"), sizes("window", "window bucket"),
                   sizes("cache", "cache bucket"), sizes("rows", "row bucket"), keys, frozenset(outputs))

    def refusal(self, message: str) -> ConfigError:
        """The error for a decode these buckets cannot run, with `missing_hint` (how to get
        the missing bucket) appended when there is one."""
        return ConfigError(message + (f"; {self.missing_hint}" if self.missing_hint else ""))

    @property
    def max_tokens(self) -> int:
        """The longest sequence one window or one cache can hold. For a fixed bucket set, the
        most any bucket holds (cache + window): whether a decode finds every bucket it needs
        is `select`'s to say, naming the one missing."""
        if self.keys is not None:
            return max(k.window + k.cache for k in self.keys)
        return min(self.windows.largest, self.caches.largest)

    def select(self, *, batch: int, window: int, cache: int, rows: int, logits: bool = False,
               router_topk: bool = False, ffn_active: bool = False) -> BucketKey:
        """The cheapest bucket that holds a step of these live sizes.

        Raises:
          ConfigError: no bucket holds it; the message names the bucket needed and, for a
            fixed set, the nearest one available.
        """
        if logits and "logits" not in self.outputs:
            raise ConfigError("this executor cannot return logits (needed for sampling, temperature > 0)")
        if router_topk and "router_topk" not in self.outputs:
            raise ConfigError("this executor cannot return the routed experts (router_topk; needed for "
                              "expert placement, --experts): use an MoE model on the JAX executor")
        if ffn_active and "ffn_active" not in self.outputs:
            raise ConfigError("this executor cannot return the FFN neuron activity (ffn_active; needed for neuron "
                              "placement): use a model with a ReLU-family FFN (ffn = relu or reglu)")
        if self.keys is None:
            return BucketKey(self.batches.select(batch), self.windows.select(window),
                             self.caches.select(cache), self.rows.select(rows), logits, router_topk, ffn_active)
        need = (batch, window, cache, rows)
        # A bucket that returns logits also serves a step that does not read them.
        fits = [k for k in self.keys if k.full_logits >= logits and k.router_topk >= router_topk
                and k.ffn_active >= ffn_active
                and all(h >= n for h, n in zip((k.batch, k.window, k.cache, k.rows), need))]
        if fits:
            return min(fits, key=lambda k: (k.window + k.cache, k.rows, k.batch, k.full_logits, k.router_topk,
                                            k.ffn_active, k.window))

        def shortfall(k: BucketKey) -> tuple:
            have = (k.batch, k.window, k.cache, k.rows)
            return (k.full_logits < logits, sum(max(0, n - h) for h, n in zip(have, need)),
                    sum(abs(h - n) for h, n in zip(have, need)))

        nearest = min(self.keys, key=shortfall)
        wanted = BucketKey(batch, window, cache, rows, logits)
        raise self.refusal(f"no bucket of this executor holds a step of batch={batch}, window={window}, "
                           f"cache={cache}, rows={rows}{' with logits' if logits else ''} (needs at least "
                           f"{wanted}); nearest available: {nearest} ({len(self.keys)} buckets)")


@dataclasses.dataclass(frozen=True)
class BuildCounts:
    """What an executor has built so far (cumulative): programs compiled (JAX) or signatures
    set up (LiteRT), buckets exported (the bundle cache), and the seconds each took; and the
    seconds its callers waited for compiles (less than `compile_seconds` where they ran in the
    background, `Executor.prefetch`). `DecodeStats` records the difference over a decode.
    Under a tiered compile (`JaxExecutor(compile="tiered")`): `quick_programs`, the step
    programs running their quick compile now (not cumulative), `upgrades`, the full
    compiles built behind quick ones so far, `widened_steps`, the steps run padded in a
    wider window's program while their own was built behind, and `pending_compiles`, the
    full compiles still queued or under way behind (not cumulative)."""

    compiles: int = 0
    compile_seconds: float = 0.0
    exports: int = 0
    export_seconds: float = 0.0
    compile_wait_seconds: float = 0.0
    quick_programs: int = 0
    upgrades: int = 0
    widened_steps: int = 0
    pending_compiles: int = 0

    def __add__(self, other: BuildCounts) -> BuildCounts:
        return BuildCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __sub__(self, other: BuildCounts) -> BuildCounts:
        return BuildCounts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


Progress = Callable[[str, int, int], None]  # (stage, done, total)


def _nothing() -> None:
    return None


class Executor(HookBase):
    """Runs the decode steps of a bucket and holds the decode's K/V: the boundary between the
    host runtime, which decides, and the tensors. The JAX executor (AOT per bucket, K/V on its
    device), the LiteRT runner and the bundle cache implement it;
    `dlm_jax.testing.MockExecutor` is a scripted one for tests.

    Subclasses implement `capabilities`, `step` and `warmup`. The other hooks have defaults
    here; the decoder calls each of them, in this order:

      prepare(keys)      before warm-up: build buckets in batches ahead (the bundle cache
                         exports them as one part); default nothing.
      warmup(keys, slots=, views=)  compile or load every bucket of a decode; returns how
                         many were new.
      fork()             once per decoder, for a CPU path (revision refresh): an executor over
                         the same weights with programs of its own, safe to step from a second
                         thread; default `self` (the CPU path then runs in turn).
      open(config, positions, valid)  once per decode: the `KVCache` that holds its K/V
                         (`dlm_jax.runtime.kvcache`); default a `HostKVCache`, NumPy K/V fed
                         to `step` as dense inputs.
      [the cache's step every step; `step` itself is the dense contract a `HostKVCache`
       and benchmarks call]
      build_counts()     before and after a decode (`DecodeStats.compiles` / `exports`).
      close()            release native resources now; default nothing.
    `set_progress(progress)` hands it a `(stage, done, total)` callback for long builds. An
    engine (`dlm_jax.runtime.engine`) calls `session` when a run of requests starts,
    `prefetch_engine` as it admits requests and `warmup_engine` for its warm-up."""

    HOOKS = ("capabilities", "step", "warmup", "prefetch", "prepare", "fork", "open", "close", "build_counts",
             "set_progress", "place", "session", "logits_like", "warmup_engine", "prefetch_engine")
    prepares_ahead: bool = False  # `prepare` builds in batches: give it the buckets of nearby prompt lengths too
    # The batch sizes an engine's calls may take (None: every batch bucket of `capabilities`),
    # and how it runs a group of steps that fills none (`dlm_jax.runtime.engine.PADDING`).
    engine_batches: tuple[int, ...] | None = None
    engine_padding: str = "split"
    # Replicas whose own cache rows a call's batch rows should read (the JAX executor's mesh dp):
    # an engine then places each request's row in one and lays each call out by replica.
    engine_replicas: int = 1

    @property
    def capabilities(self) -> Capabilities:
        raise NotImplementedError

    def step(self, inputs: StepInputs, *, timings: dict[str, float] | None = None) -> StepOutputs:
        """Outputs for every requested row; `k_new`/`v_new` only if `inputs.want.kv`,
        `logits` only if `inputs.want.logits`. With `timings`, the seconds of the transfer in
        ("h2d"), the compute ("compute") and the transfer out ("d2h"), each waited for."""
        raise NotImplementedError

    def warmup(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False) -> int:
        """Prepare every bucket in `keys` (compile, load); returns how many were new.
        `slots`: the decode's slot count (prompt + generation), for an executor whose cache
        programs depend on it; `views`: the buckets are a CPU path's (`KVCache.snapshot`)."""
        raise NotImplementedError

    def prefetch(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False) -> Callable[[], None]:
        """Start building `keys` in the background, in the order given (the decode's likely order
        of use), as `warmup` would (same `slots` / `views`); a step then waits only for its own
        bucket. Returns a callable that drops those not started (a decode calls it when it
        ends). Default: nothing is built ahead; steps build on first use."""
        return _nothing

    def warmup_engine(self, keys: Sequence[BucketKey], *, slots: int, rows: int, views: bool = False) -> int:
        """Prepare the programs an engine's calls run (`dlm_jax.runtime.engine.Engine.warmup`):
        the steps `keys` (their batch the call's) on a pooled cache of `rows` rows and `slots`
        slots each (`views`: a CPU path's steps on a row of it). Default: the dense `warmup`
        (an executor whose steps the engine feeds dense inputs, `HostKVCache`)."""
        return self.warmup(keys, slots=slots, views=views)

    def prefetch_engine(self, keys: Sequence[BucketKey], *, slots: int, rows: int,
                        views: bool = False) -> Callable[[], None]:
        """Start building in the background, in the order given, what `warmup_engine` builds for
        `keys` (an engine's requests just admitted: the calls their steps will likely run), as
        `prefetch` does for a decode's own steps; returns a callable that drops those not started
        (the engine calls it when its run of requests ends). Default: nothing is built ahead."""
        return _nothing

    def prepare(self, keys: Sequence[BucketKey]) -> None:
        """Build the buckets of `keys` in one batch, ahead of their warm-up (default: nothing)."""
        return None

    def session(self, keys: Sequence[BucketKey], *, slots: int = 0) -> Callable[[], None]:
        """An engine (`dlm_jax.runtime.engine`) starts a run of requests whose steps use `keys`
        (at batch 1) over `slots` slots per row, before it opens its K/V cache; returns what it
        calls when the run ends (the engine is idle again). Default: nothing."""
        return _nothing

    def fork(self) -> Executor:
        """An executor over the same weights for a second thread (default: this one)."""
        return self

    def open(self, config: ModelConfig, positions: np.ndarray, valid: np.ndarray):
        """The `KVCache` of one decode over slots with these `positions` / `valid` [B, S];
        default None: the decoder then holds them in a `HostKVCache` beside this executor,
        which feeds `step` dense inputs."""
        return None

    def close(self) -> None:
        """Release native resources now (default: nothing)."""
        return None

    def place(self, resident: Mapping[int, np.ndarray]) -> int:
        """Hold experts `resident` ({layer: [S] expert ids}) in the expert slots of those
        layers for the next steps (split execution); returns the bytes moved in (default: no
        slots, nothing moved)."""
        return 0

    def build_counts(self) -> BuildCounts:
        """Compiles and exports so far (default: none)."""
        return BuildCounts()

    def logits_like(self, batch: int, rows: int) -> DeviceLogits | None:
        """Logits kept on the device as a step of `batch` rows and `rows` logit rows would keep
        them (`OutputRequest.device_logits`; zeros), for warming the programs that answer their
        asks (`runtime.decoder.warm_logits`); default None: this executor keeps none."""
        return None

    def set_progress(self, progress: Progress | None) -> None:
        """A callback for long builds (default: ignored)."""
        return None

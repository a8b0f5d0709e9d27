"""The partitioned bundle's executor: the lowering's NPU/CPU split is what runs (NumPy and
LiteRT, no JAX; `dlm_jax.executors.partition_contract` names the programs).

One step of bucket (B, W, P, R):

1. CPU (NumPy): embed the window's tokens; pad rows to the tile (ceil32(W)); padded rows see
   only themselves and nothing sees them.
2. NPU programs (LiteRT on the NPU where the machine has one, the CPU otherwise): the body over
   the tiled window. A sparse bundle runs it layer by layer, and after each layer adds the
   layer's cold neurons on the CPU (`ColdPath`: PowerInfer-2's predicted-active cold neurons
   from a neuron cache, misses read from the bundle's flash file).
3. CPU (LiteRT): the head over the rows the step asks for, gathered by the host.

The step contract is the unpartitioned bundle's (`dlm_jax.runtime.step`), so the decoder, rules
and caches are the same; in float32 it gives the same tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax.executors._litert import read_outputs
from dlm_jax.executors.bundle_files import CPU_PROGRAMS_FILE, CPU_WEIGHTS_FILE
from dlm_jax.techniques.powerinfer.cold_path import ColdPath, cached_neuron_bytes
from dlm_jax.executors.partition_contract import body_name, body_outputs, head_name, head_outputs, tiled
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.step import BuildCounts, Capabilities, Executor, StepInputs, StepOutputs



class _Program:
    """One signature of the compiled model with its buffers, made once and reused."""

    def __init__(self, model, name: str, out_specs: dict[str, tuple[tuple[int, ...], np.dtype]]):
        try:
            self.index = model.get_signature_index(name)
        except Exception as e:  # noqa: BLE001 (LiteRT raises its own types)
            raise CheckpointError(f"the bundle has no program {name} ({e})") from None
        listed = model.get_signature_list()[name]
        self.input_names = list(listed["inputs"])
        self.output_names = list(listed["outputs"])
        if set(self.output_names) != set(out_specs):
            raise CheckpointError(f"program {name}: outputs {self.output_names}, expected {sorted(out_specs)}")
        self.inputs = model.create_input_buffers(self.index)
        self.outputs = model.create_output_buffers(self.index)
        self.out_specs = out_specs

    def run(self, model, arrays: dict[str, np.ndarray], skip: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
        for name, buffer in zip(self.input_names, self.inputs):
            buffer.write(np.ascontiguousarray(arrays[name]))
        model.run_by_index(self.index, self.inputs, self.outputs)
        return read_outputs(self.output_names, self.outputs, self.out_specs, skip)


def pad_window(inputs: StepInputs, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hidden, positions, visibility) of a step padded from W to ceil32(W) rows: padded rows
    are zero, at position 0, and see only themselves; no row sees them."""
    b, w = inputs.tokens.shape
    p = inputs.k_cache.shape[2]
    wt = tiled(w)
    if wt == w:
        return hidden, inputs.positions, inputs.visibility
    h = np.zeros((b, wt, hidden.shape[-1]), hidden.dtype)
    h[:, :w] = hidden
    positions = np.zeros((b, wt), np.int32)
    positions[:, :w] = inputs.positions
    vis = np.zeros((b, wt, p + wt), bool)
    vis[:, :w, :p + w] = inputs.visibility
    pad = np.arange(w, wt)
    vis[:, pad, p + pad] = True
    return h, positions, vis


class PartitionedExecutor(Executor):
    """Executor over a partitioned bundle (`bundle.json` "partition"). `accelerator` runs the
    NPU programs (cpu: XNNPACK with `threads` threads); the head always runs on the CPU. A
    sparse bundle needs its `cold` path (`ColdPath`), which holds the cold neurons."""

    def __init__(self, bundle, *, accelerator: str = "cpu", threads: int = 2, cpu_fallback: bool = False,
                 cold: ColdPath | None = None):
        from dlm_jax.checkpoint._safetensors import load_file
        from dlm_jax.executors._litert import compiled_model

        self.bundle = bundle
        self.config = bundle.config
        part = bundle.meta["partition"]
        self.sparse = bool(part.get("sparse"))
        if self.sparse and cold is None:
            raise ConfigError("a sparse bundle runs with its cold-neuron path (ColdPath)")
        self.cold = cold
        self.accelerator = accelerator
        # LiteRT reads from these buffers: keep them alive
        self._content = bundle.model_path.read_bytes()
        self._cpu_content = (bundle.path / part.get("cpu_programs", CPU_PROGRAMS_FILE)).read_bytes()
        self._npu = compiled_model(self._content, accelerator=accelerator, threads=threads, cpu_fallback=cpu_fallback,
                                   owner=self)
        self._cpu = compiled_model(self._cpu_content, accelerator="cpu", threads=threads, owner=self)
        self.embedding = load_file(bundle.path / part.get("cpu_weights", CPU_WEIGHTS_FILE))["embedding"]
        self._capabilities = Capabilities.from_keys(bundle.keys)
        self._programs: dict[str, _Program] = {}
        self._checked: set[BucketKey] = set()
        self._warm: set[BucketKey] = set()
        self._lock = threading.Lock()
        self._setup_seconds = 0.0
        self.timings = {"npu": 0.0, "cpu_head": 0.0, "cpu_cold": 0.0, "host": 0.0}

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def _program(self, model, name: str, out_specs) -> _Program:
        prog = self._programs.get(name)
        if prog is None:
            t0 = time.perf_counter()
            prog = self._programs[name] = _Program(model, name, out_specs)
            self._setup_seconds += time.perf_counter() - t0
        return prog

    def _body_specs(self, b: int, wt: int, layer: int | None):
        cfg = self.config
        kv = (b, wt, cfg.n_kv_heads, cfg.head_dim) if layer is not None else \
            (cfg.n_layers, b, wt, cfg.n_kv_heads, cfg.head_dim)
        shapes = {"hidden": (b, wt, cfg.d_model), "ffn_in": (b, wt, cfg.d_model), "k_new": kv, "v_new": kv}
        return {n: (shapes[n], np.dtype(cfg.dtype)) for n in body_outputs(layer)}

    def _head_specs(self, b: int, r: int, full: bool):
        specs = {"top_token": ((b, r), np.dtype(np.int32)), "top_prob": ((b, r), np.dtype(np.float32)),
                 "second_prob": ((b, r), np.dtype(np.float32)), "entropy": ((b, r), np.dtype(np.float32)),
                 "logits": ((b, r, self.config.vocab_size), np.dtype(np.float32))}
        return {n: specs[n] for n in head_outputs(full)}

    def warmup(self, keys: Sequence[BucketKey], *, slots: int = 0, views: bool = False) -> int:
        """Set up the programs of every new bucket in `keys` and run each once (zero inputs); the
        cold path's counters are left as they were. Returns how many were new."""
        from dlm_jax.executors._litert import zero_inputs

        new = [k for k in dict.fromkeys(keys) if k not in self._warm]
        counters = None if self.cold is None else copy.copy(self.cold.counters)
        for key in new:
            self.step(zero_inputs(self.config, key))
            self._warm.add(key)
        if counters is not None:
            self.cold.counters = counters
        return len(new)

    def build_counts(self) -> BuildCounts:
        return BuildCounts(compiles=len(self._programs), compile_seconds=self._setup_seconds)

    def close(self) -> None:
        """Stop the cold path's reader thread and close its file (the programs go with this object)."""
        if self.cold is not None:
            self.cold.close()

    def step(self, inputs: StepInputs, *, timings: dict[str, float] | None = None) -> StepOutputs:
        with self._lock:
            return self._step(inputs)

    def _step(self, inputs: StepInputs) -> StepOutputs:
        t0 = time.perf_counter()
        cfg = self.config
        key = inputs.key
        if key not in self._checked:  # a bucket the bundle holds (the error names the missing one)
            self._capabilities.select(batch=key.batch, window=key.window, cache=key.cache, rows=key.rows,
                                      logits=key.full_logits)
            self._checked.add(key)
        skip = frozenset() if inputs.want.kv else frozenset({"k_new", "v_new"})
        b, w, p, r = key.batch, key.window, key.cache, key.rows
        wt = tiled(w)
        hidden, positions, vis = pad_window(inputs, self.embedding[inputs.tokens].astype(cfg.dtype, copy=False))
        arrays = {"hidden": hidden, "positions": positions, "visibility": vis}
        t1 = time.perf_counter()
        cold_s = 0.0
        if not self.sparse:
            if p:
                arrays.update(k_cache=inputs.k_cache, v_cache=inputs.v_cache)
            out = self._program(self._npu, body_name(b, wt, p), self._body_specs(b, wt, None)).run(self._npu, arrays,
                                                                                                   skip)
            hidden, k_new, v_new = out["hidden"], out.get("k_new"), out.get("v_new")
        else:
            # real rows: those some row sees (bucket padding is invisible to every row); the
            # cold neurons are computed for them only
            live = inputs.visibility[:, :, p:p + w].any(axis=1)
            ks, vs = [], []
            for i in range(cfg.n_layers):
                if p:
                    arrays.update(k_cache=inputs.k_cache[i], v_cache=inputs.v_cache[i])
                prog = self._program(self._npu, body_name(b, wt, p, i), self._body_specs(b, wt, i))
                out = prog.run(self._npu, arrays, skip)
                c0 = time.perf_counter()
                h = out["hidden"]
                rows = h[:, :w]
                rows[live] += self.cold(i, wt, out["ffn_in"][:, :w][live])
                cold_s += time.perf_counter() - c0
                arrays["hidden"] = h
                ks.append(out.get("k_new"))
                vs.append(out.get("v_new"))
            hidden = arrays["hidden"]
            k_new, v_new = (np.stack(ks), np.stack(vs)) if inputs.want.kv else (None, None)
        t2 = time.perf_counter()
        rows = np.take_along_axis(hidden[:, :w], inputs.logit_rows[:, :, None].astype(np.int64), axis=1)
        head = self._program(self._cpu, head_name(b, r, key.full_logits), self._head_specs(b, r, key.full_logits))
        named = head.run(self._cpu, {"rows": rows})
        t3 = time.perf_counter()
        if inputs.want.kv:
            named.update(k_new=k_new[:, :, :w], v_new=v_new[:, :, :w])
        if not inputs.want.logits:
            named.pop("logits", None)
        self.timings["host"] += t1 - t0
        self.timings["npu"] += t2 - t1 - cold_s
        self.timings["cpu_cold"] += cold_s
        self.timings["cpu_head"] += t3 - t2
        return StepOutputs.from_named(named)


MB = 1_000_000


def resident_bytes(bundle) -> dict[str, int]:
    """What a partitioned bundle keeps in memory besides the neuron cache: the NPU and CPU
    programs with their constants (attention, hot neurons, head), the embedding table and the
    predictor."""
    part = bundle.meta["partition"]
    out = {"programs": bundle.model_path.stat().st_size
                       + (bundle.path / part.get("cpu_programs", CPU_PROGRAMS_FILE)).stat().st_size,
           "embedding": (bundle.path / part.get("cpu_weights", CPU_WEIGHTS_FILE)).stat().st_size}
    if part.get("predictor"):
        out["predictor"] = (bundle.path / part["predictor"]).stat().st_size
    return out


def open_executor(bundle, *, accelerator: str = "cpu", threads: int = 2, cpu_fallback: bool = False,
                  memory_budget_mb: float | None = None, oracle: bool = False, pipeline: bool = True,
                  direct: bool = True, on_note=None, audit: bool = False, prefetch: bool = False) -> PartitionedExecutor:
    """The executor of a partitioned bundle. A sparse one gets its cold path: the neuron cache
    is what `memory_budget_mb` leaves after the resident part (`resident_bytes`; None: room for
    every neuron, nothing read twice); `prefetch`: fill it ahead from the calibration
    statistics when it starts empty (`cold_path.prefetch_order`; bundles without statistics
    fill it in the plan's order). Off by default: on this machine it reads more than it saves
    (`benchmarks/results/powerinfer.md`).

    Raises:
      ConfigError: a budget below the resident part (both numbers named).
    """
    import json

    part = bundle.meta["partition"]
    cold = None
    if part.get("sparse"):
        from dlm_jax.checkpoint._safetensors import load_file
        from dlm_jax.techniques.powerinfer.predictor import LowRankPredictor

        neurons = json.loads((bundle.path / part["neurons"]).read_text())
        order = np.asarray(neurons["plan"]["order"], np.int64)
        hot = {int(w): np.asarray(h, np.int64) for w, h in neurons["hot"].items()}
        resident = sum(resident_bytes(bundle).values())
        total = order.size * int(part["neuron_bytes"])
        if memory_budget_mb is None:
            cache = total
        else:
            cache = int(memory_budget_mb * MB) - resident
            if cache < int(part["neuron_bytes"]) * order.shape[0]:
                raise ConfigError(f"memory budget {memory_budget_mb:g} MB is below the resident minimum "
                                  f"{(resident + int(part['neuron_bytes']) * order.shape[0]) / MB:.2f} MB of "
                                  f"{bundle.path} (programs, embedding and predictor "
                                  f"{resident / MB:.2f} MB, one cached neuron per layer)")
        predictor = None
        if not oracle:
            if not part.get("predictor"):
                raise ConfigError(f"{bundle.path} has no activation predictor; run it with oracle activations")
            predictor = LowRankPredictor.from_arrays(load_file(bundle.path / part["predictor"]))
        slots = cache // cached_neuron_bytes(bundle.config.ffn, bundle.config.d_model)
        ahead = _prefetch(neurons, order, hot, slots) if prefetch else None
        cold = ColdPath(bundle.path / part["flash"], order=order, hot=hot, cache_bytes=cache, predictor=predictor,
                        oracle=oracle, pipeline=pipeline, direct=direct, on_note=on_note, audit=audit,
                        prefetch=ahead)
    return PartitionedExecutor(bundle, accelerator=accelerator, threads=threads, cpu_fallback=cpu_fallback,
                               cold=cold)


def _prefetch(neurons: dict, order: np.ndarray, hot: dict[int, np.ndarray], slots: int) -> list[np.ndarray]:
    """The prefetch region for `slots` cached neurons (`cold_path.prefetch_order`): the cold
    neurons of the largest window bucket in the plan's order, shared between layers by the
    bundle's activation statistics at its largest recorded window (without statistics, by
    their place in the order)."""
    from dlm_jax.techniques.powerinfer.cold_path import prefetch_order

    n_layers, n = order.shape
    first_cold = np.asarray(hot[max(hot)], np.int64)
    if "stats" in neurons:
        from dlm_jax.techniques.powerinfer.neurons import ActivationStats

        stats = ActivationStats.from_dict(neurons["stats"])
        windows = stats.recorded_windows()
        prob = stats.prob(windows[-1]) if windows else stats.token_prob()
    else:  # earlier in the order = more likely active
        prob = np.empty((n_layers, n))
        prob[np.arange(n_layers)[:, None], order] = np.linspace(1.0, 1e-6, n)[None]
    return prefetch_order(prob, order, first_cold, slots)

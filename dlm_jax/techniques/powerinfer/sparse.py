"""What a sparse bundle is made from: activation statistics of decode windows, the activation
predictor trained on recorded activations, and the neuron plan (PowerInfer-2's offline planner).

    stats = decode_statistics(handle, prompts, decode)           # ffn_active of real decodes
    samples = ffn_samples(handle.model, record_windows(handle, prompts, decode))  # (FFN input, active)
    predictor, report = train_predictor(samples, model.config)    # low-rank, per layer
    sparse = plan_sparse(model.config, stats, predictor, budget_mb=...)
    export_bundle(..., sparse=sparse)

The statistics come from the `ffn_active` step output of decodes on the JAX executor (the
`NeuronTrace` placement policy); the predictor's training pairs from the same decodes' windows,
each step's inputs replayed through the model's layers (`record_windows`, `ffn_samples`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from dlm_jax.runtime.step import Executor
from dlm_jax._errors import ConfigError
from dlm_jax.techniques.powerinfer.neuron_plan import NeuronCosts, plan_neurons
from dlm_jax.techniques.powerinfer.neurons import ActivationStats, decode_statistics
from dlm_jax.techniques.powerinfer.predictor import LowRankPredictor, recall_precision


class _Recording(Executor):
    """An executor that runs `inner`'s dense steps (the host K/V path) and keeps each step's
    inputs: the decode windows exactly as the step saw them."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    @property
    def capabilities(self):
        return self.inner.capabilities

    def warmup(self, keys, *, slots: int = 0, views: bool = False) -> int:
        return 0

    def step(self, inputs, *, timings=None):
        self.steps.append(inputs)
        return self.inner.step(inputs)


def record_windows(handle, prompts: Sequence[Sequence[int]], decode) -> list:
    """The `StepInputs` of every step of decoding `prompts` (one at a time) with `decode` on the
    JAX executor of the `dlm_jax.Model` `handle`."""
    from dlm_jax.runtime.decoder import Decoder

    recorder = _Recording(handle.executor)
    decoder = Decoder(recorder, handle.config)
    for ids in prompts:
        decoder.decode([list(ids)], decode)
    return recorder.steps


def ffn_trace(model, tokens, positions, visibility, k_cache, v_cache):
    """(FFN inputs [L, B, W, D], activations [L, B, W, F]) of one decode step of `model`: what
    each layer's FFN reads and its neurons (no cache when P == 0)."""
    import jax.numpy as jnp

    cached = k_cache.shape[2] > 0
    x, cos, sin, mask = model.layer_inputs(tokens, positions, visibility, k_cache if cached else None,
                                           v_cache if cached else None)
    xs, acts = [], []
    for i, block in enumerate(model.layers):
        attn, _, _ = block.attn(block.attn_norm(x), cos, sin, mask, k_cache[i] if cached else None,
                                v_cache[i] if cached else None)
        h = x + attn
        xn = block.ffn_norm(h)
        y, act = block.ffn(xn)
        xs.append(xn)
        acts.append(act)
        x = h + y
    return jnp.stack(xs), jnp.stack(acts)


def ffn_samples(model, steps: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Training pairs for the predictor from the Flax `model`: (FFN inputs [L, N, D] float32,
    active [L, N, F] bool) of the real rows (those some row sees) of recorded decode steps
    (`record_windows`), the inputs and activity the sparse bundle's cold path will meet."""
    import jax

    trace = jax.jit(lambda *a: ffn_trace(model, *a))
    xs, acts = [], []
    for inputs in steps:
        p, w = inputs.k_cache.shape[2], inputs.tokens.shape[1]
        live = inputs.visibility[:, :, p:p + w].any(axis=1)
        x, a = trace(inputs.tokens, inputs.positions, inputs.visibility, inputs.k_cache, inputs.v_cache)
        xs.append(np.asarray(x, np.float32)[:, live])  # a bfloat16 model's inputs, widened as documented
        acts.append(np.asarray(a)[:, live] > 0)
    return np.concatenate(xs, axis=1), np.concatenate(acts, axis=1)


@dataclasses.dataclass(frozen=True)
class PredictorReport:
    """Held-out quality of a trained predictor: per layer recall and precision over tokens, and
    over windows of W consecutive rows (a neuron counts for a window if any row activates it)."""

    rank: int
    params: int
    ffn_params: int
    recall: list[float]
    precision: list[float]
    window_recall: dict[int, list[float]]
    window_precision: dict[int, list[float]]
    thresholds: list[float]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _window_union(a: np.ndarray, w: int) -> np.ndarray:
    n = a.shape[0] // w * w
    return a[:n].reshape(-1, w, a.shape[-1]).any(axis=1)


def train_predictor(samples: tuple[np.ndarray, np.ndarray], config, *, rank: int | None = None, steps: int = 1500,
                    batch: int = 512, learning_rate: float = 3e-3, target_recall: float = 0.99,
                    windows: Sequence[int] = (1, 4, 16, 32), seed: int = 0,
                    progress=None) -> tuple[LowRankPredictor, PredictorReport]:
    """PowerInfer-2's activation predictor (§4.1.2; the architecture is our choice, the paper leaves it
    open): per layer sigmoid(W2 relu(W1 x + b1)
    + b2) of rank `rank` (default: predictor parameters within 10% of the FFN's), trained with
    binary cross-entropy on 90% of `samples` (positives weighted by the inactive / active
    ratio, capped at 20: most neurons are off), then each layer's output bias shifted so that
    a 0.5 threshold reaches `target_recall` on the other 10% (a missed neuron changes the
    output; an extra one only costs compute). The report is measured on that held-out 10%."""
    import jax
    import jax.numpy as jnp
    import optax

    xs, active = samples
    n_layers, n, d = xs.shape
    f = active.shape[-1]
    rank = rank or LowRankPredictor.rank_for(d, f)
    cut = int(n * 0.9)
    init = LowRankPredictor.init(n_layers, d, f, rank, seed=seed)
    arrays = init.to_arrays()
    w1s, b1s, w2s, b2s, thresholds = [], [], [], [], []
    rng = np.random.default_rng(seed)

    def loss_fn(p, x, y, pos_weight):
        logits = jnp.maximum(x @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]
        per = optax.sigmoid_binary_cross_entropy(logits, y)
        return jnp.mean(per * jnp.where(y > 0, pos_weight, 1.0))

    tx = optax.adam(learning_rate)

    @jax.jit
    def update(p, opt, x, y, pos_weight):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y, pos_weight)
        upd, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, upd), opt, loss

    for layer in range(n_layers):
        p = {k: jnp.asarray(arrays[f"layers.{layer}.{k}"]) for k in ("w1", "b1", "w2", "b2")}
        rate = float(active[layer, :cut].mean())
        pos_weight = float(min(20.0, (1 - rate) / max(rate, 1e-6)))
        opt = tx.init(p)
        x_train, y_train = xs[layer, :cut], active[layer, :cut].astype(np.float32)
        for step in range(steps):
            idx = rng.integers(0, cut, batch)
            p, opt, loss = update(p, opt, x_train[idx], y_train[idx], pos_weight)
            if progress is not None and step % 250 == 0:
                progress(layer, step, float(loss))
        p = {k: np.asarray(v) for k, v in p.items()}
        logits = np.maximum(xs[layer, cut:] @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]
        truth = active[layer, cut:]
        shift = _recall_shift(logits, truth, target_recall)
        w1s.append(p["w1"])
        b1s.append(p["b1"])
        w2s.append(p["w2"])
        b2s.append(p["b2"] - shift)
        thresholds.append(float(shift))
    predictor = LowRankPredictor(w1s, b1s, w2s, b2s)
    report = _report(predictor, xs[:, cut:], active[:, cut:], rank, config, windows, thresholds)
    return predictor, report


def _recall_shift(logits: np.ndarray, truth: np.ndarray, target: float) -> float:
    """The largest logit threshold whose recall over `truth` is at least `target` (0: the
    predictor already reaches it at 0.5)."""
    pos = np.sort(logits[truth])
    if pos.size == 0:
        return 0.0
    k = int(np.floor((1 - target) * pos.size))  # may miss the k lowest-scored positives
    return float(min(0.0, pos[k] - 1e-6))


def _report(predictor, xs, active, rank, config, windows, thresholds) -> PredictorReport:
    recall, precision = [], []
    w_recall = {w: [] for w in windows}
    w_precision = {w: [] for w in windows}
    for layer in range(xs.shape[0]):
        pred = predictor.predict(layer, xs[layer])
        r, p = recall_precision(pred, active[layer])
        recall.append(round(r, 4))
        precision.append(round(p, 4))
        for w in windows:
            r, p = recall_precision(_window_union(pred, w), _window_union(active[layer], w))
            w_recall[w].append(round(r, 4))
            w_precision[w].append(round(p, 4))
    gated = 3 if config.ffn == "reglu" else 2
    return PredictorReport(rank, predictor.param_count(), gated * config.d_model * config.ffn_hidden * config.n_layers,
                           recall, precision, w_recall, w_precision, thresholds)


def neuron_bytes(config, dtype: str = "float32") -> int:
    """Bytes of one neuron bundle (gate row, up row, down column) in the flash file."""
    return (3 if config.ffn == "reglu" else 2) * config.d_model * np.dtype(dtype).itemsize


def plan_sparse(config, stats: ActivationStats, predictor, *, windows: Sequence[int], budget_mb: float,
                resident_bytes: int, cluster: int = 128, costs: NeuronCosts | None = None):
    """The `SparseExport` of a memory budget: `plan_neurons` over `stats` for the tiled
    `windows` with `budget_mb` for everything (`resident_bytes`: what is not FFN)."""
    from dlm_jax.tflite_export.bundle import SparseExport

    if budget_mb <= 0:
        raise ConfigError(f"--memory-budget must be > 0 MB, got {budget_mb:g}")
    plan = plan_neurons(stats, windows=sorted(set(windows)), budget_bytes=int(budget_mb * 1e6),
                        resident_bytes=resident_bytes, neuron_bytes=neuron_bytes(config),
                        cost=costs or NeuronCosts.phone())
    return SparseExport(plan=plan, predictor=predictor, stats=stats, cluster=cluster)


def calibration_examples(per_task: int = 8, *, seed: int = 1):
    """Task examples for calibration (the training split, not the held-out prompts evaluations
    use): (prompt text, answer text) pairs."""
    from dlm_jax.training.data import TASKS, make_split

    return [(ex.prompt, ex.answer) for t in TASKS for ex in make_split(TASKS[t], per_task, split="train", seed=seed)]


def non_ffn_bytes(config) -> int:
    """Float32 bytes of every parameter outside the FFNs (attention, norms, embedding, head)."""
    from dlm_jax.models._params import param_count

    gated = 3 if config.ffn == "reglu" else 2
    return 4 * (param_count(config) - gated * config.d_model * config.ffn_hidden * config.n_layers)


def sparse_export(handle, decode, keys, *, budget_mb: float, per_task: int = 8, cluster: int = 128,
                  predictor_steps: int = 800, progress=None):
    """Everything `export_bundle(..., sparse=)` needs for the `dlm_jax.Model` `handle` (JAX
    executor): activation statistics from decoding calibration prompts with `decode`, the
    predictor trained on their (FFN input, activity) pairs, and the plan for `budget_mb` over
    the tiled windows of `keys`. Returns (SparseExport, predictor report)."""
    from dlm_jax._config import SPARSE_FFN_KINDS
    from dlm_jax.executors.partition_contract import tiled

    config = handle.config
    if config.ffn not in SPARSE_FFN_KINDS:
        raise ConfigError(f"--sparse needs a ReLU-family FFN (ffn = relu or reglu); this model's is {config.ffn!r}")
    prompts = [handle.encode(p) for p, _ in calibration_examples(per_task)]
    if progress:
        progress("activation statistics", 0, 3)
    stats = decode_statistics(handle, prompts, decode)
    if progress:
        progress("predictor samples", 1, 3)
    samples = ffn_samples(handle.model, record_windows(handle, prompts, decode))
    if progress:
        progress("predictor training", 2, 3)
    predictor, report = train_predictor(samples, config, steps=predictor_steps)
    windows = sorted({tiled(k.window) for k in keys})
    plan = plan_sparse(config, stats, predictor, windows=windows, budget_mb=budget_mb,
                       resident_bytes=non_ffn_bytes(config) + 4 * predictor.param_count(), cluster=cluster)
    return plan, report

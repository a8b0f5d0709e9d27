"""A step's rows' logits kept where the step ran, and the programs that turn them into what
the host runtime asks for (`runtime.step.DeviceLogits`).

Sampling, OpenAI's penalties and logit bias, and recorded log-probabilities need the rows'
whole distributions. Read back, that is B x R x V float32 per step (15.4 MiB at LLaDA-8B's
vocabulary and 32 rows), worked on in float64 by the host: 70-124 ms a step on a 2-core CPU
(`benchmarks/results/logits_host.md`) beside a GPU step of 8-11 ms. Here the same rules run
as small compiled programs beside the logits, and only their answers come back: [4, B, R]
int32 for a proposal, [m, 1 + 2k] for m slots' log-probabilities.

The rules are the host proposer's (`runtime.proposer`), in float32:
- adjustments: logit - frequency * c - presence * (c > 0) + bias, c the committed counts;
- sampling: Gumbel-max, argmax(z / T + g) over the tokens the top-k / top-p filter keeps
  (`sampling_keep`'s rule: ranked by logit, ties by the lower id), which draws from
  softmax(z / T) on that set as LLaDA's argmax(exp(z) / (-log u)^T) does. The noise of row
  b, predicted row r is `uniform(fold_in(key(seed_b), r), V)`, `seed_b` one 32-bit word the
  host draws from request b's own generator: a request's draws depend on its seed and its
  own steps, never on the bucket or the other rows of its call;
- confidences: the softmax probability (temperature 1) of the proposal, the runner-up's, the
  entropy.

Axes: B batch rows (of the view), R predicted rows, V vocabulary, m slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.runtime import step

_TINY = float(np.finfo(np.float32).tiny)


def _bucket(n: int) -> int:
    """The power of two >= n (>= 1): shapes that vary per step compile a few programs."""
    return 1 << max(0, int(n) - 1).bit_length()


def _float_bits(x) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.int32)


def _pack_proposal(rows, draw, seeds, count_ids, bias_ids, bias_vals, temperature, top_p, presence, frequency,
                   top_k) -> np.ndarray:
    """A proposal's request as one int32 vector (one transfer, as a step's `pack_request`):
    rows [B], draw [B], seeds [B] (their bits), count_ids [B * G], bias ids [NB], bias values
    [NB] (bits), temperature, top_p, presence, frequency (bits), top_k; `_unpack_proposal`
    reads it in the program."""
    return np.concatenate([np.asarray(rows, np.int32), np.asarray(draw, np.int32),
                           np.asarray(seeds, np.uint32).view(np.int32), np.asarray(count_ids, np.int32).ravel(),
                           np.asarray(bias_ids, np.int32), _float_bits(bias_vals),
                           _float_bits([temperature, top_p, presence, frequency]), np.asarray([top_k], np.int32)])


def _unpack_proposal(packed, b: int, g: int, nb: int):
    sizes = (b, b, b, b * g, nb, nb, 4, 1)
    cuts = np.cumsum((0,) + sizes)
    rows, draw, seeds, count_ids, bias_ids, bias_vals, scalars, top_k = (packed[s:e] for s, e in zip(cuts, cuts[1:]))
    f = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
    temperature, top_p, presence, frequency = f(scalars)
    return (rows, draw != 0, jax.lax.bitcast_convert_type(seeds, jnp.uint32), count_ids.reshape(b, g), bias_ids,
            f(bias_vals), temperature, top_p, presence, frequency, top_k[0])


@functools.partial(jax.jit, static_argnames=("b", "g", "nb", "sample", "filtered", "penalized", "biased"))
def _propose(logits, packed, *, b: int, g: int, nb: int, sample: bool, filtered: bool, penalized: bool,
             biased: bool):
    (rows, draw, seeds, count_ids, bias_ids, bias_vals, temperature, top_p, presence, frequency,
     top_k) = _unpack_proposal(packed, b, g, nb)
    z = jnp.take(logits, rows, axis=0).astype(jnp.float32)  # [B, R, V]
    b, r, v = z.shape
    if biased:
        z = z.at[:, :, bias_ids].add(bias_vals)
    if penalized:  # count_ids [B, G], v where none (dropped)
        counts = jnp.zeros((b, v), jnp.float32).at[jnp.arange(b)[:, None], count_ids].add(1.0, mode="drop")
        z = z - (frequency * counts + presence * (counts > 0))[:, None, :]
    x0 = top = jnp.argmax(z, axis=-1)
    if sample:
        keep = _keep(z, temperature, top_k, top_p) if filtered else jnp.isfinite(z)

        def noise(seed):
            key = jax.random.key(seed)
            return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i), (v,), jnp.float32,
                                                         minval=_TINY, maxval=1.0))(jnp.arange(r))

        u = jax.vmap(noise)(seeds)  # [B, R, V]
        gumbel = -jnp.log(-jnp.log(u))
        drawn = jnp.argmax(jnp.where(keep, z / temperature + gumbel, -jnp.inf), axis=-1)
        x0 = jnp.where(draw[:, None], drawn, x0)
    # Each from one pass of reductions over z: XLA:CPU fuses a softmax fed into a top-k or an
    # entropy by recomputing it per use (9x slower at V = 126,464).
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    lse = m + jnp.log(s)
    top1 = jnp.exp(jnp.take_along_axis(z, x0[..., None], -1) - lse)[..., 0]
    second = jnp.max(jnp.where(jnp.arange(v) == top[..., None], -jnp.inf, z), axis=-1, keepdims=True)  # runner-up
    top2 = jnp.exp(second - lse)[..., 0]
    ent = (lse - jnp.sum(e * jnp.where(jnp.isfinite(z), z, 0.0), axis=-1, keepdims=True) / s)[..., 0]
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
    return jnp.stack([x0.astype(jnp.int32), bits(top1), bits(top2), bits(ent)])


def _keep(z, temperature, top_k, top_p):
    """[B, R, V] bool: the tokens the top-k (0: off) / top-p (1: off) filter keeps, as
    `runtime.proposer.sampling_keep` ranks them (by logit, ties by the lower id)."""
    v = z.shape[-1]
    order = jnp.argsort(-z, axis=-1, stable=True)
    ranked = jnp.take_along_axis(z, order, -1)
    idx = jnp.arange(v)
    keep = jnp.isfinite(ranked) & ((top_k == 0) | (idx < top_k))
    t = jnp.where(keep, ranked / temperature, -jnp.inf)
    p = jnp.exp(t - t[..., :1])
    p = p / p.sum(-1, keepdims=True)
    before = jnp.cumsum(p, axis=-1) - p  # the mass ranked above each token
    keep = keep & ((top_p >= 1.0) | (before < top_p))
    keep = keep.at[..., 0].set(True)
    n = keep.sum(-1, keepdims=True)  # a prefix of the ranking
    rank = jnp.argsort(order, axis=-1)
    return (rank < n) & jnp.isfinite(z)


@functools.partial(jax.jit, static_argnames=("k",))
def _logprobs(logits, packed, *, k: int):
    b, i, tokens = packed  # [3, m]: batch row, predicted row, token
    z = logits[b, i].astype(jnp.float32)  # [m, V]
    lse = jax.nn.logsumexp(z, axis=-1)
    lp = jnp.take_along_axis(z, tokens[:, None], -1)[:, 0] - lse
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
    if not k:
        return bits(lp)[:, None]
    vals, ids = jax.lax.top_k(z, k)  # ties: the lower id first
    return jnp.concatenate([bits(lp)[:, None], ids.astype(jnp.int32), bits(vals - lse[:, None])], axis=1)


class DeviceLogits(step.DeviceLogits):
    """The rows' logits [B, R, V] float32 of a step, on the device that ran it
    (`runtime.step.DeviceLogits`). Indexing `[:, :k]` (the proposer's first k rows) and
    `rows(i)` (an engine's batch row) make views without a device op; `np.asarray` reads a
    view back whole (what any host rule without a device form gets)."""

    __slots__ = ("array", "_rows", "_cols", "_transfers")

    def __init__(self, array: jax.Array, rows: np.ndarray | None = None, cols: int | None = None, transfers=None):
        self.array = array
        self._rows = np.arange(array.shape[0], dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
        self._cols = array.shape[1] if cols is None else int(cols)
        self._transfers = transfers  # the step's `Transfers`: what is sent and read back is counted there

    def _count(self, sent: int, got: int) -> None:
        if self._transfers is not None:
            self._transfers.more(sent, got)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self._rows), self._cols, self.array.shape[2])

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def __getitem__(self, index) -> DeviceLogits:
        if (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)
                and isinstance(index[1], slice) and index[1].start in (None, 0) and index[1].step in (None, 1)):
            stop = self._cols if index[1].stop is None else min(int(index[1].stop), self._cols)
            return DeviceLogits(self.array, self._rows, stop, self._transfers)
        return np.asarray(self)[index]

    def rows(self, index) -> DeviceLogits:
        """Batch rows `index` (a list) of this view."""
        return DeviceLogits(self.array, self._rows[np.asarray(index)], self._cols, self._transfers)

    def __array__(self, dtype=None, copy=None):
        host = np.asarray(jax.device_get(self.array[jnp.asarray(self._rows), :self._cols]))
        self._count(self._rows.nbytes, host.nbytes)
        return host if dtype is None else host.astype(dtype)

    def propose(self, *, draw: np.ndarray, seeds: np.ndarray, temperature: float, top_k: int, top_p: float,
                count_ids: np.ndarray | None, presence: float, frequency: float,
                bias: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, ...]:
        """(x0 int32, top1, top2, entropy float32), each [B, R], for this view's rows: `draw` [B]
        bool rows that sample (the others take the argmax), `seeds` [B] uint32 their noise,
        `count_ids` [B, G] the committed token ids per row (-1: none) when a penalty is set.
        One array goes to the device and one comes back."""
        b, v = len(self._rows), self.array.shape[2]
        penalized = count_ids is not None and (presence != 0 or frequency != 0)
        if penalized:
            g = _bucket(count_ids.shape[1])
            ids = np.full((b, g), v, np.int32)
            ids[:, :count_ids.shape[1]] = np.where(count_ids >= 0, count_ids, v)
        else:
            ids = np.zeros((b, 1), np.int32)
        nb = _bucket(len(bias))
        bias_ids, bias_vals = np.zeros(nb, np.int32), np.zeros(nb, np.float32)
        if bias:
            bias_ids[:len(bias)], bias_vals[:len(bias)] = zip(*bias)
        sample = bool(temperature > 0 and np.any(draw))
        request = _pack_proposal(self._rows, draw, seeds, ids, bias_ids, bias_vals, max(temperature, _TINY), top_p,
                                 presence, frequency, top_k)
        packed = _propose(self.array, request, b=b, g=ids.shape[1], nb=nb, sample=sample,
                          filtered=sample and (top_k > 0 or top_p < 1.0), penalized=penalized, biased=bool(bias))
        packed = np.asarray(jax.device_get(packed))
        self._count(request.nbytes, packed.nbytes)
        packed = packed[:, :, :self._cols]
        f = lambda x: np.ascontiguousarray(x).view(np.float32)  # noqa: E731
        return packed[0], f(packed[1]), f(packed[2]), f(packed[3])

    def logprobs(self, b: np.ndarray, i: np.ndarray, tokens: np.ndarray, k: int):
        """(logprob [m] float32, top ids [m, k] int32, top logprobs [m, k] float32) of `tokens`
        at rows (`b`, `i`) of this view, under softmax of their logits (temperature 1), with
        each distribution's k likeliest tokens (ties: the lower id)."""
        m = len(b)
        n = _bucket(m)
        request = np.zeros((3, n), np.int32)
        request[:, :m] = self._rows[np.asarray(b)], i, tokens
        packed = np.asarray(jax.device_get(_logprobs(self.array, request, k=int(k))))
        self._count(request.nbytes, packed.nbytes)
        packed = packed[:m]
        f = lambda x: np.ascontiguousarray(x).view(np.float32)  # noqa: E731
        return f(packed[:, 0]), packed[:, 1:1 + k].copy(), f(packed[:, 1 + k:])

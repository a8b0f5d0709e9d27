"""A step's rows' logits kept where the step ran, and the programs that turn them into what
the host runtime asks for (`runtime.step.DeviceLogits`).

Sampling, OpenAI's penalties and logit bias, and recorded log-probabilities need the rows'
whole distributions. Read back, that is B x R x V float32 per step (15.4 MiB at LLaDA-8B's
vocabulary and 32 rows), worked on in float64 by the host: 68-107 ms a step on a 2-core CPU
(`benchmarks/results/logits_host.md`) beside a GPU step of 8-11 ms. Here the same rules run
as small compiled programs beside the logits, and only their answers come back: [5, B, R]
int32 for a proposal, [m, 1 + 2k] for m slots' log-probabilities, [6, m] for ISD's judging
of m drafts (`runtime.step.JudgeAsk`: p and q at each draft, the token a rejection emits).

`DeviceLogits.answer` takes the asks (`runtime.step.ProposeAsk`, `LogprobsAsk`, `JudgeAsk`)
of every view of one step's logits at once: an engine's call of 16 requests, each its own
view and its own options, is one proposal program over the call's rows (each row's options
its own: temperature, top-k, top-p, penalties, bias) and one sync, not 16.

Each call needs a program of some shape and options (`_Variant`: rows, penalty and bias
widths, which of sampling / filter / penalties / bias it applies). Where that exact program has
not run in this process but one for the same rows with more options has, that one answers:
its extra options are off for these rows, so the answers are the same bits, and a call that
mixes requests whose programs were each built (their union warmed by `Engine.warmup`)
compiles nothing. Never one for more rows: XLA may reduce another count of rows in another
order (vectorized over the slots, XLA:CPU gave 19 of 256 log-probabilities other last bits
in programs for fewer than 16 slots). Log-probabilities likewise: one program for a call's
slots, with the largest k its asks want (each ask's k first of them).

On a CPU every program runs its rows one at a time (`_by_row`), so a row's answers are the
same bits whatever the call holds: an engine's requests answer alone and under load as its
steps do (`docs/engine.md`). Elsewhere the rows run vectorized, and the call's row count may
move their last bits, as a batch bucket moves a step's.

The rules are the host proposer's (`runtime.proposer`), in float32:
- adjustments: logit - frequency * c - presence * (c > 0) + bias, c the committed counts;
- sampling: Gumbel-max, argmax(z / T + g) over the tokens the top-k / top-p filter keeps
  (`sampling_keep`'s rule: ranked by logit, ties by the lower id), which draws from
  softmax(z / T) on that set as LLaDA's argmax(exp(z) / (-log u)^T) does. The noise of row
  b, predicted row r is `uniform(fold_in(key(seed_b), r), V)`, `seed_b` one 32-bit word the
  host draws from request b's own generator: a request's draws depend on its seed and its
  own steps, never on the bucket or the other rows of its call;
- confidences: the softmax probability (temperature 1) of the proposal, the runner-up's, the
  entropy;
- ISD's judging: p and q under the sampler's filter and temperature, as the proposals', q
  from the rows of the earlier step that proposed each draft; a rejection's token by inverse
  CDF over max(0, p - q) (or p without the draft) on one uniform of the draft's seed.

Axes: B batch rows (of the view), R predicted rows, V vocabulary, m slots (or drafts).
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.runtime import step

_TINY = float(np.finfo(np.float32).tiny)
# Top-p without top-k ranks each row's likeliest 1,024 tokens, and sorts the whole vocabulary
# only where their mass falls short of p (`_keep`).
TOP_P_CAP = 1024


def _bucket(n: int) -> int:
    """The power of two >= n (>= 1): shapes that vary per step compile a few programs."""
    return 1 << max(0, int(n) - 1).bit_length()


def _float_bits(x) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.int32)


def _host_floats(x) -> np.ndarray:
    """int32 answers read back -> the float32 they carry."""
    return np.ascontiguousarray(x).view(np.float32)


def _bits(x):
    """float32 -> int32 bits inside a program (its answers travel as one int32 array)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


class _Rows:
    """A proposal program's rows: which row of the step's logits each is (`rows` [B]) and its
    options; rows no ask names (padding) stay greedy and unadjusted, and are not read."""

    def __init__(self, b: int, g: int, nb: int, v: int):
        self.rows = np.zeros(b, np.int32)
        self.draw, self.seeds = np.zeros(b, np.int32), np.zeros(b, np.uint32)
        self.count_ids = np.full((b, g), v, np.int32)  # v: none (dropped)
        self.bias_ids, self.bias_vals = np.full((b, nb), v, np.int32), np.zeros((b, nb), np.float32)
        self.temperature, self.top_p = np.ones(b, np.float32), np.ones(b, np.float32)
        self.presence, self.frequency = np.zeros(b, np.float32), np.zeros(b, np.float32)
        self.top_k = np.zeros(b, np.int32)

    def set(self, ask: step.ProposeAsk, rows: slice, v: int) -> None:
        self.rows[rows] = ask.logits._rows
        self.draw[rows] = np.asarray(ask.draw, bool)
        self.seeds[rows] = np.asarray(ask.seeds, np.uint32)
        if _penalized(ask):
            ids = np.asarray(ask.count_ids)
            self.count_ids[rows, :ids.shape[1]] = np.where(ids >= 0, ids, v)
            self.presence[rows], self.frequency[rows] = ask.presence, ask.frequency
        if ask.bias:
            ids, vals = zip(*ask.bias)
            self.bias_ids[rows, :len(ids)], self.bias_vals[rows, :len(ids)] = ids, vals
        if ask.temperature > 0:  # (a greedy row's filter is never used: it stays off)
            self.temperature[rows] = ask.temperature
            self.top_p[rows], self.top_k[rows] = ask.top_p, ask.top_k

    def pack(self) -> np.ndarray:
        """One int32 vector (one transfer, as a step's `pack_request`), `_unpack_proposal`'s."""
        return np.concatenate([self.rows, self.draw, self.seeds.view(np.int32), self.count_ids.ravel(),
                               self.bias_ids.ravel(), _float_bits(self.bias_vals).ravel(),
                               _float_bits(self.temperature), _float_bits(self.top_p), _float_bits(self.presence),
                               _float_bits(self.frequency), self.top_k])


def _unpack_proposal(packed, b: int, g: int, nb: int):
    sizes = (b, b, b, b * g, b * nb, b * nb, b, b, b, b, b)
    cuts = np.cumsum((0,) + sizes)
    (rows, draw, seeds, count_ids, bias_ids, bias_vals, temperature, top_p, presence, frequency,
     top_k) = (packed[s:e] for s, e in zip(cuts, cuts[1:]))
    f = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
    return (rows, draw != 0, jax.lax.bitcast_convert_type(seeds, jnp.uint32), count_ids.reshape(b, g),
            bias_ids.reshape(b, nb), f(bias_vals).reshape(b, nb), f(temperature), f(top_p), f(presence),
            f(frequency), top_k)


def _penalized(ask: step.ProposeAsk | step.JudgeAsk) -> bool:
    return ask.count_ids is not None and (ask.presence != 0 or ask.frequency != 0)


class _Variant(NamedTuple):
    """A proposal program's shape and options (`_propose`'s static keywords)."""

    b: int  # rows
    g: int  # committed ids per row (penalties)
    nb: int  # bias entries per row
    sample: bool
    filtered: bool
    penalized: bool
    biased: bool
    cap: int | None  # the filter's ranking (`_keep`; any gives the same set)

    def covers(self, need: _Variant) -> bool:
        """Whether this program answers `need`'s rows with the same bits: as many rows (XLA
        may reduce rows of another count in another order: vectorized, XLA:CPU did, see
        `_by_row`), at least as many entries, and every option `need` applies (an option a
        row does not use is off for it: greedy rows take the argmax, zero penalties and
        dropped bias ids change nothing, an unfiltered row keeps every finite logit)."""
        return (self.b == need.b and self.g >= need.g and self.nb >= need.nb
                and all(h or not n for h, n in zip(self.options, need.options)))

    def excess(self, need: _Variant) -> tuple:
        """What answering `need` with this program costs beyond its own options."""
        return (sum(self.options) - sum(need.options), self.cap != need.cap, self.g + self.nb)

    @property
    def options(self) -> tuple[bool, bool, bool, bool]:
        return (self.sample, self.filtered, self.penalized, self.biased)


class _Ran:
    """The program variants that have run in this process, per kind and logits signature
    (shape, dtype, sharding: what else keys a compiled program), and the choice for a call:
    the exact one, else the cheapest that covers it, else the exact one (compiled)."""

    def __init__(self):
        self._ran: dict[tuple, set] = {}
        self._lock = threading.Lock()

    def choose(self, sig: tuple, need):
        with self._lock:
            ran = self._ran.get(sig, ())
            if need in ran:
                return need
            wider = [v for v in ran if v.covers(need)]
        return min(wider, key=lambda v: v.excess(need)) if wider else need

    def add(self, sig: tuple, variant) -> None:
        with self._lock:
            self._ran.setdefault(sig, set()).add(variant)


_RAN = _Ran()


def _signature(kind: str, array: jax.Array) -> tuple:
    return (kind, array.shape, array.dtype, array.sharding)


@functools.partial(jax.jit, static_argnames=("b", "g", "nb", "sample", "filtered", "penalized", "biased", "cap"))
def _propose(logits, packed, *, b: int, g: int, nb: int, sample: bool, filtered: bool, penalized: bool,
             biased: bool, cap: int | None = None):
    """[5, b, R] int32 (x0, the bits of top1, top2, entropy, then the argmax) for b rows of
    `logits` [B, R, V], each row with its own options (`_Rows`)."""
    columns = _unpack_proposal(packed, b, g, nb)
    return _by_row(functools.partial(_propose_rows, logits, sample=sample, filtered=filtered, penalized=penalized,
                                     biased=biased, cap=cap), columns).transpose(1, 0, 2)


def _by_row(fn, columns):
    """`fn(*columns)` over columns whose leading axis is a call's rows (slots, drafts), giving
    one array with that leading axis. On a CPU one row at a time (`lax.map`, each row through
    the same code whatever their count: XLA:CPU reduces [m, V] rows of another count m in
    another order, moving the last bits of a row's softmax, so a request's answers would
    depend on the rows it shares a call with, `Engine`'s batch invariance); elsewhere all at
    once (a loop of rows would launch kernels for each)."""
    if jax.default_backend() != "cpu":
        return fn(*columns)
    return jax.lax.map(lambda row: fn(*(c[None] for c in row))[0], columns)


def _adjusted(z, count_ids, presence, frequency, bias_ids, bias_vals, *, penalized: bool, biased: bool):
    """Logits z [b, R, V] after OpenAI's penalties and bias (`Proposer.adjusted`, in float32):
    each row's `bias_ids` [b, nb] raised by `bias_vals`, then its `count_ids` [b, G] (the ids
    its generation holds committed) counted and charged `frequency` [b] per time and
    `presence` [b] once; ids v (none) are dropped."""
    b, _, v = z.shape
    if biased:
        z = z.at[jnp.arange(b)[:, None], :, bias_ids].add(bias_vals[:, :, None], mode="drop")
    if penalized:
        counts = jnp.zeros((b, v), jnp.float32).at[jnp.arange(b)[:, None], count_ids].add(1.0, mode="drop")
        z = z - (frequency[:, None] * counts + presence[:, None] * (counts > 0))[:, None, :]
    return z


def _propose_rows(logits, rows, draw, seeds, count_ids, bias_ids, bias_vals, temperature, top_p, presence, frequency,
                  top_k, *, sample: bool, filtered: bool, penalized: bool, biased: bool, cap: int | None):
    """`_propose`'s answers [b, 5, R] for its b rows (`_by_row`)."""
    z = jnp.take(logits, rows, axis=0).astype(jnp.float32)  # [b, R, V]
    b, r, v = z.shape
    z = _adjusted(z, count_ids, presence, frequency, bias_ids, bias_vals, penalized=penalized, biased=biased)
    x0 = top = jnp.argmax(z, axis=-1)
    if sample:
        temperature = temperature[:, None, None]
        keep = (_keep(z, temperature, top_k[:, None, None], top_p[:, None, None], cap) if filtered
                else jnp.isfinite(z))

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
    return jnp.stack([x0.astype(jnp.int32), _bits(top1), _bits(top2), _bits(ent), top.astype(jnp.int32)], axis=1)


def _keep(z, temperature, top_k, top_p, cap: int | None = None):
    """[B, R, V] bool: the tokens the top-k (0: off) / top-p (1: off) filter keeps, as
    `runtime.proposer.sampling_keep` ranks them (by logit, ties by the lower id); the options
    broadcast against [B, R, V] (per row: [B, 1, 1]).

    `cap`: rank only each row's `cap` likeliest tokens (`lax.top_k`, the lower id first among
    equals: the same ranking), enough where top-k is at most `cap` or the top-p mass is reached
    within them. Where it is not, a row without top-k finds its top-p set by bisection
    (`_keep_top_p`), and a top-k past the cap sorts the call's whole rows (a `lax.cond` each:
    the rows pay for neither where none needs it). On a CPU a sort of 32 rows of 126,464 logits
    takes about a second, their 1,024 likeliest 20 ms. None: sort."""
    v = z.shape[-1]
    if cap is None or cap >= v:
        return _keep_sorted(z, temperature, top_k, top_p)
    mask, exact = _keep_ranked(z, temperature, top_k, top_p, cap)

    def past_the_cap():
        return jax.lax.cond(jnp.all(exact | (top_k == 0)),
                            lambda: jnp.where(exact, mask, _keep_top_p(z, temperature, top_p)),
                            lambda: _keep_sorted(z, temperature, top_k, top_p))

    return jax.lax.cond(jnp.all(exact), lambda: mask, past_the_cap)


def _order_key(x):
    """float32 -> int32 in the same order (an involution: it maps the keys back too)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _keep_top_p(z, temperature, top_p):
    """`_keep` for rows without top-k, without a sort: a token is kept where the mass of the
    tokens ranked above it is below p, which holds for every logit from the smallest value
    v* whose mass strictly above is below p; v* is found by bisection over the 2^32 float32
    values (32 passes over the row), then ties at the last kept logit are kept in id order
    while the mass before each stays below p. The same set as sorting but where float32
    sums taken in another order fall on the other side of p."""
    top_p = jnp.broadcast_to(top_p, z.shape[:-1] + (1,))
    finite = jnp.isfinite(z)
    t = jnp.where(finite, z / temperature, -jnp.inf)
    e = jnp.exp(t - jnp.max(t, -1, keepdims=True))
    q = e / e.sum(-1, keepdims=True)

    def above(v):  # [.., 1] mass of the tokens with a logit > v
        return jnp.sum(jnp.where(z > v, q, 0.0), -1, keepdims=True)

    lo = _order_key(jnp.min(jnp.where(finite, z, jnp.inf), -1, keepdims=True))
    hi = _order_key(jnp.max(z, -1, keepdims=True))  # (nothing above the top: always below p)

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # (no int32 overflow)
        below = above(jax.lax.bitcast_convert_type(_order_key(mid), jnp.float32)) < top_p
        return jnp.where(below, lo, mid + 1), jnp.where(below, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    floor = jax.lax.bitcast_convert_type(_order_key(lo), jnp.float32)
    last = jnp.min(jnp.where(z >= floor, z, jnp.inf), -1, keepdims=True)  # the last kept logit
    tied = z == last
    before = above(last) + (jnp.cumsum(tied, -1) - 1) * jnp.max(jnp.where(tied, q, 0.0), -1, keepdims=True)
    return finite & ((z > last) | (tied & (before < top_p)))


def _keep_ranked(z, temperature, top_k, top_p, cap: int):
    """(`_keep` from each row's `cap` likeliest tokens, [B, R, 1] whether that is exact)."""
    b, r, v = z.shape
    temperature, top_k, top_p = (jnp.broadcast_to(x, (b, r, 1)) for x in (temperature, top_k, top_p))
    ranked, ids = jax.lax.top_k(z, cap)  # [B, R, C]
    idx = jnp.arange(cap)
    keep = jnp.isfinite(ranked) & ((top_k == 0) | (idx < top_k))
    t = jnp.where(keep, ranked / temperature, -jnp.inf)
    e = jnp.exp(t - t[..., :1])
    # Normalised over what top-k keeps (within the cap), or over the whole row when it is off.
    everything = jnp.sum(jnp.where(jnp.isfinite(z), jnp.exp(z / temperature - t[..., :1]), 0.0), -1, keepdims=True)
    p = e / jnp.where(top_k > 0, e.sum(-1, keepdims=True), everything)
    mass = jnp.cumsum(p, axis=-1)
    keep = keep & ((top_p >= 1.0) | (mass - p < top_p))
    keep = keep.at[..., 0].set(True)
    # Exact where nothing past the cap could be kept or weighs in: top-k within it, or no top-k
    # and the top-p mass reached within it.
    exact = jnp.where(top_k > 0, top_k <= cap, (top_p >= 1.0) | (mass[..., -1:] >= top_p))
    n = keep.sum(-1, keepdims=True)  # a prefix of the ranking: the last kept sets the bar
    last = jnp.take_along_axis(ranked, n - 1, -1)
    last_id = jnp.take_along_axis(ids, n - 1, -1)
    col = jnp.arange(v)
    ranked_keep = (z > last) | ((z == last) & (col <= last_id))
    unfiltered = (top_k == 0) & (top_p >= 1.0)
    return jnp.isfinite(z) & (unfiltered | ranked_keep), exact


def _keep_sorted(z, temperature, top_k, top_p):
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
    """[m, 1 + 2k] int32: each slot's log-probability (bits), its k likeliest ids and theirs."""
    return _by_row(functools.partial(_logprobs_rows, logits, k=k), tuple(packed))  # [3, m]: b, i, token


def _logprobs_rows(logits, b, i, tokens, *, k: int):
    z = logits[b, i].astype(jnp.float32)  # [m, V]
    lse = jax.nn.logsumexp(z, axis=-1)
    lp = jnp.take_along_axis(z, tokens[:, None], -1)[:, 0] - lse
    if not k:
        return _bits(lp)[:, None]
    vals, ids = jax.lax.top_k(z, k)  # ties: the lower id first
    return jnp.concatenate([_bits(lp)[:, None], ids.astype(jnp.int32), _bits(vals - lse[:, None])], axis=1)


@jax.jit
def _gather_into(logits, rows, packed):
    """`rows` [m, V] with row j replaced by `logits`' row (b_j, i_j) where b_j >= 0 (packed
    [2, m]: b, i; -1: kept): the q rows of a call's drafts, gathered from the one or more
    earlier steps that proposed them."""
    b, i = packed
    got = logits[jnp.maximum(b, 0), i].astype(jnp.float32)
    return jnp.where((b >= 0)[:, None], got, rows)


@functools.partial(jax.jit, static_argnames=("m", "filtered", "cap", "g", "nb", "penalized", "biased"))
def _judge(p_logits, q_rows, packed, adjust, *, m: int, filtered: bool, cap: int | None = None, g: int = 1,
           nb: int = 1, penalized: bool = False, biased: bool = False):
    """[6, m] int32 (the bits of p(draft), q(draft), p1(draft), p1(anchor), q1(draft), then the
    residual's draw) for m drafts (`runtime.step.JudgeAsk`, packed by `_answer_judges`), their
    q rows [m, V] gathered (`_gather_into`); `adjust` (`_JudgeAdjust.pack`): each draft's
    penalties and bias, applied to p with the ids committed at this step, to q with those
    committed at the step that proposed it."""
    if not (penalized or biased):  # (none sent)
        adjust = jnp.zeros(2 * m * (g + 1 + nb), jnp.int32)
    cuts = np.cumsum((0, m * g, m * g, m, m, m * nb, m * nb))
    count_p, count_q, presence, frequency, bias_ids, bias_vals = (adjust[s:e] for s, e in zip(cuts, cuts[1:]))
    f = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
    columns = tuple(packed[j * m:(j + 1) * m] for j in range(9)) + (
        q_rows, count_p.reshape(m, g), count_q.reshape(m, g), f(presence), f(frequency), bias_ids.reshape(m, nb),
        f(bias_vals).reshape(m, nb))
    return _by_row(functools.partial(_judge_rows, p_logits, filtered=filtered, cap=cap, penalized=penalized,
                                     biased=biased), columns).T


def _judge_rows(p_logits, pb, pi, s, a, seeds, use_q, temperature, top_k, top_p, q_rows, count_p, count_q, presence,
                frequency, bias_ids, bias_vals, *, filtered: bool, cap: int | None, penalized: bool, biased: bool):
    """`_judge`'s answers [m, 6] for its m drafts (`_by_row`)."""
    seeds = jax.lax.bitcast_convert_type(seeds, jnp.uint32)
    temperature, top_p = (jax.lax.bitcast_convert_type(x, jnp.float32)[:, None, None] for x in (temperature, top_p))
    adjust = functools.partial(_adjusted, presence=presence, frequency=frequency, bias_ids=bias_ids,
                               bias_vals=bias_vals, penalized=penalized, biased=biased)
    zp = adjust(p_logits[pb, pi].astype(jnp.float32)[:, None, :], count_p)  # [m, 1, V]
    zq = adjust(q_rows[:, None, :], count_q)
    v = zp.shape[-1]

    def sampled(z):  # the sampler's distribution: softmax(z / T) over what its filter keeps
        keep = _keep(z, temperature, top_k[:, None, None], top_p, cap) if filtered else jnp.isfinite(z)
        return jax.nn.softmax(jnp.where(keep, z / temperature, -jnp.inf), axis=-1)[:, 0]

    def at(x, ids):
        return jnp.take_along_axis(x, ids[:, None], -1)[:, 0]

    p, q = sampled(zp), sampled(zq)
    p1, q1 = jax.nn.softmax(zp, axis=-1)[:, 0], jax.nn.softmax(zq, axis=-1)[:, 0]
    q_s = jnp.where(use_q != 0, at(q, s), 1.0)
    # A rejection draws from max(0, p - q) (drafts drawn from q), or from p without the draft
    # (one-hot q); from p where that leaves nothing.
    w = jnp.where(use_q[:, None] != 0, jnp.maximum(p - q, 0.0), jnp.where(jnp.arange(v) == s[:, None], 0.0, p))
    w = jnp.where(jnp.sum(w, -1, keepdims=True) > 0, w, p)
    # Inverse CDF on one uniform a draft: the first token whose cumulative weight passes it
    # (never past the last token of positive weight, where float32 sums fall short).
    u = jax.vmap(lambda seed: jax.random.uniform(jax.random.key(seed), (), jnp.float32))(seeds)
    cdf = jnp.cumsum(w, axis=-1)
    last = v - 1 - jnp.argmax((w > 0)[:, ::-1], axis=-1)
    drawn = jnp.minimum(jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1), last)
    return jnp.stack([_bits(at(p, s)), _bits(q_s), _bits(at(p1, s)), _bits(at(p1, a)), _bits(at(q1, s)),
                      drawn.astype(jnp.int32)], axis=1)


class DeviceLogits(step.DeviceLogits):
    """The rows' logits [B, R, V] float32 of a step, on the device that ran it
    (`runtime.step.DeviceLogits`). Indexing `[:, a:b]` (predicted rows a to b: the proposer's
    first k, the probes after them) and `rows(i)` (an engine's batch row) make views without a
    device op; `np.asarray` reads a view back whole (what any host rule without a device form
    gets)."""

    __slots__ = ("array", "_rows", "_cols", "_transfers")

    def __init__(self, array: jax.Array, rows: np.ndarray | None = None, cols: slice | None = None, transfers=None):
        self.array = array
        self._rows = np.arange(array.shape[0], dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
        # predicted rows [start, stop) of the step's
        self._cols = slice(0, array.shape[1]) if cols is None else slice(*cols.indices(array.shape[1])[:2])
        self._transfers = transfers  # the step's `Transfers`: what is sent and read back is counted there

    def _count(self, sent: int, got: int) -> None:
        if self._transfers is not None:
            self._transfers.more(sent, got)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self._rows), self._cols.stop - self._cols.start, self.array.shape[2])

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def __getitem__(self, index) -> DeviceLogits:
        if (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)
                and isinstance(index[1], slice) and index[1].step in (None, 1)):
            start, stop, _ = index[1].indices(self._cols.stop - self._cols.start)
            at = self._cols.start
            return DeviceLogits(self.array, self._rows, slice(at + start, at + max(start, stop)), self._transfers)
        return np.asarray(self)[index]

    def rows(self, index) -> DeviceLogits:
        """Batch rows `index` (a list) of this view."""
        return DeviceLogits(self.array, self._rows[np.asarray(index)], self._cols, self._transfers)

    def __array__(self, dtype=None, copy=None):
        host = np.asarray(jax.device_get(self.array[jnp.asarray(self._rows), self._cols]))
        self._count(self._rows.nbytes, host.nbytes)
        return host if dtype is None else host.astype(dtype)

    def propose(self, **options) -> tuple[np.ndarray, ...]:
        """`runtime.step.ProposeAsk`'s answer for this view (`answer` of one ask)."""
        return self.answer([step.ProposeAsk(self, **options)])[0]

    def logprobs(self, b: np.ndarray, i: np.ndarray, tokens: np.ndarray, k: int):
        """`runtime.step.LogprobsAsk`'s answer for this view (`answer` of one ask)."""
        return self.answer([step.LogprobsAsk(self, b, i, tokens, int(k))])[0]

    @classmethod
    def answer(cls, asks) -> list:
        """Each ask's answer, in order: one device call (one array sent, one read back) per
        kind and step, for every view of that step's logits it is asked about (views may share
        rows: each ask has program rows of its own)."""
        out: list = [None] * len(asks)
        calls: dict[tuple, list[int]] = {}  # (kind, the step's logits) -> its asks
        for j, ask in enumerate(asks):
            kind = _answer_logprobs
            if isinstance(ask, step.ProposeAsk):
                kind = _answer_proposals
            elif isinstance(ask, step.JudgeAsk):
                kind = _answer_judges
            calls.setdefault((kind, id(ask.logits.array)), []).append(j)
        for key, js in calls.items():
            for j, got in zip(js, key[0]([asks[j] for j in js])):
                out[j] = got
        return out


def _answer_proposals(asks: list[step.ProposeAsk]) -> list[tuple[np.ndarray, ...]]:
    """One `_propose` call for the asks on one step's logits: their views' rows one after the
    other, padded to a power of two (a few programs per step shape; padding rows cost what a
    row does, so not to the step's whole batch), in the program `_RAN` chooses."""
    first = asks[0].logits
    v = first.array.shape[2]
    variant = _RAN.choose(sig := _signature("propose", first.array), _needs(asks, v))
    rows, spans, at = _Rows(variant.b, variant.g, variant.nb, v), [], 0
    for ask in asks:
        spans.append(slice(at, at + len(ask.logits._rows)))
        rows.set(ask, spans[-1], v)
        at = spans[-1].stop
    request = rows.pack()
    packed = np.asarray(jax.device_get(_propose(first.array, request, **variant._asdict())))
    _RAN.add(sig, variant)
    first._count(request.nbytes, packed.nbytes)
    out = []
    for ask, span in zip(asks, spans):
        mine = packed[:, span, ask.logits._cols]
        out.append((mine[0].copy(), *(_host_floats(mine[j]) for j in (1, 2, 3)), mine[4].copy()))
    return out


def _needs(asks: list[step.ProposeAsk], v: int) -> _Variant:
    """The program `asks` need: their rows, the widest penalty and bias, the options any uses."""
    filtered = [a for a in asks if a.temperature > 0 and np.any(a.draw) and (a.top_k > 0 or a.top_p < 1.0)]
    return _Variant(b=_bucket(sum(len(a.logits._rows) for a in asks)),
                    g=_bucket(max((np.asarray(a.count_ids).shape[1] for a in asks if _penalized(a)), default=1)),
                    nb=_bucket(max(len(a.bias) for a in asks)),
                    sample=any(a.temperature > 0 and np.any(a.draw) for a in asks), filtered=bool(filtered),
                    penalized=any(map(_penalized, asks)), biased=any(bool(a.bias) for a in asks),
                    cap=_cap([a.top_k for a in filtered], v) if filtered else None)


def _cap(top_ks, v: int) -> int | None:
    """How many of each row's likeliest tokens the filter ranks (`_keep`), for the top-k of
    each filtered request (0: none): top-k's largest where every one sets it (nothing past it
    is kept), else at least `TOP_P_CAP`, past which a top-p row sorts its whole vocabulary;
    None: sort (a small one)."""
    k = _bucket(max(top_ks))
    cap = k if all(k > 0 for k in top_ks) else max(k, TOP_P_CAP)
    return cap if cap < v else None


class _Slots(NamedTuple):
    """A log-probabilities program's shape: slots, and the likeliest tokens each gives."""

    m: int
    k: int

    def covers(self, need: _Slots) -> bool:
        # As many slots (as `_Variant.covers`); a top-k's first j are the top-j (ties by id).
        return self.m == need.m and self.k >= need.k

    def excess(self, need: _Slots) -> tuple:
        return (self.k,)


class _Judges(NamedTuple):
    """A judging program's shape and options: drafts, whether a filter applies (its ranking),
    committed ids per draft and bias entries (`_judge`'s adjustments), whether penalties or a
    bias apply; `top_p`: whether a filtered draft sets top-p (a call's fact, not the
    program's: the program filters each draft by its own options)."""

    m: int
    filtered: bool
    cap: int | None
    g: int = 1
    nb: int = 1
    penalized: bool = False
    biased: bool = False
    top_p: bool = False

    def covers(self, need: _Judges) -> bool:
        """As many drafts (as `_Variant.covers`), the filter where `need` filters (an
        unfiltered draft keeps every finite logit under any ranking) with a ranking that keeps
        `need`'s sets bit for bit, at least as many ids and entries, and the adjustments `need`
        applies (zero penalties and dropped ids change no bit)."""
        return (self.m == need.m and (not need.filtered or (self.filtered and self._ranks_alike(need)))
                and self.g >= need.g and self.nb >= need.nb and (self.penalized or not need.penalized)
                and (self.biased or not need.biased))

    def _ranks_alike(self, need: _Judges) -> bool:
        """The same ranking, or, where no draft of `need` sets top-p, any that ranks at least its
        largest top-k (`_keep`): a top-k set is the k likeliest tokens, ties by the lower id,
        whether `lax.top_k` ranked k or more of them or the whole row was sorted. A top-p set is
        kept to its own ranking: its mass is summed over the ranked tokens, and float32 sums
        of another length may round to the other side of p."""
        if self.cap == need.cap:
            return True
        return not need.top_p and (self.cap is None or (need.cap is not None and self.cap >= need.cap))

    def excess(self, need: _Judges) -> tuple:
        return (self.filtered + self.penalized + self.biased, self.cap != need.cap, self.g + self.nb)


class _JudgeAdjust:
    """The drafts' penalties and bias for `_judge` (`_Judges.penalized` / `biased`): committed
    ids for p and for q [m, g] (v: none), presence and frequency [m], bias ids and values
    [m, nb]; padding drafts and asks without them change nothing."""

    def __init__(self, m: int, g: int, nb: int, v: int):
        self.count_p, self.count_q = np.full((m, g), v, np.int32), np.full((m, g), v, np.int32)
        self.presence, self.frequency = np.zeros(m, np.float32), np.zeros(m, np.float32)
        self.bias_ids, self.bias_vals = np.full((m, nb), v, np.int32), np.zeros((m, nb), np.float32)

    def set(self, ask: step.JudgeAsk, rows: slice, v: int) -> None:
        if _penalized(ask):
            for ids, into in ((ask.count_ids, self.count_p), (ask.q_count_ids, self.count_q)):
                if ids is not None:
                    ids = np.asarray(ids)
                    into[rows, :ids.shape[1]] = np.where(ids >= 0, ids, v)
            self.presence[rows], self.frequency[rows] = ask.presence, ask.frequency
        if ask.bias:
            ids, vals = zip(*ask.bias)
            self.bias_ids[rows, :len(ids)], self.bias_vals[rows, :len(ids)] = ids, vals

    def pack(self) -> np.ndarray:
        return np.concatenate([self.count_p.ravel(), self.count_q.ravel(), _float_bits(self.presence),
                               _float_bits(self.frequency), self.bias_ids.ravel(), _float_bits(self.bias_vals).ravel()])


def _id_width(ask: step.JudgeAsk) -> int:
    return max(np.shape(ids)[1] for ids in (ask.count_ids, ask.q_count_ids) if ids is not None)


def _answer_judges(asks: list[step.JudgeAsk]) -> list[tuple[np.ndarray, ...]]:
    """One `_judge` call for the drafts of all asks on one step's logits, padded to a power of
    two, in the program `_RAN` chooses, after one `_gather_into` of their q rows per earlier
    step they come from (requests of one call may have drafted in calls of other batch sizes:
    gathered apart, the judging program depends on this step's shape alone)."""
    first = asks[0].logits
    counts = [len(a.tokens) for a in asks]
    m = sum(counts)
    t = np.concatenate([np.asarray(a.temperature, np.float32) for a in asks])
    top_k = np.concatenate([np.asarray(a.top_k, np.int32) for a in asks])
    top_p = np.concatenate([np.asarray(a.top_p, np.float32) for a in asks])
    filtered = (t > 0) & ((top_k > 0) | (top_p < 1))
    v = first.array.shape[2]
    sig = _signature("judge", first.array)
    penalized = [a for a in asks if _penalized(a)]
    judges = _RAN.choose(sig, _Judges(_bucket(m), bool(filtered.any()),
                                      _cap(top_k[filtered].tolist(), v) if filtered.any() else None,
                                      g=_bucket(max(map(_id_width, penalized), default=1)),
                                      nb=_bucket(max(len(a.bias) for a in asks)), penalized=bool(penalized),
                                      biased=any(bool(a.bias) for a in asks), top_p=bool((top_p[filtered] < 1).any())))
    adjust = _JudgeAdjust(judges.m, judges.g, judges.nb, v)
    columns = np.zeros((9, judges.m), np.int32)
    columns[6] = _float_bits(np.ones(judges.m, np.float32))  # (padding: temperature 1, no filter)
    columns[8] = columns[6]
    q_rows = jnp.zeros((judges.m, v), jnp.float32)
    sent = 0
    if m:
        cat = lambda f: np.concatenate([np.asarray(f(a)) for a in asks])  # noqa: E731
        columns[:, :m] = (
            cat(lambda a: a.logits._rows[np.asarray(a.b, np.int64)]),
            cat(lambda a: np.asarray(a.i) + a.logits._cols.start),
            cat(lambda a: a.tokens), cat(lambda a: a.anchors),
            cat(lambda a: np.asarray(a.seeds, np.uint32).view(np.int32)),
            cat(lambda a: np.asarray(a.use_q, bool) & (a.q is not None)),
            _float_bits(np.where(t > 0, t, 1.0)), np.where(t > 0, top_k, 0), _float_bits(np.where(t > 0, top_p, 1.0)))
        gathers: dict[int, tuple[jax.Array, np.ndarray]] = {}  # an earlier step's logits -> their rows' places
        for a, at in zip(asks, np.cumsum([0] + counts)):
            adjust.set(a, slice(at, at + len(a.tokens)), v)
            if a.q is not None:
                array, where = gathers.setdefault(id(a.q.array), (a.q.array, np.full((2, judges.m), -1, np.int32)))
                where[:, at:at + len(a.tokens)] = (a.q._rows[np.asarray(a.qb, np.int64)],
                                                   np.asarray(a.qi) + a.q._cols.start)
        for array, where in gathers.values():
            q_rows = _gather_into(array, q_rows, where)
            sent += where.nbytes
    request = columns.ravel()
    adjustments = adjust.pack() if judges.penalized or judges.biased else np.zeros(0, np.int32)
    program = {k: x for k, x in judges._asdict().items() if k != "top_p"}  # (the call's, not a program's)
    packed = np.asarray(jax.device_get(_judge(first.array, q_rows, request, adjustments, **program)))
    _RAN.add(sig, judges)
    first._count(request.nbytes + adjustments.nbytes + sent, packed.nbytes)
    out, at = [], 0
    for n in counts:
        mine = packed[:, at:at + n]
        at += n
        out.append((*(_host_floats(mine[j]) for j in range(5)), mine[5].copy()))
    return out


def _answer_logprobs(asks: list[step.LogprobsAsk]) -> list[tuple[np.ndarray, ...]]:
    """One `_logprobs` call for the slots of all asks on one step's logits, with the largest
    k any asks for (or more, in a program that covers it), each ask's answer cut to its own k."""
    first = asks[0].logits
    counts = [len(a.b) for a in asks]
    m = sum(counts)
    top = max(int(a.k) for a in asks)
    slots = _RAN.choose(sig := _signature("logprobs", first.array), _Slots(_bucket(m), top))
    k = slots.k
    request = np.zeros((3, slots.m), np.int32)
    if m:
        request[:, :m] = (np.concatenate([a.logits._rows[np.asarray(a.b, np.int64)] for a in asks]),
                          np.concatenate([np.asarray(a.i) + a.logits._cols.start for a in asks]),
                          np.concatenate([np.asarray(a.tokens) for a in asks]))
    packed = np.asarray(jax.device_get(_logprobs(first.array, request, k=k)))
    _RAN.add(sig, slots)
    first._count(request.nbytes, packed.nbytes)
    out, at = [], 0
    for ask, n in zip(asks, counts):
        mine, j = packed[at:at + n], int(ask.k)
        at += n
        out.append((_host_floats(mine[:, 0]), mine[:, 1:1 + j].copy(), _host_floats(mine[:, 1 + k:1 + k + j])))
    return out

"""The proposer: a step's outputs -> a proposed token and a confidence per predicted slot
(NumPy only).

Greedy decoding takes the program's argmax and its probability. Sampling (temperature > 0)
draws LLaDA's float64 Gumbel-max from the rows' logits, each request from its own generator,
and only while the request has candidates, so batching never changes a request's samples.
Confidences are the top-1 probability (`prob`), top-1 minus top-2 (`margin`) or minus the
entropy (`entropy`); `remasking="random"` ranks by uniform noise instead (LLaDA); `defer_eos`
drops EOS proposals to the lowest confidence so they commit last (LLaDA's
`confidence_eos_eot_inf`).

Axes: B batch rows, R predicted rows of the step, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import numpy as np

from dlm_jax._errors import ConfigError
from dlm_jax.runtime.state import DecodeState
from dlm_jax.runtime.step import ProposeAsk, StepOutputs, answer, is_device_logits

REMASKING: tuple[str, ...] = ("low_confidence", "random")
CONFIDENCE_KINDS: tuple[str, ...] = ("prob", "margin", "entropy")
# Where the rules that need the rows' whole logits run (sampling, penalties, logit bias,
# recorded log-probabilities): `host` (float64 NumPy, LLaDA's generator), `device` (float32
# beside the step, only small answers read back: the executor must keep logits,
# `Capabilities.logits_on`), `auto` (device where the executor keeps them on a GPU or TPU).
LOGITS_ON: tuple[str, ...] = ("auto", "host", "device")
MAX_LOGPROBS = 20  # alternatives per token `Proposer.logprobs` may ask for (OpenAI's top_logprobs bound)


def confidence_scores(
    kind: str,
    top1_prob: np.ndarray,
    top2_prob: np.ndarray | None = None,
    entropy: np.ndarray | None = None,
) -> np.ndarray:
    """Score each position from the model's distribution there; higher = more confident.

    Args:
      kind: `prob` (LLaDA / Fast-dLLM: the top-1 probability), `margin` (Dream's
        `topk_margin`: top-1 minus top-2 probability) or `entropy` (Dream's `entropy`:
        minus the entropy of the distribution).
      top1_prob: [B, W] float, the probability of the most likely token.
      top2_prob: [B, W] float, the probability of the second most likely token (needed for
        `margin` only).
      entropy: [B, W] float, the entropy (nats) of the distribution (needed for `entropy` only).

    Returns:
      [B, W] float64 confidence. `prob` and `margin` lie in [0, 1] for valid inputs;
      `entropy` scores are <= 0.

    Raises:
      ConfigError: `kind` is not one of `CONFIDENCE_KINDS`.
      ValueError: an array the kind needs is missing, or the shapes differ.
    """
    if kind not in CONFIDENCE_KINDS:
        raise ConfigError(f"confidence kind={kind!r} is not one of {CONFIDENCE_KINDS}")
    top1 = np.asarray(top1_prob, dtype=np.float64)
    return _CONFIDENCE[kind](top1, top2_prob, entropy)


def _operand(name: str, kind: str, x: np.ndarray | None, top1: np.ndarray) -> np.ndarray:
    if x is None:
        raise ValueError(f"confidence kind={kind!r} needs {name}")
    x = np.asarray(x, dtype=np.float64)
    if x.shape != top1.shape:
        raise ValueError(f"{name} shape {x.shape} != top1_prob shape {top1.shape}")
    return x


_CONFIDENCE = {  # kind -> (top1, top2, entropy) -> confidence
    "prob": lambda top1, top2, ent: top1.copy(),
    "margin": lambda top1, top2, ent: top1 - _operand("top2_prob", "margin", top2, top1),
    "entropy": lambda top1, top2, ent: -_operand("entropy", "entropy", ent, top1),
}
# The lowest score a proposal can have, by kind and vocabulary size (deferred EOS).
_FLOOR = {"prob": lambda vocab: 0.0, "margin": lambda vocab: 0.0, "entropy": lambda vocab: -math.log(vocab)}


class Proposal(NamedTuple):
    tokens: np.ndarray  # [B, R] int32
    confidence: np.ndarray  # [B, R] float64
    # [B, R, V], the rows' logits when the step returned them: on the host, after the penalties
    # and bias; kept on the device (`DeviceLogits`), as the step left them (the program that
    # proposed applied the adjustments inside)
    logits: np.ndarray | None = None
    sampler: Proposer | None = None  # who drew `tokens` (temperature, top-k, top-p)
    # [B, R] int32 the argmax of the adjusted logits, where sampling drew `tokens` beside the
    # step (an argmax draft needs it, ISD; on the host: `logits.argmax(-1)`)
    argmax: np.ndarray | None = None


def sampling_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution a sampler draws from, float64 [..., V]: softmax(logits / temperature)
    restricted to the `top_k` most likely tokens (0: all), then to the smallest set of the most
    likely whose mass reaches `top_p` (1: all), renormalised; one-hot at the argmax for
    temperature 0. Ties rank by the lower token id. This is the filter `Proposer` samples from
    (left-to-right and ISD alike)."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        out = np.zeros(logits.shape)
        np.put_along_axis(out, logits.argmax(-1)[..., None], 1.0, axis=-1)
        return out
    keep = sampling_keep(logits, temperature, top_k, top_p)
    z = np.where(keep, logits / temperature, -np.inf)
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def sampling_keep(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """[..., V] bool, the tokens the top-k / top-p filter keeps (all where both are off)."""
    logits = np.asarray(logits, np.float64)
    finite = np.isfinite(logits)
    if not top_k and top_p >= 1.0:
        return finite
    order = np.argsort(-logits, axis=-1, kind="stable")  # most likely first, ties by lower id
    ranked = np.take_along_axis(logits, order, -1)
    keep = np.isfinite(ranked)
    if top_k:
        keep[..., top_k:] = False
    if top_p < 1.0:
        z = np.where(keep, ranked / temperature, -np.inf)
        z = np.exp(z - z[..., :1])
        mass = np.cumsum(z / z.sum(-1, keepdims=True), axis=-1)
        before = mass - z / z.sum(-1, keepdims=True)  # the mass ranked above each token
        keep &= before < top_p
        keep[..., 0] = True
    out = np.zeros(logits.shape, bool)
    np.put_along_axis(out, order, keep, axis=-1)
    return out & finite


@dataclasses.dataclass(frozen=True)
class Proposer:
    temperature: float = dataclasses.field(
        default=0.0, metadata={"help": "0 = greedy; > 0 = float64 Gumbel-max sampling (LLaDA)"})
    confidence: str = dataclasses.field(
        default="prob", metadata={"help": "what rules rank by", "choices": CONFIDENCE_KINDS})
    remasking: str = dataclasses.field(
        default="low_confidence", metadata={"help": "rank by confidence, or by uniform noise (LLaDA)",
                                            "choices": REMASKING})
    defer_eos: bool = dataclasses.field(
        default=False, metadata={"help": "EOS proposals get the lowest confidence (commit last)"})
    seed: int = dataclasses.field(default=0, metadata={"help": "sampling / random-remasking seed per request"})
    top_k: int = dataclasses.field(default=0, metadata={"help": "sample among the k most likely tokens (0: all)"})
    top_p: float = dataclasses.field(
        default=1.0, metadata={"help": "sample among the most likely tokens holding this mass (1: all)"})
    presence_penalty: float = dataclasses.field(
        default=0.0, metadata={"help": "subtracted from the logit of every token the completion holds already "
                                       "(committed so far; -2 to 2, OpenAI's)"})
    frequency_penalty: float = dataclasses.field(
        default=0.0, metadata={"help": "subtracted from a token's logit once per time the completion holds it already "
                                       "(-2 to 2, OpenAI's)"})
    logit_bias: tuple[tuple[int, float], ...] = dataclasses.field(
        default=(), metadata={"option": False})  # (token id, bias) pairs added to the logits (-100 to 100 each)
    logprobs: int = dataclasses.field(
        default=-1, metadata={"help": "record each generated token's log-probability at the step that decided it, "
                                      f"with this many likeliest alternatives (0-{MAX_LOGPROBS}; -1: off)"})
    logits_on: str = dataclasses.field(
        default="auto", metadata={"help": "where sampling, penalties, logit bias and logprobs run: host (float64, "
                                          "LLaDA's generator), device (beside the step; only the answers are "
                                          "read back), auto (device on a GPU or TPU)", "choices": LOGITS_ON})

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"temperature={t!r} must be a finite number >= 0")
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be an integer >= 0")
        if self.confidence not in CONFIDENCE_KINDS:
            raise ConfigError(f"confidence={self.confidence!r} is not one of {CONFIDENCE_KINDS}")
        if self.logits_on not in LOGITS_ON:
            raise ConfigError(f"logits_on={self.logits_on!r} is not one of {LOGITS_ON}")
        if self.remasking not in REMASKING:
            raise ConfigError(f"remasking={self.remasking!r} is not one of {REMASKING}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k!r} must be an integer >= 0 (0: off)")
        p = self.top_p
        if not isinstance(p, numbers.Real) or isinstance(p, bool) or not 0 < p <= 1:
            raise ConfigError(f"top_p={p!r} must be in (0, 1] (1: off)")
        k = self.logprobs
        if not isinstance(k, numbers.Integral) or isinstance(k, bool) or not -1 <= k <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs={k!r} must be an integer from -1 (off) to {MAX_LOGPROBS}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not -2 <= v <= 2:
                raise ConfigError(f"{name}={v!r} must be a number from -2 to 2")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], numbers.Integral)
                    and not isinstance(pair[0], bool) and pair[0] >= 0 and isinstance(pair[1], numbers.Real)
                    and not isinstance(pair[1], bool) and -100 <= pair[1] <= 100):
                raise ConfigError(f"logit_bias entry {pair!r} must be (token id >= 0, bias from -100 to 100)")

    @property
    def needs_logits(self) -> bool:
        return self.temperature > 0 or self.logprobs >= 0 or self.adjusts

    @property
    def adjusts(self) -> bool:
        """Whether proposals come from the logits changed by penalties or a bias (on the host)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def adjusted(self, logits: np.ndarray, state: DecodeState) -> np.ndarray:
        """The rows' logits [B, R, V] (float64) after OpenAI's penalties and `logit_bias`:
        logit[v] - frequency_penalty * c[v] - presence_penalty * (c[v] > 0) + bias[v], c[v] the
        times the request's generation holds v among its committed (visible or final) tokens."""
        z = np.asarray(logits, np.float64).copy()
        if self.logit_bias:
            ids, bias = zip(*self.logit_bias)
            np.add.at(z, (slice(None), slice(None), np.asarray(ids)), np.asarray(bias, np.float64))
        if self.presence_penalty or self.frequency_penalty:
            counts = state.committed_counts(z.shape[-1])  # [B, V]
            z -= (self.frequency_penalty * counts + self.presence_penalty * (counts > 0))[:, None, :]
        return z

    def ask(self, out: StepOutputs, candidates: np.ndarray, state: DecodeState) -> ProposeAsk | None:
        """What `propose` needs computed beside the step, when the step kept its logits there
        (`DeviceLogits`) and sampling, a penalty or a bias needs them, for the decode's driver
        to answer (`runtime.step.answer`; an engine answers a call's requests together); None
        otherwise. Each sampling row's noise is one 32-bit seed drawn now from its request's
        own generator, only while it has candidates: ask once per step, then `propose` with
        the answer."""
        if not (is_device_logits(out.logits) and (self.adjusts or self.temperature > 0)):
            return None
        b = candidates.shape[0]
        draw, seeds = np.zeros(b, bool), np.zeros(b, np.uint32)
        if self.temperature > 0:
            for r, rng in enumerate(state.rngs):
                if rng is not None and candidates[r].any():
                    draw[r], seeds[r] = True, rng.integers(0, 2 ** 32, dtype=np.uint32)
        return ProposeAsk(out.logits[:, :candidates.shape[1]], draw, seeds, temperature=self.temperature,
                          top_k=self.top_k, top_p=self.top_p, **self._adjustments(state))

    def _adjustments(self, state: DecodeState) -> dict:
        """A `ProposeAsk`'s fields for this proposer's penalties and bias."""
        penalized = bool(self.presence_penalty or self.frequency_penalty)
        return dict(count_ids=state.committed_ids() if penalized else None, presence=self.presence_penalty,
                    frequency=self.frequency_penalty, bias=self.logit_bias)

    def propose(self, out: StepOutputs, candidates: np.ndarray, state: DecodeState,
                answered: tuple[np.ndarray, ...] | None = None) -> Proposal:
        """Tokens and confidences [B, R] for the step's R predicted rows (`candidates` [B, R]:
        the rows a rule may commit; only they draw noise). `answered`: the answer to this
        step's `ask` (None: asked and answered here when the step needs one)."""
        k = candidates.shape[1]
        logits = out.logits[:, :k] if out.logits is not None else None
        argmax = None
        if is_device_logits(logits) and (self.adjusts or self.temperature > 0):
            if answered is None:
                answered = answer([self.ask(out, candidates, state)])[0]
            x0, top1, top2, ent, argmax = answered
        else:
            if self.adjusts:
                logits = self.adjusted(logits, state)
            if self.temperature > 0:
                x0, top1, top2, ent = _sample(logits, candidates, self.temperature, state.rngs, self.top_k, self.top_p)
            elif self.adjusts:
                x0 = logits.argmax(-1)
                top1, top2, ent = _scores(logits, x0)
            else:
                x0, top1, top2, ent = (out.top_token[:, :k], out.top_prob[:, :k], out.second_prob[:, :k],
                                       out.entropy[:, :k])
        conf = confidence_scores(self.confidence, top1.astype(np.float64), top2.astype(np.float64),
                                 ent.astype(np.float64))
        if self.remasking == "random":
            conf = np.zeros_like(conf)
            for r, rng in enumerate(state.rngs):
                if rng is not None and candidates[r].any():
                    conf[r] = rng.random(k)
        if self.defer_eos and state.eos_ids:
            # The lowest score a proposal can have: 0, or minus the largest entropy, log V.
            floor = _FLOOR[self.confidence](state.vocab_size)
            conf = np.where(state.is_eos(x0), floor, conf)
        return Proposal(x0.astype(np.int32), conf, logits, self, argmax)


def predicted(proposer: Proposer, logits, state: DecodeState,
              answered: tuple[np.ndarray, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(argmax int32, its probability float64) [B, n] of rows' logits [B, n, V] after the
    proposer's penalties and bias: the predictions a revision compares tokens against (DPPR's
    probes and refresh), so that it never brings back a token the adjustments ruled out. Logits
    kept on the device are worked on there: `answered` is the answer to `predict_ask` (None:
    asked and answered here)."""
    if is_device_logits(logits):
        if answered is None:
            answered = answer([predict_ask(proposer, logits, state)])[0]
        return answered[0].astype(np.int32), answered[1].astype(np.float64)
    z = proposer.adjusted(logits, state)
    top = z.argmax(-1)
    return top.astype(np.int32), _scores(z, top)[0]


def predict_ask(proposer: Proposer, logits, state: DecodeState) -> ProposeAsk | None:
    """What `predicted` needs computed beside the step, for the decode's driver to answer; None
    for logits on the host."""
    if not is_device_logits(logits):
        return None
    b = logits.shape[0]
    return ProposeAsk(logits, np.zeros(b, bool), np.zeros(b, np.uint32), **proposer._adjustments(state))


def _sample(logits: np.ndarray, cand: np.ndarray, temperature: float, rngs: list, top_k: int = 0,
            top_p: float = 1.0):
    """LLaDA's Gumbel-max in float64: x0 = argmax(exp(logits) / (-log u)^T), confidence = the
    softmax probability of x0. Noise is drawn per request from its own generator, only while
    it has candidates. With top-k / top-p, tokens outside the filter (`sampling_keep`) are never
    drawn."""
    logits = logits.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x0 = logits.argmax(-1)
    drawn = logits if not top_k and top_p >= 1.0 else np.where(sampling_keep(logits, temperature, top_k, top_p),
                                                               logits, -np.inf)
    for r, rng in enumerate(rngs):
        if rng is not None and cand[r].any():
            gumbel = (-np.log(rng.random(logits[r].shape))) ** temperature
            x0[r] = np.argmax(np.exp(drawn[r]) / gumbel, axis=-1)
    return (x0, *_scores(logits, x0, probs))


def _scores(logits: np.ndarray, x0: np.ndarray, probs: np.ndarray | None = None):
    """(softmax probability of `x0`, the runner-up's, the entropy) of float64 `logits`."""
    if probs is None:
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
    top1 = np.take_along_axis(probs, x0[..., None], -1)[..., 0]
    top2 = np.partition(probs, -2, axis=-1)[..., -2]  # (the runner-up: O(V), not a sort)
    ent = -(probs * np.log(np.maximum(probs, 1e-300))).sum(-1)
    return top1, top2, ent

"""`Engine`: continuous batching over a `Model`, in text (the NumPy engine of
`dlm_jax.runtime.engine` with the model's tokenizer, chat template and stop strings).

    engine = dlm_jax.Engine(model, dlm_jax.preset("fast-dllm", gen_len=64), max_batch=8)
    handle = engine.submit("564+894=", {"threshold": 0.8}, stop=["\\n"])
    for text in handle.stream():   # committed text as it becomes final
        print(text, end="")
    completion = handle.result()   # text, token ids, status, its own stats

Requests may be submitted at any time, from any thread; each decodes with its own options
(flat decode options over the engine's config, or a `DecodeConfig`) and its tokens do not
depend on what else the engine runs ([docs/engine.md](../docs/engine.md)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dlm_jax._errors import InputError
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.engine import Engine as _Core
from dlm_jax.runtime.engine import Request, RequestStats
from dlm_jax.runtime.state import TokenLogprobs

if TYPE_CHECKING:
    from dlm_jax._model import Model, Prompt


@dataclasses.dataclass
class Completion:
    text: str | None  # None without a tokenizer
    token_ids: list[int]  # up to the first EOS (or the stop string)
    status: str  # done, stopped (a stop string), cancelled
    stats: RequestStats
    logprobs: TokenLogprobs | None = None  # token_ids' log-probabilities (decode option `logprobs`)


class TextStream:
    """A request's completion text as it becomes final: `update(ids)` returns the new piece
    (the pieces join to the completion's text). Held back until they are sure: a trailing
    incomplete UTF-8 character, and a tail that may be the start of a stop string. The ids are
    cut at the first EOS and at `limit` tokens."""

    def __init__(self, model: Model, stops: Sequence[str] = (), limit: int | None = None):
        self.model, self.stops, self.limit = model, list(stops), limit
        self.eos = set(model.config.eos_ids)
        self.shown = ""

    def ids(self, final: Sequence[int]) -> list[int]:
        ids = [int(t) for t in (final if self.limit is None else final[:self.limit])]
        return ids[:_eos_cut(ids, self.eos)]

    def text(self, final: Sequence[int]) -> str:
        """The completion's text if `final` were all of it (token ids, space-separated, for a
        model without a tokenizer), cut before the first stop string."""
        ids = self.ids(final)
        if not self.model.has_tokenizer:
            return " ".join(map(str, ids))
        text = self.model.tokenizer.decode(ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return text[:min(hits)] if hits else text

    def update(self, final: Sequence[int], *, end: bool = False) -> str:
        """The text newly final since the last call: `final` the ids final so far (`end`: the
        completion's own ids, once it has ended)."""
        text = self.text(final)
        if not end:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character (byte-level tokenizers)
            held = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                       default=0)
            text = text[:len(text) - held]
        if not text.startswith(self.shown) or len(text) <= len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece


class Handle:
    """One submitted request (`Engine.submit`)."""

    def __init__(self, model: Model, request: Request, stops: Sequence[str]):
        self.model = model
        self.request = request
        self.stops = tuple(stops)

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def done(self) -> bool:
        return self.request.done

    def cancel(self) -> None:
        """Stop decoding it; its row is free for the next request from the engine's next step."""
        self.request.cancel()

    def stream(self) -> Iterator[str]:
        """Its completion's text as it becomes final (a commit unit at a time, or a token at a
        time where the schedule commits one per step); the pieces join to `result().text`.
        Token ids, space-separated, for a model without a tokenizer."""
        text = TextStream(self.model, self.stops)
        for event in self.request.events():
            if event.end is not None and self.request.status == "failed":
                raise self.request.error
            piece = text.update(self.request.tokens() if event.end is not None else self.request.final,
                                end=event.end is not None)
            if piece:
                yield piece

    def result(self, timeout: float | None = None) -> Completion:
        """Its completion once it has ended (raises a failed request's error)."""
        ids = [int(t) for t in self.request.result(timeout)]
        text = TextStream(self.model, self.stops).text(ids) if self.model.has_tokenizer else None
        return Completion(text, ids, self.request.status, self.request.stats, self.request.logprobs())


def _eos_cut(ids: list[int], eos_ids: Sequence[int]) -> int:
    eos = set(eos_ids)
    return next((i for i, t in enumerate(ids) if t in eos), len(ids))


class Engine:
    """Continuous batching over `model` (`dlm_jax.load(...)`): `submit` requests at any time;
    between steps the engine admits waiting requests into free batch rows and retires finished
    ones. `config` is the decode every request starts from (default `DecodeConfig()`);
    `max_batch` the most requests decoding at once (default: the largest batch bucket whose
    K/V fit, `dlm_jax.runtime.engine.POOL_BYTES`); `max_tokens` the longest prompt +
    generation a request may have (default the model's limit); `max_waiting` bounds the queue;
    `padding` how a group of steps that fills no batch bucket runs ("pad", "split" or "free";
    default the executor's).

    Without `start()`, handles drive the engine from the caller's thread while they wait;
    with it, a background thread does."""

    def __init__(self, model: Model, config: DecodeConfig | None = None, *, max_batch: int | None = None,
                 max_tokens: int | None = None, max_waiting: int | None = None, padding: str | None = None):
        self.model = model
        self.config = config or DecodeConfig()
        self.core = _Core(model.decoder, max_batch=max_batch, max_tokens=max_tokens, max_waiting=max_waiting,
                          padding=padding)

    @property
    def max_batch(self) -> int:
        return self.core.max_batch

    @property
    def stats(self):
        return self.core.stats

    def options(self, options: DecodeConfig | Mapping[str, Any] | None) -> DecodeConfig:
        """A request's `DecodeConfig`: the engine's, with flat decode `options` changed
        (`{"threshold": 0.8, "gen_len": 32}`; `"preset"` picks another base), or one given whole."""
        if options is None:
            return self.config
        if isinstance(options, DecodeConfig):
            return options
        from dlm_jax.runtime.registry import decode_config, preset

        options = dict(options)
        name = options.pop("preset", None)
        return preset(name, **options) if name is not None else decode_config(self.config, **options)

    def submit(self, prompt: Prompt, options: DecodeConfig | Mapping[str, Any] | None = None, *,
               seed: int | None = None, chat: bool | None = None, stop: Sequence[str] = (),
               suffix: Prompt | None = None) -> Handle:
        """Queue a request; returns its handle at once. `chat`: as in `Model.generate`; `stop`:
        strings that end the completion (not included); `suffix`: text (as it is) or token ids
        that follow the completion, which is decoded between the prompt and it (infilling, as
        `Model.generate`'s `suffixes`). A request the engine cannot serve (too long, options the
        model or executor cannot run, a full queue) is refused here, with one line naming the
        limit."""
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise InputError(f"stop must be a list of non-empty strings, got {stop!r}")
        if stop and not self.model.has_tokenizer:
            raise InputError("stop strings need a tokenizer; this model has none")
        ids = self.model.encode(prompt, chat=chat)
        rule = _stop_rule(self.model, tuple(stop)) if stop else None
        config = self.options(options)
        tail = None if suffix is None else self.model._suffixes(suffix, 1)[0]
        if config.placement.probe() is not None:  # TIDE's tau='auto' / static sets: from this prompt's probe
            self.model.decoder.check_prompts([ids], None)
            config = self.model.calibrated(config, [ids], seeds=None if seed is None else [seed],
                                           suffixes=None if tail is None else [tail])
        return Handle(self.model, self.core.submit(ids, config, seed=seed, stop=rule, suffix=tail), stop)

    def warmup(self, configs: Sequence[DecodeConfig | Mapping[str, Any]] | None = None, *,
               prompt_lens: Sequence[int] | None = None) -> int:
        """Build, before the first request, every program requests decoded with `configs`
        (options as `submit` takes them; default the engine's config) reach for prompts of
        `prompt_lens` tokens (default every length that fits a row), so that none of them waits
        for a compile (`dlm_jax.runtime.engine.Engine.warmup`). Returns how many were new."""
        configs = [self.config] if configs is None else [self.options(c) for c in configs]
        return self.core.warmup(configs, prompt_lens=prompt_lens)

    def step(self) -> bool:
        return self.core.step()

    def run(self) -> None:
        """Decode until every submitted request has ended."""
        self.core.run()

    def start(self) -> None:
        """Run the engine on a background thread until `close`."""
        self.core.start()

    def close(self) -> None:
        self.core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop_rule(model: Model, stops: tuple[str, ...]):
    """A stop rule for the engine (`Request.stop`): the final ids to keep when their text holds
    one of `stops` (the ids whose text ends before it), else None."""
    decode = model.tokenizer.decode
    eos = model.config.eos_ids

    def rule(final: np.ndarray) -> int | None:
        ids = [int(t) for t in final]
        ids = ids[:_eos_cut(ids, eos)]
        text = decode(ids)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if not hits:
            return None
        at = min(hits)
        keep = 0
        while keep < len(ids) and len(decode(ids[:keep + 1])) <= at:
            keep += 1
        return keep

    return rule

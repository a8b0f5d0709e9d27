"""`dlm-jax serve`: an OpenAI-compatible HTTP server on the continuous-batching engine
([docs/serve.md](../../docs/serve.md)).

    POST /v1/completions        text (or token ids) in, completion out; `stream` for SSE
    POST /v1/chat/completions   messages through the checkpoint's chat template
    GET  /v1/models             the one model served
    GET  /health                200 once warm; 503 while warming up or draining
    GET  /metrics               Prometheus text: requests, rows, tokens/s, latencies, refusals

The stack is Starlette (routing, requests, responses) under uvicorn (HTTP/1.1, its
connection handling and signal capture): a small, well-kept ASGI pair. FastAPI was not
taken: its request models would validate fields a second time, beside the registry that
validates every decode option of the command line and of this server, and its validation
errors have a shape of their own, not OpenAI's error object.

Every request runs as its own decode on the engine (`dlm_jax.Engine`), sharing the compiled
steps with whatever else runs, so its tokens are those it gets alone
([docs/engine.md](../../docs/engine.md)). The event loop never waits for a step: the engine
runs on its own thread and tells the loop when a request has news (`Request.listen`).

Lifecycle: warm-up (every program the configured decode reaches is built before /health
reports 200; requests meanwhile get 503), serving, and on SIGTERM a drain: new requests get
503, running ones finish within the grace period (those still running then end with an
error object, in the stream or as the response), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dlm_jax._engine import TextStream
from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax.runtime import registry
from dlm_jax.runtime.buckets import infill_slots
from dlm_jax.runtime.engine import CANCELLED, DONE, FAILED, STOPPED, QueueFull
from dlm_jax.runtime.proposer import MAX_LOGPROBS

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request

    from dlm_jax._model import Model
    from dlm_jax.runtime.config import DecodeConfig
    from dlm_jax.runtime.state import TokenLogprobs

log = logging.getLogger("dlm_jax.serve")

MAX_BODY = 1 << 20  # bytes of a request body (--max-body)
MAX_STOPS = 4  # stop strings per request, as OpenAI allows
HISTOGRAM_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# Fields of OpenAI's requests that dlm-jax does not implement, accepted at their neutral value only.
NEUTRAL = {"tools": ([],),
           "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},), "parallel_tool_calls": (False, True),
           "service_tier": ("auto", "default"), "store": (False,), "metadata": ({},)}


def _same(value: Any, accepted: Any) -> bool:
    """`value` is None or `accepted` (numbers by value, never a boolean for a number)."""
    if value is None:
        return True
    if isinstance(accepted, bool) or isinstance(value, bool):
        return value is accepted
    return value == accepted and type(value) in ((int, float) if isinstance(accepted, (int, float)) else (type(accepted),))
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                     "stream_options", "user", "dlm_jax", "n", "best_of", "echo", "logprobs", "presence_penalty",
                     "frequency_penalty", "logit_bias", "suffix"}
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
               "stream", "stream_options", "user", "dlm_jax", "n", "logprobs", "top_logprobs", "presence_penalty",
               "frequency_penalty", "logit_bias", "tools", "tool_choice", "response_format", "parallel_tool_calls",
               "service_tier", "store", "metadata"}
# Decode options set by OpenAI's own fields, not inside `dlm_jax`.
OWN_FIELDS = {"gen_len": "max_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed",
              "logprobs": "logprobs", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


class ApiError(Exception):
    """A request the server answers with an OpenAI error object (`status`, `param`, and the
    `reason` counted by /metrics' refusals)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, reason: str = "invalid_request",
                 kind: str = "invalid_request_error", code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.reason = status, message, param, reason
        self.kind, self.code, self.headers = kind, code, dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ---------------------------------------------------------------------------- reading a request


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 over `limit` bytes (at once when its Content-Length says
    so: a client sending `Expect: 100-continue`, as curl does for large bodies, then sends
    nothing; a body of unannounced length is read and dropped up to 16x the limit, so that the
    client gets the answer rather than a broken pipe), 400 for bytes that are not UTF-8, text
    that is not JSON, or JSON that is not an object."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise ApiError(400, f"Content-Length {declared!r} is not a byte count", reason="bad_body")
    if declared is not None and int(declared) > limit:
        raise ApiError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes",
                       reason="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > 16 * limit:
            break
    if size > limit:
        raise ApiError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes", reason="body_too_large")
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})",
                       reason="bad_body") from None

    def no_constant(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"request body is not valid JSON: {_one_line(e)}", reason="bad_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, not {type(body).__name__}", reason="bad_json")
    _no_surrogates(body, "")
    return body


def _no_surrogates(value: Any, where: str) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"), which no text encoding holds: a 400
    naming the field, not a tokenizer's exception."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"{where or 'a key'} holds an unpaired surrogate \\u{ord(value[e.start]):04x} "
                                f"(not text)", param=where or None, reason="bad_body") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_surrogates(k, where)
            _no_surrogates(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_surrogates(v, f"{where}[{i}]")


def _typed(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], what: str, *, where: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, f"{where}{name} must be {what}, got {json.dumps(value)[:80]}", param=where + name)
    return value


def _number(body, name, lo: float, hi: float, *, integer: bool = False, where: str = "", open_lo: bool = False):
    value = _typed(body, name, (int,) if integer else (int, float), "an integer" if integer else "a number",
                   where=where)
    if value is None:
        return None
    if not math.isfinite(value) or value < lo or value > hi or (open_lo and value == lo):
        lower = f"> {lo}" if open_lo else f">= {lo}"
        raise ApiError(400, f"{where}{name}={value} is out of range ({lower} and <= {hi})", param=where + name)
    return value


def _logit_bias(body: Mapping[str, Any], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`, {token id (a string): bias from -100 to 100}, as the proposer's
    sorted (id, bias) pairs."""
    given = _typed(body, "logit_bias", (dict,), "an object of token id: bias")
    pairs = []
    for key, value in (given or {}).items():
        if not key.isdigit() or int(key) >= vocab:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id of this model (0 to {vocab - 1})",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{key!r}]={json.dumps(value)[:40]} must be a number from -100 to 100",
                           param="logit_bias")
        if value:
            pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _logprobs_asked(body: Mapping[str, Any], kind: str) -> int | None:
    """The likeliest alternatives per token a request asks for, None for no logprobs:
    /v1/completions' `logprobs` (an integer), /v1/chat/completions' `logprobs` (true or false)
    with `top_logprobs` (an integer, only beside logprobs: true)."""
    if kind == "text_completion":
        return _number(body, "logprobs", 0, MAX_LOGPROBS, integer=True)
    asked = _typed(body, "logprobs", (bool,), "true or false")
    top = _number(body, "top_logprobs", 0, MAX_LOGPROBS, integer=True)
    if top is not None and not asked:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if asked else None


def _token_logprobs(job: Job, model: Model, ids: list[int], lp: TokenLogprobs | None, start: int = 0) -> dict | None:
    """OpenAI's logprobs object for the completion tokens `ids[start:]` (`ids`: the completion's
    ids so far, `lp` their records): /v1/completions' {tokens, token_logprobs, top_logprobs,
    text_offset (in the completion's text)}, /v1/chat/completions' {content: [{token, logprob,
    bytes, top_logprobs}]}. Each token's log-probability is under the distribution of the step
    that decided it; None (JSON null) where none was recorded."""
    if job.logprobs is None or lp is None:
        return None
    k, new = job.logprobs, ids[start:]
    rows = lp[start:len(ids)]
    if model.has_tokenizer:
        def piece(t) -> str:
            return model.tokenizer.decode([int(t)])

        def raw(t) -> list[int]:  # (a byte token's piece of a character: not its text's U+FFFD)
            return list(model.tokenizer.token_bytes(int(t)))

        def offset(n: int) -> int:
            return len(model.tokenizer.decode([int(t) for t in ids[:n]]))
    else:  # the completion's text is its ids, space-separated
        piece = str

        def raw(t) -> list[int]:
            return list(str(t).encode())

        def offset(n: int) -> int:
            return len(" ".join(map(str, ids[:n]))) + (1 if n else 0)

    def value(x) -> float | None:
        return float(x) if math.isfinite(x) else None

    tokens = [piece(t) for t in new]
    logprob = [value(v) for v in rows.logprob]
    tops = [[(piece(t), value(v)) for t, v in zip(rows.top_ids[j, :k], rows.top_logprob[j, :k])]
            for j in range(len(new))]
    if job.kind == "text_completion":  # the chosen token is always among them (up to logprobs + 1)
        return {"tokens": tokens, "token_logprobs": logprob,
                "top_logprobs": [{**dict(top), tok: v} for top, tok, v in zip(tops, tokens, logprob)],
                "text_offset": [offset(start + j) for j in range(len(new))]}
    return {"content": [{"token": tok, "logprob": v, "bytes": raw(t),
                         "top_logprobs": [{"token": s, "logprob": x, "bytes": raw(i)}
                                          for (s, x), i in zip(top, rows.top_ids[j, :k])]}
                        for j, (t, tok, v, top) in enumerate(zip(new, tokens, logprob, tops))], "refusal": None}


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop holds {len(stops)} strings; at most {MAX_STOPS}", param="stop")
    return stops


def decode_changes(body: Mapping[str, Any], max_tokens: int | None, config_of: Callable[[dict], DecodeConfig], *,
                   base: DecodeConfig) -> dict:
    """The flat decode options of a request: its `dlm_jax` object (any option of the registry,
    and `preset`), OpenAI's temperature / top_p, typed as the registry types them. An option
    the registry does not know, or one it refuses for the chosen decoder, is a 400 naming it."""
    extra = body.get("dlm_jax")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ApiError(400, "dlm_jax must be an object of decode options", param="dlm_jax")
    known = registry.options()
    changes: dict[str, Any] = {}
    for name, value in extra.items():
        where = f"dlm_jax.{name}"
        if name in OWN_FIELDS:
            raise ApiError(400, f"{where}: give it as the request's {OWN_FIELDS[name]!r} field", param=where)
        if name == "chat":
            if not isinstance(value, bool):
                raise ApiError(400, f"{where} must be true or false", param=where)
            continue
        if name == "preset":
            if value not in registry.PRESETS:
                raise ApiError(400, f"{where}={json.dumps(value)[:80]} is not a preset; known: "
                                    f"{', '.join(sorted(registry.PRESETS))}", param=where, reason="unknown_preset")
            changes[name] = value
            continue
        opt = known.get(name)
        if opt is None:
            raise ApiError(400, f"unknown decode option {where}; known: preset, chat, "
                                f"{', '.join(sorted(set(known) - set(OWN_FIELDS)))}", param=where)
        kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(opt.type, (object,))
        if value is None or (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ApiError(400, f"{where} must be {opt.type.__name__}, got {json.dumps(value)[:80]}", param=where)
        if opt.choices is not None and value not in opt.choices:
            raise ApiError(400, f"{where}={value!r} is not one of {list(opt.choices)}", param=where)
        changes[name] = float(value) if opt.type is float else value
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        changes["temperature"] = float(temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, open_lo=True)
    if top_p is not None:
        changes["top_p"] = float(top_p)
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2.0, 2.0)
        if value:
            changes[name] = float(value)
    if max_tokens is not None:  # the decode runs whole blocks
        block = _block_len(registry.PRESETS[changes["preset"]] if "preset" in changes else registry.decode_options(base),
                           changes)
        if block and max_tokens % block and isinstance(body.get("suffix"), str) and body["suffix"]:
            # An infill fills every slot before its suffix: cut at max_tokens, it would no
            # longer lead into it. One block of max_tokens where fewer than a block are asked.
            if max_tokens > block:
                raise ApiError(400, f"max_tokens={max_tokens} with a suffix: an infill fills whole blocks of "
                                    f"{block} tokens before its suffix; ask for a multiple of {block}, or set "
                                    f"dlm_jax.block_len to a divisor of {max_tokens}", param="max_tokens")
            changes["block_len"] = block = max_tokens
        changes["gen_len"] = -(-max_tokens // block) * block if block else max_tokens
    try:
        config_of(changes)
    except ConfigError as e:
        raise ApiError(400, f"dlm_jax: {_one_line(e)}", param="dlm_jax") from None
    return changes


def _block_len(base: Mapping[str, Any], changes: Mapping[str, Any]) -> int | None:
    """The block length flat options decode with (None: a schedule without blocks), read from
    the options themselves: building the config first would check what depends on the
    generation length (a step count per token) before the blocks have rounded it."""
    options = {**base, **changes}
    fields = {f.name: f for f in dataclasses.fields(registry.SCHEDULERS[options.get("cache", "prefix")])}
    if "block_len" not in fields:
        return None
    return options.get("block_len", fields["block_len"].default)


@dataclass
class Job:
    """One HTTP request's decodes (one per prompt) on the engine."""

    kind: str  # "text_completion" or "chat.completion"
    id: str
    created: int
    handles: list  # dlm_jax._engine.Handle
    prompt_tokens: list[int]
    max_tokens: int
    stops: list[str]
    stream: bool
    include_usage: bool
    started: float
    logprobs: int | None = None  # alternatives per token asked for (None: no logprobs)
    n: int = 1  # choices per prompt; `handles` holds best_of >= n decodes per prompt, in order
    echo: list[str] | None = None  # per prompt, its text to put before each of its choices' (echo)

    @property
    def best_of(self) -> int:
        return len(self.handles) // len(self.prompt_tokens)


# ---------------------------------------------------------------------------- metrics


class Metrics:
    """The Prometheus series of /metrics (a registry of this server's own)."""

    def __init__(self, service: Service):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        core = service.engine.core
        Gauge("dlm_jax_requests_running", "requests decoding (holding a batch row)", registry=r).set_function(
            lambda: core.running)
        Gauge("dlm_jax_requests_waiting", "requests queued for a batch row", registry=r).set_function(
            lambda: core.waiting)
        Gauge("dlm_jax_batch_rows", "batch rows of the engine (max batch)", registry=r).set(core.max_batch)
        Gauge("dlm_jax_batch_rows_busy", "batch rows holding a request", registry=r).set_function(lambda: core.running)
        Gauge("dlm_jax_batch_utilisation", "busy rows over computed rows, over every engine call so far",
              registry=r).set_function(lambda: core.stats.utilisation)
        Gauge("dlm_jax_tokens_per_second", "generated tokens per second over the last 10 s",
              registry=r).set_function(service.tokens_per_second)
        Gauge("dlm_jax_ready", "1 once warm and not draining", registry=r).set_function(
            lambda: float(service.state == "ready"))
        Gauge("dlm_jax_programs_quick", "step programs running their quick compile (DLM_JAX_COMPILE=tiered): "
              "their full compiles still building", registry=r).set_function(
            lambda: core.decoder.build_counts().quick_programs)
        Gauge("dlm_jax_compiles_pending", "full compiles queued or under way behind (DLM_JAX_COMPILE=tiered): "
              "0 once every program the server has met is built in full", registry=r).set_function(
            lambda: core.decoder.build_counts().pending_compiles)
        Gauge("dlm_jax_steps_widened", "steps run padded in a wider window's program while theirs was built behind "
              "(DLM_JAX_COMPILE=tiered), since start", registry=r).set_function(
            lambda: core.decoder.build_counts().widened_steps)
        self.tokens = Counter("dlm_jax_generated_tokens", "completion tokens sent", registry=r)
        self.prompt_tokens = Counter("dlm_jax_prompt_tokens", "prompt tokens decoded", registry=r)
        self.engine_calls = Gauge("dlm_jax_engine_calls", "executor calls the engine made", registry=r)
        self.engine_calls.set_function(lambda: core.stats.calls)
        self.requests = Counter("dlm_jax_requests", "requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.refusals = Counter("dlm_jax_refusals", "requests refused, by reason", ["reason"], registry=r)
        self.first_chunk = Histogram("dlm_jax_time_to_first_chunk_seconds",
                                     "from the request's arrival to its first completion text (streamed or not)",
                                     buckets=HISTOGRAM_BUCKETS, registry=r)
        self.latency = Histogram("dlm_jax_request_latency_seconds", "from arrival to the last byte of the answer",
                                 buckets=HISTOGRAM_BUCKETS, registry=r)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---------------------------------------------------------------------------- the service


# Bias entries a warm-up with `--warmup-sampling` covers: a request with more compiles the
# program that answers its proposals when it first runs.
WARM_BIAS = 64


def sampling_variant(cfg: DecodeConfig, decoder) -> DecodeConfig:
    """`cfg` with every option a request may add to it on: sampling with top-p, both penalties,
    a bias of `WARM_BIAS` entries and `MAX_LOGPROBS` alternatives (none where `decoder` refuses
    them with `cfg`: llada.cpp's CPU path). Its programs are those of any such request (steps
    that return their logits; the programs that answer proposals and log-probabilities beside
    them, which answer calls with fewer options, entries or alternatives, `executors._logits`):
    what `--warmup-sampling` builds."""
    bias = tuple((i, 0.0) for i in range(min(WARM_BIAS, decoder.model_config.vocab_size)))
    proposer = dataclasses.replace(cfg.proposer, temperature=1.0, top_p=0.9, presence_penalty=0.5,
                                   frequency_penalty=0.5, logprobs=MAX_LOGPROBS, logit_bias=bias)
    variant = dataclasses.replace(cfg, proposer=proposer)
    try:
        decoder.bucket_keys([1], variant)
    except ConfigError:
        variant = dataclasses.replace(variant, proposer=dataclasses.replace(proposer, logprobs=-1))
    return variant


def infill_variants(configs: Sequence[DecodeConfig], decoder, longest: int, max_tokens: int) -> list[DecodeConfig]:
    """Each of `configs` for requests with a suffix (infilling) of up to `longest` tokens: one
    per size the slots after a generation take (`runtime.buckets.infill_slots`: 8, 16, ...
    up to the one that holds `longest`) that leaves a row of `max_tokens` room for a prompt.
    A request whose suffix fits such a size, and its prompt with it, runs their programs: what
    `--warmup-infill` builds. With them, the decode of the shortest of `configs` at every
    `max_tokens` below its block (`short_infills`: such a request decodes one block of its
    length). Raises ConfigError where the model or the decode cannot infill."""
    top = infill_slots(longest)
    out = []
    for cfg in [*configs, *short_infills(configs)]:
        size = 8
        while size <= top:
            if cfg.gen_len + size < max_tokens:
                out.append(decoder.with_infill(decoder._for_model(cfg), [[0] * size], limit=max_tokens))
            size *= 2
    return out


def short_infills(configs: Sequence[DecodeConfig]) -> list[DecodeConfig]:
    """The decodes of suffix requests that ask for fewer tokens than a block (`decode_changes`:
    one block of `max_tokens` tokens, so that the generation ends where the suffix begins): the
    shortest of `configs` with each generation length from 1 to its block less one (as many
    configs; their step programs share buckets, `Engine.warmup` builds each once). Lengths the
    decode refuses are left out, as their requests are."""
    cfg = min(configs, key=lambda c: c.gen_len, default=None)
    block = getattr(cfg.scheduler, "block_len", None) if cfg is not None else None
    out = []
    for n in range(1, block or 0):
        try:
            out.append(registry.decode_config(cfg, gen_len=n, block_len=n))
        except ConfigError:
            continue
    return out


class Service:
    """The server's state: the model, its engine (on a background thread), the lifecycle
    (`state`: warming, ready, draining) and the metrics.

    Args:
      model: `dlm_jax.load(...)`.
      config: the decode every request starts from (`--preset` and the decode flags).
      name: the model id clients name (`model` field; /v1/models).
      max_batch, max_waiting, max_tokens: the engine's (`dlm_jax.Engine`).
      max_body: the largest request body, bytes.
      warmup: build every program `config` reaches before reporting healthy.
      warmup_sampling: and those of its requests that sample, set penalties or a bias, or ask
        for log-probabilities (`sampling_variant`).
      warmup_infill: and those of its requests with a suffix of up to this many tokens
        (`infill_variants`; 0: none; with `warmup_sampling`, those of such requests that
        sample too). Raises ConfigError where the model cannot infill.
    """

    def __init__(self, model: Model, config: DecodeConfig, *, name: str, max_batch: int | None = None,
                 max_waiting: int | None = 64, max_tokens: int | None = None, max_body: int = MAX_BODY,
                 warmup: bool = True, warmup_sampling: bool = False, warmup_infill: int = 0):
        from dlm_jax._engine import Engine

        self.model, self.config, self.name = model, config, name
        self.engine = Engine(model, config, max_batch=max_batch, max_waiting=max_waiting, max_tokens=max_tokens)
        self.max_body = max_body
        self.warm, self.warm_sampling = warmup, warmup_sampling
        self.infill = infill_variants(self._warm_configs(), self.engine.core.decoder, warmup_infill,
                                      self.engine.core.max_tokens) if warmup_infill else []
        self.state = "warming"
        self.warmup_seconds: float | None = None
        self.warmup_programs: int | None = None
        self.in_flight = 0  # decode requests (HTTP) being answered
        self.created = int(time.time())
        self._finished: deque[tuple[float, int]] = deque()  # (time, tokens) of recent completions
        self._latency = 5.0  # a running mean of request seconds (Retry-After)
        self._drained = threading.Event()
        self.hurry = False  # a second SIGTERM: cancel what runs now
        self.metrics = Metrics(self)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine's thread and warm up on another (the server answers meanwhile)."""
        self.engine.start()
        threading.Thread(target=self._warm_up, name="dlm-jax-warmup", daemon=True).start()

    def _warm_up(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.warm:
                configs = self._warm_configs()
                self.warmup_programs = self.engine.core.warmup(configs)
                if self.warm_sampling:
                    variants = [sampling_variant(c, self.engine.core.decoder) for c in configs]
                    self.warmup_programs += self.engine.core.warmup(variants)
                if self.infill:
                    self.warmup_programs += self.engine.core.warmup(self.infill)
                if self.infill and self.warm_sampling:  # suffix requests that sample, adjust or ask logprobs
                    variants = [sampling_variant(c, self.engine.core.decoder) for c in self.infill]
                    self.warmup_programs += self.engine.core.warmup(variants)
        except Exception:  # noqa: BLE001 - a server that cannot warm up still serves (compiling on use)
            log.exception("warm-up failed; programs will compile on first use")
        self.warmup_seconds = time.perf_counter() - t0
        if self.state == "warming":
            self.state = "ready"
        counts = self.engine.core.decoder.build_counts()
        quick, later = counts.quick_programs, counts.pending_compiles - counts.quick_programs
        behind = ", ".join(([f"{quick} compiled quick: their full compiles build behind"] if quick else [])
                           + ([f"{later} more build behind"] if later > 0 else []))
        behind = f" ({behind})" if behind else ""
        print(f"ready: {self.warmup_programs or 0} programs built in {self.warmup_seconds:.1f} s{behind}", flush=True)

    def _warm_configs(self) -> list[DecodeConfig]:
        """The configured decode at every generation length a request may ask for (multiples
        of its block up to its own)."""
        cfg = self.config
        block = getattr(cfg.scheduler, "block_len", None)
        lens = range(block, cfg.gen_len + 1, block) if block else [cfg.gen_len]
        return [registry.decode_config(cfg, gen_len=g) for g in lens]

    def drain(self, grace: float) -> None:
        """Stop admitting (503), let running requests finish for up to `grace` seconds, then
        cancel what is left (their clients get an error object)."""
        self.state = "draining"
        deadline = time.monotonic() + grace
        while self.in_flight and time.monotonic() < deadline and not self.hurry:
            time.sleep(0.05)
        left = self.in_flight
        if left:
            log.warning("grace period over: cancelling %d request(s)", left)
            self.engine.core.cancel_all()
        self._drained.set()

    def close(self) -> None:
        self.engine.close()

    # -- figures ----------------------------------------------------------------------------

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        while self._finished and self._finished[0][0] < now - 10.0:
            self._finished.popleft()
        return sum(n for _, n in self._finished) / 10.0

    def retry_after(self) -> int:
        core = self.engine.core
        waves = (core.waiting + 1) / max(core.max_batch, 1)
        return max(1, min(60, math.ceil(waves * self._latency)))

    def _done(self, seconds: float, tokens: int) -> None:
        self._finished.append((time.monotonic(), tokens))
        self._latency = 0.9 * self._latency + 0.1 * seconds

    # -- requests ---------------------------------------------------------------------------

    def admit(self) -> None:
        if self.state == "warming":
            raise ApiError(503, "the server is warming up (building its programs); retry shortly", reason="not_ready",
                           kind="server_error", code="warming_up", headers={"Retry-After": "5"})
        if self.state == "draining":
            raise ApiError(503, "the server is shutting down and admits no new requests", reason="draining",
                           kind="server_error", code="shutting_down")

    @property
    def max_decodes(self) -> int:
        """The decodes one request may queue (its prompts times `n`): four times the rows."""
        return self.engine.core.max_batch * 4

    def parse(self, body: dict, kind: str) -> tuple[list[list[int]], dict, dict]:
        """(prompts as ids, decode changes, the rest) of a request body, or an ApiError."""
        fields = COMPLETION_FIELDS if kind == "text_completion" else CHAT_FIELDS
        unknown = sorted(set(body) - fields)
        if unknown:
            raise ApiError(400, f"unknown field(s) {unknown} for {'/v1/completions' if kind == 'text_completion' else '/v1/chat/completions'}",
                           param=unknown[0])
        model = body.get("model")
        if model is None:
            raise ApiError(400, "model is required", param="model")
        if not isinstance(model, str):
            raise ApiError(400, "model must be a string", param="model")
        if model != self.name:
            raise ApiError(404, f"model {model!r} is not served here; this server serves {self.name!r}",
                           param="model", reason="unknown_model", code="model_not_found")
        for name, accepted in NEUTRAL.items():
            if name in body and not any(_same(body[name], a) for a in accepted):
                raise ApiError(400, f"{name} is not supported by dlm-jax serve ({name}={json.dumps(body[name])[:60]})",
                               param=name)
        _typed(body, "user", (str,), "a string")
        stream = _typed(body, "stream", (bool,), "true or false") or False
        options = _typed(body, "stream_options", (dict,), "an object")
        include_usage = False
        if options is not None:
            if not stream:
                raise ApiError(400, "stream_options needs stream: true", param="stream_options")
            if set(options) - {"include_usage"}:
                raise ApiError(400, f"unknown stream_options {sorted(set(options) - {'include_usage'})}",
                               param="stream_options")
            include_usage = bool(_typed(options, "include_usage", (bool,), "true or false", where="stream_options."))
        limit = self.engine.core.max_tokens
        max_tokens = _number(body, "max_tokens", 1, limit, integer=True)
        if kind == "chat.completion":
            alt = _number(body, "max_completion_tokens", 1, limit, integer=True)
            if alt is not None and max_tokens is not None and alt != max_tokens:
                raise ApiError(400, "max_tokens and max_completion_tokens differ", param="max_completion_tokens")
            max_tokens = alt if max_tokens is None else max_tokens
        seed = _number(body, "seed", 0, 2**31 - 1, integer=True)
        cap = self.max_decodes
        n = _number(body, "n", 1, cap, integer=True) or 1
        stops = _stops(body)
        if stops and not self.model.has_tokenizer:
            raise ApiError(400, "stop strings need a tokenizer; this model has none", param="stop")
        changes = decode_changes(body, max_tokens, self.engine.options, base=self.config)
        logprobs = _logprobs_asked(body, kind)
        changes["logprobs"] = -1 if logprobs is None else logprobs  # whatever the server's own config says
        best_of = _number(body, "best_of", 1, cap, integer=True) or n  # (completions only)
        if best_of < n:
            raise ApiError(400, f"best_of={best_of} must be at least n={n}", param="best_of")
        if best_of > n:
            if stream:
                raise ApiError(400, "best_of above n cannot be streamed (the best are known at the end)",
                               param="best_of")
            changes["logprobs"] = max(changes["logprobs"], 0)  # ranked by their tokens' log-probabilities
        echo = _typed(body, "echo", (bool,), "true or false") or False
        if echo and logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported: a diffusion decode gives the prompt's tokens "
                                "no log-probability", param="echo")
        chat = (body.get("dlm_jax") or {}).get("chat")
        suffix = _typed(body, "suffix", (str,), "a string") or None  # (completions only; "" is none)
        if suffix is not None and not self.model.has_tokenizer:
            raise ApiError(400, "suffix needs a tokenizer; this model has none", param="suffix")
        prompts = self._prompts(body, kind, chat)
        if len(prompts) * best_of > cap:
            what = f"n={n} choices" if best_of == n else f"best_of={best_of} candidates"
            raise ApiError(400, f"{len(prompts)} prompts x {what} in one request; at most {cap} in all",
                           param="n" if best_of == n else "best_of")
        options = self.engine.options(changes)
        bias = _logit_bias(body, self.model.config.vocab_size)
        if bias:  # not a flat option: the request's whole config carries it
            changes = options = dataclasses.replace(options, proposer=dataclasses.replace(options.proposer,
                                                                                          logit_bias=bias))
        # candidate j of a prompt samples with seed + j (seed: the request's, else the preset's)
        seeds = [((options.proposer.seed if seed is None else seed) + j) % 2**31 for j in range(best_of)]
        return prompts, changes, {"stream": stream, "include_usage": include_usage, "seeds": seeds, "stops": stops,
                                  "max_tokens": max_tokens or options.gen_len, "logprobs": logprobs, "n": n,
                                  "echo": self._echo(body, prompts) if echo else None,
                                  "suffix": None if suffix is None else list(self.model.tokenizer.encode(suffix))}

    def _echo(self, body: dict, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text as the request gave it (token ids: their text), for `echo`."""
        given = body["prompt"] if isinstance(body["prompt"], list) and not isinstance(body["prompt"][0], int) \
            else [body["prompt"]]
        model = self.model
        return [p if isinstance(p, str) else model.tokenizer.decode(ids) if model.has_tokenizer
                else " ".join(map(str, ids)) for p, ids in zip(given, prompts)]

    def _prompts(self, body: dict, kind: str, chat: bool | None) -> list[list[int]]:
        model = self.model
        if kind == "chat.completion":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
            chat_messages = []
            for i, m in enumerate(messages):
                where = f"messages[{i}]"
                if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
                    raise ApiError(400, f"{where} must be an object with role and content", param=where)
                role, content = m.get("role"), m.get("content")
                if role not in ("system", "user", "assistant", "developer"):
                    raise ApiError(400, f"{where}.role must be system, user, assistant or developer, got "
                                        f"{json.dumps(role)[:40]}", param=where + ".role")
                if isinstance(content, list):  # content parts: text only
                    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                               for p in content):
                        raise ApiError(400, f"{where}.content parts must be {{type: text, text}}",
                                       param=where + ".content")
                    content = "".join(p["text"] for p in content)
                if not isinstance(content, str):
                    raise ApiError(400, f"{where}.content must be a string", param=where + ".content")
                chat_messages.append({"role": "system" if role == "developer" else role, "content": content})
            if not model.has_tokenizer:
                raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids", param="messages")
            try:
                return [list(model.tokenizer.apply_chat(chat_messages))]
            except (ConfigError, CheckpointError) as e:
                raise ApiError(400, f"messages: {_one_line(e)}", param="messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(p, str) or (isinstance(p, list) and p and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p)) for p in prompt):
            raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                                "such lists (none empty)", param="prompt")
        if len(prompt) > self.max_decodes:  # (before encoding them: n is checked after)
            raise ApiError(400, f"{len(prompt)} prompts in one request; at most {self.max_decodes}",
                           param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str) and not model.has_tokenizer:
                raise ApiError(400, "this model has no tokenizer: give prompts as token ids", param="prompt")
            try:
                out.append(list(model.encode(p, chat=chat)) if isinstance(p, str) else p)
            except (ConfigError, CheckpointError) as e:
                raise ApiError(400, f"prompt: {_one_line(e)}", param="prompt") from None
        return out

    def submit(self, prompts: list[list[int]], changes: dict, rest: dict) -> list:
        """Each prompt on the engine, once per choice (`n`; called on a worker thread: `submit` may
        wait for a tick), in the choices' order: prompt i's choice j is handle i * n + j. A prompt
        the engine refuses (too long, options it cannot run, a full queue) cancels the ones
        submitted before it."""
        handles = []
        try:
            for ids in prompts:
                for seed in rest["seeds"]:
                    handles.append(self.engine.submit(ids, changes, seed=seed, chat=False, stop=rest["stops"],
                                                      suffix=rest.get("suffix")))
        except QueueFull as e:
            for h in handles:
                h.cancel()
            raise ApiError(429, f"{_one_line(e)}; retry later", reason="queue_full", kind="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(self.retry_after())}) from None
        except ConfigError as e:
            for h in handles:
                h.cancel()
            msg = _one_line(e)
            if rest["logprobs"] is None and len(rest["seeds"]) > rest["n"] and "logprobs" in msg:
                raise ApiError(400, f"best_of ranks candidates by their tokens' log-probabilities, and {msg}",
                               param="best_of") from None
            param = "suffix" if "suffix" in msg else "prompt" if "prompt" in msg or "token id" in msg else "dlm_jax"
            raise ApiError(400, msg, param=param) from None
        return handles


# ---------------------------------------------------------------------------- the answers


def _finish(handle, text: TextStream) -> tuple[str, list[int], str]:
    """(text, ids, finish reason) of an ended request."""
    req = handle.request
    full = [int(t) for t in req.tokens()]
    ids = text.ids(full)
    if req.status == STOPPED:
        return text.text(full), ids, "stop"
    eos = len(full) < req.config.gen_len  # cut at an EOS (tokens() stops there)
    reason = "stop" if eos and len(full) <= text.limit else "length"
    return text.text(full), ids, reason


def _cut_short(req) -> ApiError | None:
    """The error object of a request that ended without its completion: failed (500, logged
    with its traceback: the server's fault) or cancelled by the drain (503); None otherwise."""
    if req.status == FAILED:
        log.error("request failed: %s", _one_line(req.error), exc_info=req.error)
        return ApiError(500, f"decoding failed: {_one_line(req.error)}", kind="server_error", reason="failed")
    if req.status == CANCELLED:
        return ApiError(503, "the server shut down before this request finished", kind="server_error",
                        code="shutting_down")
    return None


def _usage(job: Job, completion: int) -> dict:
    prompt = sum(job.prompt_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk(job: Job, index: int, piece: str | None, reason: str | None, *, role: bool = False,
           logprobs: dict | None = None) -> dict:
    if job.kind == "text_completion":
        choice = {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    else:
        delta = {} if piece is None and not role else {"content": piece or ""}
        if role:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion.chunk"
    return {"id": job.id, "object": obj, "created": job.created, "model": "", "choices": [choice]}


def _best(job: Job, ends: list[tuple]) -> list[tuple]:
    """Each prompt's `n` choices out of its `best_of` ended decodes (`ends`, in candidate
    order: (text, ids, finish reason, request)): all of them when best_of is n, else the n with
    the highest mean log-probability per token (OpenAI's rule; an empty completion scores 0),
    best first, ties in candidate order."""
    k = job.best_of
    if k == job.n:
        return ends
    out = []
    for p in range(len(ends) // k):
        group = ends[p * k:(p + 1) * k]
        score = [sum(map(float, req.logprobs().logprob[:len(ids)])) / len(ids) if ids else 0.0
                 for _, ids, _, req in group]
        out += [group[j] for j in sorted(range(k), key=lambda j: -score[j])[:job.n]]
    return out


def _shown_tokens(text: TextStream, ids: list[int], have: int) -> int:
    """How many of `ids` (at least `have`) a stream has shown the whole text of."""
    n = have
    while n < len(ids) and text.shown.startswith(text.text(ids[:n + 1])):
        n += 1
    return n


class EventStream:
    """A server-sent event response that watches the client while it streams: a client that
    disconnects cancels `body` at once (its `finally` cancels the engine requests), whatever
    the ASGI server's spec version (Starlette's own response notices only on its next send)."""

    def __init__(self, body: AsyncIterator[bytes], headers: Mapping[str, str] | None = None):
        self.body, self.headers = body, dict(headers or {})

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")] + [(k.encode(), v.encode()) for k, v in self.headers.items()]

        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = asyncio.ensure_future(stream())
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, watch):
                if not t.done():
                    t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
            await self.body.aclose()
        if task.done() and not task.cancelled() and isinstance(task.exception(), OSError):
            return  # the client went while we wrote


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def build_app(service: Service) -> Starlette:
    """The Starlette application of `service` (its lifespan starts and closes the engine)."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    metrics = service.metrics

    def error(e: ApiError, endpoint: str) -> JSONResponse:
        metrics.refusals.labels(e.reason).inc()
        metrics.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def watch(job: Job, receive) -> bool:
        """Until every request of `job` ended (True) or the client went (False)."""
        loop = asyncio.get_running_loop()
        news = asyncio.Event()
        for h in job.handles:
            h.request.listen(lambda: loop.call_soon_threadsafe(news.set))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            while not all(h.done for h in job.handles):
                if gone.done():
                    return False
                news.clear()
                if all(h.done for h in job.handles):
                    break
                waiter = asyncio.ensure_future(news.wait())
                await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            return True
        finally:
            gone.cancel()

    async def answer(job: Job, receive, endpoint: str) -> Response:
        t_first = None
        try:
            finished = await watch(job, receive)
        finally:
            if not all(h.done for h in job.handles):
                for h in job.handles:
                    h.cancel()
        if not finished:
            metrics.requests.labels(endpoint, "disconnected").inc()
            return Response(status_code=499)
        choices, completion, ends = [], 0, []
        for h in job.handles:
            req = h.request
            cut = _cut_short(req)
            if cut is not None:
                metrics.requests.labels(endpoint, str(cut.status)).inc()
                return JSONResponse(cut.body(), status_code=cut.status)
            content, ids, reason = _finish(h, TextStream(service.model, job.stops, job.max_tokens))
            completion += len(ids)  # (every candidate of best_of counts)
            first = req.stats.first_token_seconds
            t_first = first if t_first is None or (first is not None and first < t_first) else t_first
            ends.append((content, ids, reason, req))
        for i, (content, ids, reason, req) in enumerate(_best(job, ends)):
            stats = req.stats.to_dict()
            logprobs = _token_logprobs(job, service.model, ids, req.logprobs())
            if job.kind == "text_completion":
                echo = job.echo[i // job.n] if job.echo is not None else ""
                choices.append({"index": i, "text": echo + content, "logprobs": logprobs, "finish_reason": reason,
                                "dlm_jax": stats})
            else:
                choices.append({"index": i, "message": {"role": "assistant", "content": content},
                                "logprobs": logprobs, "finish_reason": reason, "dlm_jax": stats})
        seconds = time.perf_counter() - job.started
        metrics.tokens.inc(completion)
        metrics.latency.observe(seconds)
        metrics.first_chunk.observe(t_first if t_first is not None else seconds)
        metrics.requests.labels(endpoint, "200").inc()
        service._done(seconds, completion)
        return JSONResponse({"id": job.id, "object": job.kind, "created": job.created, "model": service.name,
                             "choices": choices, "usage": _usage(job, completion)})

    async def events(job: Job, endpoint: str) -> AsyncIterator[bytes]:
        """The SSE body: a chunk per newly final piece of text, each choice's finish, the
        usage (stream_options.include_usage), `data: [DONE]`."""
        loop = asyncio.get_running_loop()
        news = asyncio.Event()
        texts = [TextStream(service.model, job.stops, job.max_tokens) for _ in job.handles]
        ended = [False] * len(job.handles)
        sent = [0] * len(job.handles)  # per choice, the tokens whose logprobs went out
        completion, first = 0, None
        outcome = None

        def sse(obj: dict) -> bytes:
            if "error" not in obj:
                obj["model"] = service.name
            return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

        try:
            for h in job.handles:
                h.request.listen(lambda: loop.call_soon_threadsafe(news.set))
            if job.kind == "chat.completion":
                for i in range(len(job.handles)):
                    yield sse(_chunk(job, i, "", None, role=True))
            elif job.echo is not None:  # each choice's prompt first (best_of is n here: one handle a choice)
                for i in range(len(job.handles)):
                    yield sse(_chunk(job, i, job.echo[i // job.n], None))
            while not all(ended):
                news.clear()
                for i, h in enumerate(job.handles):
                    if ended[i]:
                        continue
                    req = h.request
                    batch = req.poll()
                    if not batch:
                        continue
                    end = batch[-1].end
                    cut = _cut_short(req) if end in (FAILED, CANCELLED) else None
                    if cut is not None:
                        yield sse(cut.body())
                        yield b"data: [DONE]\n\n"
                        outcome = str(cut.status)
                        return
                    if end in (DONE, STOPPED):
                        _, ids, reason = _finish(h, texts[i])
                        piece = texts[i].update(req.tokens(), end=True)
                        ended[i] = True
                        completion += len(ids)
                        shown = len(ids)
                    else:
                        piece, reason = texts[i].update(req.final), None
                        ids = texts[i].ids(req.final)
                        shown = _shown_tokens(texts[i], ids, sent[i]) if job.logprobs is not None else 0
                    if piece and first is None:
                        first = time.perf_counter() - job.started
                        metrics.first_chunk.observe(first)
                    if piece or reason:
                        logprobs = None
                        if job.logprobs is not None and (shown > sent[i] or reason):
                            logprobs = _token_logprobs(job, service.model, ids[:shown], req.logprobs(), sent[i])
                            sent[i] = shown
                        chunk = _chunk(job, i, piece or None, reason, logprobs=logprobs)
                        if reason:
                            chunk["usage"] = _usage(job, completion) if all(ended) else None
                        yield sse(chunk)
                if not all(ended):
                    await news.wait()
            if job.include_usage:
                yield sse({"id": job.id, "object": _chunk(job, 0, "", None)["object"], "created": job.created,
                           "choices": [], "usage": _usage(job, completion)})
            yield b"data: [DONE]\n\n"
            outcome = "200"
        finally:
            if outcome != "200":  # the client went (None), or a request failed or was cut: end the others
                for h in job.handles:
                    h.cancel()
                metrics.requests.labels(endpoint, outcome or "disconnected").inc()
            else:
                seconds = time.perf_counter() - job.started
                metrics.tokens.inc(completion)
                metrics.latency.observe(seconds)
                if first is None:
                    metrics.first_chunk.observe(seconds)
                metrics.requests.labels(endpoint, "200").inc()
                service._done(seconds, completion)

    def completion_endpoint(kind: str, endpoint: str):
        async def handle(request: Request) -> Response:
            from starlette.concurrency import run_in_threadpool

            started = time.perf_counter()
            service.in_flight += 1
            release = True
            try:
                service.admit()
                body = await read_json(request, service.max_body)
                prompts, changes, rest = await run_in_threadpool(service.parse, body, kind)
                handles = await run_in_threadpool(service.submit, prompts, changes, rest)
                job = Job(kind, ("cmpl-" if kind == "text_completion" else "chatcmpl-") + secrets.token_hex(12),
                          int(time.time()), handles, [len(p) for p in prompts], rest["max_tokens"], rest["stops"],
                          rest["stream"], rest["include_usage"], started, rest["logprobs"], rest["n"], rest["echo"])
                metrics.prompt_tokens.inc(sum(job.prompt_tokens))
                if job.stream:
                    release = False
                    return EventStream(_released(events(job, endpoint), service))
                return await answer(job, request.receive, endpoint)
            except ApiError as e:
                return error(e, endpoint)
            finally:
                if release:
                    service.in_flight -= 1

        return handle

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": service.name, "object": "model",
                                                          "created": service.created, "owned_by": "dlm-jax"}]})

    async def health(request: Request) -> Response:
        core = service.engine.core
        body = {"status": {"warming": "warming up"}.get(service.state, service.state), "model": service.name,
                "running": core.running, "waiting": core.waiting, "max_batch": core.max_batch,
                "warmup_seconds": None if service.warmup_seconds is None else round(service.warmup_seconds, 2)}
        return JSONResponse(body, status_code=200 if service.state == "ready" else 503)

    async def prometheus(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        reason = "not_found" if exc.status_code == 404 else "method_not_allowed"
        what = (f"no route {request.url.path}" if exc.status_code == 404
                else f"{request.method} is not allowed on {request.url.path}")
        return error(ApiError(exc.status_code, what, reason=reason), request.url.path)

    async def crashed(request: Request, exc: Exception) -> Response:
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return JSONResponse(ApiError(500, "internal server error", kind="server_error").body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            service.close()

    routes = [Route("/v1/completions", completion_endpoint("text_completion", "/v1/completions"), methods=["POST"]),
              Route("/v1/chat/completions", completion_endpoint("chat.completion", "/v1/chat/completions"),
                    methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: not_found, Exception: crashed})


async def _released(body: AsyncIterator[bytes], service: Service) -> AsyncIterator[bytes]:
    """`body`, counting as in flight until it ends (streamed, cancelled or cut)."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        await body.aclose()
        service.in_flight -= 1


# ---------------------------------------------------------------------------- running it


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one). A port in use is a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(service: Service, *, host: str = "127.0.0.1", port: int = 8000, grace: float = 30.0,
          log_level: str = "warning") -> int:
    """Serve until SIGTERM / SIGINT: then drain (`Service.drain`, `grace` seconds) and return 0.
    Prints the address it listens on, then `ready` once warm."""
    import uvicorn

    sock = bind(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    placement = getattr(service.model.executor, "placement", None)
    where = "" if placement is None else f"; mesh {placement.shape}, {placement.mesh.devices.size} devices"
    print(f"serving {service.name} on http://{shown}:{bound} (OpenAI API under /v1; /health, /metrics{where})",
          flush=True)

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig: int, frame) -> None:
            # Not uvicorn's own: it re-raises the signal after its shutdown (the process would
            # die of it); a drained server exits 0.
            if self.draining:  # a second signal: the grace period is over
                service.hurry = True
                return
            self.draining = True
            print(f"{signal.Signals(sig).name}: draining ({service.in_flight} in flight, grace {grace:g} s)",
                  flush=True)

            def drain() -> None:
                service.drain(grace)
                self.should_exit = True

            threading.Thread(target=drain, name="dlm-jax-drain", daemon=True).start()

    config = uvicorn.Config(build_app(service), log_level=log_level, timeout_graceful_shutdown=max(1.0, grace),
                            access_log=log_level in ("info", "debug"), lifespan="on", timeout_keep_alive=5)
    server = Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    print("stopped", flush=True)
    return 0


def default_name(path: str | os.PathLike) -> str:
    """The model id a checkpoint is served as: its directory's name."""
    return os.path.basename(os.path.normpath(str(path))) or "model"

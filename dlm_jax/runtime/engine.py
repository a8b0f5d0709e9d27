"""Continuous batching: requests join and leave a running decode between steps (NumPy only).

The engine runs every request as its own decode: the loop of `Decoder.steps` over a batch of
one, with its own `DecodeState`, scheduler cursor, commit rule, proposer generator and
revision policy, exactly as that request would run alone. What requests share is the
executor's step. Each tick, every running request has planned one step (a batch-1
`SlotStep`); the engine puts the steps of the same shape into one call of the executor
(`merge`), each request in its own batch row, reading and writing its own row of one K/V cache
held for all requests (`KVCache.assign`, `SlotStep.rows`), and hands each request its row
of the outputs. A request's host decisions therefore never see another request, and its
row of a step is computed from the same arrays, in a program of the same window, cache and
row sizes, as when it runs alone. With an executor that computes rows one at a time and
"free" padding (the JAX executor's CPU defaults), every call of one shape is the same
program, so a request's outputs are the same bytes alone and under load
(`tests/runtime/test_engine_invariance.py`); otherwise a call's batch size may move low bits.

Between ticks the engine retires finished requests (done: at the generation's end or an EOS
block; stopped by a stop rule; cancelled; failed), freeing their rows and K/V, and admits waiting requests into free rows.
A request's first step (its prompt's forward) joins a call with other rows' decode steps
when it has their shape, and runs as a call of its own otherwise.

  Engine      submit / step / run / start (a background thread) / close
  Request     the handle: status, streamed events, the result and its own `RequestStats`

Which steps share a call: those with the same bucket (window, cache, rows, outputs). Where the
cache reads its slots in place whatever the read bucket (`KVCache.read_bucket_free`: the JAX
executor's `split` attention), steps of several cache sizes share one call, padded to the
largest. Nothing else is padded across requests: a wider window or more logit rows would
change the reductions of a request's row.

Axes: B batch rows of a call, S slots of a cache row, W window, P read slots, R logit rows.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from dlm_jax._errors import ConfigError, InputError
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.decoder import DecodeOutput, DecodeStats, Decoder, _use_order, warm_logits, warm_mixed_logits
from dlm_jax.runtime.kvcache import HostKVCache, KVCache, Transfers
from dlm_jax.runtime.state import DecodeState, TokenLogprobs
from dlm_jax.runtime.step import LogitsAsk, SlotStep, StepOutputs, answer, is_device_logits

# Request statuses: waiting -> running -> one of the ends.
WAITING, RUNNING = "waiting", "running"
DONE, STOPPED, CANCELLED, FAILED = "done", "stopped", "cancelled", "failed"
ENDS = (DONE, STOPPED, CANCELLED, FAILED)

POOL_BYTES = 1 << 30  # the default `max_batch` keeps the engine's K/V within this many bytes


def default_batch(decoder: Decoder, max_tokens: int) -> int:
    """An engine's default `max_batch`: the largest batch bucket whose rows of `max_tokens`
    slots keep the K/V within `POOL_BYTES` (at least 1)."""
    mc = decoder.model_config
    per_row = 2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * np.dtype(
        "float32" if mc.dtype == "float32" else "float16").itemsize * max_tokens
    fits = [b for b in decoder.capabilities.batches.sizes if b * per_row <= POOL_BYTES]
    return max(fits) if fits else 1


# A group of steps whose count is not a batch bucket: "pad" runs one call of the next bucket
# (padding rows computed for nothing), "split" runs calls of the buckets that it fills (7 steps:
# 4 + 2 + 1), more calls and no padding row; "free", for an executor that computes only the
# live rows of a call, runs every call in the bucket of the engine's whole batch (one program
# per step shape, whatever the number of requests).
PADDING = ("pad", "split", "free")


@dataclasses.dataclass
class RequestStats:
    """One request's own figures (seconds from its `submit`)."""

    nfe: int = 0  # steps it took part in (`DecodeStats.request_nfe`)
    steps: int = 0  # calls its row was in (its steps, whether or not it had a slot left to decide)
    tokens: int = 0  # generated tokens up to the first EOS (all final)
    queued_seconds: float | None = None  # until it took a row
    first_block_seconds: float | None = None  # until its first commit unit was done
    first_token_seconds: float | None = None  # until its first final token
    last_token_seconds: float | None = None  # until its last final token
    seconds: float | None = None  # until it ended
    decode: DecodeStats | None = None  # its loop's own stats (None if it never ended normally)

    def to_dict(self) -> dict:
        out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()
               if k != "decode"}
        if self.decode is not None:
            out["speculation"] = self.decode.to_dict().get("speculation")
        return out


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request streams: `ids` newly final (only ever appended), `unit` the last commit
    unit it had completed then; `end` set on the last event (the request's status)."""

    ids: np.ndarray
    unit: int | None = None
    end: str | None = None


class Request:
    """A submitted request: its status, its stream of final ids, its result. Made by
    `Engine.submit`; `wait`, `events` and `result` drive the engine themselves when no
    background thread does (`Engine.start`)."""

    def __init__(self, engine: Engine, rid: int, ids: np.ndarray, config: DecodeConfig, seed: int,
                 stop: Callable[[np.ndarray], int | None] | None, suffix: np.ndarray | None = None):
        self.engine = engine
        self.id = rid
        self.prompt = ids
        self.suffix = suffix  # token ids after its generation (infilling), or None
        self.config = config
        self.seed = seed
        self.stop = stop
        self.status = WAITING
        self.error: BaseException | None = None
        self.output: DecodeOutput | None = None
        self.stats = RequestStats()
        self.final = np.zeros(0, np.int32)  # its generated ids that no later step can change
        self.unit = -1  # the last commit unit it completed
        self.on_unit: Callable[[int, list[np.ndarray]], None] | None = None  # after each of its units
        self._listener: Callable[[], None] | None = None
        self._events: collections.deque[Event] = collections.deque()
        self._submitted = time.perf_counter()
        self._cancel = False
        self._gen = None
        self._row = -1
        self._pending: SlotStep | LogitsAsk | None = None  # (an ask only inside `Engine._call`)
        self._ended = threading.Event()
        self._state: DecodeState | None = None  # its decode's state, where it records logprobs

    # -- the caller's side ------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.status in ENDS

    def cancel(self) -> None:
        """End the request: it is retired, its row freed, before the engine's next step."""
        self._cancel = True

    def wait(self, timeout: float | None = None) -> bool:
        """Until the request has ended (driving the engine when no thread does); False on timeout."""
        if self.engine.running_in_background:
            return self._ended.wait(timeout)
        deadline = None if timeout is None else time.perf_counter() + timeout
        self.engine.run(until=lambda: self.done or (deadline is not None and time.perf_counter() > deadline))
        return self.done

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The request's events as they happen: newly final ids, then one with `end` set."""
        while True:
            while self._events:
                event = self._events.popleft()
                yield event
                if event.end is not None:
                    return
            if self.engine.running_in_background:
                with self.engine._cond:
                    if not self._events:
                        self.engine._cond.wait(timeout=0.5 if timeout is None else timeout)
            else:
                self.engine.step()

    def listen(self, callback: Callable[[], None] | None) -> None:
        """Call `callback()` whenever events are ready to `poll` (from the engine's thread,
        inside its tick: it must only hand the news on, e.g. `loop.call_soon_threadsafe`);
        called at once if some are ready already."""
        self._listener = callback
        if callback is not None and self._events:
            callback()

    def poll(self) -> list[Event]:
        """The events ready now, without waiting or driving the engine (for an event loop
        told by `listen`; `events` is the blocking way; use one or the other)."""
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def tokens(self) -> np.ndarray:
        """The generated ids: up to the first EOS when the request ran to its end (or its stop
        rule), what was final when it was cancelled."""
        if self.output is not None and self.status in (DONE, STOPPED):
            seq = self.output.sequences[0]
            return seq[:_eos_cut(seq, self.engine.decoder.model_config.eos_ids)]
        return self.final

    def logprobs(self) -> TokenLogprobs | None:
        """The log-probabilities of `tokens()` (None unless its config records them:
        decode option `logprobs`)."""
        if self.output is not None and self.output.logprobs:
            return self.output.logprobs[0][:len(self.tokens())]
        return None if self._state is None else self._state.token_logprobs(0, len(self.tokens()))

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Its tokens once it has ended; raises the error of a failed request."""
        if not self.wait(timeout):
            raise TimeoutError(f"request {self.id} still {self.status} after {timeout} s")
        if self.status == FAILED:
            raise self.error
        return self.tokens()

    def __repr__(self) -> str:
        return f"Request({self.id}, {self.status}, row {self._row}, {len(self.final)} final tokens)"

    # -- the engine's side ------------------------------------------------------------------

    def _emit(self, ids: np.ndarray, end: str | None = None) -> None:
        self._events.append(Event(np.asarray(ids, np.int32), self.unit, end))
        if self._listener is not None:
            self._listener()


def _eos_cut(seq: np.ndarray, eos_ids: Sequence[int]) -> int:
    hit = np.flatnonzero(np.isin(seq, list(eos_ids))) if eos_ids else ()
    return int(hit[0]) if len(hit) else len(seq)


class QueueFull(ConfigError):
    """`Engine.submit` with `max_waiting` requests waiting already."""


class RowCache(KVCache):
    """A request's view of the engine's cache: its one row. The engine runs the steps; a CPU
    path's `snapshot` / `write` (llada.cpp's refresh) go to the row."""

    def __init__(self, pool: KVCache, row: int):
        self.pool = pool
        self.row = row
        self.transfers = Transfers()

    def step(self, req: SlotStep, *, timings=None) -> StepOutputs:
        raise RuntimeError("an engine request's steps run in the engine's shared calls")

    def snapshot(self, req: SlotStep, executor: Any):
        return self.pool.snapshot(dataclasses.replace(req, rows=np.array([self.row], np.int32)), executor)

    def write(self, kv: Any, slots: np.ndarray, rows: np.ndarray, *, at: np.ndarray | None = None) -> None:
        self.pool.write(kv, slots, rows, at=np.array([self.row], np.int32))


@dataclasses.dataclass
class EngineStats:
    """What the engine ran: `ticks` (rounds in which every running request took one step),
    `calls` (executor steps), `rows` (batch rows of those calls, bucket padding included) and
    `busy_rows` (rows that held a request's step): `utilisation` = busy / rows."""

    ticks: int = 0
    calls: int = 0
    rows: int = 0
    busy_rows: int = 0
    admitted: int = 0
    retired: dict = dataclasses.field(default_factory=dict)  # status -> count
    buckets: dict = dataclasses.field(default_factory=dict)  # call bucket -> calls
    step_seconds: float = 0.0  # in the executor
    host_seconds: float = 0.0  # the rest of the ticks
    call_seconds: list = dataclasses.field(default_factory=list)  # per call, in the executor
    tick_host_seconds: list = dataclasses.field(default_factory=list)  # per tick, the host's share
    h2d_bytes: list = dataclasses.field(default_factory=list)  # per call, to where the step runs
    d2h_bytes: list = dataclasses.field(default_factory=list)  # per call, back (its asks' answers too)
    # Calls that answered questions to logits kept on the device (`runtime.step.LogitsAsk`):
    # one per kind (proposals, log-probabilities) and step call, whatever its requests; and
    # their seconds (part of `host_seconds`).
    logits_calls: int = 0
    logits_seconds: float = 0.0

    @property
    def utilisation(self) -> float:
        return self.busy_rows / self.rows if self.rows else 0.0

    def to_dict(self) -> dict:
        lists = ("buckets", "call_seconds", "tick_host_seconds", "h2d_bytes", "d2h_bytes")
        return {**{k: v for k, v in dataclasses.asdict(self).items() if k not in lists},
                "buckets": dict(sorted(self.buckets.items())), "utilisation": round(self.utilisation, 4),
                "step_seconds": round(self.step_seconds, 4), "host_seconds": round(self.host_seconds, 4),
                "logits_seconds": round(self.logits_seconds, 4)}


class Engine:
    """Continuous batching over a `Decoder`'s executor.

    Args:
      decoder: the decoder whose executor runs the steps and whose checks requests pass.
      max_batch: the most requests decoding at once (rows of the shared K/V cache); default
        the largest batch bucket of the executor whose cache fits `POOL_BYTES`.
      max_tokens: slots per row (prompt + generation + a schedule's overhang), default the
        decoder's limit (`Decoder.max_tokens`).
      max_waiting: requests that may wait for a row (None: unbounded); `submit` refuses more.
      padding: how a group of steps that fills no batch bucket runs (`PADDING`; default the
        executor's `engine_padding`).
    """

    def __init__(self, decoder: Decoder, *, max_batch: int | None = None, max_tokens: int | None = None,
                 max_waiting: int | None = None, padding: str | None = None):
        if padding is not None and padding not in PADDING:
            raise ConfigError(f"padding={padding!r}: known {', '.join(PADDING)}")
        if padding == "free" and decoder.executor.engine_padding != "free":
            raise ConfigError("padding='free' needs an executor that computes only a call's live rows "
                              "(JaxExecutor(rows='each'))")
        self._padding = padding
        self.padding = padding or decoder.executor.engine_padding  # settled when a run starts (`_open`)
        self.decoder = decoder
        caps = decoder.capabilities
        limit = decoder.max_tokens
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 0):
            raise ConfigError(f"max_tokens={max_tokens!r} must be a positive integer")
        self.max_tokens = min(max_tokens or limit, limit)
        if max_batch is None:
            max_batch = default_batch(self.decoder, self.max_tokens)
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch <= 0:
            raise ConfigError(f"max_batch={max_batch!r} must be a positive integer")
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self._batches = caps.batches.sizes
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}  # row -> request
        self._ids = itertools.count()
        self._pool: KVCache | None = None
        self._end_session: Callable[[], None] | None = None
        self._prefetched: list[Callable[[], None]] = []  # `Executor.prefetch_engine`'s cancels, this run's
        self._lock = threading.RLock()  # submit from any thread; one tick at a time
        self._cond = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.stats = EngineStats()

    # -- before the first request ---------------------------------------------------------

    def warmup(self, configs: Sequence[DecodeConfig], *, prompt_lens: Sequence[int] | None = None) -> int:
        """Build every program the engine's calls can run for requests decoded with `configs`
        and prompts of `prompt_lens` tokens (default: every length whose prompt + generation
        fits a row), so that such requests wait for no compile: each step shape those decodes
        plan, at each batch size a call may take under the engine's padding, on the engine's
        pooled cache, and a CPU path's steps on a row of it. Returns how many step programs
        were new (0 when everything was built before, in this process or the persistent
        compile cache's earlier ones are loaded instead of compiled)."""
        dec = self.decoder
        main: set[BucketKey] = set()
        cpu: set[BucketKey] = set()
        logits: list[tuple[DecodeConfig, set[BucketKey]]] = []  # steps whose logits a config asks about
        for config in configs:
            cfg = dec._for_model(config)
            logits.append((cfg, set()))
            top = self.max_tokens - cfg.gen_len - cfg.scheduler.overhang()
            for n in prompt_lens if prompt_lens is not None else range(1, top + 1):
                if n > top:
                    continue
                ours, theirs = dec._keys_of([n], cfg)
                main.update(ours)
                cpu.update(theirs)
                logits[-1][1].update(k for k in ours if k.full_logits)
        calls = {dataclasses.replace(k, batch=b) for k in main for b in self._warm_batches(k)}
        new = dec.executor.warmup_engine(sorted(calls), slots=self.max_tokens, rows=self.max_batch)
        if cpu:  # llada.cpp's refresh: a request's CPU-path steps run alone, on its row (`RowCache.snapshot`)
            new += dec.cpu_executor().executor.warmup_engine(sorted(cpu), slots=self.max_tokens,
                                                              rows=self.max_batch, views=True)
        shapes = [(cfg, [(b, k.rows) for k in keys for b in self._warm_batches(k)]) for cfg, keys in logits]
        for cfg, reached in shapes:  # sampling, penalties, bias, logprobs beside the step
            warm_logits(dec.executor, cfg, reached)
        warm_mixed_logits(dec.executor, shapes)  # a call's requests of several configs together
        return new

    def _warm_batches(self, key: BucketKey) -> list[int]:
        """The batch sizes of the calls a step of `key` may join (`_groups`, `_call`)."""
        sizes = self._call_sizes(key)
        top = next((b for b in sizes if b >= self.max_batch), sizes[-1])
        if self.padding == "free":
            return [top]
        if self.padding == "split" and self.replicas == 1:
            return [b for b in sizes if b <= self.max_batch] or sizes[:1]
        return [b for b in sizes if b <= top]

    # -- requests ---------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], config: DecodeConfig, *, seed: int | None = None,
               stop: Callable[[np.ndarray], int | None] | None = None,
               suffix: Sequence[int] | None = None) -> Request:
        """Queue a request (token ids) decoded with `config`; returns its handle at once.

        `seed` seeds its sampling (default `config.proposer.seed`); `stop(final_ids)` may end
        it after any step: it returns how many of the final ids to keep, or None to go on;
        `suffix` (token ids) follows its generation: the generation is decoded between the
        prompt and it (infilling, `Decoder.with_infill`).

        Raises (before the request takes a row or a place in the queue): InputError for ids
        outside the vocabulary or a bad seed; ConfigError for options the decoder refuses and
        for a prompt + generation longer than a row (`max_tokens`), naming the limit; and
        ConfigError when `max_waiting` requests already wait.
        """
        ids = np.asarray(prompt)
        seed = config.proposer.seed if seed is None else seed
        dec = self.decoder
        dec.check_prompts([ids], [seed])
        if ids.ndim != 1 or len(ids) == 0:
            raise InputError("a request's prompt must be a non-empty sequence of token ids")
        suffix = None if suffix is None or len(suffix) == 0 else suffix
        cfg = dec.with_infill(dec._for_model(config), None if suffix is None else [suffix], prompt_len=len(ids),
                              limit=min(self.max_tokens, dec.max_tokens))
        suffix = None if suffix is None else np.asarray(suffix, np.int32)
        dec.bucket_keys([len(ids)], cfg)  # every check of the decoder, with its own messages
        if cfg.placement.probe() is not None:
            raise ConfigError(f"{type(cfg.placement).__name__} is calibrated by a probe decode first "
                              f"(`Model.calibrated(config, prompts)`; `dlm_jax.Engine` does it per request): "
                              f"submit the calibrated config")
        total = dec.slots(len(ids), cfg)
        if total > self.max_tokens:
            raise ConfigError(f"prompt ({len(ids)} tokens) + gen_len ({cfg.gen_len})"
                              + ("" if suffix is None else f" + suffix ({len(suffix)} tokens)")
                              + f" = {total} tokens exceeds the engine's {self.max_tokens} slots per request "
                                f"(max_tokens)")
        with self._cond:
            if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"the engine's queue is full ({self.max_waiting} requests waiting)")
            req = Request(self, next(self._ids), ids.astype(np.int32), cfg, int(seed), stop, suffix)
            self._waiting.append(req)
            self._cond.notify_all()
        return req

    @property
    def replicas(self) -> int:
        """The replicas the engine places requests' cache rows in: the executor's
        `engine_replicas` (a JAX executor's mesh dp) where they divide `max_batch` and a batch
        bucket of at least `max_batch` rows, else 1. Replica d holds cache rows d * max_batch /
        replicas onwards; a request takes a free row of the replica running the fewest, and
        every call lays its batch rows out in one equal chunk per replica, replica d's
        requests first in chunk d, so that each replica computes its own rows over its own
        cache rows (`dlm_jax.executors.jax_executor.replica_local`)."""
        r = self.decoder.executor.engine_replicas
        if r <= 1 or self.max_batch % r:
            return 1
        allowed = self.decoder.executor.engine_batches or self._batches
        return r if any(b % r == 0 and b >= self.max_batch for b in allowed) else 1

    def _replica(self, row: int) -> int:
        return row // (self.max_batch // self.replicas)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> bool:
        """One tick: retire cancelled requests, admit waiting ones into free rows, run one step
        of every running request (in as few calls as their shapes allow), retire those that
        ended. Returns False when there was nothing to do."""
        with self._cond:
            t0 = time.perf_counter()
            for row, req in list(self._running.items()):
                if req._cancel:
                    self._end(req, CANCELLED)
            for req in [r for r in self._waiting if r._cancel]:
                self._waiting.remove(req)
                self._end(req, CANCELLED)
            if self._waiting and self._pool is None:
                self._open()
            self._admit()
            if not self._running:
                self._close_pool()
                self._cond.notify_all()
                return False
            ran = 0.0
            for group in self._groups():
                ran += self._call(group)
            self.stats.ticks += 1
            host = time.perf_counter() - t0 - ran
            self.stats.step_seconds += ran
            self.stats.host_seconds += host
            self.stats.tick_host_seconds.append(host)
            self._cond.notify_all()
            return True

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Tick until every request has ended (or `until()` holds)."""
        while not (until is not None and until()):
            if not self.step():
                return

    @property
    def running_in_background(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and threading.current_thread() is not self._thread

    def start(self) -> None:
        """Run the ticks on a background thread (daemon) until `close`: handles then wait for it."""
        if self._thread is not None:
            return
        self._stop = False

        def loop() -> None:
            while True:
                with self._cond:
                    while self.idle and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001 - a fault outside any one request's step (opening
                    self._fail_all(e)  # the cache, say) ends the requests it reached; the thread goes on

        self._thread = threading.Thread(target=loop, name="dlm-jax-engine", daemon=True)
        self._thread.start()

    def _fail_all(self, error: BaseException) -> None:
        """End every request with `error` (failed) and release the cache, so that a thread
        whose tick raised serves the next requests afresh instead of leaving these waiting."""
        with self._cond:
            for req in list(self._waiting) + list(self._running.values()):
                if req in self._waiting:
                    self._waiting.remove(req)
                req.error = error
                self._end(req, FAILED)
            try:
                self._close_pool()
            except Exception:  # noqa: BLE001 - the pool may be what failed; drop it
                self._pool = self._end_session = None
            self._cond.notify_all()

    def cancel_all(self) -> int:
        """Cancel every waiting and running request (each ends `cancelled` at the next tick);
        returns how many there were."""
        with self._cond:
            reqs = list(self._waiting) + list(self._running.values())
            for req in reqs:
                req.cancel()
            self._cond.notify_all()
        return len(reqs)

    def close(self) -> None:
        """Cancel what is left, stop the thread, release the shared cache."""
        with self._cond:
            for req in list(self._waiting) + list(self._running.values()):
                req.cancel()
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()
        self._thread = None
        with self._cond:
            self.step()
            self._close_pool()

    def _close_pool(self) -> None:
        """The run of requests is over: the cache released, the executor told (`session`)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
            end, self._end_session = self._end_session, None
            cancels, self._prefetched = self._prefetched, []
            for cancel in cancels:  # (the compiles not started: none of this run's requests waits for them)
                cancel()
            if end is not None:
                end()

    # -- inside a tick ----------------------------------------------------------------------

    def _open(self) -> KVCache:
        """The engine's K/V cache, opened when a run of requests starts (`Executor.session`
        over the buckets of the requests waiting then; the default executor on a CPU picks
        JAX or LiteRT there) and closed when the engine is idle again."""
        if self._pool is None:
            dec = self.decoder
            keys = set()
            for req in list(self._waiting)[:self.max_batch]:
                keys.update(dec.bucket_keys([len(req.prompt)], req.config))
            self._end_session = dec.executor.session(sorted(keys), slots=self.max_tokens)
            self.padding = self._padding or dec.executor.engine_padding  # the executor the session picked
            shape = (self.max_batch, self.max_tokens)
            positions, valid = np.zeros(shape, np.int32), np.zeros(shape, bool)
            self._pool = dec.executor.open(dec.model_config, positions, valid) or HostKVCache(
                dec.executor, dec.model_config, positions, valid)
        return self._pool

    def _admit(self) -> None:
        admitted = []
        free = [r for r in range(self.max_batch) if r not in self._running]
        load = collections.Counter(self._replica(r) for r in self._running)
        while free and self._waiting:
            req = self._waiting.popleft()
            row = min(free, key=lambda r: (load[self._replica(r)], r))  # the least busy replica's first
            free.remove(row)
            load[self._replica(row)] += 1
            pool = self._pool
            req._row = row
            req.status = RUNNING
            req.stats.queued_seconds = time.perf_counter() - req._submitted
            self._running[row] = req
            self.stats.admitted += 1

            def open_cache(state: DecodeState, req=req, row=row) -> KVCache:
                pool.assign(row, state.positions[0], state.valid[0])
                return RowCache(pool, row)

            def on_step(state: DecodeState, req=req) -> None:
                self._after_step(req, state)

            def on_block(unit: int, prefixes, req=req) -> None:
                req.unit = unit
                if req.stats.first_block_seconds is None:
                    req.stats.first_block_seconds = time.perf_counter() - req._submitted
                if req.on_unit is not None:
                    req.on_unit(unit, prefixes)

            req._gen = self.decoder.steps([req.prompt], req.config, seeds=[req.seed], on_block=on_block,
                                          on_step=on_step, open_cache=open_cache, prefetch=False, batch=1,
                                          suffixes=None if req.suffix is None else [req.suffix])
            self._advance(req, None)
            admitted.append(req)
        if admitted:
            self._prefetch(admitted)

    def _prefetch(self, reqs: list[Request]) -> None:
        """Queue the programs the admitted requests' steps will likely run on the executor's
        background compile threads (`Executor.prefetch_engine`; none where it has no threads),
        first reached first: each of their steps' buckets at the batch of a call of all the
        running requests (requests admitted together step together until their blocks part).
        A step then waits for its own program only, as a decode's do (`Decoder.steps`), instead
        of compiling (or loading) each program when it first reaches it."""
        dec, n = self.decoder, len(self._running)
        keys: dict[BucketKey, None] = {}
        cpu: dict[BucketKey, None] = {}  # a CPU path's steps: each request's alone, on its row
        for req in reqs:
            main, theirs = dec._keys_of([len(req.prompt)], req.config)
            keys.update((dataclasses.replace(k, batch=self._call_batch(k, n)), None) for k in _use_order(main))
            cpu.update(dict.fromkeys(_use_order(theirs)))
        self._prefetched.append(dec.executor.prefetch_engine(list(keys), slots=self.max_tokens, rows=self.max_batch))
        if cpu:
            self._prefetched.append(dec.cpu_executor().executor.prefetch_engine(
                list(cpu), slots=self.max_tokens, rows=self.max_batch, views=True))

    def _call_batch(self, key: BucketKey, n: int) -> int:
        """The batch of the first call of n running requests whose steps share `key` (`_groups`,
        `_call`)."""
        sizes = self._call_sizes(key)
        want = self.max_batch if self.padding == "free" else n
        if self.replicas > 1:
            want = max(want, self.replicas * -(-n // self.replicas))
        elif self.padding == "split":  # the largest call the requests fill
            want = max((b for b in sizes if b <= n), default=want)
        return next((b for b in sizes if b >= want), sizes[-1])

    def _after_step(self, req: Request, state: DecodeState) -> None:
        """After each of the request's steps: stream what became final, ask its stop rule (the
        final prefix only grows: nothing to do while it has not)."""
        req.stats.steps += 1
        if state.logprobs is not None:
            req._state = state  # (read when asked: no copy per step)
        if not state.final_beyond(0, len(req.final)):
            return
        final = state.final_prefixes()[0]
        if len(final) > len(req.final):
            now = time.perf_counter() - req._submitted
            if req.stats.first_token_seconds is None:
                req.stats.first_token_seconds = now
            req.stats.last_token_seconds = now
            req._emit(final[len(req.final):])
            req.final = final
        if req.stop is not None:
            keep = req.stop(final)
            if keep is not None:
                req.final = final[:keep]
                req._cancel = "stop"

    def _advance(self, req: Request, out: StepOutputs | None) -> None:
        """Hand a request its outputs (None: start it); keep its next step, or retire it."""
        try:
            req._pending = req._gen.send(out) if out is not None else next(req._gen)
        except StopIteration as stop:
            req.output = stop.value
            self._end(req, DONE)
            return
        except Exception as e:  # noqa: BLE001 - a request's fault ends that request only
            req.error = e
            self._end(req, FAILED)
            return
        if req._cancel == "stop":
            self._end(req, STOPPED)

    def _end(self, req: Request, status: str) -> None:
        if req._gen is not None:
            req._gen.close()
            req._gen = None
        req._pending = None
        if self._running.get(req._row) is req:
            del self._running[req._row]
        req.status = status
        now = time.perf_counter() - req._submitted
        req.stats.seconds = now
        if req.output is not None:
            stats = req.output.stats
            req.stats.decode = stats
            req.stats.nfe = stats.request_nfe[0] if stats.request_nfe else 0
        tokens = req.tokens()
        req.stats.tokens = len(tokens)
        tail = tokens[len(req.final):] if len(tokens) >= len(req.final) else np.zeros(0, np.int32)
        req._emit(tail, end=status)
        self.stats.retired[status] = self.stats.retired.get(status, 0) + 1
        req._ended.set()

    def _groups(self) -> list[list[Request]]:
        """The running requests' pending steps, in groups that share one call: the same bucket
        (the cache size aside where the cache reads in place), first admitted first."""
        free = getattr(self._pool, "read_bucket_free", False)
        groups: dict[tuple, list[Request]] = {}
        for row in sorted(self._running, key=lambda r: self._running[r].id):
            req = self._running[row]
            if req._pending is None:
                continue
            k = req._pending.key
            cache = ("any", k.cache > 0) if free else k.cache
            flags = (k.full_logits, k.router_topk, k.ffn_active, req._pending.want, req._pending.lora_gate is not None)
            groups.setdefault((k.window, cache, k.rows, flags), []).append(req)
        out = []
        for _, reqs in sorted(groups.items(), key=lambda kv: kv[1][0].id):
            sizes = self._call_sizes(reqs[0]._pending.key)
            if self.replicas > 1:  # as many per replica as a chunk of the largest call holds
                per, calls, counts = sizes[-1] // self.replicas, [[]], collections.Counter()
                for req in reqs:
                    d = self._replica(req._row)
                    if counts[d] == per:
                        calls.append([])
                        counts.clear()
                    calls[-1].append(req)
                    counts[d] += 1
                out.extend(calls)
                continue
            while reqs:
                n = next((b for b in sizes if b >= len(reqs)), sizes[-1])
                if self.padding == "free":
                    n = len(reqs[:sizes[-1]])
                if self.padding == "split" and n > len(reqs):  # no padding row: the largest call that fills
                    n = max((b for b in sizes if b <= len(reqs)), default=n)
                out.append(reqs[:n])
                reqs = reqs[n:]
        return out

    def _call_sizes(self, key: BucketKey) -> list[int]:
        """The batch sizes a call of this bucket can have (a fixed bucket set may lack some)."""
        caps = self.decoder.capabilities
        allowed = self.decoder.executor.engine_batches or caps.batches.sizes
        sizes = [b for b in allowed if caps.keys is None or dataclasses.replace(key, batch=b) in caps.keys]
        if self.replicas > 1:  # every replica an equal chunk
            sizes = [b for b in sizes if b % self.replicas == 0]
        return sizes or [1]

    def _call(self, reqs: list[Request]) -> float:
        """Run one call of these requests' steps; hand each its row. Returns the seconds it took."""
        sizes = self._call_sizes(reqs[0]._pending.key)
        want = self.max_batch if self.padding == "free" else len(reqs)
        at = None
        if self.replicas > 1:  # chunk d of the batch: replica d's requests, then its padding
            by = collections.Counter(self._replica(r._row) for r in reqs)
            want = max(want, self.replicas * max(by.values()))
        batch = next((b for b in sizes if b >= want), sizes[-1])
        if self.replicas > 1:
            chunk, seen = batch // self.replicas, collections.Counter()
            at = []
            for req in reqs:
                d = self._replica(req._row)
                at.append(d * chunk + seen[d])
                seen[d] += 1
        merged = merge([r._pending for r in reqs], [r._row for r in reqs], batch,
                       mask_id=self.decoder.model_config.mask_token_id, at=at)
        t0 = time.perf_counter()
        try:
            out = self._pool.step(merged)
        except Exception as e:  # noqa: BLE001 - the call failed: so did its requests, not the others
            for req in reqs:
                req.error = e
                self._end(req, FAILED)
            return time.perf_counter() - t0
        ran = time.perf_counter() - t0
        self.stats.calls += 1
        self.stats.rows += len(reqs) if self.padding == "free" else batch  # free padding rows are not computed
        self.stats.busy_rows += len(reqs)
        self.stats.buckets[str(merged.key)] = self.stats.buckets.get(str(merged.key), 0) + 1
        self.stats.call_seconds.append(ran)
        for i, req in enumerate(reqs):
            self._advance(req, split(out, i if at is None else at[i]))
        self._answer(reqs)
        moved = self._pool.transfers
        self.stats.h2d_bytes.append(moved.h2d[-1] if moved.h2d else 0)
        self.stats.d2h_bytes.append(moved.d2h[-1] if moved.d2h else 0)
        return ran

    def _answer(self, reqs: list[Request]) -> None:
        """The questions the call's requests ask of its logits kept on the device (sampling,
        penalties, bias, then log-probabilities: `LogitsAsk`), answered together, one device
        call per kind, until each request holds its next step."""
        while asking := [r for r in reqs if isinstance(r._pending, LogitsAsk)]:
            t0 = time.perf_counter()
            try:
                answers = answer([r._pending for r in asking])
            except Exception as e:  # noqa: BLE001 - as a failed call: its requests fail, not the others
                for req in asking:
                    req.error = e
                    self._end(req, FAILED)
                return
            self.stats.logits_calls += len({type(r._pending) for r in asking})
            self.stats.logits_seconds += time.perf_counter() - t0
            for req, got in zip(asking, answers):
                self._advance(req, got)


def merge(steps: Sequence[SlotStep], rows: Sequence[int], batch: int, *, mask_id: int,
          at: Sequence[int] | None = None) -> SlotStep:
    """One `SlotStep` of `batch` rows from batch-1 steps of one shape (the read bucket may
    differ: each row's reads are padded with -1 to the largest, and its hidden window columns
    moved with them), step i in batch row `at[i]` (default i) on cache row `rows[i]`; the
    other batch rows are padding (read and write nothing)."""
    first = steps[0]
    n = len(steps)
    if n > batch:
        raise ValueError(f"{n} steps do not fit a call of batch {batch}")
    p = max(s.key.cache for s in steps)
    key = dataclasses.replace(first.key, batch=batch, cache=p)
    order: list[int | None] = list(range(n)) + [None] * (batch - n)  # batch row -> step (None: padding)
    if at is not None:
        order = [None] * batch
        for i, b in enumerate(at):
            order[b] = i
    wide = [s.widened(p) for s in steps]  # window columns follow the cache's

    def rows_of(name: str, fill, dtype, of=steps) -> np.ndarray:
        first = getattr(of[0], name)
        out = np.full((batch,) + (first.shape[1:] if first.ndim >= 2 else first.shape or (1,)), fill, dtype)
        for b, i in enumerate(order):
            if i is not None:
                out[b] = getattr(of[i], name)  # a batch-1 step's row (its one row, or a 1-d array)
        return out

    lengths = [0 if i is None else int(steps[i].lengths()[0]) for i in order]
    return SlotStep(key=key, tokens=rows_of("tokens", mask_id, np.int32), positions=rows_of("positions", 0, np.int32),
                    q_valid=rows_of("q_valid", False, bool), read=rows_of("read", -1, np.int32, wide),
                    probes=rows_of("probes", False, bool), hide=rows_of("hide", -1, np.int32, wide),
                    write=rows_of("write", -1, np.int32), logit_rows=rows_of("logit_rows", 0, np.int32),
                    want=first.want, written_only=first.written_only, geometry=None,
                    read_len=np.asarray(lengths, np.int32),
                    lora_gate=None if first.lora_gate is None else rows_of("lora_gate", 1.0, np.float32),
                    rows=np.asarray([-1 if i is None else rows[i] for i in order], np.int32))


def split(out: StepOutputs, i: int) -> StepOutputs:
    """Batch row `i` of a call's outputs, as a batch-1 step's."""
    def row(name: str, axis: int):
        x = getattr(out, name)
        if x is None:
            return None
        if is_device_logits(x):
            return x.rows([i])  # (a view: the logits stay where the step ran)
        return x[i:i + 1].copy() if axis == 0 else np.take(x, [i], axis=axis)

    return StepOutputs(top_token=row("top_token", 0), top_prob=row("top_prob", 0), second_prob=row("second_prob", 0),
                       entropy=row("entropy", 0), logits=row("logits", 0), router_topk=row("router_topk", 1),
                       ffn_active=row("ffn_active", 1))

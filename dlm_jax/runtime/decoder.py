"""The decode loop (NumPy only): state -> scheduler -> executor -> proposer -> commit rule ->
revision -> state, until the scheduler has nothing left to plan.

Every strategy hook is declared, with a default, by its base class (`Scheduler`,
`RevisionPolicy`, `PlacementPolicy`, `Executor`) and called here directly, in this order:

  checks             scheduler.for_model (the schedule fit to the model's blocks, used from here
                     on), scheduler.validate (the model and the other strategies), scheduler.overhang
                     (slots past the generation its windows reach), scheduler.wants_logits
  before the decode  scheduler.start; revision.cpu_path (executor.fork, once per decoder);
                     executor.open (the decode's KVCache); placement.begin
  each step          scheduler.plan -> revision.probe -> [commit rule.begin at a unit's first
                     step] -> cpu_path.submit -> request built -> placement.before_step ->
                     cache.step (K/V stored where it runs) -> proposer.propose -> rule.select ->
                     scheduler.ask -> scheduler.settle -> revision.commit -> revision.after_step ->
                     revision.after_probes (if the plan had probes) -> cpu_path.merge ->
                     placement.after_step -> rule.finished -> scheduler.advance
  after the decode   cpu_path.close; cache.close; placement.end; scheduler.report (DecodeStats.speculation)
Warm-up (`warmup`) calls executor.prepare and executor.warmup (and the fork's warmup for a CPU
path's buckets) with the buckets of scheduler.plan_shapes, revision.plan_shapes and
revision.cpu_shapes; `DecodeStats` counts what the executors compiled or exported during the
decode (`executor.build_counts`), which is zero after a warm-up.

The loop names no cache mode and no rule, and holds no tensors. A plan may place each batch
row's window at its own slot and give each row its own cache length (`StepPlan.offset`,
`cache_len`): requests then advance at their own pace (ISD, left to right), and a schedule
that verifies its own drafts commits in `settle` (with the `none` rule). Each step the scheduler plans
the slots to compute, read and predict; the request builder pads them, as indices, to a
bucket the executor can run; the executor's cache reads the slots, runs the step, stores the
window's K/V where the plan says, and returns predictions; the
proposer turns them into tokens and confidences; the unit's commit rule picks what to keep;
the revision policy may revisit; the rule says when the unit is done and the scheduler
advances. Everything a decode needs compiled is known before its first step
(`bucket_keys`, from the scheduler's plan shapes).

Axes: B batch (bucketed), S slots, R predicted rows of a step.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import ConfigError, InputError
from dlm_jax.runtime.buckets import BucketKey, infill_slots
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.inputs import StepInputBuilder
from dlm_jax.runtime.kvcache import HostKVCache, KVCache
from dlm_jax.runtime.revision import NoRevision
from dlm_jax.runtime.proposer import Proposer, predict_ask, predicted
from dlm_jax.runtime.cpu_path import CpuExecutor
from dlm_jax.runtime.state import DecodeState, TokenLogprobs, TokenState, take
from dlm_jax.runtime.step import (BuildCounts, Capabilities, Executor, LogitsAsk, LogprobsAsk, OutputRequest,
                                  ProposeAsk, SlotStep, StepOutputs, answer)

_USEFUL = np.zeros(max(TokenState) + 1, bool)
_USEFUL[[TokenState.MASK, TokenState.CANDIDATE, TokenState.DRAFT]] = True


@dataclasses.dataclass
class DecodeStats:
    nfe: int = 0  # forward passes of the batch
    request_nfe: list[int] = dataclasses.field(default_factory=list)  # passes each request took part in
    tokens_committed: int = 0
    seconds: float = 0.0
    first_block_seconds: float | None = None  # time to the first completed block
    commit_histogram: dict[int, int] = dataclasses.field(default_factory=dict)  # tokens/step -> count
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # executor time per step
    host_seconds: list[float] = dataclasses.field(default_factory=list)  # host time per step
    prep_seconds: list[float] = dataclasses.field(default_factory=list)  # of which building inputs
    peak_rss_mb: float = 0.0
    buckets: dict[str, int] = dataclasses.field(default_factory=dict)  # bucket key -> steps run in it
    counters: dict[str, int] = dataclasses.field(default_factory=dict)  # events of schedulers and policies
    compiles: int = 0  # programs compiled (or signatures set up) during the decode, CPU path included
    compile_seconds: float = 0.0
    compile_wait_seconds: float = 0.0  # of which the decode waited for (the rest ran beside its steps)
    widened_steps: int = 0  # steps run padded in a wider window's program while theirs compiled (tiered)
    exports: int = 0  # buckets exported during the decode (the bundle cache)
    export_seconds: float = 0.0
    # Bytes between the host and where the step runs (`KVCache.transfers`): once when the
    # decode's cache was made, then per step (the CPU path's steps included) in and out.
    opened_bytes: int = 0
    h2d_bytes: list[int] = dataclasses.field(default_factory=list)
    d2h_bytes: list[int] = dataclasses.field(default_factory=list)
    # What a speculative schedule measured (`Scheduler.report`; ISD and left to right): counts
    # summed over requests, merged across decodes by `merge_speculation`. See `tpf`, `alpha`,
    # `iar`, `overhead`.
    speculation: dict = dataclasses.field(default_factory=dict)
    # What the placement policy reports (`PlacementPolicy.end`; expert placement's accounting and
    # its routing trace, which `to_dict` leaves out).
    placement: dict = dataclasses.field(default_factory=dict)

    def record_step(self, candidates: np.ndarray, committed: np.ndarray, key: BucketKey, step_seconds: float,
                    host_seconds: float, prep_seconds: float = 0.0) -> None:
        """Count one step: `candidates` / `committed` [B, R] (rows past the requests are padding);
        `host_seconds` is the host's whole share of it, `prep_seconds` the part building inputs."""
        n = len(self.request_nfe)
        counts = committed.sum(axis=1)[:n].tolist()
        for r, took_part in enumerate(candidates.any(axis=1)[:n].tolist()):
            if took_part:
                self.request_nfe[r] += 1
                self.commit_histogram[counts[r]] = self.commit_histogram.get(counts[r], 0) + 1
        name = str(key)
        self.buckets[name] = self.buckets.get(name, 0) + 1
        self.tokens_committed += sum(counts)
        self.nfe += 1
        self.step_seconds.append(step_seconds)
        self.host_seconds.append(host_seconds)
        self.prep_seconds.append(prep_seconds)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens_committed / max(self.nfe, 1)

    @property
    def tpf(self) -> float | None:
        """Tokens per forward of a request, over a speculative schedule's steps after the
        prompt's (ISD's TPF; None for other schedules)."""
        return speculation_summary(self.speculation).get("tpf")

    @property
    def alpha(self) -> list[float] | None:
        """Per draft position i, the share of verified drafts accepted (alpha_i)."""
        return speculation_summary(self.speculation).get("alpha")

    @property
    def iar(self) -> float | None:
        """The introspective acceptance rate (I-DLM §2) over verified drafts, when measured."""
        return speculation_summary(self.speculation).get("iar")

    @property
    def overhead(self) -> float | None:
        """Query rows computed per emitted token (OH, I-DLM §3.2 and App. B)."""
        return speculation_summary(self.speculation).get("overhead")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_committed / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"nfe": self.nfe, "request_nfe": self.request_nfe,
                "tokens_committed": self.tokens_committed,
                "tokens_per_forward": round(self.tokens_per_forward, 3),
                "seconds": round(self.seconds, 4), "tokens_per_second": round(self.tokens_per_second, 1),
                "first_block_seconds": None if self.first_block_seconds is None else round(self.first_block_seconds, 4),
                "commit_histogram": dict(sorted(self.commit_histogram.items())),
                "median_step_seconds": float(np.median(self.step_seconds)) if self.step_seconds else 0.0,
                "median_host_seconds": float(np.median(self.host_seconds)) if self.host_seconds else 0.0,
                "peak_rss_mb": round(self.peak_rss_mb, 1), "buckets": dict(sorted(self.buckets.items())),
                "counters": self.counters, "compiles": self.compiles,
                "compile_seconds": round(self.compile_seconds, 3),
                "compile_wait_seconds": round(self.compile_wait_seconds, 3), "widened_steps": self.widened_steps,
                "exports": self.exports,
                "export_seconds": round(self.export_seconds, 3), "opened_bytes": self.opened_bytes,
                "h2d_bytes": int(sum(self.h2d_bytes)), "d2h_bytes": int(sum(self.d2h_bytes)),
                "max_step_h2d_bytes": max(self.h2d_bytes, default=0),
                **({"speculation": speculation_summary(self.speculation)} if self.speculation else {}),
                **({"placement": {k: v for k, v in self.placement.items() if k not in ("trace", "stats")}}
                   if self.placement else {})}


def merge_speculation(a: dict, b: dict) -> dict:
    """Two `DecodeStats.speculation` counts summed (decodes of one setting)."""
    if not a or not b:
        return dict(a or b)
    out = dict(a)
    for k, v in b.items():
        if k == "stride":
            continue
        if isinstance(v, dict):
            out[k] = {j: a.get(k, {}).get(j, 0) + v.get(j, 0) for j in sorted(set(a.get(k, {})) | set(v))}
        elif isinstance(v, list):
            out[k] = [x + y for x, y in zip(a.get(k, [0] * len(v)), v)]
        else:
            out[k] = a.get(k, 0) + v
    return out


def speculation_summary(spec: dict) -> dict:
    """The rates of `DecodeStats.speculation` counts: tpf, alpha, iar, overhead, the accepted
    length histogram (empty for a schedule that reports none)."""
    if not spec:
        return {}
    steps, tokens = spec.get("steps", 0), spec.get("tokens", 0)
    verified, accepted = spec.get("verified", []), spec.get("accepted", [])
    iar_n = spec.get("iar_count", 0)
    emitted = spec.get("emitted", tokens)
    return {"stride": spec.get("stride"), "steps": steps, "tokens": tokens, "emitted": emitted,
            "tpf": round(tokens / steps, 4) if steps else None,
            "emitted_tpf": round(emitted / steps, 4) if steps else None,
            "overhead": round(spec.get("query_rows", 0) / tokens, 4) if tokens else None,
            "alpha": [round(a / v, 4) if v else None for a, v in zip(accepted, verified)],
            "verified": list(verified), "accept_histogram": dict(sorted(spec.get("accept_histogram", {}).items())),
            "iar": round(spec.get("iar_sum", 0.0) / iar_n, 4) if iar_n else None}


@dataclasses.dataclass
class DecodeOutput:
    sequences: list[np.ndarray]  # per request: the gen_len generated ids (EOS-filled after a stop)
    stats: DecodeStats
    logprobs: list[TokenLogprobs] | None = None  # per request, beside `sequences`, when the decode records them


def drive(steps: Generator[SlotStep | LogitsAsk, Any, DecodeOutput],
          run: Callable[[SlotStep], StepOutputs]) -> DecodeOutput:
    """Run a decode generator (`Decoder.steps`) to its end, each step through `run`, each
    question to logits kept on the device through `answer`; the generator is closed (its cache
    and CPU path with it) if `run` raises."""
    try:
        req = next(steps)
        while True:
            req = steps.send(answer([req])[0] if isinstance(req, LogitsAsk) else run(req))
    except StopIteration as stop:
        return stop.value
    finally:
        steps.close()


def _wants_logits(cfg: DecodeConfig) -> bool:
    """Whether a decode's steps return the rows' logits (sampling, or a schedule that reads them)."""
    return cfg.proposer.needs_logits or cfg.scheduler.wants_logits()


def logits_on_device(cfg: DecodeConfig, caps: Capabilities) -> bool:
    """Whether a decode's steps keep their logits on the executor's device, where the proposer's
    rules over them run (`Proposer.logits_on`): asked (`device`), or `auto` on an executor that
    keeps them on a GPU or TPU; never for a schedule that reads the logits itself on the host
    (`Scheduler.reads_logits`)."""
    on = cfg.proposer.logits_on
    if on == "host" or not _wants_logits(cfg) or cfg.scheduler.reads_logits(cfg.proposer) or not caps.logits_on:
        return False
    return on == "device" or caps.logits_on in ("gpu", "tpu")


def warm_logits(executor: Executor, cfg: DecodeConfig, shapes: Iterable[tuple[int, int]]) -> int:
    """Run, once, the programs that answer the questions a decode with `cfg` asks of logits
    kept on the device (`LogitsAsk`), for steps of each (batch, logit rows) in `shapes`, so
    that its first steps wait for no compile: its proposals (sampling or not) for any number
    of the step's rows and its log-probabilities for any number of slots (each padded to a
    power of two), and what its schedule asks of them (`Scheduler.warm_asks`). Returns how
    many ran (0 where `cfg` keeps its logits on the host)."""
    if not logits_on_device(cfg, executor.capabilities):
        return 0
    p = cfg.proposer
    asks: list[LogitsAsk] = []
    for batch, rows in sorted(set(shapes)):
        logits = executor.logits_like(batch, rows)
        if logits is None:
            continue
        if _proposes(cfg):
            draws = [True, False] if p.temperature > 0 else [False]
            asks += [_proposal_ask(logits, cfg, n, draw) for n in _row_counts(batch) for draw in draws]
        if p.logprobs >= 0:  # a step's recorded slots, 1 to all its rows (padded to powers of two)
            m = 1
            while m < 2 * batch * rows:
                n = min(m, batch * rows)
                b, i = np.divmod(np.arange(n), rows)
                asks.append(LogprobsAsk(logits, b, i, np.zeros(n, np.int32), p.logprobs))
                m *= 2
    asks += cfg.scheduler.warm_asks(p, sorted(set(shapes)), executor.logits_like, gen_len=cfg.gen_len)
    for ask in asks:  # one at a time: each its own program
        answer([ask])
    return len(asks)


def warm_mixed_logits(executor: Executor, configs: Sequence[tuple[DecodeConfig, Iterable[tuple[int, int]]]]) -> int:
    """Run, once, the proposal programs for calls that mix requests of several configs (each
    with the steps (batch, logit rows) it reaches, `warm_logits`'): for each step shape two or
    more of them reach, at each row count up to the batch, one program with all their options
    on (where a call has fewer rows than there are configs, each row carries the options of
    several). Such a program answers any mix of them in as many rows (`DeviceLogits.answer`
    takes a program with more options where a call's own was never built), so a mixed call
    compiles nothing. Returns how many ran."""
    by_shape: dict[tuple[int, int], list[DecodeConfig]] = {}
    for cfg, shapes in configs:
        if logits_on_device(cfg, executor.capabilities) and _proposes(cfg):
            for shape in set(shapes):
                by_shape.setdefault(shape, []).append(cfg)
    ran = 0
    for (batch, rows), cfgs in sorted(by_shape.items(), key=lambda kv: kv[0]):
        if len(cfgs) < 2 or (logits := executor.logits_like(batch, rows)) is None:
            continue
        for n in _row_counts(batch):
            groups = [cfgs[i::n] for i in range(min(n, len(cfgs)))]  # (the configs, over the rows)
            g = len(groups)
            answer([_merged_ask(logits, group, n // g + (i < n % g)) for i, group in enumerate(groups)])
            ran += 1
    # What schedules ask of the logits (ISD's judges) in calls that mix configs: each schedule's
    # questions with every config's options on at once (the programs that answer them answer
    # a call of any mix: `_logits._Judges.covers`).
    device = [(cfg, shapes) for cfg, shapes in configs if logits_on_device(cfg, executor.capabilities)]
    if len(device) > 1:
        merged = _merged_proposer([cfg for cfg, _ in device])
        gen_len = max(cfg.gen_len for cfg, _ in device)
        schedules: list[tuple[Any, set]] = []  # each schedule once, over the steps its configs reach
        for cfg, shapes in device:
            same = next((s for s in schedules if s[0] == cfg.scheduler), None)
            if same is None:
                schedules.append((cfg.scheduler, set(shapes)))
            else:
                same[1].update(shapes)
        for scheduler, shapes in schedules:
            for ask in scheduler.warm_asks(merged, sorted(shapes), executor.logits_like, gen_len=gen_len):
                answer([ask])
                ran += 1
    return ran


def _merged_proposer(cfgs: Sequence[DecodeConfig]) -> Proposer:
    """A proposer with every option of `cfgs` on (a warm-up's: the program it needs has them
    all): sampling where one samples (the highest temperature); top-k where every filtered one
    sets it (its largest), else top-p (the smallest); penalties where one has them; the
    longest bias."""
    ps = [c.proposer for c in cfgs]
    sampled = [p for p in ps if p.temperature > 0]
    filtered = [p for p in sampled if p.top_k > 0 or p.top_p < 1.0]
    penalized = any(p.presence_penalty or p.frequency_penalty for p in ps)
    top_k = max((p.top_k for p in filtered), default=0) if all(p.top_k > 0 for p in filtered) else 0
    return dataclasses.replace(ps[0], temperature=max((p.temperature for p in ps), default=0.0), top_k=top_k,
                               top_p=min((p.top_p for p in filtered), default=1.0) if filtered and not top_k else 1.0,
                               presence_penalty=1.0 if penalized else 0.0, frequency_penalty=0.0,
                               logit_bias=max((p.logit_bias for p in ps), key=len))


def _merged_ask(logits, cfgs: Sequence[DecodeConfig], n: int) -> ProposeAsk:
    """A proposal ask for `n` rows of `logits` with every option of `cfgs` on (`_merged_proposer`),
    penalties with the widest count."""
    p = _merged_proposer(cfgs)
    penalized = [c for c in cfgs if c.proposer.presence_penalty or c.proposer.frequency_penalty]
    counts = np.full((n, max(c.gen_len for c in penalized)), -1, np.int32) if penalized else None
    return ProposeAsk(logits.rows(np.arange(n) % logits.shape[0]), np.full(n, p.temperature > 0),
                      np.zeros(n, np.uint32), temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                      count_ids=counts, presence=p.presence_penalty, bias=p.logit_bias)


def _proposes(cfg: DecodeConfig) -> bool:
    """Whether a decode with `cfg` asks for proposals of its logits (beside the step)."""
    return cfg.proposer.adjusts or cfg.proposer.temperature > 0


def _row_counts(batch: int) -> list[int]:
    """The rows a call's proposals may take: the powers of two below `batch`, and `batch`."""
    counts, n = [], 1
    while n < batch:
        counts.append(n)
        n *= 2
    return counts + [batch]


def _proposal_ask(logits, cfg: DecodeConfig, n: int, draw: bool) -> ProposeAsk:
    """A proposal ask of `cfg`'s options for `n` rows of `logits` (a warm-up's; rows repeat
    past its batch)."""
    p = cfg.proposer
    counts = np.full((n, cfg.gen_len), -1, np.int32) if p.presence_penalty or p.frequency_penalty else None
    return ProposeAsk(logits.rows(np.arange(n) % logits.shape[0]), np.full(n, draw), np.zeros(n, np.uint32),
                      temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, count_ids=counts,
                      presence=p.presence_penalty, frequency=p.frequency_penalty, bias=p.logit_bias)


def _wants_placement(cfg: DecodeConfig) -> dict[str, bool]:
    """The optional outputs a decode's steps return for its placement policy: the MoE layers'
    routed experts (expert placement), the FFN neuron activity (neuron placement)."""
    return {name: name in cfg.placement.outputs for name in ("router_topk", "ffn_active")}


def _use_order(keys: Sequence[BucketKey]) -> list[BucketKey]:
    """A decode's buckets in the order its steps likely reach them: the cache grows as blocks
    are committed (a decode starts with nothing cached) and the window shrinks."""
    return sorted(keys, key=lambda k: (k.cache, -k.window, -k.rows))


class Decoder:
    """Decodes batches of token-id prompts with any `DecodeConfig` over any `Executor`."""

    def __init__(self, executor: Executor, model_config: ModelConfig):
        if model_config.mask_token_id is None:
            raise ConfigError("the model has no mask token (no mask_token_id in config.json, none declared by "
                              "its tokenizer) and diffusion decoding needs one: pass "
                              "dlm_jax.load(path, mask_token_id=N) or --mask-token-id N")
        self.executor = executor
        self.model_config = model_config
        self._cpu: CpuExecutor | None = None
        self._warm: set[BucketKey] = set()  # buckets warmed for the main executor
        self._keys: dict[tuple, tuple[tuple[BucketKey, ...], ...]] = {}  # _keys_of memo

    @property
    def capabilities(self) -> Capabilities:
        return self.executor.capabilities

    def cpu_executor(self) -> CpuExecutor:
        """The executor of a revision policy's CPU path: the main executor's `fork()` (the
        same weights, programs of its own, for a thread of its own), made once; the main
        executor itself, run in turn, when it cannot fork."""
        if self._cpu is None:
            fork = self.executor.fork()
            self._cpu = CpuExecutor(fork, threaded=fork is not self.executor)
        return self._cpu

    def build_counts(self) -> BuildCounts:
        """What the main executor and the CPU path's fork have compiled or exported so far."""
        counts = self.executor.build_counts()
        if self._cpu is not None and self._cpu.threaded:
            counts = counts + self._cpu.executor.build_counts()
        return counts

    @property
    def max_tokens(self) -> int:
        """The longest prompt + generation this decoder can hold."""
        return min(self.capabilities.max_tokens, self.model_config.max_seq_len)

    @staticmethod
    def slots(prompt_len: int, cfg: DecodeConfig) -> int:
        """The slots a decode of prompts up to `prompt_len` tokens spans with `cfg` (a model's,
        `_for_model`): the prompt, the generation and the schedule's overhang (`DecodeState.total`)."""
        return prompt_len + cfg.gen_len + cfg.scheduler.overhang()

    @property
    def shift(self) -> int:
        return 1 if self.model_config.logit_shift else 0

    def _check(self, lens: Sequence[int], cfg: DecodeConfig) -> None:
        """Reject an empty batch, an empty prompt or a sequence longer than any bucket."""
        if len(lens) == 0:
            raise ConfigError("no prompts given")
        if min(lens) == 0:
            raise ConfigError(f"prompt {list(lens).index(0)} is empty")
        cfg.scheduler.validate(cfg, self.model_config)
        cfg.placement.validate(self.model_config, self.capabilities)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t, _ in cfg.proposer.logit_bias):
            raise ConfigError(f"logit_bias names token {max(t for t, _ in cfg.proposer.logit_bias)}, outside the "
                              f"vocabulary of {vocab}")
        if cfg.proposer.logits_on == "device":
            if not self.capabilities.logits_on:
                raise ConfigError("logits_on='device' needs an executor that keeps a step's logits on its device "
                                  "(the JAX executor, on one device or a mesh); "
                                  "use logits_on='host' or 'auto'")
            if cfg.scheduler.reads_logits(cfg.proposer):
                raise ConfigError(f"logits_on='device' does not go with the {type(cfg.scheduler).__name__} schedule "
                                  f"and these sampling options: it reads the rows' logits on the host; "
                                  f"use logits_on='host' or 'auto'")
        if cfg.proposer.logprobs >= 0 and cfg.revision.cpu_shapes(lens, cfg.gen_len):
            raise ConfigError("logprobs are not recorded beside a CPU path that revises tokens (its steps' logits "
                              "stay there): set refresh_rows=0, or logprobs=-1")
        total = self.slots(max(lens), cfg)
        if total > self.max_tokens:
            over = cfg.scheduler.overhang()
            past = f"suffix ({over} tokens)" if cfg.scheduler.infilled() else f"slots past it ({over})"
            raise self.capabilities.refusal(f"prompt ({max(lens)} tokens) + gen_len ({cfg.gen_len})"
                                            + (f" + {past}" if over else "") + f" = {total} "
                                            f"tokens exceeds the limit of {self.max_tokens} (largest cache bucket "
                                            f"/ max_seq_len)")

    def check_prompts(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int] | None = None, *,
                      what: str = "prompt") -> None:
        """Reject token ids outside [0, vocab_size) (a NaN confidence or a silent wrap-around
        later) and negative or non-integer seeds, naming the prompt (`what`: or the suffix)
        and the id."""
        vocab = self.model_config.vocab_size
        for r, prompt in enumerate(prompts):
            ids = np.asarray(prompt)
            if ids.size == 0:
                continue  # _check names an empty prompt (an empty suffix is none)
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise InputError(f"{what} {r} must be a sequence of integer token ids, got {ids.dtype} "
                                 f"of shape {ids.shape}")
            bad = ids[(ids < 0) | (ids >= vocab)]
            if bad.size:
                raise InputError(f"{what} {r} holds token id {int(bad[0])}, outside the model's vocabulary "
                                 f"[0, {vocab})")
        for s in seeds if seeds is not None else ():
            if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 0:
                raise InputError(f"seed {s!r} must be an integer >= 0")

    def _for_model(self, cfg: DecodeConfig) -> DecodeConfig:
        """`cfg` with the schedule that decodes this model (`Scheduler.for_model`: a block
        schedule of a block-causal model's block size aligns its blocks to the model's)."""
        scheduler = cfg.scheduler.for_model(self.model_config)
        return cfg if scheduler is cfg.scheduler else dataclasses.replace(cfg, scheduler=scheduler)

    def bucket_keys(self, prompt_lens: Sequence[int], cfg: DecodeConfig, *, cpu_path: bool = True) -> list[BucketKey]:
        """Every bucket a decode of one batch with these prompt lengths can use: the
        scheduler's and the revision policy's plan shapes (and, with `cpu_path`, those of the
        policy's CPU path), each in the bucket the executor would run it in. Raises a
        ConfigError naming a bucket the executor lacks."""
        main, cpu = self._keys_of(prompt_lens, self._for_model(cfg))
        return sorted(set(main) | set(cpu)) if cpu_path else list(main)

    def _keys_of(self, prompt_lens: Sequence[int], cfg: DecodeConfig) -> tuple[tuple[BucketKey, ...], ...]:
        """(the main executor's buckets, the CPU path's) of a decode, after its checks;
        memoised, as they depend on the longest prompt, the batch bucket and the config alone."""
        self._check(prompt_lens, cfg)
        caps = self.capabilities
        try:
            batch = caps.batches.select(len(prompt_lens))
        except ConfigError as e:
            raise caps.refusal(str(e)) from None
        memo = (max(prompt_lens), batch, cfg)
        try:
            return self._keys[memo]
        except KeyError:
            pass
        except TypeError:  # a config that cannot be hashed
            memo = None
        logits, placed = _wants_logits(cfg), _wants_placement(cfg)
        shift, gen = self.shift, cfg.gen_len
        shapes = set(cfg.scheduler.plan_shapes(prompt_lens, gen, shift=shift))
        main = {caps.select(batch=batch, window=w, cache=p, rows=r, logits=logits, **placed)
                for w, p, r in shapes}
        for w, p, r in cfg.revision.plan_shapes(prompt_lens, gen, shift=shift, window_shapes=shapes) - shapes:
            if w <= caps.windows.largest and r <= caps.rows.largest:  # wider: refused when planned, none to warm
                main.add(caps.select(batch=batch, window=w, cache=p, rows=r, logits=logits, **placed))
        # The CPU path asks for logits only to predict under the penalties and bias.
        cpu = {caps.select(batch=batch, window=w, cache=p, rows=r, logits=cfg.proposer.adjusts)
               for w, p, r in cfg.revision.cpu_shapes(prompt_lens, gen)}
        keys = (tuple(sorted(main)), tuple(sorted(cpu)))
        if memo is not None:
            self._keys[memo] = keys
        return keys

    def warmup(self, prompt_lens: Sequence[int], cfg: DecodeConfig) -> int:
        """Prepare, ahead of time, every bucket such a decode can reach (on the CPU path's
        fork too); returns how many were new. A decode after it compiles and exports nothing
        (`DecodeStats.compiles` / `exports`).

        The executor is first asked to `prepare` them; one that `prepares_ahead` (the bundle
        cache, which exports them as one part) also every bucket of prompts up to the next
        multiple of 64 tokens, so that later prompts of other lengths find theirs ready."""
        cfg = self._for_model(cfg)
        main, cpu = self._keys_of(prompt_lens, cfg)
        ahead: set[BucketKey] = set()
        if self.executor.prepares_ahead:
            span = min(-(-max(prompt_lens) // 64) * 64, self.max_tokens - cfg.gen_len)
            ahead = {k for n in range(1, span + 1) for k in self.bucket_keys([n] * len(prompt_lens), cfg)}
        self.executor.prepare(sorted(ahead | set(main) | set(cpu)))
        slots = self.slots(max(prompt_lens), cfg)  # the slot grid (`DecodeState.total`)
        new = self.executor.warmup(main, slots=slots)
        self._warm |= set(main)
        warm_logits(self.executor, cfg, [(k.batch, k.rows) for k in main if k.full_logits])
        if cpu:  # the CPU path's steps run as cache snapshots on the fork (or this executor)
            new += self.cpu_executor().executor.warmup(cpu, slots=slots, views=True)
        return new

    def with_infill(self, cfg: DecodeConfig, suffixes: Sequence[Sequence[int]] | None, *,
                    prompt_len: int | None = None, limit: int | None = None) -> DecodeConfig:
        """`cfg` (a model's, `_for_model`) for requests whose generations end before the given
        `suffixes` (token ids per request; None or all empty: none): its schedule over the slots
        after the generation that hold the longest suffix (`Scheduler.with_infill`), a bucket
        of them (`buckets.infill_slots`: requests with suffixes of other lengths share their
        programs) within `limit` slots (default the decoder's) for prompts of up to
        `prompt_len` tokens. Raises ConfigError where the slots after a generation are not
        read (a causal or block-causal model, a schedule that does not read them, a revision
        policy), InputError for ids outside the vocabulary."""
        n = max((len(s) for s in suffixes), default=0) if suffixes is not None else 0
        if n:
            mc = self.model_config
            if mc.attention != "bidirectional":
                raise ConfigError(f"a suffix (infilling) needs a bidirectional model: this one's attention is "
                                  f"{mc.attention}, so no generated slot sees the slots after it")
            if not isinstance(cfg.revision, NoRevision):
                raise ConfigError(f"a suffix (infilling) does not go with the {type(cfg.revision).__name__} revision "
                                  f"policy (its CPU path and probes plan no slots after the generation)")
            self.check_prompts(suffixes, what="suffix")
            top = self.max_tokens if limit is None else limit
            room = None if prompt_len is None else top - prompt_len - cfg.gen_len
            n = infill_slots(n, room)
        return dataclasses.replace(cfg, scheduler=cfg.scheduler.with_infill(n))

    def decode(self, prompts: Sequence[Sequence[int]], cfg: DecodeConfig, *,
               seeds: Sequence[int] | None = None,
               on_block: Callable[[int, list[np.ndarray]], None] | None = None,
               suffixes: Sequence[Sequence[int]] | None = None) -> DecodeOutput:
        """Decode `cfg.gen_len` tokens after each prompt, as one fixed batch.

        Args:
          prompts: token ids per request (non-empty).
          seeds: per-request sampling seeds (default `cfg.proposer.seed` for every request).
          suffixes: per request, token ids that follow its generation (infilling: the tokens are
            decoded between the prompt and the suffix; `with_infill`); None: none.
          on_block: called after each commit unit (block) with (unit index, each request's final
            generated ids so far: `DecodeState.final_prefixes`, which only grow).
        """
        opened: list = []

        def open_cache(state: DecodeState):
            cache = (self.executor.open(self.model_config, state.positions, state.valid)
                     or HostKVCache(self.executor, self.model_config, state.positions, state.valid))
            opened.append(cache)
            return cache

        return drive(self.steps(prompts, cfg, seeds=seeds, on_block=on_block, open_cache=open_cache,
                                suffixes=suffixes), lambda req: opened[0].step(req))

    def steps(self, prompts: Sequence[Sequence[int]], cfg: DecodeConfig, *,
              seeds: Sequence[int] | None = None,
              on_block: Callable[[int, list[np.ndarray]], None] | None = None,
              on_step: Callable[[DecodeState], None] | None = None,
              open_cache: Callable[[DecodeState], KVCache],
              prefetch: bool = True, batch: int | None = None,
              suffixes: Sequence[Sequence[int]] | None = None,
              ) -> Generator[SlotStep | LogitsAsk, Any, DecodeOutput]:
        """The decode loop as a generator: it yields each step's `SlotStep` and takes back the
        step's outputs (whoever runs it: `decode` on the decode's own cache, the engine in a
        step shared with other requests, `dlm_jax.runtime.engine`), and returns the
        `DecodeOutput`. Where the step kept its logits on the device, it then yields the
        questions its proposer and its log-probabilities ask of them (`LogitsAsk`) and takes
        back their answers (`runtime.step.answer`: an engine answers those of one call's
        requests together). `open_cache(state)` gives the decode's `KVCache` (its `snapshot` and
        `write` serve a CPU path; `step` is the driver's); `on_step(state)` runs after every
        step; `prefetch` hands the decode's buckets to `Executor.prefetch`; `batch` the rows of
        its state (default: the executor's batch bucket for the prompts); `suffixes` as
        `decode`'s. Closing the generator ends the decode early (its cache closed, its CPU path
        stopped)."""
        mc = self.model_config
        cfg = self.with_infill(self._for_model(cfg), suffixes, prompt_len=max(map(len, prompts), default=0))
        n = len(prompts)
        if suffixes is not None and len(suffixes) != n:
            raise InputError(f"{len(suffixes)} suffixes for {n} prompts")
        self.check_prompts(prompts, seeds)
        main_keys, cpu_keys = self._keys_of([len(p) for p in prompts], cfg)  # every check first (memoised)
        state = DecodeState.create(prompts, gen_len=cfg.gen_len, batch=batch or self.capabilities.batches.select(n),
                                   mask_id=mc.mask_token_id, vocab_size=mc.vocab_size, eos_ids=mc.eos_ids,
                                   shift=self.shift, seeds=seeds if seeds is not None else [cfg.proposer.seed] * n,
                                   tail=cfg.scheduler.overhang(),
                                   suffixes=suffixes if cfg.scheduler.infilled() else None)
        if cfg.proposer.logprobs >= 0:
            state.track_logprobs(cfg.proposer.logprobs)
        builder = StepInputBuilder(mc, self.capabilities, prefer=self._warm)
        scheduler, proposer, revision, placement = cfg.scheduler, cfg.proposer, cfg.revision, cfg.placement
        units = cfg.units
        stats = DecodeStats(request_nfe=[0] * n)
        want = OutputRequest(kv=False, logits=_wants_logits(cfg), **_wants_placement(cfg),
                             device_logits=logits_on_device(cfg, self.capabilities))
        rule = cfg.rule
        start = time.perf_counter()
        cursor = scheduler.start(state)
        cpu = revision.cpu_path(self.cpu_executor, mc, proposer)
        built = self.build_counts()  # the fork, if any, exists now
        # The decode's K/V, held by the executor (or in NumPy beside one that takes them densely).
        # Buckets not built yet compile in the background, first needed first; a step waits for its own.
        cancels = [self.executor.prefetch(_use_order(main_keys), slots=state.total)] if prefetch else []
        if prefetch and cpu is not None and cpu_keys:
            cancels.append(self.cpu_executor().executor.prefetch(_use_order(cpu_keys), slots=state.total, views=True))
        cache = open_cache(state)
        stored = False
        placed = placement.begin(state, mc)
        try:
            while (plan := scheduler.plan(state, cursor)) is not None:
                t0 = time.perf_counter()
                plan, probed = revision.probe(state, plan)  # leave-one-out rows after the window
                targets = plan.target_index
                if plan.step == 0:
                    rule = cfg.rule.begin(plan.unit_undecided(state), units=units)
                if len(plan.cached) and not stored:
                    raise RuntimeError("the plan reads cached K/V but nothing has been stored yet")
                if cpu is not None and stored:
                    cpu.submit(state, cache, plan)  # runs beside this step; merged after it
                req = builder.build(plan, state, want)
                # Rows of the step still to decide (mask, invisible or draft), of the widest request.
                state.count("useful_rows", int((_USEFUL[take(state.status, plan.window_index)]
                                                & state.active[:, None]).sum(axis=1).max()))
                state.count("window_rows", len(plan.window))
                d = 0 if plan.probes is None else len(plan.probes)
                state.count("logit_rows", len(plan.rows) + d)
                if d:
                    state.count("probe_rows", d)
                decision = placement.before_step(placed, state, plan)
                if decision is not None:
                    state.count("placement_bytes", self.executor.place(decision))
                t1 = time.perf_counter()
                out = yield req  # the driver runs it; K/V stored where the step runs
                t2 = time.perf_counter()
                if plan.store is not None:
                    state.stored(plan.slots(plan.window[plan.store]), req.tokens[:, plan.store], plan.store_rows)
                    stored = True
                scored = state.undecided(targets)
                candidates = scored if plan.current is None else scored & plan.current
                ask = proposer.ask(out, scored, state)  # logits on the device: the driver answers
                proposal = proposer.propose(out, scored, state, (yield ask) if ask is not None else None)
                open_ = ~state.is_final(targets) & state.active[:, None]
                state.record(targets, open_, proposal.confidence)
                committed = rule.select(proposal.confidence, candidates, step=plan.step)
                ask = scheduler.ask(state, plan, proposal, cursor)  # (a rule judging drafts on the device)
                cursor.answer = (yield ask) if ask is not None else None
                accepted = scheduler.settle(state, plan, proposal, cursor)
                if accepted is not None:
                    committed = committed | accepted
                revision.commit(state, plan, proposal, committed)
                revision.after_step(state, plan, proposal, committed)
                if probed is not None:
                    r = len(plan.rows)
                    top, prob = out.top_token[:, r:r + d], out.top_prob[:, r:r + d]
                    if proposer.adjusts:  # re-predicted under the penalties and bias too
                        logits = out.logits[:, r:r + d]
                        ask = predict_ask(proposer, logits, state)
                        top, prob = predicted(proposer, logits, state, (yield ask) if ask is not None else None)
                    revision.after_probes(state, plan, probed, top=top, prob=prob)
                if state.logprobs is not None:
                    logits = out.logits[:, :open_.shape[1]]
                    ask = state.logprobs_ask(targets, open_, logits)
                    state.record_logprobs(targets, open_, logits, (yield ask) if ask is not None else None)
                if cpu is not None:
                    cpu.merge(state, cache)  # the step boundary: delayed merge
                placement.after_step(placed, state, plan, out)
                steps = plan.step + 1
                unit_done = rule.finished(steps, plan.unit_undecided(state))
                width = len(plan.targets) if plan.unit_slots is None else len(plan.unit_slots)
                if not unit_done and steps >= rule.max_steps(width):
                    raise RuntimeError(f"commit rule {rule!r} left unit {plan.unit} unfinished after {steps} steps")
                stats.record_step(candidates | committed, committed, req.key, t2 - t1,
                                  (t1 - t0) + (time.perf_counter() - t2), t1 - t0)
                scheduler.advance(state, cursor, unit_done)
                if unit_done:
                    if stats.first_block_seconds is None:
                        stats.first_block_seconds = time.perf_counter() - start
                    if on_block is not None:
                        on_block(plan.unit, state.final_prefixes())
                if on_step is not None:
                    on_step(state)
        finally:
            for cancel in cancels:  # buckets this decode did not reach are not built for it
                cancel()
            if cpu is not None:
                cpu.close()
            cache.close()
        stats.placement = placement.end(placed, state)
        stats.opened_bytes = cache.transfers.opened
        stats.h2d_bytes, stats.d2h_bytes = list(cache.transfers.h2d), list(cache.transfers.d2h)
        grown = self.build_counts() - built
        stats.compiles, stats.compile_seconds = grown.compiles, grown.compile_seconds
        stats.compile_wait_seconds, stats.widened_steps = grown.compile_wait_seconds, grown.widened_steps
        stats.exports, stats.export_seconds = grown.exports, grown.export_seconds
        stats.counters = dict(sorted(state.counters.items()))
        stats.speculation = scheduler.report(cursor)
        stats.seconds = time.perf_counter() - start
        stats.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        logprobs = None if state.logprobs is None else [state.token_logprobs(r) for r in range(n)]
        return DecodeOutput(state.sequences(), stats, logprobs)

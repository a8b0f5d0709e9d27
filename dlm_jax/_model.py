"""`Model`: a tokenizer and a decoder over any executor, the object `dlm_jax.load` and
`dlm_jax.executors.runner.load_bundle` return.

Sits below both (and below every executor): it imports the NumPy host runtime and the
tokenizer, never JAX, `dlm_jax.api`, the runner or `tflite_export`. The executor comes in
built: `dlm_jax.load` picks it from `dlm_jax.api.EXECUTORS`, the runner opens a bundle's.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._errors import CheckpointError, ConfigError, InputError
from dlm_jax._tokenizer import NoTokenizerError, Tokenizer, load_tokenizer
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.decoder import DecodeStats, Decoder, merge_speculation
from dlm_jax.runtime.state import TokenLogprobs
from dlm_jax.runtime.step import Executor

if TYPE_CHECKING:
    from dlm_jax.models._transformer import Transformer

Prompt = str | Sequence[int]


@dataclasses.dataclass
class GenerateResult:
    texts: list[str] | None  # decoded completions, cut at the first EOS (None: no tokenizer)
    token_ids: list[list[int]]  # completion ids, cut at the first EOS id
    stats: DecodeStats
    logprobs: list[TokenLogprobs] | None = None  # per completion, its ids' (decode option `logprobs`)


class MissingTokenizer:
    """The tokenizer of a checkpoint that ships none: token-id prompts decode, and anything
    that needs text fails with the directory named."""

    vocab_size = 0
    mask_id = eos_id = pad_id = bos_id = None
    prompt_format = "raw"

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def _fail(self, what: str):
        raise CheckpointError(f"{self.directory}: no tokenizer files (tokenizer.json or a dlm-jax "
                              f"tokenizer_config.json), so text cannot be {what}: pass prompts as token ids")

    def encode(self, text: str) -> list[int]:
        self._fail("encoded")

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        self._fail("decoded")

    def token_bytes(self, token_id: int) -> bytes:
        self._fail("decoded")

    def apply_chat(self, messages, *, add_generation_prompt: bool = True) -> list[int]:
        self._fail("encoded")

    def save(self, directory: str | os.PathLike) -> None:
        pass


def stored_tokenizer(directory: str | os.PathLike) -> Tokenizer | MissingTokenizer:
    """The tokenizer stored in a checkpoint or bundle directory, or a `MissingTokenizer` when
    it ships none (corrupt tokenizer files still raise)."""
    try:
        return load_tokenizer(directory)
    except NoTokenizerError:
        return MissingTokenizer(directory)


class Model:
    """A model's tokenizer and a decoder over `executor` (the JAX executor, a LiteRT runner,
    `dlm_jax.testing.MockExecutor`, ...).

    `model` is the Flax `Transformer` the executor runs, or None where there is none (a
    bundle, a mock); `config` defaults to `model.config`. `dlm_jax.load(path, executor=...)`
    builds one from a checkpoint; for a Flax model in hand,
    `Model(m, tokenizer, executor=dlm_jax.api.EXECUTORS["jax"](m, source=""))`."""

    def __init__(self, model: Transformer | None, tokenizer: Tokenizer, *, executor: Executor,
                 config: ModelConfig | None = None):
        if config is None and model is None:
            raise ValueError("Model(None, ...) needs the model config")
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or model.config
        self.executor = executor
        self.decoder = Decoder(self.executor, self.config)

    @property
    def has_tokenizer(self) -> bool:
        return not isinstance(self.tokenizer, MissingTokenizer)

    @property
    def prompt_format(self) -> str:
        """How the model was trained to be prompted: `chat` (the tokenizer's chat template
        wraps a text prompt) or `raw`; recorded in the checkpoint's tokenizer config."""
        return getattr(self.tokenizer, "prompt_format", "raw")

    def encode(self, prompt: Prompt, *, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: text is wrapped in the chat template when `chat` is True, or
        when it is None (the default) and the model's prompt format is `chat`; ids pass as
        they are."""
        if not isinstance(prompt, str):
            try:
                return [operator.index(t) for t in prompt]
            except TypeError:
                raise InputError(f"a prompt must be text or a sequence of integer token ids, got "
                                 f"{type(prompt).__name__} {prompt!r:.60}") from None
        if chat is None:
            chat = self.prompt_format == "chat"
        if chat:
            return self.tokenizer.apply_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt], config: DecodeConfig | None = None, *,
                 chat: bool | None = None, seeds: Sequence[int] | None = None,
                 on_block: Callable[[int, list[str]], None] | None = None,
                 max_batch: int | None = None,
                 suffixes: Prompt | Sequence[Prompt] | None = None) -> GenerateResult:
        """Decode a completion for each prompt (text or token ids), on the continuous-batching
        engine (`dlm_jax.Engine`): at most `max_batch` requests decode at once (default: the
        batch bucket that holds every prompt, capped at the largest whose K/V fit), each
        joining as another ends, so a list longer than the batch streams through it. The
        engine's rows are as long as these requests need (the longest prompt, the generation
        and the schedule's overhang), not the model's limit. Each completion is the one its
        prompt gets alone.

        `chat`: wrap text prompts in the chat template (None: as the model was trained, see
        `prompt_format`; False: the raw text). `on_block(i, texts)` receives the committed text
        of every request when the first of them completes its block i. `suffixes`: one per
        prompt (or one for a single prompt), text (as it is, never wrapped) or token ids that
        follow the completion: each completion is decoded between its prompt and its suffix
        (infilling; a bidirectional model and a block schedule, `Decoder.with_infill`).
        """
        from dlm_jax.runtime.engine import Engine

        config = config or DecodeConfig()
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        batch = [prompts] if single else list(prompts)
        ids = [self.encode(p, chat=chat) for p in batch]
        self.decoder.check_prompts(ids, seeds)
        if not ids:
            raise ConfigError("no prompts given")
        empty = next((n for n, i in enumerate(ids) if len(i) == 0), None)
        if empty is not None:
            raise ConfigError(f"prompt {empty} is empty")
        if seeds is not None and len(seeds) != len(ids):
            raise InputError(f"{len(seeds)} seeds for {len(ids)} prompts")
        tails = self._suffixes(suffixes, len(ids))
        # An executor that builds in batches (the bundle cache exports the buckets of nearby
        # prompt lengths as one part) prepares every reachable bucket first. Others build only
        # what the decode reaches, when it first does: the stats count those compiles.
        if self.decoder.executor.prepares_ahead:
            self.decoder.warmup([len(i) for i in ids], config)
        config = self.calibrated(config, ids, seeds=seeds, suffixes=tails)
        built = self.decoder.build_counts()
        # The engine sized to this call: its pooled K/V (allocated and zeroed per call) holds
        # these requests, not the model's longest rows in the largest batch that fits (a
        # 64-row pool of 512 slots for one prompt of the shipped tiny model: 60% of its decode).
        longest = max(map(len, ids))
        tokens = min(self.decoder.slots(longest, self.decoder.with_infill(self.decoder._for_model(config), tails,
                                                                          prompt_len=longest)),
                     self.decoder.max_tokens)
        if max_batch is None:
            from dlm_jax.runtime.engine import default_batch

            batches = self.decoder.capabilities.batches
            max_batch = min(batches.select(min(len(ids), batches.largest)), default_batch(self.decoder, tokens))
        engine = Engine(self.decoder, max_batch=max_batch, max_tokens=tokens)
        try:
            requests = [engine.submit(i, config, seed=None if seeds is None else seeds[n],
                                      suffix=None if tails is None else tails[n]) for n, i in enumerate(ids)]
            if on_block is not None:  # once per block index, when the first request completes it
                reached = [-1]

                def unit_done(unit: int, prefixes, me) -> None:
                    if unit > reached[0]:
                        reached[0] = unit
                        on_block(unit, [self._text(prefixes[0] if q is me else q.final) for q in requests])

                for r in requests:
                    r.on_unit = lambda unit, prefixes, me=r: unit_done(unit, prefixes, me)
            engine.run()
        finally:
            engine.close()
        failed = next((r for r in requests if r.status == "failed"), None)
        if failed is not None:
            raise failed.error
        trimmed = [[int(t) for t in r.tokens()] for r in requests]
        texts = [self.tokenizer.decode(t) for t in trimmed] if self.has_tokenizer else None
        stats = engine_stats(engine, requests, self.decoder.build_counts() - built)
        logprobs = [r.logprobs() for r in requests]
        return GenerateResult(texts, trimmed, stats, None if logprobs[0] is None else logprobs)

    def _suffixes(self, suffixes, n: int) -> list[list[int]] | None:
        """`generate`'s suffixes as token ids, one per prompt (text encoded as it is)."""
        if suffixes is None:
            return None
        one = isinstance(suffixes, str) or (len(suffixes) > 0 and isinstance(suffixes[0], (int, np.integer)))
        given = [suffixes] if one else list(suffixes)
        if len(given) != n:
            raise InputError(f"{len(given)} suffixes for {n} prompts")
        return [self.tokenizer.encode(s) if isinstance(s, str) else self.encode(s) for s in given]

    def calibrated(self, config: DecodeConfig, ids: list[list[int]], *, seeds=None,
                   suffixes: list[list[int]] | None = None) -> DecodeConfig:
        """`config` with its placement calibrated where it asks for it (`PlacementPolicy.probe`;
        TIDE's `--tau auto`, `--experts static`): from a probe decode of the prompts `ids` (and
        their `suffixes`, token ids, when they infill) whose report the policy calibrates
        itself from. `generate` calls it on its own prompts; calling it once first (on other
        prompts) fixes the placement for later calls."""
        probe = config.placement.probe()
        if probe is None:
            return config
        report = self.decoder.decode(ids, dataclasses.replace(config, placement=probe), seeds=seeds,
                                     suffixes=suffixes).stats.placement
        return dataclasses.replace(config, placement=config.placement.calibrated(report, self.config))

    def _trim(self, seq: np.ndarray) -> list[int]:
        ids = [int(t) for t in seq]
        eos = set(self.config.eos_ids)
        cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        return ids[:cut]

    def _text(self, seq: np.ndarray) -> str:
        mask = self.config.mask_token_id
        return self.tokenizer.decode([t for t in self._trim(seq) if t != mask])


def engine_stats(engine, requests, built) -> DecodeStats:
    """One `DecodeStats` for a set of requests run on an engine (`Model.generate`): `nfe` the
    engine's calls (forwards run), `request_nfe` each request's own, the rest summed or merged
    over the requests (`speculation`, `counters`, `commit_histogram`), the compiles and
    exports `built` while they ran."""
    own = [r.stats.decode for r in requests if r.stats.decode is not None]
    es = engine.stats
    stats = DecodeStats(nfe=es.calls, request_nfe=[r.stats.nfe for r in requests])
    stats.tokens_committed = sum(s.tokens_committed for s in own)
    stats.seconds = max((r.stats.seconds or 0.0 for r in requests), default=0.0)
    firsts = [r.stats.first_block_seconds for r in requests if r.stats.first_block_seconds is not None]
    stats.first_block_seconds = min(firsts) if firsts else None
    stats.step_seconds, stats.host_seconds = list(es.call_seconds), list(es.tick_host_seconds)
    stats.buckets = dict(es.buckets)
    stats.h2d_bytes, stats.d2h_bytes = list(es.h2d_bytes), list(es.d2h_bytes)
    for s in own:
        for k, v in s.commit_histogram.items():
            stats.commit_histogram[k] = stats.commit_histogram.get(k, 0) + v
        for k, v in s.counters.items():
            stats.counters[k] = stats.counters.get(k, 0) + v
        stats.speculation = merge_speculation(stats.speculation, s.speculation)
        stats.peak_rss_mb = max(stats.peak_rss_mb, s.peak_rss_mb)
    stats.counters = dict(sorted(stats.counters.items()))
    if own and own[0].placement:
        stats.placement = dict(own[0].placement)
        for s in own[1:]:
            for k, v in s.placement.items():
                if k in ("steps", "refreshes", "migrations", "misses", "assignments"):
                    stats.placement[k] = stats.placement.get(k, 0) + v
    stats.compiles, stats.compile_seconds = built.compiles, built.compile_seconds
    stats.compile_wait_seconds = built.compile_wait_seconds
    stats.exports, stats.export_seconds = built.exports, built.export_seconds
    return stats

"""The Python decode API: `dlm_jax.load(path).generate(prompts, dlm_jax.preset(...))`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dlm_jax._config import ModelConfig
from dlm_jax._tokenizer import Tokenizer, load_tokenizer
from dlm_jax.runtime.config import DecodeConfig
from dlm_jax.runtime.decoder import DecodeStats, Decoder
from dlm_jax.runtime.step import Executor

if TYPE_CHECKING:
    from dlm_jax.models._transformer import Transformer

Prompt = str | Sequence[int]


@dataclasses.dataclass
class GenerateResult:
    texts: list[str]  # decoded completions, cut at the first EOS
    token_ids: list[list[int]]  # completion ids, cut at the first EOS
    stats: DecodeStats


class Model:
    """A model, its tokenizer and a decoder over an executor: the JAX executor over `model`
    by default, or any `Executor` (a LiteRT runner, `dlm_jax.testing.MockExecutor`) with
    `model=None` and the model's `config`."""

    def __init__(self, model: Transformer | None, tokenizer: Tokenizer, *, executor: Executor | None = None,
                 config: ModelConfig | None = None):
        if model is None and (executor is None or config is None):
            raise ValueError("Model(None, ...) needs an executor and the model config")
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or model.config
        if executor is None:
            from dlm_jax.program import JaxExecutor

            executor = JaxExecutor(model)
        self.executor = executor
        self.decoder = Decoder(self.executor, self.config)

    def encode(self, prompt: Prompt, *, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if chat:
            return self.tokenizer.apply_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt], config: DecodeConfig | None = None, *,
                 chat: bool = False, seeds: Sequence[int] | None = None,
                 on_block: Callable[[int, list[str]], None] | None = None) -> GenerateResult:
        """Decode a completion for each prompt (text or token ids).

        `on_block(i, texts)` receives the committed text of every request after block i.
        """
        config = config or DecodeConfig()
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        batch = [prompts] if single else list(prompts)
        ids = [self.encode(p, chat=chat) for p in batch]
        callback = None
        if on_block is not None:
            callback = lambda i, seqs: on_block(i, [self._text(s) for s in seqs])  # noqa: E731
        # Compile every bucket this decode needs first, so stats time decoding, not compilation.
        self.decoder.warmup([len(i) for i in ids], config)
        out = self.decoder.decode(ids, config, seeds=seeds, on_block=callback)
        trimmed = [self._trim(s) for s in out.sequences]
        return GenerateResult([self.tokenizer.decode(t) for t in trimmed], trimmed, out.stats)

    def _trim(self, seq: np.ndarray) -> list[int]:
        eos = self.config.eos_token_id
        ids = [int(t) for t in seq]
        return ids[: ids.index(eos)] if eos is not None and eos in ids else ids

    def _text(self, seq: np.ndarray) -> str:
        mask = self.config.mask_token_id
        return self.tokenizer.decode([t for t in self._trim(seq) if t != mask])


def load(path: str | os.PathLike, **overrides: Any) -> Model:
    """Load a checkpoint directory (model + tokenizer) ready to generate."""
    from dlm_jax.checkpoint._io import load_pretrained

    return Model(load_pretrained(path, **overrides), load_tokenizer(path))

"""Tokenizers behind one interface: a built-in byte-level tokenizer for the project's own small
models, and HF `tokenizer.json` (through the `tokenizers` library) for real checkpoints.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from dlm_jax._errors import CheckpointError

Message = Mapping[str, str]  # {"role": "user" | "assistant" | "system", "content": str}


class Tokenizer(Protocol):
    """What the runtime and CLI need from a tokenizer."""

    vocab_size: int
    mask_id: int | None
    eos_id: int | None
    pad_id: int | None
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...

    def apply_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]: ...

    def save(self, directory: str | os.PathLike) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then special tokens.

    Specials: <|pad|> 256, <|bos|> 257, <|eos|> 258, <|mask|> 259, <|system|> 260,
    <|user|> 261, <|assistant|> 262, <|end|> 263. Special-token strings inside text encode to
    their ids. Chat: `<|bos|>` then `<|role|>content<|end|>` per message, then `<|assistant|>`.
    """

    SPECIALS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>", "<|system|>",
                                 "<|user|>", "<|assistant|>", "<|end|>")
    CLASS_NAME = "dlm_jax.ByteTokenizer"

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIALS)}
        self.vocab_size = 256 + len(self.SPECIALS)
        self.pad_id = self.special_ids["<|pad|>"]
        self.bos_id = self.special_ids["<|bos|>"]
        self.eos_id = self.special_ids["<|eos|>"]
        self.mask_id = self.special_ids["<|mask|>"]
        self.end_id = self.special_ids["<|end|>"]
        self._split = re.compile("(" + "|".join(re.escape(t) for t in self.SPECIALS) + ")")

    def token_id(self, token: str) -> int:
        return self.special_ids[token]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self.special_ids:
                ids.append(self.special_ids[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})")
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special:
                out.append(self.SPECIALS[i - 256])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        ids = [self.bos_id]
        for m in messages:
            marker = f"<|{m['role']}|>"
            if marker not in self.special_ids or m["role"] == "end":
                raise ValueError(f"unknown chat role {m['role']!r}; expected system, user or assistant")
            ids += [self.special_ids[marker], *self.encode(m["content"]), self.end_id]
        if add_generation_prompt:
            ids.append(self.special_ids["<|assistant|>"])
        return ids

    def save(self, directory: str | os.PathLike) -> None:
        config = {"tokenizer_class": self.CLASS_NAME, "special_tokens": list(self.SPECIALS)}
        _write_json(Path(directory) / "tokenizer_config.json", config)


_MASK_CANDIDATES = ("<|mdm_mask|>", "<|mask|>", "<mask>", "[MASK]")


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer:
    """An HF `tokenizer.json` with special ids from `tokenizer_config.json` / `config.json`."""

    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer as _Tok  # runtime dependency, imported lazily

        directory = Path(directory)
        file = directory / "tokenizer.json"
        try:
            self._tok = _Tok.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise CheckpointError(f"{file}: cannot load tokenizer ({e})") from None
        self._config = _read_optional_json(directory / "tokenizer_config.json")
        model_config = _read_optional_json(directory / "config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = self._config.get("chat_template")

        def special(key: str, *fallback: str) -> int | None:
            if isinstance(model_config.get(f"{key}_token_id"), int):
                return model_config[f"{key}_token_id"]
            for tok in (_token_str(self._config.get(f"{key}_token")), *fallback):
                if tok is not None and self._tok.token_to_id(tok) is not None:
                    return self._tok.token_to_id(tok)
            return None

        self.bos_id = special("bos")
        self.eos_id = special("eos")
        self.pad_id = special("pad")
        self.mask_id = special("mask", *_MASK_CANDIDATES)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return tid

    def apply_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        text = template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=_token_str(self._config.get("bos_token")) or "",
            eos_token=_token_str(self._config.get("eos_token")) or "")
        return self.encode(text)

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        self._tok.save(str(directory / "tokenizer.json"))
        if self._config:
            _write_json(directory / "tokenizer_config.json", self._config)


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def load_tokenizer(directory: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """The tokenizer stored in a checkpoint directory."""
    directory = Path(directory)
    if (directory / "tokenizer.json").exists():
        return HFTokenizer(directory)
    config = _read_optional_json(directory / "tokenizer_config.json")
    if config.get("tokenizer_class") == ByteTokenizer.CLASS_NAME:
        if tuple(config.get("special_tokens", ByteTokenizer.SPECIALS)) != ByteTokenizer.SPECIALS:
            raise CheckpointError(f"{directory / 'tokenizer_config.json'}: special tokens differ "
                                  f"from this version's byte tokenizer")
        return ByteTokenizer()
    raise CheckpointError(f"{directory}: no tokenizer.json and no dlm-jax tokenizer_config.json")

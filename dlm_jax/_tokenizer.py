"""Tokenizers behind one interface: a built-in byte-level tokenizer for the project's own small
models, and HF `tokenizer.json` (through the `tokenizers` library) for real checkpoints.

The HF side reads the files transformers writes: `tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json` and `chat_template.jinja` (transformers 5 stores the chat template
there; older files keep it in tokenizer_config.json's `chat_template`, and the .jinja file wins
when both exist). Its `save` writes those files back byte for byte.

Both tokenizers carry a `prompt_format` ("raw" or "chat"): how the model was trained to be
prompted, stored as `"prompt_format"` in tokenizer_config.json (absent means "raw").
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from dlm_jax._errors import CheckpointError, ConfigError, InputError

Message = Mapping[str, str]  # {"role": "user" | "assistant" | "system", "content": str}

PROMPT_FORMATS: tuple[str, ...] = ("raw", "chat")
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The files of a tokenizer, as transformers writes them (HFTokenizer.save writes these back).
HF_TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", CONFIG_FILE, "special_tokens_map.json",
                                       CHAT_TEMPLATE_FILE)


class Tokenizer(Protocol):
    """What the runtime and CLI need from a tokenizer."""

    vocab_size: int
    mask_id: int | None
    eos_id: int | None
    pad_id: int | None
    bos_id: int | None
    prompt_format: str  # "raw" or "chat": how the model was trained to be prompted

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in text (a piece of a UTF-8 character for a byte
        token: OpenAI's logprobs `bytes`); a special token's own string."""
        ...

    def apply_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]: ...

    def chat_text(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The chat as text, whose `encode` is `apply_chat`'s ids."""
        ...

    def save(self, directory: str | os.PathLike) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then special tokens.

    Specials: <|pad|> 256, <|bos|> 257, <|eos|> 258, <|mask|> 259, <|system|> 260,
    <|user|> 261, <|assistant|> 262, <|end|> 263. Special-token strings inside text encode to
    their ids. Chat: `<|bos|>` then `<|role|>content<|end|>` per message, then `<|assistant|>`.
    `prompt_format` is saved in tokenizer_config.json when it is not "raw".
    """

    SPECIALS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>", "<|system|>",
                                 "<|user|>", "<|assistant|>", "<|end|>")
    CLASS_NAME = "dlm_jax.ByteTokenizer"

    def __init__(self, prompt_format: str = "raw") -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise ConfigError(f"ByteTokenizer prompt_format={prompt_format!r} is not one of {PROMPT_FORMATS}")
        self.prompt_format = prompt_format
        self.special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIALS)}
        self.vocab_size = 256 + len(self.SPECIALS)
        self.pad_id = self.special_ids["<|pad|>"]
        self.bos_id = self.special_ids["<|bos|>"]
        self.eos_id = self.special_ids["<|eos|>"]
        self.mask_id = self.special_ids["<|mask|>"]
        self.eos_ids: tuple[int, ...] = (self.eos_id,)
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
                raise InputError(f"token id {i} is outside the byte tokenizer's vocabulary [0, {self.vocab_size}) "
                                 f"(a model whose vocabulary the tokenizer does not cover)")
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special:
                out.append(self.SPECIALS[i - 256])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        i = int(token_id)
        if not 0 <= i < self.vocab_size:
            raise InputError(f"token id {i} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})")
        return bytes([i]) if i < 256 else self.SPECIALS[i - 256].encode()

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

    def chat_text(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """`apply_chat`'s ids as text, special tokens written out: `encode` reads them back."""
        return self.decode(self.apply_chat(messages, add_generation_prompt=add_generation_prompt), skip_special=False)

    def save(self, directory: str | os.PathLike) -> None:
        config: dict[str, Any] = {"tokenizer_class": self.CLASS_NAME, "special_tokens": list(self.SPECIALS)}
        if self.prompt_format != "raw":
            config["prompt_format"] = self.prompt_format
        _write_json(Path(directory) / CONFIG_FILE, config)


_MASK_CANDIDATES = ("<|mdm_mask|>", "<|mask|>", "<mask>", "[MASK]")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: each byte is a printable character (the
    printable Latin-1 bytes stand for themselves, the others for code points from 256 on, in
    byte order); character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_UNICODE_BYTES = _byte_alphabet()
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPECIAL_ATTRS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")  # transformers' named specials


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    """A config's token id or list of ids (anything else: none)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _prompt_format(config: Mapping[str, Any], path: Path) -> str:
    value = config.get("prompt_format", "raw")
    if value not in PROMPT_FORMATS:
        raise CheckpointError(f"{path}: prompt_format={value!r} is not one of {list(PROMPT_FORMATS)}")
    return value


def _chat_template(config: Mapping[str, Any], directory: Path) -> str | None:
    """chat_template.jinja if present (transformers 5), else tokenizer_config.json's field."""
    jinja = directory / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{jinja}: not UTF-8 text ({e})") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]: the default one
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{directory / CONFIG_FILE}: chat_template is not a string")
    return template


class HFTokenizer:
    """An HF `tokenizer.json` with special ids from `config.json` / `tokenizer_config.json` /
    `special_tokens_map.json` (in that order) and the chat template transformers would use.

    `eos_id` is the first of `eos_ids`: config.json's `eos_token_id` (an id or a list), the
    tokenizer's `eos_token`, then generation_config.json's `eos_token_id`.
    """

    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer as _Tok  # runtime dependency, imported lazily

        directory = Path(directory)
        file = directory / "tokenizer.json"
        try:
            self._tok = _Tok.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise CheckpointError(f"{file}: cannot load tokenizer ({e})") from None
        # The files as they came, for `save`.
        self._files = {name: (directory / name).read_bytes() for name in HF_TOKENIZER_FILES
                       if (directory / name).is_file()}
        self._config = _read_optional_json(directory / CONFIG_FILE)
        special_map = _read_optional_json(directory / "special_tokens_map.json")
        model_config = _read_optional_json(directory / "config.json")
        generation = _read_optional_json(directory / "generation_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = _chat_template(self._config, directory)
        self.prompt_format = _prompt_format(self._config, directory / CONFIG_FILE)
        # Named special tokens as strings, as transformers passes them to chat templates.
        self.special_tokens: dict[str, str] = {}
        for attr in _SPECIAL_ATTRS:
            tok = _token_str(self._config.get(f"{attr}_token")) or _token_str(special_map.get(f"{attr}_token"))
            if tok is not None:
                self.special_tokens[f"{attr}_token"] = tok

        def special(key: str, *fallback: str, model: bool = True) -> int | None:
            value = model_config.get(f"{key}_token_id")
            if model and isinstance(value, int) and not isinstance(value, bool):
                return value
            for tok in (self.special_tokens.get(f"{key}_token"), *fallback):
                if tok is not None and self._tok.token_to_id(tok) is not None:
                    return self._tok.token_to_id(tok)
            return None

        self.bos_id = special("bos")
        self.pad_id = special("pad")
        self.mask_id = special("mask", *_MASK_CANDIDATES)
        eos = _ids(model_config.get("eos_token_id"))
        if (tok_eos := special("eos", model=False)) is not None:
            eos.append(tok_eos)
        eos += _ids(generation.get("eos_token_id"))
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self._template = None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """From the token's vocabulary string, as the tokenizer's decoder reads it: GPT-2's
        byte-level alphabet mapped back to its bytes (`ByteLevel`), `<0xNN>` as byte NN
        (`ByteFallback`), the decoder's `Replace`s or `Metaspace` applied (SentencePiece's ▁
        for a space, not stripped from a first token as `decode` does); otherwise, and for
        added tokens, the string's UTF-8."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise InputError(f"token id {int(token_id)} is outside the tokenizer's vocabulary of {self.vocab_size}")
        if piece in self._added:
            return piece.encode()
        steps = self._decoder_steps
        if "ByteLevel" in steps:
            if all(c in _UNICODE_BYTES for c in piece):
                return bytes(_UNICODE_BYTES[c] for c in piece)
            return piece.encode()
        if "ByteFallback" in steps and _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        for old, new in self._replaces:
            piece = piece.replace(old, new)
        return piece.encode()

    @functools.cached_property
    def _decoder_parts(self) -> list[dict]:
        """The decoder's steps as tokenizer.json states them (a `Sequence`'s, in order)."""
        spec = json.loads(self._tok.to_str()).get("decoder") or {}
        return spec.get("decoders", [spec]) if spec.get("type") == "Sequence" else [spec]

    @functools.cached_property
    def _decoder_steps(self) -> tuple[str, ...]:
        return tuple(p.get("type", "") for p in self._decoder_parts)

    @functools.cached_property
    def _replaces(self) -> tuple[tuple[str, str], ...]:
        parts = self._decoder_parts
        return tuple((p["pattern"]["String"], p["content"]) if p.get("type") == "Replace" else
                     (p.get("replacement", "▁"), " ") for p in parts
                     if (p.get("type") == "Replace" and "String" in (p.get("pattern") or {}))
                     or p.get("type") == "Metaspace")

    @functools.cached_property
    def _added(self) -> frozenset[str]:
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values())

    def token_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return tid

    def apply_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        """The chat rendered as transformers' `apply_chat_template(messages, tokenize=True,
        add_generation_prompt=...)` renders it (same Jinja environment and variables)."""
        return self.encode(self.chat_text(messages, add_generation_prompt=add_generation_prompt))

    def chat_text(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The chat template's text, as transformers' `apply_chat_template(messages,
        tokenize=False, add_generation_prompt=...)` renders it."""
        if not self.chat_template:
            raise ValueError(f"this tokenizer has no chat template ({CHAT_TEMPLATE_FILE} or "
                             f"tokenizer_config.json's chat_template)")
        import jinja2

        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            text = self._template.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None
        return text

    def save(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer files back as they were read (byte for byte)."""
        from dlm_jax._integrity import atomic_write

        for name, data in self._files.items():
            atomic_write(Path(directory) / name, data)


def _jinja_env():
    """The sandboxed Jinja environment transformers renders chat templates in."""
    import json as _json
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return _json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


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
    from dlm_jax._integrity import atomic_write_json

    atomic_write_json(path, data)


def _vocab_ids(directory: Path) -> dict[str, int]:
    """token -> id from the JSON of tokenizer_config.json's added tokens and tokenizer.json (its
    added tokens and model vocabulary), without the tokenizers library."""
    ids: dict[str, int] = {}
    tok = _read_optional_json(directory / "tokenizer.json")
    vocab = tok.get("model", {}).get("vocab") if isinstance(tok.get("model"), dict) else None
    if isinstance(vocab, dict):
        ids.update({k: v for k, v in vocab.items() if isinstance(v, int)})
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids.update({e[0]: i for i, e in enumerate(vocab) if isinstance(e, list) and e})
    for added in tok.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            ids[added.get("content")] = added["id"]
    decoder = _read_optional_json(directory / CONFIG_FILE).get("added_tokens_decoder")
    for key, added in (decoder.items() if isinstance(decoder, dict) else ()):
        if isinstance(added, dict) and str(key).isdigit():
            ids[added.get("content")] = int(key)
    return ids


def declared_mask_token_id(directory: str | os.PathLike) -> int | None:
    """The mask token id the tokenizer files in `directory` declare, or None: tokenizer_config's
    `mask_token`, special_tokens_map.json's, else a known mask token (`<|mdm_mask|>`,
    `<|mask|>`, `<mask>`, `[MASK]`) in the vocabulary, as `HFTokenizer.mask_id` finds it when
    config.json has none; the byte tokenizer's `<|mask|>`. Reads JSON only."""
    directory = Path(directory)
    config = _read_optional_json(directory / CONFIG_FILE)
    if not (directory / "tokenizer.json").exists():
        return ByteTokenizer().mask_id if config.get("tokenizer_class") == ByteTokenizer.CLASS_NAME else None
    special_map = _read_optional_json(directory / "special_tokens_map.json")
    ids = _vocab_ids(directory)
    for tok in (_token_str(config.get("mask_token")), _token_str(special_map.get("mask_token")),
                *_MASK_CANDIDATES):
        if tok is not None and tok in ids:
            return ids[tok]
    return None


class NoTokenizerError(CheckpointError):
    """A checkpoint directory holds no tokenizer files (a model still loads without them)."""


def load_tokenizer(directory: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """The tokenizer stored in a checkpoint directory (NoTokenizerError when there is none)."""
    directory = Path(directory)
    if (directory / "tokenizer.json").exists():
        return HFTokenizer(directory)
    config = _read_optional_json(directory / CONFIG_FILE)
    if config.get("tokenizer_class") == ByteTokenizer.CLASS_NAME:
        if tuple(config.get("special_tokens", ByteTokenizer.SPECIALS)) != ByteTokenizer.SPECIALS:
            raise CheckpointError(f"{directory / CONFIG_FILE}: special tokens differ "
                                  f"from this version's byte tokenizer")
        return ByteTokenizer(prompt_format=_prompt_format(config, directory / CONFIG_FILE))
    raise NoTokenizerError(f"{directory}: no tokenizer files (neither tokenizer.json nor a dlm-jax "
                          f"tokenizer_config.json)")

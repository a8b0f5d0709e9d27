"""`dlm-jax export --format gguf`: a checkpoint -> one GGUF file llama.cpp's LLaDA loader reads.

    export_gguf("models/llada-12m", "llada-12m-q4_0.gguf", quant="q4_0")
    llama-diffusion-cli -m llada-12m-q4_0.gguf -p "12+34=" -ub 64 --diffusion-block-length 32 ...

The file follows what llama.cpp's own converter writes for `LLaDAModelLM` (architecture
`llada`): tensors `token_embd`, `blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,
ffn_gate,ffn_up,ffn_down}`, `output_norm`, `output` (left out for tied embeddings: the loader
reuses `token_embd`), non-causal attention and `diffusion.shift_logits = false`. llama.cpp
rotates adjacent pairs (GGML's "normal" RoPE) where this project rotates halves, so the rows of
each attn_q / attn_k head are permuted as its converter does; the computed attention is the same.

Weights: `f32`; `f16` (matrices in half precision, norms in f32); `q8_0` / `q4_0` (matrices
in GGML blocks of 32 along a row, quantised by this project's bit-exact reference rules,
`dlm_jax.lowering.quant`; a matrix whose rows are not a multiple of 32 long stays f16, as llama.cpp's
converter does). The tokenizer is the byte tokenizer's vocabulary as a GPT-2 byte-level BPE
without merges: ids 0..255 are the bytes (in GPT-2's byte-to-character mapping) and the special
tokens follow as control tokens, so llama.cpp tokenises text byte by byte exactly as this project
does, parses `<|mask|>`-style tokens in prompts, and detokenises the same text. A model trained
on chat prompts carries a chat template that renders them exactly as `apply_chat` does.

What llama.cpp's LLaDA graph cannot run is refused before anything is written: causal or
block-causal attention, logit shift, MoE, non-SwiGLU FFNs, QK-norm and partial rotary. The file
is written to a temporary sibling and renamed into place.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dlm_jax._errors import CheckpointError, ConfigError

GGUF_QUANTS: dict[str, str] = {
    "f32": "float32 weights",
    "f16": "float16 matrices, float32 norms",
    "q8_0": "GGML Q8_0 matrices (blocks of 32, fp16 scale, int8), float32 norms",
    "q4_0": "GGML Q4_0 matrices (blocks of 32, fp16 scale, 4-bit), float32 norms",
}
ARCH = "llada"
# A merge list is required by llama.cpp's BPE loader and may not be empty in gguf-py: one merge
# of two NUL bytes, which never occur in text (and whose result is no token, so it could not
# change a tokenisation anyway: llama.cpp falls back to the bytes).
_NO_MERGES = ["\u0100 \u0100"]
_LAYER_NAMES = {"attn_norm.scale": "attn_norm", "attn.q_proj": "attn_q", "attn.k_proj": "attn_k",
                "attn.v_proj": "attn_v", "attn.o_proj": "attn_output", "ffn_norm.scale": "ffn_norm",
                "ffn.gate_proj": "ffn_gate", "ffn.up_proj": "ffn_up", "ffn.down_proj": "ffn_down"}
_TOP_NAMES = {"embed.embedding": "token_embd", "final_norm.scale": "output_norm", "lm_head": "output"}
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
                 "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def unsupported(cfg) -> str | None:
    """Why llama.cpp's LLaDA graph cannot run a model of config `cfg` (None: it can)."""
    reasons = [
        (cfg.attention != "bidirectional", f"attention={cfg.attention!r} (llama.cpp's LLaDA is bidirectional)"),
        (cfg.logit_shift, "logit_shift (a Dream-style model; llama.cpp's LLaDA does not shift)"),
        (cfg.n_experts > 0, "a mixture of experts (llama.cpp has a separate llada-moe architecture)"),
        (cfg.ffn != "swiglu", f"ffn={cfg.ffn!r} (llama.cpp's LLaDA has a SwiGLU FFN)"),
        (cfg.qk_norm, "qk_norm"),
        (cfg.partial_rotary_factor != 1.0, f"partial_rotary_factor={cfg.partial_rotary_factor}"),
    ]
    found = [r for bad, r in reasons if bad]
    return "; ".join(found) or None


def _rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows (or bias entries) of a q/k projection reordered per head from rotate-half pairs
    (i, i + Dh/2) to adjacent pairs (2i, 2i+1), llama.cpp's RoPE layout."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(params: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    """dlm-jax parameters -> GGUF tensor name -> float32 array in llama.cpp's layout (a matrix
    [out, in], as GGUF stores `ne = (in, out)`), q/k rows in its RoPE order."""
    out: dict[str, np.ndarray] = {}
    for name, value in params.items():
        value = np.asarray(value, dtype=np.float32)
        kind = "weight"
        if name.endswith(".bias"):
            name, kind = name[: -len(".bias")], "bias"
        elif name.endswith(".kernel"):
            name, value = name[: -len(".kernel")], value.T
        if name in _TOP_NAMES:
            out[f"{_TOP_NAMES[name]}.{kind}"] = np.ascontiguousarray(value)
            continue
        parts = name.split(".", 2)
        if parts[0] != "layers" or parts[2] not in _LAYER_NAMES:
            raise ConfigError(f"parameter {name!r} has no tensor in llama.cpp's LLaDA architecture")
        short = _LAYER_NAMES[parts[2]]
        if short in ("attn_q", "attn_k"):
            value = _rope_rows(value, cfg.n_heads if short == "attn_q" else cfg.n_kv_heads)
        out[f"blk.{parts[1]}.{short}.{kind}"] = np.ascontiguousarray(value)
    return out


def _encode(value: np.ndarray, quant: str):
    """(data, raw GGML type or None) for one tensor under `quant`."""
    from gguf import GGMLQuantizationType as T

    from dlm_jax.lowering.quant import quantize_q4_0, quantize_q8_0

    if value.ndim < 2 or quant == "f32":
        return value, None
    if quant == "f16" or value.shape[-1] % 32:
        return value.astype(np.float16), None
    if quant == "q8_0":
        return quantize_q8_0(value), T.Q8_0
    return quantize_q4_0(value), T.Q4_0


@dataclasses.dataclass(frozen=True)
class GgufExport:
    path: Path
    quant: str
    bytes: int
    tensors: int
    types: dict[str, int]  # GGML type name -> tensor count
    seconds: float


def export_gguf(model_dir: str | os.PathLike, out: str | os.PathLike, *, quant: str = "f32", verify: bool = True,
                strict: bool = False, overwrite: bool = False,
                progress: Callable[[str, int, int], None] | None = None) -> GgufExport:
    """Write the checkpoint at `model_dir` as the GGUF file `out` (see the module docstring)."""
    import gguf

    from dlm_jax._integrity import atomic_path
    from dlm_jax._model import stored_tokenizer
    from dlm_jax._tokenizer import ByteTokenizer
    from dlm_jax.checkpoint._io import load_pretrained, refuse_stored_quant
    from dlm_jax.models._params import get_params

    t0 = time.perf_counter()
    if quant not in GGUF_QUANTS:
        raise ConfigError(f"unknown GGUF quantisation {quant!r}; known: {', '.join(GGUF_QUANTS)}")
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"{out} is a directory: a GGUF export writes one file (e.g. --out {out / 'model.gguf'})")
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite to replace it")
    refuse_stored_quant(model_dir, "a GGUF export (its own quantisations with --quant)")
    model = load_pretrained(model_dir, strict=strict, verify=verify)
    cfg = model.config
    if (why := unsupported(cfg)) is not None:
        raise ConfigError(f"llama.cpp's LLaDA architecture cannot run this model: {why}")
    tokenizer = stored_tokenizer(model_dir)
    if not isinstance(tokenizer, ByteTokenizer):
        raise CheckpointError(f"{model_dir}: GGUF export writes the byte tokenizer's vocabulary; this checkpoint's "
                              f"tokenizer ({type(tokenizer).__name__}) is converted by llama.cpp's own "
                              f"convert_hf_to_gguf.py")
    tensors = gguf_tensors(get_params(model), cfg)
    n_vocab = tensors["token_embd.weight"].shape[0]

    tokens = byte_chars() + list(tokenizer.SPECIALS)
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * len(tokenizer.SPECIALS)
    for i in range(len(tokens), n_vocab):  # embedding rows past the tokenizer (padding)
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    if len(tokens) != n_vocab:
        raise ConfigError(f"the tokenizer has {len(tokens)} tokens but the embedding {n_vocab} rows")

    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[quant]
    out.parent.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), ARCH)
        metadata = {  # gguf-py writer method -> value, in the order llama.cpp's converter writes them
            "add_name": Path(model_dir).resolve().name, "add_file_type": file_type, "add_vocab_size": n_vocab,
            "add_context_length": cfg.max_seq_len, "add_embedding_length": cfg.d_model,
            "add_block_count": cfg.n_layers, "add_feed_forward_length": cfg.ffn_hidden,
            "add_head_count": cfg.n_heads, "add_head_count_kv": cfg.n_kv_heads, "add_key_length": cfg.head_dim,
            "add_value_length": cfg.head_dim, "add_rope_dimension_count": cfg.head_dim,
            "add_rope_freq_base": float(cfg.rope_theta), "add_layer_norm_rms_eps": float(cfg.norm_eps),
            "add_causal_attention": False, "add_diffusion_shift_logits": False,
            "add_tokenizer_model": "gpt2", "add_tokenizer_pre": "default", "add_token_list": tokens,
            "add_token_types": types, "add_token_merges": _NO_MERGES, "add_bos_token_id": tokenizer.bos_id,
            "add_eos_token_id": tokenizer.eos_id, "add_pad_token_id": tokenizer.pad_id,
            "add_mask_token_id": tokenizer.mask_id,
            "add_add_bos_token": False,  # the chat template writes <|bos|>; raw prompts have none
            "add_add_eos_token": False,
        }
        for method, value in metadata.items():
            getattr(w, method)(value)
        if tokenizer.prompt_format == "chat":
            w.add_chat_template(CHAT_TEMPLATE)
        for i, (name, value) in enumerate(sorted(tensors.items())):
            data, raw = _encode(value, quant)
            w.add_tensor(name, data, raw_dtype=raw)  # quantised: the byte shape, converted by gguf-py
            kind = raw.name if raw is not None else {np.dtype(np.float16): "F16"}.get(data.dtype, "F32")
            counts[kind] = counts.get(kind, 0) + 1
            if progress:
                progress("quantise", i + 1, len(tensors))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return GgufExport(out, quant, out.stat().st_size, len(tensors), counts, time.perf_counter() - t0)

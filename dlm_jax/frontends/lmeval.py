"""lm-evaluation-harness's model "dlm-jax": any dlm-jax checkpoint under lm-eval's tasks.

    dlm-jax lm-eval --write-tasks tasks/ --n 32          # local tasks from dlm_jax.training.data
    dlm-jax lm-eval --model dlm-jax --model_args pretrained=models/llada-tiny,preset=fast-dllm \\
        --tasks dlmjax_addition --include_path tasks/ --batch_size 8

or from Python: `import dlm_jax.frontends.lmeval` registers the model, then
`lm_eval.simple_evaluate(model="dlm-jax", model_args="pretrained=...", tasks=[...])`.
lm-eval 0.4.13 discovers no models from other packages, so, as LLaDA's own evaluation does,
`python -m dlm_jax.frontends.lmeval ARGS` / `dlm-jax lm-eval ARGS` register it and then run lm-eval's
own command line (`lm_eval.__main__.cli_evaluate`) on ARGS.

The three request types:

- `generate_until`: every request through one continuous-batching engine (`dlm_jax.Engine`)
  with the decode config the model args describe (a `preset` plus any decode option, as
  `dlm-jax eval` takes them), at most `batch_size` decoding at once, each joining as another
  ends; each request's `until` strings are its stop strings (it ends at the first, which the
  completion leaves out). The generation length is the config's when `gen_len` is given (or the
  preset or a bundle fixes it); otherwise the request's `max_gen_toks` rounded up to a whole
  number of blocks (a block schedule must divide it). Greedy unless the decode config samples:
  a task's `do_sample` / `temperature` do not override it (a warning says so once).
- `loglikelihood`: causal logit-shift models (`attention="causal"`, `logit_shift`: AR, I-DLM)
  get the exact autoregressive log-likelihood, one causal forward over context +
  continuation; masked-diffusion models (`attention="bidirectional"`: LLaDA, and Dream's
  shifted logits) get LLaDA's Monte Carlo estimate of it (eval_llada.py's
  `get_loglikelihood`, reimplemented in NumPy + JAX): `mc_num` noisy copies in rounds of
  `mc_batch`, round r masking a stratified number of the continuation's tokens, the masked
  tokens' cross-entropy reweighted by 1/t. `is_greedy` for those is LLaDA's
  `suffix_greedy_prediction` (one token unmasked per step, the most confident), computed only
  with `is_check_greedy=true` (else False, as in LLaDA). The noise comes from a NumPy
  generator seeded by `seed` and the request's tokens: a request's estimate is the same run to
  run and whatever else is in the batch.
- `loglikelihood_rolling` (perplexity tasks): exact for causal models, over lm-eval's rolling
  windows of `max_seq_len`; refused for masked-diffusion models, as LLaDA's evaluation
  refuses it (the ELBO of a whole document is not what a perplexity task compares).

Prompt format. LLaDA's evaluation tokenises the raw context; the shipped checkpoints here were
trained on chat-formatted prompts, so both request kinds follow the `chat` model arg, whose
default is the checkpoint's prompt format, as for `dlm-jax eval`: with chat, a context is
wrapped as `Model.encode(context, chat=True)` wraps a prompt (ending in the assistant tag) and
the continuation is the answer's tokens after it, exactly the (prompt, answer) split the
models were trained on. Raw: LLaDA's `_encode_pair` (trailing whitespace of the context moves
to the continuation; the continuation is the tokens of context + continuation past those of
the context). With lm-eval's `--apply_chat_template` (and `--fewshot_as_multiturn`), lm-eval
renders each request's chat through the checkpoint's template (`apply_chat_template`) and the
rendered contexts are encoded as they are; a single-turn chat is then exactly what the `chat`
arg builds. `chat=true` together with it is refused (the prompt would be wrapped twice).

Forward passes for log-likelihoods run the Flax model (`handle.model`) jitted once per padded
shape (sequences padded to a multiple of 32; padded keys are invisible, so padding changes
nothing). An exported bundle (LiteRT) has no Flax model: it generates, and log-likelihood
requests fail naming why.

Local tasks: `write_tasks(directory)` writes lm-eval task YAMLs over held-out examples of the
project's task generators (`dlm_jax.training.data.TASKS`), each a generative task scored by the
task's own `score` (as `dlm-jax eval` scores it) and a multiple-choice variant (the right
answer among deterministic near misses, metric acc).

Needs lm-eval (`pip install 'dlm-jax[lmeval]'`); importing this module without it raises a
one-line ConfigError.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlm_jax._errors import CheckpointError, ConfigError, InputError

INSTALL_HINT = "lm-eval is not installed: pip install 'dlm-jax[lmeval]'"
MODEL_NAME = "dlm-jax"


def _typing_extensions_compat() -> None:
    """Let lm-eval 0.4.13 import under a typing_extensions older than 4.13.

    lm-eval's result schema declares `class _TaskMetrics(TypedDict, extra_items=T)` (PEP 728),
    which typing_extensions supports from 4.13 on; the LiteRT converter's xdsl pins
    typing_extensions < 4.13, so an install of dlm-jax[lmeval] gets 4.12 and
    `lm_eval.simple_evaluate` fails to import. Those TypedDicts only annotate plain dicts, so
    where the installed typing_extensions refuses the keyword it is accepted and ignored (the
    declared extra-item type only matters to a type checker). Nothing changes where it is
    supported."""
    try:
        import typing_extensions as te
    except ImportError:  # lm-eval requires it: its own import names the problem
        return

    import types

    try:  # `class _Probe(TypedDict, extra_items=int)` (the functional form takes any keyword)
        types.new_class("_Probe", (te.TypedDict,), {"extra_items": int})
        return
    except TypeError:
        pass
    meta = getattr(te, "_TypedDictMeta", None)
    if meta is None or getattr(meta, "_dlm_jax_extra_items", False):
        return
    original = meta.__new__

    def __new__(cls, name, bases, ns, *, extra_items=None, **kwargs):  # noqa: N807
        return original(cls, name, bases, ns, **kwargs)

    meta.__new__ = staticmethod(__new__)
    meta._dlm_jax_extra_items = True


try:
    import lm_eval  # noqa: F401
except ImportError:
    raise ConfigError(INSTALL_HINT) from None
_typing_extensions_compat()

import lm_eval.models  # noqa: E402,F401  (lm-eval's own models, registered lazily: see _register)
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import model_registry  # noqa: E402

# Model args of the adapter itself: name -> (type, default, help). Decode options
# (`dlm_jax.runtime.registry.options()`) are accepted besides these; `seed` is both the decode
# seed and the Monte Carlo estimator's.
ADAPTER_ARGS: dict[str, tuple[type, Any, str]] = {
    "pretrained": (str, None, "checkpoint directory (HF layout), a cached Hugging Face model id, or a bundle "
                              "(dlm-jax export; generation only)"),
    "executor": (str, None, "auto (default, or $DLM_JAX_EXECUTOR), jax or litert"),
    "lora": (str, None, "a directory of LoRA adapters made for the checkpoint"),
    "quant": (str, None, "weight-only quantization at load on the JAX executor: int8 or fp8"),
    "dtype": (str, None, "the dtype of the weights and the arithmetic on the JAX executor: float32, bfloat16 or "
                         "float16 (default: the checkpoint's)"),
    "mesh": (str, None, "decode on a device mesh, axes separated by ';' (lm-eval splits model args at ','): "
                        "tp=N;ep=M;dp=K (docs/mesh.md)"),
    "preset": (str, None, "decoder preset (default fast-dllm; a bundle: its recorded decode options)"),
    "chat": (bool, None, "wrap contexts in the chat template (default: the checkpoint's prompt format)"),
    "mc_num": (int, 128, "Monte Carlo samples per masked-diffusion log-likelihood"),
    "mc_batch": (int, 32, "samples per forward (mc_num must be a multiple of it)"),
    "is_check_greedy": (bool, False, "masked diffusion: compute is_greedy by LLaDA's greedy unmasking"),
    "batch_size": (int, 8, "requests decoding at once on the engine (lm-eval's --batch_size; 'auto': "
                           "max_batch_size or 8)"),
    "max_batch_size": (int, None, "the batch size 'auto' takes"),
    "device": (str, None, "ignored: JAX places the model (JAX_PLATFORMS picks the backend)"),
}
DEFAULT_PRESET = "fast-dllm"  # what `dlm-jax eval` decodes with when --preset is not given
DEFAULT_BATCH = 8  # the engine's max_batch when lm-eval's batch_size is 'auto' without max_batch_size
PAD_MULTIPLE = 32  # log-likelihood forwards pad the sequence length to a multiple of this
TASK_PREFIX = "dlmjax_"
SCORING_MODULE = "dlmjax_scoring"


def _decode_options() -> dict[str, Any]:
    from dlm_jax.runtime.registry import options

    return options()


def known_args() -> list[str]:
    """Every model arg the adapter takes: its own and the decode options."""
    return sorted(set(ADAPTER_ARGS) | set(_decode_options()))


def _coerce(name: str, value: Any, kind: type) -> Any:
    """A model arg's value as `kind`: lm-eval hands over strings, or values its
    `simple_parse_args_string` already converted (ints, floats, booleans, None)."""
    if value is None:
        return None
    bad = ConfigError(f"model arg {name}={value!r} is not a valid {kind.__name__}")
    if kind is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        if isinstance(value, (int, np.integer)) and value in (0, 1):
            return bool(value)
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise bad
    if kind is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, np.integer)):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip())
        except ValueError:
            raise bad from None
    if kind is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    return str(value)


def _batch_size(value: Any, max_batch: int | None) -> int:
    """lm-eval's batch size: an integer, or "auto" / "auto:N" (no memory probe here: the
    max_batch_size, else `DEFAULT_BATCH`)."""
    if value is None:
        return DEFAULT_BATCH
    if isinstance(value, str) and value.strip().lower().startswith("auto"):
        return max_batch or DEFAULT_BATCH
    size = _coerce("batch_size", value, int)
    if size <= 0:
        raise ConfigError(f"model arg batch_size={value!r} must be a positive integer")
    return size


# ----------------------------------------------------------------------------------------------
# Log-likelihood kernels (NumPy + one jitted forward)


def mc_mask_counts(k: int, target_len: int, rows: int) -> np.ndarray:
    """Masked tokens per row of one Monte Carlo round (LLaDA's `_forward_process`): `rows`
    counts spread evenly from `k` over the target length, wrapped into [1, target_len].
    `np.round` rounds halves to even, as `torch.round` does."""
    x = np.round(np.linspace(float(k), k + (rows - 1) * (target_len / rows), rows)).astype(np.int64)
    return ((x - 1) % target_len) + 1


def mc_round_masks(rng: np.random.Generator, target_len: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """One round's ([rows, target_len] bool mask of the target, [rows] masked counts): k drawn
    uniformly from 1..target_len, row i masks the first x_i positions, then permuted."""
    k = int(rng.integers(1, target_len + 1))
    x = mc_mask_counts(k, target_len, rows)
    base = np.arange(target_len)[None, :] < x[:, None]
    masks = np.stack([base[i][rng.permutation(target_len)] for i in range(rows)])
    return masks, x


def request_rng(seed: int, prefix: Sequence[int], target: Sequence[int]) -> np.random.Generator:
    """The Monte Carlo generator of one request: `seed` and the request's tokens (the same
    estimate whatever else is evaluated and in whatever order)."""
    ids = np.asarray([len(prefix), *prefix, *target], np.int64)
    return np.random.default_rng([int(seed), zlib.crc32(ids.tobytes()), len(target)])


class Scorer:
    """Token-level log-likelihoods of a Flax `Transformer`: the jitted full-sequence forward
    the estimators share. Rows are padded to a multiple of `PAD_MULTIPLE` tokens; padded keys
    are invisible to every real query (`dlm_jax._masks.padded_mask`)."""

    def __init__(self, model: Any):
        import jax
        from flax import nnx

        from dlm_jax.techniques.isd.lora import lora_spec

        self.config = model.config
        self.mask_id = self.config.mask_token_id
        self.gated = lora_spec(model) is not None
        graphdef, self._state = nnx.split(model)

        def forward(state, tokens, targets, mask, *, shift: bool):
            import jax.numpy as jnp

            model = nnx.merge(graphdef, state)
            extra = {}
            if self.gated:  # R-ISD adapters apply on [MASK] rows only
                extra["lora_gate"] = (tokens == self.mask_id).astype(jnp.float32)
            logits = model(tokens, mask=mask, **extra).logits.astype(jnp.float32)
            if shift:  # row i predicts token i + 1: realign so that row j scores token j
                logits = jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
            logp = jax.nn.log_softmax(logits, axis=-1)
            target_logp = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
            top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            top_prob = jnp.exp(jnp.max(logp, axis=-1))
            return target_logp, top, top_prob

        self._forward = jax.jit(forward, static_argnames=("shift",))

    @staticmethod
    def padded_length(n: int) -> int:
        return max(PAD_MULTIPLE, -(-n // PAD_MULTIPLE) * PAD_MULTIPLE)

    def run(self, tokens: np.ndarray, targets: np.ndarray, valid: np.ndarray, *, causal: bool,
            shift: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(log p(targets) [B, T], argmax [B, T], its probability [B, T]) for rows `tokens`
        [B, T] whose `valid` positions [B, T] are real; row j's prediction is that of position j
        (with `shift`, the model's row j - 1)."""
        from dlm_jax._masks import padded_mask

        b, t = tokens.shape
        width = self.padded_length(t)
        pad = ((0, 0), (0, width - t))
        tokens = np.pad(tokens.astype(np.int32), pad, constant_values=self.config.pad_token_id or 0)
        targets = np.pad(targets.astype(np.int32), pad)
        valid = np.pad(valid.astype(bool), pad)
        mask = padded_mask("causal" if causal else "bidirectional", valid)
        out = self._forward(self._state, tokens, targets, mask, shift=shift)
        return tuple(np.asarray(a)[:, :t] for a in out)

    # -- causal logit-shift models: exact

    def exact(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, rows: int = 32,
              progress: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
        """Exact (log p(continuation | context), every continuation token the argmax) per
        (context ids, continuation ids), `rows` sequences per forward (sorted by length, so
        a forward pads little)."""
        limit = self.config.max_seq_len
        seqs = []
        for ctx, cont in pairs:
            if len(cont) > limit:
                raise InputError(f"a continuation of {len(cont)} tokens exceeds the model's max_seq_len={limit}")
            full = [*ctx, *cont][-(limit + 1):]  # the context cut from the left, as lm-eval's HF model does
            seqs.append((np.asarray(full, np.int64), len(cont)))
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        for start in range(0, len(order), rows):
            chunk = order[start:start + rows]
            t = max(len(seqs[i][0]) - 1 for i in chunk)
            tokens = np.zeros((rows, t), np.int64)
            targets = np.zeros((rows, t), np.int64)
            valid = np.zeros((rows, t), bool)
            for r, i in enumerate(chunk):
                full = seqs[i][0]
                tokens[r, :len(full) - 1] = full[:-1]
                targets[r, :len(full) - 1] = full[1:]
                valid[r, :len(full) - 1] = True
            logp, top, _ = self.run(tokens, targets, valid, causal=True, shift=False)
            for r, i in enumerate(chunk):
                full, n = seqs[i]
                span = slice(len(full) - 1 - n, len(full) - 1)
                out[i] = (float(logp[r, span].astype(np.float64).sum()), bool((top[r, span] == targets[r, span]).all()))
            if progress:
                progress(len(chunk))
        return out  # type: ignore[return-value]

    # -- masked diffusion: LLaDA's Monte Carlo estimate

    def _check_mc(self, prefix: Sequence[int], target: Sequence[int]) -> None:
        if self.mask_id is None:
            raise ConfigError("the masked-diffusion log-likelihood needs the model's mask_token_id")
        if self.config.logit_shift and not prefix:
            raise InputError("an empty context: a logit-shift model predicts each token from the one before it")
        if len(prefix) + len(target) > self.config.max_seq_len:
            raise InputError(f"context + continuation = {len(prefix) + len(target)} tokens exceed the model's "
                             f"max_seq_len={self.config.max_seq_len}")

    def mc_rounds(self, prefix: Sequence[int], target: Sequence[int], *, mc_num: int, mc_batch: int,
                  rng: np.random.Generator) -> np.ndarray:
        """The per-round losses of LLaDA's `get_loglikelihood` (their mean is minus the
        estimate): each round masks `mc_batch` copies of prefix + target by
        `mc_round_masks`, and sums the masked tokens' cross-entropy / (x / target_len),
        divided by `mc_batch`."""
        self._check_mc(prefix, target)
        seq = np.asarray([*prefix, *target], np.int64)
        p, n = len(prefix), len(target)
        clean = np.broadcast_to(seq, (mc_batch, len(seq)))
        valid = np.ones_like(clean, bool)
        losses = []
        for _ in range(mc_num // mc_batch):
            masks, x = mc_round_masks(rng, n, mc_batch)
            is_mask = np.concatenate([np.zeros((mc_batch, p), bool), masks], axis=1)
            noisy = np.where(is_mask, self.mask_id, clean)
            logp, _, _ = self.run(noisy, clean, valid, causal=False, shift=self.config.logit_shift)
            weight = (n / x.astype(np.float64))[:, None]  # 1 / p_mask, p_mask = x / target_len
            losses.append(float((-logp.astype(np.float64) * is_mask * weight).sum() / mc_batch))
        return np.asarray(losses)

    def greedy_suffix(self, prefix: Sequence[int], target: Sequence[int]) -> bool:
        """LLaDA's `suffix_greedy_prediction`: from a fully masked target, unmask one token
        per forward, the argmax of the most confident masked position; True iff the result
        is the target."""
        self._check_mc(prefix, target)
        p, n = len(prefix), len(target)
        seq = np.asarray([*prefix, *([self.mask_id] * n)], np.int64)[None]
        valid = np.ones_like(seq, bool)
        for _ in range(n):
            masked = seq[0] == self.mask_id
            masked[:p] = False
            _, top, prob = self.run(seq, seq, valid, causal=False, shift=self.config.logit_shift)
            conf = np.where(masked, prob[0], -np.inf)
            j = int(np.argmax(conf))
            seq[0, j] = top[0, j]
        return bool((seq[0, p:] == np.asarray(target)).all())


# ----------------------------------------------------------------------------------------------
# The lm-eval model


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The checked model args of a `DlmJaxLM` (`model_settings`)."""

    pretrained: Path
    bundle: bool  # an exported bundle (LiteRT): generation only
    executor: str | None
    lora: str | None
    quant: str | None
    mesh: Any  # a MeshShape, or None
    dtype: str | None  # weights and arithmetic (None: the checkpoint's)
    chat: bool | None
    mc_num: int
    mc_batch: int
    is_check_greedy: bool
    batch_size: int
    seed: int
    decode_config: Any  # DecodeConfig
    fixed_gen_len: bool  # gen_len given (or fixed by the preset or bundle): max_gen_toks does not change it


def model_settings(pretrained: str | os.PathLike | None = None, **kwargs: Any) -> ModelSettings:
    """Check model args without loading anything (the command line does this before lm-eval
    spends its seconds indexing tasks): names, types, the Monte Carlo sizes, the preset and the
    decode config they build, the checkpoint directory's existence."""
    from dlm_jax.runtime.registry import PRESETS, build

    decode = _decode_options()
    unknown = sorted(set(kwargs) - set(ADAPTER_ARGS) - set(decode))
    if unknown:
        raise ConfigError(f"unknown dlm-jax model arg(s) {', '.join(unknown)}; known: {', '.join(known_args())}")
    args = {name: _coerce(name, kwargs.get(name, default), kind) for name, (kind, default, _) in
            ADAPTER_ARGS.items() if name not in ("pretrained", "batch_size")}
    if pretrained is None or str(pretrained).strip() == "":
        raise ConfigError("model arg pretrained=<checkpoint directory> is required")
    from dlm_jax._hub import resolve_checkpoint

    path = resolve_checkpoint(str(pretrained))  # a cached Hugging Face model id: its snapshot
    given = {name: _coerce(name, value, decode[name].type) for name, value in kwargs.items()
             if name in decode and value is not None}
    for name in ("mc_num", "mc_batch"):
        if args[name] <= 0:
            raise ConfigError(f"model arg {name}={args[name]} must be a positive integer")
    if args["mc_num"] % args["mc_batch"]:
        raise ConfigError(f"model arg mc_num={args['mc_num']} must be a multiple of mc_batch={args['mc_batch']}")
    preset = args["preset"]
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown decode preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    if args["executor"] is not None:
        from dlm_jax.api import _check_executor

        _check_executor(args["executor"])
    from dlm_jax.models.quant import check_quant

    check_quant(args["quant"])
    from dlm_jax._config import DTYPES

    if args["dtype"] is not None and args["dtype"] not in DTYPES:
        raise ConfigError(f"model arg dtype={args['dtype']!r} is not one of {', '.join(DTYPES)}")
    if args["mesh"] is not None:
        from dlm_jax._partition import MeshShape

        args["mesh"] = MeshShape.parse(args["mesh"])
    if not path.is_dir():
        raise CheckpointError(f"pretrained={path}: no such checkpoint directory")
    from dlm_jax.executors.bundle_files import BUNDLE_FILE

    bundle = (path / BUNDLE_FILE).exists()
    if bundle:
        for name in ("executor", "lora", "quant", "mesh", "dtype"):
            if args[name] is not None:
                raise ConfigError(f"model arg {name}: {path} is a bundle, which runs on LiteRT with what it was "
                                  f"exported with")
        from dlm_jax.executors.runner import Bundle

        base = PRESETS[preset] if preset else Bundle.open(path, verify=False).decode_defaults()
    else:
        base = PRESETS[preset or DEFAULT_PRESET]
    cfg = build(given, base=base)
    fixed = "gen_len" in given or (bundle and not preset) or "gen_len" in PRESETS.get(preset, {})
    return ModelSettings(path, bundle, args["executor"], args["lora"], args["quant"], args["mesh"], args["dtype"],
                         args["chat"],
                         args["mc_num"],
                         args["mc_batch"], args["is_check_greedy"],
                         _batch_size(kwargs.get("batch_size"), args["max_batch_size"]),
                         int(given.get("seed", 0)), cfg, bool(fixed))


class DlmJaxLM(LM):
    """lm-eval's `LM` over a dlm-jax checkpoint; see the module docstring. Model args arrive
    as keywords (from `--model_args k=v,...` or a dict), typed or as strings
    (`model_settings` checks them all before the checkpoint loads)."""

    def __init__(self, pretrained: str | os.PathLike | None = None, **kwargs: Any):
        super().__init__()
        s = model_settings(pretrained, **kwargs)
        self.settings = s
        self.pretrained, self.chat, self.seed = s.pretrained, s.chat, s.seed
        self.mc_num, self.mc_batch, self.is_check_greedy = s.mc_num, s.mc_batch, s.is_check_greedy
        self.batch_size, self.decode_config, self.fixed_gen_len = s.batch_size, s.decode_config, s.fixed_gen_len
        if s.bundle:
            from dlm_jax.executors.runner import load_bundle

            self.handle = load_bundle(s.pretrained)
        else:
            import dlm_jax

            self.handle = dlm_jax.load(s.pretrained, executor=s.executor, lora=s.lora, quant=s.quant,
                                       **({"mesh": s.mesh} if s.mesh is not None else {}),
                                       **({"dtype": s.dtype, "param_dtype": s.dtype} if s.dtype else {}))
        self._scorer: Scorer | None = None
        self._warned_sampling = False
        self._templated = False  # lm-eval rendered the requests' chat (`apply_chat_template`)

    # -- what lm-eval reads

    @property
    def tokenizer_name(self) -> str:
        return f"dlm-jax:{self.pretrained}:{'chat' if self._chat else 'raw'}"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's `--apply_chat_template`: the chat (few-shot turns included) as the
        checkpoint's template renders it (`Tokenizer.chat_text`). The contexts lm-eval then
        builds from it are encoded as they are, never wrapped again."""
        if self.chat:
            raise ConfigError("model arg chat=true and --apply_chat_template both wrap each request in the chat "
                              "template: pass one of them")
        try:
            text = self.handle.tokenizer.chat_text(chat_history, add_generation_prompt=add_generation_prompt)
        except ValueError as e:  # no template, an unknown role: the tokenizer names it
            raise ConfigError(f"--apply_chat_template: {e}") from None
        self._templated = True
        return text

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The checkpoint's Jinja chat template, which lm-eval records with the results ("" for
        the byte tokenizer, whose chat format is fixed: `ByteTokenizer.apply_chat`)."""
        return getattr(self.handle.tokenizer, "chat_template", None) or ""

    @property
    def _chat(self) -> bool:
        if self._templated:  # the contexts are rendered chats already
            return False
        return self.chat if self.chat is not None else self.handle.prompt_format == "chat"

    # -- generation

    def _gen_config(self, gen_kwargs: dict[str, Any]):
        """The decode config of a request: the configured one, its generation length from
        `max_gen_toks` unless fixed."""
        cfg = self.decode_config
        if self.fixed_gen_len or gen_kwargs.get("max_gen_toks") is None:
            return cfg
        want = _coerce("max_gen_toks", gen_kwargs["max_gen_toks"], int)
        if want <= 0:
            raise InputError(f"max_gen_toks={want} must be a positive integer")
        block = getattr(cfg.scheduler, "block_len", 1)
        gen_len = -(-want // block) * block
        return cfg if gen_len == cfg.gen_len else dataclasses.replace(cfg, gen_len=gen_len)

    def _warn_sampling(self, gen_kwargs: dict[str, Any]) -> None:
        temperature = gen_kwargs.get("temperature") or 0.0
        if self._warned_sampling or not (gen_kwargs.get("do_sample") or float(temperature) > 0):
            return
        self._warned_sampling = True
        asked = {k: gen_kwargs[k] for k in ("do_sample", "temperature") if k in gen_kwargs}
        warnings.warn(f"the task asks for sampling ({asked}); dlm-jax decodes with its decode config "
                      f"(temperature={self.decode_config.proposer.temperature}): pass temperature=... in "
                      f"--model_args to sample", stacklevel=2)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        if not requests:
            return []
        jobs = []  # (index, context, gen_kwargs, until, config)
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args[0], dict(req.args[1] or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else [s for s in until if s]
            self._warn_sampling(gen_kwargs)
            jobs.append((i, context, req.args[1], until, self._gen_config(gen_kwargs)))
        # Every request streams through one continuous-batching engine (`dlm_jax.Engine`), at
        # most `batch_size` at once; generation lengths and stop strings are per request.
        from dlm_jax._engine import Engine

        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="dlm-jax generate_until", file=sys.stderr, disable=disable_tqdm)
        engine = Engine(self.handle, self.decode_config, max_batch=self.batch_size)
        try:
            handles = []
            for i, context, raw_kwargs, until, cfg in jobs:
                prompt = self.handle.encode(context, chat=self._chat)
                stop = until if self.handle.has_tokenizer else ()
                handles.append((i, context, raw_kwargs, until, engine.submit(prompt, cfg, stop=stop)))
            done = 0
            while engine.step():
                now = sum(h.done for *_, h in handles)
                bar.update(now - done)
                done = now
            bar.update(len(requests) - done)
            for i, context, raw_kwargs, until, h in handles:
                result = h.result()
                text = result.text if result.text is not None else " ".join(map(str, result.token_ids))
                cut = min((k for k in (text.find(s) for s in until) if k >= 0), default=len(text))
                out[i] = text[:cut]
                self.cache_hook.add_partial("generate_until", (context, raw_kwargs), out[i])
        finally:
            engine.close()
            bar.close()
        return out  # type: ignore[return-value]

    # -- log-likelihoods

    def scorer(self) -> Scorer:
        if self.handle.model is None:
            raise ConfigError(f"log-likelihood requests need the JAX model: {self.pretrained} is an exported bundle "
                              f"(LiteRT), which only generates; pass its checkpoint directory")
        if self._scorer is None:
            self._scorer = Scorer(self.handle.model)
        return self._scorer

    @property
    def mode(self) -> str:
        """"exact" (causal logit-shift models) or "mc" (masked diffusion)."""
        cfg = self.handle.config
        if cfg.attention == "causal" and cfg.logit_shift:
            return "exact"
        if cfg.attention == "bidirectional":
            return "mc"
        raise ConfigError(f"log-likelihoods of a model with {cfg.attention} attention"
                          f"{'' if cfg.logit_shift else ' and no logit shift'} have no estimator here: dlm-jax "
                          f"scores causal logit-shift models exactly and bidirectional masked-diffusion models "
                          f"by LLaDA's Monte Carlo estimate")

    def _prefix_id(self) -> int:
        """What an empty raw context conditions a causal model on: BOS, else EOS (lm-eval's
        convention for the first token)."""
        cfg = self.handle.config
        eos = cfg.eos_ids[0] if getattr(cfg, "eos_ids", None) else None
        pid = cfg.bos_token_id if cfg.bos_token_id is not None else eos
        if pid is None:
            raise ConfigError("an empty context needs a BOS or EOS token to condition on; the model declares none")
        return int(pid)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids): trailing whitespace of the context moves to the
        continuation (LLaDA's `_encode_pair`); with chat, the context is the chat-wrapped
        prompt and the continuation its answer tokens, else the raw split of context +
        continuation."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        tok = self.handle.tokenizer
        if self._chat:
            return list(self.handle.encode(context, chat=True)), list(tok.encode(continuation))
        whole = list(tok.encode(context + continuation))
        ctx = list(tok.encode(context))
        return ctx, whole[len(ctx):]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        if not requests:
            return []
        mode, scorer = self.mode, self.scorer()
        pairs = [self.encode_pair(*req.args[:2]) for req in requests]
        out: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        todo = [i for i, (_, cont) in enumerate(pairs) if cont]  # an empty continuation: log 1
        bar = tqdm(total=len(todo), desc=f"dlm-jax loglikelihood ({mode})", file=sys.stderr, disable=disable_tqdm)
        try:
            if mode == "exact":
                fixed = [(ctx or [self._prefix_id()], cont) for ctx, cont in (pairs[i] for i in todo)]
                for i, res in zip(todo, scorer.exact(fixed, rows=self.mc_batch, progress=bar.update)):
                    out[i] = res
            else:
                for i in todo:
                    ctx, cont = pairs[i]
                    losses = scorer.mc_rounds(ctx, cont, mc_num=self.mc_num, mc_batch=self.mc_batch,
                                              rng=request_rng(self.seed, ctx, cont))
                    greedy = scorer.greedy_suffix(ctx, cont) if self.is_check_greedy else False
                    out[i] = (-float(losses.mean()), greedy)
                    bar.update(1)
        finally:
            bar.close()
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args[:2], res)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        if self.mode != "exact":
            raise ConfigError(f"loglikelihood_rolling (perplexity tasks) is not defined for masked-diffusion models "
                              f"({self.pretrained} has {self.handle.config.attention} attention), as in LLaDA's own "
                              f"evaluation: use generative or multiple-choice tasks, or a causal model")
        scorer = self.scorer()
        limit = self.handle.config.max_seq_len
        out = []
        for req in requests:
            tokens = list(self.handle.tokenizer.encode(req.args[0]))  # a document, not a prompt: raw
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=tokens, prefix_token=self._prefix_id(), max_seq_len=limit, context_len=1)]
            total = sum(lp for lp, _ in scorer.exact(windows, rows=self.mc_batch)) if windows else 0.0
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return out

    # -- construction from lm-eval

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DlmJaxLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> DlmJaxLM:
        """`model_args` over lm-eval's own settings (batch_size, max_batch_size, device): a
        model arg wins where both name one (lm-eval's CLI always passes batch_size, 1 unless
        --batch_size says otherwise)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **dict(arg_dict)})


def _register() -> None:
    """Register `DlmJaxLM` as "dlm-jax" (once per process: `python -m dlm_jax.frontends.lmeval` runs this
    file as `__main__` and imports it as `dlm_jax.frontends.lmeval`, only the latter registers).

    lm-eval's own models are registered first (`import lm_eval.models` above, lazily): its
    `get_model` imports them only while the registry is empty, which it no longer is once
    "dlm-jax" is in it."""
    try:
        model_registry.register(MODEL_NAME)(DlmJaxLM)
    except ValueError:  # already registered by an earlier import of this module (a reload): keep it
        pass


if __name__ != "__main__":
    _register()


# ----------------------------------------------------------------------------------------------
# Local tasks


def _choices_addition(answer: str, prompt: str) -> list[str]:
    s = int(answer)
    return [str(v) for v in (s + 1, s - 1, s + 10, s - 10, s + 2, s + 100) if v >= 0]


def _choices_sorting(answer: str, prompt: str) -> list[str]:
    values = [int(t) for t in answer.split()]
    given = [int(t) for t in prompt.split(":", 1)[1].split()]
    out = [" ".join(map(str, given)), " ".join(map(str, values[::-1]))]
    for i in range(len(values) - 1):
        swapped = list(values)
        swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
        out.append(" ".join(map(str, swapped)))
    return out


def _choices_gsm_lite(answer: str, prompt: str) -> list[str]:
    head, _, last = answer.rpartition("=")
    final = int(last)
    return [f"{head}={v}" for v in (final + 1, final - 1, final + 2, final - 2, final + 10) if v >= 0]


DISTRACTORS: dict[str, Callable[[str, str], list[str]]] = {
    "addition": _choices_addition, "sorting": _choices_sorting, "gsm_lite": _choices_gsm_lite}


def multiple_choice(task: str, prompt: str, answer: str, *, n_choices: int = 4) -> tuple[list[str], int]:
    """(choices, index of the answer): the answer and `n_choices - 1` near misses (neighbouring
    sums; other orders of the numbers; the working with a wrong final result), in an order
    seeded by the prompt (deterministic)."""
    wrong: list[str] = []
    for c in DISTRACTORS[task](answer, prompt):
        if c != answer and c not in wrong:
            wrong.append(c)
    if len(wrong) < n_choices - 1:
        raise ValueError(f"{task} example {prompt!r}: only {len(wrong)} distinct distractors")
    choices = [answer, *wrong[:n_choices - 1]]
    order = np.random.default_rng(zlib.crc32(prompt.encode("utf-8"))).permutation(len(choices))
    shuffled = [choices[i] for i in order]
    return shuffled, shuffled.index(answer)


_SCORING_PY = '''"""process_results of the dlm-jax tasks beside this file (written by dlm_jax.frontends.lmeval.write_tasks):
a completion scores as `dlm-jax eval` scores it, by the task's own `score`."""

from dlm_jax.training.data import TASKS, Example


def process_results(doc, results):
    example = Example(doc["task"], doc["prompt"], doc["answer"])
    return {"exact_match": float(TASKS[doc["task"]].score(results[0], example))}
'''


def _yaml_task(name: str, data: Path, *, tag: str, body: list[str]) -> str:
    return "\n".join([
        "# Written by dlm_jax.frontends.lmeval.write_tasks (dlm-jax lm-eval --write-tasks); regenerate rather than edit.",
        f"task: {name}",
        f"tag: [{tag}]",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data))}",
        "test_split: test",
        "doc_to_text: prompt",
        *body,
        "metadata:",
        "  version: 1.0",
        "",
    ])


def write_tasks(directory: str | os.PathLike, tasks: Iterable[str] | None = None, *, n: int = 32, seed: int = 0,
                max_gen_toks: int = 64, n_choices: int = 4) -> list[str]:
    """Write lm-eval tasks over `n` held-out examples of each task of `dlm_jax.training.data.TASKS`
    (`make_split(TASKS[name], n, split="heldout", seed=seed)`, the examples and order of
    `dlm-jax eval --task name --n n`) into `directory`; returns the task names.

    Per task NAME: `dlmjax_NAME.jsonl` (task, prompt, answer, choices, gold), the generative
    `dlmjax_NAME.yaml` (exact_match by the task's own `score`, via `dlmjax_scoring.py`;
    `max_gen_toks` tokens, no stop strings: a completion ends at EOS and is scored whole, as
    `dlm-jax eval` scores it) and the multiple-choice `dlmjax_NAME_mc.yaml` (acc over the
    answer and `n_choices - 1` distractors, `multiple_choice`). Tags `dlmjax` and
    `dlmjax_mc` name each set. Data paths in the YAMLs are absolute."""
    from dlm_jax._integrity import atomic_write
    from dlm_jax.training.data import TASKS, make_split

    names = list(TASKS) if tasks is None else list(tasks)
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise ConfigError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    for label, value in (("n", n), ("max_gen_toks", max_gen_toks), ("n_choices", n_choices)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{label}={value!r} must be a positive integer")
    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / f"{SCORING_MODULE}.py", _SCORING_PY)
    written = []
    for name in names:
        rows = []
        for ex in make_split(TASKS[name], n, split="heldout", seed=seed):
            choices, gold = multiple_choice(name, ex.prompt, ex.answer, n_choices=n_choices)
            rows.append({"task": name, "prompt": ex.prompt, "answer": ex.answer, "choices": choices, "gold": gold})
        data = root / f"{TASK_PREFIX}{name}.jsonl"
        atomic_write(data, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        gen = _yaml_task(f"{TASK_PREFIX}{name}", data, tag="dlmjax", body=[
            "output_type: generate_until",
            "doc_to_target: answer",
            "generation_kwargs:",
            "  until: []",
            f"  max_gen_toks: {max_gen_toks}",
            f"process_results: !function {SCORING_MODULE}.process_results",
            "metric_list:",
            "  - metric: exact_match",
            "    aggregation: mean",
            "    higher_is_better: true",
        ])
        mc = _yaml_task(f"{TASK_PREFIX}{name}_mc", data, tag="dlmjax_mc", body=[
            "output_type: multiple_choice",
            "doc_to_choice: choices",
            "doc_to_target: gold",
            'target_delimiter: ""',
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
        ])
        atomic_write(root / f"{TASK_PREFIX}{name}.yaml", gen)
        atomic_write(root / f"{TASK_PREFIX}{name}_mc.yaml", mc)
        written += [f"{TASK_PREFIX}{name}", f"{TASK_PREFIX}{name}_mc"]
    return written


# ----------------------------------------------------------------------------------------------
# Command line


def help_text(prog: str = "dlm-jax lm-eval") -> str:
    decode = ", ".join(sorted(_decode_options()))
    own = "\n".join(f"  {name:<16} {help_}" + (f" (default {default})" if default is not None else "")
                    for name, (_, default, help_) in ADAPTER_ARGS.items())
    return f"""usage: {prog} [lm-eval run options]
       {prog} --write-tasks DIR [--n N] [--tasks NAME ...] [--max-gen-toks N] [--seed S]

lm-evaluation-harness (lm-eval run) with the model "dlm-jax" registered, e.g.
  {prog} --write-tasks tasks --n 32
  {prog} --model dlm-jax --model_args pretrained=models/llada-tiny,preset=fast-dllm \\
      --tasks dlmjax_addition --include_path tasks --batch_size 8

model args of dlm-jax (--model_args k=v,k=v):
{own}
  and any decode option: {decode}

--write-tasks DIR writes lm-eval tasks over held-out examples of the training task generators:
dlmjax_<task> (generative, exact_match as `dlm-jax eval` scores) and dlmjax_<task>_mc
(multiple choice, acc); tags dlmjax and dlmjax_mc. lm-eval's own options: {prog} run --help
"""


def _write_tasks_main(argv: list[str], prog: str) -> int:
    from dlm_jax.frontends._report import _Parser

    p = _Parser(prog=f"{prog} --write-tasks")
    p.add_argument("--write-tasks", dest="directory", required=True, metavar="DIR")
    p.add_argument("--n", type=int, default=32, help="held-out examples per task")
    p.add_argument("--tasks", nargs="+", help="dlm_jax.training.data task names (default all)")
    p.add_argument("--max-gen-toks", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    names = write_tasks(args.directory, args.tasks, n=args.n, seed=args.seed, max_gen_toks=args.max_gen_toks)
    print(json.dumps({"include_path": str(Path(args.directory).resolve()), "tasks": names}))
    return 0


def run(args: Sequence[str], *, prog: str = "dlm-jax lm-eval") -> int:
    """`dlm-jax lm-eval ARGS`: `--write-tasks DIR ...`, or lm-eval's command line on ARGS with
    "dlm-jax" registered. Errors propagate (the CLI reports them: `dlm_jax.frontends._report.report_errors`)."""
    args = list(args)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(help_text(prog))
        return 0
    if args[0] == "--write-tasks":
        return _write_tasks_main(args, prog)
    return _run_lm_eval(args)


def main(argv: Sequence[str] | None = None, *, prog: str = "dlm-jax lm-eval") -> int:
    """`python -m dlm_jax.frontends.lmeval ARGS`: `run`, with a user's mistake (a bad model arg, an unknown
    task, a missing checkpoint) ending in one `error:` line on stderr and exit code 2, never a
    traceback; lm-eval's own option errors are argparse's (exit 2)."""
    from dlm_jax.frontends._report import report_errors

    return report_errors(lambda: run(sys.argv[1:] if argv is None else argv, prog=prog))


def precheck(args: Sequence[str]) -> None:
    """With `--model dlm-jax`, check the `--model_args` (`model_settings`) before lm-eval
    indexes its tasks (seconds) and loads the model: a mistyped arg fails at once."""
    import argparse

    try:
        from lm_eval._cli.utils import MergeDictAction
    except ImportError:  # another lm-eval layout: lm-eval checks them later
        return
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", "-m")
    p.add_argument("--model_args", "-a", nargs="+", action=MergeDictAction, default=None)
    try:
        known, _ = p.parse_known_args(list(args))
    except SystemExit:  # lm-eval's own parser reports it
        return
    if known.model == MODEL_NAME:
        model_args = dict(known.model_args or {})
        model_settings(model_args.pop("pretrained", None), **model_args)


def _run_lm_eval(args: list[str]) -> int:
    """lm-eval's `cli_evaluate` on `args` (it reads sys.argv), with "dlm-jax" registered."""
    from lm_eval.__main__ import cli_evaluate

    import dlm_jax.frontends.lmeval  # noqa: F401  (registers the model when this file runs as __main__)

    precheck(args)
    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except (ConfigError, CheckpointError):
        raise
    except ValueError as e:  # lm-eval reports an unknown task as ValueError: a user's mistake too
        raise ConfigError(str(e)) from None
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    from dlm_jax.frontends.lmeval import main as _main

    sys.exit(_main(prog="python -m dlm_jax.frontends.lmeval"))

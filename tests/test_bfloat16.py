"""bfloat16 end to end on the JAX executor (the GPU's compute dtype, run here on the CPU
backend): every preset and every technique that decodes on the JAX executor, on the shipped
trained models loaded from their float32 checkpoints with `dtype="bfloat16",
param_dtype="bfloat16"`.

Each (model, decoder) pair decodes held-out task prompts in float32 and in bfloat16 and must:
raise nothing; return finite step outputs and completions of the requested length; keep the
executor's weights and the resident K/V cache in bfloat16 (not a silent float32 copy, nor a
float32 scatter into a bfloat16 cache); and agree with float32 on most prompts. Measured
agreement on the 6 held-out prompts: 6/6 on every dense pair (llada-12m included) and 5/6 on
the MoE ones, where one sorting prompt rounds differently (see
tests/techniques/tide/test_moe_reduced_precision.py), so the threshold `AGREE` (4 of 6) has
a margin of one to two prompts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax.executors.jax_executor import DeviceKVCache, JaxExecutor
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.training.data import TASKS, make_split

MODELS = Path(__file__).resolve().parents[1] / "models"
BF16 = dict(dtype="bfloat16", param_dtype="bfloat16")
GEN = 32
PROMPTS = [e.prompt for task in ("addition", "sorting") for e in make_split(TASKS[task], 3, split="heldout", seed=0)]
BLOCK_CAUSAL = dict(attention="block_causal", block_size=16)
AGREE = 4  # of the 6 prompts: the least share of bfloat16 completions equal to float32's
# MoE routers keep their selection bias in float32 (DeepSeek-V3's e_score_correction_bias):
# a [n_experts] vector that only ranks experts, never a matmul operand.
FLOAT32_LEAVES = ("expert_bias",)

# (model, load options, decode options): every preset on the models it is made for, and the
# techniques' decoders (ISD / left to right with and without R-ISD's gated LoRA; llada.cpp's
# MBSD with DPPR's CPU path; TIDE sparse dispatch, split execution and its expert placement).
# The default pass keeps three cases (the dual cache, DPPR's CPU path, a ReLU-family FFN); the
# rest (ISD with gated LoRA, block-causal attention, MoE, ...) run with --runslow.
SLOW = pytest.mark.slow
CASES = [
    *[pytest.param("llada-tiny", {}, {"preset": p}, marks=() if p == "fast-dllm-dual" else SLOW)
      for p in ("llada", "fast-dllm", "fast-dllm-dual", "fast-dllm-factor", "frechet", "llada-cpp")],
    pytest.param("llada-tiny", {}, {"preset": "fast-dllm", "temperature": 0.7}, marks=SLOW),  # float64 Gumbel sampling
    *[pytest.param("idlm-tiny", {}, {"preset": p}, marks=SLOW) for p in ("isd", "ar")],
    *[pytest.param("idlm-tiny", {"lora": str(MODELS / "idlm-tiny" / "risd")}, {"preset": p}, marks=SLOW)
      for p in ("isd", "ar")],
    pytest.param("sparse-tiny", {}, {"preset": "fast-dllm"}, marks=SLOW),  # (bfloat16 sparse-tiny by default:
    # test_powerinfer_statistics_in_bfloat16)
    # LLaDA2.0's block-causal attention (blocks at absolute multiples of 16; no trained
    # block-causal checkpoint ships, so the trained llada-tiny decodes under that mask)
    *[pytest.param("llada-tiny", BLOCK_CAUSAL, {"preset": p, "block_len": 16}, marks=SLOW)
      for p in ("fast-dllm", "fast-dllm-dual")],
    pytest.param("llada-12m", {}, {"preset": "fast-dllm"}, marks=pytest.mark.slow),
    pytest.param("moe-tiny", {}, {"preset": "fast-dllm"}, marks=pytest.mark.slow),  # sparse dispatch
    pytest.param("moe-tiny", {"expert_slots": 8}, {"preset": "fast-dllm"}, marks=pytest.mark.slow),
    pytest.param("moe-tiny", {"expert_slots": 8},
                 {"preset": "fast-dllm", "placement": "experts", "hits": "previous_step"}, marks=pytest.mark.slow),
]


class Spy:
    """What the JAX executor's steps saw: the resident cache's K/V dtypes at each step and
    after each CPU-path write, and whether every step output was finite."""

    def __init__(self):
        self.kv_dtypes: set[str] = set()
        self.outputs = 0
        self.nonfinite: list[str] = []
        self.sequences: list[np.ndarray] = []  # the decodes' generated ids, untrimmed (in the order they ended)
        self.reference: list[np.ndarray] = []  # float32's, in `decode_both`

    def outputs_seen(self, out) -> None:
        self.outputs += 1
        for name in ("top_prob", "second_prob", "entropy", "logits"):
            value = getattr(out, name, None)
            if value is None:
                continue
            value = np.asarray(value, np.float32)
            if name == "logits":  # the mask token's logit is -inf by design (the step drops it)
                value = np.where(value == -np.inf, 0.0, value)
            if not np.isfinite(value).all():
                self.nonfinite.append(name)


@pytest.fixture
def spy(monkeypatch) -> Spy:
    seen = Spy()
    step, write, dense, steps = DeviceKVCache.step, DeviceKVCache.write, JaxExecutor.step, Decoder.steps

    def cache_step(self, req, **kw):
        seen.kv_dtypes |= {str(x.dtype) for x in (*self.k, *self.v)}
        out = step(self, req, **kw)
        seen.kv_dtypes |= {str(x.dtype) for x in (*self.k, *self.v)}
        seen.outputs_seen(out)
        return out

    def cache_write(self, kv, slots, rows, **kw):
        write(self, kv, slots, rows, **kw)
        seen.kv_dtypes |= {str(x.dtype) for x in (*self.k, *self.v)}

    def dense_step(self, inputs, **kw):
        out = dense(self, inputs, **kw)
        seen.outputs_seen(out)
        return out

    def decoder_steps(self, *args, **kw):  # every decode loop, the engine's requests' included
        out = yield from steps(self, *args, **kw)
        seen.sequences += list(out.sequences)
        return out

    monkeypatch.setattr(Decoder, "steps", decoder_steps)
    monkeypatch.setattr(DeviceKVCache, "step", cache_step)
    monkeypatch.setattr(DeviceKVCache, "write", cache_write)
    monkeypatch.setattr(JaxExecutor, "step", dense_step)
    return seen


@pytest.fixture(scope="module")
def loaded():
    """`get(model, **load_options)` -> (float32, bfloat16) handles, each loaded once per module."""
    handles: dict = {}

    def get(name: str, **options):
        key = (name, tuple(sorted(options.items())))
        if key not in handles:
            path = MODELS / name
            handles[key] = (dlm_jax.load(path, executor="jax", **options),
                            dlm_jax.load(path, executor="jax", **BF16, **options))
        return handles[key]

    return get


def _executor_float32_leaves(handle) -> set[str]:
    state = jax.tree_util.tree_flatten_with_path(nnx.state(handle.model))[0]
    return {jax.tree_util.keystr(p) for p, leaf in state if str(leaf.dtype) == "float32"}


def decode_both(f32, bf16, options: dict, spy: Spy):
    options = dict(options)
    cfg = dlm_jax.preset(options.pop("preset"), gen_len=GEN, **options)
    seeds = list(range(len(PROMPTS)))
    want = f32.generate(PROMPTS, cfg, seeds=seeds)
    spy.reference = spy.sequences  # float32's generated ids, untrimmed
    spy.kv_dtypes.clear()
    spy.outputs, spy.nonfinite, spy.sequences = 0, [], []
    got = bf16.generate(PROMPTS, cfg, seeds=seeds)
    return want, got


@pytest.mark.parametrize("name, load_options, decode", CASES)
def test_decodes_in_bfloat16_like_float32(name, load_options, decode, loaded, spy):
    """A bfloat16 decode that silently ran in float32 (weights or K/V upcast on the way), or
    that produced NaN confidences (committing arbitrary tokens without an error), or that
    drifted from float32's answers: here each shows as a failed assertion."""
    f32, bf16 = loaded(name, **load_options)
    want, got = decode_both(f32, bf16, decode, spy)
    kept32 = {p for p in _executor_float32_leaves(bf16) if not any(s in p for s in FLOAT32_LEAVES)}
    assert not kept32, f"float32 parameters in the bfloat16 model: {sorted(kept32)[:4]}"
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(bf16.executor._leaves)
              if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) and leaf.ndim >= 2]
    assert leaves and {str(leaf.dtype) for leaf in leaves} == {"bfloat16"}
    assert spy.outputs > 0 and not spy.nonfinite
    assert spy.kv_dtypes == {"bfloat16"}
    mask = bf16.config.mask_token_id
    # The requests' loops end last (a placement's calibration decode, if any, runs first).
    assert [len(seq) for seq in spy.sequences[-len(PROMPTS):]] == [GEN] * len(PROMPTS)
    assert not any(mask in ids for ids in got.token_ids)  # every slot before EOS decided
    agree = sum(a == b for a, b in zip(want.token_ids, got.token_ids))
    assert agree >= AGREE, (agree, want.texts, got.texts)


@pytest.mark.parametrize("name, load_options, decode", CASES)
def test_decodes_with_a_gpu_s_defaults_like_the_cpu_s(name, load_options, decode, loaded, spy, monkeypatch):
    """The path a GPU user's decode takes, on the CPU backend: the executor built for a GPU
    (`building_for("gpu")`: the resident cache read in place by the split attention, an
    engine's rows batched, q and k rotated by one RoPE op) and the rows' logits kept on the
    device, where the proposer's and the schedule's questions are answered (a GPU's
    `logits_on="auto"`). Each case decodes as with the CPU's defaults (the read slots gathered,
    row by row, logits on the host): bfloat16 weights and K/V, finite outputs, every slot
    decided, and the CPU defaults' completions on most prompts (measured: 6 of 6 in every case).
    A step, schedule or answer that only a GPU build takes fails here, not first on a GPU."""
    from dlm_jax.executors._compile import building_for
    from dlm_jax.executors._logits import DeviceLogits
    from dlm_jax.runtime.decoder import logits_on_device

    asked = []
    real_answer = DeviceLogits.answer.__func__
    monkeypatch.setattr(DeviceLogits, "answer", classmethod(lambda cls, asks: asked.append(len(asks))
                                                            or real_answer(cls, asks)))
    options = dict(decode)
    cfg = dlm_jax.preset(options.pop("preset"), gen_len=GEN, **options)
    seeds = list(range(len(PROMPTS)))
    _, cpu = loaded(name, **load_options)
    want = cpu.generate(PROMPTS, cfg, seeds=seeds)
    spy.kv_dtypes.clear()
    spy.outputs, spy.nonfinite, spy.sequences = 0, [], []
    asked.clear()
    with building_for("gpu"):
        gpu = dlm_jax.load(MODELS / name, executor="jax", **BF16, **load_options)
        ex = gpu.executor
        assert (ex.attention, ex.rows, ex.one_rope) == ("split", "batched", True)
        on_device = dataclasses.replace(cfg, proposer=dataclasses.replace(cfg.proposer, logits_on="device"))
        got = gpu.generate(PROMPTS, on_device, seeds=seeds)
    assert spy.outputs > 0 and not spy.nonfinite
    assert spy.kv_dtypes == {"bfloat16"}
    assert [len(seq) for seq in spy.sequences[-len(PROMPTS):]] == [GEN] * len(PROMPTS)
    assert not any(gpu.config.mask_token_id in ids for ids in got.token_ids)
    # Answered on the device where the decode reads its logits (sampling, ISD's judging).
    assert bool(asked) == logits_on_device(on_device, ex.capabilities)
    agree = sum(a == b for a, b in zip(want.token_ids, got.token_ids))
    assert agree >= AGREE, (agree, want.texts, got.texts)


@pytest.mark.slow  # (5 s; the default pass decodes bfloat16 models through the presets above)
def test_powerinfer_statistics_in_bfloat16(loaded, spy):
    """PowerInfer-2's offline paths that decode on the JAX executor (`decode_statistics`: the
    `ffn_active` step output; `record_windows` + `ffn_samples`: the predictor's training pairs)
    on a bfloat16 sparse-tiny: `ffn_samples` returned the bfloat16 model's FFN inputs in
    bfloat16 although it promises float32 [L, N, D] (the predictor then trained on whatever
    dtype the model had). The statistics and the activity must be float32's, up to rounding."""
    from dlm_jax.techniques.powerinfer.neurons import decode_statistics
    from dlm_jax.techniques.powerinfer.sparse import ffn_samples, record_windows

    f32, bf16 = loaded("sparse-tiny")
    cfg = dlm_jax.preset("fast-dllm", gen_len=GEN)
    ids = [f32.encode(p) for p in PROMPTS[:2]]
    want = decode_statistics(f32, ids, cfg)
    spy.kv_dtypes.clear()
    got = decode_statistics(bf16, ids, cfg)
    assert got.tokens == want.tokens > 0 and spy.kv_dtypes == {"bfloat16"}
    rate_f32, rate_bf16 = want.token_hits / want.tokens, got.token_hits / got.tokens
    assert np.abs(rate_f32 - rate_bf16).max() <= 0.05  # measured 1/86: one token's neuron flipped
    x32, active32 = ffn_samples(f32.model, record_windows(f32, ids[:1], cfg))
    x16, active16 = ffn_samples(bf16.model, record_windows(bf16, ids[:1], cfg))
    assert x16.dtype == np.float32 and x16.shape == x32.shape and active16.dtype == bool
    assert (active16 != active32).mean() <= 0.01  # measured 8e-5
    np.testing.assert_allclose(x16, x32, atol=0.1 * np.abs(x32).max())  # bfloat16's 8 mantissa bits


def test_the_commands_and_lm_eval_decode_a_float32_checkpoint_in_bfloat16(monkeypatch, capsys):
    """`--dtype bfloat16` (the decode commands) and the lm-eval model arg `dtype=bfloat16` load a
    float32 checkpoint with bfloat16 weights and arithmetic, as `dlm_jax.load(dtype=...,
    param_dtype=...)` does, and answer as that model does. Guards the silent failure of a flag
    that parses but leaves the model in float32 (a GPU user's decode at twice the bytes). The
    LiteRT runner, whose bundles are exported float32 from the files, is refused in one line."""
    from dlm_jax.frontends import lmeval
    from dlm_jax.frontends.cli import main

    loaded = []
    real_load = dlm_jax.load

    def spy(*args, **kw):
        handle = real_load(*args, **kw)
        loaded.append(handle)
        return handle

    monkeypatch.setattr(dlm_jax, "load", spy)
    path = MODELS / "llada-tiny"
    args = ["generate", "--model", str(path), "--prompt", PROMPTS[0], "--gen", str(GEN), "--executor", "jax"]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out.strip()
    (handle,) = loaded
    assert handle.model.config.dtype == handle.model.config.param_dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(handle.model, nnx.Param))} == {np.dtype(jax.numpy.bfloat16)}
    want = real_load(path, executor="jax", **BF16).generate([PROMPTS[0]], dlm_jax.decode_config(gen_len=GEN))
    assert out == want.texts[0]
    lm = lmeval.DlmJaxLM(pretrained=str(path), dtype="bfloat16", executor="jax")
    assert lm.handle.model.config.dtype == lm.handle.model.config.param_dtype == "bfloat16"
    with pytest.raises(dlm_jax.ConfigError, match="model arg dtype='bf16' is not one of"):
        lmeval.model_settings(str(path), dtype="bf16")
    assert main([*args[:-1], "litert", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: dtype bfloat16: the LiteRT runner"), err

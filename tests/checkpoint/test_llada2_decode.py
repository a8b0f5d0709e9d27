"""LLaDA2.0 decodes in the blocks its generator decodes: absolute multiples of the block length.

Guards against the silent failure where a block-causal model is decoded in blocks that start
at the end of the prompt: an 8-token prompt with block length 32 then decodes positions 8-39
as one block, although the model's attention (and LLaDA2.0's `generate`) splits them into
8-31 (the rest of the block the prompt ends in) and 32-63. Tokens still come out, with an
attention pattern the model was never trained or released with, and no error.

The reference is a transcription of the block loop of inclusionAI's LLaDA2.0 `generate`
(`LLaDA2MoeModelLM.generate`): blocks from `prompt_length // block_length` to
ceil((prompt + gen) / block_length), each decoded over the sequence up to its end under the
block-causal mask of whole blocks; per step, the masked slots of the block take the argmax
and its probability, every one above `threshold` is kept when they are at least the step's
scheduled count (`block_length` split over `steps`), else the scheduled count of the most
confident; a block ends when it has no mask left; decoding stops after a block holding an
EOS, and the answer is cut after the first EOS. It drives transformers' Glm4Moe, which
computes LLaDA2.0's forward (`test_llada2`), with that mask and absolute position ids. Where
it departs from the released file: temperature 0 is greedy (argmax and its softmax
probability), as the docstring says and as inclusionAI's later fix of the sampler reads it
(the released sampler draws from the softmax even at temperature 0), and the mask is float32
0 / -inf where the release builds the same values in bfloat16. The softmax keeps the mask
token, as released; the tiny model's head gives it a probability near 1e-4 (a trained model
never predicts it; dlm-jax drops its logit before the softmax).

Settings: `generate(block_length=L, steps=L, threshold=t, eos_id=e, mask_id=m)` with
gen_length >= L (so `steps` stays L) is dlm-jax's `rule="threshold", threshold=t,
block_len=L` on a model of block size L (loaded with `mask_token_id=m, eos_token_id=e`):
with one token scheduled per step the generator keeps every candidate above t, or the most
confident one, which is Fast-dLLM's threshold rule (at >= t; no confidence here equals t).
Any cache mode: a block-causal model's caches are exact once blocks sit on its own.
"""

import numpy as np
import pytest
import torch

import dlm_jax
from dlm_jax.runtime.scheduler import DualCache, NoCache, PrefixCache
from dlm_jax.runtime.state import DecodeState
from dlm_jax.testing import tiny_config

from .hf_models import BUILDERS, build, glm4_moe_to_llada2
from .test_llada2 import _tiny_config

MASK = 95
BLOCK = 32
GEN = 32
THRESHOLD = 0.7
THETA = 10.0  # fast RoPE: masked slots read out position-dependent predictions
LENGTHS = (8, 13, 32, 45)  # inside block 0, inside block 0, a whole block, inside block 1
_RNG = np.random.default_rng(0)
PROMPTS = [_RNG.integers(0, 90, n).tolist() for n in LENGTHS]  # ids below the pad (90) and mask (95)
RELEASED_EOS = 156892  # the generator's default eos_id, outside the tiny vocabulary


def llada2_generate(model: torch.nn.Module, prompt: list[int], *, gen_length: int, block_length: int = 32,
                    steps: int = 32, threshold: float = 0.95, minimal_topk: int = 1, eos_id: int = RELEASED_EOS,
                    mask_id: int = MASK) -> tuple[list[int], int]:
    """LLaDA2.0's `generate` at temperature 0 (no top-k / top-p, no early EOS stop) on a batch
    of one: (the answer, cut after its first EOS; the forwards it ran)."""
    steps = min(steps, gen_length // minimal_topk)
    input_ids = torch.as_tensor([prompt])
    prompt_length = input_ids.shape[1]
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    block_mask = torch.tril(torch.ones(num_blocks, num_blocks))
    visible = block_mask.repeat_interleave(block_length, dim=0).repeat_interleave(block_length, dim=1)
    attention = torch.where(visible.bool(), 0.0, float("-inf"))[None, None]
    position_ids = torch.arange(total_length).unsqueeze(0)
    x = torch.full((1, total_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = input_ids
    base, remainder = divmod(block_length, steps)
    schedule = torch.full((steps,), base, dtype=torch.int64)
    schedule[:remainder] += 1
    forwards = 0
    for num_block in range(prompt_length // block_length, num_blocks):
        end = (num_block + 1) * block_length
        cur_x = x[:, :end]  # a view: commits land in x
        for step in range(steps):
            active = cur_x[:, -block_length:] == mask_id
            if active.sum() == 0:
                break
            with torch.no_grad():
                logits = model(cur_x, attention_mask=attention[:, :, :end, :end],
                               position_ids=position_ids[:, :end]).logits.float()
            forwards += 1
            probs = torch.softmax(logits[:, -block_length:], dim=-1)
            x0 = probs.argmax(dim=-1)
            x0_p = torch.gather(probs, -1, x0[..., None])[..., 0]
            n = schedule[step].item()
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            confidence = torch.where(active, x0_p, -torch.inf)
            high = confidence[0] > threshold
            if high.sum().item() >= n:
                transfer[0] = high
            else:
                _, idx = torch.topk(confidence[0], k=min(n, active.sum().item()))
                transfer[0, idx] = True
            cur_x[:, -block_length:][transfer] = x0[transfer]
        if (x[0, prompt_length:end] == eos_id).any():
            break
    answer = x[0, prompt_length:prompt_length + gen_length]
    eos = (answer == eos_id).nonzero(as_tuple=True)[0]
    cut = eos[0].item() if len(eos) else gen_length
    return answer[:cut + 1].tolist(), forwards


@pytest.fixture(scope="module")
def glm():
    """Tiny random Glm4Moe (LLaDA2.0's computation) made decisive: zero mask embedding, sharp
    attention, a scaled head whose mask row is zero."""
    rope = {**BUILDERS["glm4_moe"]()[2]["rope_parameters"], "rope_theta": THETA}
    model = build("glm4_moe", seed=1, rope_parameters=rope)
    with torch.no_grad():
        model.model.embed_tokens.weight[MASK] = 0.0
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.mul_(3.0)
        model.lm_head.weight.mul_(8.0)
        model.lm_head.weight[MASK] = 0.0
    return model


@pytest.fixture(scope="module")
def ckpt(glm, tmp_path_factory):
    path = tmp_path_factory.mktemp("llada2") / "ckpt"
    glm4_moe_to_llada2(glm, path, {**_tiny_config(glm), "rope_theta": THETA})
    return path


@pytest.fixture(scope="module")
def refs(glm):
    """The generator's (answer, forwards) for PROMPTS[i], computed once when first asked."""
    memo: dict[int, tuple[list[int], int]] = {}

    def ref(i: int) -> tuple[list[int], int]:
        if i not in memo:
            memo[i] = llada2_generate(glm, PROMPTS[i], gen_length=GEN, block_length=BLOCK, steps=BLOCK,
                                      threshold=THRESHOLD)
        return memo[i]

    return ref


def _config(cache: str):
    return dlm_jax.decode_config(gen_len=GEN, block_len=BLOCK, cache=cache, rule="threshold", threshold=THRESHOLD)


def test_first_block_is_the_rest_of_the_prompts_block(ckpt, refs):
    """An 8-token prompt, block 32, 32 tokens: the generator decodes 8-31, then 32-63 (keeping
    32-39), where dlm-jax silently decoded 8-39 as one block; it must now give the generator's
    tokens and take its forwards."""
    handle = dlm_jax.load(ckpt, mask_token_id=MASK)
    out = handle.generate([PROMPTS[0]], _config("prefix"))
    ref, forwards = refs(0)
    assert out.token_ids[0] == ref
    assert out.stats.nfe == forwards
    assert handle.config.block_align == BLOCK  # the family's block-causal attention, block 32


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_each_prompt_alone_and_in_a_batch_decodes_the_generators_tokens(ckpt, refs, cache):
    """Prompts ending inside a block (8, 13, 45 tokens) and on a block's end (32): alone, and
    all four in one left-padded batch, where each keeps its own blocks (they sit at different
    slots) and takes the generator's forwards."""
    handle = dlm_jax.load(ckpt, mask_token_id=MASK)
    expected = [refs(i) for i in range(len(PROMPTS))]
    for prompt, (ref, forwards) in zip(PROMPTS, expected):
        out = handle.generate([prompt], _config(cache))
        assert (out.token_ids[0], out.stats.nfe) == (ref, forwards), len(prompt)
    batched = handle.generate(PROMPTS, _config(cache))
    assert batched.token_ids == [ref for ref, _ in expected]
    assert batched.stats.request_nfe == [forwards for _, forwards in expected]


@pytest.mark.slow
def test_eos_in_a_later_block_cuts_the_answer_where_the_generator_does(glm, ckpt, refs):
    """The generator stops after the block holding an EOS and cuts its answer after it;
    dlm-jax (which stops at an all-EOS block) returns the same answer up to that EOS."""
    ref, _ = refs(0)
    first = BLOCK - LENGTHS[0]  # the answer's slots in the first block
    eos = next(t for i, t in enumerate(ref) if i >= first and t not in ref[:i])
    cut, _ = llada2_generate(glm, PROMPTS[0], gen_length=GEN, block_length=BLOCK, steps=BLOCK,
                             threshold=THRESHOLD, eos_id=eos)
    assert cut[-1] == eos and len(cut) > first
    handle = dlm_jax.load(ckpt, mask_token_id=MASK, eos_token_id=eos)
    assert handle.generate([PROMPTS[0]], _config("dual")).token_ids[0] == cut[:-1]  # token_ids end before EOS


@pytest.mark.parametrize("cls", [NoCache, PrefixCache, DualCache])
def test_blocks_of_a_block_causal_model_start_at_multiples_of_its_block(cls):
    """The units a schedule plans (silently 8-39 for every model before): a block-causal model
    of block size 32 gets 8-31 then 32-63 for an 8-token prompt (a 13-token one beside it in a batch keeps 13-31 and 32-63, each
    request its own rows); a bidirectional model, or a block length that is not the model's,
    keeps the blocks from the generation's start (8-39)."""
    block_causal = tiny_config(attention="block_causal", block_size=BLOCK)

    def units(scheduler, lens):
        state = DecodeState.create([[1] * n for n in lens], gen_len=GEN, batch=len(lens), mask_id=MASK,
                                   vocab_size=96, tail=scheduler.overhang())
        cursor = scheduler.start(state)
        out = []
        while (plan := scheduler.plan(state, cursor)) is not None:
            current = np.ones((len(lens), len(plan.targets)), bool) if plan.current is None else plan.current
            # As slots of each request's own sequence (left padding moves the shorter prompt).
            out.append([(plan.targets[c] - (state.gen_start - n)).tolist() for c, n in zip(current, lens)])
            scheduler.advance(state, cursor, True)
        return out, state.total

    aligned = cls(block_len=BLOCK).for_model(block_causal)
    assert aligned.align and aligned.overhang() == BLOCK - 1
    got, total = units(aligned, [8])
    assert got == [[list(range(8, 32))], [list(range(32, 64))]] and total == 8 + GEN + BLOCK - 1
    got, _ = units(aligned, [8, 13])
    assert got == [[list(range(8, 32)), list(range(13, 32))], [list(range(32, 64)), list(range(32, 64))]]
    got, _ = units(aligned, [32, 13])  # a whole-block prompt: its first unit is all prompt
    assert got == [[[], list(range(13, 32))], [list(range(32, 64)), list(range(32, 64))]]
    for model, block in ((tiny_config(attention="bidirectional", block_size=BLOCK), BLOCK), (block_causal, 16)):
        plain = cls(block_len=block).for_model(model)
        assert not plain.align and plain.overhang() == 0
        got, total = units(plain, [8])
        assert got == [[list(range(8 + u * block, 8 + (u + 1) * block))] for u in range(GEN // block)]
        assert total == 8 + GEN

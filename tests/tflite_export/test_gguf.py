"""GGUF export (`dlm-jax export --format gguf`): read back with gguf-py's own reader and
quantizers, the RoPE row order against this project's attention, the tokenizer against GPT-2's
byte table and the chat template against `apply_chat`; refusals write nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from dlm_jax.checkpoint._io import load_pretrained  # noqa: E402
from dlm_jax.frontends.cli import main  # noqa: E402
from dlm_jax.models._params import get_params  # noqa: E402
from dlm_jax.tflite_export.gguf import GGUF_QUANTS, byte_chars, export_gguf, gguf_tensors  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "llada-tiny"
T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny():
    model = load_pretrained(TINY)
    return model.config, gguf_tensors(get_params(model), model.config)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {q: export_gguf(TINY, d / f"tiny-{q}.gguf", quant=q).path for q in GGUF_QUANTS}


def _field(reader, key):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]][0].item()


@pytest.mark.parametrize("quant", list(GGUF_QUANTS))
def test_every_tensor_reads_back_with_its_shape_type_and_value(exported, tiny, quant):
    cfg, want = tiny
    reader = gguf.GGUFReader(exported[quant])
    got = {t.name: t for t in reader.tensors}
    assert set(got) == set(want)
    for name, value in want.items():
        t = got[name]
        assert tuple(int(n) for n in t.shape) == tuple(reversed(value.shape)), name  # GGUF ne order
        if value.ndim == 1 or quant == "f32":
            assert t.tensor_type == T.F32
            np.testing.assert_array_equal(np.asarray(t.data).reshape(value.shape), value)
        elif quant == "f16":
            assert t.tensor_type == T.F16
            np.testing.assert_array_equal(np.asarray(t.data).reshape(value.shape), value.astype(np.float16))
        else:
            qtype = T.Q8_0 if quant == "q8_0" else T.Q4_0
            assert t.tensor_type == qtype
            raw = np.asarray(t.data).reshape(value.shape[0], -1)
            # Bit-exact with gguf-py's reference quantizer, and within the format's error.
            np.testing.assert_array_equal(raw, gguf.quants.quantize(value, qtype))
            back = gguf.quants.dequantize(raw, qtype).reshape(value.shape)
            block_max = np.abs(value.reshape(-1, 32)).max(axis=1, keepdims=True)
            bound = block_max / 127 * 0.6 if quant == "q8_0" else block_max / 8 * 1.1  # half a step, fp16 scale
            assert (np.abs(back.reshape(-1, 32) - value.reshape(-1, 32)) <= bound + 1e-6).all(), name


def test_metadata_is_what_llama_cpp_reads_for_llada(exported, tiny):
    cfg, _ = tiny
    reader = gguf.GGUFReader(exported["f32"])
    assert _field(reader, "general.architecture") == "llada"
    expect = {"llada.block_count": cfg.n_layers, "llada.embedding_length": cfg.d_model,
              "llada.feed_forward_length": cfg.ffn_hidden, "llada.attention.head_count": cfg.n_heads,
              "llada.attention.head_count_kv": cfg.n_kv_heads, "llada.rope.dimension_count": cfg.head_dim,
              "llada.context_length": cfg.max_seq_len, "llada.attention.causal": False,
              "diffusion.shift_logits": False, "tokenizer.ggml.mask_token_id": cfg.mask_token_id,
              "tokenizer.ggml.model": "gpt2"}
    assert {k: _field(reader, k) for k in expect} == expect
    assert _field(reader, "llada.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.norm_eps)
    assert _field(reader, "llada.rope.freq_base") == pytest.approx(cfg.rope_theta)


def test_vocabulary_is_gpt2_byte_level_then_the_special_tokens(exported):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    reference = bytes_to_unicode()
    assert byte_chars() == [reference[b] for b in range(256)]
    reader = gguf.GGUFReader(exported["f32"])
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    import dlm_jax

    tok = dlm_jax.load_tokenizer(TINY)
    assert tokens[256 + tok.mask_id - 256] == "<|mask|>" and tokens[tok.eos_id] == "<|eos|>"
    assert tokens[:256] == [reference[b] for b in range(256)]
    assert set(types[:256]) == {gguf.TokenType.NORMAL} and set(types[256:]) == {gguf.TokenType.CONTROL}


def test_chat_template_renders_what_apply_chat_encodes(tmp_path):
    import jinja2

    import dlm_jax
    from dlm_jax.tflite_export.gguf import CHAT_TEMPLATE

    tok = dlm_jax.load_tokenizer(ROOT / "models" / "llada-12m")
    assert tok.prompt_format == "chat"
    path = export_gguf(ROOT / "models" / "llada-12m", tmp_path / "m.gguf", quant="q4_0").path
    template = _field(gguf.GGUFReader(path), "tokenizer.chat_template")
    assert template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+34="}]
    text = jinja2.Template(template).render(messages=messages, add_generation_prompt=True, bos_token="<|bos|>")
    assert tok.encode(text) == tok.apply_chat(messages)


def test_rope_row_order_gives_the_same_attention_scores(tiny):
    """llama.cpp rotates adjacent pairs; the exported q/k rows must make its scores equal ours."""
    import jax.numpy as jnp

    from dlm_jax.models._transformer import apply_rope, rope_tables

    cfg, tensors = tiny
    model = load_pretrained(TINY)
    params = get_params(model)
    x = np.random.default_rng(0).standard_normal((5, cfg.d_model)).astype(np.float32)
    pos = np.arange(5)[None]
    cos, sin = rope_tables(jnp.asarray(pos), cfg.head_dim, cfg.rope_theta)
    dh = cfg.head_dim

    def ours(kernel, heads):
        h = (x @ np.asarray(kernel)).reshape(1, 5, heads, dh)
        return np.asarray(apply_rope(jnp.asarray(h), cos, sin))[0]

    def llama_cpp(weight, heads):  # GGML_ROPE_TYPE_NORM: pairs (2i, 2i+1), theta_i = base^(-2i/dh)
        h = (x @ weight.T).reshape(5, heads, dh // 2, 2)
        ang = pos[0][:, None] * cfg.rope_theta ** (-np.arange(dh // 2) * 2 / dh)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        return np.stack([h[..., 0] * c - h[..., 1] * s, h[..., 0] * s + h[..., 1] * c], -1).reshape(5, heads, dh)

    q0 = ours(params["layers.0.attn.q_proj.kernel"], cfg.n_heads)
    k0 = ours(params["layers.0.attn.k_proj.kernel"], cfg.n_kv_heads)
    q1 = llama_cpp(tensors["blk.0.attn_q.weight"], cfg.n_heads)
    k1 = llama_cpp(tensors["blk.0.attn_k.weight"], cfg.n_kv_heads)
    group = cfg.n_heads // cfg.n_kv_heads
    for h in range(cfg.n_heads):
        np.testing.assert_allclose(q1[:, h] @ k1[:, h // group].T, q0[:, h] @ k0[:, h // group].T,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("argv, message", [
    (["--model", "models/idlm-tiny", "--quant", "q4_0"], "cannot run this model: attention='causal'"),
    (["--model", "models/moe-tiny"], "a mixture of experts"),
    (["--model", "models/llada-tiny", "--quant", "int8"], "is a bundle quantisation"),
    (["--model", "models/llada-tiny", "--quant", "q5_k"], "invalid choice"),
    (["--model", "models/llada-tiny", "--partition"], "--partition apply to bundles"),
])
def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "m.gguf"
    argv = [a if not a.startswith("models/") else str(ROOT / a) for a in argv]
    try:
        code = main(["export", "--format", "gguf", "--out", str(out), *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert list(tmp_path.iterdir()) == []


def test_quant_of_the_other_format_is_refused_for_bundles(tmp_path, capsys):
    assert main(["export", "--model", str(TINY), "--out", str(tmp_path / "b"), "--quant", "q4_0"]) == 2
    assert "pass --format gguf" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_existing_file_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep")
    assert main(["export", "--model", str(TINY), "--out", str(out), "--format", "gguf"]) == 2
    assert "--overwrite" in capsys.readouterr().err and out.read_bytes() == b"keep"
    assert main(["export", "--model", str(TINY), "--out", str(out), "--format", "gguf", "--overwrite"]) == 0
    assert gguf.GGUFReader(out).tensors


def _llamacpp():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _llamacpp

    return _llamacpp


@pytest.mark.slow
def test_llama_cpp_decodes_the_exported_file_to_the_model_answers(exported):
    """The strongest check that the file is right: llama.cpp's own diffusion CLI, decoding the
    shipped model's held-out addition prompts from it, gives the answers our decoder gives."""
    lc = _llamacpp()
    cli = lc.built_binary()
    if cli is None:
        pytest.skip("llama-diffusion-cli is not built (python benchmarks/peers.py --build-llama-cpp)")
    import dlm_jax
    from dlm_jax.training.data import TASKS, make_split

    model = dlm_jax.load(TINY, executor="jax")
    examples = make_split(TASKS["addition"], 8, split="heldout")
    ours = model.generate([e.prompt for e in examples], dlm_jax.preset("llada", gen_len=32, steps=32)).texts
    agree = 0
    for ex, mine in zip(examples, ours):
        shape = lc.RunShape(len(model.encode(ex.prompt)), 32, 32, 32)
        run = lc.diffuse(cli, exported["f32"], ex.prompt, shape, sampling=("--top-k", "1", "--temp", "0"))
        agree += TASKS["addition"].score(run.text, ex) and TASKS["addition"].score(mine, ex)
    assert agree >= 6, (agree, ours)

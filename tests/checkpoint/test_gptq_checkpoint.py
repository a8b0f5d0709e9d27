"""GPTQ checkpoints (config `quantization_config.quant_method: "gptq"`, written here by AutoRound's
own quantizer and packer, `format="auto_gptq"`) load as weight-only int4 (symmetric), uint4
(asymmetric 4-bit: with zero points) or int8 (8-bit, q - 128) and compute what transformers computes with the weights
AutoRound's own GPTQ kernel (`QuantLinear`, torch backend) dequantises from the same files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import dlm_jax
from dlm_jax._errors import CheckpointError, ConfigError
from dlm_jax.checkpoint._prequantized import gptq_unpack

from .hf_models import (build, edit_quantization_config, loaded_logits, logits, reference_logits,
                        word_tokenizer)

IDS = np.random.default_rng(0).integers(0, 96, (2, 13))
TOL = 1e-4


def gptq_checkpoint(dst: Path, *, kind: str = "qwen3", bits: int = 4, group: int = 16, sym: bool = True) -> Path:
    """A tiny random `kind` model quantized by AutoRound (round to nearest: no calibration) and
    saved in GPTQ's format (format "gptq": zero points stored minus one)."""
    from auto_round import AutoRound

    dst.mkdir(parents=True, exist_ok=True)
    word_tokenizer(dst)
    tokenizer = T.PreTrainedTokenizerFast(tokenizer_file=str(dst / "tokenizer.json"), unk_token="<unk>",
                                          pad_token="<|endoftext|>")
    # (dimensions that are multiples of 32: AutoRound leaves other linears float)
    rounder = AutoRound(build(kind, intermediate_size=64), tokenizer=tokenizer, bits=bits, group_size=group, sym=sym,
                        iters=0, disable_opt_rtn=True)
    rounder.quantize_and_save(str(dst / "out"), format="auto_gptq")
    (out,) = [p for p in (dst / "out").iterdir() if (p / "config.json").exists()] or [dst / "out"]
    return out


def _dequantized(path: Path, dst: Path) -> np.ndarray:
    """transformers' float32 logits with each GPTQ linear of `path` replaced by the weight
    AutoRound's GPTQ kernel computes from its tensors (its float16 scales cast to float32, which
    is exact: the kernel multiplies in the scales' dtype, and dlm-jax holds (q - zero) * scale in
    float32)."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    config = json.loads((path / "config.json").read_text())
    qc = config.pop("quantization_config")
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".qweight")]:
        module = name[:-len(".qweight")]
        inp, out = tensors[name].shape[0] * 32 // qc["bits"], tensors[name].shape[1]
        # (groups of consecutive rows, as the checkpoint's g_idx says: the kernel's g_idx path is
        # its act-order one)
        layer = QuantLinear(qc["bits"], inp if qc["group_size"] == -1 else qc["group_size"], inp, out, bias=False)
        layer.qweight, layer.qzeros = tensors.pop(name), tensors.pop(module + ".qzeros")
        layer.scales = tensors.pop(module + ".scales").float()
        g = inp if qc["group_size"] == -1 else qc["group_size"]
        np.testing.assert_array_equal(tensors.pop(module + ".g_idx").numpy(), np.arange(inp) // g)
        with torch.no_grad():
            tensors[module + ".weight"] = layer(torch.eye(inp)).T.contiguous()  # [out, in]
    return _float_logits(tensors, config, dst)


def _float_logits(tensors: dict, config: dict, dst: Path) -> np.ndarray:
    """transformers' float32 logits of the float checkpoint that `tensors` (each linear's weight
    dequantised) and `config` (without its quantization_config) make at `dst`."""
    for name in tensors:
        tensors[name] = tensors[name].float()
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return reference_logits(dst, IDS)


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ's packing of unsigned `bits`-bit values [rows, cols] along the rows: 32 / bits a
    word, the first in its lowest bits (int32 [rows * bits / 32, cols])."""
    per = 32 // bits
    words = np.zeros((values.shape[0] // per, values.shape[1]), np.uint32)
    for j in range(per):
        words |= values[j::per].astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


@pytest.fixture(scope="module")
def symmetric(tmp_path_factory) -> Path:
    """A Qwen3's GPTQ checkpoint (4 bits, symmetric, groups of 16), quantized once for the file."""
    return gptq_checkpoint(tmp_path_factory.mktemp("gptq"))


@pytest.fixture
def gptq(symmetric, tmp_path) -> Path:
    """A test's own copy of `symmetric`, to edit."""
    return Path(shutil.copytree(symmetric, tmp_path / "gptq"))


SLOW = pytest.mark.slow  # (4 s each, most of it AutoRound's quantization)


@pytest.mark.parametrize("kind,bits,group,sym,mode", [
    ("qwen3", 4, 16, True, "int4-g16"),  # GPTQ's default: symmetric, q - 8 fits int4
    pytest.param("qwen3", 4, 16, False, "uint4-g16", marks=SLOW),  # zero points: q - 8 as int4, zero - 8 as int8
    # 8 bits (q - 128), q/k/v biases stored float beside the qweight
    pytest.param("qwen2", 8, 16, True, "int8-g16", marks=SLOW),
    pytest.param("llama", 4, -1, True, "int4", marks=SLOW),  # group_size -1: a scale per output channel
])
def test_gptq_checkpoint_matches_autorounds_kernel(kind, bits, group, sym, mode, symmetric, tmp_path):
    path = (symmetric if (kind, bits, group, sym) == ("qwen3", 4, 16, True) else
            gptq_checkpoint(tmp_path / "gptq", kind=kind, bits=bits, group=group, sym=sym))
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq"
    # AutoRound leaves float the linears whose width is not a multiple of 32 (k_proj and v_proj
    # but Qwen3's, 2 heads of 8) and names them in GPTQModel's `dynamic` ("-:<module>")
    left = {f"layers.{i}.attn.{p}" for i in (0, 1) for p in ("k_proj", "v_proj")} if kind != "qwen3" else set()
    assert len(qc.get("dynamic", {})) == len(left) and all(rule.startswith("-:") for rule in qc.get("dynamic", {}))
    ref = _dequantized(path, tmp_path / "float")
    model, ours = loaded_logits(path, IDS)
    assert model.quant == mode and model.quant_float == {"lm_head"} | left
    q = model.layers[0].attn.q_proj
    assert str(q.qkernel[...].dtype) == ("int8" if bits == 8 else "int4") and (q.zero is not None) == (not sym)
    assert (model.layers[0].attn.q_proj.bias is not None) == (kind == "qwen2")
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL, diff
    float_logits = logits(build(kind, intermediate_size=64), IDS)
    assert float(np.abs(ref - float_logits).max()) > 10 * TOL  # (it is not the float model)


@SLOW
def test_the_reference_is_what_autorounds_own_loading_computes(gptq, tmp_path):
    """transformers loading the GPTQ checkpoint through AutoRound (`AutoRoundConfig`, torch
    backend) computes in float16: the float32 reference above within float16's rounding."""
    path = gptq
    ref = _dequantized(path, tmp_path / "float")
    theirs = reference_logits(path, IDS, quantization_config=T.AutoRoundConfig(backend="torch"))
    np.testing.assert_allclose(theirs, ref, atol=2e-2)
    _, ours = loaded_logits(path, IDS)
    assert float(np.abs(ours - ref).max()) < float(np.abs(theirs - ref).max())  # (float32 closer than float16)


def gptq_moe_checkpoint(dst: Path, *, group: int = 16, head: bool = False) -> Path:
    """A tiny random Qwen3-MoE in GPTQ's layout, one quantized linear a routed expert (as the
    "-GPTQ-Int4" MoE releases hold them): every projection's weight (and with `head` the output
    head's, GPTQ's `lm_head: true`) quantized to 4 bits per group of `group` input rows by round
    to nearest, symmetric, packed by AutoRound's own GPTQ packer."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    # (widths that are multiples of 32: AutoRound's packer packs rows and columns in 32s)
    build("qwen3_moe", moe_intermediate_size=32, intermediate_size=64, head_dim=16).save_pretrained(dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight") or head and n == "lm_head.weight"]:
        w = tensors.pop(name).float()  # [out, in]
        out, inp = w.shape
        scales = (w.reshape(out, inp // group, group).abs().amax(-1) / 7).clamp_min(1e-5).half().float()  # [out, G]
        linear = torch.nn.Linear(inp, out, bias=False)
        linear.weight.data = w
        layer = QuantLinear(4, group, inp, out, bias=False)
        layer.pack(linear, scales, 8)
        module = name[:-len(".weight")]
        tensors.update({module + ".qweight": layer.qweight, module + ".qzeros": layer.qzeros, module + ".scales":
                        layer.scales, module + ".g_idx": torch.arange(inp, dtype=torch.int32) // group})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                                     "desc_act": False, "lm_head": head}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@SLOW
@pytest.mark.parametrize("head", [False, True])
def test_gptq_moe_experts_load_quantized(head, tmp_path):
    """A Qwen3-MoE's routed experts, one GPTQ linear each, stack into one int4 [E, I, O] array per
    layer; the router stays float; the output head is quantized where the checkpoint stores it so."""
    path = gptq_moe_checkpoint(tmp_path / "gptq", head=head)
    model, ours = loaded_logits(path, IDS)
    assert model.quant == "int4-g16" and model.quant_float == (set() if head else {"lm_head"})
    assert model.quant_head == head
    experts = model.layers[1].ffn
    assert str(experts.gate[...].dtype) == "int4" and experts.gate_scale[...].shape == (4, 2, 32)
    ref = _dequantized(path, tmp_path / "float")
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL, diff


@SLOW
def test_act_order_moe_experts_match_autorounds_kernel_and_decode_on_a_mesh(tmp_path):
    """A Qwen3-MoE whose every GPTQ linear, each routed expert's too, is in act order (rows
    permuted, g_idx with them): the experts stack with one map each ([E, I]) and compute what
    AutoRound's kernel computes through its g_idx path; saved and reloaded bit for bit; on
    ep=2,tp=2 (both expert exchanges) one device's tokens, and a step moves what the same weights
    in consecutive groups move (the down projections' groups whole on every device)."""
    from tests.executors.test_mesh import assert_bytes, assert_same, drive

    path = gptq_moe_checkpoint(tmp_path / "gptq")
    _act_order(path)
    word_tokenizer(path)  # (the mesh driver's prompts are text)
    ref = _dequantized_act_order(path, tmp_path / "float")
    model, ours = loaded_logits(path, IDS)
    assert model.quant == "int4-g16-act"
    maps = np.asarray(model.layers[1].ffn.down_g_idx[...])
    assert maps.shape == (4, 32) and len({m.tobytes() for m in maps}) == 4  # (each expert its own)
    assert float(np.abs(ours - ref).max()) <= TOL
    dlm_jax.save_pretrained(model, tmp_path / "saved")
    np.testing.assert_array_equal(ours, loaded_logits(tmp_path / "saved", IDS)[1])
    plain = _trivial_copy(path, tmp_path / "plain")
    assert float(np.abs(ours - _dequantized(plain, tmp_path / "f2")).max()) > TOL
    case = {"mesh": "ep=2,tp=2", "presets": ["ar"], "fixed": False, "collectives": True}
    report = drive({"devices": 4, "cases": [{**case, "model": str(path)}, {**case, "model": str(plain)},
                                            {**case, "model": str(path), "exchange": "all_to_all"}]})
    assert_same(report)
    assert_bytes(report)
    act, in_order, _ = report["cases"]
    assert act["collectives"] == in_order["collectives"], (act["collectives"], in_order["collectives"])


def _v2(path: Path) -> None:
    """Rewrite `path` in GPTQModel's format "gptq_v2": the zero points as they are (not minus one)."""
    tensors = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    bits = config["quantization_config"]["bits"]
    for name in [n for n in tensors if n.endswith(".qzeros")]:
        zero = gptq_unpack(tensors[name].numpy(), bits, 1, what=name).astype(np.uint32) + 1
        tensors[name] = torch.from_numpy(np.ascontiguousarray(_pack_rows(zero.T, bits).T))  # (along the columns)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (path / "config.json").write_text(json.dumps(config))


@SLOW
def test_gptq_v2_zero_points_and_inspect(tmp_path, capsys):
    from dlm_jax.frontends.cli import main

    path = gptq_checkpoint(tmp_path / "gptq", sym=False)
    _, v1 = loaded_logits(path, IDS)
    _v2(path)
    model, v2 = loaded_logits(path, IDS)
    np.testing.assert_array_equal(v1, v2)
    assert main(["inspect", "--model", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_quant_stored"] == ("GPTQ (v2): 4-bit integers with zero points, a scale per group of 16 "
                                          "input columns; held as uint4-g16")
    dlm_jax.save_pretrained(model, tmp_path / "saved")  # saved as dlm-jax's uint4-g16, bit for bit
    again, theirs = loaded_logits(tmp_path / "saved", IDS)
    assert again.quant == "uint4-g16"
    np.testing.assert_array_equal(v2, theirs)


def test_unpacking_is_autorounds_own():
    """GPTQ's packing (32 / bits values a word along the input rows, the first lowest) read as
    AutoRound's kernel reads it."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    for bits in (4, 8):
        u = np.random.default_rng(bits).integers(0, 1 << bits, (64, 16)).astype(np.uint8)  # [in, out]
        layer = QuantLinear(bits, 64, 64, 16, bias=False)
        words = _pack_rows(u, bits)
        layer.qweight = torch.from_numpy(words)
        layer.qzeros = torch.zeros((1, 16 * bits // 32), dtype=torch.int32)  # zero points 1 (stored minus one)
        layer.scales = torch.ones((1, 16))
        np.testing.assert_array_equal(gptq_unpack(words, bits, 0, what="w"), u)
        with torch.no_grad():
            np.testing.assert_array_equal(layer(torch.eye(64)).numpy(), u.astype(np.float32) - 1)


@pytest.mark.parametrize("change,match", [
    ({"bits": 3}, "bits=3: GPTQ checkpoints of 4 or 8 bits are supported"),
    ({"bits": 8, "sym": False}, "asymmetric 8-bit weights .sym: false. are not supported: dlm-jax holds zero points"),
    ({"checkpoint_format": "marlin"}, "format 'marlin' is not supported: dlm-jax reads GPTQ's own packing"),
    ({"group_size": 0}, "group_size=0: expected -1 .a scale per output channel. or an integer of at least 2"),
    ({"dynamic": {"+:.*mlp.*": {"bits": 8}}}, r"dynamic\['\+:.\*mlp.\*'\]: per-module bits or groups are not "
                                               r"supported \({'bits': 8}\)"),
    ({"pack_dtype": "int16"}, "pack_dtype='int16': dlm-jax reads weights packed in int32 words"),
])
def test_gptq_refusals_are_one_line(change, match, gptq):
    path = gptq
    edit_quantization_config(path, **change)
    with pytest.raises(ConfigError, match=match) as e:
        dlm_jax.load_pretrained(path)
    assert "\n" not in str(e.value)


def test_act_order_with_static_groups_loads(gptq):
    """desc_act with static_groups (groups fixed before the columns were reordered: g_idx is row
    // g) reads as without act-order."""
    from flax import nnx

    before = nnx.state(dlm_jax.load_pretrained(gptq))
    edit_quantization_config(gptq, desc_act=True, static_groups=True)
    after = nnx.state(dlm_jax.load_pretrained(gptq))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), before, after))


def _act_order(path: Path, seed: int = 0) -> None:
    """Rewrite the GPTQ checkpoint `path` (groups of consecutive rows) as an act-order one
    (`desc_act: true`): each linear's input rows in an order, its g_idx the group of each row (a
    model of its own: the rows of W permuted, the scales and zero points unchanged). Linears of
    one input (q/k/v, gate/up) share their order, as GPTQ's, which orders the rows by the input's
    statistics; the others each have their own."""
    tensors = load_file(str(path / "model.safetensors"))
    bits = json.loads((path / "config.json").read_text())["quantization_config"]["bits"]
    rng = np.random.default_rng(seed)
    orders: dict[str, np.ndarray] = {}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        module = name[:-len(".qweight")]
        q = gptq_unpack(tensors[name].numpy(), bits, 0, what=name).astype(np.uint32)  # [in, out]
        same_input = re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gate_up", module))
        perm = orders.setdefault(same_input, rng.permutation(q.shape[0]))
        tensors[name] = torch.from_numpy(_pack_rows(q[perm], bits))
        tensors[module + ".g_idx"] = tensors[module + ".g_idx"][torch.from_numpy(perm)].contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    edit_quantization_config(path, desc_act=True)


def _dequantized_act_order(path: Path, dst: Path) -> np.ndarray:
    """transformers' float32 logits with each act-order GPTQ linear of `path` replaced by the
    weight AutoRound's GPTQ kernel computes through its g_idx path (`QuantLinear(g_idx=True)`),
    which reads a linear whole where its output is no wider than its input (wider ones it cuts
    to the input's width): it is run on slices of the output columns that wide."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    config = json.loads((path / "config.json").read_text())
    qc = config.pop("quantization_config")
    bits, group, per = qc["bits"], qc["group_size"], 32 // qc["bits"]
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".qweight")]:
        module = name[:-len(".qweight")]
        qweight, qzeros = tensors.pop(name), tensors.pop(module + ".qzeros")
        scales, g_idx = tensors.pop(module + ".scales").float(), tensors.pop(module + ".g_idx")
        inp, out = qweight.shape[0] * per, qweight.shape[1]
        parts = []
        for c in range(0, out, inp):
            w = min(inp, out - c)
            layer = QuantLinear(bits, group, inp, w, bias=False, g_idx=True)
            layer.qweight, layer.scales = qweight[:, c:c + w].contiguous(), scales[:, c:c + w].contiguous()
            layer.qzeros, layer.g_idx = qzeros[:, c // per:(c + w) // per].contiguous(), g_idx
            with torch.no_grad():
                parts.append(layer(torch.eye(inp)))  # [in, w]
        tensors[module + ".weight"] = torch.cat(parts, dim=1).T.contiguous()  # [out, in]
    return _float_logits(tensors, config, dst)


@pytest.mark.parametrize("sym", [True, pytest.param(False, marks=SLOW)])
def test_act_order_checkpoint_matches_autorounds_g_idx_kernel(sym, symmetric, tmp_path, capsys):
    """GPTQ's act-order groups (`desc_act: true` without `static_groups`: each input row's group
    in a permuted g_idx) load as "-act" modes holding the map beside the scales, and compute what
    AutoRound's kernel computes through its g_idx path; fused projections hold the map q/k/v
    (and gate/up) share once, and save and reload bit for bit."""
    from dlm_jax.frontends.cli import main
    from dlm_jax.models._fuse import fuse_projections

    path = Path(shutil.copytree(symmetric, tmp_path / "gptq")) if sym else gptq_checkpoint(tmp_path / "gptq", sym=False)
    _act_order(path)
    ref = _dequantized_act_order(path, tmp_path / "float")
    model, ours = loaded_logits(path, IDS)
    mode = "int4-g16-act" if sym else "uint4-g16-act"
    assert model.quant == mode
    q = model.layers[0].attn.q_proj
    g_idx = np.asarray(q.g_idx[...])
    assert g_idx.dtype == np.int32 and not np.array_equal(g_idx, np.sort(g_idx))  # (a permuted map)
    assert float(np.abs(ours - ref).max()) <= TOL
    assert float(np.abs(ours - _dequantized(_trivial_copy(path, tmp_path / "plain"), tmp_path / "f2")).max()) > TOL
    assert main(["inspect", "--model", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["weight_quant"] == mode
    dlm_jax.save_pretrained(model, tmp_path / "saved")
    again, theirs = loaded_logits(tmp_path / "saved", IDS)
    assert again.quant == mode
    np.testing.assert_array_equal(ours, theirs)
    assert fuse_projections(again) == 2 * len(again.layers)  # (q/k/v's and gate/up's maps are equal)
    np.testing.assert_allclose(np.asarray(again(jnp.asarray(IDS))[0]), ours, atol=1e-5)


@SLOW
def test_act_order_checkpoint_on_a_mesh_decodes_as_one_device(symmetric, tmp_path):
    """An act-order checkpoint on tp=2 (tests/executors/mesh_driver.py, a process with two host
    devices): one device's tokens; each device holds its share of a row-parallel kernel's rows
    with their groups (g_idx split as the rows) and every group's scales, so a step moves what the
    same weights in consecutive groups move (no scales gathered: split by their groups, as
    without act-order, a step gathered 2 KB of them here), and the planner counts those bytes."""
    from tests.executors.test_mesh import assert_bytes, assert_same, drive

    path = Path(shutil.copytree(symmetric, tmp_path / "gptq"))
    _act_order(path)
    case = {"mesh": "tp=2", "presets": ["ar", "isd"], "fixed": False, "collectives": True}
    report = drive({"devices": 2, "cases": [{**case, "model": str(path)},
                                            {**case, "model": str(_trivial_copy(path, tmp_path / "plain"))}]})
    assert_same(report)
    assert_bytes(report)
    act, plain = report["cases"]
    assert act["collectives"] == plain["collectives"], (act["collectives"], plain["collectives"])


def _trivial_copy(path: Path, dst: Path) -> Path:
    """`path` with its act-order map replaced by groups of consecutive rows (the same stored
    weights read in the other grouping): what the map changes."""
    shutil.copytree(path, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    group = json.loads((dst / "config.json").read_text())["quantization_config"]["group_size"]
    for name in [n for n in tensors if n.endswith(".g_idx")]:
        tensors[name] = torch.arange(tensors[name].shape[0], dtype=torch.int32) // group
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    edit_quantization_config(dst, desc_act=False)
    return dst


def test_bad_gptq_tensors_are_named(gptq):
    path = gptq
    original = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"

    def save(**edits) -> None:
        save_file({**original, **edits}, str(path / "model.safetensors"), metadata={"format": "pt"})

    save(**{name: original[name].flip(0).contiguous()})  # act-order: a permuted column-to-group map
    with pytest.raises(CheckpointError, match=f"tensor '{name}': the input rows are not in groups of 16 in order, "
                                              f"and the config does not say act-order"):
        dlm_jax.load_pretrained(path)
    edit_quantization_config(path, desc_act=True)  # it does: a group index past the groups is named
    save(**{name: torch.full_like(original[name], 4)})
    with pytest.raises(CheckpointError, match=f"tensor '{name}': torch.int32 .64,., expected 64 group indices from "
                                              f"0 to 3|tensor '{name}': int32 .64,., expected 64 group indices"):
        dlm_jax.load_pretrained(path)
    edit_quantization_config(path, desc_act=False)
    zeros = "model.layers.0.self_attn.o_proj.qzeros"
    save(**{zeros: torch.zeros_like(original[zeros])})  # symmetric, but zero points of 1
    with pytest.raises(CheckpointError, match=f"tensor '{zeros}': zero points other than 8 in a symmetric checkpoint"):
        dlm_jax.load_pretrained(path)
    save(**{zeros: original[zeros][:, :-1].contiguous()})
    with pytest.raises(CheckpointError, match=f"tensor '{zeros}': int32 .4, 3., expected int32 .4, 4.: zero points"):
        dlm_jax.load_pretrained(path)

"""The `dlm-jax` command line: help, demo, generate, inspect, convert and their errors."""

import json
import subprocess
import sys

import pytest

import dlm_jax
from dlm_jax import ByteTokenizer, ModelConfig
from dlm_jax.cli import main


def test_help_runs_and_runtime_imports_no_torch():
    code = ("import sys, dlm_jax, dlm_jax.cli, buckets, lowering, tflite_export, training;"
            "dlm_jax.cli.build_parser();"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "dlm_jax.cli", "--help"], check=True,
                         capture_output=True, text=True).stdout
    for command in ("demo", "generate", "inspect", "convert"):
        assert command in out


def test_numpy_only_parts_import_without_jax():
    """Config, tokenizers, safetensors I/O and masks must run where only NumPy exists."""
    code = ("import sys, dlm_jax, dlm_jax.checkpoint._safetensors, dlm_jax.checkpoint._families;"
            "from dlm_jax import ModelConfig, ByteTokenizer, HFTokenizer, CheckpointError, attention_mask;"
            "assert 'jax' not in sys.modules and 'flax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_demo_decodes_every_position(capsys):
    assert main(["demo", "--gen", "16", "--steps", "8", "--block", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["nfe"] == 8
    assert "<|mask|>" not in result["completion"]


@pytest.fixture
def tiny_ckpt(tmp_path):
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, ffn_hidden=64,
                      mask_token_id=tok.mask_id, max_seq_len=64)
    return dlm_jax.save_pretrained(dlm_jax.init_model(cfg), tmp_path / "tiny", tokenizer=tok)


def test_generate_inspect_convert(tiny_ckpt, tmp_path, capsys):
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt", "hi", "--gen", "8",
                 "--steps", "8", "--block", "8"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["nfe"] == 8
    assert main(["inspect", "--model", str(tiny_ckpt)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "dlm_jax" and info["config"]["d_model"] == 32
    assert main(["convert", "--model", str(tiny_ckpt), "--out", str(tmp_path / "llada"), "--family", "llada"]) == 0
    capsys.readouterr()
    cfg, family = dlm_jax.load_config(tmp_path / "llada")
    assert family.name == "llada" and cfg.d_model == 32


def test_errors_are_clear(tiny_ckpt, tmp_path, capsys):
    (tiny_ckpt / "model.safetensors").write_bytes(b"abc")
    assert main(["generate", "--model", str(tiny_ckpt)]) == 2
    assert "model.safetensors: truncated" in capsys.readouterr().err
    assert main(["inspect", "--model", str(tmp_path / "missing")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", "--model", str(tiny_ckpt), "--out", "x", "--family", "gguf"])

"""The `dlm-jax` command line: help, demo, generate, inspect, convert and their errors."""

import json
import subprocess
import sys

import pytest

import numpy as np

import dlm_jax
from dlm_jax.frontends.cli import main
from dlm_jax.testing import mock_model, tiny_checkpoint


def test_help_runs_and_runtime_imports_no_torch():
    code = ("import sys, dlm_jax, dlm_jax.frontends.cli, dlm_jax.buckets, dlm_jax.lowering, dlm_jax.tflite_export, dlm_jax.training;"
            "dlm_jax.frontends.cli.build_parser();"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "dlm_jax.frontends.cli", "--help"], check=True,
                         capture_output=True, text=True).stdout
    for command in ("demo", "generate", "inspect", "convert", "profile", "train", "eval"):
        assert command in out


def test_numpy_only_parts_import_without_jax():
    """Config, tokenizers, safetensors I/O, masks, the host runtime and the test seams must run
    where only NumPy exists (the on-device runner); the runtime reaches neither the model
    code nor the `buckets` tools package (which depends on it, not the reverse)."""
    code = ("import sys, pkgutil, importlib, dlm_jax, dlm_jax.runtime, dlm_jax.testing;"
            "import dlm_jax.checkpoint._safetensors, dlm_jax.checkpoint._families;"
            "from dlm_jax import ModelConfig, ByteTokenizer, HFTokenizer, CheckpointError, attention_mask;"
            "[importlib.import_module('dlm_jax.runtime.' + m.name) for m in pkgutil.iter_modules(dlm_jax.runtime.__path__)];"
            "from dlm_jax.testing import mock_model; mock_model(answer=[1], confidence=[0.5]).generate('hi', dlm_jax.decode_config(gen_len=32));"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'buckets')"
            " or m.startswith('dlm_jax.models')];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_demo_without_a_shipped_model_uses_a_random_one(capsys, monkeypatch, tmp_path):
    import dlm_jax.frontends.cli

    monkeypatch.setattr(dlm_jax.frontends.cli, "shipped_model", lambda name="llada-tiny": tmp_path / "absent")
    assert main(["demo", "--gen", "16", "--block", "8"]) == 0
    fast, vanilla = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert fast["decoder_name"] == "prefix cache + threshold 0.9, block 8, gen 16"
    assert (vanilla["decoder"]["cache"], vanilla["decoder"]["rule"]) == ("none", "topk")
    assert vanilla["stats"]["nfe"] == 16  # one token per step
    assert fast["prompts"] == ["564+894="] and "<|mask|>" not in fast["completions"][0]


@pytest.fixture
def tiny_ckpt(tmp_path):
    return tiny_checkpoint(tmp_path / "tiny", max_seq_len=256)


def test_demo_answers_task_prompts_fast_and_vanilla(tiny_ckpt, capsys):
    assert main(["demo", "--model", str(tiny_ckpt), "--per-task", "1", "--gen", "32"]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 2 and "expected" in out
    speed = json.loads(out.strip().splitlines()[-1])
    assert set(speed) == {"speedup_vs_vanilla", "nfe_ratio"}


def test_generate_inspect_convert(tiny_ckpt, tmp_path, capsys):
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt", "hi", "--gen", "16", "--block", "8",
                 "--cache", "dual", "--rule", "frechet", "--delta", "0.25"]) == 0
    captured = capsys.readouterr()
    stats = json.loads(captured.err.strip().splitlines()[-1])
    assert 1 <= stats["nfe"] <= 16 and stats["tokens_committed"] == 16
    assert main(["inspect", "--model", str(tiny_ckpt)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "dlm_jax" and info["config"]["d_model"] == 32
    assert main(["convert", "--model", str(tiny_ckpt), "--out", str(tmp_path / "llada"), "--family", "llada"]) == 0
    capsys.readouterr()
    cfg, family = dlm_jax.load_config(tmp_path / "llada")
    assert family.name == "llada" and cfg.d_model == 32


def test_generate_prints_each_completions_logprobs(capsys):
    """`--logprobs K`: one JSON line per completion on stderr after the statistics, its tokens
    spelling the completion, with the log-probabilities `Model.generate` records."""
    from dlm_jax.frontends.cli import shipped_model

    prompts = ["564+894=", "66+76="]
    assert main(["generate", "--model", str(shipped_model()), "--executor", "jax", "--gen", "32", "--logprobs", "2",
                 *[a for p in prompts for a in ("--prompt", p)]]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in err.strip().splitlines()[-2:]]
    want = dlm_jax.load(shipped_model(), executor="jax").generate(prompts, dlm_jax.preset("fast-dllm", gen_len=32,
                                                                                           logprobs=2))
    assert out.split() == want.texts and [line["completion"] for line in lines] == [0, 1]
    for line, text, lp in zip(lines, want.texts, want.logprobs):
        assert "".join(line["tokens"]) == text and line["logprobs"] == [round(float(v), 6) for v in lp.logprob]
        assert [len(top) for top in line["top_logprobs"]] == [2] * len(text)
    assert main(["generate", "--model", "any", "--prompt", "Q", "--logprobs", "21"]) == 2
    assert "logprobs=21" in capsys.readouterr().err


def test_generate_suffix_text_infills_each_completion(capsys):
    """`--suffix-text`: the completions are decoded before the suffixes, as `Model.generate`'s
    `suffixes` decodes them (one for all prompts, or one per prompt); a count that fits
    neither, or a model that cannot infill, is one line and exit 2."""
    from dlm_jax.frontends.cli import shipped_model

    prompts, suffixes = ["sort: 37 44 13", "66+76="], [" 44", "2"]
    args = ["generate", "--model", str(shipped_model()), "--executor", "jax", "--gen", "32", "--cache", "dual"]
    assert main([*args, *[a for p, s in zip(prompts, suffixes) for a in ("--prompt", p, "--suffix-text", s)]]) == 0
    want = dlm_jax.load(shipped_model(), executor="jax").generate(
        prompts, dlm_jax.preset("fast-dllm", gen_len=32, cache="dual"), suffixes=suffixes).texts
    assert capsys.readouterr().out.split("\n")[:2] == want
    assert main([*args, "--prompt", "a", "--prompt", "b", *["--suffix-text", "x"] * 3]) == 2
    assert "3 --suffix-text for 2 prompts" in capsys.readouterr().err
    assert main(["generate", "--model", str(shipped_model("idlm-tiny")), "--preset", "isd", "--prompt", "1+1=",
                 "--suffix-text", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs a bidirectional model" in err and "Traceback" not in err


def test_generate_options_come_from_the_registry(monkeypatch, capsys):
    """Every decode option reaches the decoder and the report (scripted executor, no model)."""
    answer = np.full(96, ord("7"))
    handle = mock_model(answer=answer, confidence=np.linspace(0.5, 1.0, 96))
    monkeypatch.setattr(dlm_jax, "load", lambda path, **kw: handle)
    assert main(["generate", "--model", "any", "--prompt", "Q", "--gen", "16", "--block", "8", "--cache", "dual",
                 "--rule", "factor_paper", "--factor", "2", "--no-stop-on-eos-block", "--confidence", "margin"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "7" * 16
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["tokens_committed"] == 16 and stats["nfe"] == len(handle.executor.calls)
    assert {k.split("_")[2] for k in stats["buckets"]} == {"p0", "p32"}  # full forwards, then dual windows
    assert main(["generate", "--model", "any", "--prompt", "Q", "--rule", "frechet", "--threshold", "0.5"]) == 2
    assert "error: threshold=0.5 applies to rule='threshold' only" in capsys.readouterr().err


def test_errors_are_clear(tiny_ckpt, tmp_path, capsys):
    (tiny_ckpt / "model.safetensors").write_bytes(b"abc")
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt", "a", "--no-verify"]) == 2
    assert "model.safetensors: truncated" in capsys.readouterr().err
    assert main(["inspect", "--model", str(tmp_path / "missing")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", "--model", str(tiny_ckpt), "--out", "x", "--family", "gguf"])
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "a", "--gen", "30", "--block", "8"]) == 2
    assert "block_len=8 must divide gen_len=30" in capsys.readouterr().err


def test_profile_writes_table_and_plot(tmp_path, capsys):
    from dlm_jax.buckets import LatencyTable

    assert main(["profile", "--out", str(tmp_path / "lat"), "--windows", "8", "32", "--caches", "0", "32",
                 "--repeats", "2"]) == 0
    table = LatencyTable.load(tmp_path / "lat.json")
    assert {(e.window, e.cache) for e in table.entries} == {(8, 0), (32, 0), (8, 32), (32, 32)}
    assert table.lookup(20, 10) == next(e.median_ms for e in table.entries if (e.window, e.cache) == (32, 32))
    assert (tmp_path / "lat.png").read_bytes()[:4] == b"\x89PNG"
    manifest = json.loads((tmp_path / "lat.manifest.json").read_text())
    assert sorted(manifest["files"]) == ["lat.json", "lat.png"]
    text = (tmp_path / "lat.json").read_text()
    (tmp_path / "lat.json").write_text(text.replace('"median_ms": ', '"median_ms": 1', 1))
    with pytest.raises(dlm_jax.CheckpointError, match="lat.json: truncated or modified"):
        LatencyTable.load(tmp_path / "lat.json")


@pytest.mark.slow  # (over the default suite's 5-minute budget on 2 cores; .ci/run runs the slow tests)
def test_train_then_eval(tmp_path, capsys):
    """`dlm-jax train --config` writes an HF checkpoint that `dlm-jax eval` scores."""
    config = tmp_path / "tiny.toml"
    config.write_text("""
[model]
vocab_size = 264
mask_token_id = 259
eos_token_id = 258
d_model = 32
n_layers = 1
n_heads = 2
ffn_hidden = 64
max_seq_len = 96
[train]
objective = "masked_diffusion"
steps = 4
batch_size = 4
seq_len = 32
warmup_steps = 1
log_every = 2
checkpoint_every = 2
[data]
tasks = { addition = 1.0 }
train_examples = 16
""")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["steps"] == 4
    assert main(["eval", "--model", result["model"], "--task", "addition", "--n", "4", "--gen", "16",
                 "--block", "8", "--show", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 4 and 0.0 <= report["accuracy"] <= 1.0 and len(report["samples"]) == 1
    config.write_text(config.read_text().replace("steps = 4", "steps = 4\nlr = 1"))
    assert main(["train", "--config", str(config)]) == 2
    assert "unknown key(s) ['lr'] in [train]" in capsys.readouterr().err


@pytest.mark.slow  # about 9 s: two CLI processes
def test_a_command_keeps_its_compiled_buckets_for_the_next_run(tiny_ckpt, tmp_path):
    """`dlm-jax generate` as a process stores its XLA executables in DLM_JAX_CACHE_DIR (a
    second run loads them instead of compiling); `main([...])` called from Python leaves the
    caller's JAX settings alone."""
    import os

    cache = tmp_path / "xla"
    argv = [sys.executable, "-m", "dlm_jax.frontends.cli", "generate", "--model", str(tiny_ckpt), "--prompt-ids", "5 6 7",
            "--gen", "8", "--block", "8"]
    run = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "DLM_JAX_CACHE_DIR": str(cache)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert any(cache.iterdir())
    import jax

    before = jax.config.jax_compilation_cache_dir
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "5 6 7", "--gen", "8", "--block", "8"]) == 0
    assert jax.config.jax_compilation_cache_dir == before

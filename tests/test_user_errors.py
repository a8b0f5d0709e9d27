"""What a user gets wrong ends in one line naming the mistake and a non-zero exit; the API
answers out of the box (prompt formats, token-id prompts without a tokenizer), and the demo
does what its flags say."""

import errno
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import dlm_jax
from dlm_jax import CheckpointError, ConfigError, InputError, decode_config
from dlm_jax.frontends.cli import main
from dlm_jax.testing import mock_model, tiny_checkpoint, tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", max_seq_len=128)


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- prompts ------------------------------------------------------------------------------------


def test_prompt_ids_outside_the_vocabulary_are_named():
    handle = mock_model(answer=np.full(96, 7), confidence=np.full(96, 0.9))
    cfg = decode_config(gen_len=8, block_len=8)
    vocab = handle.config.vocab_size
    with pytest.raises(InputError, match=f"prompt 0 holds token id 5000, outside the model's vocabulary \\[0, {vocab}\\)"):
        handle.generate([1, 2, 5000], cfg)
    with pytest.raises(InputError, match="prompt 1 holds token id -1"):
        handle.generate([[1, 2], [3, -1]], cfg)
    with pytest.raises(InputError, match="integer token ids"):
        handle.generate([[1.5, 2.0]], cfg)
    with pytest.raises(InputError, match="seed -3 must be an integer >= 0"):
        handle.generate([1, 2], cfg, seeds=[-3])
    assert not handle.executor.calls  # refused before any step


def test_checkpoint_without_tokenizer_decodes_token_ids(ckpt, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((ckpt / f).read_bytes())
    handle = dlm_jax.load(bare, verify=False)
    result = handle.generate([104, 105], decode_config(gen_len=8, block_len=8))
    assert result.texts is None and len(result.token_ids[0]) <= 8
    with pytest.raises(CheckpointError, match="no tokenizer files .* pass prompts as token ids"):
        handle.generate("hi", decode_config(gen_len=8, block_len=8))


def test_prompt_format_recorded_in_the_checkpoint_is_applied(ckpt, tmp_path):
    raw = dlm_jax.load(ckpt)
    assert raw.prompt_format == "raw" and raw.encode("hi") == list(b"hi")
    chat_dir = tiny_checkpoint(tmp_path / "chat", max_seq_len=128)
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    (chat_dir / "tokenizer_config.json").write_text(json.dumps({**config, "prompt_format": "chat"}))
    chat = dlm_jax.load(chat_dir, verify=False)
    wrapped = chat.tokenizer.apply_chat([{"role": "user", "content": "hi"}])
    assert chat.prompt_format == "chat" and chat.encode("hi") == wrapped
    assert chat.encode("hi", chat=False) == list(b"hi") and raw.encode("hi", chat=True) == wrapped


@pytest.mark.parametrize("name,block", [("llada-tiny", 32), ("idlm-tiny", 1)])  # idlm: left to right, as its card
def test_shipped_models_answer_in_their_recorded_format(name, block):
    handle = dlm_jax.load(ROOT / "models" / name)
    assert handle.prompt_format == "chat"
    cfg = dlm_jax.preset("llada", gen_len=32, block_len=block)
    assert handle.generate(["564+894=", "sort: 37 44 13 33 47 48"], cfg).texts == ["1458", "13 33 37 44 47 48"]
    assert handle.generate("564+894=", cfg, chat=False).texts != ["1458"]  # raw text: not what it learnt


def without_mask_token(path: Path) -> Path:
    """A checkpoint whose config and tokenizer declare no mask token (no tokenizer files)."""
    model = tiny_model(tokenizer=dlm_jax.ByteTokenizer(), max_seq_len=128, mask_token_id=None)
    return dlm_jax.save_pretrained(model, path)


def test_missing_mask_token_says_how_to_supply_one(tmp_path):
    path = without_mask_token(tmp_path / "nomask")
    with pytest.raises(ConfigError, match="mask_token_id=N.*--mask-token-id N"):
        dlm_jax.load(path)
    assert dlm_jax.load(path, mask_token_id=259).config.mask_token_id == 259


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["eval", "--model", "m", "--task", "addition", "--n", "0"], "argument --n: 0 must be a positive integer"),
    (["eval", "--model", "m", "--task", "addition", "--max-batch", "0"], "argument --max-batch: 0 must be a positive integer"),
    (["eval", "--model", "m", "--task", "addition", "--max-batch", "-1"], "argument --max-batch: -1 must be a positive integer"),
    (["demo", "--per-task", "0"], "argument --per-task: 0 must be a positive integer"),
    (["generate", "--model", "m", "--prompt", "a", "--chat", "--raw"], "not allowed with argument"),
    (["generate", "--model", "m"], "one of the arguments --prompt --prompt-ids is required"),
    (["generate", "--model", "m", "--prompt", "a", "--cache", "ring"], "invalid choice: 'ring'"),
    (["serve", "--model", "m", "--port", "70000"], "argument --port: 70000 is not a port number"),
    (["serve", "--model", "m", "--grace", "-1"], "argument --grace: -1 must be a number of seconds >= 0"),
    (["serve", "--model", "m", "--max-waiting", "0"], "argument --max-waiting: 0 must be a positive integer"),
    (["plan", "--model", "m", "--devices", "0", "--memory", "80"], "argument --devices: 0 must be a positive integer"),
    (["plan", "--model", "m", "--devices", "8", "--memory", "80", "--batch", "0"],
     "argument --batch: 0 must be a positive integer"),
    (["plan", "--model", "m", "--devices", "8", "--memory", "80", "--context", "-1"],
     "argument --context: -1 must be a positive integer"),
    (["plan", "--model", "m", "--devices", "8", "--memory", "lots"], "argument --memory: invalid float value: 'lots'"),
])
def test_bad_flags_end_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("dlm-jax ") and message in line


@pytest.mark.parametrize("argv,message", [
    (["--seed", "-1"], "error: seed=-1 must be an integer >= 0"),
    (["--steps", "1000", "--cache", "none", "--rule", "topk"], "error: steps=1000 exceeds gen_len=32"),
    (["--block", "5"], "error: block_len=5 must divide gen_len=32"),
])
def test_bad_decode_options_end_in_one_line(argv, message, ckpt, capsys):
    for command in (["generate", "--model", str(ckpt), "--prompt", "a"], ["demo", "--model", str(ckpt)]):
        assert main(command + ["--gen", "32"] + argv) == 2
        assert one_error_line(capsys.readouterr().err) .startswith(message)


def test_serve_refuses_bad_options_and_a_taken_port_before_loading(ckpt, capsys):
    """`serve` names a decode option out of range and a port another process holds in one
    line, before it loads the model."""
    assert main(["serve", "--model", str(ckpt), "--threshold", "2"]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("error: ThresholdRule.threshold=2.0 must be in (0, 1]")
    from dlm_jax.frontends.server import bind

    taken = bind("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(ckpt), "--port", str(port)]) == 2
        assert one_error_line(capsys.readouterr().err).startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    finally:
        taken.close()


def test_non_utf8_prompt_is_named(ckpt):
    result = subprocess.run([sys.executable, "-m", "dlm_jax.frontends.cli", "generate", "--model", os.fsencode(ckpt),
                             "--prompt", b"caf\xff"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "is not valid UTF-8 (byte 0xff at character 3)" in one_error_line(result.stderr)


def test_mask_token_flag_and_corrupt_weights(tmp_path, capsys):
    path = without_mask_token(tmp_path / "nomask")
    ids = "--prompt-ids"
    assert main(["generate", "--model", str(path), "--prompt", "a", "--gen", "8", "--block", "8"]) == 2
    assert "--mask-token-id N" in one_error_line(capsys.readouterr().err)
    assert main(["generate", "--model", str(path), ids, "97", "--gen", "8", "--block", "8",
                 "--mask-token-id", "259"]) == 0
    capsys.readouterr()
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    assert main(["generate", "--model", str(path), ids, "97", "--mask-token-id", "259"]) == 2
    assert "model.safetensors: sha256 differs" in one_error_line(capsys.readouterr().err)
    assert main(["generate", "--model", str(path), ids, "97", "--gen", "8", "--block", "8",
                 "--mask-token-id", "259", "--no-verify"]) == 0


@pytest.mark.parametrize("code,reason", [(errno.EROFS, "Read-only file system"),
                                         (errno.ENOSPC, "No space left on device")])
def test_unwritable_output_ends_in_one_line_and_leaves_nothing(code, reason, ckpt, tmp_path, monkeypatch, capsys):
    """A read-only or full output location (simulated: this suite may run as root, whom
    permissions do not stop) names the path and the reason, and leaves no partial output."""
    out = tmp_path / "out"

    def refuse(*args, dir=None, **kwargs):
        raise OSError(code, os.strerror(code), dir)

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    assert main(["convert", "--model", str(ckpt), "--out", str(out)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {tmp_path}") and reason in line
    assert list(tmp_path.iterdir()) == []
    assert main(["profile", "--model", str(ckpt), "--out", str(out / "lat"), "--windows", "8", "--caches", "0",
                 "--repeats", "1"]) == 1
    assert reason in one_error_line(capsys.readouterr().err)
    assert not (out / "lat.json").exists()


def test_missing_output_directories_are_created(ckpt, tmp_path, capsys):
    assert main(["convert", "--model", str(ckpt), "--out", str(tmp_path / "a" / "b" / "c")]) == 0
    assert dlm_jax.load_config(tmp_path / "a" / "b" / "c")[0].d_model == 32
    (tmp_path / "file").write_text("")
    assert main(["convert", "--model", str(ckpt), "--out", str(tmp_path / "file" / "c")]) == 1
    assert one_error_line(capsys.readouterr().err).startswith(f"error: {tmp_path / 'file'}")


# -- the demo -----------------------------------------------------------------------------------


def test_demo_honours_decode_options_and_decodes_prompt_batches(ckpt, capsys):
    assert main(["demo", "--model", str(ckpt), "--prompt", "ab", "--prompt", "abc", "--gen", "16",
                 "--cache", "dual", "--rule", "frechet", "--delta", "0.3", "--block", "8"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("== ")]
    assert heads == ["== dual cache + frechet 0.3, block 8, gen 16",
                     "== vanilla: none cache + topk, 16 steps, block 8, gen 16"]
    assert out.count("'ab' -> ") == 2 and out.count("'abc' -> ") == 2
    chosen, vanilla = (json.loads(line) for line in out.splitlines() if line.startswith('{"mean_nfe"'))
    assert vanilla["mean_nfe"] == 16 and chosen["mean_nfe"] <= 16


def test_a_bucket_the_backend_lacks_is_named_in_one_line(monkeypatch, capsys):
    """A backend with a fixed bucket set (a bundle; here a scripted executor) that cannot run
    a step names the bucket needed and the nearest one it has."""
    from dlm_jax.runtime import BucketKey, Capabilities

    keys = [BucketKey(1, 32, 0, 8), BucketKey(1, 8, 32, 8)]
    handle = mock_model(answer=np.full(96, 7), confidence=np.full(96, 0.5), capabilities=Capabilities.from_keys(keys))
    monkeypatch.setattr(dlm_jax, "load", lambda path, **kw: handle)
    assert main(["generate", "--model", "bundle", "--prompt-ids", "1 2 3", "--gen", "16", "--block", "8"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no bucket of this executor holds a step of batch=1, window=16" in line
    assert "nearest available: b1_w32_p0_r8" in line and not handle.executor.calls


@pytest.mark.slow
def test_raw_prompting_is_one_flag_away_in_eval_and_demo(capsys):
    """The shipped model answers in its recorded chat format and not from raw text, in eval
    and in the demo alike."""
    model = str(ROOT / "models" / "llada-tiny")
    scores = {}
    for flag in ([], ["--raw"]):
        assert main(["eval", "--model", model, "--task", "addition", "--n", "4", "--gen", "32", "--show", "0"] + flag) == 0
        scores[tuple(flag)] = json.loads(capsys.readouterr().out)["accuracy"]
    assert scores[()] == 1.0 and scores[("--raw",)] < 1.0
    assert main(["demo", "--per-task", "1", "--gen", "32", "--raw"]) == 0
    assert "[ok ]" not in capsys.readouterr().out.split("== vanilla")[0]


@pytest.mark.parametrize("flag,message", [
    (["--quant", "int8"], "error: --quant int8: "),
    (["--dtype", "bfloat16"], "error: --dtype bfloat16: "),
])
def test_load_time_flags_on_a_bundle_are_refused_in_one_line(flag, message, tmp_path, capsys):
    """A bundle's weights and arithmetic were fixed at its export: a flag that would change them
    at load is refused, naming the bundle, before anything is read (not ignored)."""
    from dlm_jax.executors.bundle_files import BUNDLE_FILE

    (tmp_path / BUNDLE_FILE).write_text("{}")  # the marker `_load` goes by; never opened
    assert main(["generate", "--model", str(tmp_path), "--prompt", "a", *flag]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(message) and f"{tmp_path} is a bundle" in line

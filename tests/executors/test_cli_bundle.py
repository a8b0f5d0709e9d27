"""`dlm-jax export` / `dlm-jax run` mistakes end in one `error:` line and exit 2, and nothing is
written or lost: a bad bucket name, a directory that is not a bundle, a decode the bundle has
no bucket for, an unknown accelerator."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlm_jax.frontends.cli import main

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "models" / "llada-tiny")


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:") or "error:" in line[:40]]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "b"
    assert main(["export", "--model", MODEL, "--out", str(out), "--buckets", "step_w64_p0_r32", "--preset", "llada",
                 "--gen", "32", "--steps", "32", "--latency-repeats", "1"]) == 0
    return out


def test_run_uses_the_bundle_decode_defaults(bundle, capsys):
    capsys.readouterr()
    assert main(["run", str(bundle), "--prompt", "564+894="]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[0] == "1458"
    assert '"buckets": {"b1_w64_p0_r32": 32}' in out.err  # LLaDA's one token per step, as exported


@pytest.mark.parametrize("argv,message", [
    (["run", "{bundle}", "--prompt", "564+894=", "--preset", "fast-dllm"], "has no bucket for this decode"),
    (["run", "{tmp}", "--prompt", "1+1="], "not a bundle"),
    (["export", "--model", MODEL, "--out", "{bundle}", "--buckets", "w64"], "is not a signature name"),
    (["export", "--model", MODEL, "--out", "{bundle}", "--buckets", "step_w32_p32_r32"], "pass --add"),
    (["export", "--model", MODEL, "--out", "{tmp}", "--buckets", "step_w32_p32_r32"], "is not a bundle"),
    (["export", "--model", MODEL, "--out", "{tmp}/new", "--for-prompts", "900"], "exceed the model's"),
    (["export", "--model", MODEL, "--out", "{tmp}/new", "--buckets", "step_w32_p32_r32", "--target",
      "qualcomm-sm8750"], "ai-edge-litert-sdk-qualcomm is not installed"),
    (["export", "--model", MODEL, "--out", "{tmp}/new", "--memory-budget", "5"], "pass --sparse with it"),
    (["export", "--model", MODEL, "--out", "{tmp}/new", "--sparse"], "--sparse needs --memory-budget"),
    (["export", "--model", MODEL, "--out", "{tmp}/new", "--sparse", "--memory-budget", "5"],
     "--sparse needs a ReLU-family FFN"),
    (["run", "{bundle}", "--prompt", "1+1=", "--memory-budget", "5"], "is not a sparse bundle"),
])
def test_mistakes_are_one_line_errors(bundle, tmp_path, capsys, argv, message):
    import importlib.util

    if "qualcomm-sm8750" in argv and importlib.util.find_spec("ai_edge_litert_sdk_qualcomm"):
        pytest.skip("the Qualcomm SDK package is installed here")
    (tmp_path / "something").write_text("x")
    before = sorted(p.name for p in bundle.iterdir())
    argv = [a.format(bundle=bundle, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    assert message in one_error(capsys)
    assert sorted(p.name for p in bundle.iterdir()) == before
    assert not (tmp_path / "new").exists()


def test_unknown_accelerator_is_refused_by_the_parser(bundle, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", str(bundle), "--prompt", "1+1=", "--accelerator", "tpu"])
    assert e.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err


def test_a_failed_export_leaves_the_old_bundle_and_no_temporary(bundle, monkeypatch):
    """The bundle is built beside the destination and renamed into place: an export that
    fails half way (here: while measuring latency) changes nothing."""
    import dlm_jax.tflite_export.bundle as bundle_module
    from dlm_jax._integrity import file_digest

    before = {p.name: file_digest(p) for p in bundle.iterdir()}

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bundle_module, "_measure_latency", broken)
    assert main(["export", "--model", MODEL, "--out", str(bundle), "--buckets", "step_w32_p32_r32", "--add"]) == 1
    assert {p.name: file_digest(p) for p in bundle.iterdir()} == before
    assert sorted(p.name for p in bundle.parent.iterdir()) == [bundle.name]

"""The training loop: exact resume after an interruption, multi-device parity, config errors."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.training.config import RunConfig

MODEL = dict(vocab_size=264, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
             mask_token_id=259, eos_token_id=258, max_seq_len=64)


def run_config(model=MODEL, **train):
    return RunConfig.from_dict({
        "model": model,
        "train": {"objective": "masked_diffusion", "steps": 8, "batch_size": 4, "seq_len": 32,
                  "warmup_steps": 2, "log_every": 2, "checkpoint_every": 4, **train},
        "data": {"tasks": {"addition": 1.0}, "train_examples": 64},
    })


def small_dataset():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (40, 32)).astype(np.int32)
    prompt = np.zeros((40, 32), bool)
    prompt[:, :8] = True
    return {"tokens": tokens, "prompt_mask": prompt}


@pytest.mark.slow  # 25-45 s; .ci/run runs the slow tests after the default suite
def test_interrupted_run_resumes_at_the_same_step_and_data(tmp_path):
    from dlm_jax.training.loop import train

    run, data = run_config(), small_dataset()
    straight = train(run, tmp_path / "a", progress=False, dataset=data)
    first = train(run, tmp_path / "b", progress=False, dataset=data, stop_after=4)
    assert first.steps == 4 and not (tmp_path / "b" / "model").exists()
    second = train(run, tmp_path / "b", progress=False, dataset=data)
    assert second.resumed_from == 4 and second.steps == 8
    a = dlm_jax.get_params(dlm_jax.load_pretrained(straight.model_dir))
    b = dlm_jax.get_params(dlm_jax.load_pretrained(second.model_dir))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    losses = lambda d: [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    np.testing.assert_allclose(losses(tmp_path / "a"), losses(tmp_path / "b"), rtol=1e-5)


@pytest.mark.slow  # 25-45 s; .ci/run runs the slow tests after the default suite
def test_length_bucketed_run_resumes_exactly(tmp_path):
    """Length buckets: steps of different shapes, interrupted mid-run, resume bit-for-bit."""
    from dlm_jax.training.loop import train

    run = RunConfig.from_dict({
        "model": MODEL,
        "train": {"objective": "masked_diffusion", "steps": 6, "batch_size": 2, "seq_len": 64,
                  "length_buckets": [32, 64], "long_tail_prob": 0.5, "warmup_steps": 1,
                  "log_every": 1, "checkpoint_every": 3},
        "data": {"tasks": {"addition": 1.0, "sorting": 1.0}, "train_examples": 32},
    })
    straight = train(run, tmp_path / "a", progress=False)
    train(run, tmp_path / "b", progress=False, stop_after=3)
    second = train(run, tmp_path / "b", progress=False)
    assert second.resumed_from == 3
    a = dlm_jax.get_params(dlm_jax.load_pretrained(straight.model_dir))
    b = dlm_jax.get_params(dlm_jax.load_pretrained(second.model_dir))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # A checkpoint exports to the same HF model the run wrote at its end.
    from dlm_jax.training.loop import export_checkpoint

    assert export_checkpoint(run, tmp_path / "b", tmp_path / "exported") == 6
    c = dlm_jax.get_params(dlm_jax.load_pretrained(tmp_path / "exported"))
    assert all(np.array_equal(b[name], c[name]) for name in b)
    with pytest.raises(ConfigError, match="no checkpoint at step 5"):
        export_checkpoint(run, tmp_path / "b", tmp_path / "x", step=5)


@pytest.mark.slow  # 25-45 s; .ci/run runs the slow tests after the default suite
def test_four_fake_devices_match_one_device(tmp_path):
    """Data x model sharding over 4 CPU devices gives the 1-device losses."""
    code = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.training.test_loop import run_config, small_dataset
from dlm_jax.training.loop import train
import jax
mesh = [int(x) for x in sys.argv[1:3]]
r = train(run_config(mesh_data=mesh[0], mesh_model=mesh[1]), sys.argv[3], progress=False, dataset=small_dataset())
print(json.dumps({{"devices": jax.device_count()}}))
"""
    losses = {}
    for name, devices, mesh in (("one", 1, ("1", "1")), ("four", 4, ("2", "2"))):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, "-c", code, *mesh, str(tmp_path / name)], env=env, check=True,
                             capture_output=True, text=True).stdout
        assert json.loads(out.strip().splitlines()[-1])["devices"] == devices
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(losses["four"], losses["one"], rtol=1e-4)


@pytest.mark.parametrize("change, match", [
    ({"train": {"objective": "masked_diffusion", "steps": 8, "batch_size": 4, "seq_len": 32, "learnin_rate": 1}},
     r"unknown key\(s\) \['learnin_rate'\] in \[train\]"),
    ({"model": {**MODEL, "colour": 1}}, r"unknown key\(s\) \['colour'\] in \[model\]"),
    ({"optimizer": {}}, r"unknown tables \['optimizer'\]"),
    ({"train": {"objective": "masked_diffusion", "steps": 8, "batch_size": 4, "seq_len": 128, "warmup_steps": 2}},
     "seq_len=128 exceeds \\[model\\] max_seq_len=64"),
    ({"train": {"objective": "introspective", "steps": 8, "batch_size": 4, "seq_len": 32, "warmup_steps": 2}},
     "needs model attention='causal'"),
    ({"data": {"tasks": {"poetry": 1.0}}}, r"unknown task\(s\) \['poetry'\]"),
    ({"train": {"objective": "masked_diffusion", "steps": 8, "batch_size": 4, "seq_len": 32, "warmup_steps": 9}},
     "warmup_steps=9"),
])
def test_bad_configs_name_the_key(change, match):
    raw = {"model": MODEL, "train": {"objective": "masked_diffusion", "steps": 8, "batch_size": 4, "seq_len": 32,
                                     "warmup_steps": 2},
           "data": {"tasks": {"addition": 1.0}}}
    raw.update(change)
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_dict(raw)


@pytest.mark.parametrize("train, match", [
    ({"length_buckets": [16, 8, 32]}, "strictly increasing"),
    ({"length_buckets": [8, 16]}, "end at seq_len=32"),
    ({"length_buckets": [24, 32]}, "\\[24\\] do not divide"),
    ({"length_buckets": [8, 32], "long_tail_prob": 2.0}, "long_tail_prob=2.0"),
])
def test_length_bucket_config_errors(train, match):
    with pytest.raises(ConfigError, match=match):
        run_config(**train)


def test_block_size_must_divide_seq_len_for_two_stream_objectives():
    raw = {"model": {**MODEL, "attention": "block_causal", "block_size": 12},
           "train": {"objective": "block_diffusion", "steps": 8, "batch_size": 4, "seq_len": 32, "warmup_steps": 2},
           "data": {"tasks": {"addition": 1.0}}}
    with pytest.raises(ConfigError, match="block_size=12 must divide \\[train\\] seq_len=32"):
        RunConfig.from_dict(raw)
    raw["model"]["block_size"] = 8
    raw["train"]["length_buckets"] = [4, 32]
    with pytest.raises(ConfigError, match="block_size=8 must divide \\[train\\] length_buckets entry=4"):
        RunConfig.from_dict(raw)


@pytest.mark.slow  # two training runs: about 10 s cold
def test_init_from_starts_the_run_at_a_saved_models_weights(tmp_path):
    """[train] init_from: a causal model's weights start a bidirectional run (AR -> diffusion
    adaptation); a model of other shapes is refused with the key named, before any step."""
    from dlm_jax.training.loop import train

    causal = dlm_jax.init_model(dataclasses.replace(run_config().model, attention="causal"), seed=7)
    dlm_jax.save_pretrained(causal, tmp_path / "ar", tokenizer=dlm_jax.ByteTokenizer())
    start = dlm_jax.get_params(causal)
    one_step = train(run_config(steps=1, warmup_steps=0, init_from=str(tmp_path / "ar")), tmp_path / "a",
                     progress=False, dataset=small_dataset())
    scratch = train(run_config(steps=1, warmup_steps=0), tmp_path / "b", progress=False, dataset=small_dataset())
    after, fresh = (dlm_jax.get_params(dlm_jax.load_pretrained(r.model_dir)) for r in (one_step, scratch))
    # one AdamW step moves each weight by at most about the learning rate
    for name in start:
        assert np.abs(after[name] - start[name]).max() < 3e-3, name
    assert max(np.abs(fresh[n] - start[n]).max() for n in start) > 0.1  # a random init is elsewhere
    wide = dlm_jax.init_model(dataclasses.replace(causal.config, d_model=64), seed=0)
    dlm_jax.save_pretrained(wide, tmp_path / "wide", tokenizer=dlm_jax.ByteTokenizer())
    for path, match in ((tmp_path / "wide", "init_from=.*do not fit"), (tmp_path / "none", "not a model dir")):
        with pytest.raises(ConfigError, match=match):
            train(run_config(init_from=str(path)), tmp_path / "c", progress=False, dataset=small_dataset())
        assert not (tmp_path / "c" / "checkpoints").exists() or not any((tmp_path / "c" / "checkpoints").iterdir())

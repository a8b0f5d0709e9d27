"""A run directory holds one run: --fresh never mixes two, a resume with another config is
refused before anything is built, Ctrl-C saves a checkpoint and resumes exactly, a diverged run
stops at its step and is never written or shipped, and a config that cannot fit the tokenizer
or the task data fails before any step."""

import json
import shutil

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from tests.training.test_loop import MODEL, run_config, small_dataset
from dlm_jax.training.config import RunConfig


def base(**train):
    """Two logged and checkpointed steps: the smallest complete run."""
    return run_config(**{"steps": 2, "warmup_steps": 0, "log_every": 1, "checkpoint_every": 1, **train})


def write_toml(path, steps):
    """A config file of the test model (warm-up 0, the addition task)."""
    path.write_text("[model]\n" + "".join(f"{k} = {v}\n" for k, v in MODEL.items()) +
                    f'[train]\nobjective = "masked_diffusion"\nsteps = {steps}\nbatch_size = 4\nseq_len = 32\n'
                    "warmup_steps = 0\n[data]\ntasks = { addition = 1.0 }\n")
    return path


def logged_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_steps(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run; tests work on copies of it."""
    from dlm_jax.training.loop import train

    path = tmp_path_factory.mktemp("base") / "run"
    train(base(), path, progress=False, dataset=small_dataset())
    return path


@pytest.fixture
def old_run(finished_run, tmp_path):
    path = tmp_path / "run"
    shutil.copytree(finished_run, path)
    return path


def test_fresh_into_a_run_is_refused_and_replace_moves_it_aside(old_run):
    """Item 9: --fresh into a directory with a run is refused (nothing touched); --replace moves
    the old run aside in one rename and the new run starts in an empty directory."""
    from dlm_jax.training.loop import train

    before = {p.relative_to(old_run): p.read_bytes() for p in old_run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=f"^{old_run} already holds a run .*--replace.*leave out --fresh"):
        train(base(), old_run, resume=False, progress=False, dataset=small_dataset())
    assert {p.relative_to(old_run): p.read_bytes() for p in old_run.rglob("*") if p.is_file()} == before

    new = base(steps=3, warmup_steps=1, seed=1)
    result = train(new, old_run, resume=False, replace=True, progress=False, dataset=small_dataset())
    moved = list(old_run.parent.glob("run.old-*"))
    assert result.replaced == moved[0].resolve() and len(moved) == 1
    assert {p.relative_to(moved[0]): p.read_bytes() for p in moved[0].rglob("*") if p.is_file()} == before
    assert result.resumed_from == 0 and result.steps == 3
    assert logged_steps(old_run) == [1, 2, 3] and checkpoint_steps(old_run) == [2, 3]  # keep_checkpoints=2
    assert json.loads((old_run / "run_config.json").read_text())["train"]["seed"] == 1
    old_params = dlm_jax.get_params(dlm_jax.load_pretrained(moved[0] / "model"))
    new_params = dlm_jax.get_params(dlm_jax.load_pretrained(old_run / "model"))
    assert any(not np.array_equal(old_params[n], new_params[n]) for n in old_params)


def test_only_an_empty_or_missing_directory_counts_as_no_run(tmp_path):
    """Item 9: an empty directory (or one with only empty folders) is not a run; one with other
    files is neither resumed nor overwritten."""
    from dlm_jax.training.loop import _holds_files, train

    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert not _holds_files(tmp_path / "empty") and not _holds_files(tmp_path / "missing")
    (tmp_path / "empty" / "notes.txt").write_text("x")
    assert _holds_files(tmp_path / "empty")
    with pytest.raises(ConfigError, match="holds files but no training run .*--replace"):
        train(base(), tmp_path / "empty", progress=False, dataset=small_dataset())


def test_resume_with_another_config_names_every_changed_key_before_building(old_run, monkeypatch):
    """Item 10: the stored run_config.json is compared first; each changed key is named with its
    old and new value, and nothing (mesh, data, checkpoint manager) is built."""
    import dlm_jax.training.loop as loop

    stored = json.loads((old_run / "run_config.json").read_text())
    assert set(stored) == {"model", "train", "data"} and stored["model"]["d_model"] == 32
    assert stored["train"]["steps"] == 2 and stored["data"]["tasks"] == {"addition": 1.0}
    del stored["model"]["qk_norm"]  # a key added after the run was made reads as its default
    (old_run / "run_config.json").write_text(json.dumps(stored))

    def built(*a, **k):
        raise AssertionError("built something before checking the config")

    for name in ("build_mesh", "build_dataset", "_checkpoint_manager", "init_model"):
        monkeypatch.setattr(loop, name, built)
    changed = RunConfig.from_dict({
        "model": {**MODEL, "d_model": 64},
        "train": {"objective": "masked_diffusion", "steps": 9, "batch_size": 4, "seq_len": 32, "warmup_steps": 0,
                  "log_every": 3, "checkpoint_every": 1, "learning_rate": 0.01},
        "data": {"tasks": {"addition": 1.0}, "train_examples": 64}})
    with pytest.raises(ConfigError) as e:
        loop.train(changed, old_run, progress=False, dataset=small_dataset())
    msg = str(e.value)
    assert "[model] d_model: 32 -> 64" in msg and "[train] learning_rate: 0.001 -> 0.01" in msg
    assert "steps:" not in msg and "log_every:" not in msg  # allowed to change on resume
    assert "[model] head_dim: 8 -> 16" in msg  # the resolved config: derived values too
    assert "qk_norm" not in msg and msg.count(" -> ") == 3
    assert "--replace" in msg
    assert checkpoint_steps(old_run) == [1, 2]


def test_ctrl_c_saves_a_checkpoint_and_resumes_logging_each_step_once(old_run):
    """Items 10 and 11: the finished 2-step run extended to 4 steps (an allowed change), after a
    crash had logged step 3 past its last checkpoint; Ctrl-C after step 3 (not a checkpoint step)
    saves step 3, keeps the metrics so far and the segment's time; the next resume continues at
    3. Each step is logged once and train_seconds sums every segment."""
    from dlm_jax.training.loop import TrainingInterrupted, train

    with open(old_run / "metrics.jsonl", "a") as f:  # what a crash after logging step 3 leaves
        f.write(json.dumps({"step": 3, "loss": -1.0}) + "\n" + '{"step": 4, "lo')
    seconds = [json.loads((old_run / "train_seconds.json").read_text())["seconds"]]
    run = base(steps=4, checkpoint_every=10)

    def ctrl_c(done):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted) as e:
        train(run, old_run, progress=False, dataset=small_dataset(), on_step=ctrl_c)
    assert isinstance(e.value, KeyboardInterrupt) and e.value.step == 3
    assert checkpoint_steps(old_run) == [2, 3] and logged_steps(old_run) == [1, 2, 3]
    assert json.loads((old_run / "metrics.jsonl").read_text().splitlines()[-1])["loss"] > 0  # not the crash's
    assert json.loads((old_run / "run_config.json").read_text())["train"]["steps"] == 4
    seconds.append(json.loads((old_run / "train_seconds.json").read_text())["seconds"])
    assert seconds[1] > seconds[0]
    result = train(run, old_run, progress=False, dataset=small_dataset())
    assert result.resumed_from == 3 and result.steps == 4
    assert logged_steps(old_run) == [1, 2, 3, 4] and checkpoint_steps(old_run) == [3, 4]
    total = json.loads((old_run / "train_seconds.json").read_text())["seconds"]
    assert total == pytest.approx(seconds[1] + result.seconds, abs=0.05)


def test_ctrl_c_during_a_checkpoint_save_takes_effect_after_it(tmp_path, monkeypatch):
    """Item 11: a real SIGINT while a checkpoint is written does not cut the save short (which
    leaves orbax's temporary directory and thread errors behind): the save finishes, then the
    run stops there."""
    import os
    import signal

    import dlm_jax.training.loop as loop

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    real, calls = loop._checkpoint_manager, []

    def manager(*args, **kwargs):
        m = real(*args, **kwargs)
        save = m.save

        def save_with_ctrl_c(step, *a, **k):
            calls.append(f"start {step}")
            if step == 1:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives as the save begins
            save(step, *a, **k)
            calls.append(f"end {step}")

        m.save = save_with_ctrl_c
        return m

    monkeypatch.setattr(loop, "_checkpoint_manager", manager)
    with pytest.raises(loop.TrainingInterrupted) as e:
        loop.train(base(), tmp_path / "run", progress=False, dataset=small_dataset())
    assert e.value.step == 1 and calls == ["start 1", "end 1"]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["1"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_cli_ctrl_c_prints_the_resume_command_and_exits_130(tmp_path, monkeypatch, capsys):
    """Item 11 at the CLI: one line naming the step and the command that resumes, code 130."""
    import dlm_jax.training.loop as loop
    from dlm_jax.frontends.cli import main

    config = write_toml(tmp_path / "my run.toml", 40)
    calls = []

    def interrupted(run, out, **kwargs):
        calls.append(kwargs)
        raise loop.TrainingInterrupted(37, out)

    monkeypatch.setattr(loop, "train", interrupted)
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err
    assert err == (f"interrupted at step 37; resume with: dlm-jax train --config '{config}' "
                   f"--out {tmp_path / 'out'}\n")
    assert calls == [{"resume": True, "replace": False}]
    main(["train", "--config", str(config), "--out", str(tmp_path / "out"), "--fresh", "--replace"])
    assert calls[-1] == {"resume": False, "replace": True}


def test_cli_fresh_into_a_run_is_one_line_error(old_run, tmp_path, capsys):
    """Item 9 at the CLI: `--fresh` into a run is refused with the way out, exit code 2."""
    from dlm_jax.frontends.cli import main

    config = write_toml(tmp_path / "tiny.toml", 2)
    assert main(["train", "--config", str(config), "--out", str(old_run), "--fresh"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {old_run} already holds a run") and "--replace" in err
    assert err.count("\n") == 1


def test_a_diverging_run_stops_at_its_step_and_keeps_the_last_good_checkpoint(tmp_path):
    """Item 12: learning rate 1e30 (after one warm-up step at 0): the first non-finite step is
    named, nothing of it is saved, no model is written, the last checkpoint is finite."""
    from dlm_jax.training.loop import TrainingError, export_checkpoint, train

    run, out = base(steps=6, warmup_steps=1, learning_rate=1e30), tmp_path / "run"
    diverged = r"^step (\d+): the (loss|gradient norm|updated parameters) .*without saving this step.*--replace"
    with pytest.raises(TrainingError, match=diverged) as e:
        train(run, out, progress=False, dataset=small_dataset())
    bad = int(str(e.value).split()[1].rstrip(":"))
    assert 1 < bad < 6 and not (out / "model").exists()
    assert checkpoint_steps(out) == ([bad - 2, bad - 1] if bad > 2 else [1])  # keep_checkpoints=2
    assert logged_steps(out) == list(range(1, bad))
    assert export_checkpoint(run, out, tmp_path / "last") == bad - 1  # finite: _save_model accepts it


def test_non_finite_parameters_are_never_written_or_shipped(tmp_path):
    """Item 12: _save_model and dlm_jax.training.ship refuse a NaN tensor, naming it."""
    import jax
    from flax import nnx

    from dlm_jax.training.loop import TrainingError, _save_model
    from dlm_jax.training.ship import ship

    run = base()
    model = dlm_jax.init_model(run.model, seed=0)
    _, params = nnx.split(model)
    leaves, tree = jax.tree_util.tree_flatten(params)
    leaves[0] = leaves[0] * np.nan
    with pytest.raises(TrainingError, match=r"parameter \S+ .*non-finite.*refusing to write a model"):
        _save_model(run, tree.unflatten(leaves), tmp_path / "model")
    assert not (tmp_path / "model").exists()

    flat = dlm_jax.get_params(model)
    name = sorted(flat)[-1]
    flat[name] = np.full_like(flat[name], np.inf)
    from dlm_jax.models._params import model_from_params

    run_dir = tmp_path / "run"
    dlm_jax.save_pretrained(model_from_params(run.model, flat), run_dir / "model", tokenizer=dlm_jax.ByteTokenizer())
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 1.0, "tokens_per_second": 1.0}) + "\n")
    config = write_toml(tmp_path / "run.toml", 2)
    with pytest.raises(SystemExit, match=f"tensor {name} has non-finite values"):
        ship(run_dir, config, tmp_path / "shipped", n=1, gen_len=8)
    assert not (tmp_path / "shipped").exists()


def test_vocab_smaller_than_the_tokenizer_is_a_config_error():
    """Item 12: the byte tokenizer has 264 ids; a smaller [model] vocab_size is refused."""
    with pytest.raises(ConfigError, match=r"\[model\] vocab_size=200 is smaller than the byte tokenizer's 264 ids; "
                                          r"set vocab_size >= 264"):
        RunConfig.from_dict({"model": {**MODEL, "vocab_size": 200, "mask_token_id": 199, "eos_token_id": 198},
                             "train": {"objective": "masked_diffusion", "steps": 2, "batch_size": 4, "seq_len": 32,
                                       "warmup_steps": 0},
                             "data": {"tasks": {"addition": 1.0}}})


def test_seq_len_too_short_for_the_task_data_is_a_config_error(tmp_path):
    """Item 12: the longest encoded example must fit [train] seq_len; the error names the task
    and the length needed, before any step (no checkpoint, no metrics)."""
    from dlm_jax.training.loop import train

    run = RunConfig.from_dict({
        "model": MODEL,
        "train": {"objective": "masked_diffusion", "steps": 2, "batch_size": 4, "seq_len": 32, "warmup_steps": 0},
        "data": {"tasks": {"addition": 1.0, "sorting": 1.0}, "train_examples": 64}})
    with pytest.raises(ConfigError, match=r"\[train\] seq_len=32 is too short for the task data: the longest "
                                          r"'sorting' example needs (\d+) tokens .*set \[train\] seq_len >= \d+"):
        train(run, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "run_config.json").exists()

"""Every command and snippet the README shows runs, and prints what the README says it prints.

README conventions this test reads:
- a ```console block: lines starting with `$ ` are commands; the lines after a command, up to
  the next one, are its expected stdout: each must appear, in order, as a line of the real
  output (compared without surrounding spaces); `...` stands for any lines.
- a ```python block runs as a script from the repository root; a ```text block right after it
  is its expected stdout, with the same rule.
- the set-up block (`make demo`, `make test`) runs `make demo`; `make test` is the command
  running this file.

Commands run in a scratch directory that links `models/` and `examples/` from the repository,
so what they write (`latency.json`, converted checkpoints, runs) lands there. The training
commands take hours as written; they run in-process with their config cut to two steps on a
few hundred examples (marked slow).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README)]


def console_commands() -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for info, body in blocks():
        if info != "console":
            continue
        for line in body.splitlines():
            if line.startswith("$ "):
                out.append((line[2:].strip(), []))
            elif out and line.strip():
                out[-1][1].append(line)
    return out


def python_snippets() -> list[tuple[str, list[str]]]:
    found = blocks()
    return [(body, found[i + 1][1].splitlines() if i + 1 < len(found) and found[i + 1][0] == "text" else [])
            for i, (info, body) in enumerate(found) if info == "python"]


def assert_prints(stdout: str, expected: list[str], what: str) -> None:
    """Each expected line (but `...`) appears in `stdout`, in order."""
    lines = [line.strip() for line in stdout.splitlines()]
    at = 0
    for want in expected:
        if want.strip() == "...":
            continue
        try:
            at = lines.index(want.strip(), at) + 1
        except ValueError:
            raise AssertionError(f"{what}: expected the line {want.strip()!r} (in order) in its output:\n"
                                 f"{stdout}") from None


@pytest.fixture
def scratch(tmp_path):
    for name in ("models", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def block_of() -> dict[str, int]:
    """Which console block each command is in: a block's commands run in order in one
    directory (a bundle exported by one line is run by the next)."""
    found = {}
    for i, (info, body) in enumerate(blocks()):
        for line in body.splitlines():
            if info == "console" and line.startswith("$ "):
                found.setdefault(line[2:].strip(), i)
    return found


@pytest.fixture(scope="module")
def block_dirs(tmp_path_factory):
    made: dict[int, Path] = {}

    def get(block: int) -> Path:
        if block not in made:
            made[block] = tmp_path_factory.mktemp(f"block{block}")
            for name in ("models", "examples"):
                (made[block] / name).symlink_to(ROOT / name)
        return made[block]

    return get


_HUB: list[Path] = []


def readme_hub() -> Path:
    """A Hugging Face cache holding `org/llada-tiny` (a copy of models/llada-tiny, laid out as
    `hf download` does), which the README's model-id command loads; made once per process."""
    if not _HUB:
        import atexit
        import shutil
        import tempfile

        from tests.checkpoint.test_hub import add_snapshot

        cache = Path(tempfile.mkdtemp(prefix="dlm-jax-readme-hub-"))
        atexit.register(shutil.rmtree, cache, True)
        atexit.register(shutil.rmtree, cache.with_name(cache.name + "-datasets"), True)
        add_snapshot(cache, "org/llada-tiny", "c" * 40, ROOT / "models" / "llada-tiny", refs=("main",))
        _HUB.append(cache)
    return _HUB[0]


def newcomer_env() -> dict[str, str]:
    """The environment a reader's shell has: the default executor (not the tests' JAX one), and
    a Hugging Face cache that holds the model id the README loads."""
    env = {k: v for k, v in os.environ.items() if k not in ("DLM_JAX_EXECUTOR", "HF_HOME", "HF_HUB_OFFLINE")}
    hub = readme_hub()
    return {**env, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HF_HUB_CACHE": str(hub),
            "HF_DATASETS_CACHE": str(hub.with_name(hub.name + "-datasets"))}  # lm-eval's local tasks


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, cwd=cwd, env=newcomer_env(), capture_output=True, text=True,
                          timeout=600)


TRAINING = [(c, e) for c, e in console_commands() if c.startswith("dlm-jax train ")]
RUNS_ON_A_TRAINED_RUN = [(c, e) for c, e in console_commands() if "runs/" in c and (c, e) not in TRAINING]
QUICK = [(c, e) for c, e in console_commands() if (c, e) not in TRAINING + RUNS_ON_A_TRAINED_RUN]
# the longest commands (a sparse export calibrates and trains a predictor: about a minute; the
# MoE commands decode with expert placement) run in the slow pass, a block's commands
# together (a bundle exported by one line is run by the next)
SLOW_COMMANDS = ("dlm-jax export --model models/sparse-tiny ", "dlm-jax run bundles/sparse-tiny ",
                 "dlm-jax eval --model models/moe-tiny ", "dlm-jax generate --model models/moe-tiny ",
                 "dlm-jax export --model models/llada-tiny --out bundles/llada-tiny-int4 ",
                 "dlm-jax run bundles/llada-tiny-int4 ", "dlm-jax lm-eval ",
                 "dlm-jax eval --model models/llada-tiny --task sorting --n 32 ",
                 "dlm-jax export --model models/llada-tiny --out bundles/llada-tiny-int8 ",
                 "dlm-jax run bundles/llada-tiny-int8 ",
                 # the suite's 5-minute budget: variants of commands the default suite runs
                 'dlm-jax generate --model models/llada-tiny --prompt "564+894=" --executor jax',
                 'dlm-jax generate --model models/llada-tiny --prompt "564+894=" --preset llada-cpp ',
                 'dlm-jax generate --model models/idlm-tiny --prompt "Uma has 4 keys. She sells 2. She loses 1. '
                 'She buys 2 more. How many keys does Uma have now?" --prompt "sort: 37 44 13 33 47 48" --preset ar',
                 "dlm-jax eval --model models/idlm-tiny --task gsm_lite ",
                 "dlm-jax profile ", "dlm-jax convert ")  # tests/frontends/test_cli.py, tests/checkpoint run these too


def _quick_params() -> list:
    return [pytest.param(c, e, id=c[:60], marks=[pytest.mark.slow] if c.startswith(SLOW_COMMANDS) else [])
            for c, e in QUICK]


def test_the_readme_shows_commands_and_snippets():
    assert len(QUICK) >= 5 and len(TRAINING) == 3 and len(python_snippets()) >= 1
    setup = blocks()[0][1]
    assert [line.split()[:2] for line in setup.splitlines()] == [["make", "demo"], ["make", "test"]]


def test_every_inline_command_is_also_run():
    """A command quoted in the prose must be one of the commands the blocks run."""
    runnable = {c for c, _ in console_commands()} | {"make demo", "make test"}
    inline = re.findall(r"`((?:dlm-jax|make|python -m) [^`]*)`", README)
    stray = [c for c in inline if c not in runnable and not c.startswith("dlm-jax demo --help")]
    assert not stray, f"commands in README prose that no test runs: {stray}"


@pytest.mark.parametrize("command,expected", _quick_params())
def test_console_command(command, expected, block_dirs):
    result = run(command, block_dirs(block_of()[command]))
    assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr
    assert_prints(result.stdout, expected, command)


@pytest.mark.parametrize("snippet,expected", [
    pytest.param(s, e, marks=[pytest.mark.slow] if "lm_eval" in s else []) for s, e in python_snippets()],
    ids=lambda x: "snippet")
def test_python_snippet(snippet, expected):
    result = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, env=newcomer_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_prints(result.stdout, expected, "README snippet")


def test_setup_demo_command():
    """`make demo` in this checkout (its .venv exists, so make only runs the demo)."""
    result = run("make demo", ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("[ok ]") > result.stdout.count("[BAD]")
    assert "speedup_vs_vanilla" in result.stdout


def _shrunk(run_config):
    """The README's training config cut to two steps on a few hundred examples."""
    train = dataclasses.replace(run_config.train, steps=2, warmup_steps=0, log_every=1, checkpoint_every=1,
                                batch_size=2, length_buckets=(), long_tail_prob=0.0)
    data = dataclasses.replace(run_config.data, train_examples=50, heldout_examples=10, corpus_bytes=10_000)
    return dataclasses.replace(run_config, train=train, data=data)


@pytest.mark.slow
def test_training_commands_then_eval_of_the_run(scratch, monkeypatch, capsys):
    """The README's training commands, then its eval of the finished run."""
    import json

    from dlm_jax.frontends.cli import main
    from dlm_jax.training.config import RunConfig

    real_load = RunConfig.load
    monkeypatch.setattr(RunConfig, "load", classmethod(lambda cls, path: _shrunk(real_load.__func__(cls, path))))
    monkeypatch.chdir(scratch)
    for command, _ in TRAINING:
        assert main(shlex.split(command)[1:]) == 0, command
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["steps"] == 2 and Path(report["model"]).is_dir()
    for command, _ in RUNS_ON_A_TRAINED_RUN:
        args = shlex.split(command)[1:] + ["--n", "2"]
        assert main(args) == 0, command
        assert json.loads(capsys.readouterr().out)["n"] == 2


def gpu_commands() -> list[str]:
    """The lines of the ```bash block in "On a GPU" (commands for a GPU machine)."""
    section = README.split("\n## On a GPU\n", 1)[1].split("\n## ", 1)[0]
    found = [body for info, body in FENCE.findall(section) if info == "bash"]
    assert len(found) == 1, "the GPU section shows one bash block"
    return [line for line in found[0].splitlines() if line.strip()]


def test_gpu_commands_install_extras_that_exist_and_parse():
    """What a CPU can check of the GPU section: the install names extras pyproject.toml has
    (the `cuda` one over the same JAX range as the CPU install; jax's own `cuda12` extra pins the
    plugin to the JAX release installed), and each benchmark command parses.
    Its `--small` command runs on a GPU in tests/benchmarks/test_gpu.py (`--device`)."""
    import tomllib

    from packaging.requirements import Requirement

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu

    install, *bench = gpu_commands()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = re.fullmatch(r"\.venv/bin/pip install (?:-c constraints\.txt )?-e '\.\[([\w,]+)\]'", install)
    assert extras, f"the GPU section's install line: {install!r}"
    assert set(extras.group(1).split(",")) <= set(project["optional-dependencies"])
    jax = next(r for r in map(Requirement, project["dependencies"]) if r.name == "jax")
    cuda = [Requirement(r) for r in project["optional-dependencies"]["cuda"]]
    assert [(r.name, r.extras, r.specifier) for r in cuda] == [("jax", {"cuda12"}, jax.specifier)]
    assert len(bench) == 2
    for line in bench:
        argv = shlex.split(line.replace("PATH/TO/Fast-dLLM", "/src"))
        assert argv[:2] == [".venv/bin/python", "benchmarks/gpu.py"]
        args = gpu.parse_args(argv[2:])
        assert args.peer_src == Path("/src")
    assert gpu.parse_args(shlex.split(bench[0])[2:]).mode == "small"

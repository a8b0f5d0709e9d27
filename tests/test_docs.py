"""Every command and snippet the README and the docs show runs, and prints what the page says
it prints; the pages cite nothing outside the repository and link only to files that exist.

Conventions this test reads (README.md and docs/**/*.md alike):
- a ```console block: lines starting with `$ ` are commands; the lines after a command, up to
  the next one, are its expected stdout: each must appear, in order, as a line of the real
  output (compared without surrounding spaces); `...` stands for any lines. A block's commands
  run in order in one scratch directory that links `models/` and `examples/` from the
  repository, so what one writes (a bundle, a converted checkpoint) the next one reads.
- a ```python block runs as a script from the repository root; a ```text block right after it
  is its expected stdout, with the same rule.
- a second word in the info string marks cost: ```console slow / ```python slow run only in
  the slow pass (`--runslow`). ```text and ```bash blocks never run (output formats, commands
  for a GPU machine).
- a command quoted inline in the prose (`dlm-jax ...`, `make ...`, `python -m ...`) must be one
  that a block runs.
- the README's set-up block (`make demo`, `make test`) runs `make demo`; `make test` is the
  command running this file.
- a server: a console command `dlm-jax serve ... --port 8000 ... &` starts the server (on a
  free port instead of 8000) and waits for its /health; the block's later commands, and any
  ```python block of the page that names `127.0.0.1:8000`, reach it there. At the block's end
  (the snippet's, for which the page's serve command starts a server of its own) it gets
  SIGTERM and must exit 0 without a traceback.

The training commands take hours as written; they run in-process with their config cut to two
steps on a few hundred examples (slow); an eval of a run (`runs/...`) in their block scores two
prompts, and the block's other `dlm-jax` commands run in-process after them. Model ids (`org/llada-tiny`) load from a Hugging Face cache
this test lays out with a copy of models/llada-tiny.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
BIN = Path(sys.executable).parent
# An opening fence with its info string (language, then an optional cost word), its body, the
# closing fence.
FENCE = re.compile(r"^```([\w-]*)(?:[ \t]+(\S+))?[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
COSTS = ("", "slow")
INLINE_COMMAND = re.compile(r"`((?:dlm-jax|make|python -m) [^`]*)`")
# Documents outside the repository that a page must not cite: the papers are cited by name and
# section, other pages by relative link.
OUTSIDE = re.compile(r"SPECS|DESIGN\.md|STYLE\.md|(?:\.\./|/work/)shared|shared\s+notes")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s*\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, cost word and body; `line` is the line of
    its opening fence."""

    page: Path
    line: int
    lang: str
    cost: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def commands(self) -> list[tuple[str, list[str]]]:
        """A console block's commands, each with the lines of stdout it expects."""
        out: list[tuple[str, list[str]]] = []
        for line in self.body.splitlines():
            if line.startswith("$ "):
                out.append((line[2:].strip(), []))
            elif out and line.strip():
                out[-1][1].append(line)
        return out

    @property
    def trains(self) -> bool:
        return self.lang == "console" and any(c.startswith("dlm-jax train ") for c, _ in self.commands)


def blocks_of(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2) or "", m.group(3))
            for m in FENCE.finditer(text)]


BLOCKS = {page: blocks_of(page) for page in PAGES}
ALL = [b for found in BLOCKS.values() for b in found]
CONSOLE = [b for b in ALL if b.lang == "console"]
TRAINING = [b for b in CONSOLE if b.trains]


def python_snippets() -> list[tuple[Block, list[str]]]:
    """Every ```python block with the expected stdout of the ```text block right after it."""
    out = []
    for found in BLOCKS.values():
        for i, block in enumerate(found):
            if block.lang == "python":
                after = found[i + 1] if i + 1 < len(found) else None
                out.append((block, after.body.splitlines() if after is not None and after.lang == "text" else []))
    return out


def prose(page: Path) -> str:
    """A page without its fenced blocks."""
    return FENCE.sub("", page.read_text(encoding="utf-8"))


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


def scratch_dir(path: Path) -> Path:
    """`path` with `models/` and `examples/` linked from the repository."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("models", "examples"):
        (path / name).symlink_to(ROOT / name)
    return path


_HUB: list[Path] = []


def docs_hub() -> Path:
    """A Hugging Face cache holding `org/llada-tiny` (a copy of models/llada-tiny, laid out as
    `hf download` does), which the docs' model-id commands load; made once per process."""
    if not _HUB:
        import atexit
        import shutil
        import tempfile

        from tests.checkpoint.test_hub import add_snapshot

        cache = Path(tempfile.mkdtemp(prefix="dlm-jax-docs-hub-"))
        atexit.register(shutil.rmtree, cache, True)
        atexit.register(shutil.rmtree, cache.with_name(cache.name + "-datasets"), True)
        add_snapshot(cache, "org/llada-tiny", "c" * 40, ROOT / "models" / "llada-tiny", refs=("main",))
        _HUB.append(cache)
    return _HUB[0]


def newcomer_env() -> dict[str, str]:
    """The environment a reader's shell has: the default executor (not the tests' JAX one), and
    a Hugging Face cache that holds the model id the docs load."""
    env = {k: v for k, v in os.environ.items() if k not in ("DLM_JAX_EXECUTOR", "HF_HOME", "HF_HUB_OFFLINE")}
    hub = docs_hub()
    return {**env, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HF_HUB_CACHE": str(hub),
            "HF_DATASETS_CACHE": str(hub.with_name(hub.name + "-datasets"))}  # lm-eval's local tasks


SERVE = re.compile(r"^dlm-jax serve .*--port 8000\b.*&$")
SERVED_AT = "127.0.0.1:8000"


def serve_command(page: Path) -> str | None:
    """The page's first `dlm-jax serve ... &` command."""
    return next((c for b in BLOCKS[page] if b.lang == "console" for c, _ in b.commands if SERVE.match(c)), None)


@contextlib.contextmanager
def served(command: str, cwd: Path):
    """The server of a page's `dlm-jax serve ... --port 8000 &`, on a free port, until the block
    ends; yields what rewrites a command or snippet's 127.0.0.1:8000 to reach it."""
    import signal
    import socket
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = shlex.split(command.rstrip("&").strip().replace("--port 8000", f"--port {port}"))
    log = cwd / f"serve-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=newcomer_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"{command} exited early:\n{log.read_text()[-3000:]}"
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, f"{command} not healthy after 600 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield lambda text: text.replace(SERVED_AT, f"127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    output = log.read_text()
    assert code == 0 and "Traceback" not in output, f"{command} at SIGTERM: exit {code}\n{output[-3000:]}"


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, cwd=cwd, env=newcomer_env(), capture_output=True, text=True,
                          timeout=600)


def _marks(block: Block) -> list:
    return [pytest.mark.slow] if block.cost == "slow" or block.trains else []


# ---------------------------------------------------------------------------- the pages' shape


def test_the_pages_show_commands_and_snippets():
    readme = BLOCKS[ROOT / "README.md"]
    assert [line.split()[:2] for line in readme[0].body.splitlines()] == [["make", "demo"], ["make", "test"]], (
        "the README's first block is the set-up block: make demo, make test")
    assert any(b.lang == "console" for b in readme) and any(b.lang == "python" for b in readme)
    training = [b for b in TRAINING if b.page == DOCS / "training.md"]
    assert len(training) == 1 and sum(c.startswith("dlm-jax train ") for c, _ in training[0].commands) == 3
    assert len(CONSOLE) >= 10 and len(python_snippets()) >= 3


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_blocks_are_well_formed(block):
    """A block's cost word is one the test knows; a console block opens with a command; a
    python block parses (a typo in a fence would otherwise leave a block unrun)."""
    assert block.cost in COSTS, f"{block.where}: unknown cost word {block.cost!r} (known: slow)"
    if block.lang == "console":
        first = next(line for line in block.body.splitlines() if line.strip())
        assert first.startswith("$ "), f"{block.where}: a console block starts with a `$ ` command, not {first!r}"
    if block.lang == "python":
        ast.parse(block.body, filename=block.where)


def test_every_inline_command_is_also_run():
    """A command quoted in the prose of any page must be one of the commands the blocks run."""
    runnable = {c for b in CONSOLE for c, _ in b.commands} | {"make demo", "make test"}
    stray = [f"{page.relative_to(ROOT)}: {c}" for page in PAGES for c in INLINE_COMMAND.findall(prose(page))
             if c not in runnable]
    assert not stray, "commands in the prose that no block runs:\n" + "\n".join(stray)


def test_no_page_cites_documents_outside_the_repository():
    """The docs are the project's reference: they cite papers by name and section and other
    pages by link, never notes that live outside the repository."""
    files = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*") if p.is_file())]
    hits = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            for path in files for text in [path.read_text(encoding="utf-8", errors="replace")]
            for m in OUTSIDE.finditer(text)]
    assert not hits, "citations of documents outside the repository:\n" + "\n".join(hits)


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", prose(page), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_relative_link_points_to_a_file_in_the_repository():
    bad = []
    for page in PAGES:
        text = re.sub(r"`[^`\n]*`", "", prose(page))  # a link quoted as code is not a link
        for target in LINK.findall(text) + REF_LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.is_relative_to(ROOT):
                bad.append(f"{where} (outside the repository)")
            elif not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest):
                bad.append(f"{where} (no heading with that anchor)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_map_lists_every_page():
    """docs/README.md is the map of the docs: it links every page."""
    text = prose(DOCS / "README.md")
    linked = {(DOCS / target.partition("#")[0]).resolve() for target in LINK.findall(text)}
    missing = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p != DOCS / "README.md" and p.resolve() not in linked]
    assert not missing, f"pages the map (docs/README.md) does not link: {missing}"


# ---------------------------------------------------------------------------- running them


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where, marks=_marks(b)) for b in CONSOLE if not b.trains])
def test_console_block(block, tmp_path):
    """The block's commands, in order, in one scratch directory."""
    cwd = scratch_dir(tmp_path / "block")
    with contextlib.ExitStack() as servers:
        at = lambda text: text  # noqa: E731 - no server yet
        for command, expected in block.commands:
            if SERVE.match(command):
                at = servers.enter_context(served(command, cwd))
                continue
            result = run(at(command), cwd)
            assert result.returncode == 0, f"{block.where}: {command}\n{result.stderr[-3000:]}"
            assert "Traceback" not in result.stderr, f"{block.where}: {command}\n{result.stderr[-3000:]}"
            assert_prints(result.stdout, expected, f"{block.where}: {command}")


@pytest.mark.parametrize("snippet,expected", [pytest.param(b, e, id=b.where, marks=_marks(b))
                                              for b, e in python_snippets()])
def test_python_snippet(snippet, expected, tmp_path):
    with contextlib.ExitStack() as servers:
        body = snippet.body
        if SERVED_AT in body:
            command = serve_command(snippet.page)
            assert command, f"{snippet.where} reaches {SERVED_AT}, but its page starts no server"
            body = servers.enter_context(served(command, scratch_dir(tmp_path / "serve")))(body)
        result = subprocess.run([sys.executable, "-c", body], cwd=ROOT, env=newcomer_env(), capture_output=True,
                                text=True, timeout=600)
    assert result.returncode == 0, f"{snippet.where}\n{result.stderr[-3000:]}"
    assert_prints(result.stdout, expected, f"{snippet.where} (python)")


@pytest.mark.slow  # (the demo itself, in process: tests/frontends/test_cli.py)
def test_setup_demo_command():
    """`make demo` in this checkout (its .venv exists, so make only runs the demo)."""
    result = run("make demo", ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("[ok ]") > result.stdout.count("[BAD]")
    assert "speedup_vs_vanilla" in result.stdout


def _shrunk(run_config):
    """A training config cut to two steps on a few hundred examples."""
    train = dataclasses.replace(run_config.train, steps=2, warmup_steps=0, log_every=1, checkpoint_every=1,
                                batch_size=2, length_buckets=(), long_tail_prob=0.0)
    data = dataclasses.replace(run_config.data, train_examples=50, heldout_examples=10, corpus_bytes=10_000)
    return dataclasses.replace(run_config, train=train, data=data)


@pytest.mark.slow
@pytest.mark.parametrize("block", TRAINING, ids=lambda b: b.where)
def test_training_block(block, tmp_path, monkeypatch, capsys):
    """The training commands (shrunk, in-process), then the block's other commands: an eval of
    a run on two prompts, any other `dlm-jax` command in-process as written (it may read the
    runs), anything else in the shell."""
    import json

    from dlm_jax.frontends.cli import main
    from dlm_jax.training.config import RunConfig

    real_load = RunConfig.load
    monkeypatch.setattr(RunConfig, "load", classmethod(lambda cls, path: _shrunk(real_load.__func__(cls, path))))
    cwd = scratch_dir(tmp_path / "block")
    monkeypatch.chdir(cwd)
    for command, expected in block.commands:
        if command.startswith("dlm-jax train "):
            assert main(shlex.split(command)[1:]) == 0, command
            report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            assert report["steps"] == 2 and Path(report["model"]).is_dir()
        elif command.startswith("dlm-jax eval ") and "runs/" in command:
            assert main(shlex.split(command)[1:] + ["--n", "2"]) == 0, command
            assert json.loads(capsys.readouterr().out)["n"] == 2
        elif command.startswith("dlm-jax "):
            assert main(shlex.split(command)[1:]) == 0, command
            assert_prints(capsys.readouterr().out, expected, f"{block.where}: {command}")
        else:
            result = run(command, cwd)
            assert result.returncode == 0, f"{block.where}: {command}\n{result.stderr[-3000:]}"
            assert_prints(result.stdout, expected, f"{block.where}: {command}")


# ---------------------------------------------------------------------------- GPU commands


def gpu_commands() -> list[str]:
    """The lines of the ```bash blocks in "On a GPU" of docs/benchmarks.md (commands for a GPU
    machine), in order."""
    page = DOCS / "benchmarks.md"
    section = page.read_text(encoding="utf-8").split("\n## On a GPU\n", 1)[1].split("\n## ", 1)[0]
    found = [body for lang, _, body in FENCE.findall(section) if lang == "bash"]
    assert found, "the GPU section shows no bash block"
    return [line for body in found for line in body.splitlines() if line.strip()]


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
    import gpu_step

    peers = [line for line in bench if "benchmarks/gpu.py" in line]
    assert len(peers) == 2
    for line in peers:
        argv = shlex.split(line.replace("PATH/TO/Fast-dLLM", "/src"))
        assert argv[:2] == [".venv/bin/python", "benchmarks/gpu.py"]
        args = gpu.parse_args(argv[2:])
        assert args.peer_src == Path("/src")
    assert gpu.parse_args(shlex.split(peers[0])[2:]).mode == "small"
    steps = [line for line in bench if "benchmarks/gpu_step.py" in line]
    # A lease's commands (tests/benchmarks/test_gpu_lease.py parses the script's parts).
    leases = [line for line in bench if re.search(r"\bbash benchmarks/\w+\.sh\b", line)]
    assert len(leases) == 3 and all((ROOT / re.search(r"benchmarks/\w+\.sh", line).group()).is_file()
                                    for line in leases), leases
    loads = [line for line in bench if "benchmarks/cache_load.py" in line]  # run in tests/benchmarks/test_cache_load.py
    # The stand-in's runs in tests/benchmarks/test_attention_check.py; cuDNN's needs a GPU.
    checks = [line for line in bench if "benchmarks/attention_check.py" in line]
    assert len(checks) == 2
    # The stand-in's runs in tests/benchmarks/test_kernel_sweep.py; the kernel's speed needs a GPU.
    sweeps = [line for line in bench if "benchmarks/kernel_sweep.py" in line]
    assert len(sweeps) == 2
    # The stand-in's runs in tests/benchmarks/test_quant_sweep.py; the kernel's speed needs a GPU.
    qsweeps = [line for line in bench if "benchmarks/quant_sweep.py" in line]
    assert len(qsweeps) == 2
    # Runs as written in tests/benchmarks/test_first_decode.py.
    firsts = [line for line in bench if "benchmarks/first_decode.py" in line]
    assert len(firsts) == 3
    assert len(steps) == 3 and len(peers) + len(steps) + len(leases) + len(loads) + len(checks) + len(sweeps) \
        + len(qsweeps) + len(firsts) == len(bench), bench
    import kernel_sweep

    for line in sweeps:
        argv = shlex.split(line)
        kernel_sweep.build_parser().parse_args(argv[argv.index("benchmarks/kernel_sweep.py") + 1:])
    import quant_sweep

    for line in qsweeps:
        argv = shlex.split(line)
        quant_sweep.build_parser().parse_args(argv[argv.index("benchmarks/quant_sweep.py") + 1:])
    import attention_check

    for line in checks:
        argv = shlex.split(line)
        attention_check.build_parser().parse_args(argv[argv.index("benchmarks/attention_check.py") + 1:])
    import cache_load

    for line in loads:
        argv = shlex.split(line)
        cache_load.build_parser().parse_args(argv[argv.index("benchmarks/cache_load.py") + 1:])
    for line in steps:  # the CPU one runs in tests/benchmarks/test_gpu_step.py
        argv = shlex.split(line)
        gpu_step.parse_args(argv[argv.index("benchmarks/gpu_step.py") + 1:])

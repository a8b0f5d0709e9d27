"""`benchmarks/gpu_lease.sh`, the one command of a GPU lease, and `benchmarks/peer_src.sh`,
which fills the ignored `.peer/Fast-dLLM` the lease carries.

A lease is 15 minutes of device time drawn by chance: a part that dies on a misspelt flag, or a
Fast-dLLM copy without the files gpu.py imports, costs a lease that may not come again. The
script's parts are expanded by bash itself (its own `part` replaced by one that prints what it
would run, each counted as ended well) and each is parsed by its benchmark's own argparse parser."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LEASE = ROOT / "benchmarks" / "gpu_lease.sh"
PEER_SRC = ROOT / "benchmarks" / "peer_src.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))

SEP = "\x1f"


def lease_parts(tmp_path: Path, *, tuned: bool = True, **env: str) -> list[list[str]]:
    """What each `part` of the lease script would run, as bash expands it: [name, limit, min,
    command...] per part, in order. Nothing runs (no GPU, no Python). The parts' results go to
    tmp_path/out (RES); what comes back, to tmp_path/back (OUT). `tuned`: the probe's autotuning
    results are there (a stubbed probe writes none), so the part reading them runs."""
    text = LEASE.read_text()
    anchor = "\n{ nvidia-smi"
    assert text.count(anchor) == 1, "the lease script's parts start after its nvidia-smi line"
    stub = f"\npart() {{ printf '%s{SEP}' \"$@\"; printf '\\n'; ENDED_OK[$1]=1; }}" + anchor
    script = tmp_path / "lease.sh"
    script.write_text(text.replace(anchor, stub))
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    (work / "autotune.pbtxt").unlink(missing_ok=True)
    if tuned:
        (work / "autotune.pbtxt").write_text("version: 3\n")
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path / "back"), "RES": str(out), "WORK": str(tmp_path / "work"),
                               "PATH": os.environ["PATH"], **env})
    assert proc.returncode == 0, proc.stderr
    return [line.split(SEP)[:-1] for line in proc.stdout.splitlines() if SEP in line]


def unenv(part: list[str]) -> list[str]:
    """A part's [name, limit, min, command...] with a leading `env VAR=value ...` taken off its
    command (its variables checked: XLA_FLAGS only, each flag one XLA defines)."""
    name, limit, least, *cmd = part
    if cmd[0] == "env":
        cmd = cmd[1:]
        while "=" in cmd[0]:
            var, value = cmd.pop(0).split("=", 1)
            assert var == "XLA_FLAGS" and all(re.fullmatch(r"--xla_\w+=[\w./-]*", f) for f in value.split()), (name, var)
    return [name, limit, least, *cmd]


def parse(script: str, argv: list[str]):
    """`argv` parsed by the named benchmark's parser (gpu.py's with its checks); SystemExit on a
    flag it does not take."""
    name = Path(script).stem
    module = __import__(name)
    if name == "gpu":
        return module.parse_args(argv)
    return module.build_parser().parse_args(argv)


def test_lease_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(LEASE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry-run"])
def test_every_part_of_the_lease_names_a_script_that_takes_its_arguments(tmp_path, dry):
    """A part whose flags its script refuses exits at once on the GPU machine (argparse's exit
    status 2 in the log) and its results are simply missing after the lease."""
    parts = [unenv(p) for p in lease_parts(tmp_path, LIMIT="5000", **({"DRY": "1"} if dry else {}))]
    assert [p[0] for p in parts] == ["target", "attncheck", "decide", "dual", "tiered cold", "tiered cache", "probe",
                                     "fused", "command buffers off",
                                     "probe load", "probe no autotuning", "gemm", "attention", "probe kernel",
                                     "attention gqa", "sweep", "table",
                                     "small", "logits", "large",
                                     "probe cache", "probe cache again", "cache load", "probe serial", "qsweep", "int4",
                                     "qkernel", "cudnn",
                                     "scan", "first cold", "first cache"]  # (scandsf by name only)
    for name, limit, least, py, script, *argv in parts:
        assert int(least) <= int(limit), name
        assert py == "python3" and (ROOT / script).is_file(), (name, script)
        args = parse(script, argv)
        assert str(args.out).startswith(str(tmp_path / "out")), (name, args.out)  # every result under $RES
    args = {p[0]: parse(p[4], p[5:]) for p in parts}
    table, small, large, dual = args["table"], args["small"], args["large"], args["dual"]
    for name in ("table", "large", "dual"):
        full, limit = args[name], int(next(p[1] for p in parts if p[0] == name))
        assert full.mode == "full" and full.reps == 3 and full.profile and full.quant == ["none", "int8"]
        assert full.xla_cache is not None and not full.no_second_process
        assert full.budget_s + 30 <= limit  # the report is written before the part's timeout
        assert full.second_budget_s < full.budget_s and Path(full.peer_src) == Path(".peer/Fast-dLLM")
        assert (full.shape, full.dtype) == (("small", "float32") if dry else ("llada-8b", "bfloat16"))
    assert table.sides == ["fast_dllm", "dlm_jax"] and table.peer_budget_s < table.budget_s
    assert large.sides == dual.sides == ["dlm_jax"] and dual.caches == ["dual"]
    assert len({table.xla_cache, large.xla_cache, dual.xla_cache}) == 3  # each part's first decodes cold
    assert (table.batches, large.batches) == (([1], [2]) if dry else ([1, 8], [16, 32]))
    # what the table still lacks first: int8 and batch 16 and 32 (batch 8 last: the budget cuts it first)
    assert dual.batches == ([1, 2] if dry else [1, 16, 32, 8])
    assert table.checkpoint == large.checkpoint == dual.checkpoint and small.small  # one checkpoint per lease
    (dsf,) = map(unenv, lease_parts(tmp_path, PARTS="scandsf", LIMIT="5000"))
    assert args["cudnn"].attention == ["cudnn"] and args["scan"].layers == parse(dsf[4], dsf[5:]).layers == ["scan"]
    assert args["attention"].attention == ["split", "cudnn", "cudnn_split", "pallas"]
    assert args["int4"].quant == ["none", "none+dense", "int8", "int4-g128", "int4-g128+pallas", "uint4-g128",
                                  "uint4-g128+pallas"]
    qsweep = args["qsweep"]  # the kernel's tilings against XLA's form, 4-bit and 8-bit groups, and unquantized
    assert qsweep.quant == ["int4-g128", "int8-g128", "none"] and [n for n, _ in qsweep.tilings][0] == "default"
    assert len(qsweep.tilings) == (2 if dry else 9) and qsweep.rows == ([8] if dry else [32, 256])
    assert (qsweep.shape, qsweep.stand_in) == (("small", True) if dry else ("llada-8b", False))
    assert args["attention"].kinds == ["refresh", "dual", "prefix"]
    gqa = args["attention gqa"]  # a grouped-query 8B model's steps: the kernel's stacked heads timed
    assert gqa.attention == ["split", "pallas"] and gqa.kinds == ["dual", "prefix"] and gqa.batches == [1, 8, 32]
    assert gqa.shape == ("small" if dry else "gqa-8b")
    sweep = args["sweep"]  # the kernel's tilings against the split form, each against float32
    assert sweep.batches == [1, 32] and [n for n, _ in sweep.tilings][0] == "default"
    assert len(sweep.tilings) == (2 if dry else 8)
    assert (sweep.shape, sweep.stand_in, sweep.layers) == ((["small"], True, 2) if dry else (["llada-8b", "gqa-8b"], False, 32))
    check = args["attncheck"]  # the forms against float32 before they are timed; a CPU has no cuDNN
    assert (check.shape, check.stand_in) == ((["small"], True) if dry else (["llada-8b", "gqa-8b"], False))
    assert args["target"].write_target and args["target"].out.name == "target_config"  # the device's own config
    fused = args["fused"]  # fused projections against separate ones, in one run, with their kernels
    assert fused.projections == ["separate", "fused"] and fused.profile and fused.kinds == ["dual", "prefix"]
    assert table.projections is large.projections is dual.projections is None  # nothing decided: the executor's
    decide = args["decide"]  # the forms the defaults may take, timed in one run before the table's parts
    assert (decide.attention, decide.projections, decide.kinds, decide.batches) == (
        ["split", "pallas"], ["separate", "fused"], ["dual"], [1, 8])
    assert (decide.shape, decide.dtype) == (("small", "float32") if dry else ("llada-8b", "bfloat16"))
    again = {p[0]: parse(p[4], p[5:]) for p in map(unenv, lease_parts(tmp_path, PARTS="dual table large",
                                                                      PROJECTIONS="fused", LIMIT="5000"))}
    assert [again[n].projections for n in ("dual", "table", "large")] == ["fused"] * 3
    assert "decide" not in [p[0] for p in lease_parts(tmp_path, PROJECTIONS="fused", LIMIT="5000")]  # (given: kept)
    again = {p[0]: parse(p[4], p[5:]) for p in map(unenv, lease_parts(tmp_path, PARTS="dual table large",
                                                                      ATTENTION="cudnn", LIMIT="5000"))}
    assert [again[n].attention for n in ("dual", "table", "large")] == ["cudnn"] * 3
    assert table.attention is None  # the executor's default (split on a GPU)
    gemm = args["gemm"]  # one layer's GEMMs at the model's shape, both layouts, both weight formats
    assert (gemm.shape, gemm.dtype) == (("small", "float32") if dry else ("llada-8b", "bfloat16"))
    assert gemm.quant == ["none", "int8", "int8-g128"] and gemm.groups == ["qkv", "gate_up"] and gemm.rows == [32, 256]
    names = ("probe", "probe load", "probe no autotuning", "probe cache", "probe cache again", "probe serial")
    probes = [args[n] for n in names]
    kernel = args["probe kernel"]  # the probe's programs again in the attention kernel's form
    assert (kernel.kinds, kernel.at, kernel.batches, kernel.threads) == (probes[0].kinds, probes[0].at, [1], 4)
    assert kernel.attention == ["pallas"] and probes[0].attention == ["split"] and kernel.xla_cache is None
    for probe in probes:  # a prefix-cache decode's programs, on the executor's compile threads and on one
        assert probe.kinds == ["refresh", "prefix"] and probe.at == list(range(8)) and probe.batches == [1]
    assert [p.threads for p in probes] == [4, 4, 4, 4, 4, 1]
    assert [p.xla_cache is not None for p in probes] == [False, False, False, True, True, False]
    assert probes[3].xla_cache == probes[4].xla_cache and probes[3].out != probes[4].out  # the second loads the first's
    cache_load = args["cache load"]  # that cache's programs loaded again, the wait split into its parts
    assert cache_load.xla_cache == probes[3].xla_cache and cache_load.kinds == probes[3].kinds
    assert cache_load.at == probes[3].at and cache_load.batches == probes[3].batches
    assert (cache_load.shape, cache_load.dtype) == (("small", "float32") if dry else ("llada-8b", "bfloat16"))
    flags = {p[0]: p[4] for p in lease_parts(tmp_path) if p[3] == "env"}
    tuned = tmp_path / "work" / "autotune.pbtxt"  # the probe writes XLA's autotuning results, the next reads them
    assert flags == {"probe": f"XLA_FLAGS=--xla_gpu_dump_autotune_results_to={tuned}",
                     "probe load": f"XLA_FLAGS=--xla_gpu_load_autotune_results_from={tuned}",
                     "probe no autotuning": "XLA_FLAGS=--xla_gpu_autotune_level=0",
                     "command buffers off": "XLA_FLAGS=--xla_gpu_enable_command_buffer="}
    assert [p[4] for p in lease_parts(tmp_path, PARTS="scandsf")] == ["XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true"]
    off = args["command buffers off"]  # the fused part's separate cases, without CUDA graphs
    assert off.kinds == fused.kinds and off.batches == fused.batches and off.profile and off.projections == ["separate"]
    # A probe cut before XLA wrote the file: the part reading it is skipped, not failed.
    assert "probe load" not in [p[0] for p in lease_parts(tmp_path, tuned=False)]
    cold, cache = args["first cold"], args["first cache"]
    assert cold.cache == cache.cache == "prefix" and cold.xla_cache == cache.xla_cache  # the second reads the first's
    assert cold.path == cache.path == "engine"  # (the users' path: Model.generate, the commands, the server)
    tiered, again = args["tiered cold"], args["tiered cache"]  # a tiered compile's first decode, then a second process
    assert tiered.compile == again.compile == "tiered" and tiered.cache == again.cache == "prefix"
    assert tiered.path == again.path == "engine"
    assert tiered.xla_cache == again.xla_cache and tiered.xla_cache not in (cold.xla_cache, table.xla_cache)
    limit = int(next(p[1] for p in parts if p[0] == "tiered cold"))
    assert tiered.upgrade_wait_s + 60 <= limit  # the upgraded decode's report before the part's timeout
    assert (tiered.shape, tiered.dtype) == (("small", "float32") if dry else ("llada-8b", "bfloat16"))
    only = lease_parts(tmp_path, PARTS="table small")
    assert [p[0] for p in only] == ["table", "small"]
    (again,) = lease_parts(tmp_path, PARTS="dual", DUAL_QUANTS="int8", DUAL_BATCHES="16 32")  # what a cut left
    again = parse(again[4], again[5:])
    assert again.quant == ["int8"] and again.batches == [16, 32] and again.caches == ["dual"]


def test_a_shorter_lease_cuts_the_table_part_and_its_budget_alike(tmp_path):
    """A --budget-s longer than its part's timeout is a report never written: when the time
    left is short, the part and its budget shrink together."""
    parts = lease_parts(tmp_path, LIMIT="200", PARTS="table")
    name, limit, _, _, script, *argv = parts[0]
    args = parse(script, argv)
    assert name == "table" and int(limit) == 190 and args.budget_s == 190 - 55


def test_the_header_s_render_commands_parse():
    """The commands that turn a lease's files into benchmarks/results/ are run once per lease,
    by hand, from the header: each must be one its script takes."""
    header = "\n".join(line[1:].strip() for line in LEASE.read_text().splitlines() if line.startswith("#"))
    header = header.replace("\\\n", " ")
    commands = re.findall(r"\.venv/bin/python (benchmarks/\w+\.py) ([^\n]*)", header)
    assert {c[0] for c in commands} == {"benchmarks/gpu.py", "benchmarks/gpu_step.py", "benchmarks/first_decode.py"}
    for script, rest in commands:
        argv = [a.replace("$LEASE", "/lease") for a in shlex.split(rest)]
        args = parse(script, argv)
        assert getattr(args, "merge", None) or args.render, (script, argv)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def fast_dllm_repo(tmp_path: Path) -> tuple[Path, str]:
    """A tiny git repository laid out as NVlabs/Fast-dLLM is (llada/ beside other folders)."""
    repo = tmp_path / "Fast-dLLM"
    for rel, text in {"llada/generate.py": "x = 1\n", "llada/model/modeling_llada.py": "m = 1\n",
                      "llada/model/configuration_llada.py": "c = 1\n", "dream/generate.py": "d = 1\n",
                      "README.md": "readme\n"}.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(tmp_path, "init", "-q", str(repo))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    return repo, git(repo, "rev-parse", "HEAD")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("bare", [False, True], ids=["checkout", "bare"])
def test_peer_src_copies_only_llada_and_names_its_commit(tmp_path, fast_dllm_repo, bare):
    """A copy of the wrong tree (or of a whole repository, over the lease's 64 MiB carry) and a
    report that cannot name the Fast-dLLM it ran are both silent: the script copies llada/ at one
    commit, and gpu.py reports that commit from the copy."""
    import gpu

    repo, commit = fast_dllm_repo
    if bare:
        git(tmp_path, "clone", "-q", "--bare", str(repo), str(tmp_path / "mirror.git"))
        repo = tmp_path / "mirror.git"
    dest = tmp_path / "w" / ".peer" / "Fast-dLLM"
    (dest / "stale").mkdir(parents=True)  # a copy from before is replaced whole
    proc = subprocess.run(["bash", str(PEER_SRC), str(repo), "HEAD", str(dest)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == ["COMMIT", "llada/generate.py", "llada/model/configuration_llada.py",
                     "llada/model/modeling_llada.py"]
    assert (dest / "COMMIT").read_text().strip() == commit
    ident = gpu.peer_identity(dest)
    assert ident["commit"] == commit and set(ident["sha256"]) == {"llada/generate.py", "llada/model/modeling_llada.py",
                                                                  "llada/model/configuration_llada.py"}
    assert gpu.peer_source(dest)[0] == dest.resolve()  # what --peer-src accepts


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_peer_src_refuses_what_is_not_fast_dllm(tmp_path, fast_dllm_repo):
    repo, _ = fast_dllm_repo
    dest = tmp_path / "peer"
    for argv, problem in (([str(repo), "no-such-rev"], "has no commit no-such-rev"),
                          ([str(tmp_path)], "has no commit HEAD")):
        proc = subprocess.run(["bash", str(PEER_SRC), *argv, str(dest)] if len(argv) == 2 else
                              ["bash", str(PEER_SRC), *argv, "HEAD", str(dest)], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.startswith("error:") and problem in proc.stderr, proc.stderr
    git(repo, "rm", "-rq", "llada")
    git(repo, "commit", "-qm", "no llada")
    proc = subprocess.run(["bash", str(PEER_SRC), str(repo), "HEAD", str(dest)], capture_output=True, text=True)
    assert proc.returncode == 2 and "no llada/generate.py" in proc.stderr and not dest.exists()


def test_the_decided_form_reaches_every_later_part_and_a_later_call(tmp_path):
    """The decide part's choice (gpu_decide.py, run by the script itself over the reports the
    stubbed parts would have written) is what the table's parts and the first decodes run in, and
    a later call on the same machine takes it again from $WORK; a choice the decision refuses to
    make (no timed baseline) leaves the executor's defaults."""
    from tests.benchmarks.test_gpu_decide import check_report, steps_report

    out = tmp_path / "out"
    out.mkdir()
    fast = {("split", "separate"): (7.0, 15.0), ("split", "fused"): (6.8, 14.5), ("pallas", "separate"): (6.0, 12.0),
            ("pallas", "fused"): (5.8, 11.6)}
    (out / "decide_steps.json").write_text(json.dumps(steps_report(fast)))
    (out / "attention_check.json").write_text(json.dumps(check_report()))
    parts = {p[0]: parse(p[4], p[5:]) for p in map(unenv, lease_parts(tmp_path, LIMIT="5000"))}
    for name in ("dual", "table", "large", "first cold", "first cache", "tiered cold", "tiered cache"):
        assert (parts[name].attention, parts[name].projections) == ("pallas", "fused"), name
    assert (tmp_path / "work" / "decided.env").read_text() == "ATTENTION=pallas PROJECTIONS=fused\n"
    assert parts["dual"].batches == [1, 8, 16, 32]  # in a new form the targets' batches first
    (given,) = lease_parts(tmp_path, PARTS="dual", DUAL_BATCHES="32 1", LIMIT="5000")
    assert parse(given[4], given[5:]).batches == [32, 1]  # (given: its order)
    assert "Choice: pallas / fused" in (out / "decide.md").read_text()
    later = {p[0]: parse(p[4], p[5:]) for p in map(unenv, lease_parts(tmp_path, PARTS="dual", LIMIT="5000"))}
    assert (later["dual"].attention, later["dual"].projections) == ("pallas", "fused")
    given = {p[0]: parse(p[4], p[5:]) for p in map(unenv, lease_parts(tmp_path, PARTS="dual", ATTENTION="split",
                                                                      LIMIT="5000"))}
    assert (given["dual"].attention, given["dual"].projections) == ("split", None)  # given: nothing taken from $WORK
    (tmp_path / "work" / "decided.env").unlink()
    (out / "decide_steps.json").write_text(json.dumps(steps_report({("split", "separate"): "XlaRuntimeError: oom"})))
    parts = {p[0]: parse(p[4], p[5:]) for p in map(unenv, lease_parts(tmp_path, LIMIT="5000"))}
    assert all((parts[n].attention, parts[n].projections) == (None, None) for n in ("dual", "table", "first cold"))
    assert parts["dual"].batches == [1, 16, 32, 8]  # (b1 and b8 measured in the defaults' form before)
    assert not (tmp_path / "work" / "decided.env").exists()
    assert "decide: nothing decided" in (tmp_path / "back" / "log.txt").read_text()


# A stand-in for the lease's Python: it writes what a part writes under its --out (a report, a
# plot, a worker's file, temporary files) and, where the archive is there already, the names in
# it, and XLA's autotuning results where XLA_FLAGS asks; FAKE_FAIL names --out paths (ending) whose part exits 1; FAKE_REPORT, a gpu.py report's
# text to write as the --out path's .json. lease_rest.py, which reads the state, runs for real.
FAKE_PY = """#!/usr/bin/env bash
[ "$1" = benchmarks/lease_rest.py ] && exec "$REAL_PY" "$@"
case "${XLA_FLAGS:-}" in --xla_gpu_dump_autotune_results_to=*) echo "version: 3" > "${XLA_FLAGS#*=}";; esac
out=; while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done
[ -n "$out" ] || exit 0
[ -f "$OUT/lease.tar.gz" ] && tar -tzf "$OUT/lease.tar.gz" > "$out.seen.txt"
echo '{}' > "$out.json"; echo '# report' > "$out.md"; echo png > "$out.png"; echo '{' > "$out.json.tmp"
mkdir -p "${out}_work/sub" && echo '{}' > "${out}_work/sub/case.json" && echo x > "$(dirname "$out")/.r.json.tmp-1"
case "$out" in *gpu_dual) [ -n "${FAKE_REPORT:-}" ] && echo "$FAKE_REPORT" > "$out.json";; esac
for f in ${FAKE_FAIL:-}; do case "$out" in *"$f") exit 1;; esac; done
exit 0
"""


def run_lease(tmp_path: Path, **env: str) -> str:
    """The real lease script over FAKE_PY (no GPU, no JAX: a second or two), its WORK in
    tmp_path/work, its OUT tmp_path/back unless given; its log."""
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    env = {"OUT": str(tmp_path / "back"), "WORK": str(tmp_path / "work"), "LIMIT": "100", **env}
    proc = subprocess.run(["bash", str(LEASE)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PY": str(fake), "REAL_PY": sys.executable, **env})
    assert proc.returncode == 0, proc.stderr
    return (Path(env["OUT"]) / "log.txt").read_text()


def test_a_call_brings_every_result_back_in_at_most_8_files(tmp_path):
    """The device tool brings back at most 8 files of at most 16 MiB from $OUT, and the parts
    write some 90 (reports, plots, gpu.py's worker files, XLA's autotuning results). The real
    script, its Python replaced by a stand-in that writes what a part writes: after each part
    the results so far are packed into $OUT (a later part sees the earlier one's report in the
    archive), the reports apart from the large files, and the temporary files left out."""
    import tarfile

    back, res = tmp_path / "back", tmp_path / "res"
    res.mkdir()
    (res / "autotune.pbtxt").write_text("version: 3\n")
    run_lease(tmp_path, OUT=str(back), RES=str(res), PARTS="target attncheck")
    came = sorted(p.name for p in back.iterdir())
    assert came == ["lease.tar.gz", "lease_extra.tar.gz", "log.txt"]  # (no .part left: each renamed into place)
    assert all(p.stat().st_size < 16 << 20 for p in back.iterdir())

    def names(archive: str) -> set[str]:
        with tarfile.open(back / archive) as tar:
            return {Path(n).as_posix().removeprefix("./") for n in tar.getnames() if tar.getmember(n).isfile()}

    reports = {"smi.txt", "target_config.json", "target_config.md", "attention_check.json", "attention_check.md",
               "attention_check.seen.txt"}
    assert names("lease.tar.gz") == reports
    assert names("lease_extra.tar.gz") == {"autotune.pbtxt", "target_config.png", "attention_check.png",
                                           "target_config_work/sub/case.json", "attention_check_work/sub/case.json"}
    with tarfile.open(back / "lease.tar.gz") as tar:  # the second part saw the first's report packed already
        seen = tar.extractfile("./attention_check.seen.txt").read().decode().split()
    assert "./target_config.json" in seen and "./attention_check.json" not in seen
    assert "target: exit 0" in (back / "log.txt").read_text()


def test_the_working_tree_a_lease_sends_fits_the_device_tool():
    """A call sends the checkout's tracked files and the carried `.peer` (about 0.2 MiB), 64 MiB
    at most, or no machine starts. The shipped models are most of it (56 MB), so a new model or
    a lease's results committed can tip it: this fails first, here, not on the lease."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    tracked = sum(p.stat().st_size for n in names if n and (p := ROOT / n.decode()).is_file())
    assert tracked + (1 << 20) <= 64 << 20, f"{tracked / 2**20:.1f} MiB tracked: the lease's tree would be over 64 MiB"


def test_a_later_call_runs_what_the_calls_before_it_left(tmp_path):
    """The second call of a lease has to start within the 30 s a machine stays warm, so it is one
    fixed command, PARTS=rest: the parts that failed, were skipped for time or never ran, in
    the script's order, and the dual part over only the cases its budget skipped (by its
    report); a part that ended well is not run again, and a third call finds nothing left."""
    import lease_rest

    default = lease_rest_default_parts()
    cut = {"cases": [{"batch": 1, "quant": "none", "dlm_jax": {"median_step_seconds": 0.007}},
                     {"batch": 1, "quant": "int8", "dlm_jax": {"median_step_seconds": 0.004}},
                     {"batch": 16, "quant": "none", "dlm_jax": {"median_step_seconds": 0.02}},
                     {"batch": 16, "quant": "int8", "dlm_jax": {"skipped": "skipped: time budget"}},
                     {"batch": 32, "quant": "int8", "dlm_jax": {}},  # (its worker ended first)
                     {"batch": 8, "quant": "fp8", "dlm_jax": {"error": "XlaRuntimeError: fp8"}}]}  # (not again)
    assert lease_rest.unmeasured(cut) == ([16, 32], ["int8"])
    log = run_lease(tmp_path, OUT=str(tmp_path / "b1"), PARTS="target attncheck dual sweep", FAKE_FAIL="attention_check",
                    FAKE_REPORT=json.dumps(cut))
    assert 'dual: left for PARTS=rest: DUAL_BATCHES="16 32" DUAL_QUANTS="int8"' in log
    log = run_lease(tmp_path, OUT=str(tmp_path / "b2"), PARTS="rest", LIMIT="5000")
    rest = [p for p in default if p not in ("target", "sweep")]  # (attncheck failed, dual cut, the rest never ran)
    assert f"rest: {' '.join(rest)}" in log
    (dual,) = [line for line in log.splitlines() if line.startswith("dual: limit")]
    args = parse("benchmarks/gpu.py", shlex.split(dual.split(": ", 2)[2])[2:])
    assert (args.batches, args.quant) == ([16, 32], ["int8"])
    assert "rest: nothing left" in run_lease(tmp_path, OUT=str(tmp_path / "b3"), PARTS="rest")
    assert not (tmp_path / "work" / "dual_rest.env").exists()  # (the second call's dual measured them all)
    # A part whose last call skipped it for time, or failed one of its two steps, is left.
    state = "1 first ok\n1 probe ok\n2 probe skip\n1 table fail\n3 table ok\n4 first ok\n4 first fail\n"
    assert lease_rest.parts_left(state, ["first", "probe", "table", "gemm"]) == ["first", "probe", "gemm"]


def lease_rest_default_parts() -> list[str]:
    (line,) = [ln for ln in LEASE.read_text().splitlines() if ln.startswith("DEFAULT_PARTS=")]
    return line.split("=", 1)[1].strip('"').split()


def test_a_second_process_over_a_cache_runs_only_after_the_part_that_fills_it(tmp_path):
    """`probe cache again`, `cache load` and `first cache` time a second process over the cache
    a part before them filled in the same call (each call starts cold). After that part failed,
    or was skipped for time, they would time compiles under a cache's label: skipped instead,
    and PARTS=rest runs the filling part again with them."""
    log = run_lease(tmp_path, OUT=str(tmp_path / "b1"), PARTS="probecache cacheload", FAKE_FAIL="probe_cache",
                    LIMIT="5000")
    assert "probe cache again: skipped, probe cache did not end with exit 0 in this call" in log
    assert "cache load: skipped, probe cache did not end with exit 0 in this call" in log
    log = run_lease(tmp_path, OUT=str(tmp_path / "b2"), PARTS="first", LIMIT="45")  # 35 s left: too few for the cold one (40)
    assert "first cold: skipped" in log and "first cache: skipped, first cold did not end with exit 0" in log
    assert "first cache: exit" not in log
    with open(tmp_path / "work" / "parts.state", "a") as f:
        f.write("9 probecache ok\n")  # (as if a later call had run the probe cache part alone)
    log = run_lease(tmp_path, OUT=str(tmp_path / "b3"), PARTS="rest", LIMIT="5000")
    assert re.search(r"^rest: .*\bprobecache cacheload\b", log, re.M)
    assert "cache load: exit 0" in log and "first cache: exit 0" in log

"""Mesh decoding (`dlm_jax.load(path, mesh=...)`, docs/mesh.md): the same tokens and NFE as one
device on tensor-, expert- and data-parallel meshes of host devices, per-device bytes equal to
the planner's, two processes equal to one, and bad meshes refused before loading.

The decodes run in processes of their own (tests/executors/mesh_driver.py) with 8 host devices:
this test process keeps one device, as training's tests need (a training mesh takes every
device there is).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import dlm_jax
from dlm_jax._errors import ConfigError
from dlm_jax.frontends.cli import main

DRIVER = Path(__file__).with_name("mesh_driver.py")
ROOT = Path(__file__).resolve().parents[2]
BIDIRECTIONAL = ["fast-dllm", "fast-dllm-dual", "fast-dllm-factor", "frechet", "llada", "llada-cpp"]


def drive(spec: dict, *, timeout: float = 600) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_same(report: dict) -> None:
    """Every case's mesh decode gave one device's tokens and NFE, through the engine and as a
    fixed batch, for every preset."""
    for case in report["cases"]:
        for preset, got in case["presets"].items():
            one, mesh = got["one"], got["mesh"]
            where = f"{case['model']} {case['mesh']} {preset}"
            assert mesh["engine"] == one["engine"], where
            assert (mesh["engine_nfe"], mesh["request_nfe"]) == (one["engine_nfe"], one["request_nfe"]), where
            assert mesh["fixed"] == one["fixed"] and mesh["fixed_nfe"] == one["fixed_nfe"], where
            assert any(len(ids) for ids in one["engine"]), where  # something was generated


def assert_bytes(report: dict) -> None:
    """Each device holds the planner's figure of parameters and K/V (the same rules split
    both), and tp or ep split the parameters: no device holds all of them."""
    for case in report["cases"]:
        if case["load"].get("expert_slots"):  # split layers hold slots, not the planner's whole experts
            continue
        assert set(case["param_bytes"]) == {case["plan_param_bytes"]}, case["mesh"]
        assert set(case["kv_bytes"]) == {case["plan_kv_bytes"]}, case["mesh"]
        shape = dlm_jax.MeshShape.parse(case["mesh"])
        if shape.tp * shape.ep > 1:  # (dp replicates them)
            assert case["plan_param_bytes"] < case["total_param_bytes"], case["mesh"]


@pytest.mark.slow  # (by default a tp=2,dp=2 decode runs as docs/mesh.md shows it: tests/test_docs.py)
def test_tensor_and_data_parallel_decode_as_one_device():
    report = drive({"devices": 4, "cases": [
        {"model": "models/llada-tiny", "mesh": "tp=2,dp=2", "presets": ["fast-dllm-dual"], "prompts": 3}]})
    # (expert parallelism: test_every_preset_on_expert_and_data_parallel_meshes, in the slow pass)
    assert_same(report)
    assert_bytes(report)
    tiny = report["cases"][0]
    # Dense layers split over tp: attention and FFN kernels halve, so the per-device total sits
    # between half and all of it (embedding rows split too; norms replicated).
    assert tiny["devices"] == 4 and tiny["plan_param_bytes"] < 0.55 * tiny["total_param_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_preset_on_tensor_parallel_meshes(tp):
    cases = [{"model": "random:bidir", "mesh": f"tp={tp}", "presets": BIDIRECTIONAL},
             {"model": "random:causal", "mesh": f"tp={tp}", "presets": ["isd", "ar"]}]
    if tp in (2, 4):  # the shipped (trained) models: decodes that commit many tokens per step; at tp=4 their
        # 2 K/V heads stay whole on every device (4 query heads split)
        cases += [{"model": "models/llada-tiny", "mesh": f"tp={tp}", "presets": BIDIRECTIONAL},
                  {"model": "models/idlm-tiny", "mesh": f"tp={tp}", "presets": ["isd"]},
                  {"model": "models/ar-tiny", "mesh": f"tp={tp}", "presets": ["ar"]}]
    report = drive({"devices": 8, "cases": cases})
    assert_same(report)
    assert_bytes(report)


EXPERT_CASES = [
    {"model": "models/moe-tiny", "mesh": "ep=2", "presets": BIDIRECTIONAL},
    # (ep=4: the presets whose steps differ in kind, the prefix, dual and MBSD caches)
    {"model": "models/moe-tiny", "mesh": "ep=4", "presets": ["fast-dllm", "fast-dllm-dual", "llada-cpp"]}]
EXPERT_MORE_CASES = [
    {"model": "models/moe-tiny", "mesh": "ep=4,tp=2", "presets": ["fast-dllm", "fast-dllm-dual"]},
    # routed rows exchanged with all-to-all instead of every device computing its experts for all rows
    {"model": "models/moe-tiny", "mesh": "ep=4", "exchange": "all_to_all", "presets": ["fast-dllm", "llada-cpp"]},
    {"model": "models/moe-tiny", "mesh": "ep=2,tp=2", "exchange": "all_to_all", "presets": ["fast-dllm-dual"]},
    # TIDE's split execution, its 8 expert slots per layer split over the devices (4 each),
    # experts moving into them between steps
    {"model": "models/moe-tiny", "mesh": "ep=2", "load": {"expert_slots": 8},
     "presets": [{"experts": "tide", "tau": "2", "hits": "previous_step"}]}]
QUANT_CASES = [
    # int8 / fp8 routed experts (their [E, O] scales take a spec of their own) on expert- and
    # tensor-parallel meshes, both exchanges, float32 and bfloat16 activations (data-parallel
    # replicas of int8 kernels: QUANT_DENSE_CASES)
    {"model": "models/moe-tiny", "mesh": "ep=2,tp=2", "load": {"quant": "int8"}, "presets": ["fast-dllm-dual"]},
    {"model": "models/moe-tiny", "mesh": "ep=4", "exchange": "all_to_all", "load": {"quant": "fp8"},
     "presets": ["fast-dllm"]},
    {"model": "models/moe-tiny", "mesh": "tp=2", "load": {"quant": "int8", "dtype": "bfloat16",
                                                         "param_dtype": "bfloat16"}, "presets": ["fast-dllm-dual"]},
    # grouped scales ([G, O] a kernel, [E, G, O] the experts): groups split as the input rows
    {"model": "models/moe-tiny", "mesh": "ep=2,tp=2", "load": {"quant": "int8-g32"}, "presets": ["fast-dllm"]},
    {"model": "models/moe-tiny", "mesh": "ep=2,tp=2", "exchange": "all_to_all", "load": {"quant": "fp8-g32"},
     "presets": ["fast-dllm-dual"]}]
QUANT_DENSE_CASES = [
    {"model": "models/llada-tiny", "mesh": "tp=2", "load": {"quant": "int8-g32", "dtype": "bfloat16",
                                                            "param_dtype": "bfloat16"}, "presets": ["fast-dllm"]},
    # weight-only int8 (kernels and scales split alike) and bfloat16, on tp and dp
    {"model": "models/llada-tiny", "mesh": "tp=2,dp=2", "load": {"quant": "int8"},
     "presets": ["fast-dllm", "fast-dllm-dual"]},
    {"model": "models/llada-tiny", "mesh": "tp=2,dp=2", "load": {"dtype": "bfloat16", "param_dtype": "bfloat16"},
     "presets": ["fast-dllm", "fast-dllm-dual"]}]
DATA_CASES = [
    {"model": "models/llada-tiny", "mesh": "dp=2", "presets": BIDIRECTIONAL},
    # per-replica steps (manual over dp) whose MoE layers split their experts over ep inside
    {"model": "models/moe-tiny", "mesh": "ep=2,dp=2", "presets": ["fast-dllm-dual"]},
    {"model": "models/moe-tiny", "mesh": "ep=2,dp=2", "exchange": "all_to_all", "presets": ["fast-dllm"]},
    {"model": "models/idlm-tiny", "mesh": "dp=2", "presets": ["isd"]},
    {"model": "models/ar-tiny", "mesh": "dp=2", "presets": ["ar"]}]


@pytest.mark.slow
@pytest.mark.parametrize("cases", [EXPERT_CASES, EXPERT_MORE_CASES, QUANT_CASES, QUANT_DENSE_CASES, DATA_CASES],
                         ids=["expert", "expert-more", "quantized", "quantized-dense", "data"])
def test_every_preset_on_expert_and_data_parallel_meshes(cases):
    """Every case's tokens and NFE equal one device's and each device holds the planner's bytes.
    (Five driver runs: as one, a fresh clone's slow pass ran past the driver's 600 s, and the
    expert and quantized cases' runs each reached it on a slower machine. Measured alone on 2
    cores: 60-230 s each.)"""
    report = drive({"devices": 8, "cases": cases})
    assert_same(report)
    assert_bytes(report)


@pytest.mark.slow
def test_int4_on_a_mesh_decodes_as_one_device():
    """int4 kernels, held as int8 on a mesh (the same values: `dlm_jax.models.quant.widen_int4`;
    split int4 arrays' packed layout is one JAX's CPU arrays do not take), a dense model's on
    tp=2 and an MoE's uint4 experts (zero points split as their scales) on ep=2,tp=2: one
    device's tokens, and the planner's bytes per device (a byte a weight)."""
    report = drive({"devices": 4, "cases": [
        {"model": "models/llada-tiny", "mesh": "tp=2", "load": {"quant": "int4-g32"}, "presets": ["fast-dllm"]},
        {"model": "models/moe-tiny", "mesh": "ep=2,tp=2", "load": {"quant": "uint4-g32"},
         "presets": ["fast-dllm-dual"]}]})
    assert_same(report)
    assert_bytes(report)


@pytest.mark.slow
def test_a_pre_quantized_checkpoint_on_a_mesh_decodes_as_one_device():
    """A fine-grained FP8 copy of llada-tiny (blocks of 32 x 32 expanded to groups of 32 input
    rows, its head float) on tp=2: one device's tokens, and the planner's bytes per device with
    the head counted float. (A driver run of its own: the quantized cases' run is near its 600 s.)"""
    report = drive({"devices": 8, "cases": [{"model": "fp8:models/llada-tiny", "mesh": "tp=2",
                                             "presets": ["fast-dllm"]}]})
    assert_same(report)
    assert_bytes(report)


@pytest.mark.slow
def test_data_parallel_replicas_compute_their_own_rows():
    """On a dp=2 mesh each replica computes its own batch rows over its own cache rows: the
    engine places every request's row in a replica and lays each call out by replica, so the
    step programs move nothing between the replicas but the rows' predictions (one all-gather
    of a few KB), in the CPU's row forms and a GPU's (batched rows, the cache read in place).
    Left to XLA's partitioner, the engine's steps summed the cache rows each batch row read over
    the replicas (69 KB a step here with gathered reads; 1.2 MB in place, an all-reduce of the
    rows' whole caches) and a fixed batch's steps gathered every row's inputs and window K/V
    onto both replicas (272 KB), against 524 KB of K/V in a cache row."""
    common = {"model": "models/llada-tiny", "mesh": "dp=2", "presets": ["fast-dllm-dual", "llada"], "max_batch": 4,
              "collectives": True}
    report = drive({"devices": 2, "cases": [common, {**common, "rows": "batched", "attention": "split"}]})
    assert_same(report)
    for case in report["cases"]:
        kinds = case["collectives"]
        assert set(kinds) == {"all-gather"}, kinds  # no all-reduce: no replica reads another's rows
        assert sum(v["bytes"] for v in kinds.values()) < case["row_kv_bytes"] / 16, (kinds, case["row_kv_bytes"])


@pytest.mark.slow
def test_logits_stay_on_a_mesh_of_this_processs_devices():
    """Sampling, penalties and logprobs beside the step (`logits_on="device"`) on tp and dp
    meshes of one process's devices, and ISD's drafts judged there (relaxed with the IAR, p / q
    over sampled drafts): the logits stay replicated over the mesh, only the answers come back
    (as on one device), and the tokens are one device's."""
    presets = [{"logits_on": "device", "presence_penalty": 1.0, "frequency_penalty": 0.5,
                "logprobs": 2},
               {"logits_on": "device", "temperature": 0.8, "top_k": 4}]
    judged = [{"cache": "isd", "logits_on": "device", "relax": 0.5, "iar": True},
              {"cache": "isd", "logits_on": "device", "temperature": 0.8, "proposal": "sample"}]
    report = drive({"devices": 4, "cases": [
        {"model": "models/llada-tiny", "mesh": mesh, "presets": presets, "max_batch": 4, "prompts": 3}
        for mesh in ("tp=2", "tp=2,dp=2")] + [
        {"model": "models/idlm-tiny", "mesh": "tp=2,dp=2", "presets": judged, "max_batch": 4, "prompts": 3}]})
    assert_same(report)
    for case in report["cases"]:
        for got in case["presets"].values():
            one, mesh = got["one"], got["mesh"]
            assert mesh["logits_on"] == "cpu" and mesh["d2h"] == one["d2h"] < 3 * 32 * 264 * 4 // 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(argv) -> list[tuple[str, str]]:
    """(stdout, stderr) of the two processes `argv(coordinator, rank)` starts, joined on a free
    loopback port, each with its own host devices (XLA_FLAGS dropped); each must exit 0."""
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen(argv(coordinator, rank), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT) for rank in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append((out, err))
    finally:
        for p in procs:
            p.kill()
    return outs


@pytest.mark.slow
def test_two_processes_decode_as_one():
    """One mesh over two processes (jax.distributed on 127.0.0.1, gloo collectives), each with
    two host devices, each running the same host loop: the tokens of one process on one device.
    With the logits kept on the device (sampling, penalties, logprobs), each process answers its
    asks on its own replica of them: the same tokens, and one device's bytes read back."""
    kept = [{"logits_on": "device", "presence_penalty": 1.0, "logprobs": 2},
            {"logits_on": "device", "temperature": 0.8, "top_k": 4}]
    case = {"model": "models/llada-tiny", "mesh": "tp=2,dp=2", "presets": ["fast-dllm", "fast-dllm-dual", *kept],
            "max_batch": 4, "prompts": 3}
    outs = [json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
            for out, _ in _two_processes(lambda coordinator, rank: [sys.executable, str(DRIVER), json.dumps(
                {"devices": 2, "cases": [case], "processes": [coordinator, 2, rank]})])]
    for report in outs:
        assert report["cases"][0]["devices"] == 2  # this process's share of the 4 devices
        assert_same(report)
        for preset in kept:
            got = report["cases"][0]["presets"][json.dumps(preset)]
            assert got["mesh"]["logits_on"] == "cpu" and got["mesh"]["d2h"] == got["one"]["d2h"] < 3 * 32 * 264 * 4 // 8
    assert outs[0]["cases"][0]["presets"] == outs[1]["cases"][0]["presets"]


@pytest.mark.slow
def test_two_command_processes_print_only_their_completions():
    """`dlm-jax generate --coordinator ...` in two processes on this CPU: each one's stdout is its
    completion alone (gloo writes a line per connection to the process's stdout: the command
    sends the native stdout to stderr), and both are one device's."""
    outs = _two_processes(lambda coordinator, rank: [
        sys.executable, "-m", "dlm_jax.frontends.cli", "generate", "--model", "models/llada-tiny", "--mesh",
        "tp=2,dp=2", "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(rank),
        "--prompt", "564+894=", "--prompt", "66+76="])
    one = dlm_jax.load(ROOT / "models" / "llada-tiny", executor="jax").generate(
        ["564+894=", "66+76="], dlm_jax.decode_config()).texts
    for out, err in outs:
        assert out.splitlines() == one, (out, err[-2000:])


# -- refusals: one line, before any weight is read ----------------------------------------------


@pytest.mark.parametrize("mesh, words", [
    ("tp=3", "tp=3 does not divide the model's 4 attention heads"),
    ("tp=8", "tp=8 does not divide the model's 4 attention heads"),
    ("ep=2", "ep=2: the model has no routed experts"),
    ("tp=2", "needs 2 devices"),
])
def test_bad_meshes_are_refused_before_loading(monkeypatch, mesh, words):
    import dlm_jax.checkpoint._io as io

    monkeypatch.setattr(io, "load_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match=re.escape(words)) as err:
        dlm_jax.load("models/llada-tiny", mesh=mesh)
    assert "\n" not in str(err.value)


def test_a_mesh_that_does_not_fit_the_memory_is_refused(monkeypatch):
    import dlm_jax.checkpoint._io as io
    import dlm_jax.executors.sharding as sharding

    monkeypatch.setattr(io, "load_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    monkeypatch.setattr(sharding, "device_memory", lambda placement: 1 << 20)  # 1 MiB devices
    with pytest.raises(ConfigError, match=r"mesh tp=1,ep=1,dp=1 does not fit: it needs .* a device has 1.00 MiB"):
        dlm_jax.load("models/moe-tiny", mesh="tp=1")


@pytest.mark.parametrize("argv, words", [
    (["--mesh", "tq=2"], "unknown axis 'tq'"),
    (["--mesh", "tp=0"], "tp='0' must be a whole number >= 1"),
    (["--mesh", "ep=2"], "ep=2: the model has no routed experts"),
    (["--mesh", "tp=3"], "tp=3 does not divide the model's 4 attention heads"),
    (["--coordinator", "127.0.0.1:1"], "needs --num-processes N and --process-id I"),
    (["--num-processes", "2"], "need --coordinator HOST:PORT"),
    (["--mesh", "tp=2", "--executor", "litert"], "mesh decoding runs on the JAX executor"),
])
def test_cli_mesh_errors_are_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as ex:
        sys.exit(main(["generate", "--model", "models/llada-tiny", "--prompt", "1+1=", *argv]))
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_serve_refuses_several_processes(capsys):
    with pytest.raises(SystemExit) as ex:
        sys.exit(main(["serve", "--model", "models/llada-tiny", "--port", "0", "--coordinator", "127.0.0.1:1",
                       "--num-processes", "2", "--process-id", "0"]))
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "serve runs on one process" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_serve_on_a_mesh_answers_as_one_device(tmp_path):
    """`dlm-jax serve --mesh tp=2,dp=2` in its own process (the command splits the CPU into 4
    host devices): concurrent completions equal this process's one-device decodes."""
    import threading
    import time

    import httpx

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-m", "dlm_jax.frontends.cli", "serve", "--model",
                             str(ROOT / "models" / "llada-tiny"), "--port", "0", "--mesh", "tp=2,dp=2", "--gen", "32",
                             "--max-batch", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    prompts = ["564+894=", "sort: 37 44 13 33 47 48", "66+76="]
    try:
        first = proc.stdout.readline()
        assert first.startswith("serving llada-tiny on http://127.0.0.1:"), first + proc.stderr.read()
        assert "mesh tp=2,dp=2, 4 devices" in first, first
        url = first.split()[3]
        deadline = time.monotonic() + 300
        while True:  # warm-up compiles the mesh's programs first
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not become healthy"
            time.sleep(0.5)
        got: dict[str, str] = {}

        def ask(prompt: str) -> None:
            r = httpx.post(url + "/v1/completions", json={"model": "llada-tiny", "prompt": prompt, "max_tokens": 32},
                           timeout=120)
            assert r.status_code == 200, r.text
            got[prompt] = r.json()["choices"][0]["text"]

        clients = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for c in clients:
            c.start()
        for c in clients:
            c.join(150)
    finally:
        proc.terminate()
        proc.wait(60)
    alone = dlm_jax.load(ROOT / "models" / "llada-tiny", executor="jax")
    want = {p: alone.generate([p], dlm_jax.preset("fast-dllm", gen_len=32)).texts[0] for p in prompts}
    assert got == want and "1458" in got.values()


@pytest.mark.slow  # (by default tests/models/test_attention_kernel.py runs the kernel on meshes of host devices)
def test_the_attention_kernel_on_a_mesh_decodes_one_device_s_tokens():
    """The "pallas" form on a tp=2,dp=2 mesh (each device runs the kernel over its rows and
    heads under `shard_map`, in Pallas's interpreter here): one device's tokens and NFE in the
    same form, refreshes and cached steps, through the engine and as a fixed batch."""
    report = drive({"devices": 4, "cases": [
        {"model": "random:bidir", "mesh": "tp=2,dp=2", "presets": ["fast-dllm-dual"], "prompts": 3,
         "attention": "pallas"}]})
    assert_same(report)
    traces = report["cases"][0]["kernel_traces"]
    assert traces and set(traces) == {8}, traces  # the mesh's steps took the kernel (8 query heads split)


@pytest.mark.slow  # (by default tests/models/test_quant_kernel.py runs the kernel on meshes of host devices)
def test_the_quantized_kernel_on_a_mesh_decodes_one_device_s_tokens():
    """`$DLM_JAX_QUANT_KERNEL=pallas` on meshes (each device runs the quantized kernel over its
    shards under `shard_map`, in Pallas's interpreter here) against one device's decode in XLA's
    form: grouped int8 on tp=2; an act-order int4 model in bfloat16 on tp=2,dp=2 (row-parallel
    maps split, their scales whole); an MoE's uint4 experts on ep=2,tp=2 (each device's experts
    in the kernel inside the experts' own `shard_map`). The same tokens and NFE, and the kernel's
    weights each device's shards: the q projection's columns halved, the o projection's rows,
    half the experts with half their neurons."""
    bf16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
    report = drive({"devices": 4, "cases": [
        {"model": "models/llada-tiny", "mesh": "tp=2", "load": {"quant": "int8-g32"}, "presets": ["fast-dllm"],
         "quant_kernel": True},
        {"model": "models/llada-tiny", "mesh": "tp=2,dp=2", "load": {"quant": "int4-g32-act", **bf16},
         "presets": ["fast-dllm-dual"], "prompts": 2, "quant_kernel": True},
        {"model": "models/moe-tiny", "mesh": "ep=2,tp=2", "load": {"quant": "uint4-g32"}, "presets": ["fast-dllm"],
         "prompts": 2, "quant_kernel": True}]})
    assert_same(report)
    dense, act, moe = ({tuple(s) for s in case["quant_kernel_traces"]} for case in report["cases"])
    # llada-tiny: d 128, 4 query heads of 32 over 2 K/V heads, FFN 384 (the head's 264 columns stay XLA's)
    assert dense == act == {(1, 128, 64), (1, 128, 32), (1, 64, 128), (1, 128, 192), (1, 192, 128)}, dense
    assert {(16, 128, 32), (16, 32, 128)} <= moe, moe  # 32 experts over ep, their FFN of 64 over tp

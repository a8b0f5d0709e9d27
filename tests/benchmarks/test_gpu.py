"""`benchmarks/gpu.py`, dlm-jax against Fast-dLLM's released generators.

The correctness half (`--small`) guards against a comparison that times different work: a
benchmark whose two sides decode different answers, or the same answers in a different number
of forward passes, reports ratios that mean nothing. It needs Fast-dLLM's sources
(`DLM_JAX_PEER_SRC`, a checkout of NVlabs/Fast-dLLM); the helpers below it need none."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "gpu.json"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu  # noqa: E402

PEER_ENV = "DLM_JAX_PEER_SRC"


# ---------------------------------------------------------------------------------------------
# Helpers: no peer code, no model


def test_arguments_take_each_modes_defaults_and_the_flags_given():
    full = gpu.parse_args([])
    assert (full.mode, full.batches, full.dtype, full.reps, full.prompt_len, full.gen_len) == (
        "full", [1, 8, 16, 32], "bfloat16", 3, 128, 256)
    assert (full.block_len, full.threshold, full.caches, full.tie_tol) == (32, 0.9, ["prefix", "dual"], 1.0)
    assert full.out == ROOT / "benchmarks" / "results" / "gpu"
    small = gpu.parse_args(["--small", "--batches", "4", "--peer-src", "/x"])
    assert (small.mode, small.batches, small.dtype, small.gen_len, small.tie_tol) == ("small", [4], "float32", 64, 0.01)
    assert small.peer_src == Path("/x") and small.checkpoint != full.checkpoint


@pytest.mark.parametrize("argv", [["--block-len", "48"], ["--batches", "0"], ["--threshold", "1.5"],
                                  ["--caches", "none"], ["--sides", "torch"], ["--merge", "a.json", "--batches", "8"],
                                  ["--quant", "int4"], ["--attention", "flash"], ["--budget-s", "0"],
                                  ["--merge", "a.json", "--quant", "int8"], ["--peer-budget-s", "0"],
                                  ["--second-budget-s", "-1"], ["--shape", "llada-70b"],
                                  ["--merge", "a.json", "--profile"]])
def test_arguments_refuse_what_cannot_run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        gpu.parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_per_row_scatter_writes_each_row_its_own_block():
    """Fast-dLLM's dual cache writes the block's K/V with `past[:, :, cols] = k`, where cols
    holds the positions of every row: batch 2 fails; the patch writes each row its own."""
    torch = pytest.importorskip("torch")
    b, h, length, s, d = 2, 3, 7, 2, 4
    replace = torch.zeros(b, length, dtype=torch.bool)
    replace[:, 3:5] = True
    cols = replace.nonzero(as_tuple=True)[1]
    new = torch.arange(b * h * s * d, dtype=torch.float32).reshape(b, h, s, d) + 1
    with pytest.raises(RuntimeError):
        torch.zeros(b, h, length, d)[:, :, cols] = new  # their indexing, batch 2
    past = gpu.scatter_rows(torch.zeros(b, h, length, d), new, cols)
    assert torch.equal(past[:, :, 3:5], new)
    assert not past[:, :, :3].any() and not past[:, :, 5:].any()
    one = torch.zeros(1, h, length, d)
    one[:, :, cols[:s]] = new[:1]
    assert torch.equal(gpu.scatter_rows(torch.zeros(1, h, length, d), new[:1], cols[:s]), one)
    with pytest.raises(ValueError, match="expected 2 rows x 2"):
        gpu.scatter_rows(torch.zeros(b, h, length, d), new, cols[:3])


def attention_write(past_key, past_value, k, v, replace_position):
    # The dual-cache write of Fast-dLLM's LLaDABlock.attention, as released.
    replace_indices = replace_position.nonzero(as_tuple=True)[1]  # [selected_length]
    past_key[:, :, replace_indices] = k
    k = past_key
    past_value[:, :, replace_indices] = v
    v = past_value
    return k, v


def test_source_patch_makes_the_released_write_per_row(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(globals(), "_dlm_jax_scatter_rows", gpu.scatter_rows)
    edits = [p for p in gpu.PATCHES if p.target == "modeling.LLaDABlock.attention"]
    patched, applied = gpu._patch_function(attention_write, edits)
    assert applied == [True, True] and patched is not attention_write
    replace = torch.zeros(2, 6, dtype=torch.bool)
    replace[:, 2:4] = True
    k, v = torch.randn(2, 1, 2, 3), torch.randn(2, 1, 2, 3)
    pk, pv = patched(torch.zeros(2, 1, 6, 3), torch.zeros(2, 1, 6, 3), k, v, replace)
    assert torch.equal(pk[:, :, 2:4], k) and torch.equal(pv[:, :, 2:4], v)
    same, applied = gpu._patch_function(gpu.make_prompts, edits)  # nothing to patch: the function itself
    assert applied == [False, False] and same is gpu.make_prompts


def test_device_limits_by_name_and_by_flag():
    assert gpu.device_limits("NVIDIA H100 80GB HBM3")["hbm_tbps"] == 3.35
    assert gpu.device_limits("NVIDIA H200")["hbm_tbps"] == 4.8
    assert gpu.device_limits("gpu: NVIDIA H100 PCIe")["hbm_tbps"] == 2.0
    assert gpu.device_limits("NVIDIA H100 80GB HBM3", hbm_tbps=3.0)["hbm_tbps"] == 3.0
    assert gpu.device_limits("cpu")["hbm_tbps"] is None


def test_weight_read_limit_of_llada_8b():
    """15.0 GB of bf16 weights besides the embedding table: 4.5 ms a step at 3.35 TB/s."""
    s = gpu.SHAPES["llada-8b"]
    cfg = dict(d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"],
               head_dim=s["d_model"] // s["n_heads"], ffn_hidden=s["mlp_hidden_size"], vocab_size=s["vocab_size"])
    lim = gpu.case_limits({"b1_w32_p384_r32": 10}, cfg, itemsize=2, limits=gpu.device_limits("NVIDIA H100"))
    assert lim["weight_read_s"] == pytest.approx(15.0e9 / 3.35e12, rel=0.01)
    assert lim["weight_read_s"] < lim["roofline_s"] < 1.1 * lim["weight_read_s"]  # batch 1 reads weights
    assert lim["flop_s"] < 0.2 * lim["weight_read_s"]


def test_prompts_avoid_the_mask_and_eos_ids():
    p = gpu.make_prompts(4, 300, vocab_below=20, avoid=[7], seed=1)
    assert p == gpu.make_prompts(4, 300, vocab_below=20, avoid=[7], seed=1)
    flat = {t for row in p for t in row}
    assert len(p) == 4 and all(len(r) == 300 for r in p) and 7 not in flat and max(flat) < 20


def test_first_divergence_tells_a_near_tie_from_a_difference():
    margins = [[5.0, 5.0], [0.001, 4.0], [3.0, 3.0]]
    commit = {"0,0": 0, "0,1": 2, "1,0": 0, "1,1": 2}
    assert gpu.first_divergence([[1, 2], [3, 4]], [[1, 2], [3, 4]], margins=margins, commit_pass=commit) is None
    tie = gpu.first_divergence([[1, 2], [3, 4]], [[1, 9], [3, 4]], margins=margins, commit_pass=commit)
    assert tie == {"row": 0, "slot": 1, "pass": 2, "min_margin": 0.001}
    real = gpu.first_divergence([[1, 2], [3, 4]], [[1, 2], [3, 9]], margins=margins, commit_pass=commit)
    assert real["min_margin"] == 3.0  # row 1 never came close: a real difference


def fake_results() -> tuple[dict, dict, dict, dict]:
    spec = {"gen_len": 256, "dtype": "bfloat16", "tie_tol": 1.0,
            "cases": [{"batch": 1, "cache": "prefix"}, {"batch": 8, "cache": "dual"}]}
    tokens = [[5] * 256]
    fd = {"load_seconds": 10.0, "cases": {
        "prefix b1": {"nfe": 40, "forward_calls": 40, "idle_forwards": 0, "seconds": [1.0, 1.2, 1.1],
                      "first_seconds": 9.0, "tokens": tokens, "margins": [[9.0]] * 40, "commit_pass": {}},
        "dual b8": {"error": "RuntimeError: shape mismatch"}}}
    dj = {"load_seconds": 12.0, "config": {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32,
                                           "head_dim": 128, "ffn_hidden": 12288, "vocab_size": 126464},
          "cases": {"prefix b1": {"nfe": 40, "seconds": [0.2, 0.25, 0.2], "tokens": tokens, "first_seconds": 20.0,
                                  "median_step_seconds": 0.008, "buckets": {"b1_w256_p128_r32": 8,
                                                                            "b1_w32_p352_r32": 32}},
                    "dual b8": {"nfe": 50, "seconds": [1.0], "tokens": [[5] * 256] * 8, "first_seconds": 3.0}}}
    dj2 = {"cases": {"prefix b1": {"first_seconds": 2.0, "xla_cache_hits": 7}}}
    return spec, fd, dj, dj2


def test_targets_table_passes_fails_and_leaves_unmeasured_open():
    spec, fd, dj, dj2 = fake_results()
    rows = gpu.compare(spec, fd, dj, dj2, gpu.device_limits("NVIDIA H100 80GB HBM3"))
    assert rows[0]["ratio"] == pytest.approx(1.1 / 0.2) and rows[0]["agrees"] and rows[1]["ratio"] is None
    assert rows[0]["dlm_jax"]["tokens_per_s"] == pytest.approx(256 / 0.2)
    table = {t["target"]: t for t in gpu.targets(rows, {"fast_dllm": 10.0, "dlm_jax": 12.0})}
    assert table["Fast-dLLM s / dlm-jax s, prefix b1"]["pass"] is True
    assert table["Fast-dLLM s / dlm-jax s, dual b1"]["pass"] is None  # not run
    assert table["Fast-dLLM s / dlm-jax s, dual b8"]["pass"] is None  # Fast-dLLM failed
    assert table["dlm-jax median step / weight-read limit, prefix b1"]["pass"] is False  # 8 ms / 4.5 ms
    assert table["dlm-jax load s / Fast-dLLM load s"]["pass"] is True
    assert table["dlm-jax first decode s (cold cache, worst case)"]["pass"] is False  # 20 s
    assert table["dlm-jax first decode s, second process (worst case)"]["pass"] is True


def test_ratio_at_the_roofline_bounds_what_a_faster_step_can_reach():
    """A decode's roofline is the sum of its steps' rooflines (40 steps here); the ratio at the
    roofline is Fast-dLLM's time over it, and a ratio target above it is flagged in the report."""
    spec, fd, dj, dj2 = fake_results()
    limits = gpu.device_limits("NVIDIA H100 80GB HBM3")
    rows = gpu.compare(spec, fd, dj, dj2, limits)
    cfg = dj["config"]
    per_step = [max(f / (limits["peak_tflops"] * 1e12), b / (limits["hbm_tbps"] * 1e12))
                for f, b in (gpu.step_cost(k, cfg, 2) for k in ("b1_w256_p128_r32", "b1_w32_p352_r32"))]
    roof = 8 * per_step[0] + 32 * per_step[1]
    assert gpu.decode_roofline_s(rows[0]) == pytest.approx(roof)
    assert gpu.ratio_at_roofline(rows[0]) == pytest.approx(1.1 / roof)
    assert gpu.decode_roofline_s(rows[1]) is None  # no buckets recorded
    table = {t["target"]: t for t in gpu.targets(rows, {})}
    assert table["Fast-dLLM s / dlm-jax s, prefix b1"]["at_roofline"] == pytest.approx(1.1 / roof, abs=1e-3)
    assert "at_roofline" not in table["Fast-dLLM s / dlm-jax s, dual b8"]


def test_report_renders_with_cases_missing_and_failed(tmp_path):
    spec, fd, dj, dj2 = fake_results()
    rows = gpu.compare(spec, fd, dj, dj2, gpu.device_limits("NVIDIA H100 80GB HBM3"))
    load = {"fast_dllm": 10.0, "dlm_jax": 12.0}
    report = {"mode": "full", "settings": {"dtype": "bfloat16", "prompt_len": 128, "gen_len": 256, "block_len": 32,
                                           "threshold": 0.9, "reps": 3},
              "checkpoint": {"recipe": {"shape": "llada-8b"}, "params": 8_000_000_000},
              "device": {"jax": "gpu: NVIDIA H100 80GB HBM3", "torch": "NVIDIA H100 80GB HBM3"},
              "versions": {"jax": "0.10.2", "torch": "2.13.0", "transformers": "5.23.0"},
              "peer": {"commit": None, "sha256": {}, "shims": [{"name": "x", "target": "y", "why": "z", "applied": True}]},
              "load_seconds": load, "peak_memory_bytes": {"dlm_jax": 2**34, "fast_dllm": None}, "cases": rows,
              "targets": gpu.targets(rows, load), "notes": []}
    md = gpu.markdown(report)
    assert "| prefix b1 | 1.100 | 0.200 | 5.50 |" in md and "shape mismatch" in md and "not measured" in md
    gpu.plot(report, tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0


def test_peer_source_errors_name_the_flag(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="not a Fast-dLLM checkout"):
        gpu.peer_source(tmp_path)
    monkeypatch.setattr(gpu, "PEER_URL", str(tmp_path / "no-such-repo"))  # what no network looks like
    with pytest.raises(SystemExit, match="pass --peer-src PATH") as e:
        gpu.peer_source(None, cache=tmp_path / "peers")
    assert "\n" not in str(e.value.code)


def test_work_folder_reuses_a_result_only_for_the_same_spec(tmp_path, monkeypatch):
    """--work: a worker whose result is there for the very same spec is not run again (a run cut
    short goes on where it stopped); another spec runs it."""
    ran = []

    def fake_run(kind, spec_path, result, extra=(), kill_at=None):
        ran.append(kind)
        result.write_text(json.dumps({"kind": kind, "spec": json.loads(spec_path.read_text())["reps"]}))
        return json.loads(result.read_text())

    monkeypatch.setattr(gpu, "run_worker", fake_run)
    spec = {"reps": 1, "cases": []}
    assert gpu._worker(spec, tmp_path, "fast_dllm") == {"kind": "fast_dllm", "spec": 1}
    assert gpu._worker(spec, tmp_path, "fast_dllm") == {"kind": "fast_dllm", "spec": 1} and ran == ["fast_dllm"]
    assert gpu._done(spec, tmp_path, "fast_dllm") and not gpu._done(spec, tmp_path, "dlm_jax")
    assert gpu._worker({**spec, "reps": 2}, tmp_path, "fast_dllm") == {"kind": "fast_dllm", "spec": 2}
    assert ran == ["fast_dllm", "fast_dllm"]
    gpu.save_partial({"result": str(tmp_path / "x.json")}, {"cases": {"a": 1}})
    assert json.loads((tmp_path / "x.json.partial").read_text()) == {"cases": {"a": 1}}


# ---------------------------------------------------------------------------------------------
# Run records, one side alone, --merge, and the committed result


def fake_run(monkeypatch, argv: list[str], *, results=fake_results,
             specs: dict | None = None) -> tuple[dict, list[str]]:
    """`gpu.run` over the fake worker results above (no peer code, no model): a report as the
    script writes it, and the workers it asked for (their specs and deadlines into `specs`)."""
    _, fd, dj, dj2 = results()
    fd = {**fd, "device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "transformers": "5.23.0", "shims": [],
          "params": 8}
    dj = {**dj, "device": "gpu: NVIDIA H100 80GB HBM3", "jax": "0.10.2", "params": 8, "peak_memory_bytes": 2**34}
    calls: list[str] = []

    def worker(spec, work, kind, *, second=False, deadline=None):
        calls.append(kind + ("2" if second else ""))
        if specs is not None:
            specs[calls[-1]] = (spec, deadline)
        return {"fast_dllm": fd, "dlm_jax": dj2 if second else dj}[kind]

    monkeypatch.setattr(gpu, "peer_source", lambda given: (Path("/peer"), False))
    monkeypatch.setattr(gpu, "peer_identity", lambda src: {"src": str(src), "commit": "abc", "sha256": {}})
    monkeypatch.setattr(gpu, "checkpoint_state", lambda path, want: "reuse")
    monkeypatch.setattr(gpu, "_worker", worker)
    return gpu.run(gpu.parse_args(argv)), calls


def test_a_result_carries_its_run_record_and_one_side_runs_alone(monkeypatch):
    """Remarks typed into a result by hand, and a second run's numbers pasted beside the first,
    cannot be told from what the script measured: a result records its own run (date, machine,
    command, versions, `--note`s), and `--sides fast_dllm` is how Fast-dLLM alone is measured
    (its cases timed, not compared, so not counted as disagreeing answers)."""
    report, calls = fake_run(monkeypatch, ["--batches", "1", "--note", "one lease of 15 min"])
    run = report["run"]
    assert run["command"] == "benchmarks/gpu.py --batches 1 --note 'one lease of 15 min'"
    assert run["notes"] == ["one lease of 15 min"] and re.fullmatch(r"\d{4}-\d\d-\d\d", run["date"])
    assert run["versions"]["jax"] == "0.10.2" and run["versions"]["torch"] == "2.13.0" and run["machine"]
    assert calls == ["fast_dllm", "dlm_jax", "dlm_jax2"] and "one lease of 15 min" in gpu.markdown(report)
    alone, calls = fake_run(monkeypatch, ["--batches", "1", "8", "--sides", "fast_dllm"])
    assert calls == ["fast_dllm"]
    assert [r["agrees"] for r in alone["cases"]] == [None] * 4 and alone["correct"]
    assert alone["device"]["jax"] is None and alone["device"]["hbm_tbps"] == 3.35  # limits by Fast-dLLM's device
    md = gpu.markdown(alone)
    assert "| prefix b1 | 1.100 | - | - |" in md and "not compared" in md


def write_parts(tmp_path: Path, *reports: dict) -> list[str]:
    paths = []
    for i, rep in enumerate(reports):
        paths.append(str(tmp_path / f"part{i}.json"))
        Path(paths[-1]).write_text(json.dumps(rep) if not isinstance(rep, str) else rep)
    return paths


def test_merge_keeps_each_parts_run_record_and_names_where_each_case_came_from(tmp_path, monkeypatch):
    """Runs on several days merged by hand kept one run record for all (the batch-32 and
    --small runs had none): `--merge` keeps every part's, and names the part of each case."""
    main, _ = fake_run(monkeypatch, ["--batches", "1", "8", "--note", "first lease"])
    b32, _ = fake_run(monkeypatch, ["--batches", "32", "--sides", "fast_dllm", "--note", "second lease"])
    small, _ = fake_run(monkeypatch, ["--small", "--batches", "1", "2"])
    main["run"]["date"], b32["run"]["date"] = "2026-01-01", "2026-01-02"  # another day
    paths = write_parts(tmp_path, main, b32, small)
    assert gpu.main(["--merge", *paths, "--out", str(tmp_path / "gpu")]) == 0
    merged = json.loads((tmp_path / "gpu.json").read_text())
    assert [p["run"] for p in merged["parts"]] == [main["run"], b32["run"], small["run"]]
    assert [p["file"] for p in merged["parts"]] == paths
    assert [r["case"] for r in merged["cases"]] == ["prefix b1", "dual b1", "prefix b8", "dual b8", "prefix b32",
                                                    "dual b32"]
    assert merged["cases"][:4] == main["cases"] and merged["cases"][4:] == b32["cases"]
    assert merged["sources"]["cases"]["dual b32"] == paths[1] and merged["sources"]["cases"]["dual b8"] == paths[0]
    assert merged["sources"]["load_seconds"] == paths[0] and merged["load_seconds"] == main["load_seconds"]
    assert merged["settings"]["batches"] == [1, 8, 32] and merged["targets"] == main["targets"]
    assert merged["small"]["cases"] == small["cases"] and set(merged["sources"]["small"].values()) == {paths[2]}
    md = (tmp_path / "gpu.md").read_text()
    assert "first lease" in md and "second lease" in md and "2026-01-02" in md and "| dual b32 |" in md
    assert "Correctness half (`--small`" in md and (tmp_path / "gpu.png").stat().st_size > 0


@pytest.mark.parametrize("spoil,problem", [
    (lambda other, main: "{not json", "is not JSON"),
    (lambda other, main: [other], "is not a benchmarks/gpu.py result"),
    (lambda other, main: {**other, "benchmark": "benchmarks/peer.py"}, "is not a benchmarks/gpu.py result"),
    (lambda other, main: {k: v for k, v in other.items() if k != "run"}, "is not a benchmarks/gpu.py result (no run)"),
    (lambda other, main: {**other, "run": {k: v for k, v in other["run"].items() if k != "date"}},
     "has no run record (date missing)"),
    (lambda other, main: {**other, "parts": []}, "is itself a merged result"),
    (lambda other, main: {**other, "checkpoint": {**other["checkpoint"], "recipe": {
        **other["checkpoint"]["recipe"], "logit_std": 5.0}}}, "another checkpoint recipe"),
    (lambda other, main: {**other, "settings": {**other["settings"], "gen_len": 128}}, "has gen_len 128"),
])
def test_merge_refuses_parts_that_cannot_share_a_table(tmp_path, monkeypatch, spoil, problem):
    """A merge that took any JSON, or parts that decode another checkpoint or setting, would
    put numbers of different benchmarks in one table without a word."""
    main, _ = fake_run(monkeypatch, ["--batches", "1"])
    other, _ = fake_run(monkeypatch, ["--batches", "8"])
    paths = write_parts(tmp_path, main, spoil(other, main))
    with pytest.raises(SystemExit) as e:
        gpu.main(["--merge", *paths, "--out", str(tmp_path / "gpu")])
    msg = str(e.value.code)
    assert msg.startswith("error: --merge") and "\n" not in msg and problem in msg, msg
    assert not (tmp_path / "gpu.json").exists()


def test_merge_takes_each_side_of_a_case_from_the_first_part_that_measured_it(tmp_path, monkeypatch):
    """A lease whose budget skipped dlm-jax's cases, then a `--sides dlm_jax` run for them: one
    row per case, Fast-dLLM's time from the first and dlm-jax's from the second, the ratio of the
    two, and no answers compared (each run kept its own tokens). A side measured again in a later
    part stays out of the table and is listed, never silently dropped or averaged in."""
    fd_only, _ = fake_run(monkeypatch, ["--batches", "1", "--sides", "fast_dllm"])
    dj_only, _ = fake_run(monkeypatch, ["--batches", "1", "--sides", "dlm_jax"])
    both, _ = fake_run(monkeypatch, ["--batches", "1"])
    dj_only["cases"][0]["dlm_jax"]["seconds"] = 0.123  # told apart from both's dlm-jax time
    paths = write_parts(tmp_path, fd_only, dj_only, both)
    assert gpu.main(["--merge", *paths, "--out", str(tmp_path / "gpu")]) == 0
    merged = json.loads((tmp_path / "gpu.json").read_text())
    timed = [(row, fd, dj) for row, fd, dj in zip(merged["cases"], fd_only["cases"], dj_only["cases"], strict=True)
             if fd["fast_dllm"]["seconds"] and dj["dlm_jax"]["seconds"]]
    assert timed and merged["cases"][0]["case"] == fd_only["cases"][0]["case"]
    for row, fd, dj in timed:
        assert row["fast_dllm"] == fd["fast_dllm"] and row["dlm_jax"] == dj["dlm_jax"]
        assert row["ratio"] == pytest.approx(fd["fast_dllm"]["seconds"] / dj["dlm_jax"]["seconds"])
        assert row["agrees"] is None and row["same_tokens"] is None and row["limits"] == dj["limits"]
        assert merged["sources"]["cases"][row["case"]] == {"fast_dllm": paths[0], "dlm_jax": paths[1]}
    assert merged["cases"][0]["ratio"] == pytest.approx(fd_only["cases"][0]["fast_dllm"]["seconds"] / 0.123)
    again = {(s["case"], s["side"], s["part"], s["kept"]) for s in merged["superseded"]}
    assert again == {(r["case"], side, paths[2], paths[i]) for r in both["cases"]
                     for i, side in enumerate(gpu.SIDES) if r[side]["seconds"] is not None}
    md = (tmp_path / "gpu.md").read_text()
    assert "sides come from two parts" in md and f"prefix b1 dlm_jax {both['cases'][0]['dlm_jax']['seconds']:.3f}" in md
    # The part that measured both sides first keeps its compared rows whole.
    paths = write_parts(tmp_path, both, dj_only)
    assert gpu.main(["--merge", *paths, "--out", str(tmp_path / "gpu")]) == 0
    merged = json.loads((tmp_path / "gpu.json").read_text())
    assert merged["cases"] == both["cases"] and set(merged["sources"]["cases"].values()) == {paths[0]}
    assert [(s["side"], s["seconds"]) for s in merged["superseded"]][0] == ("dlm_jax", 0.123)


def test_committed_result_holds_only_fields_the_script_writes(monkeypatch):
    """benchmarks/results/gpu.json held fields typed in by hand (`run`, `fast_dllm_batch32`,
    `small_on_gpu`): numbers no run of the script wrote or can check. Every top-level field must
    be one that a run or a --merge of this script writes (the set taken from the script)."""
    full, _ = fake_run(monkeypatch, ["--batches", "1"])
    small, _ = fake_run(monkeypatch, ["--small", "--batches", "1"])
    writable = set(full) | set(gpu.merge([("full.json", full), ("again.json", full), ("small.json", small)]))
    stray = set(json.loads(RESULT.read_text())) - writable
    assert not stray, f"{RESULT.name} holds fields benchmarks/gpu.py does not write: {sorted(stray)}"


def test_committed_result_is_the_merge_of_its_committed_parts(tmp_path):
    """A value edited by hand in gpu.json (or .md), or a part changed without merging again,
    shows here: the committed result is what --merge makes of the committed parts, byte for byte,
    and every committed part is in it."""
    committed = json.loads(RESULT.read_text())
    assert "parts" in committed, f"{RESULT.name} is not a benchmarks/gpu.py --merge result"
    files = [p["file"] for p in committed["parts"]]
    assert sorted(files) == sorted(p.relative_to(ROOT).as_posix()
                                   for p in (RESULT.parent / "gpu_parts").glob("*.json"))
    assert gpu.main(["--merge", *(str(ROOT / f) for f in files), "--out", str(tmp_path / "gpu")]) == 0
    assert (tmp_path / "gpu.json").read_text() == RESULT.read_text()
    assert (tmp_path / "gpu.md").read_text() == RESULT.with_suffix(".md").read_text()


# ---------------------------------------------------------------------------------------------
# --quant, --attention and --budget-s


def test_quant_attention_and_budget_arguments():
    args = gpu.parse_args(["--quant", "int8", "none", "int8", "--attention", "split", "--budget-s", "500"])
    assert args.quant == ["none", "int8"] and args.attention == "split"  # each mode once, unquantized first
    assert args.budget_s == 500 and 495 < args.deadline - gpu.time.time() <= 500
    default = gpu.parse_args(["--small"])
    assert (default.quant, default.attention, default.budget_s, default.deadline) == (["none"], None, None, None)
    assert [gpu.case_name(8, "prefix", q) for q in gpu.QUANTS] == ["prefix b8", "prefix b8 int8", "prefix b8 int8-g128",
                                                                         "prefix b8 fp8", "prefix b8 int4-g128"]
    assert gpu.row_quant({"case": "dual b1"}) == "none"  # a row written before --quant
    assert gpu.worker_quants({"quants": ["int8", "none", "fp8"]}, second=False) == ["none", "int8", "fp8"]
    assert gpu.worker_quants({"quants": ["int8", "none"]}, second=True) == ["none"]  # the second process: one
    assert gpu.worker_quants({"quants": ["fp8", "int8"]}, second=True) == ["int8"]
    assert gpu.worker_quants({}, second=False) == ["none"]


def quant_results() -> tuple[dict, dict, dict, dict]:
    """`fake_results` with dlm-jax's int8 cases: prefix b1 int8 gives the unquantized answers at
    5 ms a step (unquantized 8 ms); dual b8 int8 changes 2 of its 8 answers by one token."""
    spec, fd, dj, dj2 = fake_results()
    spec = {**spec, "quants": ["none", "int8"]}
    dj["cases"]["prefix b1 int8"] = {"nfe": 40, "seconds": [0.125, 0.13, 0.125], "tokens": [[5] * 256],
                                     "first_seconds": 30.0, "median_step_seconds": 0.005,
                                     "buckets": {"b1_w256_p128_r32": 8, "b1_w32_p352_r32": 32}}
    dj["cases"]["dual b8 int8"] = {"nfe": 50, "seconds": [0.5], "tokens": [[5] * 256] * 6 + [[6] + [5] * 255] * 2,
                                   "first_seconds": 3.0}
    return spec, fd, dj, dj2


def test_an_int8_case_is_timed_against_fast_dllms_case_and_compared_with_its_own_unquantized_answers(tmp_path):
    """An int8 case compared with nothing, or counted as a wrong answer against Fast-dLLM's
    bf16 one, or its time put in the unquantized targets, would say nothing about what
    quantization costs: it is timed against Fast-dLLM's case of its batch and cache, its answers
    also compared with dlm-jax's unquantized ones, and its step ratio is the int8 target."""
    spec, fd, dj, dj2 = quant_results()
    rows = gpu.compare(spec, fd, dj, dj2, gpu.device_limits("NVIDIA H100 80GB HBM3"))
    assert [r["case"] for r in rows] == ["prefix b1", "prefix b1 int8", "dual b8", "dual b8 int8"]
    bf16, int8, _, int8_b8 = rows
    assert int8["quant"] == "int8" and int8["ratio"] == pytest.approx(1.1 / 0.125)
    assert bf16["ratio"] == pytest.approx(5.5)
    assert int8["agrees"] is None and bf16["agrees"] is True and int8["token_agreement"] == 1.0
    assert int8["vs_unquantized"] == {"same_answers": 1.0, "token_agreement": 1.0, "step_ratio": pytest.approx(0.625)}
    # 1 byte a weight: half the unquantized weight read.
    assert int8["limits"]["weight_read_s"] == pytest.approx(bf16["limits"]["weight_read_s"] / 2, rel=1e-3)
    assert int8_b8["ratio"] is None and int8_b8["agrees"] is None  # Fast-dLLM failed its dual b8
    assert int8_b8["vs_unquantized"]["same_answers"] == 6 / 8
    assert int8_b8["vs_unquantized"]["token_agreement"] == pytest.approx(1 - 2 / (8 * 256))
    table = {t["target"]: t for t in gpu.targets(rows, {"fast_dllm": 10.0, "dlm_jax": 12.0})}
    int8_target = table["dlm-jax int8 median step / unquantized median step, prefix b1"]
    assert (int8_target["value"], int8_target["limit"], int8_target["pass"]) == (0.625, 0.6, False)
    assert not any("dual b1" in t and "int8" in t for t in table)  # no int8 dual b1 case: no target
    assert table["Fast-dLLM s / dlm-jax s, prefix b1"]["value"] == 5.5  # the unquantized case's
    assert table["dlm-jax first decode s (cold cache, worst case)"]["value"] == 20.0  # not the int8 case's 30 s
    report = {"mode": "full", "settings": {"dtype": "bfloat16", "prompt_len": 128, "gen_len": 256, "block_len": 32,
                                           "threshold": 0.9, "reps": 3, "quants": ["none", "int8"],
                                           "attention": "split"},
              "checkpoint": {"recipe": {"shape": "llada-8b"}, "params": 8_000_000_000},
              "device": {"jax": "gpu: NVIDIA H100 80GB HBM3", "torch": "NVIDIA H100 80GB HBM3"},
              "versions": {"jax": "0.10.2", "torch": "2.13.0", "transformers": "5.23.0"},
              "peer": {"commit": None, "sha256": {}, "shims": []}, "load_seconds": {"fast_dllm": 10.0, "dlm_jax": 12.0},
              "peak_memory_bytes": {"dlm_jax": None, "fast_dllm": None}, "cases": rows,
              "targets": list(table.values()), "notes": []}
    md = gpu.markdown(report)
    assert "| prefix b1 int8 | 1.100 | 0.125 | 8.80 |" in md and "75% of answers = dlm-jax unquantized" in md
    assert "dlm-jax attention: split." in md
    assert "| dlm-jax int8 median step / unquantized median step, prefix b1 |" in md
    gpu.plot(report, tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0


def test_quant_and_attention_reach_the_dlm_jax_worker_only(monkeypatch):
    """Fast-dLLM measured again (or not at all) because of a dlm-jax option would waste a
    lease: its worker's spec holds no quant modes or attention, dlm-jax's holds both, and every
    worker gets the --budget-s deadline."""
    specs: dict = {}
    report, calls = fake_run(monkeypatch, ["--batches", "1", "--quant", "none", "int8", "--attention", "split",
                                           "--budget-s", "300"], results=quant_results, specs=specs)
    assert calls == ["fast_dllm", "dlm_jax", "dlm_jax2"]
    fd_spec, deadline = specs["fast_dllm"]
    assert "quants" not in fd_spec and "attention" not in fd_spec and 295 < deadline - gpu.time.time() <= 300
    assert specs["dlm_jax"][0]["quants"] == ["none", "int8"] and specs["dlm_jax"][0]["attention"] == "split"
    assert specs["dlm_jax2"][1] == deadline
    assert report["settings"]["quants"] == ["none", "int8"] and report["settings"]["attention"] == "split"
    assert report["settings"]["budget_s"] == 300
    assert [r["case"] for r in report["cases"]] == ["prefix b1", "prefix b1 int8", "dual b1", "dual b1 int8"]


def test_a_spent_budget_skips_the_remaining_cases_and_the_report_still_writes(tmp_path):
    """A run killed at the end of its lease writes nothing: with --budget-s the workers record
    what the budget left as skipped (not as failed or disagreeing), and a result holding a
    skipped case is measured again under --work rather than reused."""
    spec = {"cases": [{"batch": 1, "cache": "prefix"}, {"batch": 8, "cache": "dual"}], "quants": ["none", "int8"],
            "checkpoint": str(tmp_path / "absent"), "gen_len": 256, "dtype": "bfloat16", "tie_tol": 1.0}
    fd = gpu.fast_dllm_worker(spec, deadline=0.0)  # spent: nothing imports or loads (no checkpoint here)
    dj = gpu.dlm_jax_worker(spec, second=False, deadline=0.0)
    assert fd["skipped"] == ["prefix b1", "dual b8"]
    assert dj["skipped"] == ["prefix b1", "dual b8", "prefix b1 int8", "dual b8 int8"]
    rows = gpu.compare(spec, fd, dj, None, gpu.device_limits("NVIDIA H100"))
    assert [r["agrees"] for r in rows] == [None] * 4 and all(r["ratio"] is None for r in rows)
    report = {"mode": "full", "settings": {"dtype": "bfloat16", "prompt_len": 128, "gen_len": 256, "block_len": 32,
                                           "threshold": 0.9, "reps": 3, "budget_s": 60},
              "checkpoint": {"recipe": {"shape": "llada-8b"}, "params": 8_000_000_000},
              "device": {"jax": None, "torch": None}, "versions": {"jax": None, "torch": None, "transformers": None},
              "peer": {"commit": "abc", "sha256": {}, "shims": []},
              "load_seconds": {"fast_dllm": None, "dlm_jax": None},
              "peak_memory_bytes": {"dlm_jax": None, "fast_dllm": None}, "cases": rows,
              "targets": gpu.targets(rows, {}), "notes": []}
    md = gpu.markdown(report)
    assert "| dual b8 int8 |" in md and "fast_dllm: skipped: time budget; dlm_jax: skipped: time budget" in md
    text, spec_path, result = gpu._worker_spec(spec, tmp_path, "dlm_jax", False)
    spec_path.write_text(text)
    result.write_text(json.dumps(dj))
    assert not gpu._done(spec, tmp_path, "dlm_jax")
    result.write_text(json.dumps({**dj, "skipped": []}))
    assert gpu._done(spec, tmp_path, "dlm_jax")


@pytest.mark.parametrize("how", ["crash", pytest.param("overrun", marks=pytest.mark.slow)])  # (overrun: 3 s)
def test_a_worker_that_crashes_or_overruns_stands_as_its_saved_cases(how, tmp_path):
    """A measuring worker that died (an out-of-memory at batch 32) or was still in a case long
    past its deadline (a cold compile) used to end the whole run with no report: `gpu_lease.sh`'s
    hard time limit then killed everything, and the cases measured before were lost. Now the
    worker is stopped at `kill_at`, and it stands as what it saved after its last case, with why
    it ended; the checkpoint writer's failure still ends the run."""
    result = tmp_path / "dlm_jax.json"
    saved = {**gpu.EMPTY_RESULT["dlm_jax"], "device": "gpu: X", "cases": {"dual b1": {"seconds": [0.4]}}}
    script = (f"import json, sys, time; open({str(result) + '.partial'!r}, 'w').write({json.dumps(saved)!r}); "
              + ("sys.exit(3)" if how == "crash" else "time.sleep(60)"))
    t0 = time.time()
    out = gpu.run_worker("dlm_jax", tmp_path / "spec.json", result, kill_at=t0 + 3,
                         argv=[sys.executable, "-c", script])
    assert time.time() - t0 < 20  # stopped near kill_at (a terminate, then a kill 5 s on), not after 60 s
    assert out["cases"] == saved["cases"] and out["device"] == "gpu: X"
    assert out["ended"] == ("exit status 3" if how == "crash" else "stopped 30 s past its time budget")
    nothing = gpu.run_worker("fast_dllm", tmp_path / "spec.json", tmp_path / "fd.json", argv=[sys.executable, "-c",
                                                                                           "import sys; sys.exit(1)"])
    assert nothing == {**gpu.EMPTY_RESULT["fast_dllm"], "ended": "exit status 1"}
    with pytest.raises(SystemExit, match="the write process failed"):
        gpu.run_worker("write", tmp_path / "spec.json", tmp_path / "w.json", argv=[sys.executable, "-c",
                                                                                  "import sys; sys.exit(2)"])


# ---------------------------------------------------------------------------------------------
# --profile, the per-side budgets and the full mode at the tiny shape (benchmarks/gpu_lease.sh)


def test_profile_decode_is_per_step_and_a_failing_profile_is_recorded_not_raised():
    """A kernel table of a whole decode read as one step's overstates every kernel NFE times,
    and a profiler that fails on the lease's machine (no CUPTI, an unreadable trace) must not
    cost the run: the profile divides by the decode's NFE and records its error."""
    import types

    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    a = jnp.ones((64, 64))
    f(a).block_until_ready()

    def decode():
        for _ in range(3):  # a "decode" of 3 steps, one program call each
            f(a).block_until_ready()
        return types.SimpleNamespace(stats=types.SimpleNamespace(to_dict=lambda: {"nfe": 3}))

    prof = gpu.profile_decode(decode)
    assert prof["nfe"] == 3 and prof["source"] == "host CPU ops" and prof["top"], prof  # (conftest pins the CPU)
    assert prof["top"][0]["calls_per_step"] == pytest.approx(1.0)  # 3 calls over NFE 3
    assert sum(k["share"] for k in prof["top"]) == pytest.approx(1.0)  # every op of this program is in the top 10
    assert prof["kernel_ms_per_step"] == pytest.approx(sum(k["ms_per_step"] for k in prof["top"]))

    def broken():
        raise RuntimeError("CUPTI not found\nsecond line")

    assert gpu.profile_decode(broken) == {"error": "RuntimeError: CUPTI not found"}


FAKE_PROFILE = {"kernel_ms_per_step": 7.5, "source": "device", "nfe": 40, "seconds": 0.3,
                "top": [{"kernel": "gemm_fusion_dot.12", "ms_per_step": 5.0, "calls_per_step": 64.0, "share": 2 / 3},
                        {"kernel": "loop_reduce_fusion", "ms_per_step": 2.5, "calls_per_step": 32.0, "share": 1 / 3}]}


def profiled_results() -> tuple[dict, dict, dict, dict]:
    spec, fd, dj, dj2 = fake_results()
    dj["cases"]["prefix b1"].update(profile=FAKE_PROFILE, mean_step_seconds=0.0095, median_host_seconds=0.0004)
    dj["cases"]["dual b8"]["profile"] = {"error": "RuntimeError: CUPTI not found"}
    return spec, fd, dj, dj2


def test_profiled_cases_get_a_kernel_table_each_and_merge_beside_parts_without(tmp_path, monkeypatch):
    """A profile measured but lost on the way to the report (the row copy, the merge) would
    leave the issue's kernel tables unanswered with no error: each profiled case keeps its
    profile in the JSON and gets a table in the report, a failed one says so, and a part
    written without --profile merges beside it."""
    report, _ = fake_run(monkeypatch, ["--batches", "1", "8", "--profile"], results=profiled_results)
    assert report["settings"]["profile"] is True
    rows = {r["case"]: r for r in report["cases"]}
    assert rows["prefix b1"]["dlm_jax"]["profile"] == FAKE_PROFILE
    md = gpu.markdown(report)
    # the step's time outside its kernels beside them (9.5 ms - 7.5 ms)
    assert ("Kernels of dlm-jax's decode, prefix b1 (device, 7.50 ms of kernels per step over NFE 40; the timed "
            "decodes' mean step 9.50 ms, 2.00 ms of it outside the kernels, and 0.40 ms of host decisions between "
            "steps (median)):") in md
    assert "| `gemm_fusion_dot.12` | 5.000 | 64.0 | 66.7% |" in md and "| `loop_reduce_fusion` | 2.500 | 32.0 | 33.3% |" in md
    assert "Kernels of dlm-jax's decode, dual b8: profile failed (RuntimeError: CUPTI not found)." in md
    assert md.count("Kernels of dlm-jax's decode") == 2
    old, _ = fake_run(monkeypatch, ["--batches", "32", "--sides", "fast_dllm"])  # no profile anywhere
    assert "profile" not in old["cases"][0]["dlm_jax"]
    paths = write_parts(tmp_path, report, old)
    assert gpu.main(["--merge", *paths, "--out", str(tmp_path / "gpu")]) == 0
    merged = json.loads((tmp_path / "gpu.json").read_text())
    assert {r["case"]: r for r in merged["cases"]}["prefix b1"]["dlm_jax"]["profile"] == FAKE_PROFILE
    assert (tmp_path / "gpu.md").read_text().count("Kernels of dlm-jax's decode") == 2


def test_peer_and_second_budgets_leave_dlm_jax_its_share(monkeypatch):
    """One --budget-s over both sides lets Fast-dLLM (which runs first, its 73 s load included)
    spend the lease, and dlm-jax's first process the second one's share: --peer-budget-s caps
    Fast-dLLM from its start, --second-budget-s ends dlm-jax's first process sooner."""
    specs: dict = {}
    t0 = __import__("time").time()
    report, calls = fake_run(monkeypatch, ["--batches", "1", "--budget-s", "300", "--peer-budget-s", "100",
                                           "--second-budget-s", "40", "--profile"], specs=specs)
    assert calls == ["fast_dllm", "dlm_jax", "dlm_jax2"]
    fd_deadline, dj_deadline, dj2_deadline = (specs[k][1] for k in calls)
    assert fd_deadline == pytest.approx(t0 + 100, abs=5) and dj2_deadline == pytest.approx(t0 + 300, abs=5)
    assert dj_deadline == pytest.approx(dj2_deadline - 40)
    assert "profile" not in specs["fast_dllm"][0] and specs["dlm_jax"][0]["profile"] is True  # Fast-dLLM's spec
    assert specs["dlm_jax"][0]["require_gpu"] is True  # the 8B shape needs a GPU
    assert (report["settings"]["peer_budget_s"], report["settings"]["second_budget_s"]) == (100, 40)
    specs.clear()
    fake_run(monkeypatch, ["--batches", "1", "--peer-budget-s", "500", "--budget-s", "60"], specs=specs)
    assert specs["fast_dllm"][1] == pytest.approx(specs["dlm_jax2"][1])  # the whole run's budget ends first
    specs.clear()
    fake_run(monkeypatch, ["--batches", "1", "--shape", "small", "--dtype", "float32"], specs=specs)
    assert specs["dlm_jax"][0]["require_gpu"] is False and specs["dlm_jax"][0]["recipe"]["shape"] == "small"
    assert all(d is None for _, d in specs.values())


def strip_quant(report: dict) -> dict:
    """A result as the script wrote it before --quant: no quant modes in its settings or rows."""
    return {**report, "settings": {k: v for k, v in report["settings"].items() if k not in ("quants", "attention",
                                                                                          "budget_s")},
            "cases": [{k: v for k, v in r.items() if k != "quant"} for r in report["cases"]]}


def test_merge_takes_parts_without_quant_cases_as_unquantized(tmp_path, monkeypatch):
    """Parts written before --quant must still merge (the committed gpu_parts are such), their
    rows as unquantized cases beside a new part's int8 ones, in batch, cache, quant order."""
    old, _ = fake_run(monkeypatch, ["--batches", "8"])
    new, _ = fake_run(monkeypatch, ["--batches", "1", "--quant", "none", "int8"], results=quant_results)
    paths = write_parts(tmp_path, strip_quant(old), new)
    assert gpu.main(["--merge", *paths, "--out", str(tmp_path / "gpu")]) == 0
    merged = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["case"] for r in merged["cases"]] == ["prefix b1", "prefix b1 int8", "dual b1", "dual b1 int8",
                                                    "prefix b8", "dual b8"]
    assert merged["settings"]["quants"] == ["none", "int8"] and merged["settings"]["batches"] == [1, 8]
    assert "settings.quants" in merged["sources"] and merged["sources"]["cases"]["dual b8"] == paths[0]
    assert merged["targets"] == gpu.targets(merged["cases"], merged["load_seconds"])
    assert any(t["target"].startswith("dlm-jax int8") and t["value"] == 0.625 for t in merged["targets"])
    assert "| prefix b1 int8 |" in (tmp_path / "gpu.md").read_text()
    alone, _ = fake_run(monkeypatch, ["--batches", "1"])
    assert gpu.merge([("a.json", strip_quant(alone))])["settings"] == strip_quant(alone)["settings"]  # as before


@pytest.mark.slow
def test_dlm_jax_worker_loads_each_quant_mode_and_names_its_cases(tmp_path):
    """The dlm-jax worker on the shipped llada-tiny, unquantized and int8, in a process of its
    own as the script runs it (about 5 s): one load per mode (int8 weights held in fewer bytes), the int8
    case named as such, the attention asked for recorded, and --budget-s's deadline honoured."""
    spec = {"checkpoint": str(ROOT / "models" / "llada-tiny"), "dtype": "float32", "require_gpu": False,
            "prompt_len": 8, "gen_len": 32, "block_len": 32, "threshold": 0.9, "reps": 1, "tie_tol": 0.01,
            "xla_cache": str(tmp_path / "xla"), "cases": [{"batch": 1, "cache": "prefix"}],
            "quants": ["none", "int8"], "attention": "gather", "prompts": [[11, 12, 13, 14, 15, 16, 17, 18]]}
    out = gpu._worker(spec, tmp_path, "dlm_jax")
    assert set(out["cases"]) == {"prefix b1", "prefix b1 int8"} and not out.get("skipped")
    assert out["attention"] == "gather" and set(out["load_seconds_by_quant"]) == {"none", "int8"}
    assert out["weight_bytes"]["int8"] < 0.5 * out["weight_bytes"]["none"]  # float32 to int8, but for the embedding
    for case in out["cases"].values():
        assert len(case["tokens"][0]) == 32 and len(case["seconds"]) == 1 and case["nfe"] >= 1
    rows = gpu.compare(spec, {"cases": {}}, out, None, gpu.device_limits("cpu"))
    assert rows[1]["vs_unquantized"]["same_answers"] in (0.0, 1.0)
    late = gpu._worker({**spec, "reps": 2}, tmp_path, "dlm_jax", deadline=gpu.time.time() - 1)
    assert late["skipped"] == ["prefix b1", "prefix b1 int8"]


# ---------------------------------------------------------------------------------------------
# The correctness half, with Fast-dLLM's sources


def test_the_peer_model_built_on_a_chosen_device_is_the_one_their_class_builds():
    """`build_peer_model(device=...)` (the 8B checkpoint initialized on the GPU: minutes on a
    CPU) must be Fast-dLLM's own model and initialization, not a look-alike: built on the CPU by
    that path, it holds the same parameters, bit for bit, as `LLaDAModelLM(config,
    init_params=True)` from the same seed. And the recipe names the device only when it is not
    the CPU (the recipes written before the option read as the CPU's)."""
    if PEER_ENV not in os.environ:
        pytest.skip(f"{PEER_ENV} is not set: point it at a checkout of NVlabs/Fast-dLLM")
    import torch

    peer = gpu.load_peer(Path(os.environ[PEER_ENV]), device="cpu")
    config = peer.config_class(**gpu.LLADA_KEYS, **gpu.SHAPES["small"])
    models = []
    for device in (None, "cpu"):
        torch.manual_seed(3)
        models.append(gpu.build_peer_model(peer, config, device))
    a, b = (dict(m.named_parameters()) for m in models)
    assert a.keys() == b.keys() and len(a) > 4
    assert all(torch.equal(a[k], b[k]) for k in a)
    args = gpu.parse_args(["--shape", "small"])
    assert args.init_device == "cpu" and "init_device" not in gpu.recipe(args)
    args = gpu.parse_args([])
    assert args.init_device == "cuda" and gpu.recipe(args)["init_device"] == "cuda"


def run_small(tmp_path: Path, env: dict[str, str]) -> dict:
    src = os.environ[PEER_ENV]
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--small", "--peer-src", src,
                           "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["correct"] and len(report["cases"]) == 4
    for case in report["cases"]:
        assert case["agrees"], case["case"]
        assert case["fast_dllm"]["nfe"] < report["settings"]["gen_len"] / 2  # the peaked head commits several a step
    patches = {s["name"]: s for s in report["peer"]["shims"]}
    assert patches["per-row replace_position (key)"]["applied"]  # batch 2's dual cache needed it
    assert out.with_suffix(".png").stat().st_size > 0 and "| dual b2 |" in out.with_suffix(".md").read_text()
    return report


@pytest.mark.skipif(PEER_ENV not in os.environ, reason=f"{PEER_ENV} is not set: the correctness half needs a "
                    "checkout of NVlabs/Fast-dLLM, and CI has no network and no copy")
def test_small_answers_equal_fast_dllm_on_cpu(tmp_path):
    run_small(tmp_path, dict(os.environ))


@pytest.mark.device
def test_small_answers_equal_fast_dllm_on_gpu(tmp_path):
    if PEER_ENV not in os.environ:
        pytest.skip(f"{PEER_ENV} is not set: point it at a checkout of NVlabs/Fast-dLLM")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # conftest pins the CPU
    report = run_small(tmp_path, env)
    assert report["device"]["jax"].startswith("gpu") and report["device"]["torch"] != "cpu", report["device"]

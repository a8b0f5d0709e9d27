"""`benchmarks/lladacpp.py` runs end to end on a small case and prices decodes with the phone
cost model as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lladacpp  # noqa: E402


def test_simulated_latency_prices_each_forward_by_its_bucket():
    stats = {"buckets": {"b1_w64_p0_r32": 1, "b1_w32_p64_r8": 2}, "counters": {}}
    sim = lladacpp.simulated_ms("+ MBSD", stats)
    npu = lladacpp.NPU.step_ms(64) + 2 * lladacpp.NPU.step_ms(32)
    assert sim["phone_ms"] == pytest.approx(npu)
    base = lladacpp.simulated_ms("CPU vanilla", stats)  # the baselines run on the phone's CPU
    assert base["phone_ms"] == pytest.approx(lladacpp.CPU.step_ms(64) + 2 * lladacpp.CPU.step_ms(32))
    # A refresh of 8 rows on the CPU outlasts the NPU step it runs beside by the difference.
    stats["counters"] = {"refresh_steps": 2, "refresh_rows": 16}
    extra = 2 * (lladacpp.CPU_ROWS.step_ms(8) - lladacpp.NPU.step_ms(32))
    assert lladacpp.simulated_ms("+ sparse CPU refresh", stats)["phone_ms"] == pytest.approx(npu + extra)


@pytest.mark.slow  # a minute of cold compiles of llada-cpp's buckets
def test_the_benchmark_runs_its_passes_apart_and_combines_them(tmp_path):
    def bench(*args):
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lladacpp.py"), *args], check=True, cwd=ROOT,
                       capture_output=True)

    common = ["--model", str(ROOT / "models" / "llada-tiny"), "--gens", "32", "--n", "2", "--tasks", "addition",
              "--cases", "1", "--repeats", "1", "--executors", "jax", "--sweep-gen", "0"]
    bench(*common, "--passes", "accuracy", "--out", str(tmp_path / "acc"))
    bench(*common, "--passes", "latency", "--out", str(tmp_path / "lat"))
    out = tmp_path / "lc"
    bench("--combine", str(tmp_path / "acc.json"), str(tmp_path / "lat.json"), "--out", str(out))
    doc = json.loads(out.with_suffix(".json").read_text())
    rows = doc["results"][0]["gens"]["32"]
    assert list(rows)[:6] == list(lladacpp.breakdown(32, "in_place"))
    assert rows["CPU vanilla"]["mean_nfe"] == 32  # one token per step
    assert rows["+ sparse CPU refresh"]["mean_nfe"] < 32 and rows["+ sparse CPU refresh"]["phone_ms"] > 0
    assert doc["targets"][0]["gen_len"] == 32
    assert out.with_suffix(".png").stat().st_size > 0 and "CPU vanilla" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_calibration_tells_right_from_replaced_tokens():
    import dlm_jax

    handle = dlm_jax.load(ROOT / "models" / "llada-tiny", executor="jax")
    cal = lladacpp.calibration(handle, ["addition"], 4)
    for kind in ("in_place", "remask"):
        assert cal["random"][kind]["auroc"] > 0.9  # random bytes are easy to spot
        assert cal["random"][kind]["right"] > 0 and cal["own"][kind]["right"] > 0


def test_a_later_pass_replaces_a_settings_counters_whole():
    old = {"acc": {"accuracy": 0.5, "counters": {"a": 1, "b": 2}, "per_task": {"x": 0.5}}, "lat": {"jax_s": 1.0}}
    new = {"acc": {"accuracy": 0.7, "counters": {"a": 3}, "per_task": {"x": 0.7}}}
    merged = lladacpp.merge({"gens": old}, {"gens": new})["gens"]
    assert merged["acc"] == {"accuracy": 0.7, "counters": {"a": 3}, "per_task": {"x": 0.7}}
    assert merged["lat"] == {"jax_s": 1.0}

"""The quantization report end to end on one shipped model with a handful of prompts: a
fake-quantized model that silently kept its float weights would report fp32 numbers as Q4_0."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("quant_report", ROOT / "benchmarks" / "quant_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_linear_weight_selection_and_quantized_params_change():
    script = _load_script()
    params = {"embed.embedding": np.ones((10, 4)), "final_norm.scale": np.ones(4),
              "layers.0.attn.q_proj.kernel": np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32),
              "lm_head.kernel": np.random.default_rng(1).standard_normal((32, 10)).astype(np.float32)}
    assert script.linear_weight_names(params) == ["layers.0.attn.q_proj.kernel", "lm_head.kernel"]
    out, err = script.quantize_params(params, "q4_0")
    assert out["embed.embedding"] is params["embed.embedding"]
    assert out["lm_head.kernel"].shape == (32, 10)
    assert not np.array_equal(out["lm_head.kernel"], params["lm_head.kernel"])
    assert 0 < err["mean_rel_fro"] <= err["worst_rel_fro"] < 0.3
    assert err["bits_per_weight"] == pytest.approx(4.5)


@pytest.mark.slow  # a benchmark smoke run (decodes the task suite twice)
def test_report_runs_on_one_model_and_writes_json_and_markdown(tmp_path):
    script = _load_script()
    out = tmp_path / "quant"
    report = script.main(["--n", "2", "--models", "models/llada-tiny", "--tasks", "addition",
                          "--schemes", "q4_0", "--out", str(out)])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["n_per_task"] == 2 and saved["schemes"] == ["q4_0"]
    model = saved["models"]["models/llada-tiny"]
    assert [r["scheme"] for r in model["rows"]] == ["fp32", "q4_0"]
    assert "embed.embedding" in model["kept_float"] and "lm_head.kernel" in model["linear_weights"]
    assert len(model["linear_weights"]) == 4 * 7 + 1  # q/k/v/o + gate/up/down per layer, lm_head
    fp32, q4 = model["rows"]
    assert fp32["weight_error"]["mean_rel_fro"] == 0.0 and fp32["same_completion_as_fp32"] == 1.0
    assert 0.0 <= q4["same_completion_as_fp32"] <= 1.0
    assert 0.01 < q4["weight_error"]["mean_rel_fro"] < 0.3 and q4["weight_error"]["bits_per_weight"] == 4.5
    for row in model["rows"]:
        assert set(row["accuracy"]) == {"addition"} and 0.0 <= row["mean_accuracy"] <= 1.0
        assert "delta_vs_fp32_points" in row
    assert "| llada-tiny | q4_0 | 4.500 |" in out.with_suffix(".md").read_text()
    assert report["mixed_rule"]["name"] == "int4+int8-outliers"

"""`benchmarks/quant_jax.py`: its one-ulp reference moves exactly what int8 quantizes by exactly
one bfloat16 ulp, and the script reports every variant with the floor beside int8."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlm_jax.models.quant import quantized_weights
from dlm_jax.testing import tiny_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import quant_jax  # noqa: E402


def _weights(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, path)): np.asarray(leaf) for path, leaf in
            jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


def test_nudge_moves_each_quantized_weight_one_ulp_and_nothing_else():
    model = tiny_model(param_dtype="bfloat16", dtype="bfloat16", tie_embeddings=False)
    target = quantized_weights(model)[0][1:]
    kernel = getattr(*target).kernel
    kernel[...] = kernel[...].at[0, :4].set(0)  # zeros stay zero
    before = _weights(model)
    moved = quant_jax.nudge_one_ulp(model)
    after = _weights(model)
    listed = {id(getattr(m, n).kernel) for _, m, n in quantized_weights(model)}
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert len(changed) == len(listed) and not any("embed" in k or "norm" in k for k in changed)
    ups = downs = 0
    for k in changed:
        b, a = before[k].astype(np.float32), after[k].astype(np.float32)
        assert np.all((a == 0) == (b == 0)) and np.all(np.sign(a) == np.sign(b))
        nz = b != 0
        up = np.abs(a[nz]) > np.abs(b[nz])
        ups, downs = ups + up.sum(), downs + (~up).sum()
        # one ulp: nothing representable in bfloat16 lies strictly between the old and the new value
        mid = ((a[nz] + b[nz]) / 2).astype(jnp.bfloat16).astype(np.float32)
        assert np.all((mid == a[nz]) | (mid == b[nz]))
    assert moved == ups + downs and 0.45 < ups / moved < 0.55


def test_nudge_refuses_a_float32_model():
    with pytest.raises(ValueError, match="not bfloat16"):
        quant_jax.nudge_one_ulp(tiny_model())


@pytest.mark.slow
def test_quant_jax_reports_the_floor_beside_int8(tmp_path):
    """One model, a preset named after it (llada-tiny's default decode runs the same code: two
    models took 280 s of the slow pass)."""
    out = tmp_path / "q"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quant_jax.py"), "--models", "idlm-tiny:isd",
                    "--n", "2", "--gen-len", "32", "--nudge-seeds", "2", "--out", str(out)], check=True,
                   capture_output=True, cwd=ROOT)
    result = json.loads(out.with_suffix(".json").read_text())
    assert list(result["models"]) == ["idlm-tiny:isd"]
    for rows in result["models"].values():
        assert list(rows) == list(quant_jax.VARIANTS)
        assert rows["bfloat16"]["identical_to_bfloat16"] == 1.0
        assert rows[quant_jax.NUDGED]["weight_bytes"] == rows["bfloat16"]["weight_bytes"]
        assert len(rows[quant_jax.NUDGED]["identical_to_bfloat16_seeds"]) == 2
        # grouped: a float32 scale per 32 weights of a column on top of int8's bytes
        assert rows["int8"]["weight_bytes"] < rows["int8-g32"]["weight_bytes"] < rows["bfloat16"]["weight_bytes"]
    md = out.with_suffix(".md").read_text()
    assert md.count("1-ulp floor") == 2 and md.count("over 2 seeds") == 2  # int8's and int8-g32's
    assert "| idlm-tiny:isd | bf16 1 ulp |" in md
    assert out.with_suffix(".png").stat().st_size > 0

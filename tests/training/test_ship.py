"""Model-card helpers of dlm_jax.training.ship."""

from __future__ import annotations

import pytest

from dlm_jax.training.ship import LOSS_WINDOW, _final_loss


def test_final_loss_averages_the_last_logged_steps():
    metrics = [{"step": 50 * (i + 1), "loss": 100.0} for i in range(5)]
    metrics += [{"step": 300 + 50 * i, "loss": float(i % 2)} for i in range(LOSS_WINDOW)]  # 0,1,0,1,...
    assert _final_loss(metrics) == pytest.approx(0.5)  # not the last batch's 1.0, nor the early 100s
    assert _final_loss(metrics[:3]) == pytest.approx(100.0)  # fewer logs than the window


def test_bfloat16_storage_loads_into_the_float32_model(tmp_path):
    """--weights-dtype bfloat16 halves the file; the model still loads as float32, with the
    weights rounded to bfloat16 and nothing else changed."""
    import ml_dtypes
    import numpy as np

    import dlm_jax
    from dlm_jax._integrity import write_manifest
    from dlm_jax.checkpoint._safetensors import read_header
    from dlm_jax.testing import tiny_config
    from dlm_jax.training.ship import _store_weights

    model = dlm_jax.init_model(tiny_config(), seed=0)
    path = dlm_jax.save_pretrained(model, tmp_path / "m")
    before = (path / "model.safetensors").stat().st_size
    _store_weights(path, "bfloat16")
    write_manifest(path)
    assert (path / "model.safetensors").stat().st_size < 0.6 * before
    infos, _ = read_header(path / "model.safetensors")
    assert {str(i.dtype) for i in infos.values()} == {"bfloat16"}
    loaded = dlm_jax.load_pretrained(path)
    assert loaded.config.param_dtype == "float32"
    want, got = dlm_jax.get_params(model), dlm_jax.get_params(loaded)
    for name, v in want.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], np.asarray(v).astype(ml_dtypes.bfloat16).astype(np.float32))
    _store_weights(path, "bfloat16")  # already stored so: the file is left as it is
    write_manifest(path)
    dlm_jax.load_pretrained(path)


def test_card_states_storage_machine_and_a_stopped_run():
    from dlm_jax.training.config import RunConfig
    from dlm_jax.training.ship import _card

    run = RunConfig.from_dict({
        "model": {"vocab_size": 264, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64,
                  "attention": "bidirectional", "max_seq_len": 64, "mask_token_id": 259, "eos_token_id": 258},
        "train": {"objective": "masked_diffusion", "steps": 100, "batch_size": 2, "seq_len": 64, "warmup_steps": 10,
                  "clean_loss_weight": 0.5, "corrupt_prob": 0.15},
        "data": {"tasks": {"addition": 1.0}}})
    metrics = [{"step": 90, "loss": 0.5, "md_loss": 0.4, "clean_ce": 0.2}]
    from dlm_jax.training.data import TASKS

    results = {"dec": {t: {"accuracy": 0.5, "mean_nfe": 2.0} for t in TASKS}}
    card = _card("m", run, "c.toml", metrics, results, {t: 0.0 for t in TASKS}, 1.0, 60.0, 4, 32,
                 weights_dtype="bfloat16", trained_on="one NVIDIA H100 GPU", stopped_at=95)
    assert "steps: 95 of the configured 100" in card
    assert "on one NVIDIA H100 GPU" in card and "bfloat16 storage; loads into a float32 model" in card
    assert "masked-diffusion part 0.4000" in card and "clean-position term, weight 0.5" in card

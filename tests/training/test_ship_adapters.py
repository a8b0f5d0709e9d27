"""dlm_jax.training.ship_adapters: an R-ISD run's adapters shipped beside their base with a card whose
held-out clean-stream loss is the base's, bit for bit."""

import json

import numpy as np

import dlm_jax
from dlm_jax.checkpoint import load_adapted, save_adapters
from dlm_jax.techniques.isd import LoraSpec, attach_lora, lora_params, set_lora_params

MODEL = dict(vocab_size=264, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, mask_token_id=259,
             eos_token_id=258, max_seq_len=256, attention="causal", logit_shift=True, block_size=4)


def test_shipped_adapters_carry_a_card_and_load(tmp_path):
    from dlm_jax.training.ship_adapters import ship_adapters

    base = dlm_jax.save_pretrained(dlm_jax.init_model(dlm_jax.ModelConfig(**MODEL), seed=0), tmp_path / "base",
                                   tokenizer=dlm_jax.ByteTokenizer())
    model = attach_lora(dlm_jax.load_pretrained(base), LoraSpec(rank=2, alpha=4), seed=0)
    rng = np.random.default_rng(0)
    set_lora_params(model, {k: rng.normal(size=v.shape).astype(np.float32) * 0.1 for k, v in lora_params(model).items()})
    run = tmp_path / "run"
    save_adapters(model, run / "adapters", base=base)
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 1.0 / s, "noisy_ce": 0.5 / s, "clean_ce": 0.4 / s, "masked_acc": 0.5}) + "\n" for s in (1, 2)))
    (run / "train_seconds.json").write_text(json.dumps({"seconds": 90.0}))
    config = tmp_path / "risd.toml"
    model_toml = "\n".join(f"{k} = {json.dumps(v)}" for k, v in MODEL.items())
    config.write_text(f"[model]\n{model_toml}\n[train]\nobjective = \"introspective\"\nsteps = 2\nbatch_size = 2\n"
                      f"seq_len = 256\nwarmup_steps = 1\ninit_from = \"{base}\"\n[lora]\nrank = 2\nalpha = 4\n"
                      "[data]\ntasks = { addition = 1.0 }\n")
    dest = tmp_path / "base" / "risd"
    results = ship_adapters(run, config, dest, n=3)
    assert sorted(p.name for p in dest.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                                     "eval.json", "manifest.json"]
    card = (dest / "README.md").read_text()
    for needle in ("dlm-jax train --config", "wall time: 1.5 min", "final training loss:", "| step | loss |",
                   "Held-out introspective losses (3 prompts per task)"):
        assert needle in card, needle
    assert all(r["base"]["clean_ce"] == r["adapted"]["clean_ce"] for r in results.values())
    assert any(r["base"]["noisy_ce"] != r["adapted"]["noisy_ce"] for r in results.values())
    load_adapted(base, dest)  # the base checkpoint still verifies with the adapters inside its directory


def test_the_shipped_idlm_tiny_adapters_load_against_their_base():
    from pathlib import Path

    models = Path(__file__).resolve().parents[2] / "models"
    path = models / "idlm-tiny" / "risd"
    assert sum(f.stat().st_size for f in path.iterdir()) <= 2**20  # under 1 MB
    model = load_adapted(models / "idlm-tiny", path)
    assert model.config.logit_shift and len(lora_params(model)) == 2 * 7 * 4
    card = (path / "README.md").read_text()
    for needle in ("dlm-jax train --config examples/configs/idlm-tiny-risd.toml", "wall time:", "2-core CPU",
                   "final training loss:", "| step | loss |", "CE_mask base + adapters"):
        assert needle in card, needle

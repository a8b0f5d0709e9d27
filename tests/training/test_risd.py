"""R-ISD training (gated LoRA on a frozen base), the fixed clean-loss scale `ce_alpha`, the stride
curriculum, and their [train] / [lora] keys."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.checkpoint import load_adapted, read_adapter_config
from dlm_jax.techniques.isd import lora_params, mask_rows_gate
from dlm_jax.testing import tiny_config
from dlm_jax.training.config import RunConfig
from dlm_jax.training.objectives import get_objective, introspective, two_stream_mask

MODEL = dict(vocab_size=264, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, mask_token_id=259,
             eos_token_id=258, max_seq_len=64, attention="causal", logit_shift=True, block_size=4)


def raw_config(train=None, lora=None, **tables):
    raw = {"model": MODEL,
           "train": {"objective": "introspective", "steps": 4, "batch_size": 4, "seq_len": 32, "warmup_steps": 1,
                     "log_every": 1, "checkpoint_every": 4, **(train or {})},
           "data": {"tasks": {"addition": 1.0}, "train_examples": 64}, **tables}
    if lora is not None:
        raw["lora"] = lora
    return raw


def small_dataset(rows=24):
    rng = np.random.default_rng(0)
    prompt = np.zeros((rows, 32), bool)
    prompt[:, :8] = True
    return {"tokens": rng.integers(0, 256, (rows, 32)).astype(np.int32), "prompt_mask": prompt}


def _batch(seed=1):
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 60, (2, 8)), jnp.int32)
    return {"tokens": tokens, "prompt_mask": jnp.arange(8)[None, :].repeat(2, 0) < 3}


def _toy():
    cfg = tiny_config(vocab_size=64, n_layers=1, attention="causal", logit_shift=True, block_size=4)
    return dlm_jax.init_model(cfg, seed=1)


@pytest.mark.slow  # (over the default suite's 5-minute budget on 2 cores; .ci/run runs the slow tests)
def test_fixed_ce_alpha_weights_the_clean_term_and_its_gradient():
    """ce_alpha: loss = CE_mask + ce_alpha CE_clean exactly, gradient included."""
    model, batch = _toy(), _batch()
    graphdef, state = nnx.split(model)
    fixed = get_objective("introspective", model.config, ce_alpha=0.2)

    def parts(s, objective):
        _, m = objective(nnx.merge(graphdef, s), batch, jax.random.key(0))
        return m["loss"], (m["noisy_ce"], m["clean_ce"])

    (loss, (n, c)), g = jax.value_and_grad(lambda s: parts(s, fixed), has_aux=True)(state)
    assert float(loss) == pytest.approx(float(n) + 0.2 * float(c), rel=1e-6)
    g_n = jax.grad(lambda s: parts(s, introspective)[1][0])(state)
    g_c = jax.grad(lambda s: parts(s, introspective)[1][1])(state)
    for a, bn, bc in zip(jax.tree.leaves(g), jax.tree.leaves(g_n), jax.tree.leaves(g_c)):
        np.testing.assert_allclose(a, bn + 0.2 * bc, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # (over the default suite's 5-minute budget on 2 cores; .ci/run runs the slow tests)
def test_auto_balance_weight_is_a_constant_ratio():
    """Eq. 2's lambda = CE_mask / CE_clean carries no gradient: the auto-balanced loss's
    gradient equals that of CE_mask + lambda CE_clean with lambda a fixed number (ce_alpha)."""
    model, batch = _toy(), _batch(seed=4)
    graphdef, state = nnx.split(model)
    _, m = introspective(model, batch, jax.random.key(0))
    lam = float(m["noisy_ce"]) / float(m["clean_ce"])
    assert float(m["clean_scale"]) == pytest.approx(lam, rel=1e-6)
    auto = jax.grad(lambda s: introspective(nnx.merge(graphdef, s), batch, None)[0])(state)
    fixed = jax.grad(lambda s: introspective(nnx.merge(graphdef, s), batch, None, ce_alpha=lam)[0])(state)
    for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(fixed)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_noisy_block_overrides_the_configs_block_size():
    model, batch = _toy(), _batch(seed=2)
    wide = dlm_jax.model_from_params(model.config.replace(block_size=2), dlm_jax.get_params(model))
    a = introspective(model, batch, None, noisy_block=2)[1]
    b = introspective(wide, batch, None)[1]
    c = introspective(model, batch, None)[1]
    assert float(a["noisy_ce"]) == float(b["noisy_ce"]) and float(a["noisy_ce"]) != float(c["noisy_ce"])


def test_curriculum_stages_and_ce_alpha_parse():
    run = RunConfig.from_dict(raw_config({"steps": 6, "stride_curriculum": [[2, 2], [1, 3], [3, 4]], "ce_alpha": 0.2}))
    assert [run.train.stride_at(s) for s in range(6)] == [2, 2, 3, 4, 4, 4]
    assert run.train.ce_alpha == 0.2 and run.lora is None
    assert RunConfig.from_dict(raw_config({"ce_alpha": "auto"})).train.ce_alpha is None
    assert RunConfig.from_dict(raw_config()).train.stride_at(0) is None


@pytest.mark.parametrize("train, lora, match", [
    ({"ce_alpha": -1.0}, None, r"\[train\] ce_alpha=-1.0 must be"),
    ({"ce_alpha": "fixed"}, None, r"\[train\] ce_alpha='fixed' must be"),
    ({"objective": "autoregressive", "ce_alpha": 0.2}, None, r"\[train\] objective 'autoregressive' has no option"),
    ({"stride_curriculum": [[2, 2], [1, 3]]}, None, r"\[train\] stride_curriculum stages add up to 3 steps, not steps=4"),
    ({"stride_curriculum": [[4, 1]]}, None, r"\[train\] stride_curriculum entry \[4, 1\] must be"),
    ({"stride_curriculum": [4, 2]}, None, r"\[train\] stride_curriculum entry 4 must be"),
    ({"objective": "autoregressive", "stride_curriculum": [[4, 2]]}, None,
     r"\[train\] stride_curriculum is an option of the 'introspective' objective"),
    ({"init_from": "base"}, {"rank": 4, "alpah": 8}, r"unknown key\(s\) \['alpah'\] in \[lora\]"),
    ({"init_from": "base"}, {"rank": 0}, r"\[lora\] LoRA self.rank=0 must be"),
    ({"init_from": "base"}, {"targets": ["q_proj", "qkv"]}, r"\[lora\] LoRA targets=.*unknown: \['qkv'\]"),
    ({}, {"rank": 4}, r"\[lora\] needs \[train\] init_from"),
    ({"objective": "autoregressive", "init_from": "base"}, {"rank": 4}, r"\[lora\] trains R-ISD adapters"),
])
def test_bad_keys_are_named_in_one_line(train, lora, match):
    with pytest.raises(ConfigError, match=match) as e:
        RunConfig.from_dict(raw_config(train, lora))
    assert "\n" not in str(e.value)


@pytest.mark.slow  # a training run: about 15 s cold
def test_risd_run_trains_only_the_adapters(tmp_path):
    """A short R-ISD run: the base stays bit-identical, the adapters move, clean rows of the
    adapted model are the base's bits, and the adapter files round-trip against the base."""
    from dlm_jax.training.loop import train

    base_dir = tmp_path / "base"
    base = dlm_jax.init_model(dlm_jax.ModelConfig(**MODEL), seed=3)
    dlm_jax.save_pretrained(base, base_dir, tokenizer=dlm_jax.ByteTokenizer())
    before = {f.name: f.read_bytes() for f in base_dir.iterdir()}
    run = RunConfig.from_dict(raw_config({"init_from": str(base_dir), "learning_rate": 1e-2, "ce_alpha": 0.2,
                                          "stride_curriculum": [[2, 2], [2, 3]]},
                                         {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "up_proj", "down_proj"]}))
    result = train(run, tmp_path / "run", progress=False, dataset=small_dataset())
    assert result.model_dir == tmp_path / "run" / "adapters" and not (tmp_path / "run" / "model").exists()
    assert {f.name: f.read_bytes() for f in base_dir.iterdir()} == before  # the base is never written
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["stride"] for m in logged] == [2, 2, 3, 3] and all(m["clean_scale"] == pytest.approx(0.2) for m in logged)
    assert read_adapter_config(result.model_dir)["base_model_name_or_path"] == str(base_dir)
    model = load_adapted(base_dir, result.model_dir)
    ref = dlm_jax.get_params(base)
    for name, value in dlm_jax.get_params(model).items():
        np.testing.assert_array_equal(value, ref[name])
    trained = lora_params(model)
    assert all(np.abs(v).max() > 0 for k, v in trained.items() if k.endswith("lora_b"))  # B left zero
    # The two-stream input of a batch: clean rows (gate 0) are the base's bits, mask rows not.
    batch = {k: jnp.asarray(v[:2]) for k, v in small_dataset().items()}
    noisy = jnp.where(batch["prompt_mask"], batch["tokens"], MODEL["mask_token_id"])
    tokens = jnp.concatenate([noisy, batch["tokens"]], axis=1)
    gate = mask_rows_gate(tokens, MODEL["mask_token_id"])
    kw = dict(positions=jnp.tile(jnp.arange(32, dtype=jnp.int32), 2)[None].repeat(2, 0),
              mask=jnp.asarray(two_stream_mask(32, 3, noisy_causal=True, clean_causal=True))[None].repeat(2, 0))
    out, want = model(tokens, lora_gate=gate, **kw).logits, base(tokens, **kw).logits
    clean = np.asarray(gate) == 0
    np.testing.assert_array_equal(np.asarray(out)[clean], np.asarray(want)[clean])
    assert not np.array_equal(np.asarray(out)[~clean], np.asarray(want)[~clean])


def test_the_example_risd_config_parses():
    from pathlib import Path

    run = RunConfig.load(Path(__file__).resolve().parents[2] / "examples" / "configs" / "idlm-tiny-risd.toml")
    assert run.lora.rank == 8 and run.lora.scale == 2.0 and run.train.init_from == "models/idlm-tiny"
    assert run.to_dict()["lora"] == {"rank": 8, "alpha": 16.0, "targets": run.lora.targets}

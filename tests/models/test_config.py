"""ModelConfig validation: a bad value fails at construction, naming the field."""

import pytest

from dlm_jax import ConfigError, ModelConfig

BASE = dict(vocab_size=32, d_model=16, n_layers=1, n_heads=4, ffn_hidden=32)


@pytest.mark.parametrize("change, field", [
    ({"attention": "sideways"}, "attention"),
    ({"ffn": "gelu"}, "ffn"),
    ({"n_kv_heads": 3}, "n_kv_heads"),
    ({"d_model": 0}, "d_model"),
    ({"head_dim": 5}, "head_dim"),
    ({"embedding_rows": 16}, "embedding_rows"),
    ({"mask_token_id": 32}, "mask_token_id"),
    ({"dtype": "float64"}, "dtype"),
    ({"ffn": "moe"}, "n_experts"),
    ({"ffn": "moe", "n_experts": 4, "moe_ffn_hidden": 8, "n_experts_per_tok": 5}, "n_experts_per_tok"),
    ({"ffn": "moe", "n_experts": 4, "moe_ffn_hidden": 8, "n_experts_per_tok": 2,
      "n_expert_groups": 3}, "n_expert_groups"),
    ({"dense_layers": (1,)}, "dense_layers"),
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"partial_rotary_factor": 0.25}, "partial_rotary_factor"),  # 1 of head_dim 4: odd
    ({"head_dim": 12, "partial_rotary_factor": 0.25}, "partial_rotary_factor"),  # 3: odd
])
def test_bad_value_names_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**BASE, **change})


def test_defaults_resolve():
    cfg = ModelConfig(**BASE)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.embedding_rows) == (4, 4, 32)


def test_dict_round_trip_and_unknown_key():
    cfg = ModelConfig(**BASE, ffn="moe", n_experts=4, n_experts_per_tok=2, moe_ffn_hidden=8,
                      dense_layers=(0,))
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="colour"):
        ModelConfig.from_dict({**cfg.to_dict(), "colour": "red"})


def test_partial_rotary_round_trips_through_the_native_format():
    from dlm_jax.checkpoint import get_family

    cfg = ModelConfig(**BASE, head_dim=8, partial_rotary_factor=0.5)
    assert (ModelConfig(**BASE).rotary_dim, cfg.rotary_dim) == (4, 4)
    fam = get_family("dlm_jax")
    data = fam.config_to_json(cfg)
    assert data["partial_rotary_factor"] == 0.5
    assert fam.config_from_json(data, source="config.json") == cfg

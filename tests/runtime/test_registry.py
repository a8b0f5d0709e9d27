"""The strategy registry: names and presets -> objects, flat options both ways, the command
line generated from it, and what it takes to add a commit rule."""

import argparse
import dataclasses

import numpy as np
import pytest

import dlm_jax
from dlm_jax import ConfigError
from dlm_jax.runtime import (DecodeConfig, Decoder, DualCache, FactorRule, FrechetRule, NoCache, PaperFactorRule,
                             PerStepRule, PrefixCache, Proposer, ThresholdRule, TopKSchedule, decode_config, preset,
                             registry)
from dlm_jax.testing import MockExecutor, tiny_config
from dlm_jax.runtime.registry import decode_options


def test_presets_are_the_papers_decoders():
    assert preset("fast-dllm") == DecodeConfig(scheduler=PrefixCache(block_len=32), rule=ThresholdRule(0.9))
    assert preset("llada", gen_len=64) == DecodeConfig(gen_len=64, scheduler=NoCache(32), rule=TopKSchedule())
    assert preset("frechet").rule == FrechetRule(0.25) and preset("frechet").scheduler.block_len == 32
    assert preset("fast-dllm-dual").scheduler == DualCache(32)
    assert preset("fast-dllm-factor").rule == FactorRule(1.0)  # the released rule
    assert decode_config() == DecodeConfig()  # prefix cache, threshold 0.9, block 32, greedy
    with pytest.raises(ConfigError, match="unknown decode preset 'turbo'"):
        preset("turbo")


@pytest.mark.parametrize("options", [
    {}, dict(cache="none", rule="topk", steps=64, block_len=16), dict(rule="factor_paper", factor=2.0),
    dict(cache="dual", rule="frechet", delta=0.1, temperature=0.7, seed=4, confidence="margin", defer_eos=True),
    dict(rule="topk", remasking="random", stop_on_eos_block=False, gen_len=32, block_len=8),
])
def test_flat_options_round_trip(options):
    cfg = decode_config(**options)
    assert decode_config(**decode_options(cfg)) == cfg
    assert {k: decode_options(cfg)[k] for k in options} == options


def test_replace_rebuilds_only_what_changes():
    cfg = preset("frechet", gen_len=64)
    hot = decode_config(cfg, temperature=1.0)
    assert hot.rule is cfg.rule and hot.scheduler is cfg.scheduler and hot.proposer == Proposer(temperature=1.0)
    dual = decode_config(cfg, cache="dual")
    assert dual.scheduler == DualCache(32) and dual.rule is cfg.rule
    assert decode_config(cfg, rule="threshold").rule == ThresholdRule(0.9)  # delta dropped with its rule
    own = decode_config(cfg, rule=FrechetRule(0.05))
    assert own.rule == FrechetRule(0.05) and decode_options(own)["delta"] == 0.05


@pytest.mark.parametrize("options, match", [
    (dict(rule="threshold", steps=8), r"steps=8 applies to rule='topk' only"),
    (dict(rule="frechet", threshold=0.5), r"threshold=0.5 applies to rule='threshold' only"),
    (dict(rule="threshold", factor=2.0), r"factor=2.0 applies to rule='factor' or rule='factor_paper' only"),
    (dict(rule="fastest"), r"rule='fastest' is not one of \('topk', 'threshold', 'factor'"),
    (dict(cache="triple"), r"cache='triple' is not one of \('none', 'prefix', 'dual', 'mbsd', 'isd', 'ar'\)"),
    (dict(speed=3), r"unknown decode option\(s\) \['speed'\]"),
    (dict(gen_len=16, block_len=5), r"block_len=5 must divide gen_len=16"),
    (dict(rule="topk", steps=6, gen_len=64, block_len=16), r"steps=6 must be a positive multiple of the number "
                                                            r"of blocks \(4\)"),
    (dict(remasking="random"), r"remasking='random' applies to rule='topk' only"),
    (dict(threshold=1.5), r"ThresholdRule.threshold=1.5 must be in \(0, 1\]"),
    (dict(temperature=-1.0), r"temperature=-1.0 must be a finite number >= 0"),
    (dict(confidence="vibes"), r"confidence='vibes' is not one of"),
    (dict(gen_len=0), r"gen_len=0 must be a positive integer"),
])
def test_options_are_validated_once_with_the_value_named(options, match):
    with pytest.raises(ConfigError, match=match):
        decode_config(**options)


def test_preset_options_that_no_longer_apply_are_dropped_silently():
    cfg = preset("fast-dllm", rule="frechet")  # the preset's threshold belongs to the old rule
    assert cfg.rule == FrechetRule(0.25) and "threshold" not in decode_options(cfg)


def _parse(argv):
    parser = argparse.ArgumentParser()
    registry.add_cli_options(parser)
    return registry.config_from_args(parser.parse_args(argv))


def test_command_line_flags_come_from_the_registry():
    cfg = _parse(["--preset", "llada", "--gen", "16", "--block", "8", "--steps", "8", "--no-stop-on-eos-block",
                  "--defer-eos", "--confidence", "margin"])
    assert cfg == decode_config(cache="none", rule="topk", gen_len=16, block_len=8, steps=8,
                                stop_on_eos_block=False, defer_eos=True, confidence="margin")
    assert _parse(["--rule", "factor_paper", "--factor", "2"]).rule == PaperFactorRule(2.0)
    with pytest.raises(SystemExit):
        _parse(["--cache", "triple"])
    with pytest.raises(ConfigError, match="delta=0.1 applies to rule='frechet' only"):
        _parse(["--delta", "0.1"])  # the default preset's rule is the threshold


@dataclasses.dataclass(frozen=True)
class LeftToRight(PerStepRule):
    """Commit the `width` leftmost candidates of each row."""

    width: int = dataclasses.field(default=1, metadata={"help": "slots committed per step, left to right"})

    def select(self, confidence, candidates, *, step=0):
        return candidates & (np.cumsum(candidates, axis=1) <= self.width)


def test_adding_a_commit_rule_is_a_class_and_one_registry_line(monkeypatch):
    assert "width" not in registry.options()  # made once per state of the tables: seen again after the line
    monkeypatch.setitem(registry.RULES, "left_to_right", LeftToRight)  # the registry line
    assert registry.options()["width"].owners == ("rule='left_to_right'",)
    cfg = _parse(["--rule", "left_to_right", "--width", "3", "--gen", "8", "--block", "8"])
    assert cfg.rule == LeftToRight(3) and decode_options(cfg)["rule"] == "left_to_right"
    with pytest.raises(ConfigError, match=r"width=2 applies to rule='left_to_right' only"):
        decode_config(rule="threshold", width=2)
    config = tiny_config()
    confidence = np.linspace(0.1, 0.9, config.max_seq_len)  # right is more confident: order is the rule's
    exe = MockExecutor(config, answer=np.arange(config.max_seq_len) % 50, confidence=confidence)
    out = Decoder(exe, config).decode([[1, 2]], cfg)
    assert out.stats.nfe == 3 and out.stats.commit_histogram == {3: 2, 2: 1}
    first_fed = exe.calls[1].tokens[0, :8]  # the block, first in the second step's window
    assert (first_fed[:3] != config.mask_token_id).all() and (first_fed[3:] == config.mask_token_id).all()
    monkeypatch.undo()
    assert "width" not in registry.options()


def test_top_level_names():
    assert dlm_jax.decode_config is decode_config and dlm_jax.preset is preset
    assert set(dlm_jax.PRESETS) == {"llada", "fast-dllm", "fast-dllm-dual", "fast-dllm-factor", "frechet",
                                   "llada-cpp", "isd", "ar"}

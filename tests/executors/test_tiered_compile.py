"""A tiered compile (`JaxExecutor(compile="tiered")`, `$DLM_JAX_COMPILE`): each step program
compiled quick first, replaced by its full compile built behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlm_jax
from dlm_jax._errors import ConfigError
from dlm_jax.executors import _compile
from dlm_jax.executors._compile import COMPILE_ENV, CompiledBuckets, XlaCompileCounter, choose_compile
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime.decoder import Decoder
from dlm_jax.testing import tiny_model

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]


@pytest.fixture
def compiles(monkeypatch, tmp_path):
    """Every `Lowered.compile` call's compiler options, in order; the full compiles held back
    until `release` is set; the tiered compiles' markers under `tmp_path` (this process's
    persistent cache is the tests' shared one)."""
    calls: list[dict | None] = []
    release = threading.Event()
    original = jax.stages.Lowered.compile

    def compile(self, compiler_options=None, **kw):
        calls.append(compiler_options)
        return original(self, compiler_options, **kw)

    upgrade = CompiledBuckets._upgrade

    def held(self, key, job):
        assert release.wait(120)
        return upgrade(self, key, job)

    marker = _compile._full_marker
    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)
    monkeypatch.setattr(CompiledBuckets, "_upgrade", held)
    monkeypatch.setattr(_compile, "_full_marker", lambda lowered: tmp_path / marker(lowered).name)
    yield calls, release
    release.set()
    _compile.UPGRADES.wait(timeout=120)


def test_every_platform_s_quick_options_are_options_xla_knows():
    """XLA refuses an option it does not know (`No such compile option`) only when a program
    compiles with it, and a GPU's quick options never compile on this CPU otherwise: a
    misspelt one would fail every tiered compile of a GPU's first decode. XLA's debug options
    are one set for every backend, so this CPU's compiler checks the names (and refuses a
    misspelling, which the second half checks)."""
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    assert set(_compile.QUICK_OPTIONS) >= {"cpu", "gpu"}
    for options in _compile.QUICK_OPTIONS.values():
        lowered.compile(options)
    with pytest.raises(Exception, match="No such compile option"):
        lowered.compile({**_compile.QUICK_OPTIONS["gpu"], "xla_gpu_autotune_levle": 0})


def test_a_program_runs_quick_until_its_full_compile_takes_its_place(compiles):
    """Guards a tiered compile that is not one: quick options never passed (the first call
    waits for the full compile), a full compile that never replaces the quick one (every
    call slower for good), or one that replaces another key's program."""
    calls, release = compiles
    programs = CompiledBuckets(lambda n: (lambda x: jnp.tanh(x * n).sum(), (jax.ShapeDtypeStruct((4, n), jnp.float32),)),
                               tiered=True)
    quick = _compile.quick_options()
    assert quick == {"xla_backend_optimization_level": 0}  # (this CPU's)
    exes = {n: programs.get(n) for n in (2, 3)}
    assert calls == [quick, quick]
    assert [programs.tier(n) for n in (2, 3)] == ["quick", "quick"] and programs.upgrades_pending == 2
    assert programs.get(2) is exes[2]  # held: the quick one answers
    release.set()
    assert programs.wait_upgrades(timeout=120)
    assert calls[2:] == [None, None]
    assert [programs.tier(n) for n in (2, 3)] == ["full", "full"] and programs.upgrade_count == 2
    for n in (2, 3):
        x = np.full((4, n), 0.5, np.float32)
        full = programs.get(n)
        assert full is not exes[n]
        assert float(full(x)) == pytest.approx(float(exes[n](x)), rel=1e-6) == float(np.tanh(x * n).sum())
    assert programs.compile_count == 2  # the full compiles are upgrades, not compiles a caller waited for


@pytest.mark.slow  # (3 s; the default pass checks the mechanism above, on a small program)
def test_a_tiered_decode_keeps_its_tokens_and_the_next_executor_starts_full(compiles):
    """A decode on quick programs gives the full programs' tokens; once upgraded, a decode
    compiles nothing; and an executor built after (another process, for the markers) compiles
    the step in full at once, without a quick compile: a second process with the persistent
    cache loads the full program instead of running the quick one first."""
    calls, release = compiles
    cfg = dlm_jax.decode_config(gen_len=16, block_len=8, cache="prefix", rule="threshold", threshold=0.9)
    model = tiny_model(seed=1, eos_token_id=None, n_layers=2)
    want = Decoder(JaxExecutor(model), model.config).decode(PROMPTS, cfg).sequences
    calls.clear()
    ex = JaxExecutor(model, compile="tiered")
    dec = Decoder(ex, model.config)
    got = dec.decode(PROMPTS, cfg)
    tiers = ex.tiers()
    behind = tiers["pending"] - tiers["quick"]  # (programs of steps run in a wider window meanwhile)
    assert tiers["quick"] >= 2 and tiers["full"] == 0 and behind >= 0
    assert dec.build_counts().quick_programs == tiers["quick"]
    assert [g.tolist() for g in got.sequences] == [w.tolist() for w in want]
    release.set()
    assert ex.wait_for_upgrades(timeout=120)
    upgraded = ex.tiers()
    assert upgraded["upgrade_seconds"] > 0
    assert upgraded == {"quick": 0, "full": tiers["quick"] + behind, "upgrades": tiers["quick"], "behind": behind,
                        "widened": tiers["widened"], "pending": 0, "upgrade_seconds": upgraded["upgrade_seconds"]}
    before = XlaCompileCounter.count()
    again = dec.decode(PROMPTS, cfg)
    assert XlaCompileCounter.count() == before and again.stats.compiles == 0
    assert [g.tolist() for g in again.sequences] == [w.tolist() for w in want]
    calls.clear()
    later = JaxExecutor(model, compile="tiered")
    Decoder(later, model.config).decode(PROMPTS, cfg)
    assert later.tiers()["quick"] == 0 and later.tiers()["full"] >= tiers["quick"]
    assert _compile.quick_options() not in calls


@pytest.mark.slow  # (20-30 s; the default pass checks the widened step's padding and the tiered warm-up below)
def test_a_step_runs_in_a_wider_window_until_its_own_program_is_built_behind(compiles):
    """A prefix-cache decode's window narrows block by block: tiered, a step whose program is
    not compiled runs padded in a wider window's compiled program of the same cache, and its
    own program is built behind. Guards a fallback that changes tokens, returns the wider
    window's rows of the routed experts (the placement trace would differ in shape), waits
    for the program after all (as many compiles as the full executor), or keeps padding once
    the program is built."""
    from dlm_jax.runtime import preset
    from dlm_jax.testing import sharp_model

    calls, release = compiles
    model = sharp_model(seed=2, ffn="moe", n_experts=8, n_experts_per_tok=2, moe_ffn_hidden=16, n_shared_experts=1,
                        router="sigmoid", router_bias=True, n_layers=3, dense_layers=(0,))
    cfg = preset("fast-dllm", gen_len=32, block_len=8, threshold=0.7, experts="all")
    full = JaxExecutor(model, attention="split")
    want = Decoder(full, model.config).decode(PROMPTS, cfg)
    windows = sorted(k[0].window for k in full._resident.keys)
    assert len(windows) >= 4  # (32, 24, 16, 8 and the refresh: one program each)
    ex = JaxExecutor(model, attention="split", compile="tiered")
    dec = Decoder(ex, model.config)
    got = dec.decode(PROMPTS, cfg)
    held = sorted(k[0].window for k in ex._resident.keys)
    tiers = ex.tiers()
    assert len(held) < len(windows) and tiers["widened"] > 0 and tiers["behind"] == 0
    assert tiers["pending"] == tiers["quick"] + len(windows) - len(held)
    assert got.stats.widened_steps == tiers["widened"] == dec.build_counts().widened_steps
    assert [g.tolist() for g in got.sequences] == [w.tolist() for w in want.sequences]
    trace, ref = got.stats.placement["trace"], want.stats.placement["trace"]
    assert [len(b) for b in trace] == [len(b) for b in ref]
    for block, ref_block in zip(trace, ref):
        for s, r in zip(block, ref_block):
            np.testing.assert_array_equal(s, r)
    release.set()
    assert ex.wait_for_upgrades(timeout=120)
    built = ex.tiers()
    assert built["behind"] == len(windows) - len(held) and built["quick"] == 0
    assert sorted(k[0].window for k in ex._resident.keys) == windows
    again = dec.decode(PROMPTS, cfg)
    assert ex.tiers()["widened"] == tiers["widened"] and again.stats.compiles == again.stats.widened_steps == 0
    assert [g.tolist() for g in again.sequences] == [w.tolist() for w in want.sequences]


def test_a_tiered_prefetch_leaves_out_the_windows_a_wider_one_runs(monkeypatch):
    """Background threads (a GPU's) compile a decode's programs ahead; tiered, a step of which
    a wider window is queued runs padded in that one's program, so queueing its own as well
    would compile it quick only to build it again behind."""
    from dlm_jax.runtime import BucketKey

    seen = []
    monkeypatch.setattr(CompiledBuckets, "prefetch", lambda self, keys: seen.append((self, list(keys))))
    keys = [BucketKey(1, 64, 0, 32), BucketKey(1, 64, 64, 32), BucketKey(1, 32, 64, 32), BucketKey(1, 32, 96, 32),
            BucketKey(2, 32, 64, 32)]
    model = tiny_model(seed=1, n_layers=1)
    for compile, windows in (("full", [(1, 64, 0), (1, 64, 1), (1, 32, 1), (2, 32, 1)]),
                             ("tiered", [(1, 64, 0), (1, 64, 1), (2, 32, 1)])):
        ex = JaxExecutor(model, attention="split", compile=compile)  # (read in place: every read bucket the slots)
        seen.clear()
        ex.prefetch(keys, slots=200)
        [resident] = [ks for programs, ks in seen if programs is ex._resident]
        assert [(k.batch, k.window, k.cache // slots) for k, slots in resident] == windows, compile


def test_a_tiered_warmup_builds_the_widest_window_now_and_the_narrower_ones_behind(compiles):
    """A warm-up (a server's, before it reports ready) compiles, tiered, only the resident steps
    no wider window among them could run padded; the rest are queued behind, and every one is
    there once they are built."""
    from dlm_jax.runtime import BucketKey

    calls, release = compiles
    model = tiny_model(seed=1, n_layers=1)
    keys = [BucketKey(1, w, 64, 8) for w in (8, 16, 32)] + [BucketKey(1, 64, 0, 8)]
    ex = JaxExecutor(model, attention="split", compile="tiered")
    assert ex.warmup(keys, slots=100) == 2  # (window 32 over the cache, 64 without one)
    counts = ex.build_counts()
    assert counts.quick_programs == 2 and counts.pending_compiles == 4
    release.set()
    assert ex.wait_for_upgrades(timeout=120)
    assert sorted(k[0].window for k in ex._resident.keys) == [8, 16, 32, 64]
    assert ex.tiers()["behind"] == 2 and ex.build_counts().pending_compiles == 0
    full = JaxExecutor(model, attention="split")
    assert full.warmup(keys, slots=100) == 4


def test_a_widened_step_pads_its_window_with_rows_nobody_sees():
    from dlm_jax.runtime import BucketKey
    from dlm_jax.runtime.step import SlotStep

    key = BucketKey(batch=1, window=2, cache=4, rows=2)
    step = SlotStep(key, tokens=np.array([[7, 8]], np.int32), positions=np.array([[4, 5]], np.int32),
                    q_valid=np.ones((1, 2), bool), read=np.arange(4, dtype=np.int32), probes=np.array([True, False]),
                    hide=np.array([5, -1], np.int32), write=np.array([[4, 5]], np.int32),
                    logit_rows=np.array([[0, 1]], np.int32))
    wide = step.widened_window(4)
    assert wide.key == BucketKey(batch=1, window=4, cache=4, rows=2) and wide.widened_window(4) is wide
    assert wide.tokens.tolist() == [[7, 8, 0, 0]] and wide.q_valid.tolist() == [[True, True, False, False]]
    assert wide.write.tolist() == [[4, 5, -1, -1]] and wide.hide.tolist() == [[5, -1, -1, -1]]
    assert wide.probes.tolist() == [[True, False, False, False]] and wide.logit_rows is step.logit_rows
    assert wide.read is step.read and wide.lora_gate is None
    with pytest.raises(ValueError, match="window 2 cannot be widened to 1"):
        step.widened_window(1)


def test_no_quick_tier_compiles_in_full_and_a_bad_mode_is_refused_in_one_line(monkeypatch, compiles):
    calls, _ = compiles
    monkeypatch.setattr(_compile, "QUICK_OPTIONS", {})  # (a TPU's: none known)
    programs = CompiledBuckets(lambda n: (lambda x: x * n, (jax.ShapeDtypeStruct((n,), jnp.float32),)), tiered=True)
    programs.get(2)
    assert calls == [None] and programs.tier(2) == "full" and programs.upgrades_pending == 0
    monkeypatch.setenv(COMPILE_ENV, "fast")
    with pytest.raises(ConfigError, match=r"^DLM_JAX_COMPILE='fast': known full, tiered$"):
        choose_compile()
    assert choose_compile("tiered") == "tiered"
    monkeypatch.delenv(COMPILE_ENV)
    assert choose_compile() == "full"


def test_a_mesh_over_several_processes_refuses_a_tiered_compile(monkeypatch):
    """Processes of one mesh run each step's program together: one that swapped in its full
    program while another still ran the quick one would pair different programs' collectives."""
    from types import SimpleNamespace

    from dlm_jax.executors import jax_executor

    monkeypatch.setattr(jax_executor, "_placement", lambda mesh, model, slots: SimpleNamespace(processes=2))
    with pytest.raises(ConfigError, match=r"^compile='tiered' on a mesh over 2 processes: .*use compile='full'$"):
        JaxExecutor(tiny_model(seed=1, n_layers=1), mesh="tp=2", compile="tiered")


EXIT_SCRIPT = """
import time
import jax, jax.numpy as jnp
from dlm_jax.executors._compile import UPGRADES, CompiledBuckets
upgrade = CompiledBuckets._upgrade
def slow(self, key, job):
    time.sleep(1.0)
    upgrade(self, key, job)
    print("upgraded", flush=True)
CompiledBuckets._upgrade = slow
programs = CompiledBuckets(lambda n: (lambda x: x * n, (jax.ShapeDtypeStruct((n,), jnp.float32),)), tiered=True)
programs.get(2)
programs.get(3)
deadline = time.monotonic() + 60
while UPGRADES._busy is None and time.monotonic() < deadline:
    time.sleep(0.01)
print("exiting", flush=True)
"""


def test_a_process_exiting_during_a_full_compile_says_it_waits_for_that_one_only(tmp_path):
    """At exit the queue is dropped and the compile under way finishes (XLA's compiler is not
    left running while the interpreter ends): one line on stderr says why the process lingers."""
    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DLM_JAX_CACHE_DIR": str(tmp_path),
                                 "JAX_COMPILATION_CACHE_DIR": str(tmp_path)})  # (no marker from an earlier run)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["exiting", "upgraded"]  # (the second program's upgrade dropped)
    assert "dlm-jax: exiting once the full compile under way ends" in result.stderr

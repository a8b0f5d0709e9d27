"""Compiles ahead of use (`CompiledBuckets.prefetch`, `Executor.prefetch`): background threads
build a decode's buckets in the order given, a caller waits for its own bucket only (one not
started yet is compiled at once on the caller's thread), queued ones are dropped when the
decode ends, and a decode with them gives the tokens of one without."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.executors import _compile
from dlm_jax.executors._compile import CompiledBuckets, background_workers
from dlm_jax._errors import ConfigError
from dlm_jax.executors.jax_executor import JaxExecutor
from dlm_jax.runtime import Decoder, preset
from dlm_jax.runtime.step import Executor
from dlm_jax.testing import sharp_model


@pytest.fixture
def threads(monkeypatch):
    """One background compile thread, in a pool of this test's own."""
    monkeypatch.setenv("DLM_JAX_COMPILE_THREADS", "1")
    monkeypatch.setattr(_compile, "_POOL", None)
    yield
    if _compile._POOL is not None:
        _compile._POOL.shutdown(wait=True)


class Builds:
    """A build function that records which thread built each key; key 1 waits for `release`."""

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Event()
        self.by: dict[int, str] = {}
        self.fail: set[int] = set()

    def __call__(self, key: int):
        if key == 1:
            self.started.set()
            assert self.release.wait(30)
        self.by[key] = threading.current_thread().name
        if key in self.fail:
            raise RuntimeError(f"no program for {key}")
        return (lambda x: x * key), (jnp.zeros(3),)


def test_a_caller_waits_only_for_its_own_key(threads):
    builds = Builds()
    programs = CompiledBuckets(builds)
    programs.prefetch([1, 2, 3])
    assert builds.started.wait(30)  # the one thread is busy with key 1
    assert float(programs.get(3)(jnp.ones(3))[0]) == 3.0  # not started: taken off the queue
    assert builds.by == {3: threading.current_thread().name}
    builds.release.set()
    assert float(programs.get(1)(jnp.ones(3))[0]) == 1.0  # started: waited for
    programs.get(2)
    assert builds.by[1].startswith("dlm-jax-compile") and builds.by[2].startswith("dlm-jax-compile")
    assert programs.compile_count == 3 and programs.keys == [1, 2, 3]
    assert 0 < programs.wait_seconds


def test_cancel_drops_what_has_not_started(threads):
    builds = Builds()
    programs = CompiledBuckets(builds)
    programs.prefetch([1, 2, 3])
    assert builds.started.wait(30)
    programs.cancel()
    builds.release.set()
    programs.get(1)  # was compiling: finishes
    _compile._POOL.shutdown(wait=True)
    assert programs.keys == [1] and set(builds.by) == {1}


def test_a_cancel_of_some_keys_leaves_the_others_queued(threads):
    """What a decode or an engine queued is dropped when it ends (`cancel(keys)`), not what
    another queued beside it on the same programs (a second decode's, a server's warm-up's)."""
    builds = Builds()
    programs = CompiledBuckets(builds)
    programs.prefetch([1, 2, 3])  # the first caller's (1 holds the one thread)
    programs.prefetch([4, 5])  # another's
    assert builds.started.wait(30)
    programs.cancel([2, 3, 9])  # the first caller ends (9: never queued)
    builds.release.set()
    _compile._POOL.shutdown(wait=True)
    assert programs.keys == [1, 4, 5] and set(builds.by) == {1, 4, 5}


def test_cancel_leaves_a_compile_a_caller_runs_on_its_own_thread():
    """Regression: a key compiling on a caller's own thread (not queued) sits in the pending
    table as a bare Future, which `cancel` (the end of another decode, e.g. the main thread's
    while a CPU path's thread compiles its view) could cancel: the caller's `get` then failed
    with InvalidStateError setting its result, found by a mesh decode's llada-cpp refresh."""
    builds = Builds()
    programs = CompiledBuckets(builds)
    got = {}
    caller = threading.Thread(target=lambda: got.update(exe=programs.get(1)))
    caller.start()
    assert builds.started.wait(30)  # compiling on `caller`'s thread
    programs.cancel()
    builds.release.set()
    caller.join(30)
    assert float(got["exe"](jnp.ones(3))[0]) == 1.0 and programs.keys == [1]


def test_a_failed_background_compile_raises_where_its_key_is_needed(threads):
    builds = Builds()
    builds.release.set()
    builds.fail.add(2)
    programs = CompiledBuckets(builds)
    programs.prefetch([2])
    with pytest.raises(RuntimeError, match="no program for 2"):
        programs.get(2)
    builds.fail.clear()
    programs.get(2)  # tried again
    assert programs.keys == [2]


def test_no_threads_no_prefetch(monkeypatch):
    monkeypatch.setattr(_compile, "_POOL", None)
    monkeypatch.setenv("DLM_JAX_COMPILE_THREADS", "0")
    programs = CompiledBuckets(Builds())
    programs.prefetch([2, 3])
    assert programs.keys == [] and _compile._POOL is None
    monkeypatch.delenv("DLM_JAX_COMPILE_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert background_workers() == 0  # two cores: compiles wait for their first use
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert background_workers() == 4
    assert background_workers(backend="cpu") == 4
    # On an accelerator too: more threads made a GPU's first needed bucket wait behind the rest.
    assert background_workers(backend="gpu") == 4
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert background_workers(backend="tpu") == 0
    monkeypatch.setenv("DLM_JAX_COMPILE_THREADS", "two")
    with pytest.raises(ConfigError, match="DLM_JAX_COMPILE_THREADS='two' must be a whole number"):
        background_workers()


@pytest.mark.parametrize("name", ["fast-dllm", "llada-cpp"])
def test_a_decode_with_background_compiles_gives_the_same_tokens(threads, name):
    cfg = preset(name, gen_len=32)
    prompts = [[5, 17, 3, 44, 9], [8, 1]]
    model = sharp_model(seed=5)
    plain = JaxExecutor(model)
    plain.prefetch = Executor.prefetch.__get__(plain)  # the default: compile on first use
    lazy = Decoder(plain, model.config).decode(prompts, cfg)
    assert lazy.stats.compile_wait_seconds >= lazy.stats.compile_seconds  # every compile waited for
    ahead = Decoder(JaxExecutor(model), model.config).decode(prompts, cfg)
    for a, b in zip(lazy.sequences, ahead.sequences):
        np.testing.assert_array_equal(a, b)
    assert ahead.stats.counters == lazy.stats.counters and ahead.stats.nfe == lazy.stats.nfe
    stats = ahead.stats.to_dict()
    assert stats["compiles"] >= len(ahead.stats.buckets)
    assert 0 < stats["compile_wait_seconds"] <= 1.1 * stats["compile_seconds"] + 0.05  # (and its overhead)


@pytest.mark.parametrize("cache, batch", [("prefix", 1), ("dual", 2)])
def test_a_decode_prefetches_exactly_its_buckets_in_the_order_it_reaches_them(cache, batch):
    """Guards a first decode that waits for more than its own buckets: background threads
    busy with buckets it never uses, or reaching its next bucket after one it needs later
    (a fresh process then waits for compiles one after another, 35.7 s at LLaDA-8B on a GPU).
    The buckets handed to `prefetch` when the decode starts are the ones its steps run, in
    the order of their first step."""
    model = sharp_model(seed=2, eos_token_id=None)
    ex = JaxExecutor(model)
    handed: list = []
    ex.prefetch = lambda keys, **kw: handed.extend(keys) or (lambda: None)
    cfg = preset("fast-dllm", cache=cache, gen_len=24, block_len=8, rule="threshold", threshold=0.9)
    out = Decoder(ex, model.config).decode([[5, 17, 3, 44, 9], [8, 1]][:batch], cfg)
    assert len(out.stats.buckets) >= 2
    assert [str(k) for k in handed] == list(out.stats.buckets)  # dicts keep the order of first use


@pytest.mark.parametrize("cache, prompts, padding, batch", [("prefix", [[5, 17, 3, 44, 9]], "pad", 1),
                                                           ("dual", [[8, 1, 4], [8, 1, 4]], "pad", 2),
                                                           ("dual", [[8, 1, 4], [8, 1, 4]], None, 4)])
def test_an_engine_prefetches_exactly_its_calls_buckets_in_the_order_it_reaches_them(cache, prompts, padding, batch):
    """An engine's requests (what `Model.generate`, the commands and the server run) hand the
    executor their calls' programs when they are admitted (`Executor.prefetch_engine`), as a
    decode hands its own (above): without it a fresh process's first request compiled, or
    loaded from the persistent cache, each program only when its step reached it, one after
    another. Requests admitted together are handed at the batch of their shared calls (a CPU's
    default padding, "free", runs every call at the engine's largest batch)."""
    from dlm_jax.runtime.engine import Engine

    model = sharp_model(seed=2, eos_token_id=None)
    ex = JaxExecutor(model)
    handed: list = []
    ex.prefetch_engine = lambda keys, **kw: handed.append((list(keys), kw)) or (lambda: None)
    cfg = preset("fast-dllm", cache=cache, gen_len=24, block_len=8, rule="threshold", threshold=0.9)
    engine = Engine(Decoder(ex, model.config), max_batch=4, max_tokens=64, padding=padding)
    handles = [engine.submit(p, cfg) for p in prompts]
    engine.run()
    assert all(h.status == "done" for h in handles) and len(engine.stats.buckets) >= 2
    ((keys, kw),) = handed  # one hand-over: the requests were admitted together
    assert kw == {"slots": 64, "rows": 4}
    assert {k.batch for k in keys} == {batch}
    assert [str(k) for k in keys] == list(engine.stats.buckets)  # (in the order of first use)


@pytest.mark.parametrize("name", ["fast-dllm", "llada-cpp"])
def test_an_engine_with_background_compiles_gives_the_same_tokens(threads, name, monkeypatch):
    """The engine's requests with their programs built ahead on a background thread (llada.cpp's
    CPU path's too) decode the tokens they decode with every program compiled on first use,
    and their steps waited for less than all the compiling."""
    from dlm_jax.runtime.engine import Engine

    cfg = preset(name, gen_len=32)
    prompts = [[5, 17, 3, 44, 9], [8, 1]]
    model = sharp_model(seed=5)
    out = []
    handed = []
    for ahead in (False, True):
        with monkeypatch.context() as m:
            if ahead:  # (the CPU path's fork is a JaxExecutor too)
                real = JaxExecutor.prefetch_engine
                m.setattr(JaxExecutor, "prefetch_engine", lambda self, keys, **kw: handed.append(kw.get("views", False))
                          or real(self, keys, **kw))
            else:  # the default: compile on first use
                m.setattr(JaxExecutor, "prefetch_engine", Executor.prefetch_engine)
            ex = JaxExecutor(model)
            engine = Engine(Decoder(ex, model.config), max_batch=2, max_tokens=64)
            handles = [engine.submit(p, cfg) for p in prompts]
            engine.run()
        out.append(([h.result() for h in handles], ex._resident.compile_count, ex._resident.wait_seconds,
                     ex._resident.compile_seconds))
    assert handed == ([False, True] if name == "llada-cpp" else [False])  # (llada.cpp: its CPU path's views)
    (lazy, n_lazy, waited_lazy, compiled_lazy), (eager, n_eager, waited, compiled) = out
    assert [list(t) for t in eager] == [list(t) for t in lazy] and n_eager >= n_lazy >= 1
    assert waited_lazy >= compiled_lazy  # every compile waited for
    if name == "fast-dllm":  # (llada.cpp's main steps: one program, its wait about its compile)
        assert waited < compiled, (waited, compiled)  # (measured: 0.74-0.76 of it here)

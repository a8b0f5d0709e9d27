"""The runtime's protocols: every hook declared by a base class with a no-op default, a
misspelt or misdeclared hook refused when its class is defined, the loop calling the hooks in
the documented order with no lookup by name, and `DecodeState` owning its transitions."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from dlm_jax import ConfigError
from dlm_jax.runtime import DecodeState, Decoder, TokenState, decode_config, preset
from dlm_jax.runtime import registry
from dlm_jax.runtime.commit import CommitRule, PerStepRule, ThresholdRule, TopKRule, TopKSchedule
from dlm_jax.runtime.hooks import HookError
from dlm_jax.runtime.placement import PlacementPolicy
from dlm_jax.runtime.revision import NoRevision, RevisionPolicy
from dlm_jax.runtime.scheduler import PrefixCache, Scheduler, StepPlan
from dlm_jax.techniques.lladacpp.dppr import ProgressiveRevision
from dlm_jax.techniques.lladacpp.mbsd import SpeculativeWindow
from dlm_jax.runtime.state import TRANSITIONS, StateError
from dlm_jax.runtime.step import Executor
from dlm_jax.testing import MockExecutor, tiny_config

ROOT = Path(__file__).resolve().parents[2]
S = TokenState


# --------------------------------------------------------------------------- declared hooks


@pytest.mark.parametrize("base, name", [(PrefixCache, "setle"), (Scheduler, "advence"), (NoRevision, "after_stpe"),
                                        (RevisionPolicy, "cpu_paths"), (PlacementPolicy, "before_step_"),
                                        (MockExecutor, "forks"), (Executor, "warm_up"),
                                        (SpeculativeWindow, "looked_ahed"), (CommitRule, "selct"),
                                        (PerStepRule, "finshed"), (ThresholdRule, "max_step"),
                                        (TopKSchedule, "begn"), (TopKRule, "chek")])
def test_a_misspelt_hook_is_refused_when_its_class_is_defined(base, name):
    with pytest.raises(HookError, match=f"{name}.*misspelling of the hook"):
        type("Custom", (base,), {name: lambda self, *a, **k: None})


def test_every_commit_rule_derives_from_the_hook_base():
    """Guards a rule that matches `CommitRule` only structurally: its hooks go unchecked."""
    rules = [*registry.RULES.values(), TopKRule, PerStepRule]
    assert all(CommitRule in cls.__mro__ for cls in rules), [c for c in rules if CommitRule not in c.__mro__]


def test_a_hook_with_renamed_or_extra_required_parameters_is_refused():
    with pytest.raises(HookError, match=r"settle .*missing \['state'\]"):
        class A(PrefixCache):
            def settle(self, st, plan, proposal, cursor):
                return None
    with pytest.raises(HookError, match=r"after_probes .*missing \['top'\]"):
        class B(NoRevision):
            def after_probes(self, state, plan, probed, *, tops, prob):
                return None
    with pytest.raises(HookError, match=r"required extras \['budget'\]"):
        class C(PlacementPolicy):
            def after_step(self, state, plan, outputs, budget):
                return None

    with pytest.raises(HookError, match=r"begin .*missing \['units'\]"):
        class D(PerStepRule):
            def begin(self, candidates):
                return self
    with pytest.raises(HookError, match=r"select .*missing \['candidates'\]"):
        class E(ThresholdRule):
            def select(self, confidence, *, step=0):
                return confidence > 0

    class Fine(PrefixCache):  # the same parameters, a helper of its own: accepted
        def settle(self, state, plan, proposal, cursor):
            return None

        def _settle_helper(self):
            return None


def test_a_config_refuses_a_strategy_outside_its_protocol():
    class Duck:  # has the methods, not the declaration
        def after_step(self, state, plan, proposal, committed):
            return None

    with pytest.raises(ConfigError, match="revision=.* is not a RevisionPolicy"):
        decode_config(revision=Duck())

    class DuckRule:  # a commit rule's methods, not its declaration
        def begin(self, candidates, *, units):
            return self

        def select(self, confidence, candidates, *, step=0):
            return candidates

        def finished(self, steps, remaining):
            return not remaining.any()

        def max_steps(self, width):
            return width

        def check(self, *, units, gen_len=None):
            return None

    with pytest.raises(ConfigError, match="rule=.* is not a CommitRule"):
        decode_config(rule=DuckRule())


def test_the_loop_looks_up_no_hook_by_name():
    """No getattr / hasattr in the decode loop, the strategies or the CLI's executor handling."""
    for path in ["dlm_jax/runtime/decoder.py", "dlm_jax/runtime/revision.py", "dlm_jax/runtime/cpu_path.py",
                 "dlm_jax/techniques/lladacpp/dppr.py", "dlm_jax/techniques/lladacpp/refresh.py",
                 "dlm_jax/techniques/lladacpp/mbsd.py", "dlm_jax/runtime/scheduler.py", "dlm_jax/runtime/placement.py",
                 "dlm_jax/runtime/inputs.py", "dlm_jax/frontends/cli.py"]:
        tree = ast.parse((ROOT / path).read_text())
        calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        assert "hasattr" not in calls, path
        if path != "dlm_jax/frontends/cli.py":  # the CLI reads argparse namespaces with getattr
            assert "getattr" not in calls or path.endswith(("mbsd.py", "dppr.py")), path


def test_every_plan_field_is_read():
    """No dead plan fields: every field of `StepPlan` is read (an attribute load `.field`) in
    the package outside the class itself and outside the keyword arguments that build plans
    (`StepPlan(...)`, `dataclasses.replace(...)`). Guards a field the schedulers compute every
    step that nothing consumes (`store_stable` was one: an `is_final` gather per storing step,
    and a contract a reader would trust that no code kept)."""
    fields = {f.name for f in dataclasses.fields(StepPlan)}
    read: set[str] = set()
    for path in (ROOT / "dlm_jax").rglob("*.py"):
        tree = ast.parse(path.read_text())
        building: set[int] = set()  # nodes of the class body and of the arguments that build plans
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "StepPlan":
                building.update(id(n) for n in ast.walk(node))
            elif isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if name in ("StepPlan", "replace"):
                    building.update(id(n) for kw in node.keywords for n in ast.walk(kw.value))
        read |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
                 and id(n) not in building}
    assert fields <= read, f"StepPlan fields nothing reads: {sorted(fields - read)}"


# --------------------------------------------------------------------------- call order


def _recording(log):
    @dataclasses.dataclass(frozen=True)
    class Sched(PrefixCache):
        def start(self, state):
            log.append("scheduler.start")
            return super().start(state)

        def plan(self, state, cursor):
            log.append("scheduler.plan")
            return super().plan(state, cursor)

        def settle(self, state, plan, proposal, cursor):
            log.append("scheduler.settle")
            return None

        def advance(self, state, cursor, unit_done):
            log.append("scheduler.advance")
            super().advance(state, cursor, unit_done)

    @dataclasses.dataclass(frozen=True)
    class Rev(RevisionPolicy):
        def cpu_path(self, executor, config, proposer=None):
            log.append("revision.cpu_path")
            return None

        def probe(self, state, plan):
            log.append("revision.probe")
            return plan, None

        def commit(self, state, plan, proposal, committed):
            log.append("revision.commit")
            super().commit(state, plan, proposal, committed)

        def after_step(self, state, plan, proposal, committed):
            log.append("revision.after_step")

    @dataclasses.dataclass(frozen=True)
    class Place(PlacementPolicy):
        def begin(self, state, model):
            log.append("placement.begin")
            return "record"

        def before_step(self, record, state, plan):
            assert record == "record"
            log.append("placement.before_step")

        def after_step(self, record, state, plan, outputs):
            log.append("placement.after_step")

        def end(self, record, state):
            log.append("placement.end")
            return {}

    class Exe(MockExecutor):
        def step(self, inputs, *, timings=None):
            log.append("executor.step")
            return super().step(inputs)

    return Sched(block_len=4), Rev(), Place(), Exe


def test_hooks_are_called_in_the_documented_order():
    log: list[str] = []
    sched, rev, place, exe_cls = _recording(log)
    cfg = tiny_config()
    exe = exe_cls(cfg, answer=np.full(cfg.max_seq_len, 7), confidence=np.full(cfg.max_seq_len, 0.99))
    dc = dataclasses.replace(decode_config(gen_len=4, block_len=4), scheduler=sched, revision=rev, placement=place)
    Decoder(exe, cfg).decode([[1, 2, 3]], dc)
    step = ["scheduler.plan", "revision.probe", "placement.before_step", "executor.step", "scheduler.settle",
            "revision.commit", "revision.after_step", "placement.after_step", "scheduler.advance"]
    assert log == ["scheduler.start", "revision.cpu_path", "placement.begin", *step, "scheduler.plan",
                   "placement.end"]


# --------------------------------------------------------------------------- state transitions


def _state():
    return DecodeState.create([[1, 2]], gen_len=6, batch=1, mask_id=63, vocab_size=64)


def test_state_moves_follow_iv_v_s():
    st, slots = _state(), np.arange(2, 8)
    pick = lambda *i: np.isin(np.arange(6), i)[None, :]  # noqa: E731
    tok = np.full((1, 6), 9)
    st.draft(slots, pick(0, 1), tok, visible=True)
    st.draft(slots, pick(2), tok, visible=False)
    assert st.status[0, 2:5].tolist() == [S.DRAFT, S.DRAFT, S.CANDIDATE]
    st.demote(slots, pick(1))
    st.make_visible(slots, pick(0, 2), tok)
    st.commit(slots, pick(3), tok)
    assert st.status[0, 2:6].tolist() == [S.VISIBLE, S.MASK, S.VISIBLE, S.STABLE]
    st.revise(slots, pick(0), np.full((1, 6), 10))
    st.promote(slots, pick(2))
    assert st.tokens[0, 2] == 10 and st.status[0, 2:6].tolist() == [S.VISIBLE, S.MASK, S.STABLE, S.STABLE]
    # Nothing returns to IV from V or S, and V / S are not committed twice.
    for move in (lambda: st.commit(slots, pick(0), tok), lambda: st.make_visible(slots, pick(3), tok),
                 lambda: st.demote(slots, pick(0)), lambda: st.promote(slots, pick(1)),
                 lambda: st.revise(slots, pick(3), tok), lambda: st.draft(slots, pick(0), tok, visible=True)):
        before = (st.status.copy(), st.tokens.copy())
        with pytest.raises(StateError, match="cannot move to"):
            move()
        assert (st.status == before[0]).all() and (st.tokens == before[1]).all()  # refused whole
    assert not TRANSITIONS[S.STABLE].any() and not TRANSITIONS[S.VISIBLE, [S.MASK, S.CANDIDATE, S.DRAFT]].any()


def test_the_llada_cpp_preset_moves_states_only_through_the_state():
    """A full llada.cpp decode (drafts, visible, stable, revisions) raises no StateError."""
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    exe = MockExecutor(cfg, answer=rng.integers(3, 60, cfg.max_seq_len),
                       confidence=rng.uniform(0.5, 1.0, cfg.max_seq_len))
    out = Decoder(exe, cfg).decode([[1, 2, 3], [4, 5]], preset("llada-cpp", gen_len=32, block_len=8))
    assert out.stats.counters.get("visible_made", 0) > 0
    assert isinstance(preset("llada-cpp").revision, ProgressiveRevision)

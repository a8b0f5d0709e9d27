"""The swap-optimized memory planner on the real llada-tiny step and an analytic LLaDA-8B step.

A plan that lets two live tensors share bytes, or refills a staging slot its consumer is still
reading, would feed the NPU overwritten data and produce wrong tokens with no error anywhere:
`check_plan` must accept every plan the planner makes and reject each kind of corruption.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from dlm_jax import ModelConfig
from dlm_jax._errors import ConfigError
from dlm_jax.runtime.buckets import BucketKey
from dlm_jax.lowering.costs import MB, CostModel
from dlm_jax.lowering._analytic import analytic_graph
from dlm_jax.lowering.graph import StepGraph, read_tflite_graph
from dlm_jax.techniques.lladacpp.somr import MemoryPlan, PlanError, Staged, check_plan, plan_bundle, plan_memory, simulate
from dlm_jax.techniques.lladacpp.paging import paging_only
from dlm_jax.lowering.partition import partition
from tests.lowering._tiny_step import KEYS, tiny_step
from dlm_jax.tflite_export import decode_signature_name

LLADA_8B = ModelConfig(vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=12288,
                       dtype="float16", param_dtype="float16")
STAGING = 200 * 1024  # ~256 MB scaled by the tiny model's share of LLaDA-8B's NPU weights


def npu_graph(graph: StepGraph) -> StepGraph:
    return graph.subgraph(partition(graph).npu_ops)


@pytest.fixture(scope="module")
def tiny() -> StepGraph:
    _, content = tiny_step()
    return npu_graph(read_tflite_graph(content, decode_signature_name(KEYS[0])))


@pytest.fixture(scope="module")
def big() -> StepGraph:
    return npu_graph(analytic_graph(LLADA_8B, BucketKey(1, 32, 512, 32), weight_bytes_per_param=18 / 32,
                                    vector_bytes_per_param=4))


@pytest.fixture(scope="module")
def starved(tiny) -> MemoryPlan:
    """No resident weights: every weight streams through the slots."""
    return plan_memory(tiny, weight_budget=0, staging_bytes=STAGING)


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.9, 1.0, None])
def test_plans_pass_the_checker(tiny, fraction):
    budget = None if fraction is None else int(fraction * tiny.weight_bytes())
    plan = plan_memory(tiny, weight_budget=budget, staging_bytes=STAGING)
    check_plan(plan, tiny)
    assert plan.resident_weight_bytes <= plan.weight_budget and plan.va_used <= plan.va_budget
    assert {t for t, _ in plan.kv.tensors} == {t for t in tiny.lifetimes() if tiny.tensors[t].kind == "kv"}
    if fraction == 1.0 or fraction is None:
        assert not plan.staged and plan.timeline.stall_s == 0


def test_plans_in_a_fixed_va_budget_pass_the_checker(tiny, big):
    full = plan_memory(tiny, staging_bytes=STAGING)
    for va in (full.va_budget, full.va_budget // 2, full.va_budget // 4):
        check_plan(plan_memory(tiny, va_budget=va, staging_bytes=STAGING), tiny)
    for fraction in (0.0, 0.5):
        check_plan(plan_memory(big, weight_budget=int(fraction * big.weight_bytes())), big)


def test_weight_budget_zero_streams_every_weight_in_alternating_chunks(tiny, starved):
    assert starved.resident == () and starved.weight_budget == 0
    assert [s.slot for s in starved.staged] == [k % 2 for k in range(len(starved.staged))]
    assert all(s.nbytes <= starved.slot_bytes for s in starved.staged)
    ffn = [s for s in starved.staged if s.chunks > 1]
    assert ffn and all(sum(x.nbytes for x in starved.staged if x.op == s.op) == 384 * 128 * 4 for s in ffn)
    staged_bytes = sum(s.nbytes for s in starved.staged)
    assert staged_bytes == sum(tiny.tensors[w].nbytes for w in tiny.used_weights() if tiny.tensors[w].nbytes >= 1024)
    t = starved.timeline
    assert t.step_s == pytest.approx(t.compute_s + t.stall_s) and 0 < t.stall_s <= t.staging_s


def test_resident_weights_are_packed_in_consumption_order(tiny):
    plan = plan_memory(tiny, weight_budget=tiny.weight_bytes() // 2, staging_bytes=STAGING, mapping_bytes=256 * 1024)
    order = {w: i for i, w in enumerate(tiny.used_weights())}
    placed = [(offset, t) for region in plan.resident for t, offset in region.tensors]
    assert [t for _, t in sorted(placed)] == sorted((t for _, t in placed), key=order.get)
    assert len(plan.resident) > 1 and all(r.size <= 256 * 1024 for r in plan.resident)
    ends = [(r.offset, r.offset + r.size) for r in plan.resident]
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))  # adjacent mappings, no holes


def test_demotion_is_nested_and_staging_time_grows_as_the_budget_shrinks(big):
    plans = [plan_memory(big, weight_budget=int(f * big.weight_bytes())) for f in (1.0, 0.75, 0.5, 0.25, 0.0)]
    for larger, smaller in zip(plans, plans[1:]):
        assert set(larger.demoted) <= set(smaller.demoted)
        assert larger.timeline.staging_s <= smaller.timeline.staging_s
        assert larger.timeline.stall_s <= smaller.timeline.stall_s + 1e-9
    assert plans[0].timeline.stall_s == 0 and plans[-1].resident == ()


def test_planner_completes_where_paging_only_fails(tiny, starved):
    check_plan(starved, tiny)
    paging = paging_only(tiny, va_budget=starved.va_budget)
    assert not paging.ok and "cannot map" in paging.reason and paging.failed_op in starved.op_index


def test_planner_stalls_less_than_paging_only(tiny, big):
    for graph, staging in ((big, 256 * MB), (tiny, STAGING)):
        plan = plan_memory(graph, weight_budget=graph.weight_bytes() // 2, staging_bytes=staging)
        paging = paging_only(graph, va_budget=plan.va_budget)
        assert paging.ok and plan.timeline.stall_s < paging.stall_s
        assert plan.timeline.step_s < paging.step_s


def test_plan_json_round_trip(tiny, starved):
    again = MemoryPlan.from_json(starved.to_json())
    assert again == starved
    check_plan(again, tiny)
    assert json.loads(starved.to_json())["staged"][0]["slot"] == 0


def test_budget_below_kv_scratch_and_staging_names_both_numbers(tiny, starved):
    with pytest.raises(ConfigError, match=r"VA budget 0\.0954 MB is smaller than the KV cache 0\.188 MB \+ "
                                          r"scratch [0-9.]+ MB \+ staging 0\.188 MB"):
        plan_memory(tiny, va_budget=100_000, staging_bytes=2 * 96 * 1024 + 100)


def corrupt(plan: MemoryPlan, **changes) -> MemoryPlan:
    return dataclasses.replace(plan, **changes)


def test_checker_rejects_overlapping_live_tensors(tiny, starved):
    entries = list(starved.scratch)
    a, b = next((i, j) for i, x in enumerate(entries) for j, y in enumerate(entries)
                if i < j and x.first <= y.last and y.first <= x.last and x.offset != y.offset)
    entries[b] = dataclasses.replace(entries[b], offset=entries[a].offset)
    with pytest.raises(PlanError, match="'overlap'"):
        check_plan(corrupt(starved, scratch=tuple(entries)), tiny)


def test_checker_rejects_a_slot_refilled_while_live(tiny, starved):
    staged = list(starved.staged)
    staged[3] = dataclasses.replace(staged[3], prefetch_after=0)  # slot 1 still holds chunk 1
    with pytest.raises(PlanError, match="'slot occupancy'.*chunk 1 still occupies"):
        check_plan(corrupt(starved, staged=tuple(staged)), tiny)


def test_checker_rejects_non_alternating_slots(tiny, starved):
    staged = list(starved.staged)
    staged[1] = dataclasses.replace(staged[1], slot=0)
    with pytest.raises(PlanError, match="'slot alternation'"):
        check_plan(corrupt(starved, staged=tuple(staged)), tiny)


def test_checker_rejects_budget_and_coverage_breaks(tiny):
    plan = plan_memory(tiny, weight_budget=tiny.weight_bytes() // 2, staging_bytes=STAGING)
    with pytest.raises(PlanError, match="'budget'"):
        check_plan(corrupt(plan, va_budget=plan.va_used - 1), tiny)
    with pytest.raises(PlanError, match="'coverage'"):
        check_plan(corrupt(plan, resident=plan.resident[1:]), tiny)
    big_chunk = dataclasses.replace(plan.staged[0], nbytes=plan.slot_bytes + 1)
    with pytest.raises(PlanError, match="'slot size'"):
        check_plan(corrupt(plan, staged=(big_chunk,) + plan.staged[1:]), tiny)


def test_event_simulation_by_hand():
    """Ops of 1 s; transfers of n bytes take n s. Chunk 0 (2 B, op 1) is ready at 2 s: op 1
    waits 1 s. Chunk 1 (op 2) follows on the engine, ready at 3 s = when op 2 starts. Chunk 2
    reuses slot 0 once op 1 ends (3 s), is ready at 4 s = when op 3 starts."""
    cost = CostModel(staging_bandwidth=1.0, map_cost_s=0.0)
    staged = [Staged(0, 1, 0, 1, (), 2, 0, -1), Staged(1, 2, 0, 1, (), 1, 1, -1), Staged(2, 3, 0, 1, (), 1, 0, 0)]
    t = simulate([1.0] * 4, staged, cost)
    assert (t.step_s, t.stall_s, t.staging_s, t.op_stall_s) == (5.0, 1.0, 4.0, (0.0, 1.0, 0.0, 0.0))


def test_plan_bundle_is_fast_json_and_checks():
    config, content = tiny_step()
    start = time.perf_counter()
    bundle = plan_bundle(content, config, KEYS, va_budget=2 * MB, staging_bytes=STAGING)
    assert time.perf_counter() - start < 2.0
    bundle = json.loads(json.dumps(bundle))
    assert set(bundle["signatures"]) == {decode_signature_name(k) for k in KEYS}
    for name, entry in bundle["signatures"].items():
        graph = read_tflite_graph(content, name)
        plan = MemoryPlan.from_dict(entry["memory"])
        npu = graph.subgraph([i for i, d in zip(entry["partition"]["op_index"], entry["partition"]["devices"])
                              if d == "npu"])
        check_plan(plan, npu)
        assert plan.va_budget == 2 * MB and plan.staged  # the budget forces streaming

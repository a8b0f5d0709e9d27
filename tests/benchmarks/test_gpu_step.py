"""benchmarks/gpu_step.py at a small shape on the CPU: the cost analysis, step times and kernel
profile it reports come from the programs it compiles, and the geometry of its three steps is
the decode's (a window that drifts from the setting would time another step)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_step  # noqa: E402


def test_the_three_steps_cover_the_sequence_once():
    """refresh: every slot in the window; prefix: the slots before the block read, the rest in
    the window; dual: the block in the window, every other slot read; the wanted rows are the
    block's in every case."""
    for kind in gpu_step.KINDS:
        geo = gpu_step.Geometry(kind)
        win, read = geo.window(), geo.read()
        assert not set(win) & set(read)
        covered = np.sort(np.concatenate([win, read]))
        assert kind == "prefix" or np.array_equal(covered, np.arange(geo.total)), kind
        start = geo.prompt + geo.at * geo.block
        np.testing.assert_array_equal(win[geo.rows()], np.arange(start, start + geo.block))
    assert len(gpu_step.Geometry("dual").window()) == 32
    assert len(gpu_step.Geometry("prefix").window()) == 128


def test_abstract_mode_lowers_from_shapes(tmp_path):
    """--abstract makes no weights and still reports the compiled step's cost analysis, of the
    weight-only int8 model too (its weights abstract as well: half the bytes or less)."""
    out = tmp_path / "cost"
    assert gpu_step.main(["--shape", "small", "--abstract", "--batches", "1", "--kinds", "dual", "--threads", "1",
                          "--quant", "none", "int8", "--out", str(out)]) == 0
    case, int8 = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert case["bytes_over_weights"] > 0.5 and case["hlo_bytes_over_weights"] > 0.5 and "step_ms" not in case
    assert int8["quant"] == "int8" and "error" not in int8 and int8["bytes_accessed"] > 0
    assert int8["weight_bytes"] < 0.6 * case["weight_bytes"]


def test_a_kernel_suffix_is_pallas_or_dense_and_needs_a_gpu(tmp_path):
    """'+pallas' and '+dense' (the quantized and the dense products in dlm-jax's kernel) are a
    row's error off a GPU without --target; any other suffix stops the run in one line."""
    out = tmp_path / "k"
    assert gpu_step.main(["--shape", "small", "--abstract", "--batches", "1", "--kinds", "dual", "--threads", "1",
                          "--quant", "none+dense", "int8-g16+pallas+dense", "--out", str(out)]) == 0
    dense, both = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert dense["error"] == "none+dense: the Pallas kernel is compiled by Triton for a GPU (or --target)"
    assert both["quant"] == "int8-g16+pallas+dense" and "Triton" in both["error"]
    with pytest.raises(SystemExit, match=r"^--quant none\+triton: unknown kernel 'triton' \(after '\+': pallas, "
                                         r"dense\)$"):
        gpu_step.main(["--shape", "small", "--abstract", "--quant", "none+triton", "--out", str(out)])


@pytest.mark.slow  # (5 s: the script's timing path on a CPU; its cost-analysis and --target paths run by default)
def test_a_backend_without_cost_analysis_still_times_the_step(tmp_path, monkeypatch):
    """XLA:GPU answers `cost_analysis()` of a lowered program with None (jax 0.11.2 on an H200):
    once that turned every case of a lease into an error and nothing was timed. Both analyses
    failing must leave the case timed, the failure named. The program's first execution (its
    kernels loaded; on a GPU its command buffers recorded), which a process's first decode pays
    once per program, is timed apart from the steady steps."""
    import jax

    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)

    def refuse(self):
        raise NotImplementedError("no cost model here")

    monkeypatch.setattr(jax.stages.Compiled, "cost_analysis", refuse)
    out = tmp_path / "step"
    assert gpu_step.main(["--shape", "small", "--dtype", "float32", "--batches", "1", "--kinds", "dual", "--reps", "1",
                          "--threads", "1", "--out", str(out)]) == 0
    (case,) = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert "error" not in case and case["step_ms"] > 0 and case["first_call_ms"] > 0
    assert 0 < case["empty_call_ms"] < case["step_ms"]  # a call that computes nothing: the step's overhead
    assert case["request_fields_ms"] > 0 and case["request_packed_ms"] > 0  # the request's transfers, both ways
    assert "| first call ms |" in out.with_suffix(".md").read_text()
    assert case["bytes_over_weights"] is None and case["hlo_bytes_over_weights"] is None
    assert "NotImplementedError" in case["compiled_cost_error"] and "NoneType" in case["traced_cost_error"]


@pytest.mark.slow
def test_small_shape_reports_costs_times_and_kernels(tmp_path):
    out = tmp_path / "step"
    assert gpu_step.main(["--shape", "small", "--dtype", "float32", "--batches", "1", "--kinds", "dual", "refresh",
                          "--attention", "split", "gather", "--reps", "2", "--profile", "--profile-steps", "1",
                          "--threads", "2", "--out", str(out)]) == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    assert {(c["kind"], c["attention"]) for c in rep["cases"]} == {
        (k, a) for k in ("dual", "refresh") for a in ("split", "gather")}
    for case in rep["cases"]:
        assert "error" not in case, case
        assert case["bytes_over_weights"] > 0.5 and case["flops_over_dense"] > 0.5, case
        assert case["step_ms"] > 0 and case["weight_read_ms"] > 0
        assert case["profile"]["top"] and abs(sum(k["share"] for k in case["profile"]["top"])) <= 1.0 + 1e-9
        kinds = case["profile"]["kinds"]  # every kernel's time, by kind: the matrix products among them
        assert abs(sum(k["share"] for k in kinds) - 1.0) < 1e-9 and "gemm" in {k["kind"] for k in kinds}
    md = out.with_suffix(".md").read_text()
    assert "Kernels, b1 dual split" in md and "outside the kernels" not in md  # (a CPU's traced ops: not device kernels)
    for case in rep["cases"]:  # as a device's profile: the step's time outside its kernels, and the empty call's
        case["profile"]["source"] = "device"
    out.with_suffix(".json").write_text(json.dumps(rep))
    assert gpu_step.main(["--render", str(out.with_suffix(".json")), "--out", str(tmp_path / "again")]) == 0
    case = rep["cases"][0]
    assert (f"kernels per step; the step {case['step_ms']:.2f} ms, "
            f"{case['step_ms'] - case['profile']['kernel_ms_per_step']:.2f} ms of it outside the kernels; a call of a "
            f"program that takes the step's arguments and computes nothing: {case['empty_call_ms']:.3f} ms; the "
            f"request sent and the predictions read back as ten and four arrays {case['request_fields_ms']:.3f} ms, "
            f"packed as one and one {case['request_packed_ms']:.3f} ms") in (tmp_path / "again.md").read_text()


def test_at_every_block_compiles_the_programs_a_prefix_cache_decode_reaches(tmp_path):
    """The compile probe (`--kinds refresh prefix --at 0 .. 7`) stands for a cold first decode
    only if it compiles that decode's programs, no more and no fewer: its buckets against the
    decoder's own list for a prefix-cache decode of the setting (prompt 128, generation 256,
    block 32), each program once."""
    import dlm_jax
    from dlm_jax.executors.jax_executor import JaxExecutor
    from dlm_jax.runtime.decoder import Decoder

    model = gpu_step.random_model(gpu_step.model_config("small", "float32"))
    executor = JaxExecutor(model)
    args = gpu_step.parse_args(["--batches", "1", "--kinds", "refresh", "prefix", "--at", *map(str, range(8))])
    probed = [str(req.key) for req in gpu_step.probe_steps(executor, args.batches, args.kinds, args.at).values()]
    decoder = Decoder(executor, model.config)
    cfg = dlm_jax.decode_config(gen_len=256, block_len=32, cache="prefix", rule="threshold", threshold=0.9)
    reached = {str(k) for k in decoder.bucket_keys([128], cfg)}
    assert len(probed) == len(set(probed)) == 9 and set(probed) == reached


@pytest.mark.slow
def test_runs_that_compiled_differently_render_with_a_column_saying_how(tmp_path, monkeypatch):
    """The compile probe's three runs differ only in how they compile (the persistent cache,
    XLA_FLAGS): rendered together, rows of one bucket would be indistinguishable without the
    column naming each row's compile setting."""
    argv = ["--shape", "small", "--abstract", "--batches", "1", "--kinds", "prefix", "--at", "0", "7",
            "--threads", "1"]
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # (the test passes set flags of their own: tests/conftest.py)
    assert gpu_step.main([*argv, "--out", str(tmp_path / "a")]) == 0
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert gpu_step.main([*argv, "--out", str(tmp_path / "b")]) == 0
    alone = (tmp_path / "a.md").read_text()
    assert "| compiles |" not in alone and "Compiles: 1 threads, persistent cache off, XLA_FLAGS unset." in alone
    assert gpu_step.main(["--render", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out",
                          str(tmp_path / "ab")]) == 0
    md = (tmp_path / "ab.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| 1 | prefix")]
    assert "| compiles |" in md and len(rows) == 4
    assert [("XLA_FLAGS unset" in r, "--xla_gpu_autotune_level=0" in r) for r in rows] == [(True, False)] * 2 + [
        (False, True)] * 2
    # A run at another model shape (here a's result relabelled) rendered beside them: each row names its shape.
    other = json.loads((tmp_path / "a.json").read_text()) | {"shape": "gqa-8b"}
    (tmp_path / "c.json").write_text(json.dumps(other))
    assert "| shape |" not in md
    assert gpu_step.main(["--render", str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--out",
                          str(tmp_path / "ac")]) == 0
    md = (tmp_path / "ac.md").read_text()
    assert md.startswith("# The decode step at the small and gqa-8b shapes:") and "| shape | batch |" in md
    assert [line[:16] for line in md.splitlines() if "| 1 | prefix" in line] == ["| small | 1 | pr"] * 2 + [
        "| gqa-8b | 1 | p"] * 2



@pytest.mark.slow  # (4 s; the fused executor's own tests run by default, tests/executors/test_fused_projections.py)
def test_fused_projections_run_over_weights_of_their_own(tmp_path):
    """`--projections separate fused` (the lease's `fused` part): fusing changes a model in place,
    so a separate variant run after a fused one (or a scan after either) over the same weights
    would measure the fused model twice, under two names; the cached abstract model other
    callers share must stay as built."""
    from dlm_jax.models._params import param_shapes

    out = tmp_path / "fused"
    assert gpu_step.main(["--shape", "small", "--abstract", "--batches", "1", "--kinds", "dual",
                          "--projections", "fused", "separate", "--layers", "scan", "unrolled",
                          "--threads", "1", "--out", str(out)]) == 0
    cases = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert [(c["projections"], c["layers"]) for c in cases] == [
        (p, lay) for p in ("fused", "separate") for lay in ("unrolled", "scan")]
    assert all("error" not in c for c in cases) and len({c["weight_bytes"] for c in cases}) == 1
    md = out.with_suffix(".md").read_text()
    assert "| projections |" in md and "| unrolled | fused |" in md and "| scan | separate |" in md
    cfg = gpu_step.model_config("small", "bfloat16")
    assert "layers.0.attn.q_proj.kernel" in param_shapes(cfg)


def test_hlo_kernels_counts_a_loops_body_as_often_as_it_runs():
    """`hlo_kernels` reads a compiled program's launches from its optimized HLO: the entry's
    kernels once, a loop body's once per trip (XLA's known trip count), by kind."""
    import jax
    import jax.numpy as jnp

    from _profile import hlo_kernels

    def counts(trips: int) -> dict:
        def f(x, w):
            return jax.lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c) * 2.0 + c @ w, x @ w)

        return hlo_kernels(jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile().as_text())

    five, nine = counts(5), counts(9)
    assert five["by_kind"]["gemm"]["kernels"] == 6 and nine["by_kind"]["gemm"]["kernels"] == 10  # 1 + one a trip
    assert nine["kernels"] - five["kernels"] == 4 * (five["kernels"] - counts(4)["kernels"]) > 0
    assert five["largest_outputs"][0]["bytes"] == 8 * 8 * 4


def test_hlo_kernels_counts_a_conditional_as_its_costliest_branch():
    """One branch of a conditional runs (an MoE layer's expert forms: which one is the data's
    choice): its kernels count, the costliest's by the bytes they write, not all of them (the
    HLO as XLA:GPU prints a `lax.switch` of three branches)."""
    from _profile import hlo_kernels

    fusion = "  %{0} = {1} fusion(%p), kind=kLoop, calls=%c"
    text = "\n".join([
        "%small (p: f32[64,64]) -> f32[4,64] {", fusion.format("a", "f32[4,64]{1,0}"), "}",
        "%big (p: f32[64,64]) -> f32[64,64] {", fusion.format("b", "f32[64,64]{1,0}"),
        fusion.format("c", "f32[64,64]{1,0}"), "}",
        "ENTRY %main (i: s32[], p: f32[64,64]) -> f32[64,64] {",
        fusion.format("d", "f32[8]{0}"),
        "  ROOT %conditional = f32[64,64]{1,0} conditional(s32[] %i, %p, %p, %p), "
        "branch_computations={%small, %big, %small}", "}"])
    kernels = hlo_kernels(text)
    assert kernels["kernels"] == 3  # the entry's fusion and the big branch's two
    assert kernels["by_kind"]["other"]["bytes_written"] == 8 * 4 + 2 * 64 * 64 * 4
    assert [o["bytes"] for o in kernels["largest_outputs"]] == [64 * 64 * 4, 64 * 64 * 4, 8 * 4]
    two = text.replace("branch_computations={%small, %big, %small}", "true_computation=%small, false_computation=%big")
    assert hlo_kernels(two)["kernels"] == 3  # (a boolean predicate's form)


def test_hlo_kernels_tells_alike_gemms_from_distinct_ones():
    """`distinct_gemms`: GEMMs alike but for their names count once (XLA:GPU's autotuner
    tunes them once), and one that reads its operand through a slice of its own is another,
    though of the same shape (as each layer's products over a stacked cache were)."""
    import jax
    import jax.numpy as jnp

    from _profile import hlo_kernels

    def f(a, b, w, v):
        return jnp.tanh(a @ w) + jnp.tanh(b @ w), jnp.tanh(a[:, :16] @ v)

    x = jnp.ones((64, 64))
    kernels = hlo_kernels(jax.jit(f).lower(x, x, x, jnp.ones((16, 64))).compile().as_text())
    assert kernels["by_kind"]["gemm"]["kernels"] == 3 and kernels["distinct_gemms"] == 2


def test_hlo_kernels_tells_the_grouped_gemm_kernel_from_the_attention_kernel():
    """Both Pallas kernels are Triton custom calls in XLA:GPU's HLO; the grouped quantized GEMM
    (`dlm_jax.models._quant_kernel`, as an H200 compile shows it) counts as a GEMM by its name
    in the call's metadata, the attention kernel as attention."""
    from _profile import hlo_kernels

    call = ('  %{0} = f32[32,12288]{{1,0}} custom-call(%x, %q), custom_call_target="__gpu$xla.gpu.triton", '
            'metadata={{op_name="jit(step)/{1}/pallas_call"}}')
    text = "\n".join(["ENTRY %main (x: bf16[32,4096]) -> f32[32,12288] {",
                      call.format("pallas_call.1", "dlm_jax_grouped_matmul"),
                      call.format("pallas_call.2", "dlm_jax_attention"), "}"])
    kinds = hlo_kernels(text)["by_kind"]
    assert kinds["gemm"]["kernels"] == 1 and kinds["attention"]["kernels"] == 1
    assert kinds["gemm"]["bytes_written"] == 32 * 12288 * 4


def test_target_compiles_for_a_gpu_this_machine_lacks_or_says_what_it_needs(tmp_path):
    """`--target h200` compiles the step with XLA:GPU's compile-only client and counts the
    kernels it launches; the split attention's two score products stay two (XLA's dot merger
    once joined them over a [.., P+T, Dh] copy of each layer's cached keys: at this shape a
    [4, 544, 64] concatenation); every GEMM of the second layer is one of the first's, so the
    autotuner has no more to tune for it (over a stacked [L, ...] cache, each layer's cache
    products read it at their own offset: two more distinct GEMMs a layer); int8 weights add
    no kernel. Without JAX's CUDA plugin (CI) the run ends in one line naming what it needs,
    as an unknown target does."""
    out = tmp_path / "target"
    argv = ["--target", "h200", "--shape", "small", "--batches", "1", "--kinds", "dual", "--threads", "1",
            "--quant", "none", "int8", "--out", str(out)]
    if not gpu_step.plugin_versions():
        with pytest.raises(SystemExit, match="needs JAX's CUDA plugin"):
            gpu_step.main(argv)
    else:
        assert gpu_step.main(argv) == 0
        case, int8 = json.loads(out.with_suffix(".json").read_text())["cases"]
        # int8 weights converted inside the GEMMs: no kernel of its own, no bfloat16 copy written
        assert int8["kernels"]["kernels"] == case["kernels"]["kernels"]
        assert int8["kernels"]["largest_outputs"][0]["bytes"] <= case["kernels"]["largest_outputs"][0]["bytes"]
        kinds = case["kernels"]["by_kind"]
        assert case["compile_s"] > 0 and kinds["gemm"]["kernels"] >= 2 * 7 + 1  # 7 GEMMs a layer, the head
        assert case["kernels"]["distinct_gemms"] <= (kinds["gemm"]["kernels"] - 1) // 2 + 1  # 2 layers, 1 head
        assert not any("544" in k["shape"] for k in case["kernels"]["largest_outputs"])
        assert "| kernels |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="neither a known target"):
        gpu_step.main([*argv[:1], "no-such-gpu", *argv[2:]])


# XLA:GPU's optimized HLO of a scanned step compiled for an H200 (`gpu_step.py --target h200
# --layers scan`, jax 0.11.2), cut to one layer's weight slice: an asynchronous dynamic-slice
# fusion, its start a tuple of the operands it passes through, the slice and a context; as
# XLA's dump writes it (async-start over a computation) and as `Compiled.as_text()` prints the
# same op (fusion-start).
_ASYNC_SLICE = """\
%fused_dynamic_slice.8.clone (param_0.1018: bf16[32,4096,12288], param_1.1195: s32[]) -> bf16[1,4096,12288] {
  %param_0.1018 = bf16[32,4096,12288]{2,1,0} parameter(0)
  %param_1.1195 = s32[] parameter(1)
  %constant_7_9_1 = s32[] constant(0)
  ROOT %dynamic_slice.19.2 = bf16[1,4096,12288]{2,1,0} dynamic-slice(%param_0.1018, %param_1.1195, %constant_7_9_1, %constant_7_9_1), dynamic_slice_sizes={1,4096,12288}
}

%async_computation.6 (param_0.1019: bf16[32,4096,12288], param_1.1196: s32[]) -> bf16[1,4096,12288] {
  %param_0.1019 = bf16[32,4096,12288]{2,1,0} parameter(0)
  %param_1.1196 = s32[] parameter(1)
  ROOT %loop_dynamic_slice_fusion.17 = bf16[1,4096,12288]{2,1,0} fusion(%param_0.1019, %param_1.1196), kind=kLoop, calls=%fused_dynamic_slice.8.clone
}

ENTRY %main.1 (p0: bf16[32,4096,12288], p1: s32[], p2: f32[64,64]) -> (bf16[1,4096,12288], f32[64,64]) {
  %p0 = bf16[32,4096,12288]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[64,64]{1,0} parameter(2)
  %fusion-start.6 = ((bf16[32,4096,12288]{2,1,0}, s32[]), bf16[1,4096,12288]{2,1,0}, u32[]) async-start(%p0, %p1), calls=%async_computation.6, metadata={op_name="jit(program)/while/body/jit(dynamic_index_in_dim)/dynamic_slice"}
  %copy-start = (f32[64,64]{1,0}, f32[64,64]{1,0}, u32[]) copy-start(%p2)
  %copy-done = f32[64,64]{1,0} copy-done(%copy-start)
  %fusion-done.6 = bf16[1,4096,12288]{2,1,0} async-done(%fusion-start.6), metadata={op_name="jit(program)/while/body/jit(dynamic_index_in_dim)/dynamic_slice"}
  %fusion-start.7 = ((bf16[32,4096,12288]{2,1,0}, s32[]), bf16[1,4096,12288]{2,1,0}, u32[]) fusion-start(%p0, %p1), kind=kLoop, calls=%fused_dynamic_slice.8.clone, metadata={op_name="jit(program)/while/body/jit(dynamic_index_in_dim)/dynamic_slice"}
  %fusion-done.7 = bf16[1,4096,12288]{2,1,0} fusion-done(%fusion-start.7)
  ROOT %tuple = (bf16[1,4096,12288]{2,1,0}, f32[64,64]{1,0}, bf16[1,4096,12288]{2,1,0}) tuple(%fusion-done.6, %copy-done, %fusion-done.7)
}
"""


def test_hlo_kernels_counts_an_asynchronous_pair_once_by_what_it_writes():
    """An `async-start` / `async-done` pair is one kernel of the op it wraps (a scanned step's
    slice of one layer's weights: 96 MiB written, data movement), not the start's tuple with
    the whole weight stack in it (3.2 GB) plus a second launch for the done; an async copy
    writes its destination once."""
    from _profile import hlo_kernels

    kernels = hlo_kernels(_ASYNC_SLICE)
    layer = 4096 * 12288 * 2
    assert kernels["kernels"] == 3
    assert kernels["by_kind"] == {"data movement": {"kernels": 3, "bytes_written": 2 * layer + 64 * 64 * 4}}
    assert [(o["bytes"], o["kernel"]) for o in kernels["largest_outputs"][:2]] == [
        (layer, "loop_dynamic_slice_fusion.17"), (layer, "fused_dynamic_slice.8.clone")]

"""The mesh planner (`dlm_jax.planner`, `dlm-jax plan`): bytes per device from the config alone,
checked against sums written out by hand from the models' dimensions, the pick rule, the
refusal before loading, and the command's output."""

import json
from pathlib import Path

import pytest

from dlm_jax import ConfigError
from dlm_jax._config import ModelConfig
from dlm_jax._partition import MeshShape
from dlm_jax.frontends.cli import main
from dlm_jax.planner import (GIB, MeshPlan, Plan, cache_slots, check_fits, full_name, kv_bytes_per_device, plan,
                             read_config, weight_bytes_per_device)

ROOT = Path(__file__).resolve().parents[1]
FLASH = ROOT / "examples" / "configs" / "llada2.0-flash" / "config.json"


@pytest.fixture(scope="module")
def flash():
    return read_config(FLASH)[0]


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _flash_bytes(c: ModelConfig) -> tuple[int, int]:
    """(routed experts' bytes, every other parameter's bytes) of LLaDA2.0-flash, by hand: bf16
    everywhere but the float32 expert bias."""
    d, dh, h, hkv, v, e, fm = c.d_model, c.head_dim, c.n_heads, c.n_kv_heads, c.vocab_size, c.n_experts, c.moe_ffn_hidden
    moe = c.n_layers - 1  # first_k_dense_replace 1
    attention = d * h * dh * 2 + 2 * d * hkv * dh + 2 * dh + 2 * d  # q, o, k, v, q/k norms, two layer norms
    experts = moe * 3 * e * d * fm * 2
    rest = (2 * v * d + d) * 2 + c.n_layers * attention * 2 + 3 * d * c.ffn_hidden * 2
    rest += moe * ((d * e + 3 * d * fm * c.n_shared_experts) * 2 + e * 4)  # router, shared expert, expert bias
    return experts, rest


def _flash_unsplit_at_8(c: ModelConfig) -> int:
    """What tp=8 leaves whole on every device of LLaDA2.0-flash beyond `rest // 8`, by hand:
    the k and v projections (4 K/V heads: not split), the norms, the router and the expert
    bias (whole anyway), less their eighth already counted in rest // 8."""
    d, dh, hkv, e = c.d_model, c.head_dim, c.n_kv_heads, c.n_experts
    moe = c.n_layers - 1
    whole = c.n_layers * (2 * d * hkv * dh + 2 * dh + 2 * d) * 2 + d * 2 + moe * (d * e * 2 + e * 4)
    return whole - whole // 8


def test_flash_config_is_the_100b_moe(flash):
    experts, rest = _flash_bytes(flash)
    p = plan(flash, devices=1, memory_gib=1000)
    assert flash.n_experts == 256 and flash.dense_layers == (0,) and flash.param_dtype == "bfloat16"
    assert p.parameters == 102_889_705_216  # 100B total, as the model card counts
    assert p.meshes[0].weights == experts + rest


def test_dense_weights_split_by_tp_as_counted_by_hand():
    """llada-tiny at tp=2: every attention and FFN kernel, the embedding and the head halved; the
    norms whole on each device."""
    cfg = read_config(ROOT / "models" / "llada-tiny")[0]
    d, f, v, L = cfg.d_model, cfg.ffn_hidden, cfg.vocab_size, cfg.n_layers
    q = cfg.n_heads * cfg.head_dim
    kv = cfg.n_kv_heads * cfg.head_dim
    kernels = L * (2 * d * q + 2 * d * kv + 3 * d * f) + 2 * v * d
    norms = L * 2 * d + d
    assert weight_bytes_per_device(cfg, "tp=1") == 4 * (kernels + norms) == 4 * 855_168
    assert weight_bytes_per_device(cfg, "tp=2") == 4 * (kernels // 2 + norms)
    assert weight_bytes_per_device(cfg, "tp=2,dp=2") == 4 * (kernels // 2 + norms)  # dp replicates


def test_experts_split_by_ep_and_tp_as_counted_by_hand():
    cfg = read_config(ROOT / "models" / "moe-tiny")[0]
    whole = weight_bytes_per_device(cfg, "tp=1")
    experts = 4 * cfg.n_layers * 3 * cfg.n_experts * cfg.d_model * cfg.moe_ffn_hidden
    assert weight_bytes_per_device(cfg, "ep=2") == whole - experts // 2
    assert weight_bytes_per_device(cfg, "ep=4") == whole - experts * 3 // 4


def test_a_dimension_tp_does_not_divide_stays_whole_and_is_named():
    cfg = ModelConfig(vocab_size=262, d_model=64, n_layers=1, n_heads=4, ffn_hidden=128)
    p = plan(cfg, devices=4, memory_gib=1, context=64)
    tp4 = next(m for m in p.meshes if m.mesh == MeshShape(tp=4))
    kernels = 4 * 64 * 64 + 3 * 64 * 128
    assert tp4.weights == 4 * (kernels // 4 + 2 * 262 * 64 + 3 * 64)
    assert tp4.replicated == ("embed.embedding", "lm_head.kernel")


def test_cache_slots_mirror_the_jax_executor():
    """A planner whose slot count drifted from `JaxExecutor.capacity` would misstate every K/V
    figure with no error anywhere."""
    from dlm_jax.executors.jax_executor import JaxExecutor
    from dlm_jax.testing import tiny_model

    for max_len in (300, 512):
        executor = JaxExecutor(tiny_model(max_seq_len=max_len))
        for n in (1, 40, 256, 257, 300, max_len):
            assert cache_slots(executor.config, n) == executor.capacity(n), (max_len, n)


def test_kv_bytes_by_hand():
    cfg = read_config(ROOT / "models" / "llada-tiny")[0]  # L 4, Hkv 2, Dh 32, float32, max_seq_len 512
    per_slot_row = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # K and V
    flags = 4 + 1 + 1  # position, validity, written
    assert kv_bytes_per_device(cfg, "tp=1", batch=2, context=300) == 2 * 512 * (per_slot_row + flags)
    # (the written flags split their rows over dp as the K/V do; positions and validity whole)
    assert kv_bytes_per_device(cfg, "tp=2,dp=2", batch=2, context=300) == 512 * per_slot_row // 2 + 2 * 512 * 5 + 512
    assert kv_bytes_per_device(cfg, "dp=2", batch=3, context=40) == 3 * 256 * (per_slot_row + flags)  # rows whole


def _toy(totals: dict[str, int], batch: int = 4) -> Plan:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, ffn_hidden=64)
    meshes = tuple(MeshPlan(MeshShape.parse(m), total, 0, 0, usable=100) for m, total in totals.items())
    return Plan(cfg, 4, 1.0, 0.75, batch, 64, None, 0, meshes, (), 0.0)


def test_pick_prefers_busy_replicas_then_fewer_tp_then_fewer_ep():
    assert full_name(_toy({"tp=4": 10, "tp=2,dp=2": 90, "ep=2,dp=2": 90, "dp=4": 101}).pick.mesh) == "tp=1,ep=2,dp=2"
    assert full_name(_toy({"tp=4": 10, "tp=2,ep=2": 50, "tp=1,ep=4": 100}).pick.mesh) == "tp=1,ep=4,dp=1"
    # A batch of one keeps one replica busy: more would repeat its work.
    assert full_name(_toy({"tp=2,ep=2": 90, "ep=2,dp=2": 50}, batch=1).pick.mesh) == "tp=2,ep=2,dp=1"
    assert full_name(_toy({"tp=1,ep=1,dp=4": 50, "ep=2,dp=2": 50}, batch=2).pick.mesh) == "tp=1,ep=2,dp=2"
    nothing = _toy({"tp=4": 101, "tp=2,ep=2": 150})
    assert nothing.pick is None and nothing.smallest.mesh == MeshShape(tp=4)


def test_flash_on_eight_80gb_devices(flash, monkeypatch):
    """By hand: the routed experts take 186 GiB in bf16 and a device 60 GiB (0.75 of 80), so
    only meshes with tp * ep >= 4 fit (with 4: weights 46.5 + ~5.7 GiB of the rest at tp=1, K/V
    4 GiB for 32768 float32 slots); tp=8 fits with the 4 K/V heads whole on every device (the
    cache as at tp=1). A batch of one keeps one replica busy (dp=1), and the fewest tp among
    those is tp=1, ep=8."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    p = plan(flash, devices=8, memory_gib=80)
    assert p.usable == 60 * GIB and p.context == p.slots == 32768
    fitting = {full_name(m.mesh) for m in p.fitting}
    assert fitting == {"tp=1,ep=4,dp=2", "tp=1,ep=8,dp=1", "tp=2,ep=2,dp=2", "tp=2,ep=4,dp=1",
                       "tp=4,ep=1,dp=2", "tp=4,ep=2,dp=1", "tp=8,ep=1,dp=1"}
    assert p.refused == ()
    experts, rest = _flash_bytes(flash)
    tp8 = next(m for m in p.meshes if full_name(m.mesh) == "tp=8,ep=1,dp=1")
    assert tp8.kv == 32 * 4 * 32768 * 128 * 4 * 2 + 32768 * 6  # K/V heads whole: as at tp=1
    assert tp8.weights == experts // 8 + rest // 8 + _flash_unsplit_at_8(flash)
    assert any("K/V heads (tp=8 does not divide the 4 K/V heads" in r for r in tp8.replicated)
    pick = p.pick
    assert full_name(pick.mesh) == "tp=1,ep=8,dp=1" and pick.weights == experts // 8 + rest
    assert pick.kv == 32 * 4 * 32768 * 128 * 4 * 2 + 32768 * 6


def test_memory_fraction_from_the_environment(flash, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert plan(flash, devices=8, memory_gib=80).usable == int(80 * GIB * 0.9)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
    with pytest.raises(ConfigError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION='1.5' must be a number in \(0, 1\]"):
        plan(flash, devices=8, memory_gib=80)


def test_check_fits_refuses_in_one_line(flash):
    fits = check_fits(flash, "tp=4,ep=2", memory_bytes=80 * GIB, batch=1, context=4096)
    assert fits.fits and fits.total < 80 * GIB
    with pytest.raises(ConfigError) as e:
        check_fits(flash, "tp=2,ep=2", memory_bytes=40 * GIB, batch=1, context=4096)
    message = str(e.value)
    assert "\n" not in message and message.startswith("mesh tp=2,ep=2,dp=1 does not fit: it needs 5")
    assert message.endswith("for batch 1, context 4096) and a device has 40.00 GiB")
    with pytest.raises(ConfigError, match=r"mesh tp=3 does not divide the model's 32 attention heads \(n_heads\)"):
        check_fits(flash, "tp=3", memory_bytes=80 * GIB, batch=1, context=4096)
    with pytest.raises(ConfigError, match=r"context=40000 must be in \[1, 32768\]"):
        check_fits(flash, "tp=4", memory_bytes=80 * GIB, batch=1, context=40000)


def test_plan_command_text_and_json(capsys, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert main(["plan", "--model", str(FLASH), "--devices", "8", "--memory", "80"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "pick: tp=1,ep=8,dp=1" in lines and lines[0].endswith("(102.9B parameters, bfloat16 weights)")
    row = next(line for line in lines if line.startswith("tp=1,ep=4,dp=2"))
    assert row.split()[1:6] == ["52.15", "4.00", "0.65", "56.80", "yes"]

    moe = str(ROOT / "models" / "moe-tiny")
    assert main(["plan", "--model", moe, "--devices", "4", "--memory", "1", "--batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = read_config(moe)[0]
    assert out["pick"] == "tp=1,ep=2,dp=2" and out["family"] == "dlm_jax" and out["context"] == 512
    by_mesh = {m["mesh"]: m for m in out["meshes"]}
    assert by_mesh["tp=1,ep=4,dp=1"]["weights_bytes"] == weight_bytes_per_device(cfg, "ep=4")
    assert by_mesh["tp=2,ep=1,dp=2"]["kv_bytes"] == kv_bytes_per_device(cfg, "tp=2,dp=2", batch=2, context=512)
    assert by_mesh["tp=1,ep=1,dp=4"]["replicated"] == ["K/V rows (dp=4 does not divide batch 2)"]

    # int8 experts split over ep and tp as `dlm_jax.load(quant="int8", mesh=...)` splits them
    # (tests/executors/test_mesh.py decodes them there): 1 byte a weight, the scales alongside
    assert main(["plan", "--model", moe, "--devices", "2", "--memory", "1", "--quant", "int8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pick"] == "tp=1,ep=2,dp=1"
    by_mesh = {m["mesh"]: m for m in out["meshes"]}
    assert set(by_mesh) == {"tp=1,ep=1,dp=2", "tp=1,ep=2,dp=1", "tp=2,ep=1,dp=1"} and not out["refused"]
    assert by_mesh["tp=1,ep=2,dp=1"]["weights_bytes"] == weight_bytes_per_device(cfg, "ep=2", quant="int8")
    assert weight_bytes_per_device(cfg, "ep=2", quant="int8") < 0.6 * weight_bytes_per_device(cfg, "ep=2")

    assert main(["plan", "--model", moe, "--devices", "2", "--memory", "0.001"]) == 1  # nothing fits
    assert "nothing fits: the smallest need is" in capsys.readouterr().out


def test_plan_dtype_counts_the_bytes_the_decode_commands_load(capsys):
    """`plan --dtype bfloat16` plans a float32 checkpoint as `--dtype bfloat16` decodes it: its
    weight bytes are those of the model `dlm_jax.load(dtype=, param_dtype=)` holds (not the
    stored float32's, twice as many), its K/V in bfloat16."""
    import jax
    from flax import nnx

    import dlm_jax

    path = ROOT / "models" / "llada-tiny"
    assert main(["plan", "--model", str(path), "--devices", "1", "--memory", "1", "--dtype", "bfloat16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = dlm_jax.load(path, executor="jax", dtype="bfloat16", param_dtype="bfloat16").model
    held = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert out["param_dtype"] == out["kv_dtype"] == "bfloat16"
    assert out["meshes"][0]["weights_bytes"] == held
    assert main(["plan", "--model", str(path), "--devices", "1", "--memory", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["meshes"][0]["weights_bytes"] == 2 * held


@pytest.mark.parametrize("argv,message", [
    (["--model", "no/such/dir"], "error: no/such/dir: no such checkpoint directory"),
    (["--memory", "0"], "error: --memory 0: GiB per device must be > 0"),
    (["--context", "513"], "error: --context 513 exceeds the model's max_seq_len 512"),
])
def test_bad_plan_input_ends_in_one_line(argv, message, capsys):
    base = {"--model": str(ROOT / "models" / "moe-tiny"), "--devices": "2", "--memory": "1"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    assert main(["plan", *[x for kv in base.items() for x in kv]]) == 2
    assert one_error_line(capsys.readouterr().err) == message


def test_grouped_scales_split_as_their_kernels_and_stacks_never_split_their_layers():
    """A grouped scale [G, O] splits G as its kernel's input rows (row-parallel) and O as its
    output (column-parallel); [O] and a scanned stack's leading [L] axis read the same rules.
    Guards grouped expert scales [E, G, O] taking the [E, O] rule shifted by one (E left whole,
    G split over the experts' axis)."""
    from dlm_jax._partition import EXPERT, MODEL, logical_axes

    assert logical_axes("layers.0.attn.q_proj.scale", 1) == (MODEL,)
    assert logical_axes("layers.0.attn.q_proj.scale", 2) == (None, MODEL)
    assert logical_axes("layers.0.attn.o_proj.scale", 1) == (None,)
    assert logical_axes("layers.0.attn.o_proj.scale", 2) == (MODEL, None)
    assert logical_axes("layers.block.attn.o_proj.scale", 2) == (None, None)  # [L, O]: per channel, stacked
    assert logical_axes("layers.block.attn.o_proj.scale", 3) == (None, MODEL, None)  # [L, G, O]
    assert logical_axes("layers.block.attn.q_proj.kernel", 3) == (None, None, MODEL)
    assert logical_axes("layers.1.ffn.gate_scale", 2) == (EXPERT, MODEL)
    assert logical_axes("layers.1.ffn.gate_scale", 3) == (EXPERT, None, MODEL)
    assert logical_axes("layers.1.ffn.down_scale", 3) == (EXPERT, MODEL, None)
    assert logical_axes("layers.block.ffn.gate_scale", 3) == (None, EXPERT, MODEL)  # [L, E, O]
    assert logical_axes("lm_head.scale", 2) == (None, MODEL)


def test_act_order_maps_split_as_rows_and_their_scales_stay_whole_by_hand():
    """Act-order groups (`"-act"`, each input row's group from `g_idx`): a row-parallel kernel's
    map splits as its rows and its grouped scales stay whole (a device's rows may be in any
    group); a column-parallel kernel's map is whole and its scales split as without act-order.
    llada-tiny at int4-g32-act on tp=2, against int4-g32 counted by hand."""
    from dlm_jax._partition import EXPERT, MODEL, logical_axes

    act = dict(act_order=True)
    assert logical_axes("layers.1.ffn.down_g_idx", 2, **act) == (EXPERT, MODEL)  # routed experts' [E, I]
    assert logical_axes("layers.1.ffn.gate_g_idx", 2, **act) == (EXPERT, None)
    assert logical_axes("layers.1.ffn.down_scale", 3, **act) == (EXPERT, None, None)
    assert logical_axes("layers.1.ffn.down_scale", 3) == (EXPERT, MODEL, None)
    assert logical_axes("layers.1.ffn.up_scale", 3, **act) == (EXPERT, None, MODEL)
    assert logical_axes("layers.0.attn.o_proj.scale", 2, **act) == (None, None)
    assert logical_axes("layers.0.ffn.down_proj.zero", 2, **act) == (None, None)
    assert logical_axes("layers.block.shared.down_proj.scale", 3, **act) == (None, None, None)
    assert logical_axes("layers.0.attn.o_proj.g_idx", 1, **act) == (MODEL,)
    assert logical_axes("layers.block.ffn.down_proj.g_idx", 2, **act) == (None, MODEL)
    assert logical_axes("layers.0.attn.q_proj.g_idx", 1, **act) == (None,)
    assert logical_axes("layers.0.attn.q_proj.scale", 2, **act) == (None, MODEL)
    assert logical_axes("layers.0.ffn.up_proj.scale", 2, **act) == (None, MODEL)
    cfg = read_config(ROOT / "models" / "llada-tiny")[0]
    d, f, L = cfg.d_model, cfg.ffn_hidden, cfg.n_layers
    q = cfg.n_heads * cfg.head_dim
    row_scales = L * (q // 32 + f // 32) * d * 4  # o's and down's [G, d] float32, split over tp=2 without -act
    whole_maps = (L * 5 + 1) * d * 4  # q, k, v, gate, up and the head read d rows each (int32)
    split_maps = L * (q + f) * 4  # o and down read q and f rows
    for mesh, ways in (("tp=1", 1), ("tp=2", 2)):
        assert (weight_bytes_per_device(cfg, mesh, quant="int4-g32-act")
                == weight_bytes_per_device(cfg, mesh, quant="int4-g32") + row_scales - row_scales // ways
                + whole_maps + split_maps // ways), mesh

"""The analytic planner: published figures reproduced, its model checked against compiled steps, the CLI.

The grid test compiles a representative set of layouts of the tiny models on 8
CPU devices (ZeRO 0-3, tensor with and without sequence parallelism, each
pipeline schedule, experts, each remat policy, bf16) and compares the planner's
per-device argument bytes and traffic per mesh axis (within 10%) and temp
bytes (within 25%) with what XLA reports. benchmarks/planner.py sweeps more.
"""

import dataclasses
import json
import math

import jax
import pytest

from jaxpar.planner import compare
from jaxpar.planner.command import config_toml, run_command
from jaxpar.planner.devices import DEVICES, load_device
from jaxpar.planner.estimate import Estimate, estimate
from jaxpar.planner.layout import AXES, Layout, Workload
from jaxpar.planner.memory import memory_breakdown, zero_table
from jaxpar.planner.model import Leaf, Model, leaves_of, llama_leaves, model_seq
from jaxpar.planner.search import default_batch, plan
from jaxpar.planner.ticks import bubble, megatron_bubble, schedule_ticks
from jaxpar.pipeline.schedule import Schedule

from helpers import inspection_as_users_compile

TINY = {"seq_len": 32}
WORK = Workload(batch_size=16, seq_len=32)


# -- published figures ----------------------------------------------------------------------------


def _one_leaf_model(psi: int, layers: int = 100) -> Model:
    """A model of psi parameters in `layers` stacked [embed, mlp] matrices (ZeRO splits each over data)."""
    width = psi // (layers * 4096)
    leaf = Leaf("w", (layers, 4096, width), ("layers", "embed", "mlp"))
    return Model("zero-table", (leaf,), 4096, layers, 32, 32, 128, 4 * 4096, 32000)


def test_zero_table_1_reproduced():
    """ZeRO (Rajbhandari et al. 2020) Table 1: 7.5B parameters, K = 12, N = 64 -> 120 / 31.4 / 16.6 / 1.88 GB.

    jaxpar's bf16 holds the paper's 2 + 2 + 12 at ZeRO-1 and, at ZeRO-0, 2 and 3, fp32 parameters with no
    2-byte copy and 2-byte gradients (4 + 2 + 8; stage 2 holds the 2-byte casts it gathers): at or below the
    paper's bytes at every stage.
    """
    psi_n = 7_500_000_000 // (100 * 4096) * 100 * 4096
    paper = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.88e9}
    formula = zero_table(7.5e9, 64, k=12)
    assert [formula[k] for k in ("baseline", "os", "os+g", "os+g+p")] == pytest.approx(list(paper.values()), rel=0.02)
    jaxpar = {0: 14 * psi_n, 1: 4 * psi_n + 12 * psi_n / 64, 2: 2 * psi_n + 10 * psi_n / 64, 3: 14 * psi_n / 64}
    model = _one_leaf_model(psi_n)
    device = load_device("h100")
    for stage, expected in jaxpar.items():
        layout = Layout(data=64, zero=stage, precision="bf16")
        memory = memory_breakdown(model, layout, Workload(64, 1024), device)
        model_state = memory["params"] + memory["grads"] + memory["optimizer"]
        assert model_state == pytest.approx(expected, rel=1e-6), stage
        assert model_state <= paper[stage] * 1.02, stage


@pytest.mark.parametrize("p,m,v", [(2, 2, 1), (4, 8, 1), (4, 4, 1), (8, 32, 1), (2, 4, 2), (4, 8, 2), (4, 16, 4)])
def test_megatron_bubble(p, m, v):
    """Narayanan et al. 2021: bubble time over ideal time is (p-1)/m, (p-1)/(v m) interleaved; as a share of
    the step (p-1)/(v m + p-1); and the tick tables of jaxpar.pipeline.schedule idle exactly that share."""
    schedule = "interleaved" if v > 1 else "1f1b"
    layout = Layout(pipe=p, schedule=schedule, microbatches=m, virtual_stages=v)
    ratio = megatron_bubble(p, m, v)
    assert bubble(layout) == pytest.approx(ratio / (1 + ratio))
    assert bubble(layout) == pytest.approx(Schedule(schedule, p, m, v).bubble_formula)
    if v == 1:
        for name in ("gpipe", "1f1b"):
            assert Schedule(name, p, m).bubble == pytest.approx(bubble(layout))
            assert schedule_ticks(Layout(pipe=p, schedule=name, microbatches=m)) == \
                Schedule(name, p, m).ticks - (p - 1 if name == "1f1b" else 0)
    else:
        assert schedule_ticks(layout) == Schedule(schedule, p, m, v).forward_ticks


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (8, 10), (8, 16)])
def test_zb_h1_counts_read_off_its_tick_table(p, m):
    """ZB-H1 as the executor runs it: m + p - 1 forward ticks, the bubble 2(p - 1)/(3m + 2(p - 1)), the residual
    ring's rows (1F1B's, min(m, 2p - 2)), max(0, 2p - 2 - m) kept cotangents in a buffer of their own, W slots on
    m ticks (m + 1 at p = 2, one F and B tick scanned with them) and 2(m + p - 1) permutes less the dropped sends
    of one-tick scans; every schedule the executor runs is one the planner counts."""
    from jaxpar.pipeline import schedule as schedule_lib
    from jaxpar.planner import layout as layout_lib
    from jaxpar.planner.ticks import cotangent_rows, in_flight, permutes, weight_ticks

    layout, table = Layout(pipe=p, schedule="zb-h1", microbatches=m), Schedule("zb-h1", p, m)
    assert schedule_ticks(layout) == table.forward_ticks == m + p - 1
    assert bubble(layout) == pytest.approx(table.bubble) == pytest.approx(2 * (p - 1) / (3 * m + 2 * (p - 1)))
    assert bubble(layout) < bubble(Layout(pipe=p, schedule="1f1b", microbatches=m))
    assert in_flight(layout) == table.in_flight == min(m, 2 * p - 2)
    assert cotangent_rows(layout) == table.ring_layout().cotangent_buffer_rows == max(0, 2 * p - 2 - m)
    assert weight_ticks(layout) == m + (p == 2)
    assert permutes(layout) == 2 * (m + p - 1) - (p == 2) - (m == p > 2)
    assert permutes(Layout(pipe=p, schedule="1f1b", microbatches=m)) == 2 * (m + p - 1) - (p == 2)
    assert set(layout_lib.SCHEDULES) == set(schedule_lib.SCHEDULES)


def test_the_search_weighs_zb_h1():
    """`jaxpar plan` enumerates zb-h1 wherever the executor runs it (m >= p) and the estimate counts it."""
    from jaxpar.planner.search import layouts

    found = [lay for lay in layouts(Model.named("tiny", TINY), 8, WORK, load_device("cpu")) if lay.schedule == "zb-h1"]
    assert {(lay.pipe, lay.microbatches) for lay in found} >= {(2, 2), (2, 4), (4, 4)}
    assert all(lay.microbatches >= lay.pipe for lay in found)
    est = estimate(Model.named("tiny", TINY), found[0], WORK, "cpu")
    assert not est.reason and est.bubble == pytest.approx(Schedule("zb-h1", found[0].pipe, found[0].microbatches).bubble)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_traffic_per_layer(t):
    """Megatron: 4 all-reduces of b s h per layer (2 forward, 2 backward), ring traffic 8 b s h (t-1)/t."""
    b, s = 4, 2048
    small, large = (Model.named("7b", {"n_layers": n, "seq_len": s}) for n in (4, 8))
    work = Workload(b, s)
    layout = Layout(tensor=t, precision="bf16")
    per_layer = (estimate(large, layout, work).traffic["tensor"]
                 - estimate(small, layout, work).traffic["tensor"]) / 4
    h = small.d_model
    assert per_layer == pytest.approx(8 * b * s * h * (t - 1) / t * 2)  # bf16 activations: 2 bytes
    sp = estimate(large, Layout(tensor=t, sequence_parallel=True), work)
    assert sp.traffic["tensor"] == pytest.approx(estimate(large, layout, work).traffic["tensor"])


def test_inventory_matches_the_models():
    """The planner counts parameters from the config exactly as the models build them."""
    from jaxpar.models import model_config, model_factory
    from jaxpar.train.state import describe

    for name in ("tiny", "moe-tiny"):
        config = model_config(name)
        counted = llama_leaves(config)
        traced = leaves_of(describe(model_factory(name, config, 0)).logical)
        assert sorted((a.shape, a.names) for a in counted) == sorted((a.shape, a.names) for a in traced)
        assert sum(a.size for a in counted) == config.param_count()


def test_devices_and_toml(tmp_path):
    assert set(DEVICES) >= {"h100", "h200", "a100", "tpu-v5p", "cpu"}
    path = tmp_path / "mi300x.toml"
    path.write_text('[device]\nname = "MI300X"\nhbm_gb = 192\npeak_tflops = 1307\nhbm_bandwidth_gb = 5300\n'
                    'intra_bandwidth_gb = 448\ninter_bandwidth_gb = 50\ndevices_per_node = 8\n')
    device = load_device(str(path))
    assert device.hbm == 192e9 and device.peak_flops == pytest.approx(1307e12)
    with pytest.raises(ValueError, match="unknown device"):
        load_device("h1000")


def test_layout_text_round_trip():
    layout = Layout.parse("data=8,tensor=8,pipe=16 zero=1 schedule=interleaved microbatches=32 "
                          "virtual_stages=2 remat=full sequence_parallel=true")
    assert (layout.data, layout.tensor, layout.pipe, layout.zero, layout.virtual_stages) == (8, 8, 16, 1, 2)
    assert Layout.parse(str(layout)) == layout
    long = Layout.parse("data=2,context=4 context_form=ring offload=optimizer")
    assert (long.context, long.context_form, long.offload, long.devices) == (4, "ring", "optimizer", 8)
    assert Layout.parse(str(long)) == long
    with pytest.raises(ValueError, match="name=value"):
        Layout.parse("data=8 turbo")


# -- plans for the big shapes ------------------------------------------------------------------------


@pytest.mark.parametrize("name,devices", [("7b", 8), ("70b", 64), ("70b", 1024), ("405b", 16384)])
def test_top_plans_fit(name, devices):
    model = Model.named(name)
    work = Workload(default_batch(model, devices, model.d_model and model_seq(name)),
                    model_seq(name))
    ranking = plan(model, devices, work, "h100")
    best = ranking.best
    assert best is not None and best.layout.devices == devices
    assert best.peak <= 80e9 and best.fits
    assert 0 < best.mfu < 1
    assert all(a.step_time <= b.step_time for a, b in zip(ranking.ranked, ranking.ranked[1:]))
    assert all(not e.fits for e in ranking.dropped) and ranking.dropped
    assert all(e.reason for e in ranking.dropped)


def test_a_sequence_too_long_for_every_plain_layout_gets_context_parallelism():
    model, work = Model.named("7b"), Workload(8, 131072)
    ranking = plan(model, 8, work, "h100")
    plain = [e for e in ranking.dropped if e.layout.context == 1 and e.layout.offload == "none"]
    assert plain and not any(e.fits for e in plain)
    best = ranking.best
    assert best is not None and best.layout.context > 1 and best.fits and best.layout.devices == 8
    assert f"context={best.layout.context}" in run_command("7b", best, work)
    # the K/V collectives over context: 3 (C - 1)/C of K and V per layer run, both forms alike
    for form in ("all-gather", "ring"):
        layout = dataclasses.replace(best.layout, context_form=form)
        est = estimate(model, layout, work, "h100")
        kv = [c for c in est.collectives if c.axis == "context" and c.kind != "all-reduce"]
        c, runs = layout.context, model.n_layers * layout.grad_accum
        whole = 8 // (layout.data * layout.grad_accum) * work.seq_len * model.n_kv_heads / layout.tensor * model.head_dim * 2
        assert sum(k.traffic(c) for k in kv) == pytest.approx(2 * 3 * (c - 1) / c * whole * runs)
    odd = estimate(model, dataclasses.replace(best.layout, context=3, data=1), Workload(8, 1000), "h100")
    assert "does not divide by 2 x context=3" in odd.reason


def test_offload_moves_the_optimizer_state_and_master_to_the_host():
    model, work = Model.named("7b"), Workload(8, 4096)
    base = Layout.parse("data=8 zero=3 remat=full precision=bf16")
    kept, offloaded = (estimate(model, dataclasses.replace(base, offload=o), work, "h100")
                       for o in ("none", "optimizer"))
    host = kept.memory["optimizer"] + kept.memory["params"]  # ZeRO-3's fp32 shard is the bf16 master
    assert offloaded.memory["host"] == host and kept.memory["host"] == 0
    assert offloaded.memory["arguments"] == pytest.approx(kept.memory["arguments"] - host)
    device = load_device("h100")
    assert offloaded.time["update"] - kept.time["update"] == pytest.approx(2 * host / device.host_bandwidth)


def test_plan_command(tmp_path, capsys):
    """`jaxpar plan` prints the ranked table, explains it, writes JSON, pictures and a runnable config."""
    from jaxpar import cli

    config = tmp_path / "top.toml"
    png = tmp_path / "plan"
    assert cli.main(["plan", "--model", "70b", "--devices", "1024", "--device", "h100", "--json",
                     "--write-config", str(config)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 1024 and len(out["top"]) == 10 and out["fitting"] > 10
    top = out["top"][0]
    assert top["memory"]["total"] <= 80e9 and top["fits"]
    assert math.prod(top["mesh"].values()) == 1024
    assert out["explanation"] and out["command"].startswith("jaxpar train --model 70b --mesh ")
    args = cli.build_parser().parse_args(["train", "--config", str(config)])
    train, options, mesh = cli.resolve(args)
    assert train.model == "70b" and math.prod(mesh.shape.values()) == 1024
    assert options == Layout(**{a: n for a, n in mesh.shape.items() if a in AXES}, **options).options()

    assert cli.main(["plan", "--model", "70b", "--devices", "64", "--explain",
                     "data=2,tensor=8,pipe=4 zero=1 microbatches=8 remat=full", "--json"]) == 0
    explained = json.loads(capsys.readouterr().out)
    assert {a: n for a, n in explained["mesh"].items() if n > 1} == {"data": 2, "pipe": 4, "tensor": 8} and explained["bubble"] > 0
    assert {c["axis"] for c in explained["collectives"]} == {"data", "tensor", "pipe"}
    assert cli.main(["plan", "--model", "70b", "--devices", "64", "--explain", "data=8"]) == 2
    capsys.readouterr()
    assert cli.main(["plan", "--model", "1b", "--devices", "8", "--png", str(png)]) == 0
    assert (tmp_path / "plan_memory.png").stat().st_size > 0 and (tmp_path / "plan_scaling.png").stat().st_size > 0


def test_plan_from_file_runs_on_cpu(tmp_path):
    """The planner's config for the tiny model on 8 CPU devices is a valid `jaxpar train --config` plan."""
    from jaxpar import cli
    from jaxpar.core.plan import Plan
    from jaxpar.run.training import prepare

    model = Model.named("tiny", TINY)
    ranking = plan(model, 8, WORK, "cpu", precision="fp32")
    path = tmp_path / "tiny.toml"
    path.write_text(config_toml("tiny", ranking.best, WORK))
    train, options, mesh = cli.resolve(cli.build_parser().parse_args(["train", "--config", str(path)]))
    run = prepare(train, Plan.create(mesh, **options))
    assert {a: n for a, n in run.plan.shape.items() if a in AXES} == ranking.best.layout.shape


# -- against the compiler -------------------------------------------------------------------------

# (mesh, plan options, model): each ZeRO stage, tensor (and sequence) parallelism, every pipeline schedule,
# experts, every remat policy (ZeRO-3's own `dots` too), mixed precision and both context-parallel forms (with
# tensor parallelism too) and HSDP, each at least once, in 13 compiles.
GRID = [
    ("data=8", {}, "tiny"),
    ("data=4,tensor=2", {"zero": 1, "precision": "bf16", "remat": "selective"}, "tiny"),
    ("data=4,tensor=2", {"sequence_parallel": True}, "tiny"),
    ("data=4,pipe=2", {"schedule": "gpipe", "microbatches": 4, "zero": 2, "remat": "full"}, "tiny"),
    pytest.param("data=2,tensor=2,pipe=2", {"zero": 1, "microbatches": 4}, "tiny",
                 marks=pytest.mark.xfail(
                     strict=True,
                     reason="known planner defect: the planner's temp undershoots this p = 2 1F1B step by 0.84 MB, "
                            "0.705 on jax 0.12 and 0.709 on jax 0.10 (tolerance 25%). It was 0.76 while the ring had "
                            "2p - 1 rows; the slot order that took a row off the ring lowered the compiled temp and "
                            "the prediction by the same 674 KB. XLA's live ranges put the peak inside the forward "
                            "slot's lax.cond in the tick loop, whose branches copy the ring buffers they are given "
                            "(35 and 36 copies); the planner does not model them. Writing the ring outside the "
                            "cond moved the peak into the backward slot's cond and left the temp as it was")),
    ("data=4,pipe=2", {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4}, "tiny"),
    # zb-h1: its W slots' ZeRO-3 gathers and reduce-scatters (m = p = 2), kept cotangents in a buffer of their own
    # and the last forward tick's dropped send (m = p = 4), its W slots' Megatron collectives under full remat and
    # sequence parallelism (the loss head's exchange whole)
    ("data=4,pipe=2", {"schedule": "zb-h1", "microbatches": 2, "zero": 3}, "tiny"),
    ("data=2,pipe=4", {"schedule": "zb-h1", "microbatches": 4}, "tiny"),
    ("data=2,tensor=2,pipe=2", {"schedule": "zb-h1", "microbatches": 4, "zero": 1, "remat": "full",
                                "sequence_parallel": True}, "tiny"),
    ("data=2,expert=4", {"zero": 3}, "moe-tiny"),
    # each tensor rank sends whole rows over expert; the experts' own f/g sum on the capacity buffer
    ("data=2,expert=2,tensor=2", {"zero": 3}, "moe-tiny"),
    ("data=2,context=4", {"context_form": "ring"}, "tiny"),
    ("data=2,context=2,tensor=2", {"tensor_form": "explicit"}, "tiny"),
    ("replica=2,data=4", {"zero": 2}, "tiny"),
]
TOLERANCE = {"arguments": 0.10, "temp": 0.25}  # traffic per mesh axis: 0.10


def compiled_cell(mesh: str, options: dict, model: str) -> dict:
    """`jaxpar inspect --json` of one layout: an abstract compile, nothing trained."""
    from jaxpar.core.plan import Plan
    from jaxpar.run.training import TrainConfig, prepare

    run = prepare(TrainConfig(model=model, batch_size=WORK.batch_size, seq_len=WORK.seq_len), Plan.create(mesh, **options))
    return inspection_as_users_compile(run)


def predicted_cell(mesh: str, options: dict, model: str) -> Estimate:
    sizes = {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}
    layout = Layout(**sizes, **{"precision": "fp32", **options})
    return estimate(Model.named(model, TINY), layout, WORK, "cpu")


@pytest.mark.parametrize("mesh,options,model", GRID, ids=[f"{m} {o}".strip() for m, o, _ in (getattr(c, "values", c) for c in GRID)])
def test_prediction_matches_compiled_step(mesh, options, model):
    est = predicted_cell(mesh, options, model)
    assert not est.reason, est.reason
    ratios = compare.ratios(est, compiled_cell(mesh, options, model))
    assert set(ratios) >= {"arguments", "temp"}
    for key, ratio in ratios.items():
        tolerance = TOLERANCE.get(key, 0.10)
        assert abs(ratio - 1) <= tolerance, f"{key}: prediction / compiled = {ratio:.3f} (tolerance {tolerance:.0%})"


# -- DeepSeek-V3's latent attention ---------------------------------------------------------------------------

def test_latent_attention_counts_its_real_heads():
    """MLA's figures use its heads: q/k 192 (nope 128 + rope 64), v 128, and its compressions, not the Llama
    head_dim=64 its config inherits; the attention FLOPs are 6 L s h (192 + 128) beside 6 N."""
    from jaxpar.planner.activations import activation_values_per_token
    from jaxpar.planner.step_time import flops_per_token

    model = Model.named("deepseek-v3")
    assert (model.head_dim, model.value_dim, model.latent_width) == (192, 128, 1536 + 512 + 64)
    seq = 4096
    assert flops_per_token(model, seq) == 6 * model.flop_params + 6 * 61 * seq * 128 * (192 + 128)
    layout = Layout(data=8, remat="selective", tensor=2, precision="bf16")
    qkv = (128 * 192 + 128 * 192 + 128 * 128) / 2 + 1536 + 512 + 64
    assert activation_values_per_token(model, layout, seq) == qkv + 2 * model.d_ff / 2 + 2 * model.d_model


def test_no_layout_fits_names_the_nearest():
    """DeepSeek-V3 (671B) on 64 H100s does not fit, as AdamW's 14 bytes per parameter over 64 devices alone say;
    the refusal names the layout that needs least, not the first one tried (plain data parallelism: 17 TB)."""
    from jaxpar.planner.search import explain_choice, nearest

    model = Model.named("deepseek-v3")
    ranking = plan(model, 64, Workload(batch_size=default_batch(model, 64, 4096), seq_len=4096), "h100")
    assert ranking.best is None
    closest = nearest(ranking.dropped)
    assert closest.memory["total"] == min(e.memory["total"] for e in ranking.dropped if "needs" in e.reason)
    assert 14 * model.params / 64 < closest.memory["total"] < 2e12 / 8
    assert explain_choice(ranking) == [f"no layout fits: the nearest, {closest.layout}, {closest.reason}"]


JAX_0_12 = tuple(int(part) for part in jax.__version__.split(".")[:2]) >= (0, 12)


@pytest.mark.parametrize("mesh,options", [
    ("data=8", {}),
    pytest.param("data=2,expert=4", {"zero": 3}, marks=pytest.mark.xfail(
        JAX_0_12, strict=True,
        reason="known planner gap on jax 0.12: its compiled step gathers this ZeRO-3 DeepSeek differently (temp "
               "2,033,744 B, predicted / compiled 1.269; data traffic 0.854), where jax 0.10's matches the planner "
               "(temp 2,415,824 B, 1.068; traffic 0.951); the planner models jax 0.10's")),
])
def test_deepseek_prediction_matches_compiled_step(mesh, options):
    """A tiny DeepSeek-V3 (MLA, dense first block, dropless sigmoid routing) against its compiled step, at the grid's
    tolerances. (tensor=2's traffic is not held: MLA's latents are whole on every tensor rank, which the planner's
    Megatron traffic does not count.)"""
    est = predicted_cell(mesh, options, "deepseek-tiny")
    assert not est.reason, est.reason
    ratios = compare.ratios(est, compiled_cell(mesh, options, "deepseek-tiny"))
    assert set(ratios) >= {"arguments", "temp"}
    for key, ratio in ratios.items():
        tolerance = TOLERANCE.get(key, 0.10)
        assert abs(ratio - 1) <= tolerance, f"{key}: prediction / compiled = {ratio:.3f} (tolerance {tolerance:.0%})"

"""The HLO reader: replica groups in each of XLA's text forms map to the right mesh axes."""

import numpy as np
import pytest

from jaxpar import inspect
from jaxpar.mesh import MeshSpec, make_mesh

MESH = make_mesh(MeshSpec(data=4, tensor=2))

HLO = """HloModule test, entry_computation_layout={()->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%body (p: (s32[], f32[4,64])) -> (s32[], f32[4,64]) {
  %ar = f32[4,64]{1,0} all-reduce(f32[4,64]{1,0} %g), channel_id=1, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[4,64]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[4,64])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,16]) -> f32[] {
  %w = (s32[], f32[4,64]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %ag = f32[32,16]{1,0} all-gather(f32[8,16]{1,0} %a), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true
  %rs = bf16[2,16]{1,0} reduce-scatter(bf16[4,16]{1,0} %b), channel_id=3, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={0}, to_apply=%add
  %ar2 = (f32[10]{0}, f32[6]{0}) all-reduce(f32[10]{0} %c, f32[6]{0} %d), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %cp = f32[4,16]{1,0} collective-permute(f32[4,16]{1,0} %e), channel_id=5, source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}
  ROOT %r = f32[] constant(0)
}
"""


def test_ops_axes_sizes_and_loop_counts():
    ops = {op.name: op for op in inspect.collective_ops(HLO, MESH)}
    assert ops["ar"].axes == ("tensor",) and ops["ar"].count == 6 and ops["ar"].bytes == 4 * 64 * 4
    assert ops["ag"].axes == ("data",) and ops["ag"].bytes == 32 * 16 * 4 and ops["ag"].group_size == 4
    assert ops["rs"].axes == ("tensor",) and ops["rs"].bytes == 4 * 16 * 2
    assert ops["ar2"].axes == ("data", "tensor") and ops["ar2"].bytes == 16 * 4 and len(ops["ar2"].shapes) == 2
    assert ops["cp"].axes == ("data",) and ops["cp"].bytes == 4 * 16 * 4


def test_rows_sum_calls_and_ring_traffic():
    rows = {(r["kind"], tuple(r["axes"])): r for r in inspect.collectives(HLO, MESH)}
    tensor = rows[("all-reduce", ("tensor",))]
    assert tensor["count"] == 6 and tensor["bytes"] == 6 * 1024
    assert tensor["traffic"] == pytest.approx(6 * 1024 * 2 * (2 - 1) / 2)
    assert rows[("all-gather", ("data",))]["traffic"] == pytest.approx(2048 * 3 / 4)
    assert rows[("all-reduce", ("data", "tensor"))]["buffers"] == 2
    assert rows[("collective-permute", ("data",))]["traffic"] == 256


def test_ring_formulas():
    assert inspect.ring_traffic("all-reduce", 800, 8) == pytest.approx(1400)
    assert inspect.ring_traffic("all-to-all", 800, 4) == pytest.approx(600)
    assert inspect.ring_traffic("all-gather", 800, 1) == 0.0
    assert np.isclose(inspect.ring_traffic("collective-permute", 800, 2), 800)


@pytest.mark.parametrize("layers", [2, 8])
def test_matmul_flops_count_every_layer_of_the_scan(layers):
    """XLA's cost analysis counts the layer scan's body once; matmul_flops counts it per layer: 6 N + attention per token."""
    import jax
    import optax
    from flax import nnx

    from jaxpar import mfu
    from jaxpar.models import model_config
    from jaxpar.models.llama import Llama
    from jaxpar.plan import Plan
    from jaxpar.state import abstract_state, describe
    from jaxpar.step import make_train_step

    config = model_config("tiny", {"n_layers": layers, "seq_len": 32})
    plan = Plan.create("data=1", devices=jax.devices()[:1])
    model = describe(lambda: Llama(config, nnx.Rngs(0)))
    optimizer = optax.sgd(0.1)
    batch = {k: jax.ShapeDtypeStruct((4, 32), np.int32) for k in ("inputs", "targets")}
    compiled = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(
        abstract_state(model, optimizer, plan), batch).compile()
    assert inspect.matmul_flops(compiled) == pytest.approx(mfu.model_flops_per_step("tiny", config, 4, 32), rel=0.01)


def test_pipeline_figures_come_from_the_schedule_and_the_compiled_ring():
    """pipe=4, 8 layers: bubble and live-microbatch bound from the tick tables; the residual ring's bytes read from
    the compiled step, flat in m; a set is its input activation and its layers' residuals, so a chunk's (one layer,
    v = 2) holds half the layer residuals of a whole stage's (two layers, 1f1b)."""
    import jax
    import optax
    from flax import nnx

    from jaxpar.models import model_config
    from jaxpar.models.llama import Llama
    from jaxpar.plan import Plan
    from jaxpar.schedule import Schedule
    from jaxpar.state import abstract_state, describe
    from jaxpar.step import make_train_step

    config = model_config("tiny", {"n_layers": 8, "seq_len": 32})
    model, optimizer = describe(lambda: Llama(config, nnx.Rngs(0))), optax.adamw(1e-3)

    def figures(schedule, m, v=1):
        plan = Plan.create("pipe=4", devices=jax.devices()[:4], schedule=schedule, microbatches=m, virtual_stages=v)
        batch = {k: jax.ShapeDtypeStruct((m, 32), np.int32) for k in ("inputs", "targets")}
        compiled = make_train_step(model, lambda mod, b: mod(b), optimizer, plan).lower(
            abstract_state(model, optimizer, plan), batch).compile()
        out = inspect.summary(compiled, plan.mesh, plan)["pipeline"]
        assert out["peak_residual_bytes"] < inspect.memory(compiled)["temp"]
        assert out["bubble"] == Schedule(schedule, 4, m, v).bubble
        return out

    small, large, whole = figures("interleaved", 8, 2), figures("interleaved", 16, 2), figures("1f1b", 8)
    assert (small["ring_rows"], small["live_microbatches"], whole["ring_rows"], whole["live_microbatches"]) == \
        (11, 5.5, 7, 7)
    assert small["peak_residual_bytes"] == large["peak_residual_bytes"] > 0
    per_chunk, per_stage = small["peak_residual_bytes"] / 11, whole["peak_residual_bytes"] / 7
    assert 2 * per_chunk - per_stage == 32 * config.d_model * 4  # one [1, 32, d] fp32 activation

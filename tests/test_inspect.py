"""The HLO reader: replica groups in each of XLA's text forms map to the right mesh axes."""

import math

import numpy as np
import pytest

from helpers import flash_recomputed_flops
from jaxpar.planner import inspect
from jaxpar.core.mesh import MeshSpec, make_mesh

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
    """XLA's cost analysis counts the layer scan's body once; matmul_flops counts it per layer: 6 N + attention per
    token, and flash attention's recomputed scores."""
    import jax
    import optax
    from flax import nnx

    from jaxpar.planner import mfu
    from jaxpar.models import model_config
    from jaxpar.models.llama import Llama
    from jaxpar.core.plan import Plan
    from jaxpar.train.state import abstract_state, describe
    from jaxpar.train.step import make_train_step

    config = model_config("tiny", {"n_layers": layers, "seq_len": 32})
    model = describe(lambda: Llama(config, nnx.Rngs(0)))
    optimizer = optax.sgd(0.1)
    batch = {k: jax.ShapeDtypeStruct((4, 32), np.int32) for k in ("inputs", "targets")}
    model_flops = mfu.model_flops_per_step("tiny", config, 4, 32)
    recomputed = flash_recomputed_flops(config, 4, 32)
    for attention, expected in (("xla", model_flops), ("flash", model_flops + recomputed)):
        plan = Plan.create("data=1", devices=jax.devices()[:1], attention=attention)
        compiled = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(
            abstract_state(model, optimizer, plan), batch).compile()
        assert inspect.matmul_flops(compiled) == pytest.approx(expected, rel=0.01), attention


# The ring's bytes against the model's residuals, with the plain softmax: under flash attention (no scores among
# the residuals) the ring exceeds the residual count by the rotary tables, which XLA keeps twice per row.
RING_TESTS_ATTENTION = "xla"


def ring_set_bytes(config, layers: int) -> tuple[int, int]:
    """Bytes of one ring row as the model makes it: (the residuals the layer scan stacks, all residuals) of the VJP
    of `layers` blocks on one sequence, its parameters left out."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpar.core.plan import Plan
    from jaxpar.models.llama import Llama, run_layers
    from jaxpar.train.state import describe

    logical = describe(lambda: Llama(config, nnx.Rngs(0))).logical["blocks"]
    blocks = {k: jax.ShapeDtypeStruct((layers, *a.shape[1:]), a.dtype) for k, a in logical.items()}

    def residuals(q, x):
        own = {id(a) for a in jax.tree.leaves(q)}
        return [r for r in jax.tree.leaves(jax.vjp(functools.partial(run_layers, cfg=config), q, x)[1])
                if id(r) not in own]

    with Plan.create("data=1", devices=jax.devices()[:1], attention=RING_TESTS_ATTENTION).activate():
        leaves = jax.eval_shape(residuals, blocks, jax.ShapeDtypeStruct((1, config.seq_len, config.d_model),
                                                                        jnp.float32))
    nbytes = [math.prod(r.shape) * r.dtype.itemsize for r in leaves]
    return sum(n for n, r in zip(nbytes, leaves) if r.shape[:1] == (layers,)), sum(nbytes)


def compiled_pipeline_figures(config, mesh: str, schedule: str, m: int, batch: int, v: int = 1, **devices):
    import jax
    import optax
    from flax import nnx

    from jaxpar.models.llama import Llama
    from jaxpar.core.plan import Plan
    from jaxpar.train.state import abstract_state, describe
    from jaxpar.train.step import make_train_step

    model, optimizer = describe(lambda: Llama(config, nnx.Rngs(0))), optax.adamw(1e-3)
    plan = Plan.create(mesh, schedule=schedule, microbatches=m, virtual_stages=v, attention=RING_TESTS_ATTENTION,
                       **devices)
    spec = {k: jax.ShapeDtypeStruct((batch, config.seq_len), np.int32) for k in ("inputs", "targets")}
    compiled = make_train_step(model, lambda mod, b: mod(b), optimizer, plan).lower(
        abstract_state(model, optimizer, plan), spec).compile()
    return compiled, inspect.summary(compiled, plan.mesh, plan)["pipeline"]


def test_pipeline_figures_come_from_the_schedule_and_the_compiled_ring():
    """pipe=4, 8 layers: bubble and live-microbatch bound from the tick tables; the residual ring's bytes read from
    the compiled step, flat in m; a chunk's set (one layer, v = 2) holds less than a whole stage's (two layers,
    1f1b), which holds what the model's two layers stack, at most all their residuals."""
    import jax

    from jaxpar.models import model_config
    from jaxpar.pipeline.schedule import Schedule

    config = model_config("tiny", {"n_layers": 8, "seq_len": 32})

    def figures(schedule, m, v=1):
        compiled, out = compiled_pipeline_figures(config, "pipe=4", schedule, m, m, v, devices=jax.devices()[:4])
        assert out["peak_residual_bytes"] < inspect.memory(compiled)["temp"]
        assert out["bubble"] == Schedule(schedule, 4, m, v).bubble
        return out

    small, large, whole = figures("interleaved", 8, 2), figures("interleaved", 16, 2), figures("1f1b", 8)
    assert (small["ring_rows"], small["live_microbatches"], whole["ring_rows"], whole["live_microbatches"]) == \
        (10, 5, 6, 6)
    assert small["peak_residual_bytes"] == large["peak_residual_bytes"] > 0
    per_chunk, per_stage = small["peak_residual_bytes"] / 10, whole["peak_residual_bytes"] / 6
    stacked, every = ring_set_bytes(config, 2)
    assert per_chunk < per_stage and stacked <= per_stage <= every


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_residual_ring_bytes_count_every_buffer_of_the_ring(schedule, v):
    """data=4 x pipe=2, m = 4, one sequence per device per microbatch: the compiled ring holds, per row in flight,
    every residual the stage's (or chunk's) layer scan stacks, as computed from the model, and at most all its
    residuals (XLA merges the rows' equal position tables and drops residuals the backward does not read)."""
    from jaxpar.models import model_config

    config = model_config("tiny", {"n_layers": 8, "seq_len": 32})
    _, figures = compiled_pipeline_figures(config, "data=4,pipe=2", schedule, 4, 16, v)
    stacked, every = ring_set_bytes(config, config.n_layers // (2 * v))
    assert figures["ring_rows"] * stacked <= figures["peak_residual_bytes"] <= figures["ring_rows"] * every

"""Pipeline schedules against single-device training: same loss and gradients, bounded memory, known collectives.

Bubble slots are filled with NaN, so a value read from an empty slot poisons
the loss or a gradient.
"""

import dataclasses
import functools
import json
import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import TINY, copy_state, gradients, max_relative_error, reference_state, single_device_plan
from jaxpar.planner import inspect
from jaxpar.pipeline import executor as pipeline
from jaxpar.pipeline import schedule
from jaxpar.pipeline.residual_ring import ResidualRing
from jaxpar.cli import build_parser, main, resolve
from jaxpar.pipeline.layer_order import to_pipeline_order, train_state_layers
from jaxpar.models.llama import Llama
from jaxpar.core.plan import Plan
from jaxpar.train.state import abstract_state, describe
from jaxpar.train.step import make_train_step

NAN = float("nan")
CONFIG = dataclasses.replace(TINY, seq_len=16)
DEEP = dataclasses.replace(CONFIG, n_layers=8)  # pipe=4 x virtual_stages=2 chunks for the interleaved schedule
BATCH = 32
MESHES = {2: "pipe=2,data=4", 4: "pipe=4,data=2"}
loss_fn = lambda model, batch: model(batch)  # noqa: E731


def token_batch(size, seq, seed=0):
    rng = np.random.default_rng(seed)
    shape = (size, seq)
    return {"inputs": rng.integers(0, CONFIG.vocab, shape, dtype=np.int32),
            "targets": rng.integers(0, CONFIG.vocab, shape, dtype=np.int32)}


@pytest.fixture(scope="module")
def references():
    """Per config: the model, its initial state, a batch, and loss and gradients on one device."""
    cache = {}

    def get(config):
        if config not in cache:
            model, state, optimizer = reference_state(config)
            batch = token_batch(BATCH, config.seq_len)
            loss, grads = gradients(model, state.params, batch, single_device_plan())
            cache[config] = (model, state, optimizer, batch, loss, grads)
        return cache[config]

    return get


def relative(a, b) -> float:
    return abs(float(a) - float(b)) / abs(float(b))


@pytest.mark.parametrize("per_stage", [1, 4], ids=["m=p", "m=4p"])
@pytest.mark.parametrize("pipe", [2, 4])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_schedule_matches_single_device(references, name, pipe, per_stage):
    v = 2 if name == "interleaved" else 1
    model, state, _, batch, ref_loss, ref_grads = references(DEEP if v > 1 else CONFIG)
    plan = Plan.create(MESHES[pipe], schedule=name, microbatches=per_stage * pipe, virtual_stages=v)
    with pipeline.bubble_fill(NAN):
        loss, grads = gradients(model, state.params, batch, plan)
    assert relative(loss, ref_loss) <= 1e-5
    assert max_relative_error(grads, ref_grads) <= 1e-5


# The pipeline with context parallelism: each schedule, both attention forms, with data + ZeRO-3 and tensor.
CONTEXT_CASES = [
    ("1f1b", "pipe=2,context=2,data=2", {"context_form": "ring", "zero": 3}),
    ("gpipe", "pipe=2,context=2,tensor=2", {"context_form": "all-gather", "tensor_form": "explicit"}),
    ("interleaved", "pipe=2,context=4", {"context_form": "ring", "virtual_stages": 2}),
    ("zb-h1", "pipe=2,context=2,data=2", {"context_form": "ring"}),  # ring attention: masked slots (per_slot)
    ("zb-h1", "pipe=4,context=2", {"context_form": "ring"}),  # forwards before the head whose B reads another set
]


@pytest.mark.parametrize("name, mesh, options", CONTEXT_CASES, ids=[f"{n}-{m}" for n, m, _ in CONTEXT_CASES])
def test_schedule_with_context_parallelism_matches_single_device(references, name, mesh, options):
    model, state, _, batch, ref_loss, ref_grads = references(DEEP if name == "interleaved" else CONFIG)
    plan = Plan.create(mesh, schedule=name, microbatches=4, **options)
    with pipeline.bubble_fill(NAN):
        loss, grads = gradients(model, state.params, batch, plan)
    assert relative(loss, ref_loss) <= 1e-5
    assert max_relative_error(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("pipe, m", [(2, 2), (4, 4)])
def test_zb_h1_with_its_cotangents_in_a_buffer_of_their_own_matches_single_device(references, monkeypatch, pipe, m):
    """Where no residual buffer can hold a cotangent, zb-h1 keeps them in a buffer of their own (and at m < 2p - 2,
    where the ring has no row free for some, those go there): same loss and gradients, NaN-filled bubbles."""
    model, state, _, batch, ref_loss, ref_grads = references(CONFIG)
    init = ResidualRing.__init__

    def without_holder(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.holder = None

    monkeypatch.setattr(ResidualRing, "__init__", without_holder)
    plan = Plan.create(MESHES[pipe], schedule="zb-h1", microbatches=m)
    with pipeline.bubble_fill(NAN):
        loss, grads = gradients(model, state.params, batch, plan)
    assert relative(loss, ref_loss) <= 1e-5
    assert max_relative_error(grads, ref_grads) <= 1e-5


def forward_only_loss(model, state, batch, plan) -> float:
    """The loss without differentiation (only the forward ticks run), bubbles filled with NaN."""
    params = to_pipeline_order(copy_state(state.params), model.logical, plan)
    params = jax.device_put(params, plan.shardings(plan.param_specs(model.logical)))
    with plan.activate(), pipeline.bubble_fill(NAN), train_state_layers():
        return float(jax.jit(lambda p, b: loss_fn(model.merge(p), b)[0])(params, batch))


def test_forward_only_loss_matches_and_a_bubble_read_shows_as_nan(references, monkeypatch):
    """Without differentiation the schedule runs its forward ticks; reading one tick early hits the NaN fill."""
    model, state, _, batch, ref_loss, _ = references(CONFIG)
    plan = Plan.create("pipe=2,data=4", schedule="1f1b", microbatches=4)
    assert relative(forward_only_loss(model, state, batch, plan), ref_loss) <= 1e-5
    early = schedule.Schedule.output_ticks.func
    monkeypatch.setattr(schedule.Schedule, "output_ticks", property(lambda s: early(s) - 1))
    assert math.isnan(forward_only_loss(model, state, batch, plan))


def test_interleaved_forward_only_loss_matches(references):
    """The round-robin forward ticks alone (v = 2 chunks per device, the ring closed) give one device's loss."""
    model, state, _, batch, ref_loss, _ = references(CONFIG)
    plan = Plan.create("pipe=2,data=4", schedule="interleaved", microbatches=4, virtual_stages=2)
    assert relative(forward_only_loss(model, state, batch, plan), ref_loss) <= 1e-5


def cli_losses(tmp_path, name, *flags):
    metrics = tmp_path / f"{name}.jsonl"
    flags = ["--steps", "4", "--batch-size", "8", "--seq-len", "32", "--metrics", str(metrics), *flags]
    assert main(["train", *flags]) == 0
    return np.array([json.loads(line)["loss"] for line in metrics.read_text().splitlines()])


def test_jaxpar_train_defaults_to_3d_with_zero1_and_matches_data_parallel(tmp_path):
    """Without --mesh, 8 devices train as data=2 x tensor=2 x pipe=2 with ZeRO-1 (1F1B), losses as on data=8."""
    _, options, mesh = resolve(build_parser().parse_args(["train"]))
    assert {axis: n for axis, n in mesh.shape.items() if n > 1} == {"data": 2, "pipe": 2, "tensor": 2}
    assert options == {"zero": 1}
    with pipeline.bubble_fill(NAN):
        three_d = cli_losses(tmp_path, "3d")
    data_parallel = cli_losses(tmp_path, "dp", "--mesh", "data=8")
    assert np.max(np.abs(three_d - data_parallel) / data_parallel) <= 1e-5


# -- memory and communication of the compiled step (p = 4, one sequence per device per microbatch) ------

MEMORY_CONFIG = dataclasses.replace(TINY, seq_len=32)
STAGES, DATA = 4, 2


@pytest.fixture(scope="module")
def compiled_steps():
    """name, m -> (compiled train step, plan); the global batch grows with m at a fixed microbatch size."""
    model, optimizer = describe(lambda: Llama(MEMORY_CONFIG, nnx.Rngs(0))), optax.adamw(1e-3)
    cache = {}

    def get(name, m):
        if (name, m) not in cache:
            plan = Plan.create(f"pipe={STAGES},data={DATA}", schedule=name, microbatches=m)
            spec = jax.ShapeDtypeStruct((DATA * m, MEMORY_CONFIG.seq_len), np.int32)
            step = make_train_step(model, loss_fn, optimizer, plan)
            compiled = step.lower(abstract_state(model, optimizer, plan), {"inputs": spec, "targets": spec}).compile()
            cache[name, m] = (compiled, plan, model)
        return cache[name, m]

    return get


def temp_bytes(compiled) -> int:
    return inspect.memory(compiled)["temp"]


def test_1f1b_memory_stays_flat_while_gpipe_grows_with_microbatches(compiled_steps):
    """1F1B keeps at most min(m, 2p - 2) microbatches' residuals; GPipe keeps all m + p - 1 ticks'."""
    one_f_one_b = {m: temp_bytes(compiled_steps("1f1b", m)[0]) for m in (8, 32)}
    gpipe = {m: temp_bytes(compiled_steps("gpipe", m)[0]) for m in (8, 32)}
    assert one_f_one_b[32] <= 1.15 * one_f_one_b[8]
    assert gpipe[32] >= 2 * gpipe[8]
    assert one_f_one_b[8] < gpipe[8]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_collectives_over_pipe_match_the_schedule(compiled_steps, name):
    """Per tick one activation forward and one cotangent backward; the head's share moves once per microbatch."""
    m = 8
    compiled, plan, model = compiled_steps(name, m)
    activation = MEMORY_CONFIG.seq_len * MEMORY_CONFIG.d_model * 4  # one sequence per device per microbatch
    ops = [op for op in inspect.collective_ops(compiled, plan.mesh) if op.axes == ("pipe",)]
    moved = {}
    for op in ops:
        moved[op.kind] = moved.get(op.kind, 0) + op.count * op.bytes

    permutes = [op for op in ops if op.kind == "collective-permute"]
    assert sum(op.count for op in permutes) == 2 * (m + STAGES - 1)
    assert {op.bytes for op in permutes} == {activation}
    # The loss head's share of positions: an all-to-all of the last stage's outputs, and back for the
    # cotangents (autodiff transposes the all-to-all; 1F1B all-gathers its own).
    head = {"gpipe": {"all-to-all": 2 * m * activation},
            "1f1b": {"all-to-all": m * activation, "all-gather": m * activation}}
    assert {k: v for k, v in moved.items() if k not in ("collective-permute", "all-reduce")} == head[name]

    # The only arrays summed over pipe are the gradients of the parameters every stage holds: embedding and head.
    replicated = sum(math.prod(leaf.shape) * 4 for key, leaf in model.logical.items() if key != "blocks")
    reduced = [op for op in ops if op.kind == "all-reduce"]
    summed = sum(op.count * math.prod(shape) * 4 for op in reduced for shape in op.shapes if shape)
    assert summed == replicated


@functools.cache
def compile_on_four(config, m: int, **options):
    """The train step on pipe=4 over 4 devices (or one device without options), one sequence per microbatch."""
    model, optimizer = describe(lambda: Llama(config, nnx.Rngs(0))), optax.adamw(1e-3)
    mesh = f"pipe={STAGES}" if options else "data=1"
    plan = Plan.create(mesh, devices=jax.devices()[:STAGES if options else 1], **options)
    spec = jax.ShapeDtypeStruct((m, config.seq_len), np.int32)
    step = make_train_step(model, loss_fn, optimizer, plan)
    return step.lower(abstract_state(model, optimizer, plan), {"inputs": spec, "targets": spec}).compile()


def test_interleaved_memory_stays_flat_and_its_flops_show_the_bubble():
    """v = 2 chunks of 8 layers on p = 4: temp memory at m = 8p within 15% of m = 2p (a ring of chunk residuals,
    not every tick's), and matmul FLOPs over the unpipelined step's (v m + p - 1) / (v m), the bubble's share."""
    config, v = dataclasses.replace(MEMORY_CONFIG, n_layers=8), 2
    steps = {m: compile_on_four(config, m, schedule="interleaved", microbatches=m, virtual_stages=v) for m in (8, 32)}
    temp = {m: temp_bytes(compiled) for m, compiled in steps.items()}
    assert temp[32] <= 1.15 * temp[8]
    m = 8
    ratio = inspect.matmul_flops(steps[m]) * STAGES / inspect.matmul_flops(compile_on_four(config, m))
    assert ratio == pytest.approx((v * m + STAGES - 1) / (v * m), rel=0.05)
    # The count still shows the bubble: each slot's work is a branch of its cond on every tick (a bubble slot
    # skips it at run time), not optimised away.
    assert ratio > 1 + 0.5 * (STAGES - 1) / (v * m)


def test_zb_h1_keeps_its_cotangents_in_1f1b_ring():
    """zb-h1 splits 1F1B's backward into B and W slots and keeps cotangents from one to the other: in rows of the
    ring no residual set holds (stage i keeps i cotangents where it keeps i sets fewer than stage 0), stage 0's W
    taking the one its B takes. At p = 4, m = 8 (benchmarks/pipeline.py's model) its compiled ring is 1F1B's, rows
    and bytes, and its temp is no higher than 1F1B's: its W slots keep no idle activation live, and its ticks before
    the first W run one forward slot, not two (before: 6912 B above, what XLA kept for its extra slots and loop;
    before that, p cotangents in a buffer of their own, and one ring row more in both)."""
    config, m = dataclasses.replace(MEMORY_CONFIG, n_layers=8), 8
    temp, figures = {}, {}
    for name in ("1f1b", "zb-h1"):
        compiled = compile_on_four(config, m, schedule=name, microbatches=m)
        plan = Plan.create(f"pipe={STAGES}", devices=jax.devices()[:STAGES], schedule=name, microbatches=m)
        temp[name], figures[name] = temp_bytes(compiled), inspect.pipeline_figures(compiled, plan)
    assert figures["zb-h1"]["ring_rows"] == figures["1f1b"]["ring_rows"] == 2 * STAGES - 2
    assert figures["zb-h1"]["peak_residual_bytes"] == figures["1f1b"]["peak_residual_bytes"]
    assert schedule.Schedule("zb-h1", STAGES, m).ring_layout().cotangent_buffer_rows == 0
    assert temp["zb-h1"] <= temp["1f1b"]
    assert schedule.Schedule("zb-h1", STAGES, m).bubble < schedule.Schedule("1f1b", STAGES, m).bubble


@pytest.mark.parametrize("m", [8, 16])
def test_zb_h1_at_two_stages_takes_no_more_temp_than_1f1b(m):
    """ZB-H1's point: 1F1B's memory with a smaller bubble. At p = 2 every stage runs the W of the last microbatch
    in the last tick, so XLA folded that W's cond and scheduled its replay's zero-filled gradient buffers at the
    step's start, live through the peak (+588352 B over 1F1B here, a stage's parameters and more); a one-tick
    run also traced its tick's conds once more. (p = 4: the test above; the full grid: benchmarks/pipeline.py.)"""
    config, temp = dataclasses.replace(MEMORY_CONFIG, n_layers=8), {}
    model, optimizer = describe(lambda: Llama(config, nnx.Rngs(0))), optax.adamw(1e-3)
    spec = jax.ShapeDtypeStruct((m, config.seq_len), np.int32)
    for name in ("1f1b", "zb-h1"):
        plan = Plan.create("pipe=2", devices=jax.devices()[:2], schedule=name, microbatches=m)
        step = make_train_step(model, loss_fn, optimizer, plan)
        temp[name] = temp_bytes(step.lower(abstract_state(model, optimizer, plan),
                                           {"inputs": spec, "targets": spec}).compile())
    assert temp["zb-h1"] <= temp["1f1b"], temp
    assert schedule.Schedule("zb-h1", 2, m).bubble < schedule.Schedule("1f1b", 2, m).bubble


def test_interleaved_moves_no_weights_per_step():
    """The state holds the layers in pipeline order (jaxpar.pipeline.layer_order), so every collective-permute is an
    activation or cotangent inside the tick loops: one per forward and one per backward tick. Outside the loops
    only the embedding's and head's gradients are summed (moving the layers showed as permutes or all-to-alls)."""
    config, v, m = dataclasses.replace(MEMORY_CONFIG, n_layers=8), 2, 8
    compiled = compile_on_four(config, m, schedule="interleaved", microbatches=m, virtual_stages=v)
    mesh = Plan.create(f"pipe={STAGES}", devices=jax.devices()[:STAGES]).mesh
    ops = inspect.collective_ops(compiled, mesh)
    outside = [(op.kind, op.shapes) for op in ops if op.count == 1 and op.kind != "all-reduce"]
    assert not outside, f"collectives outside the pipeline's loops: {outside}"
    permutes = [op for op in ops if op.kind == "collective-permute"]
    assert {op.bytes for op in permutes} == {config.seq_len * config.d_model * 4}
    assert sum(op.count for op in permutes) == 2 * (v * m + STAGES - 1)


# -- bad input fails before compiling ----------------------------------------------------------------------


def lower(config, mesh, batch_shape, **options):
    model, optimizer = describe(lambda: Llama(config, nnx.Rngs(0))), optax.adamw(1e-3)
    plan = Plan.create(mesh, **options)
    spec = jax.ShapeDtypeStruct(batch_shape, np.int32)
    make_train_step(model, loss_fn, optimizer, plan).lower(
        abstract_state(model, optimizer, plan), {"inputs": spec, "targets": spec}
    )


def test_layers_that_do_not_divide_into_chunks_fail():
    with pytest.raises(ValueError, match=r"4 stacked layers do not divide into pipe=4 x virtual_stages=2 = 8"):
        lower(CONFIG, "pipe=4,data=2", (16, 16), schedule="interleaved", virtual_stages=2, microbatches=4)
    with pytest.raises(ValueError, match=r"'layers'\) of size 3 does not divide by mesh axes pipe=2"):
        lower(dataclasses.replace(CONFIG, n_layers=3), "pipe=2,data=4", (16, 16))


def test_batch_that_does_not_split_into_microbatches_fails():
    with pytest.raises(ValueError, match=r"global batch 12 does not divide .* microbatches=4 \(product 8\)"):
        lower(CONFIG, "pipe=4,data=2", (12, 16), microbatches=4)


def test_sequence_that_does_not_split_over_stages_fails():
    with pytest.raises(ValueError, match="sequence length 18 does not divide by pipe=4"):
        lower(CONFIG, "pipe=4,data=2", (8, 18), microbatches=4)

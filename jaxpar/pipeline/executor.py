"""Pipeline parallelism over `pipe`: stacked layers cut into stages, microbatches streamed by a schedule.

A model hands `loss` three pure functions (embedding, a chunk of its stacked
layers, loss head) and their parameters. Under a plan with pipe > 1 the layers'
leading axis is cut into pipe x virtual_stages chunks and the schedule's tick
table (`jaxpar.pipeline.schedule`) runs inside `jax.shard_map` over `pipe` only, so data,
tensor and expert sharding inside a stage keep working through GSPMD. The
train state holds the layers in the order the stages run them
(`jaxpar.pipeline.layer_order`: with v > 1 chunks per device, not the natural order),
so each device's `pipe` shard is its own chunks and no weights move per step. Each tick
is one `lax.scan` iteration; activations go forward and cotangents backward
with one `ppermute` each.

- gpipe: a scan of forward ticks; the backward is its autodiff, which keeps
  every tick's residuals (memory grows with the microbatches).
- 1f1b, interleaved and zb-h1: action tables (`Schedule.actions`) run by one
  executor (`jaxpar.pipeline.table_executor`): forward, backward (fused, or input- and
  weight-backward for zb-h1) slots of different microbatches and chunks share
  a tick, one scan per segment of ticks with the same slot kinds. Each stage
  keeps the VJP residuals of its (microbatch, chunk) pairs in flight in a ring
  buffer whose rows the table assigns (2p - 2 for 1f1b and zb-h1, fewer
  stages' worth of chunk-sized ones for interleaved), whatever m is; zb-h1
  keeps its cotangents from B to W in rows of that ring no residuals hold at
  the time.
  Loss and gradients come out of these scans, wrapped in a `jax.custom_vjp`
  so the train step differentiates it like any loss. Without differentiation
  only the forward ticks run (`jaxpar.pipeline.forward_scan`).

The embedding feeds stage 0 and the loss head runs on the last stage's outputs,
split over the pipe stages by sequence positions (a reduce-scatter of the
outputs and an all-gather of their cotangents), so no stage does p times the
head's work. Parameters every stage holds (embedding, head) get their gradients
summed over pipe once per step.

A batch of packed documents (jaxpar.parallel.documents) is split into
microbatches like the tokens: wherever a stage's layers are traced (a forward
slot, the probes of their shapes) they see their microbatch's segment ids and
positions, and the loss head its share of the positions' loss weights (and a
preference batch's answer sides and reference log-probs), put in context order
with the targets (`pipe_axis.layer_documents`, `head_documents`).

Layers may also return per-layer statistics (an MoE router's losses and
metrics). Each stage sums its own layers' statistics per microbatch; they are
summed over the stages and averaged over the microbatches, and `aux_loss` of
that sum joins the loss, each stage back-propagating its own layers' part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.core import trace, usage
from jaxpar.core.microbatches import microbatches
from jaxpar.core.trace import active_plan
from jaxpar.parallel import attention, documents, zero
from jaxpar.parallel.constrain import varying_axes
from jaxpar.pipeline import layer_order
from jaxpar.pipeline.forward_scan import autodiff_body, forward_loss
from jaxpar.pipeline.layer_order import stack_in_plan_order
from jaxpar.pipeline.pipe_axis import AXIS
from jaxpar.pipeline.schedule import Schedule
from jaxpar.pipeline.stages import Stages
from jaxpar.pipeline.table_executor import table_body


def bubble_fill(value: float):
    """Fill bubble slots (and empty ring-buffer slots) with `value` while tracing; NaN in tests shows leaks."""
    return trace.scoped(bubble_fill=value)


def loss(stages: Stages, embed_params, stacked, head_params, inputs: jax.Array, targets: jax.Array,
         layer_order: str | None = None):
    """The model's mean loss on a batch; pipelined over `pipe` when the active plan has pipe > 1.

    `stacked` comes in the plan's layer order (jaxpar.pipeline.layer_order), as a train state on the plan
    holds it: with virtual_stages > 1 not the natural order. Outside jaxpar's train step such a plan
    needs `layer_order` to name the order ("pipeline" or "natural"). With layers that return stats:
    (loss, the stats summed over the layers, averaged over the microbatches); the stats are
    metrics, and only `stages.aux_loss` of them is differentiated (as part of the loss).
    """
    plan = active_plan()
    if plan is None or plan.shape[AXIS] == 1:
        y, sums = stages.run_layers(stacked, stages.embed(embed_params, inputs))
        return _result(stages.with_aux(stages.head(head_params, y, targets), sums), sums)
    usage.mark(usage.PIPELINE)
    stacked = stack_in_plan_order(stacked, plan, layer_order)
    schedule = Schedule(plan.schedule, plan.shape[AXIS], plan.pipeline_microbatches, plan.virtual_stages)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    check_shapes(schedule, stacked, inputs, plan.axis_size(*(a for a in plan.batch_axes if a not in manual)))
    # Under context parallelism the targets take the sequence order of the embedded tokens here, whole,
    # before each stage's loss head gets its share of the positions (jaxpar.parallel.attention).
    targets = attention.context_order(targets, usage.CONTEXT_TARGETS)
    stages = dataclasses.replace(stages, head=_ordered_head(stages.head))
    split = microbatches({"inputs": inputs, "targets": targets, "documents": _documents(targets.shape)},
                         schedule.microbatches)
    stacked, entries = zero.layer_sources(stacked)  # ZeRO-2/3: each stage gathers its layers one at a time
    args = (embed_params, to_chunks(stacked, schedule), head_params, split["inputs"], split["targets"],
            split["documents"])
    with documents.scope(None):  # inside, each stage's layers and head see their own microbatch's (pipe_axis)
        return _result(*_pipelined(stages, schedule, trace.current().bubble_fill, entries)(*args))


def _documents(shape) -> dict:
    """The traced batch's document fields (jaxpar.parallel.documents), those per target in the targets' order."""
    fields = documents.current()
    for name, value in fields.items():
        if value.shape != tuple(shape):
            raise ValueError(f"the batch's {name} {list(value.shape)} and its targets {list(shape)} differ in shape")
    return {name: attention.context_order(value, usage.CONTEXT_TARGETS) if name in documents.TARGET_FIELDS else value
            for name, value in fields.items()}


def _ordered_head(head: Callable) -> Callable:
    """`head` told that its targets are already in context order, wherever it is traced (backward too)."""

    def run(params, x, targets):
        with attention.already_ordered(usage.CONTEXT_TARGETS):
            return head(params, x, targets)

    return run


def _result(value: jax.Array, sums):
    return (value, sums) if jax.tree.leaves(sums) else value


def check_shapes(schedule: Schedule, stacked, inputs: jax.Array, batch_ways: int) -> None:
    """Raise ValueError (before anything compiles) when layers, batch or sequence do not split."""
    p, v, m = schedule.stages, schedule.virtual_stages, schedule.microbatches
    layers = {leaf.shape[0] for leaf in jax.tree.leaves(stacked)}
    if len(layers) != 1:
        raise ValueError(f"stacked layer parameters disagree on the number of layers: {sorted(layers)}")
    layer_order.check_depth(*layers, p, v)
    batch, seq = inputs.shape
    if batch % (m * batch_ways):
        raise ValueError(
            f"global batch {batch} does not split into microbatches={m} x {batch_ways} batch shards "
            f"(the batch axes); make it a multiple of {m * batch_ways}"
        )
    if seq % p:
        raise ValueError(
            f"sequence length {seq} does not divide by pipe={p}: the loss head is split over the pipe stages "
            f"by sequence positions"
        )


def to_chunks(stacked, schedule: Schedule):
    """[L, ...] -> [p, v, L/(p*v), ...], device i's chunk k the layers of ring position k*p + i: a reshape.

    `stacked` must be in the active plan's pipeline order (jaxpar.pipeline.layer_order),
    as a train state placed on that plan holds it: device i's `pipe` shard is
    then its v chunks already, and nothing moves between devices.
    """
    p, v = schedule.stages, schedule.virtual_stages
    return jax.tree.map(lambda leaf: leaf.reshape(p, v, leaf.shape[0] // (p * v), *leaf.shape[1:]), stacked)


def _shard(body: Callable, out_specs) -> Callable:
    return jax.shard_map(
        body, in_specs=(P(), P(AXIS), P(), P(), P(), P()), out_specs=out_specs, axis_names={AXIS}
    )


def _pipelined(stages: Stages, schedule: Schedule, fill: float, entries: list) -> Callable:
    """loss(embed params, chunks, head params, tokens, targets, documents) whose VJP is the schedule's own backward.

    Without differentiation only the forward ticks run. Under autodiff the
    schedule computes the loss and every gradient in one shard_map (a custom
    VJP that stashes the gradients and scales them by the incoming cotangent),
    so no transpose of the pipeline is left to JAX.
    """
    forward = _shard(forward_loss(stages, schedule, fill, entries), (P(), P()))
    body = table_body if schedule.explicit_backward else autodiff_body
    with_grads = _shard(body(stages, schedule, fill, entries), ((P(), P()), (P(), P(AXIS), P())))

    primal_axes = {}

    @jax.custom_vjp
    def run(embed_params, chunks, head_params, tokens, targets, docs):
        return forward(embed_params, chunks, head_params, tokens, targets, docs)

    def run_fwd(*args):
        primal_axes["params"] = jax.tree.map(varying_axes, args[:3])
        return with_grads(*args)

    def run_bwd(grads, cotangents):
        cotangent = cotangents[0]  # the stats are metrics: their aux loss is already inside the loss

        def scale(g, axes):
            if g.dtype == jax.dtypes.float0:  # an integer parameter's (LoRA dropout's salts): no gradient to scale
                return g
            g = (g * cotangent).astype(g.dtype)
            extra = tuple(sorted(varying_axes(g) - axes))
            return jax.lax.psum(g, extra) if extra else g

        is_axes = lambda x: isinstance(x, set)  # noqa: E731
        return (*jax.tree.map(scale, grads, primal_axes["params"], is_leaf=is_axes), None, None, None)

    run.defvjp(run_fwd, run_bwd)
    return run

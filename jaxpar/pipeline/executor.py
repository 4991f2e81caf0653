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
  executor, `_table_body`: forward, backward (fused, or input- and
  weight-backward for zb-h1) slots of different microbatches and chunks share
  a tick, one scan per segment of ticks with the same slot kinds. Each stage
  keeps the VJP residuals of its (microbatch, chunk) pairs in flight in a ring
  buffer whose rows the table assigns (2p - 2 for 1f1b and zb-h1, fewer
  stages' worth of chunk-sized ones for interleaved), whatever m is; zb-h1
  keeps its cotangents from B to W in rows of that ring no residuals hold at
  the time.
  Loss and gradients come out of these scans, wrapped in a `jax.custom_vjp`
  so the train step differentiates it like any loss. Without differentiation
  only the forward ticks run (`_forward_loss`).

The embedding feeds stage 0 and the loss head runs on the last stage's outputs,
split over the pipe stages by sequence positions (a reduce-scatter of the
outputs and an all-gather of their cotangents), so no stage does p times the
head's work. Parameters every stage holds (embedding, head) get their gradients
summed over pipe once per step.

Layers may also return per-layer statistics (an MoE router's losses and
metrics). Each stage sums its own layers' statistics per microbatch; they are
summed over the stages and averaged over the microbatches, and `aux_loss` of
that sum joins the loss, each stage back-propagating its own layers' part.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.parallel import attention

from jaxpar.parallel import bits

from jaxpar.pipeline import layer_order

from jaxpar.core import usage

from jaxpar.parallel import zero
from jaxpar.pipeline.layer_order import stack_in_plan_order
from jaxpar.core.plan import active_plan
from jaxpar.core.rules import varying_axes
from jaxpar.pipeline.schedule import EMPTY, ORDER, Schedule
from jaxpar.train.step import microbatches

AXIS = "pipe"
RING_SCOPE = "pipeline_residual_ring"
# A slot kind with two places in the tick (`jaxpar.pipeline.schedule.ORDER`) runs its `lax.cond` under this scope,
# "{kind}" filled in: a stage runs one of them per tick, so `inspect.matmul_flops` counts one.
PLACE_SCOPE = "pipeline_{kind}_slot"


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model cut for pipelining into pure functions of explicit parameters.

    embed(params, tokens[b, s]) -> x[b, s, d] runs before the first stage;
    layers(stacked, x) -> x runs the layers stacked along the leading axis of
        `stacked`; or -> (x, stats), stats a tree of per-layer values stacked on
        a leading layer axis, each a mean over the batch rows (router losses, metrics);
    head(params, x, targets[b, s]) -> mean loss runs after the last stage;
    aux_loss(sums) -> scalar added to the loss, from the stats summed over
        all layers. It must be a sum of per-layer terms (linear in `sums`, as
        MoE auxiliary losses are), so that each stage back-propagates its own
        layers' part. `loss` returns (loss, sums) when the layers return stats.
    """

    embed: Callable[[Any, jax.Array], jax.Array]
    layers: Callable[[Any, jax.Array], Any]
    head: Callable[[Any, jax.Array, jax.Array], jax.Array]
    aux_loss: Callable[[Any], jax.Array] | None = None

    def run_layers(self, stacked, x) -> tuple[jax.Array, Any]:
        """(x after the layers, their stats summed over the layers in fp32: {} for layers without stats)."""
        out = self.layers(stacked, x)
        y, stats = out if isinstance(out, tuple) else (out, {})
        return y, jax.tree.map(lambda s: jnp.sum(s.astype(jnp.promote_types(s.dtype, jnp.float32)), axis=0), stats)

    def with_aux(self, value: jax.Array, sums) -> jax.Array:
        """The head's loss plus `aux_loss(sums)` (nothing to add without stats or an aux_loss)."""
        if self.aux_loss is None or not jax.tree.leaves(sums):
            return value
        return value + self.aux_loss(sums)


_fill: contextvars.ContextVar[float] = contextvars.ContextVar("jaxpar_bubble_fill", default=0.0)


@contextlib.contextmanager
def bubble_fill(value: float):
    """Fill bubble slots (and empty ring-buffer slots) with `value` while tracing; NaN in tests shows leaks."""
    token = _fill.set(value)
    try:
        yield
    finally:
        _fill.reset(token)


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
    split = microbatches({"inputs": inputs, "targets": targets}, schedule.microbatches)
    stacked, entries = zero.layer_sources(stacked)  # ZeRO-2/3: each stage gathers its layers one at a time
    args = (embed_params, to_chunks(stacked, schedule), head_params, split["inputs"], split["targets"])
    return _result(*_pipelined(stages, schedule, _fill.get(), entries)(*args))


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
        body, in_specs=(P(), P(AXIS), P(), P(), P()), out_specs=out_specs, axis_names={AXIS}
    )


def _varying(tree, axes: set[str]):
    """Mark values as varying over the manual `axes` (jax's `vma` type).

    Scan carries must start as varying as what the ticks put in them;
    parameters replicated over `pipe` are cast over it once before use, so
    their gradients stay per stage until one explicit psum (an implicit cast at
    each use would psum the gradients on every tick). Nothing is cast over
    axes it does not vary along: autodiff would then sum replicated gradients.
    """
    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _activation_axes(embedded, targets) -> set[str]:
    """The manual axes activations between stages vary over: pipe, and those of the embedded batch.

    That is `data`, and `tensor` where sequence parallelism splits the
    residual stream inside the step's shard_map (explicit tensor form).
    `embedded` may be an array or its `jax.eval_shape`.
    """
    return {AXIS} | varying_axes(embedded) | varying_axes(targets)


def _row(x, index):
    """x[index] along the leading axis for a traced index (clamped: EMPTY slots read row 0)."""
    return jax.lax.dynamic_index_in_dim(x, jnp.maximum(index, 0), 0, keepdims=False)


def _head_share(outputs, targets, stage, p: int):
    """This stage's share of the sequence positions of the last stage's `outputs` [..., b, s, d] and `targets`.

    An all-to-all over pipe cuts every stage's outputs into p pieces of s/p
    positions; each stage keeps the piece the last stage sent it, so all of
    them run the loss head on s/p positions. Returned as [-1, s/p, d] and [-1, s/p].
    Under sequence parallelism inside the step's shard_map (explicit tensor
    form) `outputs` hold this tensor rank's c-th of the sequence and `targets`
    all of it; the head gathers the c pieces of a share, so its targets are
    the same piece of each of the c chunks.
    """
    *lead, seq, d = outputs.shape
    width = seq // p
    pieces = jnp.moveaxis(outputs.reshape(*lead, p, width, d), len(lead), 0)
    share = bits.all_to_all(pieces, AXIS, split_axis=0, concat_axis=0)[p - 1]
    chunks = targets.shape[-1] // seq
    tgt = targets.reshape(*targets.shape[:-1], chunks, p, width)
    tgt = jax.lax.dynamic_index_in_dim(tgt, stage, axis=tgt.ndim - 2, keepdims=False)
    return share.reshape(-1, width, d), tgt.reshape(-1, chunks * width)


def _masked(tree, valid):
    """The stats of a slot that holds a microbatch; zeros for a bubble slot."""
    return jax.tree.map(lambda s: jnp.where(valid, s, jnp.zeros_like(s)), tree)


def _sum_over_stages(tree):
    """psum over pipe in at least fp32 (better sums; XLA:CPU also fails to compile bf16 reductions here)."""
    def total(x):
        return jax.lax.psum(x.astype(jnp.promote_types(x.dtype, jnp.float32)), AXIS).astype(x.dtype)

    return jax.tree.map(total, tree)


def _forward_loss(stages: Stages, schedule: Schedule, fill: float, entries: list) -> Callable:
    """The embedding, the schedule's forward ticks in a scan, the head (gpipe's backward is its autodiff).

    Autodiff keeps every tick's residuals anyway, so the m microbatches are
    embedded before the scan, and the table's gradient is one scatter-add.
    Returns (loss, the layers' stats summed over layers, averaged over microbatches).
    """
    p, v = schedule.stages, schedule.virtual_stages
    ring = [(a, (a + 1) % p) for a in range(p)] if v > 1 else [(a, a + 1) for a in range(p - 1)]

    def body(embed_params, chunks, head_params, tokens, targets):
        stage = jax.lax.axis_index(AXIS)
        chunks = jax.tree.map(lambda a: a[0], chunks)
        embedded = jax.vmap(lambda t: stages.embed(embed_params, t))(tokens)

        def tick(incoming, row):
            j, k = row[0][stage], row[1][stage]
            valid = j != EMPTY
            fresh = _row(embedded, j)
            x = jnp.where((stage == 0) & (k == 0), fresh, incoming)
            x = jnp.where(valid, x, jnp.zeros_like(x))
            y, sums = stages.run_layers(_stage_layers(jax.tree.map(lambda a: _row(a, k), chunks), entries), x)
            y = jnp.where(valid, y, jnp.full_like(y, fill))
            return bits.ppermute(y, AXIS, ring), (y, _masked(sums, valid))

        start = _varying(jnp.full(embedded.shape[1:], fill, embedded.dtype), _activation_axes(embedded, targets))
        ticks = schedule.forward_ticks
        table = (jnp.asarray(schedule.forward[:ticks]), jnp.asarray(schedule.chunk[:ticks]))
        _, (ys, sums) = jax.lax.scan(tick, start, table)
        outputs = jnp.swapaxes(ys[schedule.output_ticks], 0, 1)
        value = stages.head(head_params, *_head_share(outputs, jnp.swapaxes(targets, 0, 1), stage, p))
        sums = jax.tree.map(lambda s: s / schedule.microbatches, _sum_over_stages(jax.tree.map(_total, sums)))
        return stages.with_aux(jax.lax.pmean(value, AXIS), sums), sums

    return body


def _total(stats):
    """Sum over ticks (the leading axis) in fp32."""
    return jnp.sum(stats.astype(jnp.promote_types(stats.dtype, jnp.float32)), axis=0)


def _stage_layers(params, entries: list):
    """A stage's slice of the stacked layers, declared to ZeRO as shards it gathers layer by layer.

    Call it inside whatever differentiates the stage: ZeRO recognises the very arrays it is given.
    """
    zero.mark_layers(params, entries)
    return params


def _pipelined(stages: Stages, schedule: Schedule, fill: float, entries: list) -> Callable:
    """loss(embed params, chunks, head params, tokens, targets) whose VJP is the schedule's own backward.

    Without differentiation only the forward ticks run. Under autodiff the
    schedule computes the loss and every gradient in one shard_map (a custom
    VJP that stashes the gradients and scales them by the incoming cotangent),
    so no transpose of the pipeline is left to JAX.
    """
    forward = _shard(_forward_loss(stages, schedule, fill, entries), (P(), P()))
    body = _table_body if schedule.explicit_backward else _autodiff_body
    with_grads = _shard(body(stages, schedule, fill, entries), ((P(), P()), (P(), P(AXIS), P())))

    primal_axes = {}

    @jax.custom_vjp
    def run(embed_params, chunks, head_params, tokens, targets):
        return forward(embed_params, chunks, head_params, tokens, targets)

    def run_fwd(*args):
        primal_axes["params"] = jax.tree.map(varying_axes, args[:3])
        return with_grads(*args)

    def run_bwd(grads, cotangents):
        cotangent = cotangents[0]  # the stats are metrics: their aux loss is already inside the loss

        def scale(g, axes):
            g = (g * cotangent).astype(g.dtype)
            extra = tuple(sorted(varying_axes(g) - axes))
            return jax.lax.psum(g, extra) if extra else g

        is_axes = lambda x: isinstance(x, set)  # noqa: E731
        return (*jax.tree.map(scale, grads, primal_axes["params"], is_leaf=is_axes), None, None)

    run.defvjp(run_fwd, run_bwd)
    return run


def _autodiff_body(stages: Stages, schedule: Schedule, fill: float, entries: list) -> Callable:
    """gpipe: the forward ticks and their autodiff, inside the pipe shard_map."""
    forward = _forward_loss(stages, schedule, fill, entries)

    def body(embed_params, chunks, head_params, tokens, targets):
        embed_params, head_params = _varying((embed_params, head_params), {AXIS})
        value, vjp, sums = jax.vjp(lambda e, c, h: forward(e, c, h, tokens, targets), embed_params, chunks,
                                   head_params, has_aux=True)
        d_embed, d_chunks, d_head = vjp(jnp.ones_like(value))
        return (value, sums), (_sum_over_stages(d_embed), d_chunks, _sum_over_stages(d_head))

    return body


def _accumulator(x):
    """A zero to sum x's gradients into: at least fp32, varying over the axes x does."""
    return _varying(jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), varying_axes(x))


def _add(total, part):
    """total + part leaf by leaf, in the accumulators' dtype."""
    return jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, part)


class _ResidualRing:
    """Where a stage keeps the VJP residuals of its slots in flight: the ring row the schedule assigns.

    A slot's VJP closes over its chunk's parameters and over per-microbatch
    values; only the latter are stored (the parameters are sliced from the
    stage's chunks again when the VJP is replayed). An idle slot does not
    store (its slot's `lax.cond`), or writes its row back as it was (masked),
    so no scratch row takes its writes and no live row is overwritten.

    A row no residual set holds for a while can keep a cotangent from a B slot
    to its W slot (zb-h1): it goes into `holder`, a residual buffer whose row
    ends in an activation's shape and dtype (and varies over the same axes),
    at index 0 of the row's leading dims, so it keeps the activation's layout
    and sharding (None: no buffer can hold one, the cotangents get a buffer of
    their own).
    """

    def __init__(self, vjp_of: Callable, params, x, slots: int, fill: float):
        probe = vjp_of(params, x)
        leaves, self.treedef = jax.tree.flatten(probe)
        position = {id(a): n for n, a in enumerate(jax.tree.leaves(params))}
        self.param_of_leaf = [position.get(id(leaf)) for leaf in leaves]
        self.rows = slots

        def blank(leaf):
            value = fill if jnp.issubdtype(leaf.dtype, jnp.floating) else 0
            return _varying(jnp.full((slots, *leaf.shape), value, leaf.dtype), varying_axes(leaf) | varying_axes(x))

        self.empty = [blank(leaf) for leaf, n in zip(leaves, self.param_of_leaf) if n is None]
        self.cotangent_shape = x.shape
        fits = [n for n, buf in enumerate(self.empty)
                if buf.dtype == x.dtype and buf.shape[buf.ndim - x.ndim:] == x.shape and buf.ndim > x.ndim
                and varying_axes(buf) == varying_axes(x)]
        self.holder = fits[0] if fits and slots else None

    def residuals(self, vjp, params) -> list:
        """The per-microbatch leaves of `vjp`: what a row stores."""
        leaves, params = jax.tree.leaves(vjp), jax.tree.leaves(params)
        if len(leaves) != len(self.param_of_leaf) or any(
                n is not None and leaf is not params[n] for leaf, n in zip(leaves, self.param_of_leaf)):
            raise AssertionError("the stage's VJP changed structure between ticks")
        return [leaf for leaf, n in zip(leaves, self.param_of_leaf) if n is None]

    def store(self, buffers: list, row, stored: list, mask: Callable) -> list:
        """`buffers` with row `row` holding `stored` residuals: mask(new, old) keeps an idle slot's row as it was."""
        kept = [mask(leaf, _row(buf, row)) for buf, leaf in zip(buffers, stored)]
        # Each buffer's own write names it in the compiled step (`inspect.residual_ring_bytes`); their initial
        # values XLA may merge with other arrays'.
        with jax.named_scope(RING_SCOPE):
            return [jax.lax.dynamic_update_index_in_dim(buf, r, row, 0) for buf, r in zip(buffers, kept)]

    def at(self, buffers: list, row) -> list:
        return [_row(buf, row) for buf in buffers]

    def vjp(self, stored: list, params) -> Callable:
        """The VJP of a slot's forward, rebuilt from its residuals and its chunk's parameters."""
        params, stored = jax.tree.leaves(params), iter(stored)
        leaves = [params[n] if n is not None else next(stored) for n in self.param_of_leaf]
        return jax.tree.unflatten(self.treedef, leaves)

    def load(self, buffers: list, row, params) -> Callable:
        """The VJP of a slot's forward, rebuilt from its stored residuals and its chunk's parameters."""
        return self.vjp(self.at(buffers, row), params)

    def _corner(self, row):
        buf = self.empty[self.holder]
        lead = buf.ndim - len(self.cotangent_shape)
        return (jnp.clip(row, 0, self.rows - 1), *([0] * (buf.ndim - 1))), (1,) * lead + self.cotangent_shape

    def store_cotangent(self, buffers: list, row, dy, keep) -> list:
        """`buffers` with ring row `row` of the holder starting with `dy` where `keep`, as it was elsewhere."""
        start, sizes = self._corner(row)
        buf = buffers[self.holder]
        old = jax.lax.dynamic_slice(buf, start, sizes)
        buffers = list(buffers)
        with jax.named_scope(RING_SCOPE):
            buffers[self.holder] = jax.lax.dynamic_update_slice(buf, jnp.where(keep, dy.reshape(sizes), old), start)
        return buffers

    def load_cotangent(self, buffers: list, row):
        """The cotangent kept in ring row `row`."""
        start, sizes = self._corner(row)
        return jax.lax.dynamic_slice(buffers[self.holder], start, sizes).reshape(self.cotangent_shape)


def _permutes(jaxpr) -> bool:
    """Whether `jaxpr` (or a jaxpr inside it) has a `ppermute`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and _permutes(inner):
                    return True
    return False


def _after(index, tokens):
    """`index` (an int32 scalar) as XLA must compute it: after the slots that returned `tokens`.

    A slot that writes a row of the ring in a tick after other slots read it
    (a row freed and taken in the same tick) writes at such an index, so XLA
    orders the reads first and updates the ring in place. Without the
    dependency it would copy the whole ring to let the write go first (an
    `optimization_barrier` does not survive until XLA places the copies). A
    token is a float scalar a slot's `lax.cond` returns (`_token`): the
    added zero, a product with it XLA does not fold, needs no communication.
    """
    if not tokens:
        return index
    return index + (sum(tokens) * 0).astype(index.dtype)


def _token(index, live: bool):
    """What a reading slot's branch returns for `_after`: its index where it runs, -1 where it idles (unlike
    values, so XLA cannot take it out of the `lax.cond`)."""
    value = index.astype(jnp.float32)
    return value if live else value * 0 - 1


def _add_at(total, part, k, v: int):
    """total[k] += part leaf by leaf: `total` stacks the gradients of a stage's v chunks."""
    if v == 1:
        return jax.tree.map(lambda t, g: t + g.astype(t.dtype)[None], total, part)
    return jax.tree.map(
        lambda t, g: jax.lax.dynamic_update_index_in_dim(t, _row(t, k) + g.astype(t.dtype), k, 0), total, part)


def _table_body(stages: Stages, schedule: Schedule, fill: float, entries: list) -> Callable:
    """The executor of an action table (1f1b, interleaved, zb-h1): one scan per segment, loss and all gradients.

    A tick runs the slots its segment has, in `jaxpar.pipeline.schedule.ORDER`, each on
    its chunk for the microbatch the stage's table gives (EMPTY: idle): F
    (forward; its VJP residuals go into the ring row the table gives), the loss
    head on the last stage's output of the last chunk, B or BW (backward from
    the stored residuals; BW also accumulates the weight gradients, B keeps
    its cotangent for a later W in the ring row the table gives), and W (the
    stored VJP replayed on the kept cotangent, or in its B's tick on the one
    that B takes, parameter part only). F and W have two places in a tick, a
    stage running each slot at the one `Schedule.places` gives (the other is
    idle there): the last chunk's forward, and one whose stage frees no ring
    row later in the tick, before the head and its backward, every other
    forward after the backward slots, whose freed rows it takes in the same
    tick. A slot that writes the ring after others read it in the tick
    writes at an index computed from what they return (`_after`), so XLA
    updates the ring in place. Every slot runs under `lax.cond`, only when it
    holds a microbatch, so a bubble slot costs no compute at run time (the
    compiled FLOPs still count each slot's work on every tick, once for a
    slot's two places); an idle slot hands on `fill`, and as it neither
    stores nor loads, the ring needs no scratch row. A stage whose layers
    permute masks its slots instead (`per_slot`): it computes each slot once
    per tick (forward, head, backward, W) and writes the ring after all of
    them, a backward taking the residuals its forward made in the tick as
    they are (`masked_tick_of`). Under B and W the
    cond also keeps their residual copies from being live together (XLA would
    slice both out of the ring before either ran). Collectives inside a stage
    (tensor, ZeRO gathers over data, expert all_to_all) run inside the
    branches: every member of such a group is on the same stage and slot, so
    takes the same branch. Activations move forward after F ticks, cotangents
    backward after B ticks, one `ppermute` each, outside the conds (a stage
    sends and receives whether or not its slot is idle); with v > 1 chunks the
    rings close (device p - 1's chunk k feeds device 0's chunk k + 1).
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    hops = range(p) if v > 1 else range(p - 1)
    forward_ring = [(a, (a + 1) % p) for a in hops]
    backward_ring = [((a + 1) % p, a) for a in hops]
    actions, chunks, places = schedule.actions, schedule.chunks, schedule.places
    back = "B" if "B" in actions else "BW"
    f_ticks, b_ticks = schedule._slot_ticks("F"), schedule._slot_ticks(back)
    w_ticks = schedule._slot_ticks("W") if "W" in actions else b_ticks
    if any(f_ticks[p - 1, j, v - 1] != b_ticks[p - 1, j, v - 1] for j in range(m)):
        raise AssertionError(f"schedule {schedule.name!r}: the last chunk must run a backward in its forward's tick")
    if "W" in actions and any(w_ticks[key] == t for key, t in f_ticks.items()):
        raise AssertionError(f"schedule {schedule.name!r}: a W slot in its forward's tick")
    r_ticks = {key: max(b_ticks[key], w_ticks[key]) for key in f_ticks}  # the last tick that reads the residuals
    # A stage that permutes writes a forward's residuals into the ring only where a later tick reads them.
    kept = {"F": np.zeros_like(actions["F"])}
    for (i, j, k), t in f_ticks.items():
        kept["F"][t, i] = int(r_ticks[i, j, k] > t)

    def body(embed_params, chunk_params, head_params, tokens, targets):
        stage = jax.lax.axis_index(AXIS)
        embed_params, head_params = _varying((embed_params, head_params), {AXIS})
        local = jax.tree.map(lambda a: a[0], chunk_params)  # [v, layers per chunk, ...]
        first = jax.tree.map(lambda a: a[0], local)

        def params_of(k):
            return first if v == 1 else jax.tree.map(lambda a: _row(a, k), local)

        act = jax.eval_shape(stages.embed, embed_params, tokens[0])
        act_axes = _activation_axes(act, targets)
        x0 = _varying(jnp.zeros(act.shape, act.dtype), act_axes)
        run = lambda q, x: stages.run_layers(_stage_layers(q, entries), x)  # noqa: E731
        sums_shape = jax.eval_shape(lambda q, x: run(q, x)[1], first, x0)
        weighted = stages.aux_loss is not None and bool(jax.tree.leaves(sums_shape))
        if weighted:  # each slot's aux loss enters the loss with weight 1/m (typed like the aux loss itself)
            aux_shape = jax.eval_shape(lambda q, x: stages.aux_loss(run(q, x)[1]), first, x0)
            aux_cotangent = _varying(jnp.full(aux_shape.shape, 1 / m, aux_shape.dtype), varying_axes(aux_shape))

        def layers(q, x):
            """y, or (y, these layers' aux loss) when it is weighted; their stats go out as the VJP's aux."""
            y, sums = run(q, x)
            return ((y, stages.aux_loss(sums)) if weighted else y), sums
        loss_dtype = jax.eval_shape(
            stages.head, head_params, jax.ShapeDtypeStruct((act.shape[0], act.shape[1] // p, act.shape[2]), act.dtype),
            jax.ShapeDtypeStruct((act.shape[0], targets.shape[-1] // p), targets.dtype),
        ).dtype
        loss_axes = {AXIS} | varying_axes(jax.eval_shape(
            lambda y: stages.head(head_params, *_head_share(y, _row(targets, 0), stage, p)), x0))
        ring = _ResidualRing(lambda q, x: jax.vjp(layers, q, x, has_aux=True)[1], first, x0, schedule.in_flight, fill)
        # zb-h1's kept cotangents: rows below `share` are ring rows (in the holder buffer), the others rows of a
        # buffer of their own (only where the ring has no row free, or no residual buffer can hold one).
        layout = schedule.ring_layout(shared=ring.holder is not None)
        share = layout.ring_rows if ring.holder is not None else 0
        rows, kept_rows = layout.rows, layout.cotangent_rows
        permutes = _permutes(jax.make_jaxpr(run)(first, x0).jaxpr)

        def cotangent_of(dy):
            return (dy, aux_cotangent) if weighted else dy

        def masker(live):
            def mask(new, old=None):
                old = jax.tree.map(jnp.zeros_like, new) if old is None else old
                return jax.tree.map(lambda a, b: jnp.where(live, a, b), new, old)

            return mask

        def per_slot(live, work: Callable, idle: Callable, *operands):
            """work(*operands, mask) in a slot that holds a microbatch (`live`), idle(*operands) in a bubble slot.

            Under `lax.cond`, so a bubble slot costs nothing at run time, and
            `mask(new, old=zeros)` is `new`. A stage whose layers permute (ring
            attention over context) runs every slot and masks its results
            instead: XLA:CPU rendezvous every device at a collective-permute,
            and the stages' slots idle at different ticks (a cond deadlocks).
            """
            if not permutes:
                return jax.lax.cond(live, lambda *a: work(*a, lambda new, old=None: new), idle, *operands)
            return work(*operands, masker(live))

        def keep_cotangent(buffers, saved, c, dy, live):
            """Ring and cotangent buffer with B's cotangent `dy` kept in row c (none where c is EMPTY)."""
            if ring.holder is not None and share:
                buffers = ring.store_cotangent(buffers, c, dy, live & (c >= 0) & (c < share))
            if saved is not None:
                b = jnp.clip(c - share, 0, saved.shape[0] - 1)
                saved = jax.lax.dynamic_update_index_in_dim(
                    saved, jnp.where(live & (c >= share), dy, _row(saved, b)), b, 0)
            return buffers, saved

        def kept_cotangent(buffers, saved, c, handed):
            """W's cotangent: kept in row c, or `handed` on by the B of the same tick (c EMPTY)."""
            options = []
            if handed is not None:
                options.append((c < 0, handed))
            if ring.holder is not None and share:
                options.append(((c >= 0) & (c < share), ring.load_cotangent(buffers, c)))
            if saved is not None:
                options.append((c >= share, _row(saved, jnp.clip(c - share, 0, saved.shape[0] - 1))))
            value = options[-1][1]
            for chosen, other in reversed(options[:-1]):
                value = jnp.where(chosen, other, value)
            return value

        def forward_work(q, j, k, incoming, mask):
            """Forward of microbatch j through chunk k (embedded here on stage 0's chunk 0): y, its VJP, its stats."""
            x = mask(jnp.where((stage == 0) & (k == 0), stages.embed(embed_params, _row(tokens, j)), incoming))
            out, vjp, part = jax.vjp(layers, q, x, has_aux=True)
            y = out[0] if weighted else out
            return mask(y, jnp.full_like(y, fill)), vjp, part

        def forward_slot(carry, s, y_idle):
            """The forward slot (under `lax.cond`): its VJP goes into the ring row the table gives.

            Idle, it hands on `y_idle` (the other forward place's output), or
            `fill` made in its branch (y_idle None).
            """
            j, k, row, q = s["j"], s["k"], s["row"], params_of(s["k"])

            def work(buffers, sums, incoming, _, mask):
                y, vjp, part = forward_work(q, j, k, incoming, mask)
                return y, ring.store(buffers, row, ring.residuals(vjp, q), mask), _add(sums, mask(part))

            def idle(buffers, sums, incoming, y_idle):
                return (jnp.full_like(incoming, fill) if y_idle is None else y_idle), buffers, sums

            y, carry["ring"], carry["sums"] = per_slot(
                j != EMPTY, work, idle, carry["ring"], carry["sums"], carry["fwd_in"], y_idle)
            return y

        def head_slot(carry, y, j):
            """Loss of microbatch j on each stage's share of positions: the cotangent of the last stage's y.

            j is the same on every stage (the last stage's slot), so all of
            them take the same branch of its `lax.cond`, collectives included.
            """

            def run_head(d_head, total, y):
                share, tgt = _head_share(y, _row(targets, j), stage, p)
                value, head_vjp = jax.vjp(lambda h, x: stages.head(h, x, tgt), head_params, share)
                part, d_share = head_vjp(jnp.ones_like(value) / (m * p))
                dy = bits.all_gather(d_share, AXIS, axis=1)
                return dy, _add(d_head, part), total + value.astype(jnp.float32)

            dy, carry["d_head"], carry["loss"] = jax.lax.cond(
                j != EMPTY, run_head, lambda d_head, total, y: (jnp.full_like(y, fill), d_head, total),
                carry["d_head"], carry["loss"], y)
            return dy

        def into_embedding(carry, j, k, dx):
            """Stage 0's chunk 0 backs its input gradient into the embedding."""
            def work(total, dx, mask):
                _, embed_vjp = jax.vjp(lambda e: stages.embed(e, _row(tokens, j)), embed_params)
                return _add(total, embed_vjp(mask(dx))[0])

            carry["d_embed"] = per_slot((j != EMPTY) & (stage == 0) & (k == 0), work, lambda total, dx: total,
                                        carry["d_embed"], dx)

        def backward_slot(carry, s, cotangent, fused: bool):
            """Backward of microbatch j through chunk k from its stored residuals (under `lax.cond`).

            fused (BW): the weight gradients too. Otherwise (B) only the input
            gradient, which XLA prunes the weight matmuls from; the tick keeps
            the cotangent it takes for the W slot (`keep_cotangent`, before the
            B runs) in the row the table gives (none when W runs in this tick:
            it takes it as it is).
            """
            j, k, row, q = s["j"], s["k"], s["row"], params_of(s["k"])
            if fused:
                def work(buffers, total, dy, mask):
                    d_params, dx = ring.load(buffers, row, q)(cotangent_of(mask(dy)))
                    return mask(dx, jnp.full_like(dx, fill)), _add_at(total, mask(d_params), k, v), _token(row, True)

                dx, carry["d_stage"], token = per_slot(
                    j != EMPTY, work, lambda buffers, total, dy: (jnp.full_like(dy, fill), total, _token(row, False)),
                    carry["ring"], carry["d_stage"], cotangent)
            else:
                def work(buffers, dy, mask):
                    dx = ring.load(buffers, row, q)(cotangent_of(mask(dy)))[1]
                    return mask(dx, jnp.full_like(dx, fill)), _token(row, True)

                dx, token = per_slot(j != EMPTY, work, lambda buffers, dy: (jnp.full_like(dy, fill), _token(row, False)),
                                     carry["ring"], cotangent)
            into_embedding(carry, j, k, dx)
            return dx, token

        def weight_slot(carry, s, handed):
            """Weight gradients of microbatch j: its stored VJP replayed on its kept cotangent, parameter part only.

            The replay recomputes the input-gradient chain inside the stage
            (layer l's weight gradient needs the cotangent of layer l's output).
            """
            j, k, row, q = s["j"], s["k"], s["row"], params_of(s["k"])

            def replay(buffers, saved, total, handed, mask):
                dy = kept_cotangent(buffers, saved, s["saved"], handed)
                d_params = ring.load(buffers, row, q)(cotangent_of(mask(dy)))[0]
                return _add_at(total, mask(d_params), k, v), _token(row, True)

            carry["d_stage"], token = per_slot(j != EMPTY, replay, lambda _, __, total, ___: (total, _token(row, False)),
                                               carry["ring"], carry["saved"], carry["d_stage"], handed)
            return token

        def incoming_of(carry, b, head, dy):
            """A backward slot's cotangent: the loss head's on the last stage's last chunk, else the one passed back."""
            if head:
                return jnp.where((stage == p - 1) & (b["k"] == v - 1), dy, carry["bwd_in"])
            return carry["bwd_in"]

        def head_of(carry, f, y, head):
            """The loss head's cotangent of the last stage's output `y` (None in a tick without the head)."""
            if not head:
                return None
            j_head = jnp.where(f["k"][p - 1] == v - 1, f["j"][p - 1], EMPTY)
            return head_slot(carry, y, j_head)

        def tick_of(kinds: tuple[str, ...], head: bool):
            """One tick: its slots in `ORDER`, each at its place, then the two ppermutes."""
            def tick(carry, tables):
                carry, reads = dict(carry), []
                slot = {key: {name: table[stage] for name, table in columns.items()} for key, columns in tables.items()}
                # After a W slot an idle forward makes its fill in its cond, so it is not live through the W: an
                # activation less at zb-h1's peak. Made there on 1f1b's and interleaved's ticks, it cost their temp
                # 0.6 and 1.3 KB of XLA's bookkeeping.
                y = None if "W" in kinds else jnp.full_like(carry["fwd_in"], fill)
                dy = dx = handed = None
                for kind, place in ORDER:
                    if kind == "head":
                        if head:
                            dy = head_of(carry, tables["F", 0], y, head)
                        continue
                    if (kind, place) not in slot:
                        continue
                    s, scope = dict(slot[kind, place]), jax.named_scope(PLACE_SCOPE.format(kind=kind))
                    if kind == "F":
                        s["row"], reads = _after(s["row"], reads), []
                        with scope:
                            y = forward_slot(carry, s, y)
                    elif kind == "W":  # before B, a W in B's tick takes the cotangent B is about to take
                        with scope:
                            reads.append(weight_slot(carry, s, carry["bwd_in"] if place == 0 else handed))
                    else:
                        handed = incoming_of(carry, s, head, dy)
                        if kind == "B":  # the cotangent it takes, kept for a W in a later tick, before it runs
                            carry["ring"], carry["saved"] = keep_cotangent(
                                carry["ring"], carry["saved"], _after(s["saved"], reads), handed, s["j"] != EMPTY)
                            reads = []
                        dx, token = backward_slot(carry, s, handed, fused=kind == "BW")
                        reads.append(token)
                return permute(carry, kinds, y, dx), None
            return tick

        def fenced(always, fn: Callable, index, *operands):
            """(fn(*operands), its `_token`) from a `lax.cond` on `always`, which holds on every device.

            Every device takes the same branch, so collectives inside fn (ring
            attention's permutes) still meet, and the token orders the ring's
            writes after fn's reads without communication.
            """
            shapes = jax.eval_shape(fn, *operands)

            def idle(*_):
                zeros = jax.tree.map(lambda a: _varying(jnp.zeros(a.shape, a.dtype), varying_axes(a)), shapes)
                return zeros, _token(index, False)

            return jax.lax.cond(always, lambda *a: (fn(*a), _token(index, True)), idle, *operands)

        def masked_tick_of(kinds: tuple[str, ...], head: bool):
            """One tick of a stage whose layers permute: every slot computed once and masked, in the order F,
            head, B or BW, W; the ring's writes (residuals, kept cotangents) after all its reads, and a backward
            reading the residuals its forward made in this tick (the last chunk) takes them as they are."""
            def tick(carry, tables):
                carry, writes = dict(carry), []
                slot = {key: {name: table[stage] for name, table in columns.items()} for key, columns in tables.items()}
                y = dx = dy = handed = token = None
                # True on every device (a predicate of the whole tables), which XLA cannot know: see `fenced`.
                always = jnp.all(jnp.stack([columns["j"] for columns in tables.values()]) >= EMPTY)
                if "F" in kinds:
                    f = slot["F", None]
                    live_f, q = f["j"] != EMPTY, params_of(f["k"])
                    y, vjp, part = forward_work(q, f["j"], f["k"], carry["fwd_in"], masker(live_f))
                    carry["sums"] = _add(carry["sums"], masker(live_f)(part))
                    fresh = ring.residuals(vjp, q)
                    writes.append(lambda c, reads, f=f, fresh=fresh, live=live_f: c.update(ring=ring.store(
                        c["ring"], _after(f["row"], reads), fresh, masker(live & (f["keep"] == 1)))))
                    dy = head_of(carry, tables["F", None], y, head)
                if back in kinds:
                    b = slot[back, None]
                    live_b, q = b["j"] != EMPTY, params_of(b["k"])
                    mask = masker(live_b)
                    stored = ring.at(carry["ring"], b["row"])
                    if "F" in kinds:  # the last chunk's backward in its forward's tick
                        now = live_f & (f["j"] == b["j"]) & (f["k"] == b["k"])
                        stored = [jnp.where(now, new, old) for new, old in zip(fresh, stored)]
                    handed = mask(incoming_of(carry, b, head, dy))
                    if back == "BW":
                        (d_params, dx), token = fenced(
                            always, lambda st, h: ring.vjp(st, q)(cotangent_of(h)), b["row"], stored, handed)
                        carry["d_stage"] = _add_at(carry["d_stage"], mask(d_params), b["k"], v)
                    else:
                        dx, token = fenced(
                            always, lambda st, h: ring.vjp(st, q)(cotangent_of(h))[1], b["row"], stored, handed)
                        writes.append(lambda c, reads, b=b, dy=handed, live=live_b: c.update(zip(
                            ("ring", "saved"), keep_cotangent(c["ring"], c["saved"], _after(b["saved"], reads), dy,
                                                              live))))
                    dx = mask(dx, jnp.full_like(dx, fill))
                    into_embedding(carry, b["j"], b["k"], dx)
                if "W" in kinds:
                    w = slot["W", None]
                    live_w, q = w["j"] != EMPTY, params_of(w["k"])
                    def replay(buffers, saved, handed):
                        cotangent = kept_cotangent(buffers, saved, w["saved"], handed)
                        return ring.load(buffers, w["row"], q)(cotangent_of(masker(live_w)(cotangent)))[0]

                    d_params, w_token = fenced(always, replay, w["row"], carry["ring"], carry["saved"], handed)
                    carry["d_stage"] = _add_at(carry["d_stage"], masker(live_w)(d_params), w["k"], v)
                    token = w_token if token is None else token + w_token
                for write in writes:  # after every read of the ring in this tick
                    write(carry, [] if token is None else [token])
                return permute(carry, kinds, y, dx), None
            return tick

        def permute(carry, kinds, y, dx):
            """Activations on forward, cotangents back: one ppermute each, outside the slots' conds."""
            if "F" in kinds:
                carry["fwd_in"] = bits.ppermute(y, AXIS, forward_ring)
            if back in kinds:
                carry["bwd_in"] = bits.ppermute(dx, AXIS, backward_ring)
            return carry

        carry = {
            "fwd_in": _varying(jnp.full(act.shape, fill, act.dtype), act_axes),
            "bwd_in": _varying(jnp.full(act.shape, fill, act.dtype), act_axes),
            "ring": ring.empty,
            "saved": None,
            "d_stage": jax.tree.map(_accumulator, local),
            "d_embed": jax.tree.map(_accumulator, embed_params),
            "d_head": jax.tree.map(_accumulator, head_params),
            "sums": jax.tree.map(_accumulator, sums_shape),
            "loss": _varying(jnp.zeros((), jnp.float32), loss_axes),
        }
        if layout.cotangent_buffer_rows:
            carry["saved"] = _varying(jnp.full((layout.cotangent_buffer_rows, *act.shape), fill, act.dtype), act_axes)

        def tables_of(kinds, ticks):
            """The slot tables of `kinds` at `ticks` (an index array: [ticks] or [rounds, ticks]), by (kind, place):
            one per place that holds a slot in these ticks; one for all places (None) for a stage that permutes."""
            tables = {}
            for kind in kinds:
                columns = {"j": actions[kind], "k": chunks[kind], "row": rows[kind]}
                if kind in kept_rows:
                    columns["saved"] = kept_rows[kind]
                if permutes:
                    columns |= {"keep": kept.get(kind, places[kind])}
                    tables[kind, None] = {name: jnp.asarray(table[ticks]) for name, table in columns.items()}
                    continue
                for place in (0, 1):
                    j = np.where(places[kind] == place, actions[kind], EMPTY)
                    if (kind, place) in ORDER and (j[ticks] != EMPTY).any():
                        tables[kind, place] = {name: jnp.asarray(table[ticks]) for name, table in (columns | {"j": j}).items()}
            return tables

        for start, repeats, runs in schedule.loops:
            period, offsets = sum(n for n, _, _ in runs), np.cumsum([0] + [n for n, _, _ in runs])
            rounds = start + period * np.arange(repeats)[:, None]
            xs = [tables_of(kinds, rounds + np.arange(o, o + n)) for (n, kinds, _), o in zip(runs, offsets)]

            def one_round(carry, xs, runs=runs):
                for (_, kinds, head), tables in zip(runs, xs):
                    carry, _ = jax.lax.scan((masked_tick_of if permutes else tick_of)(kinds, head), carry, tables)
                return carry, None

            if repeats == 1:
                carry, _ = one_round(carry, [jax.tree.map(lambda a: a[0], x) for x in xs])
            else:
                carry, _ = jax.lax.scan(one_round, carry, xs)

        def cast(tree, like):
            return jax.tree.map(lambda a, ref: a.astype(ref.dtype), tree, like)

        d_chunks = jax.tree.map(lambda a: a[None], cast(carry["d_stage"], local))
        # Cast before the sum: one fewer table-sized f32 buffer after the loop (XLA:CPU kept the sum and its
        # cast apart: pp2 x dp4 on MaxText's model, 394.0 -> 369.7 MB); the embedding's is exact (one stage adds).
        d_embed = _sum_over_stages(cast(carry["d_embed"], embed_params))
        d_head = _sum_over_stages(cast(carry["d_head"], head_params))
        loss = (jax.lax.psum(carry["loss"], AXIS) / (m * p)).astype(loss_dtype)
        sums = jax.tree.map(lambda s: s / m, _sum_over_stages(carry["sums"]))
        return (stages.with_aux(loss, sums), sums), (d_embed, d_chunks, d_head)

    return body

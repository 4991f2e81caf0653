"""What every slot of a stage's ticks reads while the explicit schedules' shard_map body is traced.

`StageContext` is built once per trace (`StageContext.trace`), in the order
the executor has always made these values (the order decides what XLA
compiles): the stage's index and chunks, the shapes of its activations and
statistics, the residual ring, and whether its layers permute (which makes
every slot masked instead of a `lax.cond`, `per_slot`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.parallel import documents
from jaxpar.parallel.constrain import varying_axes
from jaxpar.pipeline.pipe_axis import (
    AXIS,
    activation_axes,
    head_documents,
    head_share,
    layer_documents,
    row_at,
    stage_layers,
    varying,
)
from jaxpar.pipeline.residual_ring import ResidualRing
from jaxpar.pipeline.ring_rows import RingLayout
from jaxpar.pipeline.schedule import Schedule
from jaxpar.pipeline.stages import Stages


@dataclasses.dataclass(frozen=True)
class StageLayers:
    """A stage's layers as its slots run them: under ZeRO's layer-by-layer gathers, their aux loss an output."""

    stages: Stages
    entries: list
    weighted: bool = False  # the aux loss of the layers' stats enters the loss (its cotangent `aux_cotangent`)

    def run(self, q, x):
        """(y, the layers' stats summed over them)."""
        return self.stages.run_layers(stage_layers(q, self.entries), x)

    def outputs(self, q, x):
        """y, or (y, these layers' aux loss) when it is weighted; their stats go out as the VJP's aux."""
        y, sums = self.run(q, x)
        return ((y, self.stages.aux_loss(sums)) if self.weighted else y), sums


@dataclasses.dataclass(frozen=True)
class StageContext:
    """One stage of the explicit schedules: its index, parameters, microbatches, ring, and the carry's shapes."""

    stages: Stages
    schedule: Schedule
    fill: float  # what bubble slots hand on (`jaxpar.pipeline.executor.bubble_fill`)
    stage: jax.Array  # this device's index on `pipe`
    embed_params: Any
    head_params: Any
    tokens: jax.Array  # [m, b, s] the microbatches
    targets: jax.Array
    docs: dict  # [m, b, s] each: the microbatches' document fields (jaxpar.parallel.documents), loss weights ordered
    local: Any  # this stage's chunks [v, layers per chunk, ...]
    first: Any  # its chunk 0
    layers: StageLayers
    aux_cotangent: jax.Array | None  # 1/m: each slot's aux loss enters the loss with that weight
    ring: ResidualRing
    layout: RingLayout
    permutes: bool  # the layers ppermute (ring attention): every slot runs, masked
    act: jax.ShapeDtypeStruct  # an activation between stages
    act_axes: set[str]
    sums_shape: Any  # the layers' stats
    loss_dtype: Any
    loss_axes: set[str]

    @classmethod
    def trace(cls, stages: Stages, schedule: Schedule, fill: float, entries: list,
              embed_params, chunk_params, head_params, tokens, targets, docs) -> StageContext:
        """The context of the shard_map body's arguments (chunk_params: [1, v, layers per chunk, ...] here).

        The probes of the layers and head run on microbatch 0's document fields, so that the shapes and the
        residuals' structure they find are those of every slot.
        """
        with documents.scope(layer_documents(docs, 0)):
            return cls._trace(stages, schedule, fill, entries, embed_params, chunk_params, head_params, tokens,
                              targets, docs)

    @classmethod
    def _trace(cls, stages, schedule, fill, entries, embed_params, chunk_params, head_params, tokens, targets, docs):
        p, m = schedule.stages, schedule.microbatches
        stage = jax.lax.axis_index(AXIS)
        embed_params, head_params = varying((embed_params, head_params), {AXIS})
        local = jax.tree.map(lambda a: a[0], chunk_params)  # [v, layers per chunk, ...]
        first = jax.tree.map(lambda a: a[0], local)
        act = jax.eval_shape(stages.embed, embed_params, tokens[0])
        act_axes = activation_axes(act, targets)
        x0 = varying(jnp.zeros(act.shape, act.dtype), act_axes)
        run = StageLayers(stages, entries).run
        sums_shape = jax.eval_shape(lambda q, x: run(q, x)[1], first, x0)
        weighted = stages.aux_loss is not None and bool(jax.tree.leaves(sums_shape))
        aux_cotangent = None
        if weighted:  # each slot's aux loss enters the loss with weight 1/m (typed like the aux loss itself)
            aux_shape = jax.eval_shape(lambda q, x: stages.aux_loss(run(q, x)[1]), first, x0)
            aux_cotangent = varying(jnp.full(aux_shape.shape, 1 / m, aux_shape.dtype), varying_axes(aux_shape))
        layers = StageLayers(stages, entries, weighted)
        with documents.scope(head_documents(jax.tree.map(lambda a: row_at(a, 0), docs), act.shape[1], stage, p)):
            loss_dtype = jax.eval_shape(
                stages.head, head_params,
                jax.ShapeDtypeStruct((act.shape[0], act.shape[1] // p, act.shape[2]), act.dtype),
                jax.ShapeDtypeStruct((act.shape[0], targets.shape[-1] // p), targets.dtype),
            ).dtype
            loss_axes = {AXIS} | varying_axes(jax.eval_shape(
                lambda y: stages.head(head_params, *head_share(y, row_at(targets, 0), stage, p)), x0))
        ring = ResidualRing(lambda q, x: jax.vjp(layers.outputs, q, x, has_aux=True)[1], first, x0,
                            schedule.in_flight, fill)
        # zb-h1's kept cotangents: rows below `share` are ring rows (in the holder buffer), the others rows of a
        # buffer of their own (only where the ring has no row free, or no residual buffer can hold one).
        layout = schedule.ring_layout(shared=ring.holder is not None)
        permutes = has_ppermute(jax.make_jaxpr(run)(first, x0).jaxpr)
        return cls(stages, schedule, fill, stage, embed_params, head_params, tokens, targets, docs, local, first, layers,
                   aux_cotangent, ring, layout, permutes, act, act_axes, sums_shape, loss_dtype, loss_axes)

    @property
    def p(self) -> int:
        return self.schedule.stages

    @property
    def m(self) -> int:
        return self.schedule.microbatches

    @property
    def v(self) -> int:
        return self.schedule.virtual_stages

    @property
    def back(self) -> str:
        """The backward slot kind: "B" (input-backward, zb-h1) or "BW" (fused)."""
        return "B" if "B" in self.schedule.actions else "BW"

    @property
    def share(self) -> int:
        """Kept cotangents in rows below this are ring rows (the holder buffer's); 0: none are."""
        return self.layout.ring_rows if self.ring.holder is not None else 0

    def params_of(self, k):
        """The parameters of this stage's chunk k."""
        return self.first if self.v == 1 else jax.tree.map(lambda a: row_at(a, k), self.local)

    def cotangent_of(self, dy):
        """The cotangent of the layers' outputs (`StageLayers.outputs`) for the cotangent dy of y."""
        return (dy, self.aux_cotangent) if self.layers.weighted else dy

    def per_slot(self, live, work: Callable, idle: Callable, *operands):
        """work(*operands, mask) in a slot that holds a microbatch (`live`), idle(*operands) in a bubble slot.

        Under `lax.cond`, so a bubble slot costs nothing at run time, and
        `mask(new, old=zeros)` is `new`. A stage whose layers permute (ring
        attention over context) runs every slot and masks its results
        instead: XLA:CPU rendezvous every device at a collective-permute,
        and the stages' slots idle at different ticks (a cond deadlocks).
        """
        if not self.permutes:
            return jax.lax.cond(live, lambda *a: work(*a, lambda new, old=None: new), idle, *operands)
        return work(*operands, masker(live))


def masker(live):
    """mask(new, old=zeros): new where `live`, else old, leaf by leaf."""
    def mask(new, old=None):
        old = jax.tree.map(jnp.zeros_like, new) if old is None else old
        return jax.tree.map(lambda a, b: jnp.where(live, a, b), new, old)

    return mask


def has_ppermute(jaxpr) -> bool:
    """Whether `jaxpr` (or a jaxpr inside it) has a `ppermute`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and has_ppermute(inner):
                    return True
    return False

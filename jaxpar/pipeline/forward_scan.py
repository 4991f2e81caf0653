"""The schedule's forward ticks as one scan: every schedule's loss without gradients, and gpipe's by autodiff.

Autodiff keeps every tick's residuals anyway, so the m microbatches are
embedded before the scan, and the table's gradient is one scatter-add; the
explicit schedules run their own backward instead (`jaxpar.pipeline.table_executor`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel import bits, documents
from jaxpar.pipeline.pipe_axis import (
    AXIS,
    activation_axes,
    head_documents,
    head_share,
    layer_documents,
    masked,
    row_at,
    stage_layers,
    sum_over_stages,
    sum_over_ticks,
    varying,
)
from jaxpar.pipeline.schedule import EMPTY, Schedule
from jaxpar.pipeline.stages import Stages


def forward_loss(stages: Stages, schedule: Schedule, fill: float, entries: list) -> Callable:
    """The embedding, the schedule's forward ticks in a scan, the head (gpipe's backward is its autodiff).

    Returns (loss, the layers' stats summed over layers, averaged over microbatches).
    """
    p, v = schedule.stages, schedule.virtual_stages
    ring = [(a, (a + 1) % p) for a in range(p)] if v > 1 else [(a, a + 1) for a in range(p - 1)]

    def body(embed_params, chunks, head_params, tokens, targets, docs):
        stage = jax.lax.axis_index(AXIS)
        chunks = jax.tree.map(lambda a: a[0], chunks)
        embedded = jax.vmap(lambda t: stages.embed(embed_params, t))(tokens)

        def tick(incoming, row):
            j, k = row[0][stage], row[1][stage]
            valid = j != EMPTY
            fresh = row_at(embedded, j)
            x = jnp.where((stage == 0) & (k == 0), fresh, incoming)
            x = jnp.where(valid, x, jnp.zeros_like(x))
            with documents.scope(layer_documents(docs, j)):
                y, sums = stages.run_layers(stage_layers(jax.tree.map(lambda a: row_at(a, k), chunks), entries), x)
            y = jnp.where(valid, y, jnp.full_like(y, fill))
            return bits.ppermute(y, AXIS, ring), (y, masked(sums, valid))

        start = varying(jnp.full(embedded.shape[1:], fill, embedded.dtype), activation_axes(embedded, targets))
        ticks = schedule.forward_ticks
        table = (jnp.asarray(schedule.forward[:ticks]), jnp.asarray(schedule.chunk[:ticks]))
        _, (ys, sums) = jax.lax.scan(tick, start, table)
        outputs = jnp.swapaxes(ys[schedule.output_ticks], 0, 1)
        head_docs = head_documents(jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), docs), outputs.shape[-2], stage, p)
        with documents.scope(head_docs):
            value = stages.head(head_params, *head_share(outputs, jnp.swapaxes(targets, 0, 1), stage, p))
        sums = jax.tree.map(lambda s: s / schedule.microbatches, sum_over_stages(jax.tree.map(sum_over_ticks, sums)))
        return stages.with_aux(jax.lax.pmean(value, AXIS), sums), sums

    return body


def autodiff_body(stages: Stages, schedule: Schedule, fill: float, entries: list) -> Callable:
    """gpipe: the forward ticks and their autodiff, inside the pipe shard_map."""
    forward = forward_loss(stages, schedule, fill, entries)

    def body(embed_params, chunks, head_params, tokens, targets, docs):
        embed_params, head_params = varying((embed_params, head_params), {AXIS})
        value, vjp, sums = jax.vjp(lambda e, c, h: forward(e, c, h, tokens, targets, docs), embed_params, chunks,
                                   head_params, has_aux=True)
        d_embed, d_chunks, d_head = vjp(jnp.ones_like(value))
        return (value, sums), (sum_over_stages(d_embed), d_chunks, sum_over_stages(d_head))

    return body

"""The executor of an action table (1f1b, interleaved, zb-h1): one scan per run of ticks, loss and all gradients.

A tick runs the slots its run has, in `jaxpar.pipeline.slot_places.ORDER`, each on
its chunk for the microbatch the stage's table gives (EMPTY: idle): F
(forward; its VJP residuals go into the ring row the table gives), the loss
head on the last stage's output of the last chunk, B or BW (backward from
the stored residuals; BW also accumulates the weight gradients, B keeps its
cotangent for a later W in the ring row the table gives), and W (the stored
VJP replayed on the kept cotangent, or in its B's tick on the one that B
takes, parameter part only) (`jaxpar.pipeline.slots`). F and W have two
places in a tick, a stage running each slot at the one `Schedule.places`
gives (the other is idle there): the last chunk's forward, and one whose
stage frees no ring row later in the tick, before the head and its backward,
every other forward after the backward slots, whose freed rows it takes in
the same tick. A slot that writes the ring after others read it in the tick
writes at an index computed from what they return
(`jaxpar.pipeline.residual_ring.after`), so XLA updates the ring in place.

Every slot runs under `lax.cond`, only when it holds a microbatch, so a
bubble slot costs no compute at run time (the compiled FLOPs still count
each slot's work on every tick, once for a slot's two places); an idle slot
hands on `fill`, and as it neither stores nor loads, the ring needs no
scratch row. A stage whose layers permute masks its slots instead
(`StageContext.per_slot`, `jaxpar.pipeline.tick.masked_tick_of`). Under B
and W the cond also keeps their residual copies from being live together
(XLA would slice both out of the ring before either ran). Collectives inside
a stage (tensor, ZeRO gathers over data, expert all_to_all) run inside the
branches: every member of such a group is on the same stage and slot, so
takes the same branch. Activations move forward after F ticks, cotangents
backward after B ticks, one `ppermute` each, outside the conds (a stage
sends and receives whether or not its slot is idle).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.pipeline.pipe_axis import AXIS, accumulator, sum_over_stages, varying
from jaxpar.pipeline.schedule import EMPTY, Schedule
from jaxpar.pipeline.slot_places import ORDER
from jaxpar.pipeline.stage_context import StageContext
from jaxpar.pipeline.stages import Stages
from jaxpar.pipeline.tick import masked_tick_of, tick_of


def table_body(stages: Stages, schedule: Schedule, fill: float, entries: list) -> Callable:
    """The shard_map body: (loss, stats), (gradients of embedding, chunks, head) from the schedule's scans."""
    kept = _forward_keeps(schedule)

    def body(embed_params, chunk_params, head_params, tokens, targets, docs):
        ctx = StageContext.trace(stages, schedule, fill, entries, embed_params, chunk_params, head_params, tokens,
                                 targets, docs)
        carry = _initial_carry(ctx)
        for start, repeats, runs in schedule.loops:
            carry = _run_loop(ctx, kept, carry, start, repeats, runs)
        return _result(ctx, carry)

    return body


def _forward_keeps(schedule: Schedule) -> dict:
    """"F" -> [ticks, stages] 1 where a forward's residuals are read in a later tick.

    A stage that permutes writes a forward's residuals into the ring only
    there. Also checks what the tick relies on: the last chunk runs its
    backward in its forward's tick, and no W runs in its forward's tick.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    actions = schedule.actions
    back = "B" if "B" in actions else "BW"
    f_ticks, b_ticks = schedule.slot_ticks("F"), schedule.slot_ticks(back)
    w_ticks = schedule.slot_ticks("W") if "W" in actions else b_ticks
    if any(f_ticks[p - 1, j, v - 1] != b_ticks[p - 1, j, v - 1] for j in range(m)):
        raise AssertionError(f"schedule {schedule.name!r}: the last chunk must run a backward in its forward's tick")
    if "W" in actions and any(w_ticks[key] == t for key, t in f_ticks.items()):
        raise AssertionError(f"schedule {schedule.name!r}: a W slot in its forward's tick")
    r_ticks = {key: max(b_ticks[key], w_ticks[key]) for key in f_ticks}  # the last tick that reads the residuals
    kept = {"F": np.zeros_like(actions["F"])}
    for (i, j, k), t in f_ticks.items():
        kept["F"][t, i] = int(r_ticks[i, j, k] > t)
    return kept


def _initial_carry(ctx: StageContext) -> dict:
    """The scan carry: activations and cotangents in (bubble `fill`), the ring, the gradient and loss sums."""
    act, act_axes, fill = ctx.act, ctx.act_axes, ctx.fill
    carry = {
        "fwd_in": varying(jnp.full(act.shape, fill, act.dtype), act_axes),
        "bwd_in": varying(jnp.full(act.shape, fill, act.dtype), act_axes),
        "ring": ctx.ring.empty,
        "saved": None,
        "d_stage": jax.tree.map(accumulator, ctx.local),
        "d_embed": jax.tree.map(accumulator, ctx.embed_params),
        "d_head": jax.tree.map(accumulator, ctx.head_params),
        "sums": jax.tree.map(accumulator, ctx.sums_shape),
        "loss": varying(jnp.zeros((), jnp.float32), ctx.loss_axes),
    }
    if ctx.layout.cotangent_buffer_rows:
        carry["saved"] = varying(jnp.full((ctx.layout.cotangent_buffer_rows, *act.shape), fill, act.dtype), act_axes)
    return carry


def _run_loop(ctx: StageContext, kept: dict, carry: dict, start: int, repeats: int, runs) -> dict:
    """One of `Schedule.loops`: its runs of ticks a scan each, `repeats` rounds of them a scan around them."""
    period, offsets = sum(n for n, _, _ in runs), np.cumsum([0] + [n for n, _, _ in runs])
    rounds = start + period * np.arange(repeats)[:, None]
    xs = [_tables_of(ctx, kept, kinds, rounds + np.arange(o, o + n)) for (n, kinds, _), o in zip(runs, offsets)]

    def one_round(carry, xs):
        for (_, kinds, head), tables in zip(runs, xs):
            carry, _ = jax.lax.scan((masked_tick_of if ctx.permutes else tick_of)(ctx, kinds, head), carry, tables)
        return carry, None

    if repeats == 1:
        carry, _ = one_round(carry, [jax.tree.map(lambda a: a[0], x) for x in xs])
    else:
        carry, _ = jax.lax.scan(one_round, carry, xs)
    return carry


def _tables_of(ctx: StageContext, kept: dict, kinds, ticks) -> dict:
    """The slot tables of `kinds` at `ticks` (an index array: [ticks] or [rounds, ticks]), by (kind, place):
    one per place that holds a slot in these ticks; one for all places (None) for a stage that permutes."""
    schedule, layout = ctx.schedule, ctx.layout
    actions, places = schedule.actions, schedule.places
    tables = {}
    for kind in kinds:
        columns = {"j": actions[kind], "k": schedule.chunks[kind], "row": layout.rows[kind]}
        if kind in layout.cotangent_rows:
            columns["saved"] = layout.cotangent_rows[kind]
        if ctx.permutes:
            columns |= {"keep": kept.get(kind, places[kind])}
            tables[kind, None] = {name: jnp.asarray(table[ticks]) for name, table in columns.items()}
            continue
        for place in (0, 1):
            j = np.where(places[kind] == place, actions[kind], EMPTY)
            if (kind, place) in ORDER and (j[ticks] != EMPTY).any():
                tables[kind, place] = {name: jnp.asarray(table[ticks]) for name, table in (columns | {"j": j}).items()}
    return tables


def _result(ctx: StageContext, carry: dict):
    """(loss with the aux loss, stats), (embedding, chunk and head gradients) out of the final carry."""
    p, m = ctx.p, ctx.m

    def cast(tree, like):
        return jax.tree.map(lambda a, ref: a.astype(ref.dtype), tree, like)

    d_chunks = jax.tree.map(lambda a: a[None], cast(carry["d_stage"], ctx.local))
    # Cast before the sum: one fewer table-sized f32 buffer after the loop (XLA:CPU kept the sum and its
    # cast apart: pp2 x dp4 on MaxText's model, 394.0 -> 369.7 MB); the embedding's is exact (one stage adds).
    d_embed = sum_over_stages(cast(carry["d_embed"], ctx.embed_params))
    d_head = sum_over_stages(cast(carry["d_head"], ctx.head_params))
    loss = (jax.lax.psum(carry["loss"], AXIS) / (m * p)).astype(ctx.loss_dtype)
    sums = jax.tree.map(lambda s: s / m, sum_over_stages(carry["sums"]))
    return (ctx.stages.with_aux(loss, sums), sums), (d_embed, d_chunks, d_head)

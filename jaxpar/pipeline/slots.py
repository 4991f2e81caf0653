"""The slots of an explicit schedule's tick, one function per kind: F, the loss head, B or BW, W.

Each takes the stage's `StageContext`, the scan carry (a dict it updates:
activations in, the ring, kept cotangents, the gradient and loss sums) and
its slot's entries of the tick table `s` (microbatch "j", chunk "k", ring
"row", kept cotangent's row "saved"). A slot runs under `ctx.per_slot`: a
`lax.cond` that idles in a bubble, or masked on a stage whose layers permute.
The tick (`jaxpar.pipeline.tick`) calls them in `jaxpar.pipeline.slot_places.ORDER`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel import bits, documents
from jaxpar.pipeline.pipe_axis import AXIS, add, add_at, head_documents, head_share, layer_documents, row_at
from jaxpar.pipeline.residual_ring import read_token
from jaxpar.pipeline.schedule import EMPTY
from jaxpar.pipeline.stage_context import StageContext


def forward_work(ctx: StageContext, q, j, k, incoming, mask: Callable):
    """Forward of microbatch j through chunk k (embedded here on stage 0's chunk 0): y, its VJP, its stats."""
    x = mask(jnp.where((ctx.stage == 0) & (k == 0), ctx.stages.embed(ctx.embed_params, row_at(ctx.tokens, j)),
                       incoming))
    with documents.scope(layer_documents(ctx.docs, j)):
        out, vjp, part = jax.vjp(ctx.layers.outputs, q, x, has_aux=True)
    y = out[0] if ctx.layers.weighted else out
    return mask(y, jnp.full_like(y, ctx.fill)), vjp, part


def forward_slot(ctx: StageContext, carry: dict, s: dict, y_idle):
    """The forward slot (under `lax.cond`): its VJP goes into the ring row the table gives.

    Idle, it hands on `y_idle` (the other forward place's output), or
    `fill` made in its branch (y_idle None).
    """
    j, k, row, q = s["j"], s["k"], s["row"], ctx.params_of(s["k"])

    def work(buffers, sums, incoming, _, mask):
        y, vjp, part = forward_work(ctx, q, j, k, incoming, mask)
        return y, ctx.ring.store(buffers, row, ctx.ring.residuals(vjp, q), mask), add(sums, mask(part))

    def idle(buffers, sums, incoming, y_idle):
        return (jnp.full_like(incoming, ctx.fill) if y_idle is None else y_idle), buffers, sums

    y, carry["ring"], carry["sums"] = ctx.per_slot(
        j != EMPTY, work, idle, carry["ring"], carry["sums"], carry["fwd_in"], y_idle)
    return y


def head_slot(ctx: StageContext, carry: dict, y, j):
    """Loss of microbatch j on each stage's share of positions: the cotangent of the last stage's y.

    j is the same on every stage (the last stage's slot), so all of
    them take the same branch of its `lax.cond`, collectives included.
    """
    p, m = ctx.p, ctx.m

    def run_head(d_head, total, y):
        share, tgt = head_share(y, row_at(ctx.targets, j), ctx.stage, p)
        head_docs = head_documents(jax.tree.map(lambda a: row_at(a, j), ctx.docs), y.shape[-2], ctx.stage, p)
        with documents.scope(head_docs):
            value, head_vjp = jax.vjp(lambda h, x: ctx.stages.head(h, x, tgt), ctx.head_params, share)
        part, d_share = head_vjp(jnp.ones_like(value) / (m * p))
        dy = bits.all_gather(d_share, AXIS, axis=1)
        return dy, add(d_head, part), total + value.astype(jnp.float32)

    dy, carry["d_head"], carry["loss"] = jax.lax.cond(
        j != EMPTY, run_head, lambda d_head, total, y: (jnp.full_like(y, ctx.fill), d_head, total),
        carry["d_head"], carry["loss"], y)
    return dy


def head_of(ctx: StageContext, carry: dict, f: dict, y, head: bool):
    """The loss head's cotangent of the last stage's output `y` (None in a tick without the head)."""
    if not head:
        return None
    p, v = ctx.p, ctx.v
    j_head = jnp.where(f["k"][p - 1] == v - 1, f["j"][p - 1], EMPTY)
    return head_slot(ctx, carry, y, j_head)


def incoming_of(ctx: StageContext, carry: dict, b: dict, head: bool, dy):
    """A backward slot's cotangent: the loss head's on the last stage's last chunk, else the one passed back."""
    if head:
        return jnp.where((ctx.stage == ctx.p - 1) & (b["k"] == ctx.v - 1), dy, carry["bwd_in"])
    return carry["bwd_in"]


def into_embedding(ctx: StageContext, carry: dict, j, k, dx) -> None:
    """Stage 0's chunk 0 backs its input gradient into the embedding."""
    def work(total, dx, mask):
        _, embed_vjp = jax.vjp(lambda e: ctx.stages.embed(e, row_at(ctx.tokens, j)), ctx.embed_params)
        return add(total, embed_vjp(mask(dx))[0])

    carry["d_embed"] = ctx.per_slot((j != EMPTY) & (ctx.stage == 0) & (k == 0), work, lambda total, dx: total,
                                    carry["d_embed"], dx)


def backward_slot(ctx: StageContext, carry: dict, s: dict, cotangent, fused: bool):
    """Backward of microbatch j through chunk k from its stored residuals (under `lax.cond`): (dx, its token).

    fused (BW): the weight gradients too. Otherwise (B) only the input
    gradient, which XLA prunes the weight matmuls from; the tick keeps
    the cotangent it takes for the W slot (`keep_cotangent`, before the
    B runs) in the row the table gives (none when W runs in this tick:
    it takes it as it is).
    """
    j, k, row, q = s["j"], s["k"], s["row"], ctx.params_of(s["k"])
    ring, fill = ctx.ring, ctx.fill
    if fused:
        def work(buffers, total, dy, mask):
            d_params, dx = ring.load(buffers, row, q)(ctx.cotangent_of(mask(dy)))
            return mask(dx, jnp.full_like(dx, fill)), add_at(total, mask(d_params), k, ctx.v), read_token(row, True)

        dx, carry["d_stage"], token = ctx.per_slot(
            j != EMPTY, work, lambda buffers, total, dy: (jnp.full_like(dy, fill), total, read_token(row, False)),
            carry["ring"], carry["d_stage"], cotangent)
    else:
        def work(buffers, dy, mask):
            dx = ring.load(buffers, row, q)(ctx.cotangent_of(mask(dy)))[1]
            return mask(dx, jnp.full_like(dx, fill)), read_token(row, True)

        dx, token = ctx.per_slot(j != EMPTY, work, lambda buffers, dy: (jnp.full_like(dy, fill), read_token(row, False)),
                                 carry["ring"], cotangent)
    into_embedding(ctx, carry, j, k, dx)
    return dx, token


def weight_slot(ctx: StageContext, carry: dict, s: dict, handed):
    """Weight gradients of microbatch j: its stored VJP replayed on its kept cotangent, parameter part only.

    The replay recomputes the input-gradient chain inside the stage
    (layer l's weight gradient needs the cotangent of layer l's output).
    Returns the slot's token (`jaxpar.pipeline.residual_ring.after`).
    """
    j, k, row, q = s["j"], s["k"], s["row"], ctx.params_of(s["k"])

    def replay(buffers, saved, total, handed, mask):
        dy = kept_cotangent(ctx, buffers, saved, s["saved"], handed)
        d_params = ctx.ring.load(buffers, row, q)(ctx.cotangent_of(mask(dy)))[0]
        return add_at(total, mask(d_params), k, ctx.v), read_token(row, True)

    # The barrier keeps XLA from folding the cond where every stage runs this W (zb-h1's last tick): inlined, the
    # replay's zero-filled gradient buffers were scheduled at the step's start, live through its peak (+296 KB
    # of temp at p = 2, a stage's parameters' worth).
    carry["d_stage"], token = ctx.per_slot(
        jax.lax.optimization_barrier(j != EMPTY), replay, lambda _, __, total, ___: (total, read_token(row, False)),
        carry["ring"], carry["saved"], carry["d_stage"], handed)
    return token


def keep_cotangent(ctx: StageContext, buffers, saved, c, dy, live):
    """Ring and cotangent buffer with B's cotangent `dy` kept in row c (none where c is EMPTY)."""
    ring, share = ctx.ring, ctx.share
    if ring.holder is not None and share:
        buffers = ring.store_cotangent(buffers, c, dy, live & (c >= 0) & (c < share))
    if saved is not None:
        b = jnp.clip(c - share, 0, saved.shape[0] - 1)
        saved = jax.lax.dynamic_update_index_in_dim(
            saved, jnp.where(live & (c >= share), dy, row_at(saved, b)), b, 0)
    return buffers, saved


def kept_cotangent(ctx: StageContext, buffers, saved, c, handed):
    """W's cotangent: kept in row c, or `handed` on by the B of the same tick (c EMPTY)."""
    ring, share = ctx.ring, ctx.share
    choices = []
    if handed is not None:
        choices.append((c < 0, handed))
    if ring.holder is not None and share:
        choices.append(((c >= 0) & (c < share), ring.load_cotangent(buffers, c)))
    if saved is not None:
        choices.append((c >= share, row_at(saved, jnp.clip(c - share, 0, saved.shape[0] - 1))))
    value = choices[-1][1]
    for chosen, other in reversed(choices[:-1]):
        value = jnp.where(chosen, other, value)
    return value

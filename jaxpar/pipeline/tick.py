"""One tick of an explicit schedule: its slots in `ORDER`, then the two ppermutes.

`tick_of` runs each slot at its place under its own `lax.cond`, writing the
ring at indices computed after the reads before them (`after`). A stage whose
layers permute cannot idle in a cond while others run (`StageContext.per_slot`):
`masked_tick_of` computes each slot once per tick, masked, and writes the ring
after all of them, a backward taking the residuals its forward made in the
tick as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel import bits
from jaxpar.parallel.constrain import varying_axes
from jaxpar.pipeline.pipe_axis import AXIS, add, add_at, varying
from jaxpar.pipeline.residual_ring import after, read_token
from jaxpar.pipeline.schedule import EMPTY
from jaxpar.pipeline.slot_places import ORDER
from jaxpar.pipeline.slots import (
    backward_slot,
    forward_slot,
    forward_work,
    head_of,
    incoming_of,
    into_embedding,
    keep_cotangent,
    kept_cotangent,
    weight_slot,
)
from jaxpar.pipeline.stage_context import StageContext, masker

# A slot kind with two places in the tick (`jaxpar.pipeline.slot_places.ORDER`) runs its `lax.cond` under this scope,
# "{kind}" filled in: a stage runs one of them per tick, so `inspect.matmul_flops` counts one.
PLACE_SCOPE = "pipeline_{kind}_slot"


def _slots(ctx: StageContext, tables: dict) -> dict:
    """This stage's entries of the tick's tables, by (kind, place)."""
    return {key: {name: table[ctx.stage] for name, table in columns.items()} for key, columns in tables.items()}


def tick_of(ctx: StageContext, kinds: tuple[str, ...], head: bool) -> Callable:
    """One tick: its slots in `ORDER`, each at its place, then the two ppermutes."""
    def tick(carry, tables):
        carry, reads = dict(carry), []
        slot = _slots(ctx, tables)
        # After a W slot an idle forward makes its fill in its cond, so it is not live through the W: an
        # activation less at zb-h1's peak. Made there on 1f1b's and interleaved's ticks, it cost their temp
        # 0.6 and 1.3 KB of XLA's bookkeeping.
        y = None if "W" in kinds else jnp.full_like(carry["fwd_in"], ctx.fill)
        dy = dx = handed = None
        for kind, place in ORDER:
            if kind == "head":
                if head:
                    dy = head_of(ctx, carry, tables["F", 0], y, head)
                continue
            if (kind, place) not in slot:
                continue
            s, scope = dict(slot[kind, place]), jax.named_scope(PLACE_SCOPE.format(kind=kind))
            if kind == "F":
                s["row"], reads = after(s["row"], reads), []
                with scope:
                    y = forward_slot(ctx, carry, s, y)
            elif kind == "W":  # before B, a W in B's tick takes the cotangent B is about to take
                with scope:
                    reads.append(weight_slot(ctx, carry, s, carry["bwd_in"] if place == 0 else handed))
            else:
                handed = incoming_of(ctx, carry, s, head, dy)
                if kind == "B":  # the cotangent it takes, kept for a W in a later tick, before it runs
                    carry["ring"], carry["saved"] = keep_cotangent(
                        ctx, carry["ring"], carry["saved"], after(s["saved"], reads), handed, s["j"] != EMPTY)
                    reads = []
                dx, token = backward_slot(ctx, carry, s, handed, fused=kind == "BW")
                reads.append(token)
        return permute(ctx, carry, kinds, y, dx), None
    return tick


def masked_tick_of(ctx: StageContext, kinds: tuple[str, ...], head: bool) -> Callable:
    """One tick of a stage whose layers permute: every slot computed once and masked, in the order F,
    head, B or BW, W; the ring's writes (residuals, kept cotangents) after all its reads, and a backward
    reading the residuals its forward made in this tick (the last chunk) takes them as they are."""
    def tick(carry, tables):
        carry, writes = dict(carry), []
        slot = _slots(ctx, tables)
        y = dx = dy = handed = token = made = None
        # True on every device (a predicate of the whole tables), which XLA cannot know: see `fenced`.
        always = jnp.all(jnp.stack([columns["j"] for columns in tables.values()]) >= EMPTY)
        if "F" in kinds:
            y, made = _masked_forward(ctx, carry, slot["F", None], writes)
            dy = head_of(ctx, carry, tables["F", None], y, head)
        if ctx.back in kinds:
            dx, handed, token = _masked_backward(ctx, carry, slot[ctx.back, None], made, head, dy, always, writes)
        if "W" in kinds:
            w_token = _masked_weight(ctx, carry, slot["W", None], handed, always)
            token = w_token if token is None else token + w_token
        for write in writes:  # after every read of the ring in this tick
            write(carry, [] if token is None else [token])
        return permute(ctx, carry, kinds, y, dx), None
    return tick


def _masked_forward(ctx: StageContext, carry: dict, f: dict, writes: list):
    """The forward, masked: (y, what a backward of this tick reads of it); its ring write joins `writes`."""
    live_f, q = f["j"] != EMPTY, ctx.params_of(f["k"])
    y, vjp, part = forward_work(ctx, q, f["j"], f["k"], carry["fwd_in"], masker(live_f))
    carry["sums"] = add(carry["sums"], masker(live_f)(part))
    fresh = ctx.ring.residuals(vjp, q)
    writes.append(lambda c, reads, f=f, fresh=fresh, live=live_f: c.update(ring=ctx.ring.store(
        c["ring"], after(f["row"], reads), fresh, masker(live & (f["keep"] == 1)))))
    return y, (f, fresh, live_f)


def _masked_backward(ctx: StageContext, carry: dict, b: dict, made, head: bool, dy, always, writes: list):
    """B or BW, masked, under `fenced`: (dx, the cotangent it took, its token); B's kept cotangent joins `writes`.

    made: (slot, residuals, live) of this tick's forward, None without one.
    """
    ring, v = ctx.ring, ctx.v
    live_b, q = b["j"] != EMPTY, ctx.params_of(b["k"])
    mask = masker(live_b)
    stored = ring.at(carry["ring"], b["row"])
    if made is not None:  # the last chunk's backward in its forward's tick
        f, fresh, live_f = made
        now = live_f & (f["j"] == b["j"]) & (f["k"] == b["k"])
        stored = [jnp.where(now, new, old) for new, old in zip(fresh, stored)]
    handed = mask(incoming_of(ctx, carry, b, head, dy))
    if ctx.back == "BW":
        (d_params, dx), token = fenced(
            always, lambda st, h: ring.vjp(st, q)(ctx.cotangent_of(h)), b["row"], stored, handed)
        carry["d_stage"] = add_at(carry["d_stage"], mask(d_params), b["k"], v)
    else:
        dx, token = fenced(
            always, lambda st, h: ring.vjp(st, q)(ctx.cotangent_of(h))[1], b["row"], stored, handed)
        writes.append(lambda c, reads, b=b, dy=handed, live=live_b: c.update(zip(
            ("ring", "saved"), keep_cotangent(ctx, c["ring"], c["saved"], after(b["saved"], reads), dy, live))))
    dx = mask(dx, jnp.full_like(dx, ctx.fill))
    into_embedding(ctx, carry, b["j"], b["k"], dx)
    return dx, handed, token


def _masked_weight(ctx: StageContext, carry: dict, w: dict, handed, always):
    """W, masked, under `fenced`: its kept cotangent (or the B's `handed`) replayed; returns its token."""
    live_w, q = w["j"] != EMPTY, ctx.params_of(w["k"])

    def replay(buffers, saved, handed):
        cotangent = kept_cotangent(ctx, buffers, saved, w["saved"], handed)
        return ctx.ring.load(buffers, w["row"], q)(ctx.cotangent_of(masker(live_w)(cotangent)))[0]

    d_params, w_token = fenced(always, replay, w["row"], carry["ring"], carry["saved"], handed)
    carry["d_stage"] = add_at(carry["d_stage"], masker(live_w)(d_params), w["k"], ctx.v)
    return w_token


def fenced(always, fn: Callable, index, *operands):
    """(fn(*operands), its `read_token`) from a `lax.cond` on `always`, which holds on every device.

    Every device takes the same branch, so collectives inside fn (ring
    attention's permutes) still meet, and the token orders the ring's
    writes after fn's reads without communication.
    """
    shapes = jax.eval_shape(fn, *operands)

    def idle(*_):
        zeros = jax.tree.map(lambda a: varying(jnp.zeros(a.shape, a.dtype), varying_axes(a)), shapes)
        return zeros, read_token(index, False)

    return jax.lax.cond(always, lambda *a: (fn(*a), read_token(index, True)), idle, *operands)


def permute(ctx: StageContext, carry: dict, kinds, y, dx) -> dict:
    """Activations on forward, cotangents back: one ppermute each, outside the slots' conds.

    With v > 1 chunks the rings close (device p - 1's chunk k feeds device 0's chunk k + 1).
    """
    p = ctx.p
    hops = range(p) if ctx.v > 1 else range(p - 1)
    if "F" in kinds:
        carry["fwd_in"] = bits.ppermute(y, AXIS, [(a, (a + 1) % p) for a in hops])
    if ctx.back in kinds:
        carry["bwd_in"] = bits.ppermute(dx, AXIS, [((a + 1) % p, a) for a in hops])
    return carry

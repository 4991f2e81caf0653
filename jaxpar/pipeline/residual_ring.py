"""The ring buffer where a stage keeps the VJP residuals of its slots in flight, and the order of its writes.

The explicit schedules (`jaxpar.pipeline.table_executor`) store each
forward's residuals in the ring row the table assigns (`Schedule.rows`) and
rebuild its VJP from them in the backward slots; zb-h1 also keeps a B slot's
cotangent for its W in a row no residuals hold at the time. A slot that
writes a row other slots of its tick read writes at an index computed from
what they return (`after`, `read_token`), so XLA updates the ring in place.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel.constrain import varying_axes
from jaxpar.pipeline.pipe_axis import row_at, varying

RING_SCOPE = "pipeline_residual_ring"


class ResidualRing:
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
            return varying(jnp.full((slots, *leaf.shape), value, leaf.dtype), varying_axes(leaf) | varying_axes(x))

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
        kept = [mask(leaf, row_at(buf, row)) for buf, leaf in zip(buffers, stored)]
        # Each buffer's own write names it in the compiled step (`inspect.residual_ring_bytes`); their initial
        # values XLA may merge with other arrays'.
        with jax.named_scope(RING_SCOPE):
            return [jax.lax.dynamic_update_index_in_dim(buf, r, row, 0) for buf, r in zip(buffers, kept)]

    def at(self, buffers: list, row) -> list:
        return [row_at(buf, row) for buf in buffers]

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


def after(index, tokens):
    """`index` (an int32 scalar) as XLA must compute it: after the slots that returned `tokens`.

    A slot that writes a row of the ring in a tick after other slots read it
    (a row freed and taken in the same tick) writes at such an index, so XLA
    orders the reads first and updates the ring in place. Without the
    dependency it would copy the whole ring to let the write go first (an
    `optimization_barrier` does not survive until XLA places the copies). A
    token is a float scalar a slot's `lax.cond` returns (`read_token`): the
    added zero, a product with it XLA does not fold, needs no communication.
    """
    if not tokens:
        return index
    return index + (sum(tokens) * 0).astype(index.dtype)


def read_token(index, live: bool):
    """What a reading slot's branch returns for `after`: its index where it runs, -1 where it idles (unlike
    values, so XLA cannot take it out of the `lax.cond`)."""
    value = index.astype(jnp.float32)
    return value if live else value * 0 - 1


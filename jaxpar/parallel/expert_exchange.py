"""A sorted dropless MoE layer over `expert` with the ragged exchange: each rank receives exactly its experts' rows.

A device's assignments, sorted by expert, are also sorted by the rank that holds each expert. The row counts go
first (one all-to-all of [ranks, local experts] counts, and one each of the offsets both ways), then
`jax.lax.ragged_all_to_all` sends each rank its rows, the rank runs its experts on what it received (the grouped
FFN, `jaxpar.parallel.expert_dispatch`), and a second ragged exchange brings the results back to their rows. The
bytes moved are the routed rows' (tokens x k x d each way), not the capacity buffers'; the receiving buffer is
sized for the worst case (every source's rows to one rank: ranks x tokens x k rows), as MaxText's is.
XLA:CPU has no ragged-all-to-all ("not supported by XLA:CPU ThunkEmitter"): there the capacity-buffer exchange
of `jaxpar.parallel.expert_sorted` runs instead (`choose`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.core import device_facts, usage
from jaxpar.parallel.expert_dispatch import _axes, _varying
from jaxpar.parallel.expert_kernels import EXCHANGE_MARK

MARK = EXCHANGE_MARK  # the usage marks recording each MoE layer's exchange over `expert`
RAGGED_BACKENDS = ("gpu", "tpu")  # XLA's with a ragged-all-to-all (XLA:CPU's thunk emitter has none)
ragged_all_to_all = jax.lax.ragged_all_to_all  # the collective (tests put a reference in its place on XLA:CPU)


def choose(plan, axis) -> tuple[str, str]:
    """(exchange, why) of a sorted dropless layer under `plan` whose experts are split over `axis`."""
    backend = device_facts.of_mesh(plan.mesh).backend
    if not isinstance(axis, str):
        return "buffers", f"experts over several axes {tuple(axis)}: the capacity buffers' all-to-all"
    if backend in RAGGED_BACKENDS:
        return "ragged", f"XLA:{backend.upper()} has ragged-all-to-all: each rank gets exactly its experts' rows"
    return "buffers", f"XLA:{backend.upper()} has no ragged-all-to-all: the capacity buffers' all-to-all"


def chosen(plan, axis) -> str:
    """The exchange for a layer under `plan`, its choice marked in the trace."""
    return usage.mark_choice(MARK, *choose(plan, axis))


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Offsets and sizes of the two ragged exchanges, all [ranks] but `received` [ranks, local experts]."""

    send: jax.Array  # rows this device sends to each rank
    send_at: jax.Array  # where they start in its sorted rows
    lands_at: jax.Array  # where they land in each rank's receiving buffer
    received: jax.Array  # rows each source sent to each local expert
    recv: jax.Array  # rows received from each source
    recv_at: jax.Array  # where they start in the receiving buffer
    back_at: jax.Array  # where the results go back in each source's sorted rows


def _exclusive(sizes: jax.Array) -> jax.Array:
    return (jnp.cumsum(sizes, axis=-1) - sizes).astype(jnp.int32)


def _swap(values: jax.Array, axis) -> jax.Array:
    """Element r of each rank's [ranks, ...] to rank r: what every rank holds for this one."""
    return jax.lax.all_to_all(values, axis, 0, 0, tiled=True)


def exchange(counts: jax.Array, axis, ranks: int) -> Exchange:
    """The exchanges of rows sorted by expert with `counts` [E] rows per expert, experts split over `ranks`."""
    per_rank = counts.reshape(ranks, -1).astype(jnp.int32)
    send = jnp.sum(per_rank, axis=1)
    received = _swap(per_rank, axis)
    recv = jnp.sum(received, axis=1)
    send_at, recv_at = _exclusive(send), _exclusive(recv)
    return Exchange(send, send_at, _swap(recv_at, axis), received, recv, recv_at, _swap(send_at, axis))


def to_ranks(rows: jax.Array, ex: Exchange, axis, ranks: int) -> jax.Array:
    """Sorted rows [R, d] to the ranks holding their experts: the receiving buffer [ranks * R, d]."""
    out = _like(rows, (ranks * rows.shape[0], rows.shape[1]))
    return ragged_all_to_all(rows, out, ex.send_at, ex.send, ex.lands_at, ex.recv, axis_name=axis)


def from_ranks(buffer: jax.Array, ex: Exchange, axis, rows: int) -> jax.Array:
    """The inverse: a receiving buffer's rows back to their sources' sorted rows [rows, d]."""
    out = _like(buffer, (rows, buffer.shape[1]))
    return ragged_all_to_all(buffer, out, ex.recv_at, ex.recv, ex.back_at, ex.send, axis_name=axis)


def _like(x: jax.Array, shape) -> jax.Array:
    """Zeros of `shape` in x's dtype, varying over the manual axes x varies over."""
    return _varying(jnp.zeros(shape, x.dtype), _axes(x))


def received_rows(ex: Exchange, size: int) -> tuple[jax.Array, jax.Array]:
    """(order, counts): the receiving buffer's [size] filled rows listed by local expert (each expert's rows in
    source order), the empty ones last; counts [local experts] rows per local expert."""
    position = jnp.arange(size, dtype=jnp.int32)
    ends = jnp.cumsum(ex.recv)
    source = jnp.minimum(jnp.sum(position[:, None] >= ends[None, :], axis=1), ex.recv.shape[0] - 1)
    within = position - ex.recv_at[source]
    local = jnp.sum(within[:, None] >= jnp.cumsum(ex.received, axis=1)[source], axis=1)
    key = jnp.where(position < ends[-1], local, ex.received.shape[1])
    return jnp.argsort(key, stable=True).astype(jnp.int32), jnp.sum(ex.received, axis=0).astype(jnp.int32)

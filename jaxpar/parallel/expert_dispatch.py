"""The experts' feed-forward over assignments sorted by expert: grouped matmuls in memory of the routed rows.

An MoE layer's assignments (rows of a source array: a device's tokens, or the
slots it received) are listed sorted by expert, `counts[e]` rows each. Two
forms compute every expert's FFN on exactly its rows and add each result,
times its weight, back into the row it came from:

- `tiled`: a scan over the experts, each running a loop over its own rows a
  tile at a time (the tile's rows gathered from the source, the expert's
  weights the scan's slice). Nothing padded or sorted is materialised: the
  forward's one buffer is its fp32 [source rows, d] output, and the backward
  (written out, `jax.custom_vjp`) recomputes each tile's FFN, so its temp is
  the source-sized cotangent, the weights' per-expert gradients and one
  tile's work. Each expert's last tile computes up to tile - 1 padding rows,
  masked. It runs on any backend.
- `ragged`: the rows gathered in expert order and `jax.lax.ragged_dot` as
  the grouped matmul, differentiated by JAX. Where XLA has no native grouped
  matmul for the target (XLA:CPU) it expands into a dense dot over every
  expert, so `jaxpar.parallel.expert_kernels` takes it only where asked.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel.constrain import varying_axes

WEIGHTS = ("expert_gate", "expert_up", "expert_down")
BIASES = ("expert_gate_bias", "expert_up_bias", "expert_down_bias")


def sorted_assignments(expert: jax.Array, gate: jax.Array, n_experts: int):
    """(order, weight, counts): the assignments of tokens [T, k] sorted by expert, stably (each expert's rows in
    token order): `order` [T * k] their token rows, `weight` [T * k] their gates, `counts` [E] rows per expert."""
    top_k = expert.shape[-1]
    flat = expert.reshape(-1)
    perm = jnp.argsort(flat, stable=True)
    counts = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    return (perm // top_k).astype(jnp.int32), gate.reshape(-1)[perm], counts


def expert_ffn(w: dict, x: jax.Array, activation: Callable) -> jax.Array:
    """One expert's FFN on rows x [n, d]: `w` holds its gate/up [d, f], down [f, d] and any biases."""
    gate, up = x @ w["expert_gate"], x @ w["expert_up"]
    if "expert_gate_bias" in w:
        gate, up = gate + w["expert_gate_bias"].astype(gate.dtype), up + w["expert_up_bias"].astype(up.dtype)
    out = activation(gate, up) @ w["expert_down"]
    return out + w["expert_down_bias"].astype(out.dtype) if "expert_down_bias" in w else out


def tile_rows(rows: int, n_experts: int) -> int:
    """Rows per tile: a power of two near a quarter of an expert's even share (the padding each expert's last
    tile computes, about n_experts * tile / 2 rows in all, stays near an eighth of the rows), 8 to 256."""
    share = max(1, rows // (4 * n_experts))
    return int(min(256, max(8, 1 << (share.bit_length() - 1))))


def _tile(order, weight, offset, count, i, tile):
    """The i-th tile of one expert's run: (positions in the sorted list, source rows, valid mask, weights)."""
    start = offset + i * tile
    position = start + jnp.arange(tile, dtype=jnp.int32)
    valid = position < offset + count
    rows = jax.lax.dynamic_slice(order, (start,), (tile,))
    scale = valid.astype(jnp.float32)
    if weight is not None:
        scale = scale * jax.lax.dynamic_slice(weight, (start,), (tile,)).astype(jnp.float32)
    return position, rows, valid, scale


def _padded(order, weight, tile):
    """`order` and `weight` with a tile of zeros after them, so that every tile's slice lies inside."""
    order = jnp.concatenate([order, jnp.zeros((tile,), order.dtype)])
    return order, None if weight is None else jnp.concatenate([weight, jnp.zeros((tile,), weight.dtype)])


def _tiles(count, tile):
    return (count + tile - 1) // tile


def _axes(*like) -> tuple[str, ...]:
    """Every manual axis any array in `like` varies over."""
    axes = set()
    for leaf in jax.tree.leaves(like):
        axes |= varying_axes(leaf)
    return tuple(sorted(axes))


def _zeros(shape, *like) -> jax.Array:
    """fp32 zeros typed as varying over `_axes(like)` (a loop's carry must keep its type when the loop adds those
    arrays into it)."""
    return _varying(jnp.zeros(shape, jnp.float32), _axes(like))


def _varying(x: jax.Array, axes) -> jax.Array:
    """x typed as varying over `axes` too. Differentiated inside a loop, an invariant weight would have its
    cotangent summed over the devices there, one all-reduce per tile: with each device's own trip count, a
    stall; the backward sums it once, after the loops (`_summed_where_invariant`)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _offsets(counts):
    return (jnp.cumsum(counts) - counts).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def tiled_ffn(p: dict, src: jax.Array, order: jax.Array, counts: jax.Array, weight, activation, tile: int):
    """sum over assignments r of weight[r] * FFN_{expert(r)}(src[order[r]]), added into row order[r]: [N, d].

    p: the experts' WEIGHTS [E, ...] (and BIASES); order [R] rows of src sorted by expert, counts [E] (summing to
    at most R: the rest are not computed); weight [R] or None (ones)."""
    return _tiled_forward(p, src, order, counts, weight, activation, tile)


def _tiled_forward(p, src, order, counts, weight, activation, tile):
    order, weight = _padded(order, weight, tile)

    def expert(y, xs):
        w, offset, count = xs

        def step(i, y):
            _, rows, _, scale = _tile(order, weight, offset, count, i, tile)
            out = expert_ffn(w, src[rows], activation).astype(jnp.float32)
            return y.at[rows].add(out * scale[:, None])

        return jax.lax.fori_loop(0, _tiles(count, tile), step, y), None

    y, _ = jax.lax.scan(expert, _zeros(src.shape, p, src, order, counts, weight), (p, _offsets(counts), counts))
    return y.astype(src.dtype)


def _tiled_fwd(p, src, order, counts, weight, activation, tile):
    return _tiled_forward(p, src, order, counts, weight, activation, tile), (p, src, order, counts, weight)


def _tiled_bwd(activation, tile, residuals, ct_y):
    """Each tile's FFN recomputed and differentiated: the weights' gradients one expert at a time (the scan's
    outputs), the source's and the weights' gathered back into their rows."""
    p, src, order, counts, weight = residuals
    rows_total = order.shape[0]
    order, padded_weight = _padded(order, weight, tile)
    everything = (p, src, order, counts, weight, ct_y)

    def expert(carry, xs):
        w, offset, count = xs
        w = jax.tree.map(lambda a: _varying(a, _axes(everything)), w)

        def step(i, carry):
            ct_src, ct_weight, ct_w = carry
            position, rows, valid, scale = _tile(order, padded_weight, offset, count, i, tile)
            out, ffn_vjp = jax.vjp(lambda w, x: expert_ffn(w, x, activation), w, src[rows])
            ct_out = ct_y[rows].astype(jnp.float32) * valid[:, None]
            if padded_weight is not None:
                ct_weight = ct_weight.at[position].add(jnp.sum(ct_out * out.astype(jnp.float32), axis=-1))
            d_w, d_x = ffn_vjp((ct_out * scale[:, None]).astype(out.dtype))
            ct_w = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), ct_w, d_w)
            return ct_src.at[rows].add(d_x.astype(jnp.float32)), ct_weight, ct_w

        zeros = jax.tree.map(lambda a: _zeros(a.shape, everything), w)
        ct_src, ct_weight, ct_w = jax.lax.fori_loop(0, _tiles(count, tile), step, (*carry, zeros))
        return (ct_src, ct_weight), ct_w

    start = (_zeros(src.shape, everything), _zeros(order.shape, everything))
    (ct_src, ct_weight), ct_p = jax.lax.scan(expert, start, (p, _offsets(counts), counts))
    ct_p = jax.tree.map(lambda g, a: g.astype(a.dtype), ct_p, p)
    ct_weight = None if weight is None else ct_weight[:rows_total].astype(weight.dtype)
    return ct_p, ct_src.astype(src.dtype), None, None, ct_weight


tiled_ffn.defvjp(_tiled_fwd, _tiled_bwd)


def ragged_ffn(p: dict, src: jax.Array, order: jax.Array, counts: jax.Array, weight, activation, tile: int = 0):
    """`tiled_ffn`'s result with `jax.lax.ragged_dot` as the grouped matmul over the rows gathered in expert order
    (rows past sum(counts) computed as zeros and masked); `tile` is unused."""
    del tile
    rows = src[order]
    ends = jnp.zeros((order.shape[0] + 1,), jnp.int32).at[jnp.cumsum(counts)].add(1)
    expert_of_row = jnp.cumsum(ends)[:-1]  # experts ending at or before each row
    valid = expert_of_row < counts.shape[0]
    expert_of_row = jnp.minimum(expert_of_row, counts.shape[0] - 1)

    def plus(name, out):
        return out + p[name][expert_of_row].astype(out.dtype) if name in p else out

    gate = plus("expert_gate_bias", jax.lax.ragged_dot(rows, p["expert_gate"], counts))
    up = plus("expert_up_bias", jax.lax.ragged_dot(rows, p["expert_up"], counts))
    out = plus("expert_down_bias", jax.lax.ragged_dot(activation(gate, up), p["expert_down"], counts))
    scale = valid.astype(jnp.float32) * (1.0 if weight is None else weight.astype(jnp.float32))
    y = jnp.zeros(src.shape, jnp.float32).at[order].add(out.astype(jnp.float32) * scale[:, None])
    return y.astype(src.dtype)


FORMS = {"tiled": tiled_ffn, "ragged": ragged_ffn}


def _summed_where_invariant(cts, primals):
    """Cotangents summed over the manual axes each varies over and its primal does not (what autodiff's transpose
    of the implicit broadcast does: a replicated weight's gradient is the sum of every device's part), in one
    all-reduce per set of axes (XLA:CPU may start independent ones in another order on each device and stall)."""
    leaves, tree = jax.tree.flatten(cts)
    by_axes: dict[tuple, list[int]] = {}
    for i, (ct, primal) in enumerate(zip(leaves, tree.flatten_up_to(primals))):
        axes = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
        if axes:
            by_axes.setdefault(axes, []).append(i)
    for axes, at in by_axes.items():
        for i, summed in zip(at, jax.lax.psum([leaves[i] for i in at], axes)):
            leaves[i] = summed
    return jax.tree.unflatten(tree, leaves)


def ffn_grads(form: str, p, src, order, counts, weight, activation, tile, ct_y):
    """(ct_p, ct_src, ct_weight) of `FORMS[form]` at ct_y. The tiled form's backward is called as it is: under
    jax.vjp its forward's loops are partially evaluated, which jax 0.10 mistypes in a replication-checked
    shard_map (a carry's varying axes)."""
    if form == "tiled":
        ct_p, ct_src, _, _, ct_weight = _tiled_bwd(activation, tile, (p, src, order, counts, weight), ct_y)
        return _summed_where_invariant((ct_p, ct_src, ct_weight), (p, src, weight))
    axes = _axes(p, src, order, counts, weight, ct_y)  # ragged_dot's transpose asserts on invariant weights
    varying = jax.tree.map(lambda a: _varying(a, axes), (p, src, weight))
    _, ffn_vjp = jax.vjp(lambda q, s, w: ragged_ffn(q, s, order, counts, w, activation, tile), *varying)
    return _summed_where_invariant(ffn_vjp(ct_y), (p, src, weight))

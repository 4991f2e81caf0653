"""One device's dropless MoE layer on its assignments sorted by expert (the `tiled` and `ragged` kernels).

Routing is the buffered layer's (`jaxpar.parallel.expert_routing.route_groups`, every option of it: softmax or
sigmoid scores, group-limited top-k, the correction bias, router biases, Llama 4's input gate, the statistics).
With the experts on this device, its tokens x k assignments are sorted by expert and the grouped FFN
(`jaxpar.parallel.expert_dispatch`) adds each result, gate-weighted, back into its token's row: no
[experts, tokens, d] buffer exists. With experts split over `expert`, the rows go to their experts'
ranks by `jax.lax.ragged_all_to_all` where the backend has it (`jaxpar.parallel.expert_exchange`: each rank
receives exactly its experts' rows); elsewhere (XLA:CPU has no `ragged-all-to-all`: "not supported by XLA:CPU
ThunkEmitter" on jax 0.10.2 and 0.12) by the capacity buffers' all-to-all, with each (group, expert)'s row count
sent beside it, so that the receiving device runs its experts on the rows it received, not on every slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.parallel import expert_dispatch, expert_exchange
from jaxpar.parallel.expert_routing import (
    MoEConfig, ROUTER_PARAMS, combine, dispatch, from_experts, gated, route_groups, to_experts,
)

EXPERT_KEYS = expert_dispatch.WEIGHTS + expert_dispatch.BIASES


def _split(p: dict) -> tuple[dict, dict]:
    """(the router's parameters, the experts')."""
    return {k: p[k] for k in ROUTER_PARAMS if k in p}, {k: p[k] for k in EXPERT_KEYS if k in p}


def _kernel(cfg: MoEConfig, form: str, rows: int, grads: bool = False):
    """The grouped FFN `form` as fn(p, src, order, counts, weight), its activation and tile fixed; `grads`: its
    gradients instead, fn(p, src, order, counts, weight, ct_y) -> (ct_p, ct_src, ct_weight)."""
    tile = expert_dispatch.tile_rows(rows, cfg.n_experts)
    activation = _activation(cfg)
    if grads:
        return lambda p, src, order, counts, weight, ct: expert_dispatch.ffn_grads(
            form, p, src, order, counts, weight, activation, tile, ct)
    return lambda p, src, order, counts, weight: expert_dispatch.FORMS[form](p, src, order, counts, weight,
                                                                             activation, tile)


@functools.cache
def _activation(cfg: MoEConfig):
    """The experts' activation for `cfg`, one object per config (a custom_vjp's static argument)."""
    return functools.partial(gated, cfg=cfg)


def _sorted_tokens(router: dict, x: jax.Array, cfg: MoEConfig):
    """((this device's tokens [T, d] as the experts take them, their gates sorted by expert [T * k], stats),
    (the sorted assignments' token rows, rows per expert))."""
    groups, gate, routing, stats = route_groups(router, x, cfg, None)
    order, weight, counts = expert_dispatch.sorted_assignments(
        routing.expert.reshape(-1, cfg.top_k), gate.reshape(-1, cfg.top_k), cfg.n_experts)
    return (groups.reshape(-1, x.shape[-1]), weight, stats), (order, counts)


def _local(router: dict, p: dict, x: jax.Array, cfg: MoEConfig, form: str):
    """The layer with every expert on this device: (y [batch, seq, d], per-group stats)."""
    (tokens, weight, stats), (order, counts) = _sorted_tokens(router, x, cfg)
    y = _kernel(cfg, form, order.shape[0])(p, tokens, order, counts, weight)
    return y.reshape(x.shape), stats


def _local_backward(router: dict, p: dict, x: jax.Array, ct_y, ct_stats, cfg: MoEConfig, form: str):
    """`_local`'s gradients: the routing's by JAX, the experts' by the kernel's own backward."""
    (tokens, weight, _), route_vjp, (order, counts) = jax.vjp(
        lambda r, t: _sorted_tokens(r, t, cfg), router, x, has_aux=True)
    ct_params, ct_tokens, ct_weight = _kernel(cfg, form, order.shape[0], grads=True)(
        p, tokens, order, counts, weight, ct_y.reshape(tokens.shape))
    ct_router, ct_x = route_vjp((ct_tokens, ct_weight, ct_stats))
    return {**ct_params, **ct_router}, ct_x


def _received_rows(counts: jax.Array, capacity: int):
    """(order, per-expert counts) of the filled slots of received buffers [sources, local experts, capacity] whose
    (source, expert) holds counts[s, e] rows from slot 0: their flat indices, expert-major, the empty ones last."""
    sources, local = counts.shape
    index = jnp.arange(sources * local * capacity, dtype=jnp.int32).reshape(sources, local, capacity)
    filled = jnp.arange(capacity)[None, None, :] < counts[:, :, None]
    key = jnp.where(filled, jnp.arange(local)[None, :, None], local).transpose(1, 0, 2).reshape(-1)
    order = index.transpose(1, 0, 2).reshape(-1)[jnp.argsort(key, stable=True)]
    return order, jnp.sum(counts, axis=0).astype(jnp.int32)


def _exchange_counts(expert: jax.Array, n_experts: int, axis) -> jax.Array:
    """Rows each (group, expert) sends, [groups, E], exchanged as its slots are: [devices * groups, local E]."""
    flat = expert.reshape(expert.shape[0], -1)
    counts = jax.vmap(lambda e: jnp.zeros((n_experts,), jnp.int32).at[e].add(1))(flat)
    return jax.lax.all_to_all(counts, axis, split_axis=1, concat_axis=0, tiled=True)


def _routed(router, x, cfg):
    """Routing and the capacity buffers of the exchange: (gate, slots [G, E, C, d], stats), (slot, expert)."""
    capacity = cfg.group(x.shape[1])
    groups, gate, routing, stats = route_groups(router, x, cfg, capacity)
    slots = jax.vmap(lambda t, s: dispatch(t, s, cfg.n_experts, capacity))(groups, routing.slot)
    return (gate, slots, stats), (routing.slot, routing.expert)


def _exchanged_experts(p: dict, received: jax.Array, received_counts: jax.Array, cfg: MoEConfig, form: str):
    """The local experts on the filled rows of the received buffers [S, E_local, C, d] -> the same shape."""
    order, counts = _received_rows(received_counts, received.shape[2])
    flat = received.reshape(-1, received.shape[-1])
    return _kernel(cfg, form, order.shape[0])(p, flat, order, counts, None).reshape(received.shape)


def _ragged_forward(router: dict, p: dict, x: jax.Array, cfg: MoEConfig, axis, form: str):
    """The layer with experts split over `axis` and the ragged exchange: (y, stats, (received, returned))."""
    (tokens, weight, stats), (order, counts) = _sorted_tokens(router, x, cfg)
    ranks = cfg.n_experts // p["expert_gate"].shape[0]
    ex = expert_exchange.exchange(counts, axis, ranks)
    received = expert_exchange.to_ranks(tokens[order], ex, axis, ranks)
    r_order, r_counts = expert_exchange.received_rows(ex, received.shape[0])
    out = _kernel(cfg, form, r_order.shape[0])(p, received, r_order, r_counts, None)
    returned = expert_exchange.from_ranks(out, ex, axis, order.shape[0])
    y = jnp.zeros(tokens.shape, jnp.float32).at[order].add(
        returned.astype(jnp.float32) * weight.astype(jnp.float32)[:, None])
    return y.astype(x.dtype).reshape(x.shape), stats, (received, returned)


def _ragged_backward(router: dict, p: dict, x: jax.Array, saved, ct_y, ct_stats, cfg: MoEConfig, axis, form: str):
    """`_ragged_forward`'s gradients: the combine's by hand, the exchanges reversed, the experts' by the kernel's
    own backward, the routing's by JAX."""
    received, returned = saved
    (tokens, weight, _), route_vjp, (order, counts) = jax.vjp(
        lambda r, t: _sorted_tokens(r, t, cfg), router, x, has_aux=True)
    ranks = cfg.n_experts // p["expert_gate"].shape[0]
    ex = expert_exchange.exchange(counts, axis, ranks)
    ct_rows = ct_y.reshape(tokens.shape)[order].astype(jnp.float32)
    ct_weight = jnp.sum(ct_rows * returned.astype(jnp.float32), axis=-1).astype(weight.dtype)
    ct_out = expert_exchange.to_ranks((ct_rows * weight.astype(jnp.float32)[:, None]).astype(returned.dtype), ex,
                                      axis, ranks)
    r_order, r_counts = expert_exchange.received_rows(ex, received.shape[0])
    ct_params, ct_received, _ = _kernel(cfg, form, r_order.shape[0], grads=True)(
        p, received, r_order, r_counts, None, ct_out)
    ct_sorted = expert_exchange.from_ranks(ct_received, ex, axis, order.shape[0])
    ct_tokens = jnp.zeros(tokens.shape, jnp.float32).at[order].add(ct_sorted.astype(jnp.float32))
    ct_router, ct_x = route_vjp((ct_tokens.astype(tokens.dtype), ct_weight, ct_stats))
    return {**ct_params, **ct_router}, ct_x


def forward(p: dict, x: jax.Array, cfg: MoEConfig, axis, form: str, exchange: str = "buffers"):
    """One device's layer: (y, per-group stats, what the backward pass keeps)."""
    router, params = _split(p)
    if not axis:
        y, stats = _local(router, params, x, cfg, form)
        return y, stats, ()
    if exchange == "ragged":
        return _ragged_forward(router, params, x, cfg, axis, form)
    (gate, slots, stats), (slot, expert) = _routed(router, x, cfg)
    received, received_counts = to_experts(slots, axis), _exchange_counts(expert, cfg.n_experts, axis)
    returned = from_experts(_exchanged_experts(params, received, received_counts, cfg, form), axis)
    y = jax.vmap(combine)(returned, gate, slot).reshape(x.shape)
    return y, stats, (received, received_counts, returned)


def backward(p: dict, x: jax.Array, saved, ct_y, ct_stats, cfg: MoEConfig, axis, form: str,
             exchange: str = "buffers"):
    """One device's gradients. Without an exchange, JAX's of the local layer (the kernel's own backward recomputes
    each tile); with one, two all-to-alls as the buffered layer's (or the ragged ones reversed), the experts
    differentiated on their rows."""
    router, params = _split(p)
    if not axis:
        return _local_backward(router, params, x, ct_y, ct_stats, cfg, form)
    if exchange == "ragged":
        return _ragged_backward(router, params, x, saved, ct_y, ct_stats, cfg, axis, form)
    received, received_counts, returned = saved
    (gate, _, _), route_vjp, (slot, _) = jax.vjp(lambda r, t: _routed(r, t, cfg), router, x, has_aux=True)
    _, combine_vjp = jax.vjp(lambda out, g: jax.vmap(combine)(out, g, slot), returned, gate)
    ct_returned, ct_gate = combine_vjp(ct_y.reshape(*gate.shape[:2], -1))
    order, counts = _received_rows(received_counts, received.shape[2])
    flat = received.reshape(-1, received.shape[-1])
    ct_params, ct_received, _ = _kernel(cfg, form, order.shape[0], grads=True)(
        params, flat, order, counts, None, to_experts(ct_returned, axis).reshape(flat.shape))
    ct_received = ct_received.reshape(received.shape)
    ct_router, ct_x = route_vjp((ct_gate, from_experts(ct_received, axis), ct_stats))
    return {**ct_params, **ct_router}, ct_x

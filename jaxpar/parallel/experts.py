"""Mixture-of-experts feed-forward layer: top-k routing, capacity, and all-to-all over `expert`.

Routing and the capacity buffers are `jaxpar.parallel.expert_routing`'s; with
experts split over `expert`, one `all_to_all` sends each expert's slots to
the device that holds it and a second brings the results back. Dropless
layers run, by the plan's `moe_kernel` (`jaxpar.parallel.expert_kernels`),
either on buffers with room for the whole group in every expert (`buffered`)
or on the assignments sorted by expert (`jaxpar.parallel.expert_sorted`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.core import usage
from jaxpar.core.trace import active_plan
from jaxpar.parallel import expert_exchange, expert_kernels, expert_sorted
from jaxpar.parallel.constrain import rule_axes
from jaxpar.parallel.expert_routing import (  # noqa: F401  (re-exported: experts.X is the public face)
    ACTIVATIONS, BIAS_PARAMS, CORRECTION, EXPERT_PARAMS, ROUTER_PARAMS, SCORES, MoEConfig, Routing, combine,
    dispatch, expert_in, expert_out, from_experts, gated, route, route_and_dispatch, route_groups, to_experts,
)


def _forward(p: dict, x: jax.Array, cfg: MoEConfig, axis):
    """One device's layer: (y, per-group stats, what the backward pass keeps)."""
    (gate, slots, stats), slot = route_and_dispatch(_router(p), x, cfg)
    received = to_experts(slots, axis)
    hidden_gate, hidden_up = expert_in(p, received)
    returned = from_experts(expert_out(p, hidden_gate, hidden_up, cfg), axis)
    y = jax.vmap(combine)(returned, gate, slot).reshape(x.shape)
    return y, stats, (received, hidden_gate, hidden_up, returned)


def _backward(p: dict, x: jax.Array, saved, ct_y, ct_stats, cfg: MoEConfig, axis):
    """One device's gradients from the kept activations: two all-to-alls, no expert matmul recomputed.

    Only the cheap routing is recomputed; the forward halves of the `jax.vjp`
    calls below are unused and removed by XLA. Parameters replicated over a
    manual axis get their partial gradients summed over it by autodiff itself.
    """
    received, hidden_gate, hidden_up, returned = saved
    (gate, _, _), route_vjp, slot = jax.vjp(
        lambda r, t: route_and_dispatch(r, t, cfg), _router(p), x, has_aux=True
    )
    _, combine_vjp = jax.vjp(lambda out, g: jax.vmap(combine)(out, g, slot), returned, gate)
    ct_returned, ct_gate = combine_vjp(ct_y.reshape(*gate.shape[:2], -1))
    _, out_vjp = jax.vjp(lambda p, g, u: expert_out(p, g, u, cfg), p, hidden_gate, hidden_up)
    ct_p_out, ct_gate_hidden, ct_up_hidden = out_vjp(to_experts(ct_returned, axis))
    _, in_vjp = jax.vjp(expert_in, p, received)
    ct_p_in, ct_received = in_vjp((ct_gate_hidden, ct_up_hidden))
    ct_router, ct_x = route_vjp((ct_gate, from_experts(ct_received, axis), ct_stats))
    ct_p = jax.tree.map(jnp.add, ct_p_in, ct_p_out)
    for name, ct in ct_router.items():
        ct_p[name] = ct_p[name] + ct
    return ct_p, ct_x


def _router(p: dict) -> dict:
    return {k: p[k] for k in ROUTER_PARAMS if k in p}


def moe_ffn(p: dict, x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MoE feed-forward layer on x [batch, seq, d_model] -> (y, this layer's losses and metrics).

    p: router [d, E]; expert_gate, expert_up [E, d, f]; expert_down [E, f, d]; the biases of BIAS_PARAMS if any.
    Under a plan the forward and the backward pass each run in one
    `jax.shard_map`, manual over the batch axes (those a caller's shard_map has
    not made manual already), so routing is local to each device's groups and
    the only token traffic is two all-to-alls over the experts' axes each way
    (and, for a sorted kernel, the row counts beside the first).
    Other axes (tensor) stay automatic. A dropless layer runs in the plan's `moe_kernel`
    (`jaxpar.parallel.expert_kernels`).
    """
    p = {k: p[k] for k in EXPERT_PARAMS + BIAS_PARAMS + (CORRECTION,) if k in p}
    mesh = jax.sharding.get_abstract_mesh()
    outer = tuple(a for a in mesh.manual_axes if mesh.shape[a] > 1)  # a caller's shard_map (the step's)
    manual_width = [a for a in rule_axes("expert_mlp") if a in outer]
    if manual_width:
        raise ValueError(
            f"the MoE layer splits its experts' hidden width over {', '.join(manual_width)} by sharding annotations, "
            f"but under tensor_form='explicit' the step runs the model once per {manual_width[0]} rank, where "
            "those would be partial sums; train MoE models with tensor_form='annotation' (the same Megatron "
            "layout, collectives placed by XLA)"
        )
    expert_axes = rule_axes("experts")
    if expert_axes:
        usage.mark(usage.EXPERTS)
    check_expert_layout(cfg, p, rule_axes("batch"), expert_axes, outer)
    batch_axes = tuple(a for a in rule_axes("batch") if a not in outer)
    axis = expert_axes[0] if len(expert_axes) == 1 else expert_axes
    kernel = expert_kernels.chosen(cfg.dropless)
    if kernel == "buffered":
        forward = functools.partial(_forward, cfg=cfg, axis=axis)
        backward = functools.partial(_backward, cfg=cfg, axis=axis)
    else:
        exchange = expert_exchange.chosen(active_plan(), axis) if axis and active_plan() is not None else "buffers"
        forward = functools.partial(expert_sorted.forward, cfg=cfg, axis=axis, form=kernel, exchange=exchange)
        backward = functools.partial(expert_sorted.backward, cfg=cfg, axis=axis, form=kernel, exchange=exchange)
    if batch_axes:
        tokens = P(batch_axes)
        experts = P(tuple(a for a in expert_axes if a not in outer) or None)
        specs = {k: P() if k in ROUTER_PARAMS else experts for k in p}
        forward = _untracked_shard_map(forward, (specs, tokens), (tokens, tokens, tokens), batch_axes, outer)
        backward = jax.shard_map(backward, in_specs=(specs, tokens, tokens, tokens, tokens),
                                 out_specs=(specs, tokens), axis_names=set(batch_axes))
    y, stats = _with_backward(forward, backward)(*_varying((p, x), outer))
    return y, layer_statistics(stats, cfg)


def _untracked_shard_map(fn, in_specs, out_specs, axes, outer):
    """The forward pass in a shard_map that does not track replication (check_vma=False).

    It is never differentiated (`_backward` is), and under a caller's manual
    axes jax 0.10 mislabels what a layer scan hoists out of a tracked one.
    Its results are typed as varying over the caller's manual axes, as they are.
    """
    mapped = jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes), check_vma=False)
    if not outer:
        return mapped
    return lambda *args: jax.tree.map(lambda v: jax.lax.pcast(v, outer, to="varying"), mapped(*args))


def _varying(tree, axes):
    """Every leaf typed as varying over the manual `axes`: a zero that varies is added.

    Autodiff then sums the gradients of leaves that were invariant there, so
    the written-out backward pass can treat every input alike.
    """
    if not axes:
        return tree
    zero = jax.lax.pcast(jnp.zeros((), jnp.int32), axes, to="varying")
    return jax.tree.map(lambda v: v + zero.astype(v.dtype), tree)


def _with_backward(forward, backward):
    """`forward(p, x) -> (y, stats, saved)` as a differentiable `(p, x) -> (y, stats)` with `backward`."""

    @jax.custom_vjp
    def layer(p, x):
        y, stats, _ = forward(p, x)
        return y, stats

    def layer_forward(p, x):
        y, stats, saved = forward(p, x)
        return (y, stats), (p, x, saved)

    def layer_backward(residuals, cotangents):
        p, x, saved = residuals
        return backward(p, x, saved, *cotangents)

    layer.defvjp(layer_forward, layer_backward)
    return layer


def check_expert_layout(cfg: MoEConfig, p: dict, batch_axes, expert_axes, manual) -> None:
    """Experts must split evenly over their axes, and the tokens over those axes too."""
    if set(expert_axes) - set(batch_axes):
        raise ValueError(
            f"experts are sharded over {expert_axes} but the batch only over {batch_axes}: "
            "the all-to-all needs the tokens split over the experts' axes as well"
        )
    shape = jax.sharding.get_abstract_mesh().shape if expert_axes else {}
    ways = math.prod(shape[a] for a in expert_axes)
    if cfg.n_experts % ways:
        sizes = ", ".join(f"{a}={shape[a]}" for a in expert_axes)
        raise ValueError(f"n_experts={cfg.n_experts} does not divide by the expert mesh axes {sizes} (product {ways})")
    held = cfg.n_experts // math.prod(shape[a] for a in expert_axes if a in manual)
    if p["expert_gate"].shape[0] != held:
        raise ValueError(f"expert weights hold {p['expert_gate'].shape[0]} experts here, the config implies {held}")


def layer_statistics(stats: dict[str, jax.Array], cfg: MoEConfig) -> dict[str, jax.Array]:
    """One layer's losses and metrics from its per-group statistics (means over all groups)."""
    out = {
        "load_balance_loss": cfg.load_balance_coef * jnp.mean(stats["balance"]),
        "dropped_fraction": jnp.mean(stats["dropped"]),
        "expert_share": jnp.mean(stats["load"], axis=0),
    }
    if cfg.router_z_coef:
        out["router_z_loss"] = cfg.router_z_coef * jnp.mean(stats["z"])
    return out


LOSS_TERMS = ("load_balance_loss", "router_z_loss")
# statistics a model keeps per MoE layer, [layers, ...] (the layers' sum of rows that are zero but for their own)
PER_LAYER = ("expert_load",)


def aux_loss(sums: dict[str, jax.Array]) -> jax.Array:
    """The routers' auxiliary loss from statistics summed over the MoE layers: the sum of the loss terms.

    Linear in the sums, so a pipeline stage back-propagates its own layers' part (jaxpar.pipeline.executor.Stages).
    """
    return sum((sums[k] for k in LOSS_TERMS if k in sums), jnp.zeros((), jnp.float32))


def summarize(sums: dict[str, jax.Array], layers: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Auxiliary loss and metrics from statistics summed over `layers` MoE layers: loss terms summed, the rest averaged."""
    return aux_loss(sums), {k: v if k in LOSS_TERMS + PER_LAYER else v / layers for k, v in sums.items()}


def per_layer_rows(share: jax.Array) -> jax.Array:
    """Each layer's expert shares [layers, E] as [layers, layers, E], layer l's row l alone non-zero: summed over the
    layers, as every layer statistic is (`jaxpar.pipeline.stages.Stages.run_layers`), they give back [layers, E]."""
    return jnp.eye(share.shape[0], dtype=share.dtype)[:, :, None] * share[None, :, :]


def rebalanced(correction: jax.Array, share: jax.Array, gamma: float, assignments: int) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balance: correction [layers, E] + gamma * sign(mean_e load - load_e).

    `share` [layers, E]: each expert's share of a layer's `assignments` (the step's tokens x top_k), made whole counts
    again so that an expert exactly at the mean stays put on every plan (sign 0), whatever each plan's rounding.
    """
    load = jnp.round(share.astype(jnp.float32) * assignments)
    direction = jnp.sign(jnp.sum(load, axis=-1, keepdims=True) - load.shape[-1] * load)
    return (correction.astype(jnp.float32) + jnp.float32(gamma) * direction).astype(correction.dtype)

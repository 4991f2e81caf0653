"""Mixture-of-experts feed-forward layer: top-k routing, capacity, and all-to-all over `expert`.

Tokens are routed in groups whose size the config fixes (by default one
sequence), never the mesh: an expert takes at most `capacity` assignments per
group, first choices before second choices and earlier tokens first, and the
rest skip the layer through the residual. So the same tokens are dropped on any
mesh. Each group is laid out as a dense [experts, capacity, d_model] buffer;
with experts split over `expert`, one `all_to_all` sends each expert's slots to
the device that holds it and a second brings the results back.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.core import usage
from jaxpar.parallel import bits
from jaxpar.parallel.constrain import constrain, rule_axes
from jaxpar.parallel.matmul import weight_einsum


ACTIVATIONS = ("silu", "clamped")
SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routing of one MoE layer.

    capacity_factor: slots per expert and group = ceil(top_k * group_size / n_experts * factor).
    dropless: room for the whole group in every expert: nothing is dropped, and the
        all-to-alls carry what a capacity factor of n_experts / top_k would.
    group_size: tokens over which capacity is counted; must divide the sequence (None: one sequence).
    load_balance_coef: alpha of Switch's loss alpha * E * sum_i f_i P_i.
    router_z_coef: weight of ST-MoE's router z-loss mean(logsumexp(logits)^2); 0 turns it off.
    sigmoid_input_gate: Llama 4's routing (top-1): the sigmoid of the chosen logit scales the expert's input, and
        its output joins unscaled.
    activation: the experts' gate, "silu" (SwiGLU: silu(gate) * up) or "clamped" (gpt-oss: gate clamped above
        and up on both sides at swiglu_limit, then (up + 1) * gate * sigmoid(swiglu_alpha * gate)).
    The router's and the experts' biases (gpt-oss) act where the layer's parameters hold them (`BIAS_PARAMS`).
    score: "softmax" over the experts, or "sigmoid" of each logit (DeepSeek-V3: the gates are the chosen sigmoids,
        renormalised to sum to one under `normalize`, times `routed_scale`; a layer's `router_correction` [E], where
        it holds one, is added to the sigmoids for choosing only). n_groups, topk_groups: group-limited routing
        (DeepSeek-V3): the experts in n_groups equal groups, each scored by the sum of its two best, and a token
        chooses among the topk_groups best groups' experts only.
    """

    n_experts: int
    top_k: int = 2
    capacity_factor: float = 1.25
    dropless: bool = False
    group_size: int | None = None
    load_balance_coef: float = 1e-2
    router_z_coef: float = 0.0
    sigmoid_input_gate: bool = False
    activation: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    score: str = "softmax"
    normalize: bool = True
    routed_scale: float = 1.0
    n_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"the router's score must be one of {SCORES}, got {self.score!r}")
        if self.score == "softmax" and (not self.normalize or self.routed_scale != 1.0):
            raise ValueError(f"normalize={self.normalize}, routed_scale={self.routed_scale}: the softmax router "
                             "renormalises for top_k > 1 and scales by 1; these act with score='sigmoid'")
        if self.n_groups < 1 or self.n_experts % self.n_groups or not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(f"n_groups={self.n_groups} must divide n_experts={self.n_experts}, and topk_groups="
                             f"{self.topk_groups} be between 1 and n_groups")
        if self.n_groups > 1 and self.top_k > self.topk_groups * self.n_experts // self.n_groups:
            raise ValueError(f"top_k={self.top_k} is more than the {self.topk_groups} chosen groups of "
                             f"{self.n_experts // self.n_groups} experts hold")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"the experts' activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not self.swiglu_limit > 0 or not self.swiglu_alpha > 0:
            raise ValueError(f"swiglu_limit={self.swiglu_limit} and swiglu_alpha={self.swiglu_alpha} must be > 0")
        if self.n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 tokens (or None for one sequence), got {self.group_size}")
        if self.load_balance_coef < 0 or self.router_z_coef < 0:
            raise ValueError(
                f"load_balance_coef={self.load_balance_coef} and router_z_coef={self.router_z_coef} must be >= 0"
            )
        if self.sigmoid_input_gate and self.top_k != 1:
            raise ValueError(f"sigmoid_input_gate scales a token's one expert input (Llama 4): top_k must be 1, "
                             f"got {self.top_k}")

    def group(self, seq_len: int) -> int:
        """Tokens per routing group for sequences of `seq_len` tokens."""
        group = seq_len if self.group_size is None else self.group_size
        if seq_len % group:
            raise ValueError(f"routing group_size={group} must divide the sequence length {seq_len}")
        return group

    def capacity(self, group: int) -> int:
        """Slots per expert in a group of `group` tokens (an expert never gets more than `group`)."""
        if self.dropless:
            return group
        wanted = self.top_k * group * self.capacity_factor / self.n_experts
        return max(1, min(group, math.ceil(wanted - 1e-9)))


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where the top_k choices of each token of a group go: all arrays [tokens, top_k]."""

    expert: jax.Array
    gate: jax.Array
    slot: jax.Array  # expert * capacity + position; n_experts * capacity (out of range) if dropped


jax.tree_util.register_dataclass(Routing, data_fields=["expert", "gate", "slot"], meta_fields=[])


def _group_limited(choice: jax.Array, cfg: MoEConfig) -> jax.Array:
    """`choice` [tokens, E] with the experts outside each token's topk_groups best groups at -inf (a group's score:
    the sum of its two best experts' choice scores, as DeepSeek-V3's)."""
    tokens, n_experts = choice.shape
    grouped = choice.reshape(tokens, cfg.n_groups, n_experts // cfg.n_groups)
    group_score = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)
    chosen = jax.lax.top_k(group_score, cfg.topk_groups)[1]
    keep = jnp.sum(jax.nn.one_hot(chosen, cfg.n_groups, dtype=jnp.int32), axis=1) > 0
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(tokens, n_experts)


def _sigmoid_gates(logits: jax.Array, cfg: MoEConfig, correction):
    """(per-token weights over the experts for the balance statistic, chosen experts, their gates): DeepSeek-V3's
    sigmoid routing, the correction added for choosing only."""
    scores = jax.nn.sigmoid(logits)
    choice = scores if correction is None else scores + correction.astype(scores.dtype)
    if cfg.n_groups > 1:
        choice = _group_limited(choice, cfg)
    expert = jax.lax.top_k(choice, cfg.top_k)[1]
    gate = jnp.take_along_axis(scores, expert, axis=-1)
    if cfg.normalize:
        gate = gate / (jnp.sum(gate, axis=-1, keepdims=True) + 1e-20)
    return scores / jnp.sum(scores, axis=-1, keepdims=True), expert, gate * jnp.float32(cfg.routed_scale)


def route(logits: jax.Array, cfg: MoEConfig, capacity: int, correction: jax.Array | None = None
          ) -> tuple[Routing, dict[str, jax.Array]]:
    """Top-k routing of one group from fp32 router logits [tokens, n_experts], and its statistics.

    k = 1 keeps the chosen probability as the gate (Switch); k > 1 renormalises
    the k probabilities to sum to one (GShard, Mixtral). Assignments are ranked
    choice-major, so a second choice never displaces a first choice. score="sigmoid": DeepSeek-V3's gates
    (`MoEConfig.score`), with `correction` [E] (its e_score_correction_bias) added for choosing.
    """
    tokens, n_experts = logits.shape
    if cfg.score == "sigmoid":
        probs, expert, gate = _sigmoid_gates(logits, cfg, correction)
    else:
        probs = jax.nn.softmax(logits, axis=-1)
        top_probs, expert = jax.lax.top_k(probs, cfg.top_k)
        gate = top_probs if cfg.top_k == 1 else top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    if cfg.sigmoid_input_gate:
        gate = jax.nn.sigmoid(jnp.take_along_axis(logits, expert, axis=-1))
    chosen = jax.nn.one_hot(expert.T.reshape(-1), n_experts, dtype=jnp.int32)  # [top_k * tokens, E]
    position = jnp.sum((jnp.cumsum(chosen, axis=0) - 1) * chosen, axis=-1).reshape(cfg.top_k, tokens).T
    kept = position < capacity
    slot = jnp.where(kept, expert * capacity + position, n_experts * capacity)
    load = jnp.mean(chosen.astype(jnp.float32), axis=0)  # f_i: share of assignments per expert
    stats = {
        "balance": n_experts * jnp.sum(load * jnp.mean(probs, axis=0)),
        "z": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "dropped": 1.0 - jnp.mean(kept.astype(jnp.float32)),
        "load": load,
    }
    return Routing(expert, gate, slot), stats


def dispatch(x: jax.Array, slot: jax.Array, n_experts: int, capacity: int) -> jax.Array:
    """Copy each kept token of a group [tokens, d] into its expert's slot: [n_experts, capacity, d]."""
    tokens, top_k = slot.shape
    owner = jnp.full((n_experts * capacity,), tokens, jnp.int32)
    owner = owner.at[slot.reshape(-1)].set(jnp.repeat(jnp.arange(tokens), top_k), mode="drop")
    padded = jnp.concatenate([x, jnp.zeros((1, x.shape[-1]), x.dtype)])
    return padded[owner].reshape(n_experts, capacity, x.shape[-1])


def combine(expert_out: jax.Array, gate: jax.Array, slot: jax.Array) -> jax.Array:
    """Gate-weighted sum of each token's expert outputs [n_experts, capacity, d] -> [tokens, d]; drops give 0."""
    d = expert_out.shape[-1]
    padded = jnp.concatenate([expert_out.reshape(-1, d), jnp.zeros((1, d), expert_out.dtype)])
    picked = padded[slot]  # [tokens, top_k, d]
    return jnp.sum(gate[..., None] * picked.astype(jnp.float32), axis=1).astype(expert_out.dtype)


EXPERT_PARAMS = ("router", "expert_gate", "expert_up", "expert_down")
# optional biases (gpt-oss): router_bias [E]; expert_gate_bias, expert_up_bias [E, f]; expert_down_bias [E, d]
BIAS_PARAMS = ("router_bias", "expert_gate_bias", "expert_up_bias", "expert_down_bias")
# DeepSeek-V3's e_score_correction_bias [E]: added to the sigmoid scores for choosing only, so it gets no gradient
CORRECTION = "router_correction"
ROUTER_PARAMS = ("router", "router_bias", CORRECTION)
_HIDDEN = (None, "experts", None, "expert_mlp")


def _plus_bias(p: dict, name: str, out: jax.Array) -> jax.Array:
    """out [groups, experts, capacity, width] plus each expert's bias p[name] [experts, width], where p has it."""
    return out if name not in p else out + p[name][None, :, None, :].astype(out.dtype)


def expert_in(p: dict, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gate and up projections of each expert's slots [groups, experts, capacity, d], split over `expert_mlp`."""
    gate = constrain(_plus_bias(p, "expert_gate_bias", weight_einsum("gecd,edf->gecf", slots, p["expert_gate"])),
                     _HIDDEN)
    up = constrain(_plus_bias(p, "expert_up_bias", weight_einsum("gecd,edf->gecf", slots, p["expert_up"])), _HIDDEN)
    return gate, up


def gated(gate: jax.Array, up: jax.Array, cfg: MoEConfig) -> jax.Array:
    """The experts' hidden activation: SwiGLU, or gpt-oss's clamped form (`MoEConfig.activation`)."""
    if cfg.activation == "silu":
        return jax.nn.silu(gate) * up
    limit = jnp.asarray(cfg.swiglu_limit, gate.dtype)
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * jnp.asarray(cfg.swiglu_alpha, gate.dtype)))


def expert_out(p: dict, gate: jax.Array, up: jax.Array, cfg: MoEConfig) -> jax.Array:
    """The gated activation and the row-parallel down projection: [groups, experts, capacity, d]."""
    out = _plus_bias(p, "expert_down_bias", weight_einsum("gecf,efd->gecd", gated(gate, up, cfg), p["expert_down"]))
    return constrain(out, (None, "experts", None, "embed"))


def route_and_dispatch(router: jax.Array | dict, x: jax.Array, cfg: MoEConfig):
    """Route one device's tokens [batch, seq, d] in groups: ((gates, slots [groups, E, C, d], stats), slot indices).

    `router`: the layer's router weight [d, E], or a dict of it and, where the layer has one, its bias [E]
    (`ROUTER_PARAMS`: gpt-oss)."""
    weight, bias = (router["router"], router.get("router_bias")) if isinstance(router, dict) else (router, None)
    correction = router.get(CORRECTION) if isinstance(router, dict) else None
    batch, seq, d = x.shape
    group = cfg.group(seq)
    capacity = cfg.capacity(group)
    groups = x.reshape(batch * seq // group, group, d)
    logits = weight_einsum("gtd,de->gte", groups.astype(jnp.float32), weight.astype(jnp.float32))
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    routing, stats = jax.vmap(lambda z: route(z, cfg, capacity, correction))(logits)
    gate = routing.gate
    if cfg.sigmoid_input_gate:  # the one gate [groups, tokens, 1] scales the input, the output joins as it is
        groups, gate = (groups * gate).astype(groups.dtype), jnp.ones_like(gate)
    slots = jax.vmap(lambda t, s: dispatch(t, s, cfg.n_experts, capacity))(groups, routing.slot)
    return (gate, slots, stats), routing.slot


def _to_experts(slots: jax.Array, axis) -> jax.Array:
    """The dispatch all-to-all: [groups, E, C, d] -> [devices * groups, local experts, C, d]."""
    return bits.all_to_all(slots, axis, split_axis=1, concat_axis=0) if axis else slots


def _from_experts(out: jax.Array, axis) -> jax.Array:
    """The combine all-to-all, the inverse of `_to_experts`."""
    return bits.all_to_all(out, axis, split_axis=0, concat_axis=1) if axis else out


def _forward(p: dict, x: jax.Array, cfg: MoEConfig, axis):
    """One device's layer: (y, per-group stats, what the backward pass keeps)."""
    (gate, slots, stats), slot = route_and_dispatch(_router(p), x, cfg)
    received = _to_experts(slots, axis)
    hidden_gate, hidden_up = expert_in(p, received)
    returned = _from_experts(expert_out(p, hidden_gate, hidden_up, cfg), axis)
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
    ct_p_out, ct_gate_hidden, ct_up_hidden = out_vjp(_to_experts(ct_returned, axis))
    _, in_vjp = jax.vjp(expert_in, p, received)
    ct_p_in, ct_received = in_vjp((ct_gate_hidden, ct_up_hidden))
    ct_router, ct_x = route_vjp((ct_gate, _from_experts(ct_received, axis), ct_stats))
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
    the only token traffic is two all-to-alls over the experts' axes each way.
    Other axes (tensor) stay automatic.
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
    forward = functools.partial(_forward, cfg=cfg, axis=axis)
    backward = functools.partial(_backward, cfg=cfg, axis=axis)
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

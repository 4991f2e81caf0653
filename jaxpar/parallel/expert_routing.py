"""Top-k routing of an MoE layer's tokens in groups, and the capacity buffers it fills.

Tokens are routed in groups whose size the config fixes (by default one
sequence), never the mesh: an expert takes at most `capacity` assignments per
group, first choices before second choices and earlier tokens first, and the
rest skip the layer through the residual. So the same tokens are dropped on any
mesh. Each group is laid out as a dense [experts, capacity, d_model] buffer
(the buffered layer); `jaxpar.parallel.expert_sorted` runs dropless routing on
the assignments sorted by expert instead.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxpar.parallel import bits
from jaxpar.parallel.constrain import constrain
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
    slot: jax.Array | None  # expert * capacity + position; n_experts * capacity (out of range) if dropped


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


def route(logits: jax.Array, cfg: MoEConfig, capacity: int | None, correction: jax.Array | None = None
          ) -> tuple[Routing, dict[str, jax.Array]]:
    """Top-k routing of one group from fp32 router logits [tokens, n_experts], and its statistics.

    k = 1 keeps the chosen probability as the gate (Switch); k > 1 renormalises
    the k probabilities to sum to one (GShard, Mixtral). Assignments are ranked
    choice-major, so a second choice never displaces a first choice. score="sigmoid": DeepSeek-V3's gates
    (`MoEConfig.score`), with `correction` [E] (its e_score_correction_bias) added for choosing.
    capacity None: every assignment kept and no slot given (the sorted dropless kernels').
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
    if capacity is None:  # dropless on sorted rows: no slots, nothing dropped, no [k * tokens, E] ranks
        counts = jnp.zeros((n_experts,), jnp.float32).at[expert.reshape(-1)].add(1.0)
        load, kept, slot = counts / (tokens * cfg.top_k), expert >= 0, None  # (kept varies as the tokens do)
    else:
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


def route_groups(router: jax.Array | dict, x: jax.Array, cfg: MoEConfig, capacity: int | None):
    """Route one device's tokens [batch, seq, d] in groups: (the groups [G, group, d] the experts take, their
    gates, the routing [G, group, k] and the per-group stats).

    `router`: the layer's router weight [d, E], or a dict of it and, where the layer has one, its bias [E]
    (`ROUTER_PARAMS`: gpt-oss) and correction. Under `sigmoid_input_gate` the one gate scales the input and the
    gates returned are ones: the output joins as it is."""
    weight, bias = (router["router"], router.get("router_bias")) if isinstance(router, dict) else (router, None)
    correction = router.get(CORRECTION) if isinstance(router, dict) else None
    batch, seq, d = x.shape
    group = cfg.group(seq)
    groups = x.reshape(batch * seq // group, group, d)
    logits = weight_einsum("gtd,de->gte", groups.astype(jnp.float32), weight.astype(jnp.float32))
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    routing, stats = jax.vmap(lambda z: route(z, cfg, capacity, correction))(logits)
    gate = routing.gate
    if cfg.sigmoid_input_gate:
        groups, gate = (groups * gate).astype(groups.dtype), jnp.ones_like(gate)
    return groups, gate, routing, stats


def route_and_dispatch(router: jax.Array | dict, x: jax.Array, cfg: MoEConfig):
    """Route one device's tokens [batch, seq, d] in groups: ((gates, slots [groups, E, C, d], stats), slot indices)."""
    capacity = cfg.capacity(cfg.group(x.shape[1]))
    groups, gate, routing, stats = route_groups(router, x, cfg, capacity)
    slots = jax.vmap(lambda t, s: dispatch(t, s, cfg.n_experts, capacity))(groups, routing.slot)
    return (gate, slots, stats), routing.slot


def to_experts(slots: jax.Array, axis) -> jax.Array:
    """The dispatch all-to-all: [groups, E, C, d] -> [devices * groups, local experts, C, d]."""
    return bits.all_to_all(slots, axis, split_axis=1, concat_axis=0) if axis else slots


def from_experts(out: jax.Array, axis) -> jax.Array:
    """The combine all-to-all, the inverse of `to_experts`."""
    return bits.all_to_all(out, axis, split_axis=0, concat_axis=1) if axis else out



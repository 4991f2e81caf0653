"""Every collective of one step, per device and mesh axis, as (kind, bytes, calls), and the ring traffic they make.

What the compiled step runs, by jaxpar's own layers: data parallelism and ZeRO,
Megatron's tensor parallelism, the pipeline's permutes, HSDP's replicas,
context parallelism and the experts' all-to-alls. `jaxpar.planner.inspect.ring_traffic`
turns each into bytes sent: 2(n-1)/n S for an all-reduce, (n-1)/n S for a
gather, scatter or all-to-all, S for a permute.
"""

from __future__ import annotations

import dataclasses

from jaxpar.planner.devices import Device
from jaxpar.planner.inspect import ring_traffic
from jaxpar.planner.layout import (
    AXES,
    DTYPE_BYTES,
    Layout,
    Workload,
    local_seq,
    microbatch_sequences,
    remat_policy,
    sharded_lookup,
)
from jaxpar.planner.memory import Inventory, compute_bytes, inventory, state_bytes_per_param
from jaxpar.planner.model import Model, capacity
from jaxpar.planner.ticks import permutes, schedule_ticks, weight_ticks


@dataclasses.dataclass(frozen=True)
class Collective:
    """Calls of one collective kind over one mesh axis per step: `bytes` is the whole buffer of one call
    (buffers XLA reduces in one go, e.g. all gradients, are counted as one call)."""

    axis: str
    kind: str
    bytes: float
    calls: float
    why: str
    group: int | None = None  # devices per call when fewer than the axis's (a sub-group of it)

    def traffic(self, n: int) -> float:
        return self.calls * ring_traffic(self.kind, self.bytes, self.group or n)


@dataclasses.dataclass(frozen=True)
class Widths:
    """Bytes of one element as the collectives move it: parameters gathered, gradients summed, activations
    moved (`values`) and activations summed (`summed`)."""

    params: int
    grads: int
    values: int
    summed: int


def widths(layout: Layout, device: Device) -> Widths:
    """The element widths of `layout`'s collectives on `device`."""
    p_bytes, g_bytes, _ = state_bytes_per_param(layout.precision, layout.zero if layout.data > 1 else 0)
    if layout.zero >= 2:  # the layers gather their compute-dtype casts; autodiff reduce-scatters in that dtype
        p_bytes = g_bytes = compute_bytes(layout.precision)
    # A backend that widens low-precision collectives (XLA:CPU) sums them in fp32; the ones jaxpar writes
    # that only move data carry their 16-bit bits (jaxpar.parallel.bits), and those the compiler places are widened.
    wide = 4 if device.widens_low_precision else None
    act = DTYPE_BYTES[layout.precision] if layout.precision != "bf16-params" else 2
    return Widths(p_bytes, wide or g_bytes, act, wide or act)


def collectives(model: Model, layout: Layout, work: Workload, device: Device) -> list[Collective]:
    """Every collective of one step, per device: what the compiled step runs, by jaxpar's own layers."""
    # every parameter is gathered (a quantized base in its codes), only those that train have gradients to sum
    inv, tr, q = (inventory(model, layout.data, layout.tensor, layout.pipe, layout.expert, part)
                  for part in ("all", "trained", "quantized"))
    w = widths(layout, device)
    out: list[Collective] = []
    if layout.data > 1:
        out += data_collectives(model, layout, work, (inv, tr, q), w)
    if layout.tensor > 1:
        out += tensor_collectives(model, layout, work, device, w)
    if layout.pipe > 1:
        out += pipe_collectives(model, layout, work, tr, w)
    if layout.replica > 1:
        # HSDP: each gradient leaves the ZeRO group reduced to its data shard, then one all-reduce over replica
        out.append(Collective("replica", "all-reduce", tr.sharded * w.grads, 1,
                              "gradient shards summed over replicas"))
    if layout.context > 1:
        out += context_collectives(model, layout, work, tr.local * w.grads, w.values, w.summed)
    if layout.expert > 1 and model.n_experts:
        out += expert_collectives(model, layout, work, tr, w)
    return out


def data_collectives(model: Model, layout: Layout, work: Workload, parts: tuple[Inventory, Inventory, Inventory],
                     w: Widths) -> list[Collective]:
    """The gradients summed over data, or under ZeRO reduce-scattered into shards and the parameters gathered.

    `parts`: the inventories of all parameters, of those that train and of those held quantized (`inventory`).
    """
    inv, tr, _ = parts
    if layout.zero == 0:
        return [Collective("data", "all-reduce", tr.local * w.grads, 1, "gradients summed over data")]
    # local = split + whole and sharded = split / n + whole, where `whole` are the parameters ZeRO
    # cannot split over data (no dimension divides): their gradients keep an all-reduce
    unsharded = tr.local - _zero_split(tr, layout.data)
    out = zero_collectives(model, layout, work, parts, w)
    if unsharded > 0.5:
        out.append(Collective("data", "all-reduce", unsharded * w.grads, 1, "gradients ZeRO leaves whole"))
    if sharded_lookup(model, layout, work):
        out += lookup_collectives(model, layout, work, w)
    return out


def _zero_split(inv: Inventory, n: int) -> float:
    """Parameters per device that ZeRO splits over `n` data ranks (before the split)."""
    return (inv.local - inv.sharded) * n / (n - 1)


def _zero_parts(inv: Inventory, n: int) -> tuple[float, float]:
    """(outside the layer stack, in it) of what ZeRO splits over `n` data ranks."""
    split = _zero_split(inv, n)
    stacked = inv.stacked_local * split / inv.local if inv.local else 0.0
    return split - stacked, stacked


def zero_collectives(model: Model, layout: Layout, work: Workload, parts: tuple[Inventory, Inventory, Inventory],
                     w: Widths) -> list[Collective]:
    """ZeRO's reduce-scatter of the gradients and all-gather of the parameters over data.

    ZeRO-1 reduce-scatters the accumulated gradient and gathers the updated
    parameters once per step. ZeRO-2/3 gather inside the loss: the layers once
    per stage program run (per microbatch, per pipeline tick) and again for the
    backward pass under ZeRO-3 (a third time in ZB-H1's weight-backward slots,
    the only ones that reduce-scatter its gradients), the rest once (XLA hoists
    that gather out of the accumulation loop); autodiff reduce-scatters each
    gather's gradient. Only what trains has gradients, and ZeRO-1 gathers only
    what the update changed; ZeRO-2/3 gather a frozen base too (a quantized one
    in its codes' bytes).
    """
    inv, tr, q = parts
    n, runs = layout.data, layout.grad_accum * schedule_ticks(layout)
    # ZB-H1 makes (and reduce-scatters) the weight gradients in its W slots' ticks, and ZeRO-3 gathers there again
    weight_runs = layout.grad_accum * weight_ticks(layout)
    table = model.vocab * model.d_model if sharded_lookup(model, layout, work) and model.separate_head else 0.0
    # the table is used nowhere else: neither gathered nor reduce-scattered
    rest, layers = _zero_parts(tr, n)
    rest -= table if tr.local == inv.local else 0.0  # a LoRA run's table is frozen: it has no gradient
    scattered = rest * layout.grad_accum + layers * (weight_runs or runs) if layout.zero >= 2 else rest + layers
    if layout.zero == 1:
        gathered = rest + layers
    else:
        layer_runs = runs * (2 if layout.zero == 3 else 1) + (weight_runs if layout.zero == 3 else 0)
        (rest, layers), (_, quantized) = _zero_parts(inv, n), _zero_parts(q, n)
        gathered = rest - table + layers * layer_runs
        gathered -= (1 - model.quantized_bytes / w.params) * quantized * layer_runs
    return [Collective("data", "reduce-scatter", scattered * w.grads, 1, "gradients into ZeRO shards"),
            Collective("data", "all-gather", gathered * w.params, 1,
                       "ZeRO parameters gathered" + (" per layer" if layout.zero >= 2 else " after the update"))]


def lookup_collectives(model: Model, layout: Layout, work: Workload, w: Widths) -> list[Collective]:
    """The embedding looked up in each data rank's shard of the table (`sharded_lookup`): per embedding run,
    one per microbatch, under a pipeline one per tick."""
    b, s, d = microbatch_sequences(layout, work), local_seq(layout, work), model.d_model
    rows = b * layout.data * s * layout.grad_accum * (schedule_ticks(layout) if layout.pipe > 1 else 1)
    return [Collective("data", "all-gather", rows * (4 + d * w.values), 1,
                       "the data group's tokens, and its embedding rows' cotangents"),
            Collective("data", "reduce-scatter", rows * d * w.summed, 1,
                       "embedding rows looked up in each rank's shard, summed back to their ranks")]


def tensor_collectives(model: Model, layout: Layout, work: Workload, device: Device, w: Widths) -> list[Collective]:
    """Megatron's f/g: each block half ends in one all-reduce (SP: a reduce-scatter, and starts with an
    all-gather) forward, and one more in the backward pass. Full remat re-runs the forward in the backward
    pass, but only the attention half's all-reduce feeds anything the gradients need (SP: both halves'
    all-gathers). ZB-H1's W slots run the blocks' backward again, and full remat's recomputation: its dx chain
    feeds the earlier layers' weight gradients."""
    p = layout.pipe
    chunk = model.n_layers / (p * layout.virtual_stages)  # layers one tick runs
    ticks, replays = schedule_ticks(layout), weight_ticks(layout)
    full = layout.remat == "full"
    block = ticks * chunk * (4 + full)
    one = microbatch_sequences(layout, work) * local_seq(layout, work) * model.d_model  # elements
    if p == 1:
        embedded, head = one, one  # the vocab-parallel embedding's sum, the head input's gradient
    elif layout.schedule in ("1f1b", "zb-h1"):
        embedded, head = ticks * one, layout.microbatches * one / p  # embedding on every forward slot
    else:
        embedded, head = layout.microbatches * one, layout.microbatches * one / p  # all microbatches at once
    out = []
    # ZB-H1's W slots: the blocks' backward again, full remat's recomputation too (SP: both halves' gathers)
    again = {kind: replays * chunk * (2 + full * (2 if kind == "all-gather" else 1)) for kind in ("all-gather", "g")}
    if not layout.sequence_parallel:
        # a capacity-routed MoE layer's experts sum over tensor on their buffer, not on the tokens: forward their
        # output, backward their input gradient; XLA:CPU sums the gate's and the up's apart and, under ZeRO-3,
        # the recomputed output again (`sums_apart`)
        moe_runs = ticks * chunk * model.moe_layers / model.n_layers if capacity_buffered(model, layout) else 0.0
        moe_sums = 3 + (layout.zero == 3) if device.sums_apart else 2
        for what, count, elements in (("Megatron f/g, per block half", block + again["g"] - 2 * moe_runs, one),
                                      ("MoE experts' f/g, on the capacity buffer", moe_sums * moe_runs,
                                       expert_slots(model, layout, work) * model.d_model if moe_runs else 0),
                                      ("vocab-parallel embedding and head", 1, embedded + head)):
            if count:
                out.append(Collective("tensor", "all-reduce", elements * w.summed, count * layout.grad_accum, what))
    else:
        # the blocks and the head as their form places them; the embedding is written out in both forms
        # (jaxpar.parallel.tensor_explicit.embedding): its rows reduce-scattered, its cotangent's bits gathered
        annotated = layout.tensor_form == "annotation"
        gather = w.summed if annotated else w.values
        leave = "all-reduce" if annotated and device.scatter_as_all_reduce else "reduce-scatter"
        out += [Collective("tensor", "all-gather", one * gather, (block + again["all-gather"]) * layout.grad_accum,
                           "Megatron f, per block half"),
                Collective("tensor", leave, one * w.summed, (block + again["g"]) * layout.grad_accum,
                           "Megatron g, per block half"),
                Collective("tensor", "all-gather", head * gather, layout.grad_accum, "the head's input"),
                Collective("tensor", leave, head * w.summed, layout.grad_accum, "the head input's gradient"),
                Collective("tensor", "all-gather", embedded * w.values, layout.grad_accum, "the embedding's cotangent"),
                Collective("tensor", "reduce-scatter", embedded * w.summed, layout.grad_accum,
                           "the vocab-parallel embedding's rows")]
    if layout.tensor > model.n_kv_heads:  # weight gradients: in ZB-H1's W slots
        out += replicated_kv_collectives(model, layout, w, (replays or ticks) * chunk * layout.grad_accum)
    return out


def replicated_kv_collectives(model: Model, layout: Layout, w: Widths, layer_runs: float) -> list[Collective]:
    """The gradients of key/value heads replicated over tensor/n_kv_heads ranks (jaxpar.parallel.tensor.
    kv_heads_for_ranks), per layer run backward, as each form compiles.

    explicit: a rank's pick of its head transposes to a sum over every tensor rank of K's and V's whole
    [embed, kv_heads, head_dim] gradients. annotation: the repeat's transpose sums each rank's one head
    over its replicas, and the heads are gathered over the other ranks once, for the whole layer stack."""
    t, kv = layout.tensor, model.n_kv_heads
    one_head = 2 * model.d_model * model.head_dim * w.grads  # K and V
    if layout.tensor_form == "explicit":
        return [Collective("tensor", "all-reduce", one_head * kv, layer_runs, "replicated K/V heads' gradients")]
    stack = model.n_layers / layout.pipe
    return [Collective("tensor", "all-reduce", one_head, layer_runs, "replicated K/V heads' gradients", t // kv),
            Collective("tensor", "all-gather", one_head * kv * stack, 1, "replicated K/V heads' gradients", kv)]


def pipe_collectives(model: Model, layout: Layout, work: Workload, inv: Inventory, w: Widths) -> list[Collective]:
    """The pipeline's permutes between stages, the loss head's exchange of positions, and the gradients of
    the parameters every stage holds."""
    b, s = microbatch_sequences(layout, work), local_seq(layout, work)
    whole = b * s * model.d_model * w.values
    one = whole / (layout.tensor if layout.sequence_parallel else 1)
    m = layout.microbatches
    if layout.schedule in ("1f1b", "zb-h1"):
        # one send per tick of a scan with forward slots and one per tick of a scan with backward slots
        # (`ticks.permutes`); the head runs on the m ticks where the last stage's forward holds a microbatch, on
        # the whole activation (sequence parallelism splits what the stages send, not what the head exchanges)
        out = [Collective("pipe", "collective-permute", one, permutes(layout) * layout.grad_accum,
                          "activations forward and cotangents backward, one per tick"),
               Collective("pipe", "all-to-all", whole, m * layout.grad_accum, "the loss head's positions"),
               Collective("pipe", "all-gather", whole, m * layout.grad_accum, "the head's input gradients")]
    else:
        out = [Collective("pipe", "collective-permute", one, 2 * schedule_ticks(layout) * layout.grad_accum,
                          "activations forward and cotangents backward, one per tick"),
               Collective("pipe", "all-to-all", one * m, 2 * layout.grad_accum,
                          "the loss head's positions and their gradients")]
    out.append(Collective("pipe", "all-reduce", inv.replicated_over_pipe * max(w.grads, 4), 1,
                          "embedding and head gradients summed over stages (fp32)"))
    return out


def context_collectives(model: Model, layout: Layout, work: Workload, grad_bytes: float, value_bytes: int,
                        summed_value_bytes: int) -> list[Collective]:
    """Context parallelism's collectives: K/V of every layer's attention, and the gradients summed over context.

    The all-gather form gathers K and V (one call each) in the forward and
    again where the backward recomputes it, then reduce-scatters their
    gradients; the ring form passes each K and V block C - 1 hops in the
    forward, the recomputation and the backward (the gradients travel with
    the blocks): 3 (C - 1) blocks per array either way. The parameters are
    whole on every context rank, so their gradients are all-reduced over it.
    An element of K or V takes `value_bytes` where it is moved and
    `summed_value_bytes` where its gradients are summed.
    """
    c, kv = layout.context, model.n_kv_heads / layout.tensor
    b, s = microbatch_sequences(layout, work), work.seq_len
    runs = model.n_layers * layout.grad_accum * layout.microbatches / layout.pipe  # layer runs per device
    elements = b * s * kv * model.attention_matmul_width / 2  # one of K, V (their mean: MLA's differ) over the sequence
    whole = elements * value_bytes
    out = [Collective("context", "all-reduce", grad_bytes, 1, "gradients summed over context")]
    if layout.context_form == "ring":
        out.append(Collective("context", "collective-permute", whole / c, 2 * 3 * (c - 1) * runs,
                              "K and V blocks around the ring: forward, recomputation, gradients"))
    else:
        out.append(Collective("context", "all-gather", whole, 2 * 2 * runs, "K and V gathered: forward, recomputation"))
        out.append(Collective("context", "reduce-scatter", elements * summed_value_bytes, 2 * runs,
                              "K and V gradients back to their ranks"))
    return out


def expert_slots(model: Model, layout: Layout, work: Workload) -> int:
    """Capacity-buffer rows of one device's tokens in one MoE layer: experts x capacity x routing groups."""
    s = local_seq(layout, work)
    group = model.group_size or s
    return model.n_experts * capacity(model, group) * (microbatch_sequences(layout, work) * s // group)


def capacity_buffered(model: Model, layout: Layout) -> bool:
    """Whether the MoE layers run on capacity buffers (capacity routing, or dropless in the buffered form)."""
    return bool(model.n_experts) and (not model.dropless or layout.moe_kernel == "buffered")


def expert_collectives(model: Model, layout: Layout, work: Workload, inv: Inventory, w: Widths) -> list[Collective]:
    """The tokens' all-to-alls to their experts and back, and the gradients of what every expert rank holds."""
    b, s, d, t = microbatch_sequences(layout, work), local_seq(layout, work), model.d_model, layout.tensor
    buffer = expert_slots(model, layout, work) * d * w.values  # every tensor rank sends whole rows (SP: gathered)
    # to the experts and back, forward and backward; a remat policy re-runs the forward pair (an
    # all-to-all is no matmul, so no policy saves its output)
    calls = (4 + 2 * (remat_policy(layout, model) != "none")) * model.moe_layers / layout.pipe * layout.grad_accum
    if layout.moe_exchange == "ragged":  # each token's k rows, exactly (jaxpar.parallel.expert_exchange)
        routed = b * s * model.top_k * d * w.values
        out = [Collective("expert", "ragged-all-to-all", routed, calls, "each token's k rows to their experts and back")]
    else:
        out = [Collective("expert", "all-to-all", buffer, calls, "tokens to their experts and back")]
    # Parameters every expert rank holds sum their gradients over expert, except, without tensor parallelism,
    # the embedding table when XLA gathers its cotangents and token ids over expert instead, cheaper than
    # summing the table; a table split over tensor is looked up shard by shard and its gradient always summed.
    rows = layout.expert * b * s * layout.grad_accum
    table = model.vocab * d if t == 1 and rows <= model.vocab else 0.0
    out.append(Collective("expert", "all-reduce", (inv.dense_replicated_over_expert - table) * w.grads, 1,
                          "gradients of parameters every expert rank holds"))
    if table:
        out.append(Collective("expert", "all-gather", rows * (d * w.summed + 4), 1,  # placed by the compiler
                              "the embedding's cotangents and token ids"))
    return out


def traffic_per_axis(colls: list[Collective], layout: Layout) -> dict[str, float]:
    out = {a: 0.0 for a in AXES}
    for c in colls:
        out[c.axis] += c.traffic(layout.shape[c.axis])
    return out

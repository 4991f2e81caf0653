"""Activations a step keeps for its backward pass (Korthikanti et al. 2022), per device.

Per layer and token, the values a block keeps by remat policy, divided by t
where tensor parallelism (and sequence parallelism) splits them, times the
layers a stage holds and the microbatches a pipeline schedule keeps in flight.
"""

from __future__ import annotations

from jaxpar.planner.layout import Layout, Workload, local_seq, microbatch_sequences, remat_policy
from jaxpar.planner.model import Model, capacity
from jaxpar.planner.ticks import cotangent_rows, explicit_backward, in_flight, schedule_ticks


def activation_values_per_token(model: Model, layout: Layout, seq: int) -> float:
    """Values one block keeps per token for its backward pass (Korthikanti et al. 2022, Table 2 adapted).

    none: a Llama block without dropout keeps the two norms' inputs and outputs
    (4 d), Q, K, V (h hd + 2 kv hd; MLA: h hd + kv (hd + vd) and its latents, whole), the softmax probabilities (h s, only where
    the plain softmax keeps them: `scores_kept`), the attention output entering
    the projection (h hd; MLA: h vd) and the MLP's gate, up and their product (3 f). dots
    (ZeRO-3's policy): every matmul output: Q, K, V, the scores and the
    attention output (the plain softmax's: flash attention's are no matmul's,
    and recomputed), both projections' outputs (2 d) and gate and up.
    selective: the weight matmuls' outputs: Q, K, V, gate, up and the two
    row-parallel outputs (2 d). full: the block input (d). Tensor parallelism
    splits all but the d-sized values by t; sequence parallelism those too.

    Where the block has no collective inside (no tensor split, no ZeRO-2/3
    gather), XLA fuses each projection into its consumer, so selective remat
    leaves only gate and up (2 f) to keep; where it has one, the collectives
    cut those fusions, and without remat the block also keeps the
    intermediates a fused block recomputes: the scores twice (before and after
    the softmax), 6 d-sized and 8 f-sized values (fused gate|up, silu, its
    product, ...).
    """
    t = layout.tensor
    d, hd, h, kv, f = model.d_model, model.head_dim, model.n_heads, model.n_kv_heads, model.d_ff
    vd, latent = model.value_dim, model.latent_width  # MLA: v's head, and its compressions (never split over t)
    d_split = t if layout.sequence_parallel else 1
    qkv = (h * hd + kv * hd + kv * vd) / t + latent
    policy = remat_policy(layout, model)
    split = t > 1 or (layout.zero >= 2 and layout.data > 1)
    if policy == "full":
        return d / d_split
    if policy == "selective":
        return qkv + 2 * f / t + 2 * d / d_split if split else 2 * f
    keys = scores_kept(layout, seq)
    if policy == "none":
        qk = qk_norm_values(model, layout)
        if split:
            return 2 * h * keys / t + 6 * d / d_split + 8 * f / t + qkv + (h + kv) * hd / t + qk
        return 4 * d / d_split + qkv + h * keys / t + h * vd / t + 3 * f / t + qk
    if policy == "dots":
        attention_out = h * vd / t if keys else 0  # flash attention's output is no matmul's: recomputed
        return qkv + h * keys / t + attention_out + 2 * f / t + 2 * d / d_split
    raise ValueError(f"unknown remat policy {policy!r}")


def qk_norm_values(model: Model, layout: Layout) -> float:
    """Values a block without remat keeps per token for Qwen3's q/k norms: each norm's input and output in fp32,
    2 (h + kv) hd / t of them, counted in the compute dtype's values (two per fp32 value in 16 bits). Read in
    XLA:GPU's buffer assignment of Qwen3-8B (f32[layers, b, s, heads, hd] twice for q and twice for k)."""
    if not any(leaf.path.endswith("q_norm") for leaf in model.leaves):
        return 0.0
    wide = 1 if layout.precision == "fp32" else 2
    return wide * 2 * (model.n_heads + model.n_kv_heads) * model.head_dim / layout.tensor


def sorted_dropless(model: Model, layout: Layout) -> bool:
    """Whether a MoE layer runs on its assignments sorted by expert (moe_kernel tiled or ragged, or auto on a
    dropless model: jaxpar.parallel.expert_kernels), whose memory follows the routed rows: on one device's rows,
    or over `expert` with the ragged exchange. Over `expert` without it (XLA:CPU) the exchange is the capacity
    buffers' (`moe_mlp_values_per_token`), with the tiled kernel on the rows received."""
    sorted_kernel = layout.moe_kernel in ("tiled", "ragged") or (layout.moe_kernel == "auto" and model.dropless)
    return bool(model.n_experts) and sorted_kernel and (layout.expert == 1 or layout.moe_exchange == "ragged")


def exchanged_rows(model: Model, layout: Layout) -> float:
    """Rows per token a rank's ragged receiving buffer holds (jaxpar.parallel.expert_exchange: sized for every
    source's rows, expert x k), 0 without the ragged exchange."""
    return layout.expert * model.top_k if layout.expert > 1 and sorted_dropless(model, layout) else 0.0


def moe_mlp_values_per_token(model: Model, layout: Layout, seq: int) -> float:
    """What a MoE layer keeps per token in place of the dense MLP. Buffered (capacity routing): the router's
    logits (E), and per capacity slot (E C / group of them per token) the dispatched input and the combined
    output (2 d) and the expert's gate, up and product (3 fe, split by t). Dropless over `expert` with the
    capacity exchange: the slots received and returned (2 d each), the tiled kernel recomputing each tile's
    hidden values. Sorted dropless: the layer's input (d), its backward recomputing the routing and every tile;
    over `expert` with the ragged exchange also the receiving buffer (expert x k rows) and the k rows returned."""
    if sorted_dropless(model, layout):
        return model.d_model * (1 + exchanged_rows(model, layout) + (model.top_k if layout.expert > 1 else 0))
    group = model.group_size or seq
    slots = model.n_experts * capacity(model, group) / group
    hidden = 0 if model.dropless else 3 * model.expert_d_ff / layout.tensor
    return model.n_experts + slots * (2 * model.d_model + hidden)


def sorted_moe_workspace(model: Model, layout: Layout, tokens: float, value_bytes: int = 4) -> float:
    """Bytes one sorted dropless layer's backward keeps alive at once for `tokens` tokens: the router's fp32
    logits, probabilities and their cotangent (3 E), the fp32 output accumulator, the rows' cotangent and the
    tokens' (3 d), and per routed row (k of them per token) its token index, gate, sort key and gate cotangent
    (4 x 4 bytes); each tile's own work is a tile's rows, negligible. With the ragged exchange, the receiving
    buffer's cotangent as sent and the kernel's fp32 one (2 x 4 bytes per value of expert x k rows)."""
    if not sorted_dropless(model, layout):
        return exchange_buffers_workspace(model, layout, tokens, value_bytes)
    exchanged = 8 * exchanged_rows(model, layout) * model.d_model
    return tokens * (4 * (3 * model.n_experts + 3 * model.d_model) + 16 * model.top_k + exchanged)


def exchange_buffers_workspace(model: Model, layout: Layout, tokens: float, value_bytes: int = 4) -> float:
    """Bytes a dropless layer exchanging capacity buffers over `expert` (XLA:CPU: no ragged exchange) keeps alive
    in its backward under full remat, which recomputes them: the slots, the buffers received and returned and the
    returned cotangent as exchanged (`value_bytes` each), and the kernel's fp32 cotangent: five [E, group, d]
    buffers per group (a scaled Qwen3-MoE at data=2,expert=4: 1.063 of the compiled temp on jax 0.10, 0.96 on
    0.12)."""
    if not (model.n_experts and model.dropless and layout.expert > 1 and layout.remat == "full"):
        return 0.0
    return tokens * (4 * value_bytes + 4) * model.n_experts * model.d_model


def scores_kept(layout: Layout, seq: int) -> int:
    """Keys per query whose scores a block keeps for its backward pass: the whole sequence for the plain
    masked softmax (attention=xla, outside context parallelism); none for flash attention and the fused
    kernels, which save q, k, v, the output and a log-sum-exp and recompute the rest
    (jaxpar.parallel.attention_flash), nor under context parallelism, whose forms use it."""
    return seq if layout.context == 1 and layout.attention == "xla" else 0


def block_values_per_token(model: Model, layout: Layout, seq: int) -> float:
    """Values one block keeps per token for the backward pass, by where it runs.

    A plain layer scan keeps what its remat policy saves (`activation_values_per_token`;
    a MoE block its experts' slots in place of the MLP). Without remat, a pipeline
    keeps more: the block's values as its stage VJP's residuals (per token
    2 h s + 6 f + 2 (h + kv) hd split by t, and 6 d), masked by each tick's
    validity in GPipe's differentiated tick scan, in the residual ring's rows
    under 1F1B and interleaved (the rows' shapes in the compiled step); tensor
    parallelism adds 3 d whole (Megatron's f/g around each half).
    """
    t, d_split = layout.tensor, layout.tensor if layout.sequence_parallel else 1
    h, kv, hd, f, d = model.n_heads, model.n_kv_heads, model.head_dim, model.d_ff, model.d_model
    if layout.pipe > 1 and remat_policy(layout, model) == "none":
        keys = scores_kept(layout, seq)
        return ((2 * h * keys + 6 * f + 2 * (h + kv) * hd) / t + 6 * d / d_split + (3 * d if t > 1 else 0)
                + qk_norm_values(model, layout))
    values = activation_values_per_token(model, layout, seq)
    policy = remat_policy(layout, model)
    if model.n_experts and policy != "full":
        share = model.moe_layers / model.n_layers
        # the dense MLP's values the MoE layer replaces: under `dots` gate, up and the down projection's output
        # (qwen3-30b-a3b on h100x8 at data=8 zero=3 remat=none: q, k, v, the attention projection's output and the
        # MoE layer's input and output per token and layer, in XLA:GPU's stacked residuals; the capacity-routed
        # layer keeps its calibration against the CPU grid)
        mlp = 2 * f / t + d / d_split if policy == "dots" and sorted_dropless(model, layout) else 3 * f / t
        values += share * (moe_mlp_values_per_token(model, layout, seq) - mlp)
    return values


def activation_bytes(model: Model, layout: Layout, work: Workload, value_bytes: int, stage_weights: float) -> float:
    """Activations kept per device: values per token x tokens of a microbatch x layers of a chunk x the
    chunk-sized sets alive at once (one; every tick's under GPipe; the residual ring's rows under 1F1B,
    interleaved and zb-h1). GPipe's tick scan also keeps each tick's stage weights, a per-tick
    value to autodiff; the ring keeps ZeRO-2's gathered weights with each microbatch's residuals. ZB-H1's
    cotangents kept from B to W that find no free ring row (m < 2p - 2) take activation-sized rows of their own."""
    b, s = microbatch_sequences(layout, work), local_seq(layout, work)
    layers = model.n_layers / (layout.pipe * layout.virtual_stages)
    sets = in_flight(layout)
    kept = value_bytes * b * s * block_values_per_token(model, layout, work.seq_len) * layers * sets
    if layout.pipe > 1 and not explicit_backward(layout):
        kept += stage_weights * schedule_ticks(layout)
    elif layout.pipe > 1 and layout.zero == 2 and layout.data > 1:
        kept += stage_weights / layout.virtual_stages * sets  # ZeRO-2's gathered weights are residuals of each microbatch's VJP
    d_split = layout.tensor if layout.sequence_parallel else 1
    return kept + cotangent_rows(layout) * value_bytes * b * s * model.d_model / d_split

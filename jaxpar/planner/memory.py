"""Bytes per device of one step: model state (ZeRO), activations, the transients XLA keeps, host offload.

Model state (ZeRO, Rajbhandari et al. 2020, Table 1): P bytes per parameter
held, G per gradient, K per optimizer entry; ZeRO-1 divides the K bytes by the
data size N, ZeRO-2 also the G bytes, ZeRO-3 also the P bytes. Tensor, pipe and
expert sharding divide each parameter by the mesh axes the plan's rules give it
(exactly as `jaxpar.core.rules` and `jaxpar.parallel.zero` shard it).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.core import rules as rules_lib
from jaxpar.parallel import loss_chunks
from jaxpar.planner.activations import activation_bytes, sorted_dropless, sorted_moe_workspace
from jaxpar.planner.devices import Device
from jaxpar.planner.layout import Layout, Workload, local_seq, microbatch_sequences, remat_policy, sharded_lookup
from jaxpar.planner.model import Leaf, Model


def state_bytes_per_param(precision: str, zero: int = 0) -> tuple[int, int, int]:
    """(P, G, K): bytes per parameter of the parameters, gradients and AdamW state (ZeRO's notation).

    fp32: 4 + 4 + 8 (two moments). bf16/fp16 at ZeRO-0/2/3 hold fp32 parameters,
    compute with 2-byte casts and sum the gradients in 2 bytes (jaxpar.train.precision):
    4 + 2 + 8. Under ZeRO-1 they hold the paper's 2 + 2 + 12: the 2-byte
    parameters whole, the fp32 master sharded with the moments. bf16-params: 2 + 2 + 4.
    """
    if zero == 1 and precision in ("bf16", "fp16"):
        return 2, 2, 12
    return {"fp32": (4, 4, 8), "bf16": (4, 2, 8), "fp16": (4, 2, 8), "bf16-params": (2, 2, 4)}[precision]


def compute_bytes(precision: str) -> int:
    """Bytes of a parameter as the model computes with it: what ZeRO-2/3 gathers and reduce-scatters."""
    return 4 if precision == "fp32" else 2


def zero_table(psi: float, n: int, k: int = 12, p: int = 2, g: int = 2) -> dict[str, float]:
    """ZeRO paper Table 1: bytes per device of baseline, P_os, P_os+g and P_os+g+p for Psi parameters on n devices."""
    return {
        "baseline": (p + g + k) * psi,
        "os": (p + g) * psi + k * psi / n,
        "os+g": p * psi + (g + k) * psi / n,
        "os+g+p": (p + g + k) * psi / n,
    }


def _shard_ways(leaf: Leaf, shape: dict[str, int], over_data: bool) -> int:
    """Devices one copy of `leaf` is split over: its rules' mesh axes, and `data` under ZeRO (jaxpar.parallel.zero)."""
    from jaxpar.core import zero_layout as zero_lib
    spec = rules_lib.resolve_spec(leaf.names, leaf.shape, shape, rules_lib.DEFAULT_RULES, path=leaf.path)
    ways = math.prod(shape[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e))
    if over_data and zero_lib.choose_dim(leaf.names, leaf.shape, spec, shape["data"]) is not None:
        ways *= shape["data"]
    return ways


@dataclasses.dataclass(frozen=True)
class Inventory:
    """Parameters per device under one mesh: whole (tensor/pipe/expert sharding only) and under ZeRO."""

    local: float  # parameters per device before ZeRO
    sharded: float  # parameters per device with ZeRO's `data` dimension added
    stacked_local: float  # the layer-stacked part of `local`
    stacked_sharded: float
    replicated_over_pipe: float  # parameters every pipe stage holds (embedding, head, final norm)
    dense_replicated_over_expert: float  # `local` parameters not split over expert (their gradients sum over it)


PARTS = {"all": lambda leaf: True, "trained": lambda leaf: leaf.trained, "quantized": lambda leaf: leaf.held_bytes > 0,
         "frozen": lambda leaf: not leaf.trained and leaf.held_bytes == 0, "adapted": lambda leaf: leaf.adapted}


@functools.lru_cache(maxsize=4096)
def inventory(model: Model, data: int, tensor: int, pipe: int, expert: int, part: str = "all") -> Inventory:
    """The parameters of `part`: all, those that train (not a LoRA base), those held quantized (QLoRA), those
    frozen and not quantized, or the weights LoRA adapts."""
    shape = {"data": data, "tensor": tensor, "pipe": pipe, "expert": expert}
    local = sharded = st_local = st_sharded = rep_pipe = rep_expert = 0.0
    for leaf in filter(PARTS[part], model.leaves):
        whole, split = leaf.size / _shard_ways(leaf, shape, False), leaf.size / _shard_ways(leaf, shape, True)
        local, sharded = local + whole, sharded + split
        if leaf.stacked:
            st_local, st_sharded = st_local + whole, st_sharded + split
        else:
            rep_pipe += whole
        if "experts" not in leaf.names:
            rep_expert += whole
    return Inventory(local, sharded, st_local, st_sharded, rep_pipe, rep_expert)


def memory_breakdown(model: Model, layout: Layout, work: Workload, device: Device) -> dict[str, float]:
    """Bytes per device: params, grads, optimizer (ZeRO Table 1 on the local shard), activations, temp.

    `arguments` is what the compiled step takes in (parameters, optimizer state,
    batch); `temp` what it allocates while running (gradients, activations,
    gathered parameters, the update's workspace). total = arguments + temp.
    """
    inv, tr, q, fz = (inventory(model, layout.data, layout.tensor, layout.pipe, layout.expert, part)
                      for part in ("all", "trained", "quantized", "frozen"))
    P, G, K = state_bytes_per_param(layout.precision, layout.zero if layout.data > 1 else 0)
    if device.low_precision_in_fp32:
        G = 4  # the backend differentiates low-precision matmuls in fp32: gradients (and activations) are fp32
    n = layout.data
    z = layout.zero if n > 1 else 0
    # ZeRO-2 keeps parameters sharded between steps but gathers every layer's for the whole step (held, as in
    # the paper's P_os+g); ZeRO-3 holds its shard and gathers one layer at a time.
    C = compute_bytes(layout.precision)  # what ZeRO-2/3 gather: the compute-dtype casts
    qb = model.quantized_bytes  # a quantized base (QLoRA) is held, and under ZeRO gathered, in its codes' bytes
    # a frozen base (LoRA) is held in the compute dtype: it has no master to update (jaxpar.train.precision)
    at_rest = _held(P, C, inv.sharded, fz.sharded, q.sharded, qb) if z >= 2 else \
        _held(P, C, inv.local, fz.local, q.local, qb)
    params = (_held(P, C, inv.sharded, fz.sharded, q.sharded, qb) if z == 3
              else _held(C, C, inv.local, fz.local, q.local, qb) if z == 2 else at_rest)
    # Gradients and optimizer state: of what trains (a LoRA run: the adapters alone)
    optimizer = K * (tr.sharded if z >= 1 else tr.local)
    # ZeRO's gradient: the whole local gradient under ZeRO-0/1 (reduced once per step), the data shard under
    # ZeRO-2/3, which reduce-scatter each layer's gradient as soon as the backward pass produces it.
    grads = G * (tr.sharded if z >= 2 else tr.local)
    depth = max(model.scan_depth / layout.pipe, 1)
    per_layer, trained_per_layer = inv.stacked_local / depth, tr.stacked_local / depth
    outside, trained_outside = inv.local - inv.stacked_local, tr.local - tr.stacked_local  # gathered whole (ZeRO-2/3)
    if sharded_lookup(model, layout, work) and model.separate_head:
        outside -= model.vocab * model.d_model  # except a table looked up in its shards (its gradient stays one)
        trained_outside = min(trained_outside, outside)
    transient = G * (trained_per_layer + trained_outside) if z >= 2 else 0.0  # one layer's whole gradient
    if (layout.grad_accum > 1 or layout.pipe > 1) and G < 4:
        transient += 4 * (tr.sharded if z >= 2 else tr.local)  # fp32 accumulators of low-precision gradients
    if device.widens_low_precision and G < 4 and z <= 1 and n > 1:
        transient += (4 - G) * tr.local  # the fp32 copy of the whole gradient a widened reduction takes
    if device.low_precision_in_fp32 and C < 4 and z <= 1:
        transient += 4 * fz.stacked_local  # it widens a 2-byte frozen layer stack to fp32 whole, before the scan
    act_bytes = 4 if layout.precision == "fp32" or device.low_precision_in_fp32 else 2
    b, s = microbatch_sequences(layout, work), work.seq_len
    stage_weights = C * inv.stacked_local if z == 2 else P * inv.stacked_local - (P - C) * fz.stacked_local
    activations = activation_bytes(model, layout, work, act_bytes, stage_weights)
    activations += gpu_ring_extra(model, layout, work, device, act_bytes, inv.stacked_local, P, C)
    gathered = 0.0  # ZeRO-3: one layer's parameters, or the ones outside the layer stack, gathered at a time
    if z == 3:  # (the embedding and head are used before and after the layer scan, never beside a layer's)
        layer = C * per_layer - (C - qb) * q.stacked_local / depth  # a quantized base is gathered as its codes
        gathered = max(layer, C * (outside - (inv.sharded - inv.stacked_sharded)))
    # LoRA: each layer's backward forms its folded weights W + A B again (compute dtype) and their cotangent
    adapted = inventory(model, layout.data, layout.tensor, layout.pipe, layout.expert, "adapted").stacked_local
    transient += (C + G) * adapted / depth
    transient += tiled_expert_gradient(model, layout, inv)
    workspace = transient + layer_workspace(model, layout, work, act_bytes) + update_workspace(tr, layout, z, G, P)
    batch = 2 * 4 * b * s * layout.grad_accum * layout.microbatches
    host = offloaded_bytes(layout, z, at_rest, optimizer)
    arguments = at_rest + optimizer + batch - host
    temp = (params - at_rest) + grads + activations + gathered + workspace
    if host:  # copied in for the update, into the space the activations held (dead by then)
        temp = max(temp, (params - at_rest) + grads + gathered + transient + update_workspace(tr, layout, z, G, P) + host)
    return {
        "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
        "temp": gathered + workspace, "batch": batch, "arguments": arguments, "temp_total": temp,
        "host": host, "total": arguments + temp,
    }


def tiled_expert_gradient(model: Model, layout: Layout, inv: Inventory) -> float:
    """The tiled dropless kernel's backward sums one MoE layer's expert-weight gradients in fp32, whole (its
    gathered weights') before casting them (jaxpar.parallel.expert_dispatch: f32[experts, d, fe] three times in
    XLA:GPU's buffers for qwen3-30b-a3b), beside the cast counted with one layer's gradient. Not under full remat:
    there it lies where the recomputed layer's workspace (`layer_workspace`) does (the 4- and 48-layer compiles at
    data=8 zero=3: within 3% without it, 7 to 25% over with it)."""
    if not sorted_dropless(model, layout) or layout.moe_kernel == "ragged" or not model.moe_layers \
            or remat_policy(layout, model) == "full":
        return 0.0
    return 4 * (inv.local - inv.dense_replicated_over_expert) / max(model.moe_layers / layout.pipe, 1)


def _held(per_value: float, frozen_value: float, count: float, frozen: float, quantized: float,
          quantized_bytes: float) -> float:
    """Bytes of `count` parameters at `per_value` bytes, the `frozen` ones among them (not quantized) at
    `frozen_value`, the `quantized` ones at `quantized_bytes`."""
    return per_value * count - (per_value - frozen_value) * frozen - (per_value - quantized_bytes) * quantized


def offloaded_bytes(layout: Layout, zero: int, params_at_rest: float, optimizer: float) -> float:
    """Bytes per device `--offload optimizer` keeps in host memory between steps: the optimizer state, and
    the fp32 parameters under bf16/fp16 (held once, they are the master; jaxpar.parallel.offload) except under
    ZeRO-1, whose master is part of the optimizer state and whose 2-byte parameters stay."""
    if layout.offload == "none":
        return 0.0
    master = layout.precision in ("bf16", "fp16") and zero != 1
    return optimizer + (params_at_rest if master else 0.0)


def layer_workspace(model: Model, layout: Layout, work: Workload, value_bytes: int = 4) -> float:
    """The largest transients of one microbatch: the fp32 logits and their gradient over the vocabulary
    shard (on each stage's share of positions under a pipeline; of one chunk of tokens when the loss is
    computed in chunks, jaxpar.parallel.loss_chunks), one layer's attention scores when
    the backward pass recomputes them with remat, and a sorted dropless MoE layer's routing and row buffers. Context-parallel attention recomputes its scores too,
    but one layer's share of them is not alive at the step's peak (compiled temp at context 2 and 4)."""
    b, s = microbatch_sequences(layout, work), local_seq(layout, work)
    columns = model.vocab // layout.tensor
    logits = 2 * 4 * b * s * columns / layout.pipe / loss_chunks.pick(int(b), int(s), columns)
    recomputed = remat_policy(layout, model) in ("full", "selective") and layout.context == 1
    experts = sorted_moe_workspace(model, layout, b * s, value_bytes)  # one dropless MoE layer's backward
    return logits + (4 * b * model.n_heads / layout.tensor * s * s if recomputed else 0.0) + experts


def update_workspace(inv: Inventory, layout: Layout, z: int, grad_bytes: int, param_bytes: int = 4) -> float:
    """Parameter-sized transients besides ZeRO's own gradient (Table 1's G) that XLA keeps alive at once.

    The update keeps two gradient-sized buffers of the shard it runs on (the
    clipped gradient and the update itself): the whole local gradient under
    ZeRO-0, the data shard under ZeRO-1/2/3. ZeRO-1 then all-gathers the
    updated parameters into one whole buffer, which XLA places where those two
    were. A pipeline returns its gradients from a custom VJP that scales them
    by the incoming cotangent: one more copy.

    Accumulating microbatches under ZeRO-2/3 without a pipeline, each layer
    scan sums its stacked parameters' gradients into their fp32 accumulators
    in place (jaxpar.parallel.grad_sink): a microbatch's gradient is a buffer
    of its own, in the held dtype (`param_bytes`), only for what no layer scan
    holds (embedding, head, final norm), and the summed gradient (Table 1's G,
    counted in `grads`) is cast from the accumulators inside the update's
    fusions, no buffer either; the update writes the donated state in place.
    (qwen3-30b-a3b on h100x8 at data=8 zero=3 grad_accum=128: temp 38.81 GB
    before the sums moved into the scan, 21.28 after, the accumulators
    15.27 of it.)
    """
    shard = inv.local if z == 0 else inv.sharded
    whole = 2 * grad_bytes * shard
    if z == 1:
        whole = max(whole, grad_bytes * inv.local)
    if z >= 2 and layout.grad_accum > 1 and layout.pipe == 1:
        accumulators = 4 * shard if grad_bytes < 4 else 0.0  # counted with the transients (memory_breakdown)
        outside = inv.sharded - inv.stacked_sharded
        whole = 4 * shard + param_bytes * outside - accumulators - grad_bytes * shard
    if layout.pipe > 1:
        whole += grad_bytes * (inv.sharded if z >= 2 else inv.local)
    return whole


def gpu_ring_extra(model: Model, layout: Layout, work: Workload, device: Device, act_bytes: int,
                   stacked_local: float, P: int, C: int) -> float:
    """What the residual ring (1F1B, interleaved, ZB-H1) keeps beyond its rows on a backend that multiplies
    16-bit operands as they are (GPU; XLA:GPU's buffer assignment, 1B at seq 4,096 and 8,192): one more
    chunk-sized set of activations, the current microbatch's values stacked by the layer scan
    ([1, layers, ...] buffers) beside the ring they are copied into, and with fp32 parameters computed in 16
    bits each row's compute-dtype weight casts (bf16[rows, layers, ...] of gate, up, down, q and o), residuals
    of each microbatch's VJP. XLA:CPU widens 16-bit operands and updates the ring in place: none of it there
    (its compiles fitted the rest); ZeRO-2's gathered weights are counted with the activations already."""
    from jaxpar.planner.activations import block_values_per_token
    from jaxpar.planner.ticks import explicit_backward, in_flight

    if layout.pipe == 1 or not explicit_backward(layout) or device.widens_low_precision:
        return 0.0
    layers = model.n_layers / (layout.pipe * layout.virtual_stages)
    one_set = (act_bytes * microbatch_sequences(layout, work) * local_seq(layout, work) * layers
               * block_values_per_token(model, layout, work.seq_len))
    casts = C * stacked_local / layout.virtual_stages * in_flight(layout) if C < P and layout.zero != 2 else 0.0
    return one_set + casts

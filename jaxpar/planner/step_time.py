"""FLOPs and seconds of a step: compute at a share of the device's peak, stretched by the bubble, and the
communication that is not hidden.

Model FLOPs are 6 N per token plus 12 L s (h hd) for attention, and the
recomputation on top (ZB-H1's weight-backward replays included). Tensor,
expert, context and pipe traffic sit on the critical path; data-parallel
traffic hides behind the backward pass where the ZeRO stage lets it overlap.
"""

from __future__ import annotations

import math

from jaxpar.planner.devices import Device
from jaxpar.planner.layout import AXES, Layout
from jaxpar.planner.model import Model
from jaxpar.planner.ticks import bubble


def flops_per_token(model: Model, seq: int) -> float:
    """Model FLOPs of one token's forward and backward: 6 N + 6 L s h (hd_qk + hd_v) (attention's two matmuls, x3;
    12 L s h hd where the value head is the query/key head)."""
    return 6 * model.flop_params + 6 * model.n_layers * seq * model.n_heads * model.attention_matmul_width


def recompute_flops_per_token(model: Model, layout: Layout, seq: int) -> float:
    """Extra FLOPs of recomputation: a whole forward (full) or the attention matmuls (selective).

    ZB-H1's W slot replays the stage's stored VJP for the weight gradients, so
    the layers' input-gradient chain (2 N of the layers and attention's
    backward, 4 L s h w) and the remat recomputation run twice per microbatch
    (jaxpar.pipeline.tick; compiled at data=4,pipe=2, m = 4, xla attention:
    zb-h1's matmul FLOPs exceed 1f1b's by exactly (m + p - 1) B slots' input
    gradients, the bubble ticks' slots included).
    """
    attention = 2 * model.n_layers * seq * model.n_heads * model.attention_matmul_width
    layers = 2 * (model.flop_params - model.vocab * model.d_model)
    extra = layers + attention if layout.remat == "full" else attention if layout.remat == "selective" else 0.0
    if layout.pipe > 1 and layout.schedule == "zb-h1":
        extra = 2 * extra + layers + 2 * attention
    return extra


def step_time(model, layout, work, device, hw_flops, traffic, memory) -> dict[str, float]:
    """Seconds per step: compute (stretched by the bubble), exposed communication, the optimizer update."""
    compute = hw_flops / (device.flops(layout.precision) * device.efficiency)
    compute /= 1 - bubble(layout)
    comm = {a: traffic[a] / axis_bandwidth(a, layout, device) for a in AXES}
    # Data-parallel traffic overlaps the backward pass: all of it under ZeRO-2/3 (layer by layer), only the
    # last microbatch's under ZeRO-0/1 (the gradients are reduced once per step, after accumulation).
    backward = compute * 2 / 3
    hidden = backward if layout.zero >= 2 else backward / (layout.grad_accum * max(layout.microbatches, 1))
    exposed_data = max(0.0, comm["data"] + comm["replica"] - hidden)
    update = 3 * memory["optimizer"] / device.hbm_bandwidth + 2 * memory["host"] / device.host_bandwidth
    total = compute + comm["tensor"] + comm["expert"] + comm["pipe"] + comm["context"] + exposed_data + update
    return {"compute": compute, **{f"comm_{a}": c for a, c in comm.items()}, "exposed_data": exposed_data,
            "update": update, "step": total}


def axis_bandwidth(axis: str, layout: Layout, device: Device) -> float:
    """Bytes/s one device sends over `axis`: NVLink/ICI if the axis's groups stay inside a node, else the NIC."""
    inner = math.prod(layout.shape[a] for a in AXES[AXES.index(axis) + 1:])  # AXES: outermost first
    span = inner * layout.shape[axis]
    return device.intra_bandwidth if span <= device.devices_per_node else device.inter_bandwidth

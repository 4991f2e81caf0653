"""Everything the planner predicts for one layout, without compiling: memory, traffic, bubble, FLOPs, time.

For a model (its parameters' shapes and logical names), a global batch and a
layout (mesh sizes plus the plan options), everything is counted per device
and per step, in the same units `jaxpar.planner.inspect` reads back from XLA.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.planner.devices import Device, load_device
from jaxpar.planner.layout import Layout, Workload
from jaxpar.planner.memory import inventory, memory_breakdown
from jaxpar.planner.model import Model
from jaxpar.planner.step_time import flops_per_token, recompute_flops_per_token, step_time
from jaxpar.planner.ticks import bubble
from jaxpar.planner.traffic import Collective, collectives, traffic_per_axis


@dataclasses.dataclass
class Estimate:
    """Everything the planner predicts for one layout (bytes per device, seconds per step)."""

    layout: Layout
    memory: dict[str, float]
    collectives: list[Collective]
    traffic: dict[str, float]
    bubble: float
    flops: float  # model FLOPs per device per step (no recomputation)
    hardware_flops: float  # with recomputation
    time: dict[str, float]
    mfu: float
    fits: bool
    reason: str = ""

    @property
    def step_time(self) -> float:
        return self.time["step"]

    @property
    def peak(self) -> float:
        return self.memory["total"]

    def to_dict(self) -> dict:
        return {
            "layout": str(self.layout), "mesh": self.layout.shape, "options": self.layout.options(),
            "memory": self.memory, "traffic": self.traffic, "bubble": self.bubble, "flops": self.flops,
            "hardware_flops": self.hardware_flops, "time": self.time, "mfu": self.mfu, "fits": self.fits,
            "reason": self.reason,
            "collectives": [dataclasses.asdict(c) | {"traffic": c.traffic(self.layout.shape[c.axis])}
                            for c in self.collectives],
        }


def check(model: Model, layout: Layout, work: Workload) -> str:
    """Why `layout` cannot run `model` on `work` ('' when it can): the divisibility jaxpar itself enforces."""
    from jaxpar.pipeline.schedule import validate

    try:
        if layout.pipe > 1:
            validate(layout.schedule, layout.pipe, layout.microbatches, layout.virtual_stages)
        inventory(model, layout.data, layout.tensor, layout.pipe, layout.expert)
    except ValueError as error:
        return str(error)
    ways = layout.replica * layout.data * layout.expert * layout.grad_accum * layout.microbatches
    if work.batch_size % ways:
        return f"batch {work.batch_size} does not divide by replica x data x expert x grad_accum x microbatches = {ways}"
    if layout.pipe > 1 and model.pipeline_units % (layout.pipe * layout.virtual_stages):
        pattern = f" (in whole local/global patterns of {model.layer_pattern})" if model.layer_pattern > 1 else ""
        return (f"{model.scan_depth} layers do not split{pattern} into pipe={layout.pipe} x "
                f"virtual_stages={layout.virtual_stages}")
    if layout.pipe > 1 and work.seq_len % layout.pipe:
        return f"sequence {work.seq_len} does not divide by pipe={layout.pipe} (the loss head splits positions)"
    if layout.pipe > 1 and model.n_experts:
        return "the MoE model does not run under pipe > 1"
    if layout.expert > 1 and not model.n_experts:
        return f"expert={layout.expert} but the model has no experts"
    if model.n_experts and model.n_experts % layout.expert:
        return f"{model.n_experts} experts do not divide by expert={layout.expert}"
    if layout.replica > 1 and (layout.zero == 0 or layout.data == 1):
        return f"replica={layout.replica} without ZeRO over data is plain data parallelism: use data"
    if work.seq_len % (2 * layout.context):
        return (f"sequence {work.seq_len} does not divide by 2 x context={layout.context} (two mirrored chunks "
                "per context rank)")
    if layout.pipe > 1 and layout.context > 1:
        return ("pipe with context is not modelled yet: the pipeline's ticks each sum their weight "
                "gradients over context")
    if layout.sequence_parallel and work.seq_len % layout.tensor:
        return f"sequence {work.seq_len} does not divide by tensor={layout.tensor} (sequence parallelism)"
    return ""


def estimate(model: Model, layout: Layout, work: Workload, device: Device | str = "h100") -> Estimate:
    """The analytic model of one layout: memory breakdown, traffic per axis, bubble, FLOPs, time, MFU."""
    device = load_device(device) if isinstance(device, str) else device
    reason = check(model, layout, work)
    if reason:
        return Estimate(layout, {"total": math.inf}, [], {}, 0.0, 0.0, 0.0, {"step": math.inf}, 0.0, False, reason)
    memory = memory_breakdown(model, layout, work, device)
    colls = collectives(model, layout, work, device)
    traffic = traffic_per_axis(colls, layout)
    tokens_per_device = work.tokens / (layout.replica * layout.data * layout.expert * layout.context)
    flops = flops_per_token(model, work.seq_len) * tokens_per_device / (layout.tensor * layout.pipe)
    hw = flops + recompute_flops_per_token(model, layout, work.seq_len) * tokens_per_device / (layout.tensor * layout.pipe)
    time = step_time(model, layout, work, device, hw, traffic, memory)
    mfu = flops / (time["step"] * device.flops(layout.precision)) if time["step"] > 0 else 0.0
    fits = memory["total"] <= device.capacity
    why = "" if fits else (f"needs {memory['total'] / 1e9:.1f} GB per device, {device.name} has "
                           f"{device.capacity / 1e9:.1f} GB usable")
    return Estimate(layout, memory, colls, traffic, bubble(layout), flops, hw, time, mfu, fits, why)

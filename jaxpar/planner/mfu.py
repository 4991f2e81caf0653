"""Model FLOPs utilization of a training run: the model's FLOPs per step over what the devices could do.

The FLOPs come from the config by the planner's formula (`jaxpar.planner.step_time.flops_per_token`:
6 N per token for the matmuls forward and backward plus 6 L s h (hd_qk + hd_v) for attention),
so MFU here and in `jaxpar plan` are one number. The peak is the device's dense
(no 2:4 sparsity) datasheet figure (`jaxpar.core.device_facts.PEAKS`), looked up by
the plan's devices' kind (`jaxpar.core.device_facts`), or `--peak-flops`. Where neither is known (the CPU, an unlisted device) there is no
MFU: a made-up peak would give a made-up fraction.
"""

from __future__ import annotations

import dataclasses

from jaxpar.core import device_facts
from jaxpar.planner.model import Model
from jaxpar.planner.step_time import flops_per_token


def model_flops_per_step(name: str, config, batch_size: int, seq_len: int) -> float:
    """Model FLOPs of one optimizer step (forward and backward, no recomputation) over the whole batch."""
    model = Model.of_config(name, config)
    return flops_per_token(model, seq_len) * batch_size * seq_len


@dataclasses.dataclass(frozen=True)
class Mfu:
    """What turns a step time into MFU: FLOPs per step and the summed peak of the devices (None: no MFU)."""

    flops_per_step: float
    peak: float | None  # FLOP/s of all devices together
    why_not: str = ""  # why there is no peak, for the person reading the progress

    def __call__(self, step_time_s: float) -> float | None:
        if self.peak is None or step_time_s <= 0:
            return None
        return self.flops_per_step / (step_time_s * self.peak)


def for_run(name: str, config, batch_size: int, seq_len: int, precision: str, devices: list,
            peak_flops: float | None = None) -> Mfu:
    """The run's MFU: `peak_flops` (per device) if given, else the table's peak for the devices, else none."""
    return for_flops(model_flops_per_step(name, config, batch_size, seq_len), precision, devices, peak_flops)


def for_flops(flops: float, precision: str, devices: list, peak_flops: float | None = None) -> Mfu:
    """MFU of a step of `flops` model FLOPs (all devices together) on `devices`: `peak_flops` per device if given,
    else the table's peak for them in `precision`, else none."""
    if peak_flops is not None:
        return Mfu(flops, peak_flops * len(devices))
    facts = device_facts.of_devices(devices)  # a compile-only target's too
    if facts.backend == "cpu":
        return Mfu(flops, None, "n/a (CPU)")
    peak = facts.peak_flops(precision)
    if peak is None:
        return Mfu(flops, None, f"n/a (no peak known for {facts.kind!r}: give --peak-flops)")
    return Mfu(flops, peak * len(devices))

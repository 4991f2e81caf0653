"""Each step's figures for a training loop of one's own, written as `jaxpar train` writes them (a stable public name).

    from jaxpar.metrics import Metrics, mfu

    utilization = mfu(6 * n_params * tokens_per_step)      # or jaxpar.inspect's matmul_flops x devices
    with Metrics("metrics.jsonl", tensorboard="tb", start=start, print_every=10,
                 tokens_per_step=tokens_per_step, mfu=utilization) as metrics:
        for step in range(start, steps):
            began = time.perf_counter()
            state, out = train_step(state, batch(step))
            loss = float(out["loss"])                       # waits for the step: the time below is its own
            metrics.write({"step": step + 1, "loss": loss, "step_time_s": time.perf_counter() - began})

On process 0 only: the progress line (`step    10  loss 5.123456  ...`), one JSON line per row (a resumed run's
rows after `start` dropped first, so the file holds each step once), TensorBoard scalars under `train/`,
`perf/`, `memory/`, `eval/` (tensorboardX). With a step time, `tokens_per_s` and `mfu` (model FLOPs over
the devices' datasheet peak; none on a CPU or an unlisted device: `mfu(..., peak_flops=)` names it).
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxpar.planner.mfu import Mfu, for_flops, model_flops_per_step
from jaxpar.run.report import progress_line
from jaxpar.run.training import Outputs, device_memory
from jaxpar.train.distributed import is_leader

__all__ = ["Metrics", "Mfu", "device_memory", "mfu", "model_flops_per_step", "progress_line"]


def mfu(flops_per_step: float, *, precision: str = "fp32", devices: list | None = None,
        peak_flops: float | None = None) -> Mfu:
    """What turns a step time into MFU for a step of `flops_per_step` model FLOPs (the whole batch, forward and
    backward): the summed peak of `devices` (default all) in the compute `precision` (fp32 or bf16), or
    `peak_flops` per device. `Mfu(step_time_s)` is the fraction, None where no peak is known (`why_not`)."""
    return for_flops(flops_per_step, precision, jax.devices() if devices is None else devices, peak_flops)


class Metrics:
    """Rows of a loop written where `jaxpar train` writes them (see the module docstring)."""

    def __init__(self, jsonl: str | Path | None = None, tensorboard: str | Path | None = None, *, start: int = 0,
                 print_every: int = 1, tokens_per_step: int | None = None, mfu: Mfu | None = None):
        if print_every < 0:
            raise ValueError(f"print_every must be >= 0 (0: never), got {print_every}")
        self.print_every, self.tokens_per_step, self.mfu = print_every, tokens_per_step, mfu
        self._outputs = Outputs(jsonl, tensorboard, start)

    def write(self, row: dict) -> dict:
        """Complete `row` (needs `step`; `loss` for the progress line) with `tokens_per_s` and `mfu` from its
        `step_time_s`, and device memory where the backend reports it; write it; return it."""
        if "step" not in row:
            raise ValueError(f"a metrics row needs its 'step', got keys {sorted(row)}")
        row = {k: v.item() if getattr(v, "shape", None) == () else v for k, v in row.items()}  # jax/numpy scalars
        elapsed = row.get("step_time_s")
        if elapsed and self.tokens_per_step:
            row["tokens_per_s"] = self.tokens_per_step / elapsed
        if elapsed and self.mfu is not None and self.mfu(elapsed) is not None:
            row["mfu"] = self.mfu(elapsed)
        row.update(device_memory())
        self._outputs.write(row)
        if is_leader() and self.print_every and "loss" in row and row["step"] % self.print_every == 0:
            print(progress_line(row), flush=True)
        return row

    def close(self) -> None:
        self._outputs.close()

    def __enter__(self) -> "Metrics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

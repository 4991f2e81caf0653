"""`jaxpar plan --target NAME --verify`: the planner's top layouts compiled for the target, predicted beside compiled.

The planner ranks layouts by its analytic model; this compiles each of the top ones for the target's devices
(`jaxpar.core.target`, deviceless: nothing runs) and reads XLA's memory per device back, so that "fits" is
answered by the GPU compiler, not only by the model. Each compile is one abstract step (`run.report.inspection`).
"""

from __future__ import annotations

import dataclasses

from jaxpar.core.plan import Plan
from jaxpar.planner.estimate import Estimate
from jaxpar.planner.layout import Workload


@dataclasses.dataclass(frozen=True)
class Verified:
    """One layout: the planner's memory per device, the compiled one, whether that fits, the attention chosen."""

    layout: str
    predicted: float
    compiled: float
    capacity: float
    attention: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return self.compiled <= self.capacity

    def line(self) -> str:
        """`layout: planner, compiled, planner / compiled, fits` (GB per device)."""
        return (f"{self.layout}: {self.predicted / 1e9:.3g}, {self.compiled / 1e9:.3g}, "
                f"{self.predicted / self.compiled:.3f}, {'fits' if self.fits else 'does NOT fit'} in "
                f"{self.capacity / 1e9:.3g} (attention {', '.join(self.attention) or 'none'})")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "fits": self.fits, "ratio": self.predicted / self.compiled}


def verify(model_name: str, ranked: list[Estimate], work: Workload, target: str, capacity: float,
           trains: tuple = ()) -> list[Verified]:
    """Compile each of `ranked` for `target` (its plan options and `trains`, LoRA's) at the workload's batch."""
    from jaxpar.run.report import inspection
    from jaxpar.run.training import TrainConfig, prepare

    out = []
    for est in ranked:
        plan = Plan.create(est.layout.mesh, target=target, **est.layout.options(), **dict(trains))
        run = prepare(TrainConfig(model=model_name, batch_size=work.batch_size, seq_len=work.seq_len), plan)
        report = inspection(run)
        kernels = tuple(a.split(" ")[0] for a in report["attention"])
        out.append(Verified(est.layout.label(precision=False), float(est.memory["total"]),
                            float(report["memory"]["total"]), capacity, kernels))
    return out

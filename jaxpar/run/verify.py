"""`jaxpar plan --target NAME --verify`: the planner's top layouts compiled for the target, predicted beside compiled.

The planner ranks layouts by its analytic model; this compiles each of the top ones for the target's devices
(`jaxpar.core.target`, deviceless: nothing runs) and reads XLA's memory per device back, so that "fits" is
answered by the GPU compiler, not only by the model. Each compile is one abstract step (`run.report.inspection`).
"""

from __future__ import annotations

import dataclasses
import math

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


# -- `jaxpar plan --scaling --target`: the counts that compile here, their collectives against the planner --------

SMALL = {"n_layers": 2}  # the compiled stand-in: the model's widths and vocabulary, two layers
SMALL_SEQ = 256


@dataclasses.dataclass(frozen=True)
class ScalingCheck:
    """One (family, device count) compiled for `target` at the stand-in workload: traffic per mesh axis, bytes per
    device per step, the planner's and the compiler's."""

    family: str
    devices: int
    target: str
    layout: str
    predicted: dict
    compiled: dict
    reason: str = ""  # why the stand-in was not compiled (its layout cannot run one sequence per device)

    def ratios(self) -> dict:
        return {a: self.predicted[a] / self.compiled[a] if self.compiled[a] else math.inf
                for a in self.predicted if self.predicted[a] or self.compiled[a]}

    def line(self) -> str:
        if self.reason:
            return f"{self.family} on {self.target} ({self.layout}): not compiled: {self.reason}"
        return (f"{self.family} on {self.target} ({self.layout}): " + ", ".join(
            f"{a} {self.predicted[a] / 1e9:.4g} / {self.compiled[a] / 1e9:.4g} GB = {r:.3f}"
            for a, r in self.ratios().items()))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ratios": self.ratios()}


def host_targets(target: str, counts, per_host: int) -> dict[int, str]:
    """The counts that are whole hosts of `target` (1, 2, 4 hosts), each with its target name."""
    import re

    from jaxpar.core.target import parse

    base = parse(target)
    if base.hosts != 1:
        raise ValueError(f"--scaling --target takes one host (h100x8, ...): it compiles 1, 2 and 4 of them; "
                         f"got {target}")
    out = {}
    for hosts in (1, 2, 4):
        n = hosts * per_host
        if n in counts:
            file = re.match(r"^(?:\d+:)?(.+\.(?:txtpb|pbtxt|textproto))$", target)
            out[n] = (f"{hosts}:{file.group(1)}" if file else f"{hosts}x{base.name}") if hosts > 1 else target
    return out


def check_scaling_hosts(model_name: str, result: dict, counts, target: str, device) -> list[ScalingCheck]:
    """`plan --scaling --target`: the counts of `result` (family: [(point, ...)]) that are whole hosts of
    `target`, each compiled and held against the planner (`check_scaling`)."""
    names = host_targets(target, counts, device.devices_per_node)
    points = [(p, names[p.devices]) for rows in result.values() for p, _ in rows if p.devices in names and not p.reason]
    return check_scaling(model_name, points, target, device)


def check_scaling(model_name: str, points, target: str, device) -> list[ScalingCheck]:
    """Compile each point's layout (the stand-in model: `SMALL` layers, `SMALL_SEQ` tokens, one sequence per
    device) for its host count of `target`, and read its traffic per axis beside the planner's."""
    from jaxpar.planner import compare
    from jaxpar.planner.estimate import estimate
    from jaxpar.planner.model import Model
    from jaxpar.run.report import inspection
    from jaxpar.run.training import TrainConfig, prepare

    model = Model.named(model_name, {**SMALL, "seq_len": SMALL_SEQ})
    out = []
    for point, name in points:
        work = Workload(point.devices, SMALL_SEQ)
        layout = point.est.layout
        if layout.microbatches > 1 and work.batch_size // max(layout.data * layout.replica, 1) % layout.microbatches:
            layout = dataclasses.replace(layout, microbatches=work.batch_size // (layout.data * layout.replica))
        est = estimate(model, layout, work, device)
        if est.reason:  # e.g. the planner's choice accumulates gradients: one sequence per device is too few
            out.append(ScalingCheck(point.family, point.devices, name, layout.label(precision=False), {}, {},
                                    est.reason))
            continue
        plan = Plan.create(layout.mesh, target=name, **layout.options())
        config = TrainConfig(model=model_name, batch_size=work.batch_size, seq_len=work.seq_len,
                             model_overrides={**SMALL, "seq_len": SMALL_SEQ})
        report = inspection(prepare(config, plan))
        got, want = compare.compiled_figures(report), compare.predicted_figures(est)
        axes = [k for k in got if k.startswith("traffic_") and k != "traffic_other"]  # other: scalars over several
        out.append(ScalingCheck(point.family, point.devices, name, layout.label(precision=False),
                                {k[8:]: float(want.get(k, 0.0)) for k in axes},
                                {k[8:]: float(got[k]) for k in axes}))
    return out

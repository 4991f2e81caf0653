"""`jaxpar plan --scaling weak|strong`: one layout family over growing device counts, by the planner.

Weak scaling keeps the sequences per device (the global batch grows with the
devices), strong scaling keeps the global batch. Per count: the planner's step
time, the share of it that is exposed communication, and the efficiency against
the first count that runs (weak: t_first / t_n; strong: t_first n_first / (t_n n)).
A family names how the devices are laid out at every count: `dp` (data, no
ZeRO), `zero3` (data, ZeRO-3), `3d` (tensor=2, pipe=2, the rest data, ZeRO-1:
the command line's default layout at 8), `best` (the planner's choice per count).
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.planner.devices import Device
from jaxpar.planner.estimate import Estimate, estimate
from jaxpar.planner.layout import Layout, Workload
from jaxpar.planner.model import Model
from jaxpar.planner.search import plan

FAMILIES = ("dp", "zero3", "3d", "best")
COUNTS = tuple(2**k for k in range(3, 13))  # 8 .. 4096


@dataclasses.dataclass(frozen=True)
class Point:
    """One device count of a family: the layout, its workload and what the planner predicts for it."""

    family: str
    devices: int
    work: Workload
    est: Estimate | None
    reason: str = ""

    @property
    def step(self) -> float:
        return self.est.step_time if self.est is not None and not self.reason else math.inf

    @property
    def comm_share(self) -> float:
        """Exposed communication (what the step waits for beyond compute and the update) over the step."""
        t = self.est.time
        return max(0.0, t["step"] - t["compute"] - t["update"]) / t["step"]

    def to_dict(self, efficiency: float | None) -> dict:
        out = {"family": self.family, "devices": self.devices, "batch_size": self.work.batch_size,
               "seq_len": self.work.seq_len, "reason": self.reason}
        if self.reason:
            return out
        return {**out, "layout": self.est.layout.label(precision=False), "step_time": self.step,
                "compute": self.est.time["compute"], "comm_share": self.comm_share, "efficiency": efficiency,
                "mfu": self.est.mfu, "memory": self.est.peak, "fits": self.est.fits,
                "traffic": dict(self.est.traffic)}


def family_layout(family: str, devices: int, work: Workload, precision: str) -> Layout:
    """The layout `family` (not `best`) gives `devices`; ValueError where it cannot split them."""
    if family == "dp":
        return Layout(data=devices, precision=precision)
    if family == "zero3":
        return Layout(data=devices, zero=3, precision=precision)
    if family == "3d":
        if devices % 4:
            raise ValueError(f"3d is tensor=2 x pipe=2 x data: {devices} devices do not divide by 4")
        data = devices // 4
        local = work.batch_size // data if work.batch_size % data == 0 else 0
        return Layout(data=data, tensor=2, pipe=2, zero=1 if data > 1 else 0, microbatches=min(max(local, 2), 8),
                      precision=precision)
    raise ValueError(f"unknown layout family {family!r} (known: {', '.join(FAMILIES)})")


def workload(mode: str, devices: int, first: int, batch: int, seq: int) -> Workload:
    """Weak: `batch` sequences at `first` devices, grown in proportion; strong: `batch` at every count."""
    if mode == "weak":
        return Workload(max(1, batch * devices // first), seq)
    return Workload(batch, seq)


def point(model: Model, family: str, devices: int, work: Workload, device: Device, precision: str) -> Point:
    """The planner's estimate of `family` on `devices` (a reason instead where it cannot run or nothing fits)."""
    if family == "best":
        ranking = plan(model, devices, work, device, precision)
        if ranking.best is None:
            return Point(family, devices, work, None, "no layout fits")
        return Point(family, devices, work, ranking.best)
    try:
        layout = family_layout(family, devices, work, precision)
    except ValueError as error:
        return Point(family, devices, work, None, str(error))
    est = estimate(model, layout, work, device)
    reason = est.reason if not est.memory.get("params") else ""  # not fitting is reported, not dropped
    return Point(family, devices, work, est, reason)


def scaling(model: Model, mode: str, families: tuple[str, ...], counts: tuple[int, ...], batch: int, seq: int,
            device: Device, precision: str = "bf16") -> dict[str, list[tuple[Point, float | None]]]:
    """Per family, per count: the planner's point and its efficiency (None where it cannot run)."""
    if mode not in ("weak", "strong"):
        raise ValueError(f"--scaling must be weak or strong, got {mode!r}")
    bad = [c for c in counts if c < 1]
    if bad:
        raise ValueError(f"device counts must be >= 1, got {bad}")
    out = {}
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"unknown layout family {family!r} (known: {', '.join(FAMILIES)})")
        points = [point(model, family, n, workload(mode, n, counts[0], batch, seq), device, precision)
                  for n in counts]
        ref = next((p for p in points if not p.reason), None)
        rows = []
        for p in points:
            eff = None
            if ref is not None and not p.reason:
                eff = ref.step / p.step if mode == "weak" else ref.step * ref.devices / (p.step * p.devices)
            rows.append((p, eff))
        out[family] = rows
    return out


def table(result: dict, model: Model, mode: str, device: Device):
    """The scaling rows as a rich table."""
    from rich.table import Table

    t = Table(title=f"{mode} scaling of {model.name} ({model.params / 1e9:.3g}B) on {device.name}: "
                    "the planner's step time, exposed communication share and efficiency per device count")
    for col in ("family", "devices", "layout", "batch", "step s", "comm", "efficiency", "MFU", "GB/dev", "fits"):
        t.add_column(col, justify="left" if col in ("family", "layout") else "right")
    for family, rows in result.items():
        for p, eff in rows:
            if p.reason:
                t.add_row(family, str(p.devices), f"cannot: {p.reason}", str(p.work.batch_size), *[""] * 6)
                continue
            t.add_row(family, str(p.devices), p.est.layout.label(precision=False), str(p.work.batch_size),
                      f"{p.step:.3g}", f"{p.comm_share:.0%}", f"{eff:.0%}", f"{p.est.mfu:.0%}",
                      f"{p.est.peak / 1e9:.1f}", "yes" if p.est.fits else "no")
    return t


def to_dict(result: dict) -> dict:
    return {family: [p.to_dict(eff) for p, eff in rows] for family, rows in result.items()}


def save_plot(result: dict, model: Model, mode: str, device: Device, path: str) -> str:
    """Efficiency against devices (log2 x axis), one line per family; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for family, rows in result.items():
        xs = [p.devices for p, eff in rows if eff is not None]
        ys = [eff for _, eff in rows if eff is not None]
        ax.plot(xs, ys, marker="o", label=family)
    ax.set_xscale("log", base=2)
    counts = sorted({p.devices for rows in result.values() for p, _ in rows})
    ax.set_xticks(counts, [str(n) for n in counts], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("devices")
    ax.set_ylabel("efficiency")
    ax.set_ylim(0, 1.05 * max([1.0] + [e for rows in result.values() for _, e in rows if e is not None]))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{mode} scaling, {model.name} on {device.name} (jaxpar plan)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

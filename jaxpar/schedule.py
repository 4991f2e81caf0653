"""Pipeline schedules as static tick tables: who runs which microbatch, when; the bubble; pictures.

In a scan-based pipeline every stage runs the same program once per tick, so a
schedule is a table: at tick t, stage i runs the forward (or backward) of
microbatch j on its virtual chunk k, or nothing (a bubble slot). `jaxpar.pipeline`
executes these tables; this module also measures their bubble and draws them.

- gpipe: forward of j at stage i on tick i + j, then the backward by autodiff of
  that scan, i.e. the same table run in reverse.
- interleaved (circular): each device holds v chunks of layers; groups of p
  microbatches go round the ring of devices v times, so the backward (again by
  autodiff) and forward each take m*v + p - 1 chunk-sized ticks.
- 1f1b: forward of j at stage i on tick i + j and its backward on tick
  2p - 2 - i + j (the last stage runs the loss head and the backward in the
  tick of the forward). Ticks split into warm-up (forward only), steady
  (forward and backward) and cool-down (backward only) phases.

Bubble fractions assume a forward and a backward slot take the same time; for
these lockstep schedules the fraction does not depend on that ratio.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved")
EMPTY = -1


def validate(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> None:
    """Raise ValueError for a schedule that cannot run `microbatches` through `stages` x `virtual_stages`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {schedule!r}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1 (or 0 for one per pipe stage), got {microbatches}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    if stages == 1:
        if microbatches != 1:
            raise ValueError(
                f"microbatches={microbatches} splits the batch for a pipeline, but mesh axis pipe=1; "
                f"use grad_accum to accumulate microbatches without a pipeline"
            )
        if virtual_stages != 1:
            raise ValueError(f"virtual_stages={virtual_stages} needs a pipeline, but mesh axis pipe=1")
        return
    if schedule == "interleaved" and virtual_stages < 2:
        raise ValueError(f"schedule 'interleaved' needs virtual_stages >= 2, got {virtual_stages}")
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule 'interleaved', got {schedule!r}")
    if microbatches < stages:
        raise ValueError(
            f"schedule {schedule!r} over pipe={stages} needs at least {stages} microbatches (one per stage), "
            f"got microbatches={microbatches}"
        )
    if schedule == "interleaved" and microbatches % stages:
        raise ValueError(
            f"schedule 'interleaved' sends microbatches round the ring in groups of pipe={stages}: "
            f"microbatches={microbatches} does not divide by {stages}"
        )


@dataclasses.dataclass(frozen=True)
class Column:
    """One slot of the timeline: a forward or backward slot of every stage (EMPTY: bubble)."""

    kind: str  # "F" or "B"
    microbatch: tuple[int, ...]
    chunk: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The tick tables of one schedule for `stages` devices, `microbatches` and `virtual_stages` chunks each."""

    name: str
    stages: int
    microbatches: int
    virtual_stages: int = 1

    def __post_init__(self):
        validate(self.name, self.stages, self.microbatches, self.virtual_stages)

    @property
    def explicit_backward(self) -> bool:
        """True when the backward slots are scheduled in the table (1f1b), not left to autodiff."""
        return self.name == "1f1b"

    # -- tick tables ------------------------------------------------------------

    @functools.cached_property
    def forward(self) -> np.ndarray:
        """[ticks, stages] microbatch of each stage's forward slot, EMPTY for a bubble."""
        return self._tables[0]

    @functools.cached_property
    def chunk(self) -> np.ndarray:
        """[ticks, stages] virtual chunk (0..v-1) of each forward slot; ring position is chunk * p + stage."""
        return self._tables[1]

    @functools.cached_property
    def backward(self) -> np.ndarray:
        """[ticks, stages] microbatch of each stage's backward slot (1f1b only)."""
        if not self.explicit_backward:
            raise ValueError(f"schedule {self.name!r} leaves the backward to autodiff; it has no backward table")
        return self._tables[2]

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    @functools.cached_property
    def phases(self) -> tuple[int, int, int]:
        """1f1b: ticks of warm-up (forward only), steady (both) and cool-down (backward only)."""
        p, m = self.stages, self.microbatches
        return (p - 1, m, p - 1) if self.explicit_backward else (self.ticks, 0, 0)

    @functools.cached_property
    def output_ticks(self) -> np.ndarray:
        """[microbatches] the tick on which each microbatch leaves the last chunk of the last stage."""
        last = self.stages - 1
        ticks = np.full(self.microbatches, EMPTY)
        for t in range(self.ticks):
            j = self.forward[t, last]
            if j != EMPTY and self.chunk[t, last] == self.virtual_stages - 1:
                ticks[j] = t
        return ticks

    @functools.cached_property
    def _tables(self):
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        if self.explicit_backward:
            ticks = m + 2 * p - 2
            t, i = np.arange(ticks)[:, None], np.arange(p)[None, :]
            fwd, bwd = t - i, t - (2 * p - 2 - i)
            fwd = np.where((fwd >= 0) & (fwd < m), fwd, EMPTY)
            bwd = np.where((bwd >= 0) & (bwd < m), bwd, EMPTY)
            return fwd, np.zeros_like(fwd), bwd
        # Circular: u = t - i counts the slots a stage has seen; u = g*(v*p) + k*p + s means group g,
        # chunk k, position s in the group, so microbatch j = g*p + s enters chunk k on this tick.
        groups = -(-m // p)
        ticks = (groups - 1) * v * p + (v - 1) * p + (m - 1 - (groups - 1) * p) + p
        u = np.arange(ticks)[:, None] - np.arange(p)[None, :]
        g, k, s = u // (v * p), (u // p) % v, u % p
        j = g * p + s
        valid = (u >= 0) & (j < m)
        return np.where(valid, j, EMPTY), np.where(valid, k, 0), None

    # -- timeline and bubble --------------------------------------------------

    def timeline(self) -> list[Column]:
        """Slots in time order; an autodiff backward replays the forward ticks in reverse."""
        def column(kind, row_j, row_k):
            return Column(kind, tuple(int(x) for x in row_j), tuple(int(x) for x in row_k))

        columns = []
        if self.explicit_backward:
            warm, steady, _ = self.phases
            for t in range(self.ticks):
                if t < warm + steady:
                    columns.append(column("F", self.forward[t], self.chunk[t]))
                if t >= warm:
                    columns.append(column("B", self.backward[t], self.chunk[t]))
            return columns
        columns = [column("F", self.forward[t], self.chunk[t]) for t in range(self.ticks)]
        columns += [column("B", self.forward[t], self.chunk[t]) for t in reversed(range(self.ticks))]
        return columns

    @property
    def bubble(self) -> float:
        """Fraction of stage slots that are idle, counted on the tick table."""
        cells = [j for col in self.timeline() for j in col.microbatch]
        return sum(j == EMPTY for j in cells) / len(cells)

    @property
    def bubble_formula(self) -> float:
        """(p - 1) / (v*m + p - 1): the textbook idle fraction of GPipe, 1F1B and interleaved 1F1B."""
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        return (p - 1) / (v * m + p - 1)

    @property
    def in_flight(self) -> int:
        """Most microbatches whose forward a stage has run and whose backward it has not."""
        if not self.explicit_backward:
            return self.microbatches
        p, m = self.stages, self.microbatches
        return min(m, 2 * p - 1)

    def summary(self) -> dict:
        return {
            "schedule": self.name, "stages": self.stages, "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages, "ticks": self.ticks, "bubble": self.bubble,
            "bubble_formula": self.bubble_formula, "in_flight": self.in_flight,
        }


# -- pictures ----------------------------------------------------------------

_FORWARD_COLOURS = ("#4c72b0", "#8172b2", "#64b5cd", "#2a4a80")  # blues, one shade per virtual chunk
_BACKWARD_COLOURS = ("#55a868", "#2f7d4a", "#8cc084", "#1b5e20")  # greens


def _colour(kind: str, chunk: int) -> str:
    palette = _FORWARD_COLOURS if kind == "F" else _BACKWARD_COLOURS
    return palette[chunk % len(palette)]


def _title(schedule: Schedule) -> str:
    v = f", v={schedule.virtual_stages}" if schedule.virtual_stages > 1 else ""
    return (f"{schedule.name}: p={schedule.stages}, m={schedule.microbatches}{v}; "
            f"bubble {schedule.bubble:.1%} (formula (p-1)/(vm+p-1) = {schedule.bubble_formula:.1%})")


def render(schedule: Schedule):
    """The timeline as rich text: one row per stage, a coloured cell per forward/backward slot."""
    from rich.text import Text

    width = len(str(schedule.microbatches - 1)) + 1
    text = Text(_title(schedule) + "\n", style="bold")
    columns = schedule.timeline()
    for stage in range(schedule.stages):
        text.append(f"stage {stage} ", style="bold")
        for col in columns:
            j = col.microbatch[stage]
            if j == EMPTY:
                text.append("·".center(width), style="dim")
            else:
                text.append(str(j).rjust(width - 1) + " ", style=f"bold white on {_colour(col.kind, col.chunk[stage])}")
        text.append("\n")
    text.append("forward ", style=f"white on {_FORWARD_COLOURS[0]}")
    text.append(" ")
    text.append("backward", style=f"white on {_BACKWARD_COLOURS[0]}")
    text.append("  · bubble; numbers are microbatches")
    if schedule.virtual_stages > 1:
        text.append("; shades are virtual chunks")
    return text


def save_png(schedule: Schedule, path: str) -> None:
    """Draw the timeline with matplotlib (stages x slots, bubbles left blank) into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    columns = schedule.timeline()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(columns)), 0.55 * schedule.stages + 1.3))
    for x, col in enumerate(columns):
        for stage, j in enumerate(col.microbatch):
            if j == EMPTY:
                continue
            ax.add_patch(plt.Rectangle((x, stage), 0.95, 0.9, color=_colour(col.kind, col.chunk[stage])))
            ax.text(x + 0.47, stage + 0.45, str(j), ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, len(columns))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(schedule.stages, 0)
    ax.set_yticks([s + 0.45 for s in range(schedule.stages)], [f"stage {s}" for s in range(schedule.stages)])
    ax.set_xlabel("time slot (one forward or backward slot of one chunk)")
    ax.set_title(_title(schedule), fontsize=9)
    ax.legend(handles=[Patch(color=_FORWARD_COLOURS[0], label="forward"),
                       Patch(color=_BACKWARD_COLOURS[0], label="backward")],
              loc="upper right", fontsize=7, bbox_to_anchor=(1.0, -0.25), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

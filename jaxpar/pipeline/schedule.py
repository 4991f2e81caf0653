"""Pipeline schedules as static tick tables: who runs which microbatch, when; the bubble.

In a scan-based pipeline every stage runs the same program once per tick, so a
schedule is a table: at tick t, stage i runs the forward (or backward) of
microbatch j on its virtual chunk k, or nothing (a bubble slot). `jaxpar.pipeline.executor`
executes these tables; this module also measures their bubble (`jaxpar.pipeline.schedule_pictures`
draws them). What each schedule's tables hold and why is in `jaxpar.pipeline.slot_tables`;
where in its tick each slot runs and which ring rows it uses, in `jaxpar.pipeline.slot_places`;
the ticks as scans, in `jaxpar.pipeline.tick_loops`.

Schedules with an explicit backward are data: `Schedule.actions` maps each
slot kind (F forward, BW fused backward, B input-backward, W weight-backward)
to a [ticks, stages] table of microbatches (EMPTY: idle), `Schedule.chunks`
to the chunk each slot runs, `Schedule.rows` to the residual-ring row it
writes or reads (a row freed by a slot is taken by a later slot, of the same
tick too; `Schedule.ring_layout`), and
`Schedule.segments` cuts the ticks into phases with the same slot kinds;
`Schedule.loops` cuts them further where the loss head starts or stops
running and folds repeating runs into loops, which `jaxpar.pipeline.table_executor` runs as
(nested) scans. Bubble fractions weigh F, B and W
slots alike (a fused backward counts twice); for the 1f1b and gpipe tables
the fraction does not depend on the weights.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxpar.core import options
from jaxpar.pipeline import slot_places, tick_loops
from jaxpar.pipeline.ring_rows import RingLayout
from jaxpar.pipeline.slot_tables import EMPTY, TABLES, gpipe_forward

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
EXPLICIT = ("1f1b", "interleaved", "zb-h1")  # schedules whose backward slots are in the table
COST = {"F": 1, "B": 1, "W": 1, "BW": 2}  # slot durations in forward-slot units (equal F, B, W)


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


@options.register_plan_check
def _check_plan(plan) -> None:
    validate(plan.schedule, plan.shape["pipe"], plan.pipeline_microbatches, plan.virtual_stages)


@dataclasses.dataclass(frozen=True)
class Column:
    """One slot of the timeline: a forward or backward slot of every stage (EMPTY: bubble)."""

    kind: str  # "F", "B" (backward; input-backward when split), "W" (weight-backward) or "BW" (fused backward)
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
        """True when the backward slots are scheduled in the table (all but gpipe), not left to autodiff."""
        return self.name in EXPLICIT

    @functools.cached_property
    def _generated(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        if not self.explicit_backward:
            raise ValueError(f"schedule {self.name!r} leaves the backward to autodiff; it has no action table")
        return TABLES[self.name](self.stages, self.microbatches, self.virtual_stages)

    @property
    def actions(self) -> dict[str, np.ndarray]:
        """Slot kind -> [ticks, stages] microbatch each stage runs in that slot (EMPTY: idle).

        Kinds: "F" forward, "BW" fused backward (input and weight gradients),
        "B" input-backward and "W" weight-backward. Within a tick the slots run
        in `ORDER`, each at its kind's place `places` gives.
        """
        return self._generated[0]

    @property
    def chunks(self) -> dict[str, np.ndarray]:
        """Slot kind -> [ticks, stages] the virtual chunk (0..v-1) of that slot (0 where idle)."""
        if not self.explicit_backward:
            return {"F": self._forward_tables[1]}
        return self._generated[1]

    @functools.cached_property
    def segments(self) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
        """(start, stop, kinds): runs of ticks on which the same slot kinds hold some microbatch."""
        kinds = [k for k in ("F", "BW", "B", "W") if k in self.actions]
        out = []
        for t in range(self.ticks):
            active = tuple(k for k in kinds if (self.actions[k][t] != EMPTY).any())
            if out and out[-1][2] == active:
                out[-1] = (out[-1][0], t + 1, active)
            else:
                out.append((t, t + 1, active))
        return tuple(out)

    @functools.cached_property
    def head(self) -> np.ndarray:
        """[ticks] whether the last stage's forward slot holds the last chunk: the loss head runs in that tick."""
        last = self.stages - 1
        return (self.forward[:, last] != EMPTY) & (self.chunk[:, last] == self.virtual_stages - 1)

    @functools.cached_property
    def loops(self) -> tuple[tuple[int, int, tuple[tuple[int, tuple[str, ...], bool], ...]], ...]:
        """(start, repeats, runs): the ticks as scans, a run being (ticks, slot kinds, whether the head runs);
        see `jaxpar.pipeline.tick_loops.loops`."""
        return tick_loops.loops(self)

    # -- tick tables ------------------------------------------------------------

    @property
    def forward(self) -> np.ndarray:
        """[ticks, stages] microbatch of each stage's forward slot, EMPTY for a bubble."""
        return self.actions["F"] if self.explicit_backward else self._forward_tables[0]

    @property
    def chunk(self) -> np.ndarray:
        """[ticks, stages] virtual chunk (0..v-1) of each forward slot; ring position is chunk * p + stage."""
        return self.chunks["F"]

    @functools.cached_property
    def backward(self) -> np.ndarray:
        """[ticks, stages] microbatch of each stage's (input-)backward slot."""
        if not self.explicit_backward:
            raise ValueError(f"schedule {self.name!r} leaves the backward to autodiff; it has no backward table")
        return self.actions["B" if "B" in self.actions else "BW"]

    @functools.cached_property
    def release(self) -> np.ndarray:
        """[ticks, stages] the microbatch whose residuals a stage uses for the last time (W or BW slot)."""
        return self.actions["W" if "W" in self.actions else "BW"]

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    @functools.cached_property
    def forward_ticks(self) -> int:
        """Ticks up to the last forward slot: what a forward-only run (no gradients) scans."""
        return int(np.nonzero((self.forward != EMPTY).any(axis=1))[0].max()) + 1

    @functools.cached_property
    def phases(self) -> tuple[int, ...]:
        """Ticks per segment (1f1b: warm-up, steady, cool-down); (ticks, 0, 0) for an autodiff backward."""
        if self.explicit_backward:
            return tuple(stop - start for start, stop, _ in self.segments)
        return (self.ticks, 0, 0)

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
    def _forward_tables(self):
        return gpipe_forward(self.stages, self.microbatches)

    # -- timeline and bubble --------------------------------------------------

    def timeline(self) -> list[Column]:
        """Slots in time order; an autodiff backward replays the forward ticks in reverse."""
        def column(kind, row_j, row_k):
            return Column(kind, tuple(int(x) for x in row_j), tuple(int(x) for x in row_k))

        columns = []
        if self.explicit_backward:
            for start, stop, kinds in self.segments:
                for t in range(start, stop):
                    columns += [column(k, self.actions[k][t], self.chunks[k][t]) for k in kinds]
            return columns
        columns = [column("F", self.forward[t], self.chunk[t]) for t in range(self.ticks)]
        columns += [column("B", self.forward[t], self.chunk[t]) for t in reversed(range(self.ticks))]
        return columns

    @property
    def bubble(self) -> float:
        """Fraction of stage time that is idle on the tick table (slots weighed by `COST`)."""
        cells = [(COST.get(col.kind, 1), j) for col in self.timeline() for j in col.microbatch]
        return sum(c for c, j in cells if j == EMPTY) / sum(c for c, _ in cells)

    @property
    def bubble_formula(self) -> float:
        """(p - 1) / (v*m + p - 1): the textbook idle fraction of GPipe, 1F1B and interleaved 1F1B.

        zb-h1 in lockstep: 2(p - 1) / (3m + 2(p - 1)) at equal F, B, W (the
        warm-up's p - 1 forward and the cool-down's p - 1 input-backward slots).
        """
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        if self.name == "zb-h1" and p > 1:
            return 2 * (p - 1) / (3 * m + 2 * (p - 1))
        return (p - 1) / (v * m + p - 1)

    def slot_ticks(self, kind: str) -> dict[tuple[int, int, int], int]:
        """(stage, microbatch, chunk) -> the tick of its `kind` slot (built once per kind: the planner asks for
        tables of thousands of microbatches; do not modify the returned dict)."""
        if kind not in self._slot_ticks:
            table = self.actions[kind]
            ticks, stages = np.nonzero(table != EMPTY)
            keys = zip(stages.tolist(), table[ticks, stages].tolist(), self.chunks[kind][ticks, stages].tolist())
            self._slot_ticks[kind] = dict(zip(keys, ticks.tolist()))
        return self._slot_ticks[kind]

    @functools.cached_property
    def _slot_ticks(self) -> dict:
        return {}

    def slot_tick_array(self, kind: str) -> np.ndarray:
        """[stages, microbatches, chunks] the tick of each (stage, microbatch, chunk)'s `kind` slot: every kind
        of an explicit table holds each once."""
        table = self.actions[kind]
        ticks, stages = np.nonzero(table != EMPTY)
        out = np.full((self.stages, self.microbatches, self.virtual_stages), -1)
        out[stages, table[ticks, stages], self.chunks[kind][ticks, stages]] = ticks
        if (out < 0).any():
            raise AssertionError(f"{self.name}: a {kind} slot is missing from the table")
        return out

    @functools.cached_property
    def places(self) -> dict[str, np.ndarray]:
        """Slot kind -> [ticks, stages] which of the kind's places in `ORDER` the slot runs at (0: first);
        see `jaxpar.pipeline.slot_places.places`."""
        return slot_places.places(self)

    def ring_layout(self, shared: bool = True) -> RingLayout:
        """The rows of the residual ring, and of the kept cotangents (split backward), per slot
        (`jaxpar.pipeline.slot_places.ring_layout`)."""
        if shared not in self._layouts:
            self._layouts[shared] = slot_places.ring_layout(self, shared)
        return self._layouts[shared]

    @functools.cached_property
    def _layouts(self) -> dict:
        return {}

    @property
    def rows(self) -> dict[str, np.ndarray]:
        """Slot kind -> [ticks, stages] the residual-ring row its (microbatch, chunk) uses, from F to BW or W."""
        return self.ring_layout().rows

    @property
    def cotangent_rows(self) -> dict[str, np.ndarray]:
        """zb-h1: "B", "W" -> [ticks, stages] the ring row holding the cotangent a B keeps for its W; EMPTY where
        the W runs in the B's tick and takes the B's cotangent as it is."""
        return self.ring_layout().cotangent_rows

    @functools.cached_property
    def in_flight(self) -> int:
        """Rows of a stage's residual ring: the most (microbatch, chunk) residual sets it keeps at once, or for
        zb-h1 sets and kept cotangents together (a cotangent takes a row no set holds at that moment).

        gpipe (autodiff) keeps every microbatch's.
        """
        if not self.explicit_backward:
            return self.microbatches
        return slot_places.most_held(self, "residuals")  # = ring_layout().ring_rows, without placing each set

    @functools.cached_property
    def cotangents_in_flight(self) -> int:
        """zb-h1: most cotangents a stage keeps at once from its B slot to a W slot in a later tick (0 when the
        backward is fused). They live in ring rows (`in_flight` counts them); a buffer of their own only where
        no residual buffer can hold one (`ring_layout(shared=False)`)."""
        if not self.explicit_backward or "W" not in self.actions:
            return 0
        return slot_places.most_held(self, "cotangents")  # = ring_layout(shared=False).cotangent_buffer_rows

    @property
    def live_microbatches(self) -> float:
        """in_flight in whole-stage units (a chunk's residuals are 1/v of a stage's): the ring's rows, zb-h1's
        kept cotangents included (they take rows no residual set holds at the time)."""
        return self.in_flight / self.virtual_stages

    def summary(self) -> dict:
        return {
            "schedule": self.name, "stages": self.stages, "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages, "ticks": self.ticks, "bubble": self.bubble,
            "bubble_formula": self.bubble_formula, "in_flight": self.in_flight,
            "live_microbatches": self.live_microbatches, "cotangents_in_flight": self.cotangents_in_flight,
        }



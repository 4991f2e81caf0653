"""Pipeline schedules as static tick tables: who runs which microbatch, when; the bubble.

In a scan-based pipeline every stage runs the same program once per tick, so a
schedule is a table: at tick t, stage i runs the forward (or backward) of
microbatch j on its virtual chunk k, or nothing (a bubble slot). `jaxpar.pipeline.executor`
executes these tables; this module also measures their bubble (`jaxpar.pipeline.schedule_pictures`
draws them).

- gpipe: forward of j at stage i on tick i + j, then the backward by autodiff of
  that scan, i.e. the same table run in reverse.
- 1f1b: forward of j at stage i on tick i + j and its backward on tick
  2p - 2 - i + j (the last stage runs the loss head and the backward in the
  tick of the forward). Ticks split into warm-up (forward only), steady
  (forward and backward) and cool-down (backward only) phases. Stage 0
  keeps 2p - 2 microbatches' residuals, not canonical 1F1B's p: a lockstep
  tick holds a forward and a backward slot and moves each value one hop, so
  microbatch j's cotangent is back on stage 0 2(p - 1) ticks after its
  forward, while stage 0 starts a forward on every steady tick; it starts
  that of j + 2p - 2 after the backward of j, in the tick of that backward,
  in the ring row the backward has just freed (`ORDER`). Canonical
  1F1B hops once per slot, not per tick. Doing that in lockstep means a tick
  that is a forward on some stages and a backward on others. Each stage runs
  only its own slot (`jaxpar.pipeline.table_executor` runs slots under `lax.cond`), but the
  stages meet at every tick's `ppermute`, so such a tick lasts a backward
  (about two forwards) on every stage: the steady phase takes 2m backward-long
  ticks against m ticks of a forward and a backward, a third longer.
  Starting stage 0's forwards on every other tick instead doubles the steady
  phase. Either costs more than the p - 2 extra residual sets save.
- interleaved (Megatron's interleaved 1F1B in lockstep): each device holds v
  chunks, ring position k*p + i on device i. Microbatches go round the ring in
  groups of p: stage i runs the forward of slot u = t - i, u = g*v*p + k*p + s
  meaning microbatch g*p + s on chunk k, so an activation moves one hop per
  tick (device p - 1 hands chunk k to device 0's chunk k + 1). Backwards
  mirror it with the chunks reversed, starting in the tick the last ring
  position runs its forward; v = 1 is 1f1b. Chunk-sized ticks make the
  warm-up and cool-down p - 1 + (v - 1)p chunk slots, and the bubble
  (p - 1)/(v*m + p - 1) of the step.
- zb-h1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", lockstep form):
  1F1B's forward and input-backward (B) slots, and each stage's weight
  gradient (W) of j on tick 2p - 2 + j, when stage 0 runs its B of j: stage
  i defers its W's by i ticks, which fills the ticks where 1F1B runs no
  backward on stage 0 (W slots run on m ticks only, 1F1B's fused backward
  on m + p - 1). Stage i keeps i cotangents from B to W where it keeps i
  residual sets fewer than stage 0, so they take ring rows no set holds, and
  stage 0's W takes the cotangent its B of the same microbatch takes: the
  ring has 1F1B's rows (for m >= 2p - 2; with fewer microbatches the
  cotangents that find no free row get a buffer of their own).

Within a tick a stage runs its slots in `ORDER`: a weight-backward first,
then the forward of a last chunk (or of a stage no later slot frees a row
for), the loss head and the backward that takes its cotangent, then every
other forward. Slots that free ring rows (W, B or BW reading residuals for the
last time) so run before the slots that take them (F, and B keeping a
cotangent), in the same tick, wherever the data allow; `Schedule.places` says
which of its kind's places each slot runs at.

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
from jaxpar.pipeline.ring_rows import RingLayout, allocate

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
EXPLICIT = ("1f1b", "interleaved", "zb-h1")  # schedules whose backward slots are in the table
COST = {"F": 1, "B": 1, "W": 1, "BW": 2}  # slot durations in forward-slot units (equal F, B, W)
# The slots of a tick in program order. F and W each have two places; every slot runs at one of its kind's
# (`Schedule.places`), so that a slot freeing ring rows runs before one taking them wherever the data allow.
ORDER = (("W", 0), ("F", 0), ("head", 0), ("B", 0), ("BW", 0), ("W", 1), ("F", 1))
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
        return _GENERATORS[self.name](self.stages, self.microbatches, self.virtual_stages)

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
        """(start, repeats, runs): the ticks as scans, a run being (ticks, slot kinds, whether the head runs).

        Runs are the ticks cut where the slot kinds or the head change. A pair
        of runs repeated back to back (interleaved's steady ticks: the head on
        p ticks in every v*p) folds into one loop of `repeats` rounds, so ticks
        without a last-chunk output compute no head, and the number of scans
        does not grow with m. A run of one tick folds into the next where that
        one has its slot kinds and head (`_merge_single_ticks`).
        """
        runs = []
        for start, stop, kinds in self.segments:
            for t in range(start, stop):
                key = (kinds, bool("F" in kinds and self.head[t]))
                if runs and runs[-1][1:] == key:
                    runs[-1] = (runs[-1][0] + 1, *key)
                else:
                    runs.append((1, *key))
        runs = _merge_single_ticks(runs)
        out, i, t = [], 0, 0
        while i < len(runs):
            pair, repeats = tuple(runs[i:i + 2]), 1
            while len(pair) == 2 and tuple(runs[i + 2 * repeats:i + 2 * repeats + 2]) == pair:
                repeats += 1
            block = pair if repeats > 1 else pair[:1]
            out.append((t, repeats, block))
            i += len(block) * repeats
            t += repeats * sum(run[0] for run in block)
        return tuple(out)

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
        """gpipe: forward of j on stage i at tick i + j, chunk 0."""
        p, m = self.stages, self.microbatches
        fwd = _steps(m + p - 1, p, m, np.arange(p))
        return fwd, np.zeros_like(fwd)

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
        """(stage, microbatch, chunk) -> the tick of its `kind` slot."""
        t, i = np.nonzero(self.actions[kind] != EMPTY)
        return {(int(s), int(self.actions[kind][a, s]), int(self.chunks[kind][a, s])): int(a) for a, s in zip(t, i)}

    @functools.cached_property
    def places(self) -> dict[str, np.ndarray]:
        """Slot kind -> [ticks, stages] which of the kind's places in `ORDER` the slot runs at (0: first).

        A weight-backward runs early, before the B and F slots that take rows;
        in its B's tick it takes the cotangent that B takes, which on the last
        chunk the loss head makes in that tick (place 1, after the B). A
        forward runs early (place 0) when its own backward is in the same tick
        (the last chunk: forward, loss head, backward) or when no later slot of
        its tick frees a ring row of its stage, otherwise after the tick's
        backward and weight-backward slots, to take the rows they free. Each
        place holding a forward in a run of ticks costs the run a `lax.cond`:
        zb-h1's forwards run early except on stage 0 (elsewhere its early W's
        free the rows; stage 0's B reads its residuals last), so its ticks
        with F and B slots and no W yet have one forward slot, not two.
        """
        back = "B" if "B" in self.actions else "BW"
        out = {kind: np.zeros_like(table) for kind, table in self.actions.items()}
        backward = self.slot_ticks(back)
        if "W" in self.actions:
            head_fed = self.stages - 1, self.virtual_stages - 1
            for (stage, j, k), t in self.slot_ticks("W").items():
                out["W"][t, stage] = int(backward[stage, j, k] == t and (stage, k) == head_fed)
        freed = {}  # (stage, j, k) -> (tick, index in ORDER) of the last read of its residuals
        for kind in ("BW", "B", "W"):
            for key, t in (self.slot_ticks(kind).items() if kind in self.actions else ()):
                freed[key] = max(freed.get(key, (t, -1)), (t, ORDER.index((kind, int(out[kind][t, key[0]])))))
        late = np.zeros(self.actions["F"].shape, bool)  # a row of the stage is freed after the early forward
        for (stage, _, _), (t, position) in freed.items():
            late[t, stage] |= position > ORDER.index(("F", 0))
        for (stage, j, k), t in self.slot_ticks("F").items():
            out["F"][t, stage] = int(backward[stage, j, k] != t and late[t, stage])
        return out

    def _when(self, kind: str) -> dict[tuple[int, int, int], int]:
        """(stage, microbatch, chunk) -> the position of its `kind` slot in the stage's program (tick, then `ORDER`)."""
        return {key: t * len(ORDER) + ORDER.index((kind, int(self.places[kind][t, key[0]])))
                for key, t in self.slot_ticks(kind).items()}

    @functools.cached_property
    def _lives(self) -> dict[str, dict]:
        """"residuals": (stage, j, k) -> (first, last) positions its VJP residuals are kept (F to the last of BW,
        B and W); "cotangents" (split backward): from B to W where W runs in a later tick (in B's tick W takes
        the cotangent B takes)."""
        first, uses = self._when("F"), [self._when(kind) for kind in ("BW", "B", "W") if kind in self.actions]
        lives = {"residuals": {key: (first[key], max(use[key] for use in uses)) for key in first}, "cotangents": {}}
        if "W" in self.actions:
            made, used = self._when("B"), self._when("W")
            lives["cotangents"] = {key: (made[key], used[key]) for key in made
                                   if made[key] // len(ORDER) != used[key] // len(ORDER)}
        return lives

    def ring_layout(self, shared: bool = True) -> RingLayout:
        """The rows of the residual ring, and of the kept cotangents (split backward), per slot.

        The residual sets get the fewest rows (`in_flight`). shared: a kept
        cotangent takes a ring row no set holds over its life (`jaxpar.pipeline.residual_ring`
        writes it into a residual buffer whose row can hold it), and only those
        that find none get a buffer of their own; otherwise all do.
        """
        if shared not in self._layouts:
            lives = self._lives
            residuals = {("residuals", *key): span for key, span in lives["residuals"].items()}
            rows, where = allocate(residuals)
            cotangents = {("cotangents", *key): span for key, span in lives["cotangents"].items()}
            extra, kept = allocate(cotangents, where if shared else {}, rows if shared else 0, residuals)
            residual = {kind: self._row_table(kind, lambda key: where["residuals", *key]) for kind in self.actions}
            rows_of = {}
            if "W" in self.actions:
                rows_of = {kind: self._row_table(kind, lambda key: kept.get(("cotangents", *key), EMPTY))
                           for kind in "BW"}
            self._layouts[shared] = RingLayout(rows, residual, extra, rows_of)
        return self._layouts[shared]

    @functools.cached_property
    def _layouts(self) -> dict:
        return {}

    def _row_table(self, kind: str, row_of) -> np.ndarray:
        table = np.zeros_like(self.actions[kind])
        for (stage, j, k), t in self.slot_ticks(kind).items():
            table[t, stage] = row_of((stage, j, k))
        return table

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
        return self.ring_layout().ring_rows

    @functools.cached_property
    def cotangents_in_flight(self) -> int:
        """zb-h1: most cotangents a stage keeps at once from its B slot to a W slot in a later tick (0 when the
        backward is fused). They live in ring rows (`in_flight` counts them); a buffer of their own only where
        no residual buffer can hold one (`ring_layout(shared=False)`)."""
        if not self.explicit_backward or "W" not in self.actions:
            return 0
        return self.ring_layout(shared=False).cotangent_buffer_rows

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


def _merge_single_ticks(runs: list) -> list:
    """Runs with a run of one tick folded into the next where that one has all its slot kinds and the same head.

    A one-tick scan is unrolled by XLA, its conds and their operand tables
    traced once more (zb-h1's tick with F and B before the first W, at p = 2:
    5.3 KB of XLA:CPU's pointer tables over 1f1b's temp); in the next run the
    kinds it lacks idle under their conds on that tick.
    """
    out = []
    for run in reversed(runs):
        n, kinds, head = run
        if n == 1 and out and out[-1][2] == head and set(kinds) <= set(out[-1][1]):
            out[-1] = (out[-1][0] + 1, *out[-1][1:])
        else:
            out.append(run)
    return out[::-1]


# -- table generators (explicit backward) --------------------------------------------------------------


def _steps(ticks: int, stages: int, m: int, first) -> np.ndarray:
    """[ticks, stages]: microbatch t - first[i] on stage i, EMPTY outside 0..m-1."""
    j = np.arange(ticks)[:, None] - np.asarray(first)[None, :]
    return np.where((j >= 0) & (j < m), j, EMPTY)


def _round_robin(ticks: int, p: int, m: int, v: int, first, reverse: bool):
    """(microbatch, chunk) tables of slot u = t - first[i]: u = g*v*p + c*p + s runs g*p + s on chunk c.

    reverse: chunk v - 1 - c (the backward walks the ring the other way).
    """
    u = np.arange(ticks)[:, None] - np.asarray(first)[None, :]
    g, c, s = u // (v * p), (u // p) % v, u % p
    j = g * p + s
    valid = (u >= 0) & (j < m)
    k = v - 1 - c if reverse else c
    return np.where(valid, j, EMPTY), np.where(valid, k, 0)


def _interleaved(p: int, m: int, v: int):
    """F of (j, chunk k) on stage i at i + u; its fused backward mirrored, from the tick of the last F (v = 1: 1f1b)."""
    ticks, i = v * m + v * p + p - 2, np.arange(p)
    f, fk = _round_robin(ticks, p, m, v, i, reverse=False)
    b, bk = _round_robin(ticks, p, m, v, (v - 1) * p + 2 * p - 2 - i, reverse=True)
    return {"F": f, "BW": b}, {"F": fk, "BW": bk}


def _zb_h1(p: int, m: int, v: int):
    """1F1B's F and B ticks; W of j on every stage at 2p - 2 + j (stage i defers its W's by i ticks)."""
    ticks, i = m + 2 * p - 2, np.arange(p)
    actions = {"F": _steps(ticks, p, m, i), "B": _steps(ticks, p, m, 2 * p - 2 - i),
               "W": _steps(ticks, p, m, np.full(p, 2 * p - 2))}
    return actions, {k: np.zeros_like(a) for k, a in actions.items()}


_GENERATORS = {"1f1b": _interleaved, "interleaved": _interleaved, "zb-h1": _zb_h1}

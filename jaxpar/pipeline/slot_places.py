"""Where in its tick each pipeline slot runs, and which residual-ring rows it writes and reads.

Within a tick a stage runs its slots in `ORDER`: a weight-backward first,
then the forward of a last chunk (or of a stage no later slot frees a row
for), the loss head and the backward that takes its cotangent, then every
other forward. Slots that free ring rows (W, B or BW reading residuals for the
last time) so run before the slots that take them (F, and B keeping a
cotangent), in the same tick, wherever the data allow; `Schedule.places` says
which of its kind's places each slot runs at.
"""

from __future__ import annotations

import numpy as np

from jaxpar.pipeline.ring_rows import RingLayout, allocate
from jaxpar.pipeline.slot_tables import EMPTY

# The slots of a tick in program order. F and W each have two places; every slot runs at one of its kind's
# (`places`), so that a slot freeing ring rows runs before one taking them wherever the data allow.
ORDER = (("W", 0), ("F", 0), ("head", 0), ("B", 0), ("BW", 0), ("W", 1), ("F", 1))


def places(schedule) -> dict[str, np.ndarray]:
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
    back = "B" if "B" in schedule.actions else "BW"
    out = {kind: np.zeros_like(table) for kind, table in schedule.actions.items()}
    backward = schedule.slot_ticks(back)
    if "W" in schedule.actions:
        head_fed = schedule.stages - 1, schedule.virtual_stages - 1
        for (stage, j, k), t in schedule.slot_ticks("W").items():
            out["W"][t, stage] = int(backward[stage, j, k] == t and (stage, k) == head_fed)
    freed = {}  # (stage, j, k) -> (tick, index in ORDER) of the last read of its residuals
    for kind in ("BW", "B", "W"):
        for key, t in (schedule.slot_ticks(kind).items() if kind in schedule.actions else ()):
            freed[key] = max(freed.get(key, (t, -1)), (t, ORDER.index((kind, int(out[kind][t, key[0]])))))
    late = np.zeros(schedule.actions["F"].shape, bool)  # a row of the stage is freed after the early forward
    for (stage, _, _), (t, position) in freed.items():
        late[t, stage] |= position > ORDER.index(("F", 0))
    for (stage, j, k), t in schedule.slot_ticks("F").items():
        out["F"][t, stage] = int(backward[stage, j, k] != t and late[t, stage])
    return out


def _when(schedule, kind: str) -> dict[tuple[int, int, int], int]:
    """(stage, microbatch, chunk) -> the position of its `kind` slot in the stage's program (tick, then `ORDER`)."""
    return {key: t * len(ORDER) + ORDER.index((kind, int(schedule.places[kind][t, key[0]])))
            for key, t in schedule.slot_ticks(kind).items()}


def _lives(schedule) -> dict[str, dict]:
    """"residuals": (stage, j, k) -> (first, last) positions its VJP residuals are kept (F to the last of BW,
    B and W); "cotangents" (split backward): from B to W where W runs in a later tick (in B's tick W takes
    the cotangent B takes)."""
    first = _when(schedule, "F")
    uses = [_when(schedule, kind) for kind in ("BW", "B", "W") if kind in schedule.actions]
    lives = {"residuals": {key: (first[key], max(use[key] for use in uses)) for key in first}, "cotangents": {}}
    if "W" in schedule.actions:
        made, used = _when(schedule, "B"), _when(schedule, "W")
        lives["cotangents"] = {key: (made[key], used[key]) for key in made
                               if made[key] // len(ORDER) != used[key] // len(ORDER)}
    return lives


def ring_layout(schedule, shared: bool = True) -> RingLayout:
    """The rows of the residual ring, and of the kept cotangents (split backward), per slot.

    The residual sets get the fewest rows (`in_flight`). shared: a kept
    cotangent takes a ring row no set holds over its life (`jaxpar.pipeline.residual_ring`
    writes it into a residual buffer whose row can hold it), and only those
    that find none get a buffer of their own; otherwise all do.
    """
    lives = _lives(schedule)
    residuals = {("residuals", *key): span for key, span in lives["residuals"].items()}
    rows, where = allocate(residuals)
    cotangents = {("cotangents", *key): span for key, span in lives["cotangents"].items()}
    extra, kept = allocate(cotangents, where if shared else {}, rows if shared else 0, residuals)
    residual = {kind: _row_table(schedule, kind, lambda key: where["residuals", *key]) for kind in schedule.actions}
    rows_of = {}
    if "W" in schedule.actions:
        rows_of = {kind: _row_table(schedule, kind, lambda key: kept.get(("cotangents", *key), EMPTY))
                   for kind in "BW"}
    return RingLayout(rows, residual, extra, rows_of)


def _row_table(schedule, kind: str, row_of) -> np.ndarray:
    table = np.zeros_like(schedule.actions[kind])
    for (stage, j, k), t in schedule.slot_ticks(kind).items():
        table[t, stage] = row_of((stage, j, k))
    return table

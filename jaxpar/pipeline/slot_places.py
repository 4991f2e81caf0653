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
    stage, chunk = _key_stage_chunk(schedule)
    backward = schedule.slot_tick_array(back)
    if "W" in schedule.actions:
        weight = schedule.slot_tick_array("W")
        head_fed = (stage == schedule.stages - 1) & (chunk == schedule.virtual_stages - 1)
        out["W"][weight, stage] = (backward == weight) & head_fed
    freed = np.max([_positions(schedule, kind, out) for kind in ("BW", "B", "W") if kind in schedule.actions], 0)
    late = np.zeros(schedule.actions["F"].shape, bool)  # a row of the stage is freed after the early forward
    after = freed % len(ORDER) > ORDER.index(("F", 0))
    late[freed[after] // len(ORDER), stage[after]] = True
    forward = schedule.slot_tick_array("F")
    out["F"][forward, stage] = (backward != forward) & late[forward, stage]
    return out


def _key_stage_chunk(schedule) -> tuple[np.ndarray, np.ndarray]:
    """The stage and the chunk of each (stage, microbatch, chunk) in `Schedule.slot_tick_array`'s layout."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    stage, _, chunk = np.meshgrid(np.arange(p), np.arange(m), np.arange(v), indexing="ij")
    return stage, chunk


def _positions(schedule, kind: str, places: dict | None = None) -> np.ndarray:
    """[stages, microbatches, chunks] the position of each `kind` slot in its stage's program (tick, then `ORDER`)."""
    places = schedule.places if places is None else places
    ticks = schedule.slot_tick_array(kind)
    stage, _ = _key_stage_chunk(schedule)
    order = np.array([ORDER.index((kind, place)) if (kind, place) in ORDER else -1 for place in (0, 1)])
    return ticks * len(ORDER) + order[places[kind][ticks, stage]]


def _spans(schedule) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """"residuals": (first, last, held) [stages, microbatches, chunks] positions its VJP residuals are kept (F to
    the last of BW, B and W); "cotangents" (split backward): from B to W where W runs in a later tick (in B's
    tick W takes the cotangent B takes). held marks the keys that keep one."""
    first = _positions(schedule, "F")
    last = np.max([_positions(schedule, kind) for kind in ("BW", "B", "W") if kind in schedule.actions], 0)
    spans = {"residuals": (first, last, np.ones(first.shape, bool))}
    if "W" in schedule.actions:
        made, used = _positions(schedule, "B"), _positions(schedule, "W")
        spans["cotangents"] = (made, used, made // len(ORDER) != used // len(ORDER))
    return spans


def most_held(schedule, what: str = "residuals") -> int:
    """The most spans of `what` (`_spans`) one stage holds at one position: the rows greedy allocation gives them
    (an interval graph), counted without allocating, for the planner's thousands of microbatches."""
    spans = _spans(schedule)
    if what not in spans:
        return 0
    first, last, held = spans[what]
    stage, _ = _key_stage_chunk(schedule)
    stage, first, last = stage[held], first[held], last[held]
    if not stage.size:
        return 0
    width = int(last.max()) + 2
    change = np.zeros((schedule.stages, width), int)
    np.add.at(change, (stage, first), 1)
    np.add.at(change, (stage, last + 1), -1)
    return int(np.cumsum(change, 1).max())


def ring_layout(schedule, shared: bool = True) -> RingLayout:
    """The rows of the residual ring, and of the kept cotangents (split backward), per slot.

    The residual sets get the fewest rows (`in_flight`). shared: a kept
    cotangent takes a ring row no set holds over its life (`jaxpar.pipeline.residual_ring`
    writes it into a residual buffer whose row can hold it), and only those
    that find none get a buffer of their own; otherwise all do.
    """
    spans = {what: _labelled(what, *arrays) for what, arrays in _spans(schedule).items()}
    residuals = spans["residuals"]
    rows, where = allocate(residuals)
    extra, kept = allocate(spans.get("cotangents", {}), where if shared else {}, rows if shared else 0, residuals)
    residual = {kind: _row_table(schedule, kind, lambda key: where["residuals", *key]) for kind in schedule.actions}
    rows_of = {}
    if "W" in schedule.actions:
        rows_of = {kind: _row_table(schedule, kind, lambda key: kept.get(("cotangents", *key), EMPTY))
                   for kind in "BW"}
    return RingLayout(rows, residual, extra, rows_of)


def _labelled(what: str, first: np.ndarray, last: np.ndarray, held: np.ndarray) -> dict:
    """(what, stage, microbatch, chunk) -> (first, last) for the keys that hold a span."""
    keys = np.argwhere(held)
    spans = zip(first[held].tolist(), last[held].tolist())
    return {(what, *key): span for key, span in zip(map(tuple, keys.tolist()), spans)}


def _row_table(schedule, kind: str, row_of) -> np.ndarray:
    table = np.zeros_like(schedule.actions[kind])
    slots = schedule.slot_ticks(kind)
    if slots:
        ticks = np.fromiter(slots.values(), int, len(slots))
        stages = np.fromiter((stage for stage, _, _ in slots), int, len(slots))
        table[ticks, stages] = [row_of(key) for key in slots]
    return table

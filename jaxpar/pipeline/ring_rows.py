"""Rows of a stage's residual ring: the fewest that hold every residual set (and kept cotangent) over its life.

`Schedule.ring_layout` gives each (stage, microbatch, chunk) the span of
positions in its stage's program from the forward that makes its residuals
to the last slot that reads them; this packs those spans into rows (an
interval graph: greedy by first position needs no more rows than the most
spans live at once), and zb-h1's kept cotangents into rows no residual set
holds at the time.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Rows of a stage's residual ring: how many, and which row each slot's residuals (and cotangent) use."""

    ring_rows: int
    rows: dict  # kind -> [ticks, stages] residual row
    cotangent_buffer_rows: int  # rows of a separate cotangent buffer (0: cotangents live in the ring)
    cotangent_rows: dict  # "B", "W" -> [ticks, stages] row of the kept cotangent, EMPTY where W takes B's directly


def allocate(spans: dict, placed: dict | None = None, shared: int = 0,
             placed_spans: dict | None = None) -> tuple[int, dict]:
    """(rows, label -> row) for labels (kind, stage, ...) held over (first, last) positions of their stage's program.

    Greedy by first position, which needs no more rows than the most spans
    live at once (an interval graph). Both ends are inclusive: a row freed at
    some position can be taken at a later one, in the same tick too. With
    `placed` (label -> row of `placed_spans`) a span may also take one of the
    first `shared` rows where no placed span overlaps it; a row numbered
    `shared + r` is then row r of the rows counted (those of its own).
    """
    spans_of = {}  # (stage, row) -> spans held
    for label, row in (placed or {}).items():
        if row < shared:
            spans_of.setdefault((label[1], row), []).append(placed_spans[label])
    rows, own = {}, {}
    for label in sorted(spans, key=lambda label: (label[1], spans[label][0])):
        first, last = spans[label]
        free = lambda key: all(b < first or a > last for a, b in spans_of.get(key, ()))  # noqa: E731
        row = next((r for r in range(shared) if free((label[1], r))), None)
        if row is None:
            taken = own.setdefault(label[1], [])
            r = next((r for r, until in enumerate(taken) if until < first), len(taken))
            if r == len(taken):
                taken.append(0)
            taken[r], row = last, shared + r
        else:
            spans_of.setdefault((label[1], row), []).append((first, last))
        rows[label] = row
    return max((len(taken) for taken in own.values()), default=0), rows

"""A schedule's ticks as (nested) scans: runs of ticks with the same slot kinds and loss head, repeats folded.

`jaxpar.pipeline.table_executor` runs each run as one `lax.scan` and each loop of
repeated runs as a scan around them, so the number of scans does not grow with
the microbatches, and ticks without a last-chunk output compute no loss head.
"""

from __future__ import annotations


def loops(schedule) -> tuple[tuple[int, int, tuple[tuple[int, tuple[str, ...], bool], ...]], ...]:
    """(start, repeats, runs): the ticks as scans, a run being (ticks, slot kinds, whether the head runs).

    Runs are the ticks cut where the slot kinds or the head change. A pair
    of runs repeated back to back (interleaved's steady ticks: the head on
    p ticks in every v*p) folds into one loop of `repeats` rounds, so ticks
    without a last-chunk output compute no head, and the number of scans
    does not grow with m. A run of one tick folds into the next where that
    one has its slot kinds and head (`_merge_single_ticks`).
    """
    runs = []
    for start, stop, kinds in schedule.segments:
        for t in range(start, stop):
            key = (kinds, bool("F" in kinds and schedule.head[t]))
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



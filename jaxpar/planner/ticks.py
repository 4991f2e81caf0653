"""What a pipeline schedule's tick table implies: ticks per step, the bubble, the activation sets (and ZB-H1's kept
cotangents) in flight, the permutes its scans send.

The figures are read off the tick tables jaxpar.pipeline.schedule builds, so
the planner counts exactly what the executor runs.
"""

from __future__ import annotations

import functools

from jaxpar.pipeline import schedule as schedule_lib
from jaxpar.planner.layout import Layout


def schedule_ticks(layout: Layout) -> int:
    """Forward ticks of the pipeline's tick table (each runs a chunk of L/(p v) layers on every stage): m + p - 1
    under GPipe, 1F1B and ZB-H1 (its forwards are 1F1B's)."""
    p, m, v = layout.pipe, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 1
    if layout.schedule == "interleaved":
        groups = -(-m // p)
        return (groups - 1) * v * p + (v - 1) * p + (m - 1 - (groups - 1) * p) + p
    return m + p - 1


def bubble(layout: Layout) -> float:
    """Idle share of a stage's slots: (p - 1) / (v m + p - 1) (GPipe, 1F1B; interleaved with v chunks); ZB-H1's
    2 (p - 1) / (3 m + 2 (p - 1)), its F, B and W slots weighed alike (the warm-up's p - 1 forwards and the
    cool-down's p - 1 input-backwards idle; its W slots fill 1F1B's other idle slots)."""
    p, m, v = layout.pipe, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 0.0
    if layout.schedule == "zb-h1":
        return 2 * (p - 1) / (3 * m + 2 * (p - 1))
    return (p - 1) / (v * m + p - 1)


def megatron_bubble(p: int, m: int, v: int = 1) -> float:
    """Megatron-LM (Narayanan et al. 2021): bubble time over ideal time, (p - 1) / (v m)."""
    return (p - 1) / (v * m)


def explicit_backward(layout: Layout) -> bool:
    """A pipeline whose backward slots are in the tick table (1F1B, interleaved, ZB-H1): residuals live in a ring."""
    return layout.pipe > 1 and layout.schedule in schedule_lib.EXPLICIT


@functools.lru_cache(maxsize=None)
def _ring_rows(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> int:
    """The residual ring's rows of a tick table (built once per shape: the enumeration asks often)."""
    return schedule_lib.Schedule(schedule, stages, microbatches, virtual_stages).in_flight


def in_flight(layout: Layout) -> int:
    """Chunk-sized activation sets a stage keeps at the peak (jaxpar.pipeline.executor's schedules).

    No pipeline: one microbatch. GPipe differentiates the tick scan, so every
    tick's residuals stay (bubble ticks too); 1F1B, interleaved and ZB-H1 keep
    the rows of their residual ring (at most 2p - 2 microbatches under 1F1B and
    ZB-H1, whose kept cotangents take rows no residual set holds at the time).
    """
    if layout.pipe == 1:
        return 1
    if explicit_backward(layout):
        return _ring_rows(layout.schedule, layout.pipe, layout.microbatches, layout.virtual_stages)
    return schedule_ticks(layout)


@functools.lru_cache(maxsize=None)
def _separate_cotangent_rows(stages: int, microbatches: int) -> int:
    """Rows of ZB-H1's cotangent buffer of its own: the kept cotangents that find no ring row free over their
    life (`Schedule.ring_layout`). With m >= 2p - 2 microbatches every one finds a row (slot_tables), so only
    the few-microbatch tables are placed; their labels number fewer than 2p^2."""
    if microbatches >= 2 * stages - 2:
        return 0
    return schedule_lib.Schedule("zb-h1", stages, microbatches).ring_layout().cotangent_buffer_rows


def cotangent_rows(layout: Layout) -> int:
    """Activation-sized rows of ZB-H1's separate cotangent buffer (jaxpar.pipeline.table_executor's "saved"), 0 for
    every other schedule: its B slots' cotangents kept for a W in a later tick live in ring rows no residual set
    holds; only those that find none (m < 2p - 2: max(0, 2p - 2 - m) of them) take a row of their own. (The
    ring holds them in a residual buffer of the activation's shape, as the layer scan's stacked inputs are:
    `jaxpar.pipeline.residual_ring.ResidualRing.holder`.)"""
    if layout.pipe == 1 or layout.schedule != "zb-h1":
        return 0
    return _separate_cotangent_rows(layout.pipe, layout.microbatches)


@functools.lru_cache(maxsize=None)
def _permutes(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> int:
    sched = schedule_lib.Schedule(schedule, stages, microbatches, virtual_stages)
    back = "B" if "B" in sched.actions else "BW"
    runs = [(n, repeats, kinds) for _, repeats, block in sched.loops for n, kinds, _ in block]
    count = sum(n * repeats * (("F" in kinds) + (back in kinds)) for n, repeats, kinds in runs)
    for i, (n, repeats, kinds) in enumerate(runs):
        if n * repeats == 1:  # a scan of one tick, unrolled: a send nothing later receives is dropped
            later = [k for _, _, ks in runs[i + 1:] for k in ks]
            count -= sum(kind in kinds and kind not in later for kind in ("F", back))
    return count


def permutes(layout: Layout) -> int:
    """Collective-permutes of one pass through an explicit tick table (1F1B, ZB-H1), from its scans
    (`Schedule.loops`): one per tick whose run has forward slots (activations on) and one per tick whose run has
    backward slots (cotangents back), less those of a one-tick scan whose result no later tick reads (XLA
    unrolls it and drops the send): 1F1B's last cool-down tick at p = 2, ZB-H1's last forward tick where m = p > 2.
    1F1B: 2 (m + p - 1) - [p = 2]; ZB-H1: 2 (m + p - 1) - [p = 2] - [m = p > 2]."""
    return _permutes(layout.schedule, layout.pipe, layout.microbatches, layout.virtual_stages)


@functools.lru_cache(maxsize=None)
def _weight_ticks(stages: int, microbatches: int) -> int:
    sched = schedule_lib.Schedule("zb-h1", stages, microbatches)
    return sum(n * repeats for _, repeats, block in sched.loops for n, kinds, _ in block if "W" in kinds)


def weight_ticks(layout: Layout) -> int:
    """Ticks of ZB-H1's scans with weight-backward (W) slots, 0 for the other schedules: each replays a chunk's
    stored VJP for its weight gradients, so the layers' backward collectives (Megatron's, ZeRO-3's gathers) run
    again there. m, and m + 1 at p = 2 (the one tick of F and B before the first W is scanned with W's)."""
    if layout.pipe == 1 or layout.schedule != "zb-h1":
        return 0
    return _weight_ticks(layout.pipe, layout.microbatches)

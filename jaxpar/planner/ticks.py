"""What a pipeline schedule's tick table implies: ticks per step, the bubble, the activation sets in flight.

The figures are read off the tick tables jaxpar.pipeline.schedule builds, so
the planner counts exactly what the executor runs.
"""

from __future__ import annotations

import functools

from jaxpar.pipeline import schedule as schedule_lib
from jaxpar.planner.layout import Layout


def schedule_ticks(layout: Layout) -> int:
    """Forward ticks of the pipeline's tick table (each runs a chunk of L/(p v) layers on every stage)."""
    p, m, v = layout.pipe, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 1
    if layout.schedule == "interleaved":
        groups = -(-m // p)
        return (groups - 1) * v * p + (v - 1) * p + (m - 1 - (groups - 1) * p) + p
    return m + p - 1


def bubble(layout: Layout) -> float:
    """Idle share of a stage's slots: (p - 1) / (v m + p - 1) (GPipe, 1F1B; interleaved with v chunks)."""
    p, m, v = layout.pipe, layout.microbatches, layout.virtual_stages
    return (p - 1) / (v * m + p - 1) if p > 1 else 0.0


def megatron_bubble(p: int, m: int, v: int = 1) -> float:
    """Megatron-LM (Narayanan et al. 2021): bubble time over ideal time, (p - 1) / (v m)."""
    return (p - 1) / (v * m)


def explicit_backward(layout: Layout) -> bool:
    """A pipeline whose backward slots are in the tick table (1F1B, interleaved): residuals live in a ring."""
    return layout.pipe > 1 and layout.schedule in schedule_lib.EXPLICIT


@functools.lru_cache(maxsize=None)
def _ring_rows(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> int:
    """The residual ring's rows of a tick table (built once per shape: the enumeration asks often)."""
    return schedule_lib.Schedule(schedule, stages, microbatches, virtual_stages).in_flight


def in_flight(layout: Layout) -> int:
    """Chunk-sized activation sets a stage keeps at the peak (jaxpar.pipeline.executor's schedules).

    No pipeline: one microbatch. GPipe differentiates the tick scan, so every
    tick's residuals stay (bubble ticks too); 1F1B and interleaved keep the rows
    of their residual ring (at most 2p - 2 microbatches under 1F1B).
    """
    if layout.pipe == 1:
        return 1
    if explicit_backward(layout):
        return _ring_rows(layout.schedule, layout.pipe, layout.microbatches, layout.virtual_stages)
    return schedule_ticks(layout)

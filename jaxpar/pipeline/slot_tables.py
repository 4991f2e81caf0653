"""Which microbatch each pipeline stage runs in each slot of each tick, per schedule.

`jaxpar.pipeline.schedule.Schedule` holds these tables; the executors run them.

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
"""

from __future__ import annotations

import numpy as np

EMPTY = -1  # an idle slot: a bubble


def gpipe_forward(p: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """gpipe: forward of j on stage i at tick i + j, chunk 0 (the backward is autodiff's, the forward reversed)."""
    forward = _steps(m + p - 1, p, m, np.arange(p))
    return forward, np.zeros_like(forward)


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


TABLES = {"1f1b": _interleaved, "interleaved": _interleaved, "zb-h1": _zb_h1}  # (actions, chunks) of (p, m, v)

"""The ring form of context-parallel attention, on one context rank's shard (inside the shard_map over `context`).

K/V blocks travel around the ring of context ranks with `ppermute` (C - 1
hops) and each rank folds one block at a time into an online softmax. Under
`balanced_order` rank c holds chunks c and 2C - 1 - c of the sequence, so
which (query chunk, key chunk) pairs of a step's block are visible depends
only on the rank and the step, never on the data: `block_plan` works it out
in Python, for every rank and step, as a table. Without a window the table
is the mirrored chunks' fixed pattern: a block of an earlier rank is seen
whole by both query chunks in its first chunk only; one of a later rank
whole by the second query chunk only; each step multiplies half the pairs,
unmasked. A sliding window hides whole sub-blocks (skipped, and a step no
rank sees anything of is not folded; the ring stops once none is left) and
cuts others (masked, every masked entry weighted exactly 0). Packed
documents' segment ids travel with K/V and mask every folded block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel import bits
from jaxpar.parallel.attention_math import MASKED, Scoring, finish, fold, on_scores, raw_scores, start, visible


def rank_positions(rank, ways: int, chunk: int):
    """Sequence positions of rank `rank`'s two chunks (chunk `rank` and its mirror 2·ways − 1 − rank)."""
    steps = jnp.arange(chunk)
    return jnp.concatenate([rank * chunk + steps, (2 * ways - 1 - rank) * chunk + steps])


@dataclasses.dataclass(frozen=True)
class Fold:
    """What one rank folds of one step's key block: per query chunk (own, mirror), the key chunks it sees
    (0: the block's first, 1: its mirror) and whether a mask cuts them (a window partly over them)."""

    keys: tuple[tuple[int, ...], tuple[int, ...]]
    cut: tuple[bool, bool]

    @property
    def empty(self) -> bool:
        return not any(self.keys)


def _sub_block(query_chunk: int, key_chunk: int, chunk: int, window: int | None) -> str:
    """'none', 'whole' or 'cut': how much of key chunk `key_chunk` query chunk `query_chunk` sees (different
    chunks: the causal mask is all or nothing; the window cuts by the distances (d·chunk ± (chunk − 1)))."""
    if query_chunk <= key_chunk:
        return "none"
    near, far = (query_chunk - key_chunk) * chunk - (chunk - 1), (query_chunk - key_chunk) * chunk + (chunk - 1)
    if window is None or far < window:
        return "whole"
    return "none" if near >= window else "cut"


def block_plan(ways: int, chunk: int, window: int | None) -> list[list[Fold]]:
    """plan[step][rank]: the `Fold` of rank `rank` at ring step `step` (1 .. ways − 1; row 0 is unused)."""
    plan: list[list[Fold]] = [[]]
    for step in range(1, ways):
        row = []
        for rank in range(ways):
            source = (rank - step) % ways
            status = [[_sub_block(q, kc, chunk, window) for kc in (source, 2 * ways - 1 - source)]
                      for q in (rank, 2 * ways - 1 - rank)]
            row.append(Fold(tuple(tuple(i for i, s in enumerate(r) if s != "none") for r in status),
                            tuple("cut" in r for r in status)))
        plan.append(row)
    return plan


def ring(q, k, v, segments=None, *, ways: int, axis: str, scoring: Scoring):
    """Ring attention of this rank's queries to every rank's keys: q [b, 2·chunk, heads, d], k, v likewise
    with kv_heads; `segments` [b, 2·chunk] (packed documents) or None."""
    chunk = q.shape[1] // 2
    rank = jax.lax.axis_index(axis)
    own = rank_positions(rank, ways, chunk)
    # The rank's own block first: without documents every query sees at least itself, so the running
    # peak is finite from the start; with them a padding query sees nothing, and its weights are masked.
    mask = on_scores(visible(own, own, scoring.window, segments, segments))
    state = start(jnp.where(mask, raw_scores(q, k, scoring), MASKED), v, None if segments is None else mask)
    plan = block_plan(ways, chunk, scoring.window)
    needed = [step for step in range(1, ways) if not all(f.empty for f in plan[step])]
    block = (k, v, segments)
    shift = [(j, (j + 1) % ways) for j in range(ways)]
    for step in range(1, max(needed, default=0) + 1):
        # Each hop depends on the last block only: free to overlap its use.
        block = (*bits.ppermute(block[:2], axis, shift),
                 None if segments is None else jax.lax.ppermute(block[2], axis, shift))
        if step not in needed:
            continue
        keys = rank_positions((rank - step) % ways, ways, chunk)
        folds = sorted(set(plan[step]), key=plan[step].index)
        branches = [functools.partial(_fold_block, f, scoring, q, own, segments, keys) for f in folds]
        if len(branches) == 1:
            state = branches[0](state, block)
        else:
            which = jnp.asarray(np.array([folds.index(f) for f in plan[step]], np.int32))[rank]
            state = jax.lax.switch(which, branches, state, block)
    out = finish(state, v.dtype, guarded=segments is not None)  # [b, kv_heads, group, q, head_dim]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(q.shape)


def _fold_block(plan: Fold, scoring: Scoring, q, q_pos, q_seg, k_pos, state, block):
    """`state` with the visible part of one key block folded in, as `plan` says."""
    if plan.empty:
        return state
    k, v, k_seg = block
    chunk = q.shape[1] // 2
    halves = (slice(None, chunk), slice(chunk, None))
    keys_of = lambda chosen: slice(None) if len(chosen) == 2 else halves[chosen[0]]  # noqa: E731
    if plan.keys[0] == plan.keys[1] and plan.cut[0] == plan.cut[1]:
        parts = [(slice(None), plan.keys[0], plan.cut[0])]  # both query chunks see the same keys: one fold
    else:
        parts = [(halves[h], plan.keys[h], plan.cut[h]) for h in range(2) if plan.keys[h]]
    for rows, chosen, cut in parts:
        cols = keys_of(chosen)
        scores = raw_scores(q[:, rows], k[:, cols], scoring)
        mask = None
        if cut or q_seg is not None:
            segments = () if q_seg is None else (q_seg[:, rows], k_seg[:, cols])
            mask = on_scores(visible(q_pos[rows], k_pos[cols], scoring.window, *segments))
            scores = jnp.where(mask, scores, MASKED)
        if rows == slice(None):
            state = fold(state, scores, v[:, cols], mask)
        else:
            folded = fold(tuple(x[:, :, :, rows] for x in state), scores, v[:, cols], mask)
            state = tuple(x.at[:, :, :, rows].set(f) for x, f in zip(state, folded))
    return state

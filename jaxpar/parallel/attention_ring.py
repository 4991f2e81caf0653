"""The ring form of context-parallel attention, on one context rank's shard (inside the shard_map over `context`).

K/V blocks travel around the ring of context ranks with `ppermute` (C - 1
hops) and each rank folds one block at a time into its result: the block's
flash attention (`jaxpar.parallel.attention_flash`), merged by log-sum-exp. Under
`balanced_order` rank c holds chunks c and 2C - 1 - c of the sequence, so
which (query chunk, key chunk) pairs of a step's block are visible depends
only on the rank and the step, never on the data: `block_plan` works it out
in Python, for every rank and step, as a table. Without a window the table
is the mirrored chunks' fixed pattern: a block of an earlier rank is seen
whole by both query chunks in its first chunk only; one of a later rank
whole by the second query chunk only; each step multiplies half the pairs.
A sliding window hides whole sub-blocks (skipped, and a step no rank sees
anything of is not folded; the ring stops once none is left); within a
sub-block flash attention masks, and skips block pairs the window hides.
Packed documents' segment ids travel with K/V and mask every folded block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel import bits
from jaxpar.parallel.attention_flash import Blocks, flash_attention, merge
from jaxpar.parallel.attention_math import Scoring, sink_weight


def rank_positions(rank, ways: int, chunk: int):
    """Sequence positions of rank `rank`'s two chunks (chunk `rank` and its mirror 2·ways − 1 − rank)."""
    steps = jnp.arange(chunk)
    return jnp.concatenate([rank * chunk + steps, (2 * ways - 1 - rank) * chunk + steps])


@dataclasses.dataclass(frozen=True)
class Fold:
    """What one rank folds of one step's key block: per query chunk (own, mirror), the key chunks it sees
    (0: the block's first, 1: its mirror)."""

    keys: tuple[tuple[int, ...], tuple[int, ...]]

    @property
    def empty(self) -> bool:
        return not any(self.keys)


def _sees(query_chunk: int, key_chunk: int, chunk: int, window: int | None) -> bool:
    """Whether query chunk `query_chunk` sees any of key chunk `key_chunk` (different chunks: the causal mask is
    all or nothing; the window hides a chunk whose nearest distance, d·chunk − (chunk − 1), reaches it)."""
    if query_chunk <= key_chunk:
        return False
    return window is None or (query_chunk - key_chunk) * chunk - (chunk - 1) < window


def block_plan(ways: int, chunk: int, window: int | None) -> list[list[Fold]]:
    """plan[step][rank]: the `Fold` of rank `rank` at ring step `step` (1 .. ways − 1; row 0 is unused)."""
    plan: list[list[Fold]] = [[]]
    for step in range(1, ways):
        row = []
        for rank in range(ways):
            source = (rank - step) % ways
            row.append(Fold(tuple(tuple(i for i, kc in enumerate((source, 2 * ways - 1 - source))
                                        if _sees(q, kc, chunk, window))
                                  for q in (rank, 2 * ways - 1 - rank))))
        plan.append(row)
    return plan


def ring(q, k, v, segments=None, *, ways: int, axis: str, scoring: Scoring, blocks: Blocks, sinks=None):
    """Ring attention of this rank's queries to every rank's keys: q [b, 2·chunk, heads, d], k, v likewise
    with kv_heads; `segments` [b, 2·chunk] (packed documents) or None. Each visible part of a key block is
    flash attention of its own (`blocks`), merged into the running result by log-sum-exp; `sinks` (this rank's
    heads' sink logits) join each row's denominator once every block is merged."""
    chunk = q.shape[1] // 2
    rank = jax.lax.axis_index(axis)
    own = rank_positions(rank, ways, chunk)
    out, lse = flash_attention(q, k, v, own, own, scoring, segments, segments, blocks, out_dtype=jnp.float32)
    state = (out, lse)
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
        branches = [functools.partial(_fold_block, f, scoring, blocks, q, own, segments, keys) for f in folds]
        if len(branches) == 1:
            state = branches[0](state, block)
        else:
            which = jnp.asarray(np.array([folds.index(f) for f in plan[step]], np.int32))[rank]
            state = jax.lax.switch(which, branches, state, block)
    out, lse = state
    return (out if sinks is None else out * sink_weight(lse, sinks)).astype(v.dtype)


def _fold_block(plan: Fold, scoring: Scoring, blocks: Blocks, q, q_pos, q_seg, k_pos, state, block):
    """`state` (out, lse) with the visible part of one key block merged in, as `plan` says."""
    if plan.empty:
        return state
    k, v, k_seg = block
    chunk = q.shape[1] // 2
    halves = (slice(None, chunk), slice(chunk, None))
    keys_of = lambda chosen: slice(None) if len(chosen) == 2 else halves[chosen[0]]  # noqa: E731
    if plan.keys[0] == plan.keys[1]:
        parts = [(slice(None), plan.keys[0])]  # both query chunks see the same keys: one call
    else:
        parts = [(halves[h], plan.keys[h]) for h in range(2) if plan.keys[h]]
    for rows, chosen in parts:
        cols = keys_of(chosen)
        segments = (None, None) if q_seg is None else (q_seg[:, rows], k_seg[:, cols])
        part = flash_attention(q[:, rows], k[:, cols], v[:, cols], q_pos[rows], k_pos[cols], scoring, *segments,
                               blocks, out_dtype=jnp.float32)
        if rows == slice(None):
            state = merge(state, part)
        else:
            out, lse = merge((state[0][:, rows], state[1][..., rows]), part)
            state = (state[0].at[:, rows].set(out), state[1].at[..., rows].set(lse))
    return state

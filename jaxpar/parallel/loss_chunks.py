"""The cross-entropy over chunks of tokens, so that one chunk's [tokens, vocab] logits exist at a time.

The fp32 logits and their gradient are the largest transients of a step at
long sequences and large vocabularies: 4,096 tokens x 32,000 columns is 0.5 GB
per row, and Llama 3's 128,256 columns at 8,192 tokens 4.2 GB. Computing the
per-token losses in `n` chunks, each under `jax.checkpoint` in a `lax.scan`,
keeps one chunk's logits alive in the forward and recomputes them in the
backward: 1/n of the memory for one more output-layer matmul.

A chunk takes every n-th position (position i*n + j is chunk j's i-th token),
not n contiguous ones: the sequence dimension is split into [seq/n, n] with
the major part keeping the sequence's sharding (over `context`, or `tensor`
under sequence parallelism), so a chunk needs no data moved between devices.
The loss is a sum over tokens, so which tokens share a chunk does not matter
as long as the targets are grouped the same way.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.core import usage
from jaxpar.core.trace import active_plan
from jaxpar.parallel.constrain import rule_axes

AUTO_CHUNK_BYTES = 128 * 2**20  # auto: the fewest chunks keeping one chunk's fp32 logits within this, per device
MIN_CHUNK_TOKENS = 256  # auto never cuts finer: below it the output layer's matmuls are too small to run well
SEQ_NAMES = ("seq", "seq_residual")


def token_losses(losses_of, x, targets, vocab_columns: int, chunks: int):
    """`losses_of(x, targets)` -> [batch, seq] per-token losses, computed in `chunks` (0: auto) chunks of tokens.

    `vocab_columns` is the output layer's columns on one device (for the auto
    choice). x is [batch, seq, d] and targets [batch, seq'] where seq' = seq
    times the sequence shards a caller's shard_map left whole in targets only.
    """
    n = count(x.shape, vocab_columns, chunks) if x.ndim == 3 and targets.ndim == 2 else 1
    if chunks and n == chunks:
        usage.mark(usage.LOSS_CHUNKS)
    if n == 1:
        return losses_of(x, targets)
    b, s, d = x.shape
    xs = jnp.moveaxis(x.reshape(b, s // n, n, d), 2, 0)
    ts = jnp.moveaxis(targets.reshape(b, targets.shape[1] // n, n), 2, 0)

    @jax.checkpoint
    def chunk(_, operands):
        return None, losses_of(*operands)

    _, losses = jax.lax.scan(chunk, None, (xs, ts))
    return jnp.moveaxis(losses, 0, 2).reshape(targets.shape)


def count(x_shape, vocab_columns: int, chunks: int) -> int:
    """How many chunks for x of `x_shape` inside the active plan (see `pick`)."""
    b, s, _ = x_shape
    shards = _seq_shards()
    if s % shards:  # not this function's to refuse: the sequence's sharding is checked where it is made
        return 1
    try:
        return pick(b // _batch_shards(), s // shards, vocab_columns, chunks)
    except ValueError as error:
        raise ValueError(f"{error} (the sequence's {s} positions split over {shards} device(s))") from None


def pick(rows: int, positions: int, vocab_columns: int, chunks: int = 0) -> int:
    """Chunks for one device's `rows` x `positions` tokens over `vocab_columns`: `chunks` when given (it must
    divide the positions), else the fewest dividing them that keep one chunk's fp32 logits in AUTO_CHUNK_BYTES,
    or, where none does, the most that leave MIN_CHUNK_TOKENS tokens a chunk."""
    if chunks:
        if positions % chunks:
            raise ValueError(f"loss_chunks={chunks} must divide each device's {positions} sequence positions")
        return chunks
    wanted = math.ceil(4 * rows * positions * vocab_columns / AUTO_CHUNK_BYTES)
    usable = [n for n in _divisors(positions) if rows * positions // n >= MIN_CHUNK_TOKENS]
    return next((n for n in usable if n >= wanted), usable[-1] if usable else 1)


@functools.cache
def _divisors(n: int) -> tuple[int, ...]:
    """Ascending (the planner asks for every layout it weighs)."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _seq_shards() -> int:
    """The devices x's sequence is split over (context; tensor under sequence parallelism) that its shape still
    counts: under a caller's shard_map a manual axis's shard is what x holds, and the targets are whole over it."""
    return _shards(SEQ_NAMES)


def _batch_shards() -> int:
    """The devices x's batch rows are split over that its shape still counts (the step's shard_map shows them local)."""
    return _shards(("batch",))


def _shards(names) -> int:
    plan = active_plan()
    if plan is None:
        return 1
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return math.prod(plan.shape[a] for a in {a for name in names for a in rule_axes(name)} - manual)

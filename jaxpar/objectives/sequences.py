"""Per-sequence log-probs out of a model's own loss: the cross-entropy's per-token losses handed to an objective.

A model's loss head calls `jaxpar.parallel.tensor.vocab_parallel_cross_entropy`
(every jaxpar model does); `reducing(fn)` makes that call give
fn(per-token losses [b, s], loss weights or None, order) instead of their mean,
so an objective over whole answers (DPO's summed log-probs, GRPO's per-token
ratios) needs no change to any model, family or strategy: the vocabulary split,
the loss chunks and the context order stay the cross-entropy's. `order(a)` puts
a [b, s] array laid out like the batch's targets into the order the losses
are in (context parallelism permutes the sequence). The batch's per-target
fields reach the head as documents (jaxpar.parallel.documents), so a pipeline
hands each stage's head its share of them with its share of the positions.

Under a pipeline each stage's head sees a share of the positions: `whole`
sums a stage's partial per-row sums over the stages, and `pipeline_value`
makes a nonlinear loss of those sums give each stage the gradient of its own
share (the pipeline averages the stages' values and scales each one's gradient
by 1/p).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.core import trace
from jaxpar.core.trace import active_plan

SIDES = "pair_sides"  # [b, s] per target: 1 a chosen answer's token, 2 a rejected answer's, 0 neither
REFERENCE = "reference_logps"  # [b, s] per target: the reference's log-prob of it (0 off the answers)
CHOSEN, REJECTED = 1, 2
PIPE = "pipe"


@contextlib.contextmanager
def reducing(fn: Callable):
    """Within: the model's cross-entropy returns fn(losses, weights, order) (see the module's docstring)."""
    with trace.scoped(token_reduction=fn):
        yield


def side_sums(values, sides):
    """(sum over each row's chosen-answer targets, over its rejected-answer targets), each [b], in fp32."""
    values = values.astype(jnp.float32)
    return (jnp.sum(jnp.where(sides == CHOSEN, values, 0.0), axis=-1),
            jnp.sum(jnp.where(sides == REJECTED, values, 0.0), axis=-1))


def answer_sums(losses, sides):
    """(chosen log-prob sums, rejected log-prob sums, chosen token counts, rejected token counts), each [b].

    `losses` are per-token cross-entropies (-log p of each target), `sides` the
    batch's SIDES in the same order.
    """
    chosen, rejected = side_sums(-losses.astype(jnp.float32), sides)
    chosen_tokens, rejected_tokens = side_sums(jnp.ones(sides.shape, jnp.float32), sides)
    return chosen, rejected, chosen_tokens, rejected_tokens


def pipeline_stages() -> int:
    """The pipe stages the head being traced shares the positions with (1: it sees them all)."""
    plan = active_plan()
    if plan is None or plan.shape.get(PIPE, 1) == 1 or PIPE not in jax.sharding.get_abstract_mesh().manual_axes:
        return 1
    return plan.shape[PIPE]


def whole(partial):
    """A stage's partial per-row sums summed over the stages, the gradient flowing to this stage's part only."""
    if pipeline_stages() == 1:
        return partial
    return jax.tree.map(lambda x: jax.lax.stop_gradient(jax.lax.psum(x, PIPE) - x) + x, partial)


def pipeline_value(loss):
    """A stage's value of a loss of `whole` sums: p L - (p - 1) L, so that the pipeline's mean over the stages is L
    and the 1/p it scales each stage's gradient by leaves that stage's share of L's gradient whole."""
    p = pipeline_stages()
    return loss if p == 1 else p * loss - (p - 1) * jax.lax.stop_gradient(loss)

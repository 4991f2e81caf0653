"""Per-sequence log-probs out of a model's own loss: the cross-entropy's per-token losses handed to an objective.

A model's loss head calls `jaxpar.parallel.tensor.vocab_parallel_cross_entropy`
(every jaxpar model does); `reducing(fn)` makes that call give
fn(per-token losses [b, s], loss weights or None, order) instead of their mean,
so an objective over whole answers (DPO's summed log-probs, GRPO's per-token
ratios) needs no change to any model, family or strategy: the vocabulary split,
the loss chunks and the context order stay the cross-entropy's. `order(a)` puts
a [b, s] array laid out like the batch's targets into the order the losses
are in (context parallelism permutes the sequence).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax.numpy as jnp

from jaxpar.core import trace
from jaxpar.core.trace import active_plan

SIDES = "pair_sides"  # [b, s] per target: 1 a chosen answer's token, 2 a rejected answer's, 0 neither
REFERENCE = "reference_logps"  # [b, 2]: the reference's summed log-probs of each row's chosen and rejected answer
CHOSEN, REJECTED = 1, 2


@contextlib.contextmanager
def reducing(fn: Callable):
    """Within: the model's cross-entropy returns fn(losses, weights, order) (see the module's docstring)."""
    plan = active_plan()
    if plan is not None and plan.shape.get("pipe", 1) > 1:
        raise ValueError(f"a sequence objective (DPO, SimPO, ORPO) does not run under pipe={plan.shape['pipe']} yet: "
                         "its loss head sees a share of the positions there; use a plan without pipe")
    with trace.scoped(token_reduction=fn):
        yield


def answer_sums(losses, sides):
    """(chosen log-prob sums, rejected log-prob sums, chosen token counts, rejected token counts), each [b].

    `losses` are per-token cross-entropies (-log p of each target), `sides` the
    batch's SIDES in the same order.
    """
    logps = -losses.astype(jnp.float32)
    chosen, rejected = sides == CHOSEN, sides == REJECTED
    return (jnp.sum(jnp.where(chosen, logps, 0.0), axis=-1), jnp.sum(jnp.where(rejected, logps, 0.0), axis=-1),
            jnp.sum(chosen, axis=-1).astype(jnp.float32), jnp.sum(rejected, axis=-1).astype(jnp.float32))

"""Packed documents: the segment ids, positions and loss weights of the rows being traced.

A batch of packed documents carries, besides `inputs` and `targets` [batch, seq],
any of `segment_ids` (which document each token belongs to, 1, 2, ... per row;
0 marks padding), `positions` (each token's position inside its document, for
rotary embeddings) and `loss_weights` (each target's weight in the loss: 0 for
padding and prompt tokens). The train step sets them around the model's call
(`scope`); the pipeline re-scopes each microbatch's share. The library's layers
read them from the trace, so a model built from them needs no change to train
on documents:

- `jaxpar.parallel.attention.causal_attention` keeps attention inside each
  document, and `attention.positions` returns the documents' positions;
- `jaxpar.parallel.tensor.vocab_parallel_cross_entropy` weights each token;
- a training step with LoRA dropout adds `lora_dropout_seeds`, one per token,
  which its mask is drawn from (jaxpar.parallel.lora_dropout);
- a preference batch adds `pair_sides` (which answer each target belongs to)
  and may add `reference_logps` (the reference's log-prob of each target),
  read by the objective the cross-entropy hands its losses to (jaxpar.objectives).

`loss_weights`, `pair_sides` and `reference_logps` are laid out like the
targets (`TARGET_FIELDS`): the loss head reads them, in the targets' order;
the others are the inputs' and the layers read them.

Arrays here are in the batch's natural sequence order and hold the same rows as
the tokens the model is called with; the layers put them in context order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import jax

from jaxpar.core import trace

FIELDS = ("segment_ids", "positions", "loss_weights", "lora_dropout_seeds", "pair_sides", "reference_logps")
TARGET_FIELDS = ("loss_weights", "pair_sides", "reference_logps")  # per target, read by the loss head


def of_batch(batch) -> dict[str, jax.Array]:
    """The document fields a batch dict carries (an empty dict for a plain batch or a non-dict batch)."""
    if not isinstance(batch, Mapping):
        return {}
    return {name: batch[name] for name in FIELDS if name in batch}


@contextlib.contextmanager
def scope(fields: Mapping[str, jax.Array] | None):
    """Within: the library's layers see these document fields (None or empty: none, a plain batch)."""
    with trace.scoped(documents=dict(fields) if fields else None):
        yield


def current() -> dict[str, jax.Array]:
    """The document fields of the rows being traced (empty outside a scope)."""
    return trace.current().documents or {}


def get(name: str) -> jax.Array | None:
    """One field of the rows being traced, or None."""
    return current().get(name)

"""Megatron-style tensor-parallel building blocks, written against logical names.

Column-parallel: the output features are split (no communication forward).
Row-parallel: the input features are split, the partial sums are combined over
`tensor` (an all-reduce, or a reduce-scatter under sequence parallelism).
In this annotation form XLA places the collectives from sharding constraints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.rules import constrain


def column_parallel(x, w, equation: str, out_logical):
    """x @ W with W split along its output features; the result stays split."""
    return constrain(jnp.einsum(equation, x, w), out_logical)


def row_parallel(x, w, equation: str, out_logical):
    """x @ W with W split along its input features; partial sums combined over tensor."""
    return constrain(jnp.einsum(equation, x, w), out_logical)


def enter_tensor_region(x):
    """Entry of a tensor-parallel region: the full sequence on every tensor rank."""
    return constrain(x, ("batch", "seq", "embed"))


def embedding_lookup(tokens, table):
    """Token embedding from a table that may be split along the vocabulary."""
    return jnp.take(table, tokens, axis=0)


def vocab_parallel_cross_entropy(x, w, targets):
    """Mean cross-entropy of x @ w against targets; logits stay split along vocab.

    The target logit is picked with a one-hot product rather than a gather, so
    the reduction over the vocabulary is a sum across shards, never a gather.
    """
    logits = constrain(jnp.einsum("bsd,dv->bsv", x, w).astype(jnp.float32), ("batch", "seq", "vocab"))
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return jnp.mean(log_norm - target_logit)

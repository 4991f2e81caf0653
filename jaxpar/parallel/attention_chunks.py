"""Chunked causal attention (Llama 4's local layers): a query sees the earlier keys of its own chunk of C positions.

A chunk is a document of its own: the segment ids the attention reads (`jaxpar.parallel.documents`) are
replaced, for this call only, by ids that tell (document, position // C) pairs apart, and the library's
causal attention keeps each query inside its id. So every form of it (flash, fused kernels, context
parallelism's all-gather and ring) serves the chunks unchanged, and packed documents keep their own
chunks, counted from each document's first position, as each would have alone.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxpar.parallel import documents
from jaxpar.parallel.attention import causal_attention


def chunk_segments(segment_ids, positions, chunk: int):
    """Segment ids [batch, seq] that differ between documents and between chunks of one document's positions
    (0, padding, stays 0)."""
    per_document = positions.shape[-1] // chunk + 1  # more than the chunks any position of the rows reaches
    return jnp.where(segment_ids > 0, segment_ids * per_document + positions // chunk + 1, 0).astype(jnp.int32)


def chunked_causal_attention(q, k, v, *, chunk: int, **options):
    """`causal_attention(q, k, v, **options)` with each query seeing only keys of its chunk of `chunk` positions.

    q: [batch, seq, heads, head_dim], the whole sequence (in context order under context parallelism; the
    segment ids given here are in natural order, as the documents' fields are).
    """
    fields = documents.current()
    batch, seq = q.shape[:2]
    segments = fields.get("segment_ids")
    segments = jnp.ones((batch, seq), jnp.int32) if segments is None else segments
    positions = fields.get("positions")
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)) if positions is None else positions
    with documents.scope({**fields, "segment_ids": chunk_segments(segments, positions, chunk)}):
        return causal_attention(q, k, v, **options)

"""A batch cut into microbatches, for gradient accumulation and for the pipeline alike."""

from __future__ import annotations

import jax


def microbatches(batch: dict, k: int) -> dict:
    """Split every [B, ...] leaf into [k, B/k, ...]; microbatch j takes rows j, j+k, ...

    Strided rows keep each device's share of every microbatch local, so the
    split needs no communication whatever the batch sharding.
    """
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)

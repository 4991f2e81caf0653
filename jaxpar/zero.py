"""ZeRO sharding over `data`: which dimension of each array takes the data axis."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P


def add_data_axis(spec: P, shape, plan) -> P:
    """Shard one more dimension of `shape` over `data`, if one divides; else keep `spec`.

    Picks the largest dimension not already sharded whose size divides by the
    data axis, so tensor-parallel dimensions are never sharded twice.
    """
    data = plan.shape["data"]
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
    if data == 1 or "data" in used:
        return spec
    free = [d for d, e in enumerate(entries) if e is None and shape[d] % data == 0]
    if not free:
        return spec
    dim = max(free, key=lambda d: shape[d])
    entries[dim] = "data"
    return P(*entries)

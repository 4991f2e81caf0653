"""An export written by several processes: which Hugging Face tensors each one writes, and the waits between them.

Each process writes one safetensors file of its own share, disjoint from the others': a contiguous run of the
tensors in file order (embeddings, then layer by layer), cut where the bytes before reach its fraction of the
total, so the shares are about equal and a process reads whole layers (each from the checkpoint's shared files,
as one process does). Process 0 writes `config.json` and the index naming every file once all have
written theirs.
"""

from __future__ import annotations

import math

import jax


def shares(shapes: dict[str, tuple[int, ...]], itemsize: int, processes: int) -> list[dict[str, tuple[int, ...]]]:
    """`shapes` (name -> shape, in file order) cut into `processes` contiguous runs of about equal bytes; a run may
    be empty where one tensor outweighs a share."""
    sizes = [math.prod(shape) * itemsize for shape in shapes.values()]
    total, before, runs = sum(sizes), 0, [{} for _ in range(processes)]
    for (name, shape), size in zip(shapes.items(), sizes):
        runs[min(processes - 1, (2 * before + size) * processes // (2 * max(total, 1)))][name] = shape  # its middle
        before += size
    return runs


def barrier(name: str) -> None:
    """Wait until every process of the job reaches `name` (nothing to wait for in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)

"""Batches read ahead of the training step by worker threads, through a bounded window.

Reading a batch (numpy windows of a memory-mapped stream, then host-to-device)
is host work the step need not wait for: while step N runs, workers read steps
N+1... Results come back in step order and an error (a bad batch) is raised at
the step it belongs to. At most `depth` batches are held ahead, so memory stays bounded.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def prefetched(read: Callable[[int], T], steps: Iterable[int], workers: int = 1, depth: int | None = None
               ) -> Iterator[T]:
    """`read(step)` for each step, in order; with `workers` > 0 read up to `depth` (default 2 x workers) ahead."""
    if workers < 0:
        raise ValueError(f"data workers must be 0 or more, got {workers}")
    if workers == 0:
        yield from map(read, steps)
        return
    depth = depth or 2 * workers
    pending = collections.deque()
    steps = iter(steps)
    with ThreadPoolExecutor(workers, thread_name_prefix="jaxpar-data") as pool:
        try:
            for step in steps:
                pending.append(pool.submit(read, step))
                if len(pending) >= depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:  # the consumer stopped early (preemption, an error): drop what was read ahead
                future.cancel()

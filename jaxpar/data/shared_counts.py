"""Packed blocks' row counts shared between a run's processes through the JAX coordination service.

Which block holds a row of a global batch depends on the row counts of the
blocks before it in the epoch's order (`jaxpar.data.block_packing`), and a
count is known only once its block is tokenized and packed. Alone, every
process would tokenize every block before its own rows; shared, each block has
one owner (block b: process b mod n) that packs it, the others read its count
from the coordination service's key-value store (the one `jax.distributed`
already runs), so a process tokenizes its own blocks and the blocks holding
its rows, not the whole prefix.

No process waits forever for a count: every process walks the counts up to the
end of each global batch it reads (not only to its own rows), and the owner of
each block on that walk is walking it too.
"""

from __future__ import annotations

import threading
from typing import Protocol

WAIT_S = 30 * 60  # how long a process waits for another's count (that process is slow, or dead: the launcher sees it)


class KeyValueStore(Protocol):
    """The part of a key-value store the counts need (`CoordinationStore`, or a dict-backed one in tests)."""

    def set(self, key: str, value: str) -> None: ...

    def try_get(self, key: str) -> str | None: ...

    def wait(self, key: str, timeout_s: float) -> str: ...


class CoordinationStore:
    """The coordination service's key-value store of this `jax.distributed` run."""

    def __init__(self):
        from jax._src.distributed import global_state

        self._client = global_state.client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

    def try_get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - the client raises (NOT_FOUND) for a key not yet set
            return None

    def wait(self, key: str, timeout_s: float) -> str:
        return self._client.blocking_key_value_get(key, int(timeout_s * 1000))


class SharedCounts:
    """Row counts of one `BlockBatches`' blocks, each packed by its owner and read by the other processes."""

    def __init__(self, store: KeyValueStore, namespace: str, process: int, processes: int, wait_s: float = WAIT_S):
        self.store, self.namespace, self.process, self.processes, self.wait_s = store, namespace, process, processes, wait_s
        self._published: set[int] = set()
        self._lock = threading.Lock()

    def owns(self, block: int) -> bool:
        return block % self.processes == self.process

    def _key(self, block: int) -> str:
        return f"jaxpar/block-rows/{self.namespace}/{block}"

    def publish(self, block: int, rows: int) -> None:
        """Say block `block` packs into `rows` rows (once, by its owner)."""
        with self._lock:
            if block in self._published:
                return
            self._published.add(block)
        self.store.set(self._key(block), str(rows))

    def get(self, block: int) -> int | None:
        """The count of `block` if its owner has published it, else None (without waiting)."""
        value = self.store.try_get(self._key(block))
        return None if value is None else int(value)

    def wait(self, block: int) -> int:
        """The count of `block`, waiting for its owner to publish it."""
        try:
            return int(self.store.wait(self._key(block), self.wait_s))
        except Exception as error:  # noqa: BLE001 - the client's timeout error: say what was awaited
            raise RuntimeError(f"process {self.process} waited {self.wait_s:.0f} s for the row count of block {block} "
                               f"of {self.namespace}, which process {block % self.processes} packs; that process "
                               f"is stuck or gone ({error})") from error


def shared_counts(namespace: str) -> SharedCounts | None:
    """The counts shared by this run's processes (None in a one-process run)."""
    import jax

    if jax.process_count() == 1:
        return None
    return SharedCounts(CoordinationStore(), namespace, jax.process_index(), jax.process_count())

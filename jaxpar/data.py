"""Token sources and deterministic, indexable batches assembled into global jax Arrays.

Batch `i` is a pure function of (seed, i): random windows of the token stream.
So a run's data position is just its step, the same seed gives the same global
batches on any mesh and device count, and a resumed run sees exactly the
batches it would have seen.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text", ".py", ".json", ".csv", ".html", ".tex"}


def default_corpus() -> np.ndarray:
    """The Python language reference topics that ship with CPython, as byte tokens.

    Real English prose (~450 KB) present on every machine with Python, so
    `jaxpar train` needs no download.
    """
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def load_tokens(path: str | Path | None) -> np.ndarray:
    """Tokens from a text file or folder of text files (bytes), `.npy` or `.bin` (uint16) token files."""
    if path is None:
        return default_corpus()
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--data {str(path)!r} does not exist")
    if path.suffix == ".npy":
        tokens = np.load(path, allow_pickle=False)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"--data {str(path)!r}: expected a 1-D integer token array, got {tokens.dtype}{list(tokens.shape)}")
    elif path.suffix == ".bin":
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
        data = b"\n\n".join(p.read_bytes() for p in files)
        if path.is_file() and b"\x00" in data[:4096]:
            raise ValueError(f"--data {str(path)!r} is not a text file (it holds NUL bytes); use .npy or .bin for tokens")
        tokens = np.frombuffer(data, dtype=np.uint8)
    if tokens.size == 0:
        raise ValueError(f"--data {str(path)!r} holds no text or tokens")
    return tokens


@dataclasses.dataclass(frozen=True)
class Batches:
    """Global batches of `batch_size` windows of `seq_len + 1` tokens, indexed by step."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self):
        if self.tokens.size < self.seq_len + 2:
            raise ValueError(f"data has {self.tokens.size} tokens, fewer than one window of seq_len+1={self.seq_len + 1}")

    def check_vocab(self, vocab: int) -> None:
        largest = int(self.tokens.max())
        if largest >= vocab:
            raise ValueError(f"data holds token id {largest} but the model's vocabulary has only {vocab} entries")

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.batch_size)

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Rows lo:hi of the global batch of `step`: {"inputs", "targets"} int32 [rows, seq_len]."""
        starts = self.starts(step)[lo:hi]
        windows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1]) for s in starts]).astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step)


def global_batch(batches: Batches, step: int, sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
    """The batch of `step` as global arrays; each process loads only the rows its devices hold."""
    shape = (batches.batch_size, batches.seq_len)
    index = sharding.addressable_devices_indices_map(shape)
    rows = [idx[0] for idx in index.values()]
    lo = min(r.start or 0 for r in rows)
    hi = max(shape[0] if r.stop is None else r.stop for r in rows)
    local = batches.rows(step, lo, hi)
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}

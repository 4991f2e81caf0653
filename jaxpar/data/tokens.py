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

BIN_DTYPE = "<u2"
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
    try:
        tokens = _read(path)
    except OSError as error:
        raise ValueError(f"--data {str(path)!r} cannot be read: {error.strerror or error}") from None
    if tokens.size == 0:
        raise ValueError(f"--data {str(path)!r} holds no text or tokens")
    return tokens


def _read(path: Path) -> np.ndarray:
    """The tokens of an existing path, read as its suffix says."""
    if path.suffix in (".npy", ".bin") and not path.is_file():
        raise ValueError(f"--data {str(path)!r} is a directory, not a {path.suffix} token file")
    if path.suffix == ".npy":
        return _load_npy(path)
    if path.suffix == ".bin":
        return _load_bin(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
    data = b"\n\n".join(p.read_bytes() for p in files)
    if path.is_file() and b"\x00" in data[:4096]:
        raise ValueError(f"--data {str(path)!r} is not a text file (it holds NUL bytes); use .npy or .bin for tokens")
    return np.frombuffer(data, dtype=np.uint8)


def _load_npy(path: Path) -> np.ndarray:
    """A `.npy` token array, memory-mapped; anything else named `.npy` is refused by name, never unpickled."""
    with path.open("rb") as f:
        if f.read(len(np.lib.format.MAGIC_PREFIX)) != np.lib.format.MAGIC_PREFIX:
            raise ValueError(f"--data {str(path)!r} is not a .npy file (no numpy header); write token ids with numpy.save")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise ValueError(f"--data {str(path)!r} is not a readable .npy token array ({error})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"--data {str(path)!r}: expected a 1-D integer token array, got {tokens.dtype}{list(tokens.shape)}")
    return tokens


def _load_bin(path: Path) -> np.ndarray:
    """A `.bin` file of little-endian uint16 token ids (the nanoGPT layout), memory-mapped."""
    size, width = path.stat().st_size, np.dtype(BIN_DTYPE).itemsize
    if size % width:
        raise ValueError(
            f"--data {str(path)!r}: a .bin file holds {np.dtype(BIN_DTYPE).name} token ids of {width} bytes each, "
            f"but its size, {size} bytes, is not a multiple of {width}; the file is truncated or not a token file"
        )
    return np.memmap(path, dtype=BIN_DTYPE, mode="r") if size else np.zeros(0, BIN_DTYPE)


def check_vocab(tokens: np.ndarray, vocab: int, source: str | Path | None) -> None:
    """Refuse token ids outside [0, vocab) anywhere in `tokens` (a full scan: `jaxpar eval`'s held-out tail)."""
    _refuse_outside(tokens, vocab, source, "")


def check_batch_vocab(windows: np.ndarray, vocab: int, source: str | Path | None, step: int) -> None:
    """Refuse token ids outside [0, vocab) in one batch: a start-up check that reads no more than the batch."""
    _refuse_outside(windows, vocab, source, f" in the batch of step {step}")


SCAN_CHUNK = 1 << 26  # ids per pass of `check_token_file` (128 MiB of uint16 at a time)


def check_token_file(tokens: np.ndarray, vocab: int, source: str | Path) -> None:
    """Refuse a token file with an id outside [0, vocab) anywhere, at start-up, naming its first such token (1-based).

    One pass for the largest id (the smallest too where the dtype is signed), skipped where the dtype cannot
    hold an id past the vocabulary: a 1 GiB uint16 file takes a tenth of a second from the page cache.
    """
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab:
        return
    for lo in range(0, tokens.size, SCAN_CHUNK):
        part = np.asarray(tokens[lo:lo + SCAN_CHUNK])
        if part.max() < vocab and (info.min >= 0 or part.min() >= 0):
            continue
        at = lo + int(np.argmax((part < 0) | (part >= vocab)))
        _refuse_outside(tokens, vocab, source, f"; the first is token {at + 1:,} of {tokens.size:,} (1-based)")


class BadBatch(ValueError):
    """A batch the model cannot take (token ids outside its vocabulary), found when the batch is read."""


def _refuse_outside(tokens: np.ndarray, vocab: int, source: str | Path | None, where: str) -> None:
    """Token ids outside [0, vocab) are refused by name: an embedding lookup would silently wrap or clip them."""
    low, high = int(tokens.min()), int(tokens.max())
    if low >= 0 and high < vocab:
        return
    bad = np.unique(np.asarray(tokens[(tokens < 0) | (tokens >= vocab)]))
    shown = ", ".join(map(str, bad[:5])) + (f", ... ({bad.size} distinct values)" if bad.size > 5 else "")
    name = "the built-in corpus" if source is None else f"--data {str(source)!r}"
    raise BadBatch(
        f"{name} holds token ids outside the model's vocabulary [0, {vocab}): {shown} "
        f"(smallest {low}, largest {high}){where}; re-tokenize for this vocabulary or choose a model whose vocab covers them"
    )


@dataclasses.dataclass(frozen=True)
class Batches:
    """Global batches of `batch_size` windows of `seq_len + 1` tokens, indexed by step."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0
    vocab: int | None = None  # token ids are checked against it per batch when given
    source: str | None = None  # the --data the tokens came from, for the check's message

    def __post_init__(self):
        if self.tokens.size < self.seq_len + 2:
            raise ValueError(f"data has {self.tokens.size} tokens, fewer than one window of seq_len+1={self.seq_len + 1}")

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.batch_size)

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Rows lo:hi of the global batch of `step`: {"inputs", "targets"} int32 [rows, seq_len]."""
        starts = self.starts(step)[lo:hi]
        windows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1]) for s in starts])
        if self.vocab is not None:
            check_batch_vocab(windows, self.vocab, self.source, step)
        windows = windows.astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step)


def local_rows(sharding: jax.sharding.NamedSharding, shape: tuple[int, int]) -> tuple[int, int]:
    """(lo, hi): the rows of a global batch of `shape` that this process's devices hold under `sharding`."""
    rows = [idx[0] for idx in sharding.addressable_devices_indices_map(shape).values()]
    return min(r.start or 0 for r in rows), max(shape[0] if r.stop is None else r.stop for r in rows)


def global_batch(batches: Batches, step: int, sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
    """The batch of `step` as global arrays; each process loads only the rows its devices hold."""
    shape = (batches.batch_size, batches.seq_len)
    local = batches.rows(step, *local_rows(sharding, shape))
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}

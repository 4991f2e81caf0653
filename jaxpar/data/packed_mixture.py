"""A weighted mixture of packed document sources that keeps each source's own epochs.

Every chunk of `CHUNK` consecutive positions of the run's endless row sequence
holds exactly n_j rows of source j (n_j: `CHUNK * w_j` rounded by largest
remainder, so they sum to `CHUNK`), in an order shuffled by (seed, chunk).
The k-th row the mixture takes from source j is then position k of that
source's own row sequence (`jaxpar.data.block_packing.BlockBatches`): every
source visits its documents once per epoch in its seeded order, however the
sources interleave, and where source j's k-th row falls is found from one chunk
(`c * n_j` rows in the chunks before, plus a count inside chunk c) rather than
from every earlier draw. A batch is thus a pure function of (seed, step, the
sources and weights) on any mesh and process count, as every loader here.
Weights hold exactly per chunk, not only in expectation.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxpar.data.block_packing import BlockBatches

CHUNK = 1024  # positions per chunk: weights hold exactly over each (a weight under 1/CHUNK gets no rows: refused)


class PackedMixture:
    """Global batches of packed rows of `sources` (BlockBatches, one per --data entry) mixed by `weights`."""

    def __init__(self, sources: list[BlockBatches], weights, names, batch_size: int, seed: int = 0):
        self.sources, self.names, self.batch_size, self.seed = list(sources), list(names), batch_size, seed
        self.seq_len = self.sources[0].seq_len
        self.weights = np.asarray(weights, np.float64) / np.sum(weights)
        self.quota = _largest_remainder(self.weights, CHUNK)
        starved = [name for name, n in zip(self.names, self.quota) if n == 0]
        if starved:
            raise ValueError(f"--data weights give {', '.join(map(str, starved))} no row in {CHUNK}: a source's "
                             f"weight must be at least 1/{CHUNK} of the total")

    @functools.lru_cache(maxsize=8)
    def _chunk(self, chunk: int) -> np.ndarray:
        """The source of each position of `chunk`: n_j of source j, shuffled by (seed, chunk)."""
        sources = np.repeat(np.arange(len(self.sources)), self.quota)
        return np.random.default_rng([self.seed, chunk]).permutation(sources)

    def assignment(self, position: int) -> tuple[int, int]:
        """(source j, position within source j's own rows) of `position` of the mixture's row sequence."""
        chunk, at = divmod(position, CHUNK)
        sources = self._chunk(chunk)
        j = int(sources[at])
        return j, chunk * int(self.quota[j]) + int(np.count_nonzero(sources[:at] == j))

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Rows lo:hi of the global batch of `step`: inputs/targets (int32) and the document fields."""
        first = step * self.batch_size
        everyone = [self.assignment(p) for p in range(first, first + self.batch_size)]
        for j, source in enumerate(self.sources):  # processes sharing counts walk each source to the batch's end
            if source.shared is not None and any(i == j for i, _ in everyone):
                source.count_through(max(k for i, k in everyone if i == j))
        drawn = everyone[lo:hi]
        picked = [self.sources[j].rows_at([k], step) for j, k in drawn]
        rows = {name: np.concatenate([row[name] for row in picked]) for name in picked[0]}
        if lo == 0 and hi in (None, self.batch_size) and not rows["loss_weights"].any():
            raise ValueError(f"--data {', '.join(map(str, self.names))}: the batch of step {step} has no target to "
                             "train on (its documents are one token each, or its records' completions are empty)")
        return rows

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step)

    def taken(self, position: int) -> list[int]:
        """Rows of each source among the first `position` rows of the mixture's row sequence."""
        chunk, at = divmod(position, CHUNK)
        inside = np.bincount(self._chunk(chunk)[:at], minlength=len(self.sources))
        return [chunk * int(n) + int(k) for n, k in zip(self.quota, inside)]

    def source_epochs(self, step: int) -> dict[str, float]:
        """How far through its own data each source is after `step` batches, by source name."""
        return {str(name): source.epoch_at(rows)
                for name, source, rows in zip(self.names, self.sources, self.taken(step * self.batch_size))}

    def row_counts(self) -> list[list[int]]:
        """Each source's known block row counts (`BlockBatches.row_counts`), as checkpoints keep them."""
        return [source.row_counts() for source in self.sources]

    def learn_saved_counts(self, saved: list[list[int]], where: str) -> None:
        if len(saved) != len(self.sources):
            raise ValueError(f"{where} counted the blocks of {len(saved)} sources, this mixture has {len(self.sources)}")
        for source, counts in zip(self.sources, saved):
            source.learn_saved_counts(counts, where)

    def order(self) -> dict:
        """How the run orders its data, as its checkpoints record it (`jaxpar.data.epochs.data_order`)."""
        return {"order": "packed mixture", "rows": [len(s.source) for s in self.sources],
                "weights": [int(n) for n in self.quota], "chunk": CHUNK,
                "drawn_by": "per chunk of positions, n_j rows of source j shuffled by default_rng([seed, chunk]); "
                            "source j's k-th row is its own block order's position k"}


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer shares of `total` proportional to `weights`, summing to `total` (largest remainder)."""
    exact = weights * total
    shares = np.floor(exact).astype(np.int64)
    shares[np.argsort(-(exact - shares), kind="stable")[: total - int(shares.sum())]] += 1
    return shares

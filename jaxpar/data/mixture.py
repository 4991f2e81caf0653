"""A weighted mixture of token streams: each batch row comes from one source, drawn with the given probabilities.

Like `Batches`, batch `i` is a pure function of (seed, i) and of the sources'
order and weights, so a resumed run and any mesh see the same rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.data.tokens import check_batch_vocab


@dataclasses.dataclass(frozen=True)
class MixtureBatches:
    """Global batches of `batch_size` windows of `seq_len + 1` tokens; row r's source is drawn by `weights`."""

    streams: tuple[np.ndarray, ...]
    weights: tuple[float, ...]
    names: tuple[str, ...]
    batch_size: int
    seq_len: int
    seed: int = 0
    vocab: int | None = None  # checked per batch when given

    def __post_init__(self):
        for stream, name in zip(self.streams, self.names):
            if stream.size < self.seq_len + 2:
                raise ValueError(f"--data {name!r} has {stream.size} tokens, fewer than one window of "
                                 f"seq_len+1={self.seq_len + 1}")

    def draws(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window start) of every row of the batch of `step`."""
        rng = np.random.default_rng([self.seed, step])
        p = np.asarray(self.weights, np.float64) / sum(self.weights)
        which = rng.choice(len(self.streams), size=self.batch_size, p=p)
        highs = np.asarray([s.size - self.seq_len - 1 for s in self.streams])
        return which, rng.integers(0, highs[which])

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Rows lo:hi of the global batch of `step`: {"inputs", "targets"} int32 [rows, seq_len]."""
        which, starts = (a[lo:hi] for a in self.draws(step))
        windows = [np.asarray(self.streams[w][s : s + self.seq_len + 1]) for w, s in zip(which, starts)]
        if self.vocab is not None:
            for w in np.unique(which):
                check_batch_vocab(np.stack([x for x, v in zip(windows, which) if v == w]), self.vocab,
                                  self.names[w], step)
        stacked = np.stack(windows).astype(np.int32)
        return {"inputs": stacked[:, :-1], "targets": stacked[:, 1:]}

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step)

"""Epochs: every row of a row table once per epoch, in an order shuffled by the seed, new each epoch.

`jaxpar train --epochs E` reads its data this way instead of random windows.
The order is grain's random-access `IndexSampler` (a shuffle that computes the
record at any position without materialising a permutation): the global batch
of step `s` holds the records at positions `s * batch_size + r` of an endless
sequence of epochs, each epoch a whole permutation of the rows. A batch is
therefore still a pure function of (seed, step) and of the table's length, so a
resumed run sees exactly the batches it would have seen, on any mesh and any
number of processes, and each process reads only its own rows.

An epoch does not have to end on a batch boundary: the last batch of an epoch
is filled with the first rows of the next epoch's order (so each epoch's
permutation is whole and no row is dropped or repeated within an epoch). With
fewer rows than `batch_size`, one batch spans several epochs.

grain's epoch `e` is shuffled with seed `seed + e`, so seed 0's second epoch is
seed 1's first: runs with nearby seeds share epoch orders, shifted by one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jaxpar.core.spelling import name as option_name
from jaxpar.data.tokens import check_batch_vocab

if TYPE_CHECKING:  # grain (and the Orbax it imports) is a second of start-up: imported where a sampler is made
    from grain.python import IndexSampler

TOKEN_FIELDS = ("inputs", "targets")  # int32 token ids, checked against the vocabulary per batch


class RowTable(Protocol):
    """Rows of `seq_len` tokens a run visits once per epoch.

    `rows(indices)` returns, for each index (an int64 array, any order, repeats
    allowed), one row of every field as [len(indices), seq_len] arrays: at least
    `inputs` and `targets` (integer token ids of any integer dtype), and any
    per-token extras a model reads (packed documents' `segment_ids`, `positions`,
    `loss_weights`: jaxpar.parallel.documents), which are passed on unchanged.
    """

    def __len__(self) -> int: ...

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """The row table of a token stream: its non-overlapping windows of `seq_len + 1` tokens, in stream order.

    Row i is tokens [i * (seq_len + 1), (i + 1) * (seq_len + 1)); inputs are its
    first `seq_len` tokens, targets its last `seq_len`. The tail that fills no
    window (`dropped`: fewer than seq_len + 1 tokens) is never read. Rows are
    read from the (memory-mapped) stream as they are asked for.
    """

    tokens: np.ndarray
    seq_len: int

    def __post_init__(self):
        if len(self) == 0:
            raise ValueError(f"data has {self.tokens.size} tokens, fewer than one window of "
                             f"seq_len+1={self.seq_len + 1}")

    def __len__(self) -> int:
        return self.tokens.size // (self.seq_len + 1)

    @property
    def dropped(self) -> int:
        """Tokens at the end of the stream that fill no window."""
        return self.tokens.size - len(self) * (self.seq_len + 1)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        windows = np.asarray(self.tokens[: len(self) * (self.seq_len + 1)].reshape(len(self), -1)[indices])
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


@dataclasses.dataclass(frozen=True)
class EpochBatches:
    """Global batches of `batch_size` rows of `table`, indexed by step, each row once per epoch."""

    table: RowTable
    batch_size: int
    seq_len: int
    seed: int = 0
    vocab: int | None = None  # token ids are checked against it per batch when given
    source: str | None = None  # the --data the rows came from, for the check's message

    def __post_init__(self):
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed {self.seed}: the epoch order (grain's IndexSampler) takes a seed in "
                             f"[0, 2**32); choose one there")

    @functools.cached_property
    def _sampler(self) -> IndexSampler:
        from grain.python import IndexSampler, NoSharding

        return IndexSampler(len(self.table), shard_options=NoSharding(), shuffle=True, num_epochs=None,
                            seed=self.seed)

    def indices(self, step: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The table rows of rows lo:hi of the global batch of `step`."""
        first = step * self.batch_size
        positions = range(first, first + self.batch_size)[lo:hi]
        return np.asarray([self._sampler[p].record_key for p in positions], np.int64)

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Rows lo:hi of the global batch of `step`: the table's fields, tokens as int32 [rows, seq_len]."""
        rows = dict(self.table.rows(self.indices(step, lo, hi)))
        for field in TOKEN_FIELDS:
            if self.vocab is not None:
                check_batch_vocab(rows[field], self.vocab, self.source, step)
            rows[field] = rows[field].astype(np.int32)
        return rows

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step)

    def epoch_of(self, step: int) -> float:
        """How far through the data the run is after `step` batches: 1.5 is halfway through the second epoch."""
        return step * self.batch_size / len(self.table)

    def steps_for(self, epochs: float) -> int:
        """Steps that visit every row `epochs` times: ceil(epochs x rows / batch_size); the last may run over.

        `epochs` is read as the decimal it prints as, so 0.1 epochs of 30 rows in
        batches of 3 is 1 step, not 2 from 0.1's binary excess.
        """
        return max(1, math.ceil(Fraction(repr(float(epochs))) * len(self.table) / self.batch_size))



WINDOWS = {"order": "windows", "drawn_by": "numpy default_rng([seed, step]) per step"}  # data/tokens.py, mixture.py


def data_order(batches) -> dict:
    """How a run orders its data, as its checkpoints record it: random windows, epochs of so many rows, or
    blocks of packed documents (`jaxpar.data.block_packing.BlockBatches.order`)."""
    if hasattr(batches, "order"):
        return batches.order()
    if not isinstance(batches, EpochBatches):
        return WINDOWS
    return {"order": "epochs", "rows": len(batches.table),
            "drawn_by": "grain IndexSampler(rows, shuffle=True, seed)[step * batch_size + row]"}


def check_same_order(saved: dict, batches, origin: str) -> None:
    """Refuse a saved data state (`BatchStream.get_state`, a checkpoint's `data`) whose order or row count differs
    from the run's: its step would name other rows. `origin` names it in the error.

    Checkpoints from before orders were recorded were all written by random windows.
    """
    saved, current = {**WINDOWS, **saved}, data_order(batches)
    keys = ("order", "rows") if saved["order"] == current["order"] else ("order",)  # windows have no rows
    changed = [f"{k}: {saved.get(k)} -> {current.get(k)}" for k in keys if saved.get(k) != current.get(k)]
    if changed:
        raise ValueError(f"{origin} read its data in another order ({'; '.join(changed)}); its step names other rows "
                         f"in this run's order. Resume with the {option_name('data')}, {option_name('seq_len')} and "
                         f"{option_name('epochs')} it was saved with, or use another {option_name('checkpoint_dir')}")

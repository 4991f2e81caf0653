"""Packed documents read lazily: blocks of consecutive documents, each tokenized and packed when first needed.

A document source is cut into blocks of `BLOCK_DOCUMENTS` consecutive
documents (the last block may be shorter); block b is documents
[b * K, (b + 1) * K), packed on its own by `jaxpar.data.packing.pack` the
first time a batch needs one of its rows, and kept in a bounded LRU cache
(`CACHED_BLOCKS`). Start-up therefore reads only the source's record count
(`jaxpar.data.record_index`) and tokenizes nothing.

Order. Epoch e visits the blocks in grain's `IndexSampler` order over blocks
(seed `seed`, epoch e of its endless sequence), and each block's rows in the
permutation `default_rng([seed, e, b])`. The rows of an epoch, in that order,
are followed by the next epoch's: global batch `s` is positions
`s * batch_size + r` of this endless sequence, so a batch is a pure function of
(seed, step, the data) on any mesh and process count, every row (so every
document, each of its pieces) once per epoch, and an epoch ends mid-batch as in
`jaxpar.data.epochs`.

Row counts. Which block holds position p needs the row counts of the blocks
before it in the epoch's order, and a block's count is known once it is
packed. A count, once learned, is kept (one int per block, never evicted);
reading a position packs, for its count only, every earlier block of the epoch
not yet counted. So a run from step 0 packs each block as its rows come up (in
the read-ahead thread, not at start-up); a resumed run, or a process whose rows
come later in a batch, first counts the blocks before its rows in the epoch
(their rows are not kept). From the second epoch every count is known.
`--epochs` needs the row count of an epoch before the first step, so
`steps_for` counts every block at start-up (the one case that tokenizes the
whole source before training).

Processes share the counts (`jaxpar.data.shared_counts`): each block is
counted by its owner only, so a process tokenizes its own share of the blocks
before its rows plus the blocks that hold its rows. Checkpoints keep the
counts known so far (`row_counts`, `learn_row_counts`), so a resumed run, or
an `--epochs` run resumed, counts only the blocks never counted; a count that
disagrees with the block's packing now (the data changed) is refused.
"""

from __future__ import annotations

import bisect
import collections
import functools
import math
import threading
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jaxpar.core.spelling import name as option_name
from jaxpar.data.tokens import check_batch_vocab
from jaxpar.data.packing import Document, as_batch, pack
from jaxpar.data.shared_counts import SharedCounts

if TYPE_CHECKING:  # grain (and the Orbax it imports) is a second of start-up: imported where a sampler is made
    from grain.python import IndexSampler

BLOCK_DOCUMENTS = 256  # K: documents per block (a block of 256 web pages packs in tens of ms; a batch spans few blocks)
CACHED_BLOCKS = 32  # packed blocks kept (the read-ahead of a few batches, and every process's current blocks)


class DocumentSource(Protocol):
    """Documents read by index range (`jaxpar.data.records.LazyDocuments`)."""

    def __len__(self) -> int: ...

    def documents(self, lo: int, hi: int) -> list[Document]: ...

    def view(self, lo: int, hi: int) -> DocumentSource: ...  # documents lo:hi, unread (held-out splits)


class BlockBatches:
    """Global batches of packed rows of `source`, indexed by step, each row once per epoch (see the module)."""

    def __init__(self, source: DocumentSource, batch_size: int, seq_len: int, seed: int = 0, vocab: int | None = None,
                 name: str | None = None, block_documents: int = BLOCK_DOCUMENTS, cached: int = CACHED_BLOCKS,
                 shared: SharedCounts | None = None):
        if not 0 <= seed < 2**32:
            raise ValueError(f"--seed {seed}: the epoch order (grain's IndexSampler) takes a seed in [0, 2**32); "
                             "choose one there")
        self.source, self.batch_size, self.seq_len, self.seed = source, batch_size, seq_len, seed
        self.vocab, self.name, self.block_documents, self.cached = vocab, name, block_documents, cached
        self.shared = shared  # the counts of the other processes' blocks (None: this process counts every block)
        self.blocks = math.ceil(len(source) / block_documents)
        self._counts: dict[int, int] = {}
        self.tokenized: set[int] = set()  # blocks this process has read and packed (each process its share)
        self._counted_by: dict[int, str] = {}  # who gave each count (this process, another, a checkpoint): for errors
        self._packed: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self._prefix: dict[int, list[int]] = {}  # epoch -> cumulative row counts of its first blocks in order
        self._orders: collections.OrderedDict[tuple[int, int], np.ndarray] = collections.OrderedDict()
        self._total: int | None = None  # rows per epoch, once every block is counted
        self._packing: dict[int, threading.Lock] = {}  # blocks being packed now
        self._lock = threading.Lock()  # the caches and counts above; never held while a block is packed

    @functools.cached_property
    def _sampler(self) -> IndexSampler:
        from grain.python import IndexSampler, NoSharding

        return IndexSampler(self.blocks, shard_options=NoSharding(), shuffle=True, num_epochs=None, seed=self.seed)

    @functools.lru_cache(maxsize=4)
    def _order(self, epoch: int) -> list[int]:
        """The blocks of `epoch` in their visiting order."""
        first = epoch * self.blocks
        return [self._sampler[p].record_key for p in range(first, first + self.blocks)]

    def _block(self, block: int) -> dict[str, np.ndarray]:
        """Block `block` packed (from the cache, else read, tokenized and packed now); its row count is kept.

        Blocks are packed outside the cache's lock, so read-ahead workers pack different blocks at once; a
        per-block lock has a second reader of the same block wait for the first.
        """
        with self._lock:
            if block in self._packed:
                self._packed.move_to_end(block)
                return self._packed[block]
            packing = self._packing.setdefault(block, threading.Lock())
        with packing:
            with self._lock:
                if block in self._packed:
                    return self._packed[block]
            lo = block * self.block_documents
            packed = pack(self.source.documents(lo, min(lo + self.block_documents, len(self.source))), self.seq_len)
            rows = packed["tokens"].shape[0]
            self.learn_row_counts({block: rows})
            self.tokenized.add(block)
            with self._lock:
                self._packed[block] = packed
                while len(self._packed) > self.cached:
                    self._packed.popitem(last=False)
                self._packing.pop(block, None)
            if self.shared is not None and self.shared.owns(block):
                self.shared.publish(block, rows)
            return packed

    def learn_row_counts(self, counts: dict[int, int], where: str = "its packing now") -> None:
        """Take the row counts of blocks (`{block: rows}`, counted by `where`); ValueError if one disagrees with
        a count already known."""
        with self._lock:
            for block, rows in counts.items():
                if block not in self._counts:
                    self._counts[block], self._counted_by[block] = rows, where
                elif self._counts[block] != rows:
                    lo = block * self.block_documents
                    raise ValueError(
                        f"--data {self.name!r}: block {block} (documents {lo}:{min(lo + self.block_documents, len(self.source))}) "
                        f"packs into {rows} rows by {where} but {self._counts[block]} by {self._counted_by[block]}; "
                        "the data (or --seq-len, --tokenizer) changed since, so saved steps would name other rows. "
                        "Resume with the data the checkpoint was trained on, or use another "
                        f"{option_name('checkpoint_dir')}")

    def row_counts(self) -> list[int]:
        """The row count of every block known so far, -1 where unknown (what checkpoints keep)."""
        with self._lock:
            return [self._counts.get(b, -1) for b in range(self.blocks)]

    def learn_saved_counts(self, saved: list[int], where: str) -> None:
        """Take the counts `row_counts` gave when a checkpoint was saved (`where` names it)."""
        if len(saved) != self.blocks:
            raise ValueError(f"--data {self.name!r}: {where} counted {len(saved)} blocks of {self.block_documents} "
                             f"documents, this run has {self.blocks}; resume with the data it was trained on")
        self.learn_row_counts({b: rows for b, rows in enumerate(saved) if rows >= 0}, where)

    def count(self, block: int, ahead: list[int] = ()) -> int:
        """Rows of `block`: packing it if it was never counted and is this process's, else from its owner.

        While waiting for another process's count, this process first counts its own blocks among `ahead` (the
        blocks that follow in the walk), so the owners pack side by side rather than in turn.
        """
        with self._lock:
            if block in self._counts:
                return self._counts[block]
        if self.shared is None or self.shared.owns(block):
            self._block(block)
            return self._counts[block]
        rows = self.shared.get(block)
        if rows is None:
            for other in ahead:
                if self.shared.owns(other):
                    self.count(other)
            rows = self.shared.wait(block)
        self.learn_row_counts({block: rows}, f"process {block % self.shared.processes}'s count")
        return rows

    @property
    def rows_per_epoch(self) -> int:
        """Rows of one epoch: counts every block (tokenizing those never packed)."""
        if self._total is None:
            self._total = sum(self.count(b) for b in range(self.blocks))
        return self._total

    def _place(self, position: int) -> tuple[int, int, int]:
        """(epoch, index in the epoch's block order, row of the block's rows in order) of `position`."""
        epoch = 0
        if len(self._counts) == self.blocks:  # every count known: epochs have a known length
            epoch, position = divmod(position, self.rows_per_epoch)
            with self._lock:
                self._prefix = {e: p for e, p in self._prefix.items() if e >= epoch - 1}  # the epochs in use
        while True:
            order = self._order(epoch)
            with self._lock:
                prefix = self._prefix.setdefault(epoch, [0])
            while True:
                with self._lock:
                    known, end = len(prefix), prefix[-1]
                if end > position or known > self.blocks:
                    break
                ahead = order[known: known + self.shared.processes] if self.shared is not None else []
                rows = self.count(order[known - 1], ahead)  # may pack the block: outside the lock
                with self._lock:
                    if len(prefix) == known:
                        prefix.append(end + rows)
            if end > position:
                break
            if end == 0:  # an epoch of no rows: every document empty, or every conversation without a reply
                raise ValueError(f"--data {self.name!r} has nothing to train on: its {len(self.source):,} documents "
                                 "pack into no rows (they are empty, or conversations with no assistant reply)")
            epoch, position = epoch + 1, position - end  # past this epoch's rows: into the next
        with self._lock:
            at = bisect.bisect_right(prefix, position) - 1
            return epoch, at, position - prefix[at]

    def _locate(self, position: int) -> tuple[int, int, int]:
        """(epoch, block, row within the block's packing) of `position` of the endless row sequence."""
        epoch, at, within = self._place(position)
        block = self._order(epoch)[at]
        return epoch, block, int(self._permutation(epoch, block)[within])

    def _permutation(self, epoch: int, block: int) -> np.ndarray:
        """The order of `block`'s rows in `epoch` (kept for the blocks in use)."""
        rows = self.count(block)
        with self._lock:
            key = (epoch, block)
            if key not in self._orders:
                self._orders[key] = np.random.default_rng([self.seed, epoch, block]).permutation(rows)
                while len(self._orders) > self.cached:
                    self._orders.popitem(last=False)
            return self._orders[key]

    def locations(self, step: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int]]:
        """(epoch, block, row) of rows lo:hi of the global batch of `step`."""
        first = step * self.batch_size
        return [self._locate(p) for p in range(first, first + self.batch_size)[lo:hi]]

    def rows_at(self, positions, step: int) -> dict[str, np.ndarray]:
        """The rows at `positions` of the endless row sequence: inputs/targets (int32) and the document fields
        [rows, seq_len], token ids checked (`step` names the batch in the message)."""
        picked = []
        for position in positions:
            _, block, row = self._locate(position)
            picked.append({name: value[row] for name, value in self._block(block).items()})
        rows = as_batch({name: np.stack([p[name] for p in picked]) for name in picked[0]})
        for field in ("inputs", "targets"):
            if self.vocab is not None:
                check_batch_vocab(rows[field], self.vocab, self.name, step)
            rows[field] = rows[field].astype(np.int32)
        return rows

    def count_through(self, position: int) -> None:
        """Learn the counts up to `position`: a process that shares counts walks them to the end of every global
        batch it reads, so the owner of each block another process waits for reaches it too."""
        self._place(position)

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Rows lo:hi of the global batch of `step`: inputs/targets (int32) and the document fields [rows, seq_len]."""
        first = step * self.batch_size
        if self.shared is not None:
            self.count_through(first + self.batch_size - 1)
        rows = self.rows_at(range(first, first + self.batch_size)[lo:hi], step)
        if lo == 0 and hi in (None, self.batch_size) and not rows["loss_weights"].any():
            raise ValueError(f"--data {self.name!r}: the batch of step {step} has no target to train on (its "
                             "documents are one token each, or its records' completions are empty)")
        return rows

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step)

    def epoch_of(self, step: int) -> float:
        """How far through the data the run is after `step` batches: exact once every block's row count is known
        (with --epochs, or from the second epoch), else the epoch plus the share of its blocks already begun."""
        return self.epoch_at(step * self.batch_size)

    def epoch_at(self, position: int) -> float:
        """How far through the data `position` rows of the endless row sequence are (see `epoch_of`)."""
        if len(self._counts) == self.blocks:
            return position / self.rows_per_epoch
        epoch, at, within = self._place(position)
        return epoch + (at + within / self.count(self._order(epoch)[at])) / self.blocks

    def steps_for(self, epochs: float) -> int:
        """Steps that visit every row `epochs` times: ceil(epochs x rows / batch_size), as `EpochBatches.steps_for`."""
        return max(1, math.ceil(Fraction(repr(float(epochs))) * self.rows_per_epoch / self.batch_size))

    def order(self) -> dict:
        """How the run orders its data, as its checkpoints record it (`jaxpar.data.epochs.data_order`)."""
        return {"order": "document blocks", "rows": len(self.source), "block_documents": self.block_documents,
                "drawn_by": "grain IndexSampler(blocks, shuffle=True, seed) per epoch; rows by "
                            "default_rng([seed, epoch, block]).permutation"}


class InMemoryDocuments:
    """Documents already in memory (the built-in corpus, a single text file) as a `DocumentSource`."""

    def __init__(self, documents: list[Document]):
        self._documents = list(documents)

    def __len__(self) -> int:
        return len(self._documents)

    def view(self, lo: int, hi: int) -> InMemoryDocuments:
        return InMemoryDocuments(self._documents[lo:hi])

    def documents(self, lo: int, hi: int) -> list[Document]:
        return self._documents[lo:hi]

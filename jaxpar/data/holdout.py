"""What evaluation holds out of the data, and the held-out part as whole batches.

With evaluation on (`--eval-every N`, or `jaxpar eval` on a run that had it),
training reads the first (1 - HOLDOUT) of the data only, so the evaluated part is
never trained on. For a document source the cut falls on a document boundary: the
last documents are held out whole, never a document's tail (which would leak its
head into training). A mixture holds out each source's own part (`HeldOut`).

Under `--packing documents` the held-out documents are packed into rows as training
packs them (`eval_documents`; longer ones in pieces) with their segment ids,
positions and loss weights; a token stream is cut into non-overlapping windows
(`eval_windows`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

HOLDOUT = 0.05  # the fraction of the data held out for evaluation
MAX_BATCHES = 8  # windows evaluated: at most this many batches of the run's batch size


def split_tokens(tokens: np.ndarray, holdout: float = HOLDOUT, document_starts: np.ndarray | None = None,
                 source: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the last `holdout` of the stream is held out.

    With `document_starts` (a document source) the cut moves to the first document
    start at or after that mark, or to the last document's start if it spans the
    mark, so the held-out split is whole documents, the same ones on every run.
    """
    cut = holdout_cut(tokens.size, holdout, document_starts, source)
    return tokens[:cut], tokens[cut:]


def holdout_cut(size: int, holdout: float = HOLDOUT, document_starts: np.ndarray | None = None,
                source: str | None = None) -> int:
    """Where `split_tokens` cuts a stream of `size` tokens (at a document start where they are known)."""
    cut = size - max(1, int(size * holdout))
    if document_starts is not None:
        if len(document_starts) < 2:
            name = "the data" if source is None else f"--data {source!r}"
            raise ValueError(f"{name} holds one document; evaluation holds out whole documents, so it needs at least "
                             "two (split the text into several records) or drop --eval-every")
        later = document_starts[document_starts >= cut]
        cut = int(later[0]) if later.size else int(document_starts[-1])
        cut = max(cut, int(document_starts[1]))  # at least one document is trained on
    return cut


def split_documents(documents, holdout: float = HOLDOUT, source: str | None = None) -> tuple:
    """(training documents, held-out documents) of a `DocumentSource` (`jaxpar.data.block_packing`), both unread:
    the last `holdout` of the documents (at least one), whole; at least one is trained on."""
    count = len(documents)
    if count < 2:
        raise ValueError(f"--data {source!r} holds {count} document: holding out whole documents for evaluation "
                         "needs two or more; add documents or drop --eval-every")
    cut = count - min(count - 1, max(1, int(count * holdout)))
    return documents.view(0, cut), documents.view(cut, count)


def split_stream_document(documents) -> tuple:
    """(training part, held-out part) of a source that is one token stream (a mixture's token file, packed in
    row-size pieces): its tail, as `split_tokens` holds out a token file's tail."""
    from jaxpar.data.block_packing import InMemoryDocuments
    from jaxpar.data.packing import Document

    (stream,) = documents.documents(0, 1)
    cut = holdout_cut(stream.tokens.size)
    return InMemoryDocuments([Document(stream.tokens[:cut])]), InMemoryDocuments([Document(stream.tokens[cut:])])


def held_out_streams(streams, vocab: int) -> tuple[list[np.ndarray], list[HeldOut]]:
    """A windows mixture's streams (`training_streams`) each split as one source is: (training tokens, held out)."""
    from jaxpar.data.tokens import check_vocab

    trained, held = [], []
    for name, tokens, weight, starts in streams:
        train, kept = split_tokens(tokens, document_starts=starts, source=name)
        check_vocab(kept, vocab, name)
        trained.append(train)
        held.append(HeldOut(name, weight, kept))
    return trained, held


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """One source's held-out data in a mixture: tokens (windows) or documents (packed), and its mixture weight."""

    name: str
    weight: float
    data: Any  # np.ndarray of tokens, or a DocumentSource

    def windows(self, seq_len: int, batch_size: int, max_batches: int = MAX_BATCHES) -> dict:
        return held_out_batches(self.data, seq_len, batch_size, max_batches)


def held_out_batches(held, seq_len: int, batch_size: int, max_batches: int = MAX_BATCHES) -> dict:
    """Held-out data as whole batches: tokens (np.ndarray) as windows, documents packed into rows."""
    if isinstance(held, np.ndarray):
        return eval_windows(held, seq_len, batch_size, max_batches)
    return eval_documents(held, seq_len, batch_size, max_batches)


def eval_documents(documents, seq_len: int, batch_size: int, max_batches: int = MAX_BATCHES) -> dict:
    """Held-out documents (a `DocumentSource` or a list, read in blocks until they fill the batches) packed into rows
    (jaxpar.data.packing), as whole batches: inputs, targets, positions, segment_ids (0: padding, and every token
    of a row added to fill a batch), weights (the packer's loss weights)."""
    from jaxpar.data.block_packing import BLOCK_DOCUMENTS, InMemoryDocuments
    from jaxpar.data.packing import as_batch, pack

    if isinstance(documents, list):
        documents = InMemoryDocuments(documents)
    wanted, read, packed = batch_size * max_batches, 0, None
    while read < len(documents) and (packed is None or packed["tokens"].shape[0] <= wanted):
        read = min(len(documents), read + BLOCK_DOCUMENTS)  # next-fit rows of a prefix are the whole's first rows
        packed = pack(documents.documents(0, read), seq_len)
    rows = as_batch(packed)
    count = min(rows["inputs"].shape[0], batch_size * max_batches)
    total = math.ceil(count / batch_size) * batch_size
    out = {name: np.zeros((total, seq_len), value.dtype) for name, value in rows.items()}
    for name, value in rows.items():
        out[name][:count] = value[:count]
    return {"inputs": out["inputs"], "targets": out["targets"], "positions": out["positions"],
            "segment_ids": out["segment_ids"], "weights": out["loss_weights"]}


def eval_windows(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int = MAX_BATCHES) -> dict:
    """Non-overlapping windows of the held-out tokens as whole batches: inputs, targets, weights (0: padding row)."""
    count = (tokens.size - 1) // seq_len
    if count < 1:
        raise ValueError(f"the held-out split has {tokens.size} tokens, fewer than one window of seq_len+1={seq_len + 1}")
    count = min(count, batch_size * max_batches)
    rows = math.ceil(count / batch_size) * batch_size
    windows = np.zeros((rows, seq_len + 1), np.int32)
    for i in range(count):
        windows[i] = tokens[i * seq_len: i * seq_len + seq_len + 1]
    weights = (np.arange(rows) < count).astype(np.float32)[:, None].repeat(seq_len, axis=1)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "weights": weights}

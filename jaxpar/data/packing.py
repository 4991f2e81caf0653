"""Whole documents packed into rows of `seq_len + 1` tokens, with segment ids, positions and loss weights.

`--packing documents` trains on these rows instead of random windows: a row
holds whole documents one after another (in the order given; next-fit: a
document that does not fit in what is left of a row starts the next one, and
the rest of the row is padding). In order rather than first-fit because the
rows are then a pure function of the document order, built in one pass with no
window of open rows (first-fit would pad less where documents are long against
a row). A document longer than a row is cut into pieces of `seq_len + 1` tokens
that overlap by one token (piece k + 1 starts with piece k's last token), so
every next-token target of the document is trained exactly once; each piece is
its own segment (attention does not cross pieces) and its positions continue
the document's.

A row's fields, [seq_len] each (the inputs are the row's first seq_len tokens,
the targets its last seq_len): `segment_ids` 1, 2, ... per document of the row,
0 on padding; `positions` restarting at 0 per document (continuing in a
document's later pieces); `loss_weights` 1 where a target is the next token of
the same document (times the document's token mask: a fine-tuning record's
completion tokens only), 0 on padding and on the last token of each document,
which predicts nothing of the next. See `jaxpar.parallel.documents` for how the
step and the layers read them.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Document:
    """One document's token ids, and per token whether it is trained on as a target (None: every token)."""

    tokens: np.ndarray
    mask: np.ndarray | None = None


def pieces(doc: Document, width: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(tokens, target mask, first position) of each row-sized piece of `doc`; pieces overlap by one token."""
    n = len(doc.tokens)
    mask = np.ones(n, np.float32) if doc.mask is None else np.asarray(doc.mask, np.float32)
    if n <= width:
        return [(doc.tokens, mask, 0)]
    return [(doc.tokens[s:s + width], mask[s:s + width], s) for s in range(0, n - 1, width - 1)]


def pack(documents: list[Document], seq_len: int, alone: bool = False) -> dict[str, np.ndarray]:
    """Rows [R, seq_len + 1] of tokens, segment ids and positions, and target weights [R, seq_len + 1].

    `alone`: each piece in a row of its own (evaluation, whose forward keeps attention inside a row only).
    """
    width = seq_len + 1
    placed: list[list[tuple[np.ndarray, np.ndarray, int]]] = [[]]
    free = width
    for doc in documents:
        if not len(doc.tokens):
            continue
        for piece in pieces(doc, width):
            if len(piece[0]) > free or (alone and placed[-1]):
                placed.append([])
                free = width
            placed[-1].append(piece)
            free -= len(piece[0])
    if not placed[-1]:
        placed.pop()
    rows = len(placed)
    dtype = np.result_type(*(d.tokens.dtype for d in documents)) if documents else np.int32
    out = {"tokens": np.zeros((rows, width), dtype), "segment_ids": np.zeros((rows, width), np.int32),
           "positions": np.zeros((rows, width), np.int32), "weights": np.zeros((rows, width), np.float32)}
    for r, row in enumerate(placed):
        at = 0
        for segment, (tokens, mask, first) in enumerate(row, 1):
            n = len(tokens)
            out["tokens"][r, at:at + n] = tokens
            out["segment_ids"][r, at:at + n] = segment
            out["positions"][r, at:at + n] = np.arange(first, first + n)
            out["weights"][r, at + 1:at + n] = mask[1:]  # the weight of a token as a target: never a piece's first
            at += n
    return out


def as_batch(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows of `pack` as a training batch: inputs/targets and the document fields, [rows, seq_len] each."""
    tokens = packed["tokens"].astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": packed["segment_ids"][:, :-1],
            "positions": packed["positions"][:, :-1], "loss_weights": packed["weights"][:, 1:].copy()}


def split_stream(tokens: np.ndarray, starts: np.ndarray) -> list[Document]:
    """The documents of a token stream whose document `starts` are known (`jaxpar.data.tokenize.encode_documents`)."""
    return [Document(piece) for piece in np.split(np.asarray(tokens), np.asarray(starts[1:], np.int64))]

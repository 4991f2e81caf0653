"""Preference records (TRL's `prompt` / `chosen` / `rejected`) as rows of pairs: each pair two documents of one row.

A record is plain text (`prompt`, `chosen`, `rejected` strings: BOS + prompt +
answer + EOS, the answer and EOS trained) or conversational (`prompt` a list
of messages and `chosen` / `rejected` the assistant's reply messages, or, with
no `prompt`, two whole conversations sharing their start), rendered by the
tokenizer's chat template with its generation mask on the answer. A row holds
the prompt with its chosen answer, then the prompt with its rejected answer:
segment ids 1 and 2 (attention stays inside each), positions from 0 in each,
and `pair_sides` 1 / 2 on each answer's targets (jaxpar.objectives).
A pair that does not fit in one row is refused by record, never cut.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxpar.data import packing, records
from jaxpar.data.packing import Document
from jaxpar.data.tokenize import Tokenizer

REFERENCE = "reference_logps"  # [b, s]: the reference's log-prob of each answer target (jaxpar.objectives)

FIELDS = ("chosen", "rejected")
SFT = (None, "answer", "document")  # what an objective's cross-entropy term trains on the chosen side


def pair_documents(record, where: str, tokenizer: Tokenizer, chat=None) -> tuple[Document, Document]:
    """(prompt + chosen, prompt + rejected) documents of one record, only the answers trained."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is not a JSON object with prompt, chosen and rejected")
    for name in FIELDS:
        if name not in record:
            raise ValueError(f"{where} has no {name!r} (a preference record holds prompt, chosen and rejected; it has "
                             f"{', '.join(map(repr, record)) or 'no fields'})")
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, str):
        return (records.prompt_completion(prompt, chosen, tokenizer),
                records.prompt_completion(prompt, rejected, tokenizer))
    if isinstance(chosen, list) and isinstance(rejected, list) and (prompt is None or isinstance(prompt, list)):
        if chat is None:
            raise ValueError(f"{where} holds chat messages; rendering them needs --tokenizer with a chat_template")
        start = list(prompt or [])
        docs = [records.chat_document(start + answer, chat, tokenizer, where) for answer in (chosen, rejected)]
        shared = _common_prefix(docs[0].tokens, docs[1].tokens)
        return tuple(Document(d.tokens, np.where(np.arange(len(d.tokens)) >= shared, d.mask, 0.0).astype(np.float32))
                     for d in docs)
    raise ValueError(f"{where}: prompt, chosen and rejected must be all strings or all lists of messages, got "
                     f"{type(prompt).__name__}, {type(chosen).__name__}, {type(rejected).__name__}")


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def pack_pairs(pairs: list[tuple[Document, Document]], seq_len: int, sft: str | None = None,
               names: list[str] | None = None) -> dict[str, np.ndarray]:
    """A batch [pairs, seq_len] of one pair a row; `sft` adds `loss_weights` for an objective's cross-entropy term on
    the chosen side: on its answer ("answer": CPO/SimPO) or its whole document, prompt included ("document": ORPO)."""
    if sft not in SFT:
        raise ValueError(f"sft {sft!r} is not one of {SFT}")
    rows = []
    for i, (chosen, rejected) in enumerate(pairs):
        need = len(chosen.tokens) + len(rejected.tokens)
        if need > seq_len + 1:
            where = names[i] if names else f"pair {i}"
            raise ValueError(f"{where}: its prompt with the chosen answer ({len(chosen.tokens)} tokens) and with the "
                             f"rejected one ({len(rejected.tokens)}) need {need} tokens, more than a row of seq_len "
                             f"{seq_len} + 1 holds; raise --seq-len or shorten the record")
        packed = packing.pack([chosen, rejected], seq_len)
        row = packing.as_batch(packed)
        row["chosen_document"] = (packed["segment_ids"][:, 1:] == 1) & (packed["segment_ids"][:, :-1] == 1)
        rows.append(row)
    batch = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    trained, whole = batch.pop("loss_weights") > 0, batch.pop("chosen_document")
    batch["pair_sides"] = np.where(trained, batch["segment_ids"], 0).astype(np.int32)
    if sft is not None:
        batch["loss_weights"] = (batch["pair_sides"] == 1 if sft == "answer" else whole).astype(np.float32)
    return batch


def read_pairs(path: str | Path, tokenizer: Tokenizer, seq_len: int, chat=None, sft: str | None = None):
    """Every record of a .jsonl file of preferences, packed (`pack_pairs`); a bad record is refused by its line."""
    pairs, names = [], []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"record {len(pairs) + 1} (line {line_no} of {path})"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not JSON: {error.msg}") from None
            pairs.append(pair_documents(record, where, tokenizer, chat))
            names.append(where)
    if not pairs:
        raise ValueError(f"{path} holds no preference records")
    return pack_pairs(pairs, seq_len, sft, names)


class PreferenceBatches:
    """Global batches of whole pairs (`read_pairs`' rows), every pair once per epoch in an order shuffled by `seed`
    per epoch; batch `step` is a pure function of (seed, step). `reference` (REFERENCE per row, filled by
    `--precompute-reference`) joins each batch's rows once set."""

    def __init__(self, pairs: dict[str, np.ndarray], batch_size: int, seed: int = 0):
        self.pairs, self.batch_size, self.seed = pairs, batch_size, seed
        self.seq_len = pairs["inputs"].shape[1]
        self.reference: np.ndarray | None = None
        if len(self) < batch_size:
            raise ValueError(f"{len(self)} preference pairs cannot fill a batch of {batch_size}; lower --batch-size")

    def __len__(self) -> int:
        return len(self.pairs["inputs"])

    @property
    def steps_per_epoch(self) -> int:
        return len(self) // self.batch_size

    def indices(self, step: int) -> np.ndarray:
        epoch, k = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self))
        return order[k * self.batch_size:(k + 1) * self.batch_size]

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        at = self.indices(step)[lo:hi]
        out = {k: v[at] for k, v in self.pairs.items()}
        if self.reference is not None:
            out[REFERENCE] = self.reference[at]
        return out

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch

    def steps_for(self, epochs: float) -> int:
        return max(1, int(np.ceil(epochs * self.steps_per_epoch)))

    def order(self) -> dict:
        return {"order": "preference pairs", "rows": len(self), "drawn_by": "numpy permutation(rows) per (seed, epoch)"}

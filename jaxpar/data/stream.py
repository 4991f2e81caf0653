"""The one entry from a data spec to global batches: `jaxpar train`, `jaxpar eval` and one's own loop read data here.

A `DataSpec` is what `--data` and its options say: sources (token files, text, JSON lines / Parquet / `datasets`
documents, chat records) and their mixture weights, the tokenizer, the packing, epochs, the evaluation hold-out and
the seed. `batch_stream` checks it at start-up (every id of each token file, a document source's bad records, this
process's rows of batch 0), before anything compiles, and gives a `BatchStream`: global batches as jax Arrays laid
out over the plan's batch axes (`inputs`, `targets`, and for packed documents `segment_ids`, `positions`,
`loss_weights`), read ahead of the consumer. Its position goes into a checkpoint through `get_state()` and comes back
through `set_state()`, as grain's iterators do; batch `s` is a pure function of (seed, s), so a restored stream gives
bitwise the batches the saved one would have.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Any

import jax

from jaxpar.core.plan import Plan
from jaxpar.core.spelling import name as option_name
from jaxpar.data import tokens as tokens_lib
from jaxpar.data.prefetch import prefetched

# The readers (grain, jinja2, tokenizers) are imported where a stream is made, not by `import jaxpar`.

READ_AHEAD = 1  # threads reading the next batches while the consumer works (benchmarks/data.py measures 0, 1, 2)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What `--data` and its options say about a run's data (not its shapes: those come with the plan)."""

    data: str | None = None  # a source or a mixture `a.jsonl:0.7,b.npy:0.3`; None: the built-in corpus
    tokenizer: str | None = None  # a tokenizer.json or SentencePiece .model for text (default: UTF-8 bytes)
    text_field: str = "text"  # the field of a record that holds its text
    packing: str | None = None  # documents or windows; None: the data's default (jaxpar.data.packed)
    epochs: bool = False  # every row once per epoch instead of random windows (one windows source)
    holdout: bool = False  # hold out the evaluation split (jaxpar.data.holdout), never trained on
    seed: int = 0
    skip_bad_records: bool = False  # read a document source without its bad records instead of refusing it


def read(spec: DataSpec, vocab: int, batch_size: int, seq_len: int) -> tuple[Any, Any]:
    """(the indexable batches, the held-out data or None) of `spec`, token files scanned for ids outside `vocab`.

    Packed documents: every packed row once per epoch; one windows source: random windows, or with `epochs` every
    non-overlapping window once per epoch; several: a weighted mixture. Held out: tokens, a DocumentSource, or a
    mixture's list of `HeldOut`.
    """
    from jaxpar.data import holdout
    from jaxpar.data.epochs import EpochBatches, TokenWindows
    from jaxpar.data.mixture import MixtureBatches
    from jaxpar.data.packed import packing_of
    from jaxpar.data.sources import parse_sources
    from jaxpar.data.tokenize import training_streams

    streams = None
    if packing_of(spec.data, spec.packing) != "documents":
        streams = training_streams(spec.data, spec.tokenizer, vocab, spec.text_field)
    check_token_files(spec, vocab)  # after the headers' own checks
    heldout, seed = None, spec.seed
    if streams is None and spec.data is not None and len(parse_sources(spec.data)) > 1:  # a packed mixture
        from jaxpar.data.packed import packed_mixture

        _refuse_epochs_for_mixture(spec)
        batches, heldout = packed_mixture(spec.data, spec.tokenizer, vocab, spec.text_field, batch_size, seq_len,
                                          seed, holdout=spec.holdout)
    elif streams is None:  # --packing documents
        from jaxpar.data.packed import documents_of, packed_batches

        documents = documents_of(spec.data, spec.tokenizer, vocab, spec.text_field)
        if spec.holdout:
            documents, heldout = holdout.split_documents(documents, source=spec.data)
        batches = packed_batches(documents, batch_size, seq_len, seed, vocab, spec.data)
    elif len(streams) > 1:
        _refuse_epochs_for_mixture(spec)
        names, tokens, weights, _ = zip(*streams)
        if spec.holdout:
            tokens, heldout = holdout.held_out_streams(streams, vocab)
        batches = MixtureBatches(tuple(tokens), weights, names, batch_size, seq_len, seed, vocab)
    else:
        tokens, document_starts = streams[0][1], streams[0][3]
        if spec.holdout:
            tokens, heldout = holdout.split_tokens(tokens, document_starts=document_starts, source=spec.data)
            tokens_lib.check_vocab(heldout, vocab, spec.data)
        if spec.epochs:
            batches = EpochBatches(TokenWindows(tokens, seq_len), batch_size, seq_len, seed, vocab, spec.data)
        else:
            batches = tokens_lib.Batches(tokens, batch_size, seq_len, seed, vocab, spec.data)
    return batches, heldout


def held_out(spec: DataSpec, vocab: int, batch_size: int, seq_len: int) -> Any:
    """What a run of `spec` with the evaluation hold-out holds out (`jaxpar eval`): read as training reads it, so
    the split is the same (whole documents for a document source, each source's own part of a mixture), and a
    source with bad records refused as training refuses it, or read without them under `skip_bad_records`."""
    batches, heldout = read(dataclasses.replace(spec, holdout=True, epochs=False), vocab, batch_size, seq_len)
    refuse_or_skip_bad_records(batches, spec.skip_bad_records, doing="evaluate")
    return heldout


def check_token_files(spec: DataSpec, vocab: int) -> None:
    """Every id of each token file of `spec` against `vocab`, before any compute: one pass over each file."""
    from jaxpar.data.sources import TOKEN_SUFFIXES, parse_sources

    for source in parse_sources(spec.data) if spec.data is not None else []:
        if Path(source.path).suffix in TOKEN_SUFFIXES:
            tokens_lib.check_token_file(tokens_lib.load_tokens(source.path), vocab, source.path)


def _refuse_epochs_for_mixture(spec: DataSpec) -> None:
    if spec.epochs:
        raise ValueError(f"{option_name('epochs', True)} with a mixture ({option_name('data', spec.data)}): each "
                         "source runs through its own epochs "
                         "at the pace of its weight (a source of weight w and R rows starts a new epoch every R / w "
                         "rows of the run), so the run has no one epoch count to stop at; give the run's length "
                         "in steps, and follow each source's epoch in the metrics' epoch/<source>")


def document_sources(batches) -> list:
    """The document sources (`jaxpar.data.records.LazyDocuments`) read by `batches`, a packed mixture's each."""
    parts = getattr(batches, "sources", None) or [batches]  # a packed mixture's batches per source, or the batches
    return [part.source for part in parts if hasattr(getattr(part, "source", None), "bad")]


def refuse_or_skip_bad_records(batches, skip: bool, leader: bool = True, doing: str = "train") -> None:
    """Refuse a document source with bad records (their first named, in one line), or with `skip` say (on the
    `leader` process) how many the run `doing` (train, evaluate) goes without."""
    for documents in document_sources(batches):
        bad = documents.bad
        if not bad:
            continue
        more = f" ({len(bad):,} bad records in all)" if len(bad) > 1 else ""
        if not skip:
            raise ValueError(f"{bad[0]}{more}; fix the data, or {doing} without the bad records: "
                             f"{option_name('skip_bad_records', True)}")
        if leader:
            print(f"warning: {option_name('skip_bad_records', True)}: {doing.removesuffix('e')}ing without "
                  f"{len(bad):,} bad "
                  f"record{'s' if len(bad) > 1 else ''} of --data {documents.path!r}; the first: {bad[0]}",
                  file=sys.stderr, flush=True)


def skipped_records(batches) -> tuple[int, int]:
    """(bad records left out by --skip-bad-records, conversations skipped so far for having no assistant reply),
    over the document sources of `batches`."""
    found = document_sources(batches)
    return sum(len(d.bad) for d in found), sum(len(d.skipped) for d in found)


class BatchStream:
    """Global batches of indexable `batches` laid out by `sharding`, from `position` on; `get_state`/`set_state`.

    Iterating reads `read_ahead` batches ahead in threads (jaxpar.data.prefetch); `batch(step)` reads any one.
    """

    def __init__(self, batches, sharding: jax.sharding.NamedSharding, seed: int, heldout: Any = None,
                 read_ahead: int = READ_AHEAD):
        self.batches, self.sharding, self.seed, self.heldout = batches, sharding, seed, heldout
        self.read_ahead, self.position, self.stop, self._ahead = read_ahead, 0, None, None

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch of `step`; each process reads only the rows its devices hold."""
        return tokens_lib.global_batch(self.batches, step, self.sharding)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._ahead is None:
            steps = itertools.count(self.position) if self.stop is None else range(self.position, self.stop)
            self._ahead = prefetched(self.batch, steps, self.read_ahead)
        batch = next(self._ahead)
        self.position += 1
        return batch

    def seek(self, position: int, stop: int | None = None) -> None:
        """Give the batch of step `position` next (what was read ahead is dropped), and with `stop` end before
        step `stop`: nothing past a run's last step is read (a packed block past it would be tokenized for nothing)."""
        self.close()
        self.position, self.stop = position, stop

    def close(self) -> None:
        """Stop reading ahead."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def get_state(self) -> dict:
        """What a checkpoint keeps of the stream, as JSON: the next step, the seed, the data order (how batches
        are drawn) and packed documents' block row counts (which a restored stream need not count again)."""
        from jaxpar.data.epochs import data_order

        state = {"position": self.position, "seed": self.seed, **data_order(self.batches)}
        if hasattr(self.batches, "row_counts"):
            state["block_rows"] = self.batches.row_counts()
        return state

    def set_state(self, state: dict, origin: str | None = None) -> None:
        """Continue from a `get_state()`; ValueError (naming `origin`) if it read its data in another order.

        Given no `origin` (one's own loop), the state must hold what `get_state()` writes; a resumed `jaxpar train`
        names its checkpoint, whose older steps may lack the order (all random windows then)."""
        from jaxpar.data.epochs import check_same_order

        if origin is None:
            origin = "the saved data state"
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            missing = [key for key in ("position", "seed", "order") if not isinstance(state, dict) or key not in state]
            if missing:
                raise ValueError(f"set_state: the data state given has no {', '.join(map(repr, missing))} (it has "
                                 f"{keys}); give it what BatchStream.get_state() returned")
        check_same_order(state, self.batches, origin)
        self.learn_counts(state, origin)
        self.seek(int(state.get("position", 0)), self.stop)

    def learn_counts(self, state: dict, origin: str) -> None:
        """Take the block row counts of a saved state of the same order (`BlockBatches.learn_saved_counts`)."""
        saved = state.get("block_rows")
        if saved is not None and hasattr(self.batches, "learn_saved_counts"):
            self.batches.learn_saved_counts(saved, origin)


def batch_stream(spec: DataSpec, plan: Plan, batch_size: int, seq_len: int, vocab: int, leader: bool = True,
                 read_ahead: int = READ_AHEAD) -> BatchStream:
    """The stream of global batches [batch_size, seq_len] of `spec` for `plan`, checked; ValueError on bad data.

    `leader`: this process says what `skip_bad_records` leaves out (one process of several, to say it once).
    """
    plan.check_batch(batch_size)
    batches, heldout = read(spec, vocab, batch_size, seq_len)
    refuse_or_skip_bad_records(batches, spec.skip_bad_records, leader)
    stream = BatchStream(batches, plan.sharding(plan.batch_spec(2)), spec.seed, heldout, read_ahead)
    batches.rows(0, *tokens_lib.local_rows(stream.sharding, (batch_size, seq_len)))  # this process's rows of batch 0
    return stream

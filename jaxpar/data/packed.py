"""`--packing`: whether a run packs whole documents (jaxpar.data.packing) or draws windows, and its packed data.

`documents` is the default for one document source (.jsonl, Parquet, a
`datasets` folder) or a folder of text files (each file a document), for a
mixture with one such source in it (`jaxpar.data.packed_mixture`; its token
files are packed as one stream each, in row-size pieces), and the only choice
for fine-tuning records, whose loss is on their completions; `windows` (random
windows of the token stream) for token files, a single text file, the built-in
corpus and mixtures of those. A choice that cannot act is refused: documents of
one token file (it has no document boundaries), windows of fine-tuning records.
"""

from __future__ import annotations

from pathlib import Path

from jaxpar.core.spelling import name as option_name
from jaxpar.data.records import LazyDocuments, is_fine_tuning
from jaxpar.data.tokenize import check_covers, encode_documents, load_tokenizer
from jaxpar.data import sources
from jaxpar.data.block_packing import BlockBatches, DocumentSource, InMemoryDocuments
from jaxpar.data.packed_mixture import PackedMixture
from jaxpar.data.packing import Document, split_stream
from jaxpar.data.shared_counts import shared_counts

PACKINGS = ("documents", "windows")


def packing_of(data: str | None, packing: str | None) -> str:
    """The run's packing: `packing` as given (checked against the data) or the default for the data."""
    if packing is not None and packing not in PACKINGS:
        raise ValueError(f"{option_name('packing')} must be one of {', '.join(PACKINGS)}, got {packing!r}")
    entries = sources.parse_sources(data) if data is not None else [sources.Source(None)]
    tuning = [s.path for s in entries if s.path is not None and is_fine_tuning(s.path)]
    if len(entries) > 1:  # a mixture packs documents when any source holds documents (token files: pieces)
        if tuning and packing == "windows":
            raise ValueError(f"--data {data!r} mixes in fine-tuning records ({', '.join(tuning)}), trained on their "
                             "completions only, which random windows cannot keep apart; use "
                             f"{option_name('packing', 'documents')}")
        if packing is not None:
            return packing
        return "documents" if any(s.path is not None and _is_documents(Path(s.path)) for s in entries) else "windows"
    path = entries[0].path
    if tuning and packing == "windows":
        raise ValueError(f"--data {path!r} holds fine-tuning records, trained on their completions only, which random "
                         f"windows cannot keep apart; use {option_name('packing', 'documents')} (the default for them)")
    if packing == "documents" and path is not None and Path(path).suffix in sources.TOKEN_SUFFIXES:
        raise ValueError(f"--data {path!r} is a token file: it has no document boundaries to pack by; use "
                         f"{option_name('packing', 'windows')}, or give the text as .jsonl / Parquet / a folder of text "
                         "files")
    if packing is not None:
        return packing
    return "documents" if path is not None and _is_documents(Path(path)) else "windows"


def _is_documents(source: Path) -> bool:
    """A source of whole documents: .jsonl, Parquet, a `datasets` folder, or a folder of text files."""
    return sources.is_document_source(source) or (source.is_dir() and source.suffix not in sources.TOKEN_SUFFIXES)


def documents_of(data: str | None, tokenizer: str | None, vocab: int, text_field: str = "text") -> DocumentSource:
    """The documents of the one source of `--data`, unread: only the source's index is read here.

    The built-in corpus and a single text file are one document each, read now.
    """
    if tokenizer is not None:
        check_covers(load_tokenizer(tokenizer), vocab, f"--tokenizer {tokenizer!r}")
    if data is None:
        from jaxpar.data.tokens import default_corpus

        return InMemoryDocuments([Document(default_corpus())])
    if Path(data).suffix in sources.TOKEN_SUFFIXES:  # a mixture's token file: one stream, packed in row-size pieces
        from jaxpar.data.tokens import load_tokens

        return InMemoryDocuments([Document(load_tokens(data))])
    if Path(data).is_file() and not sources.is_document_source(Path(data)):
        texts = [Path(data).read_text(encoding="utf-8")]
        return InMemoryDocuments(split_stream(*encode_documents(texts, load_tokenizer(tokenizer))))
    return LazyDocuments(data, tokenizer, text_field)


def packed_batches(documents: DocumentSource, batch_size: int, seq_len: int, seed: int, vocab: int,
                   source: str | None, entry: int = 0) -> BlockBatches:
    """The run's batches of packed rows, each once per epoch in the seed's order, token ids checked per batch;
    block row counts shared between processes under a name of (`entry` of --data, source, rows, seq_len)."""
    return BlockBatches(documents, batch_size, seq_len, seed, vocab, source,
                        shared=shared_counts(f"{entry}:{source}:{len(documents)}:{seq_len}"))


def packed_mixture(data: str, tokenizer: str | None, vocab: int, text_field: str, batch_size: int, seq_len: int,
                   seed: int, holdout: bool = False) -> tuple[PackedMixture, list | None]:
    """The batches of a mixture (`a.jsonl:0.7,b.bin:0.3`) of packed sources, each keeping its own epochs, and with
    `holdout` each source's held-out part (`jaxpar.data.holdout.HeldOut`: whole documents, a token file's tail)."""
    from jaxpar.data.holdout import HeldOut, split_documents, split_stream_document

    entries, packed, held = sources.parse_sources(data), [], []
    for j, entry in enumerate(entries):
        documents = documents_of(entry.path, tokenizer, vocab, text_field)
        if holdout:
            is_stream = Path(entry.path).suffix in sources.TOKEN_SUFFIXES
            documents, kept = (split_stream_document(documents) if is_stream
                               else split_documents(documents, source=entry.path))
            held.append(HeldOut(entry.path, entry.weight, kept))
        packed.append(packed_batches(documents, batch_size, seq_len, seed, vocab, entry.path, j))
    mixture = PackedMixture(packed, [e.weight for e in entries], [e.path for e in entries], batch_size, seed)
    return mixture, held if holdout else None

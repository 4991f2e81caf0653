"""Text into token ids with a real tokenizer, and the JSON header that ties a token file to its tokenizer.

The tokenizer is a Hugging Face `tokenizer.json` (the `tokenizers` package), a
SentencePiece `.model` (the `sentencepiece` package), or UTF-8 bytes without one.
`jaxpar tokenize` writes the ids to a `.npy` file and, beside it, a header
(`tokens.json` for `tokens.npy`): dtype, vocabulary size, the tokenizer file's
SHA-256 and the token count. `jaxpar train --tokenizer` tokenizes text the same
way, and `training_tokens` checks a token file's header against the model and
the tokenizer before anything compiles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Callable

import numpy as np

from jaxpar.data import tokens as data_lib
from jaxpar.data.tokens import TEXT_SUFFIXES
from jaxpar.data.record_index import read_documents
from jaxpar.data.sources import Source, is_document_source, parse_sources


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: what it is, its vocabulary size, its file's hash, text -> ids per document and ids -> text."""

    kind: str  # "bytes", "tokenizer.json" or "sentencepiece"
    vocab: int
    sha256: str | None
    encode: Callable[[list[str]], list[np.ndarray]]
    decode: Callable[[list[int]], str]
    bos: int | None = None  # put before each document of a document source (.jsonl, .parquet, datasets folder)
    eos: int | None = None  # and after it


BYTES = Tokenizer("bytes", 256, None, lambda texts: [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts],
                  lambda ids: bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace"))


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """A `tokenizer.json` or SentencePiece `.model` (by suffix), or bytes for None; ValueError names what is wrong."""
    if path is None:
        return BYTES
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tokenizer {str(path)!r} is not a file (a Hugging Face tokenizer.json or a SentencePiece .model)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if path.suffix == ".model":
        return _sentencepiece(path, digest)
    if path.suffix != ".json":
        raise ValueError(f"--tokenizer {str(path)!r}: expected a Hugging Face tokenizer.json or a SentencePiece .model")
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as error:
        raise ValueError("--tokenizer with a tokenizer.json needs the `tokenizers` package (pip install tokenizers)") from error
    try:
        loaded = HFTokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the Rust side raises a bare Exception on a bad file
        raise ValueError(f"--tokenizer {str(path)!r} is not a readable Hugging Face tokenizer.json: {error}") from None
    bos, eos = _special_ids(path, loaded)
    return Tokenizer("tokenizer.json", loaded.get_vocab_size(), digest,
                     lambda texts: [np.asarray(e.ids, np.int64) for e in loaded.encode_batch(texts)],
                     lambda ids: loaded.decode(list(ids)), bos, eos)


SPECIAL_NAMES = {"bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"),
                 "eos": ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")}


def _special_ids(path: Path, loaded) -> tuple[int | None, int | None]:
    """BOS and EOS ids: `bos_token`/`eos_token` of a tokenizer_config.json beside the file, else the usual names."""
    config_path = path.with_name("tokenizer_config.json")
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError as error:
            raise ValueError(f"{config_path} is not JSON ({error}); fix or remove it") from None
    found = []
    for kind in ("bos", "eos"):
        named = config.get(f"{kind}_token")
        named = named.get("content") if isinstance(named, dict) else named
        candidates = (named,) if isinstance(named, str) else SPECIAL_NAMES[kind]
        found.append(next((i for i in map(loaded.token_to_id, candidates) if i is not None), None))
    return found[0], found[1]


def _sentencepiece(path: Path, digest: str) -> Tokenizer:
    try:
        import sentencepiece
    except ImportError as error:
        raise ValueError("--tokenizer with a SentencePiece .model needs the `sentencepiece` package "
                         "(pip install sentencepiece)") from error
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as error:
        raise ValueError(f"--tokenizer {str(path)!r} is not a readable SentencePiece model: {error}") from None
    bos, eos = processor.bos_id(), processor.eos_id()  # -1 where the model has none
    return Tokenizer("sentencepiece", processor.GetPieceSize(), digest,
                     lambda texts: [np.asarray(ids, np.int64) for ids in processor.EncodeAsIds(texts)],
                     lambda ids: processor.DecodeIds([int(i) for i in ids]),
                     bos if bos >= 0 else None, eos if eos >= 0 else None)


def text_files(source: Path) -> list[Path]:
    """The text files of a file or folder (sorted, as `jaxpar train --data` reads them)."""
    if not source.exists():
        raise ValueError(f"{str(source)!r} does not exist")
    if source.is_file():
        return [source]
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"{str(source)!r} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
    return files


def encode_texts(texts: list[str], tokenizer: Tokenizer) -> np.ndarray:
    """All documents' ids, concatenated, in the smallest unsigned dtype that holds the vocabulary."""
    ids = np.concatenate(tokenizer.encode(texts)) if texts else np.zeros(0, np.int64)
    return _smallest(ids, tokenizer.vocab)


def encode_documents(texts: list[str], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(token stream, offset of each document's first token): the offsets let evaluation hold out whole documents.

    A tokenizer whose post-processor already adds BOS/EOS gets them once, not twice.
    """
    if tokenizer is BYTES:
        sizes = np.asarray([len(t.encode("utf-8")) + 2 for t in texts], np.int64)  # each but the last has "\n\n" after
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return np.frombuffer("\n\n".join(texts).encode("utf-8"), np.uint8), starts
    bos = [] if tokenizer.bos is None else [tokenizer.bos]
    eos = [] if tokenizer.eos is None else [tokenizer.eos]
    pieces, sizes = [], []
    for ids in tokenizer.encode(texts):
        if bos and ids[:1].tolist() == bos:
            ids = ids[1:]
        if eos and ids[-1:].tolist() == eos:
            ids = ids[:-1]
        pieces += [np.asarray(bos, np.int64), ids, np.asarray(eos, np.int64)]
        sizes.append(len(bos) + len(ids) + len(eos))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return _smallest(np.concatenate(pieces), tokenizer.vocab), starts


def _smallest(ids: np.ndarray, vocab: int) -> np.ndarray:
    return ids.astype(np.uint8 if vocab <= 2**8 else np.uint16 if vocab <= 2**16 else np.uint32)


def _read_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start}); "
                             "a tokenizer reads text") from None
    return texts


def tokenize(source, out, tokenizer: str | None = None) -> dict:
    """Tokenize a text file or folder into `out` (.npy) and its JSON header; returns the header."""
    out = Path(out)
    if out.suffix != ".npy":
        raise ValueError(f"--out {str(out)!r} must end in .npy")
    if out.exists() or out.with_suffix(".json").exists():
        taken = out if out.exists() else out.with_suffix(".json")
        raise ValueError(f"{str(taken)!r} already exists (--out {str(out)!r} writes it); choose another --out or remove it")
    loaded = load_tokenizer(tokenizer)
    files = text_files(Path(source))
    if loaded is BYTES:  # the bytes as they are, whatever their encoding
        tokens = np.frombuffer(b"\n\n".join(p.read_bytes() for p in files), dtype=np.uint8)
    else:
        tokens = encode_texts(_read_texts(files), loaded)
    if tokens.size == 0:
        raise ValueError(f"{str(source)!r} gave no tokens")
    np.save(out, tokens, allow_pickle=False)
    header = {"dtype": tokens.dtype.name, "vocab": int(loaded.vocab), "tokens": int(tokens.size),
              "tokenizer": loaded.kind, "tokenizer_sha256": loaded.sha256, "files": len(files)}
    out.with_suffix(".json").write_text(json.dumps(header, indent=2) + "\n")
    return {"path": str(out), **header}


def check_covers(tokenizer: Tokenizer, vocab: int, where: str) -> None:
    """Refuse a tokenizer whose ids the model's embedding cannot hold."""
    if tokenizer.vocab > vocab:
        raise ValueError(f"{where} has a vocabulary of {tokenizer.vocab:,} tokens but the model's has {vocab:,}: "
                         f"set the model's vocab to at least {tokenizer.vocab} ([model] vocab = {tokenizer.vocab} "
                         "in --config) or use another tokenizer")


def check_header(path: Path, tokens: np.ndarray, vocab: int, tokenizer: Tokenizer | None) -> None:
    """Refuse a `.npy` token file whose header (if any) disagrees with the file, the model or `--tokenizer`."""
    header_path = path.with_suffix(".json")
    if not header_path.is_file():
        if tokenizer is not None:
            raise ValueError(f"--data {str(path)!r} has no header ({header_path.name}) to check against --tokenizer; "
                             "write it with `jaxpar tokenize`, or drop --tokenizer")
        return
    try:
        header = json.loads(header_path.read_text())
        dtype, header_vocab = np.dtype(header["dtype"]), int(header["vocab"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{header_path}: not a `jaxpar tokenize` header ({error!r}); remove it or re-tokenize") from None
    where = f"--data {str(path)!r}"
    if dtype != tokens.dtype:
        raise ValueError(f"{where} holds {tokens.dtype.name} ids but its header {header_path.name} says "
                         f"{dtype.name}: the file and its header do not belong together; re-tokenize")
    if "tokens" in header and int(header["tokens"]) != tokens.size:
        raise ValueError(f"{where} holds {tokens.size:,} tokens but its header {header_path.name} says "
                         f"{int(header['tokens']):,}: the file and its header do not belong together; re-tokenize")
    if header_vocab > vocab:
        raise ValueError(f"{where} was tokenized with a vocabulary of {header_vocab:,} tokens ({header.get('tokenizer')}"
                         f", per {header_path.name}) but the model's has {vocab:,}: choose a model whose vocab covers it")
    if tokenizer is not None:
        saved = header.get("tokenizer_sha256")
        if saved != tokenizer.sha256 or header_vocab != tokenizer.vocab:
            made_with = f"{header.get('tokenizer')} sha256 {saved}" if saved else header.get("tokenizer", "bytes")
            raise ValueError(f"{where} was tokenized with another tokenizer ({made_with}, vocab {header_vocab:,}) "
                             f"than --tokenizer ({tokenizer.kind} sha256 {tokenizer.sha256}, vocab {tokenizer.vocab:,}); "
                             "re-tokenize with this one, or give the one it was made with")


def training_streams(data: str | None, tokenizer_path: str | None, vocab: int,
                     text_field: str = "text") -> list[tuple[str | None, np.ndarray, float, np.ndarray | None]]:
    """(name, token stream, weight, document starts) of each source of `jaxpar train --data [--tokenizer] [--text-field]`.

    Text (a file, a folder, or the built-in corpus) goes through the tokenizer; a
    document source (.jsonl, .parquet, a `datasets` folder) too, with BOS/EOS
    around each document; a `.npy` from `jaxpar tokenize` is checked against its
    header; a `.bin` has no header, so `--tokenizer` is refused there. Token ids
    are not scanned here: the batches check them against `vocab` as they are read.
    Document starts (each document's first offset) are given for document sources
    only, None otherwise: evaluation holds out whole documents where it knows them.
    """
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    if tokenizer is not None:
        check_covers(tokenizer, vocab, f"--tokenizer {tokenizer_path!r}")
    sources = parse_sources(data) if data is not None else [Source(None)]
    streams = []
    for source in sources:
        tokens, starts = _stream(source.path, tokenizer, vocab, text_field)
        streams.append((source.path, tokens, source.weight, starts))
    return streams


def _stream(data: str | None, tokenizer: Tokenizer | None, vocab: int, text_field: str) -> tuple[np.ndarray, np.ndarray | None]:
    """One source's token stream, and its document starts where it is a document source."""
    path = Path(data) if data is not None else None
    if path is not None and path.suffix in (".npy", ".bin"):
        if path.suffix == ".bin" and tokenizer is not None:
            raise ValueError(f"--data {data!r}: a .bin token file has no header to check against --tokenizer; "
                             "drop --tokenizer (token ids are still checked against the vocabulary) or write a .npy "
                             "with `jaxpar tokenize`")
        tokens = data_lib.load_tokens(path)
        if path.suffix == ".npy":
            check_header(path, tokens, vocab, tokenizer)
        return tokens, None
    starts = None
    if path is not None and is_document_source(path):
        tokens, starts = encode_documents(read_documents(path, text_field), tokenizer or BYTES)
    elif tokenizer is None:
        return data_lib.load_tokens(path), None
    elif path is None:
        tokens = encode_texts([data_lib.default_corpus().tobytes().decode("utf-8")], tokenizer)
    else:
        tokens = encode_texts(_read_texts(text_files(path)), tokenizer)
    if tokens.size == 0:
        raise ValueError(f"--data {data!r} gave no tokens through {tokenizer.kind if tokenizer else 'bytes'}")
    return tokens, starts


def training_tokens(data: str | None, tokenizer_path: str | None, vocab: int, text_field: str = "text") -> np.ndarray:
    """The one token stream of `--data`, every id checked against the model's `vocab`."""
    return training_source(data, tokenizer_path, vocab, text_field)[0]


def training_source(data: str | None, tokenizer_path: str | None, vocab: int,
                    text_field: str = "text") -> tuple[np.ndarray, np.ndarray | None]:
    """(token stream, document starts or None) of the one source of `--data` (`jaxpar eval`), ids checked."""
    streams = training_streams(data, tokenizer_path, vocab, text_field)
    if len(streams) > 1:
        raise ValueError(f"--data {data!r} is a mixture; give one source here")
    data_lib.check_vocab(streams[0][1], vocab, data)
    return streams[0][1], streams[0][3]

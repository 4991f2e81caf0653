"""What `--data` names: one or more sources with mixture weights, and the documents of a document source.

A document source is JSON lines (`.jsonl`), Parquet (`.parquet`) or a folder
written by `datasets.Dataset.save_to_disk`; each record's `--text-field` is one
document. Reading is local only (pyarrow, `datasets.load_from_disk`): nothing
is downloaded. Token files and text folders stay in `jaxpar.train.data`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxpar.train.data import TEXT_SUFFIXES

DOCUMENT_SUFFIXES = (".jsonl", ".parquet")
TOKEN_SUFFIXES = (".npy", ".bin")


@dataclasses.dataclass(frozen=True)
class Source:
    """One entry of `--data`: its path and its share of the batch rows."""

    path: str | None  # None: the built-in corpus
    weight: float = 1.0


def parse_sources(spec: str) -> list[Source]:
    """`a.jsonl:0.7,b.bin:0.3` (or one path, weight 1) -> Sources; refuses missing paths and bad weights by name."""
    sources = []
    for entry in spec.split(","):
        path, weight = entry, 1.0
        head, sep, tail = entry.rpartition(":")
        if sep and head:
            try:
                path, weight = head, float(tail)
            except ValueError:
                if Path(entry).exists():  # a path with a colon in its name
                    path, weight = entry, 1.0
                else:
                    raise ValueError(f"--data {spec!r}: the weight of {head!r} is {tail!r}, not a number; "
                                     "write path:weight, e.g. a.jsonl:0.7,b.bin:0.3") from None
        if not path:
            raise ValueError(f"--data {spec!r} has an empty entry; write path:weight, e.g. a.jsonl:0.7,b.bin:0.3")
        if not weight > 0 or weight == float("inf"):
            raise ValueError(f"--data {spec!r}: the weight of {path!r} is {weight:g}; weights must be positive and finite")
        check_kind(Path(path))
        sources.append(Source(path, weight))
    if len(sources) > 1 and len({s.path for s in sources}) < len(sources):
        raise ValueError(f"--data {spec!r} names a source twice; give each once with its total weight")
    return sources


def check_kind(path: Path) -> None:
    """Refuse, by name, a path that does not exist or whose suffix names no source jaxpar reads."""
    if not path.exists():
        raise ValueError(f"--data {str(path)!r} does not exist")
    known = (*TOKEN_SUFFIXES, *DOCUMENT_SUFFIXES, *sorted(TEXT_SUFFIXES))
    if path.is_file() and path.suffix and path.suffix not in known:
        raise ValueError(f"--data {str(path)!r}: unknown kind of file {path.suffix!r}; --data reads "
                         f"{', '.join(known)}, a folder of text files, or a folder written by datasets' save_to_disk")


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `datasets.Dataset.save_to_disk` (it holds `dataset_info.json` and `state.json`)."""
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def is_document_source(path: Path) -> bool:
    return path.suffix in DOCUMENT_SUFFIXES or is_saved_dataset(path)


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """The `text_field` of every record of a document source, in file order."""
    path = Path(path)
    if path.suffix in DOCUMENT_SUFFIXES and not path.is_file():
        raise ValueError(f"--data {str(path)!r} is a directory, not a {path.suffix} file")
    try:
        if path.suffix == ".jsonl":
            texts = _jsonl(path, text_field)
        elif path.suffix == ".parquet":
            texts = _parquet(path, text_field)
        elif is_saved_dataset(path):
            texts = _saved_dataset(path, text_field)
        else:
            raise ValueError(f"--data {str(path)!r} is not a document source (.jsonl, .parquet, or a folder "
                             "written by datasets' save_to_disk)")
    except OSError as error:
        raise ValueError(f"--data {str(path)!r} cannot be read: {error.strerror or error}") from None
    if not texts:
        raise ValueError(f"--data {str(path)!r} holds no records")
    return texts


def _field(record, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        fields = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where} has no field {text_field!r} (it has {fields}); choose the field with --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} holds {type(text).__name__}, not text")
    return text


def _jsonl(path: Path, text_field: str) -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--data {str(path)!r} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not JSON ({error.msg} at column {error.colno})") from None
            texts.append(_field(record, text_field, where))
    return texts


def _column(names: list[str], column, text_field: str, where: str) -> list[str]:
    if text_field not in names:
        raise ValueError(f"{where} has no field {text_field!r} (it has {', '.join(map(repr, names))}); "
                         "choose the field with --text-field")
    texts = column(text_field)
    if any(not isinstance(t, str) for t in texts[:1]):
        raise ValueError(f"{where}: field {text_field!r} holds {type(texts[0]).__name__}, not text")
    return texts


def _parquet(path: Path, text_field: str) -> list[str]:
    import pyarrow.parquet as pq

    where = f"--data {str(path)!r}"
    try:
        schema = pq.read_schema(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises ArrowInvalid and others on a file that is not Parquet
        raise ValueError(f"{where} is not a readable Parquet file: {error}") from None
    return _column(schema.names, lambda name: pq.read_table(path, columns=[name]).column(name).to_pylist(),
                   text_field, where)


def _saved_dataset(path: Path, text_field: str) -> list[str]:
    import datasets

    where = f"--data {str(path)!r}"
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as error:  # noqa: BLE001 - datasets raises FileNotFoundError, ValueError and its own errors
        raise ValueError(f"{where} is not a readable `datasets` save_to_disk folder: {error}") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(f"{where} holds a DatasetDict ({', '.join(dataset)}); save one split, e.g. "
                         "dataset['train'].save_to_disk(...)")
    return _column(dataset.column_names, lambda name: dataset[name], text_field, where)

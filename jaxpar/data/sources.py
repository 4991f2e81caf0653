"""What `--data` names: one or more sources with mixture weights, and the documents of a document source.

A document source is JSON lines (`.jsonl`), Parquet (`.parquet`) or a folder
written by `datasets.Dataset.save_to_disk`; each record's `--text-field` is one
document. Fine-tuning records are told by their fields: `prompt` and
`completion`, or `messages` (a list of {role, content}); `check_record` checks
each as it is read and names the record (its 1-based line or record) and what is wrong: a field it lacks,
a chat role no template knows. Reading
is local only (pyarrow, `datasets.load_from_disk`) and by index range
(`jaxpar.data.record_index`): nothing is downloaded. Token files and text
folders stay in `jaxpar.data.tokens`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxpar.core.spelling import name as option_name
from jaxpar.data.tokens import TEXT_SUFFIXES

DOCUMENT_SUFFIXES = (".jsonl", ".parquet")
TOKEN_SUFFIXES = (".npy", ".bin")
TEXT, PROMPT_COMPLETION, MESSAGES = "text", "prompt/completion", "messages"  # the kinds of record


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


def text_of(record, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        fields = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where} has no field {text_field!r} (it has {fields}); choose the field with "
                         f"{option_name('text_field')}")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} holds {type(text).__name__}, not text")
    return text


def utf8_line(line: bytes, where: str) -> str:
    """A JSON line's text; ValueError names `where` (the file and 1-based line) where it is not UTF-8."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{where} is not UTF-8 text (byte 0x{line[error.start]:02x} at column {error.start + 1}: "
                         f"{error.reason}); a .jsonl file holds one JSON object per line") from None


def record_kind(path: str | Path) -> str:
    """What a document source's records are, from its first record's fields (or its columns): MESSAGES,
    PROMPT_COMPLETION or TEXT."""
    fields = set(_first_fields(Path(path)))
    if "messages" in fields:
        return MESSAGES
    if {"prompt", "completion"} <= fields:
        return PROMPT_COMPLETION
    return TEXT


def _first_fields(path: Path) -> list[str]:
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(utf8_line(line, f"--data {str(path)!r} line {number}"))
                    except json.JSONDecodeError:
                        return []  # reading the records names the line
                    return list(record) if isinstance(record, dict) else []
        return []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_schema(path).names
        except Exception:  # noqa: BLE001 - reading the records names what is wrong with the file
            return []
    if is_saved_dataset(path):
        info = json.loads((path / "dataset_info.json").read_text())
        return list((info.get("features") or {}).keys())
    return []


ROLES = ("user", "assistant", "system", "tool")  # the roles chat templates know; any other is refused by name


def check_record(record, kind: str, where: str) -> dict:
    """A record of `kind` with its fields checked; ValueError starts with `where` (its 1-based line or record).

    A conversation with no assistant reply passes: it has nothing to train on, so the reader skips and counts it.
    """
    if not isinstance(record, dict):
        raise ValueError(f"{where} is {type(record).__name__}, not an object with fields")
    needed = ("messages",) if kind == MESSAGES else ("prompt", "completion")
    for name in needed:
        if name not in record or record[name] is None:
            raise ValueError(f"{where} has no field {name!r} (it has {', '.join(map(repr, record)) or 'none'}); "
                             f"the first record makes this a {kind} source, so every record needs "
                             f"{' and '.join(map(repr, needed))}")
    if kind == PROMPT_COMPLETION:
        for name in needed:
            if not isinstance(record[name], str):
                raise ValueError(f"{where}: field {name!r} holds {type(record[name]).__name__}, not text")
        return {"prompt": record["prompt"], "completion": record["completion"]}
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}, got "
                         f"{type(messages).__name__}")
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {number} must have text fields 'role' and 'content', got {message!r}")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}: message {number} has role {message['role']!r}, which chat templates do not "
                             f"know; use one of {', '.join(ROLES)}")
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}

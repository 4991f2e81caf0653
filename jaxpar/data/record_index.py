"""The index of a document source: how many records it holds, and records lo:hi read on demand.

Start-up reads this index and checks the records (`check`), so the first step
does not wait for a whole corpus to be tokenized: a JSON lines file's line offsets (one
pass over its bytes for newlines, no JSON parsed), a Parquet file's row counts
per row group (its footer), a `datasets` folder's length (its Arrow files are
memory-mapped), a text folder's file list. `records(lo, hi)` then reads those
records only: a JSON lines file seeks to their lines, a Parquet file reads the
row groups that hold them, a `datasets` folder slices its memory map.

A record is what `jaxpar.data.sources` reads: a text (`field` given) or the
record's fields (fine-tuning records, checked by `sources.check_record`). A
blank JSON line is no record; a line of only spaces is read as an empty text.

`check(kind)` reads every record once, before the run spends compute on any:
each JSON line parsed, each record's fields checked. The bad ones leave the
index (`bad` keeps what is wrong with each, in file order), so the documents
that follow keep their places; whether a run refuses them or trains on
without them (`--skip-bad-records`) is the run's choice.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np

from jaxpar.core.spelling import name as option_name
from jaxpar.data import sources


class RecordIndex:
    """Records of one document source (or each file of a text folder), read by index range."""

    def __init__(self, path: str | Path, field: str | None = "text"):
        self.path, self.field = Path(path), field
        self.where = f"--data {str(self.path)!r}"
        self._kept: np.ndarray | None = None  # after `check`: the records that passed, by their index in the file
        self.bad: list[str] = []
        suffix = self.path.suffix
        if suffix in sources.DOCUMENT_SUFFIXES and not self.path.is_file():
            raise ValueError(f"{self.where} is a directory, not a {suffix} file")
        try:
            if suffix == ".jsonl":
                self._open_jsonl()
            elif suffix == ".parquet":
                self._open_parquet()
            elif sources.is_saved_dataset(self.path):
                self._open_dataset()
            else:
                self._open_folder()
        except OSError as error:
            raise ValueError(f"{self.where} cannot be read: {error.strerror or error}") from None
        if len(self) == 0:
            raise ValueError(f"{self.where} holds no records")

    def __len__(self) -> int:
        return self._count if self._kept is None else len(self._kept)

    def _read(self, lo: int, hi: int) -> list:
        """Records lo:hi of those kept (all, before `check`)."""
        if self._kept is None:
            return self._read_file(lo, hi)
        if hi <= lo:
            return []
        wanted = self._kept[lo:hi]
        first, last = int(wanted[0]), int(wanted[-1]) + 1
        if hasattr(self, "_starts"):  # JSON lines: parse the kept lines only
            chunk, base = self._chunk(first, last), int(self._starts[first])
            return [self._jsonl_record(chunk[self._starts[i] - base:self._ends[i] - base], int(i)) for i in wanted]
        read = self._read_file(first, last)
        return [read[int(i) - first] for i in wanted]

    def check(self, kind: str, chunk: int = 4096) -> list[str]:
        """Parse and check every record (`kind`: sources.TEXT with `field`, or a fine-tuning kind); the bad ones
        leave the index and their messages are kept in `bad`, which is returned. A text folder is read lazily:
        its files are checked as they are read."""
        if hasattr(self, "_files") or self._kept is not None:
            return self.bad
        if kind == sources.TEXT:
            self._check_field()
        good = np.ones(self._count, bool)
        for lo in range(0, self._count, chunk):
            hi = min(lo + chunk, self._count)
            for i, (record, error) in enumerate(self._parsed(lo, hi), lo):
                try:
                    if error is not None:
                        raise ValueError(error)
                    if kind == sources.TEXT:
                        if record is not None:
                            sources.text_of(record, self.field, self.name(i))
                    else:
                        sources.check_record(record, kind, self.name(i))
                except ValueError as bad:
                    good[i] = False
                    self.bad.append(str(bad))
        if not good.all():
            self._kept = np.flatnonzero(good)
        return self.bad

    def _parsed(self, lo: int, hi: int) -> list[tuple[object, str | None]]:
        """(record, None) or (None, what is wrong) of each of records lo:hi of the file: a JSON line that does not
        parse is one bad record, not the end of the reading."""
        if not hasattr(self, "_starts"):
            return [(record, None) for record in self._read_file(lo, hi)]
        chunk, base = self._chunk(lo, hi), int(self._starts[lo])
        out = []
        for i in range(lo, hi):
            try:
                out.append((self._jsonl_record(chunk[self._starts[i] - base:self._ends[i] - base], i), None))
            except ValueError as error:
                out.append((None, str(error)))
        return out

    def _check_field(self) -> None:
        names = getattr(self, "_names", None)
        if names is not None and self.field not in names:
            raise ValueError(f"{self.where} has no field {self.field!r} (it has {', '.join(map(repr, names))}); "
                             f"choose the field with {option_name('text_field')}")

    # JSON lines: byte offsets of the non-blank lines
    def _open_jsonl(self):
        size = self.path.stat().st_size
        if size == 0:
            self._starts = self._ends = self._lines = np.zeros(0, np.int64)
        else:
            with self.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                newlines = np.flatnonzero(np.frombuffer(view, np.uint8) == ord("\n"))
            starts = np.concatenate([[0], newlines + 1])
            ends = np.concatenate([newlines, [size]])
            filled = ends > starts
            self._starts, self._ends = starts[filled], ends[filled]
            self._lines = np.flatnonzero(filled) + 1  # 1-based line numbers, for messages
        self._count = len(self._starts)
        self._read_file = self._jsonl_records

    def _chunk(self, lo: int, hi: int) -> bytes:
        """The bytes of lines lo:hi (of the file's records)."""
        with self.path.open("rb") as f:
            f.seek(int(self._starts[lo]))
            return f.read(int(self._ends[hi - 1] - self._starts[lo]))

    def _jsonl_record(self, line: bytes, i: int):
        """Record i of the file from its line; ValueError names the file and the line."""
        if not line.strip():
            return {self.field: ""} if self.field else None
        where = f"{self.where} line {self._lines[i]}"
        try:
            return json.loads(sources.utf8_line(line, where))
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not JSON ({error.msg}: column {error.colno})") from None

    def _jsonl_records(self, lo: int, hi: int) -> list:
        chunk, base = self._chunk(lo, hi), int(self._starts[lo])
        return [self._jsonl_record(chunk[self._starts[i] - base:self._ends[i] - base], i) for i in range(lo, hi)]

    # Parquet: rows per row group from the footer
    def _open_parquet(self):
        import pyarrow.parquet as pq

        try:
            self._parquet = pq.ParquetFile(self.path)
        except Exception as error:  # noqa: BLE001 - pyarrow raises ArrowInvalid and others on a file that is not Parquet
            raise ValueError(f"{self.where} is not a readable Parquet file: {error}") from None
        meta = self._parquet.metadata
        self._group_starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        self._count = int(self._group_starts[-1])
        self._names = self._parquet.schema_arrow.names
        self._read_file = self._parquet_records

    def _parquet_records(self, lo: int, hi: int) -> list:
        first = int(np.searchsorted(self._group_starts, lo, side="right")) - 1
        last = int(np.searchsorted(self._group_starts, hi, side="left"))
        columns = [self.field] if self.field else None
        table = self._parquet.read_row_groups(list(range(first, last)), columns=columns)
        offset = int(self._group_starts[first])
        return table.slice(lo - offset, hi - lo).to_pylist()

    # a datasets save_to_disk folder: memory-mapped Arrow
    def _open_dataset(self):
        import datasets

        try:
            self._dataset = datasets.load_from_disk(str(self.path))
        except Exception as error:  # noqa: BLE001 - datasets raises FileNotFoundError, ValueError and its own errors
            raise ValueError(f"{self.where} is not a readable `datasets` save_to_disk folder: {error}") from None
        if isinstance(self._dataset, datasets.DatasetDict):
            raise ValueError(f"{self.where} holds a DatasetDict ({', '.join(self._dataset)}); save one split, e.g. "
                             "dataset['train'].save_to_disk(...)")
        self._names = self._dataset.column_names
        self._count = len(self._dataset)
        self._read_file = lambda lo, hi: self._dataset.select(range(lo, hi)).to_list()

    # a folder of text files: each file one record
    def _open_folder(self):
        from jaxpar.data.tokens import TEXT_SUFFIXES

        if not self.path.is_dir():
            raise ValueError(f"{self.where} is not a document source (.jsonl, .parquet, a folder written by "
                             "datasets' save_to_disk, or a folder of text files)")
        self._files = sorted(p for p in self.path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not self._files:
            raise ValueError(f"{self.where}: {str(self.path)!r} holds no text files "
                             f"({', '.join(sorted(TEXT_SUFFIXES))})")
        self._count = len(self._files)
        self.field = None
        self._read_file = self._folder_texts

    def _folder_texts(self, lo: int, hi: int) -> list:
        texts = []
        for file in self._files[lo:hi]:
            try:
                texts.append(file.read_text(encoding="utf-8"))
            except UnicodeDecodeError as error:
                raise ValueError(f"{str(file)!r} is not UTF-8 text ({error.reason} at byte {error.start})") from None
        return texts

    def texts(self, lo: int, hi: int) -> list[str]:
        """The texts of records lo:hi (their `field`; a text folder's files whole)."""
        if hasattr(self, "_files"):
            return self._read(lo, hi)
        self._check_field()
        return [sources.text_of(r, self.field, self.name(i)) for i, r in zip(range(lo, hi), self._read(lo, hi))]

    def name(self, index: int) -> str:
        """Record `index` (0-based) as a message names it: a JSON lines file's 1-based line, else its 1-based
        record number, as a person counts them."""
        index = index if self._kept is None else int(self._kept[index])
        lines = getattr(self, "_lines", None)
        return f"{self.where} line {lines[index]}" if lines is not None else f"{self.where} record {index + 1}"

    def records(self, lo: int, hi: int, kind: str) -> list[dict]:
        """Fine-tuning records lo:hi, each checked (`sources.check_record`); the index is opened with field None."""
        return [sources.check_record(r, kind, self.name(i)) for i, r in zip(range(lo, hi), self._read(lo, hi))]


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """The `text_field` of every record of a document source, in file order (`jaxpar tokenize`, windows)."""
    index = RecordIndex(path, text_field)
    return index.texts(0, len(index))

"""The index of a document source: how many records it holds, and records lo:hi read on demand.

Start-up reads no more than this index, so the first step does not wait for a
whole corpus to be read and tokenized: a JSON lines file's line offsets (one
pass over its bytes for newlines, no JSON parsed), a Parquet file's row counts
per row group (its footer), a `datasets` folder's length (its Arrow files are
memory-mapped), a text folder's file list. `records(lo, hi)` then reads those
records only: a JSON lines file seeks to their lines, a Parquet file reads the
row groups that hold them, a `datasets` folder slices its memory map.

A record is what `jaxpar.train.sources` reads: a text (`field` given) or the
record's fields (fine-tuning records, checked by `sources.check_record`). A
blank JSON line is no record; a line of only spaces is read as an empty text.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np

from jaxpar.train import sources


class RecordIndex:
    """Records of one document source (or each file of a text folder), read by index range."""

    def __init__(self, path: str | Path, field: str | None = "text"):
        self.path, self.field = Path(path), field
        self.where = f"--data {str(self.path)!r}"
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
        return self._count

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
        self._read = self._jsonl_records

    def _jsonl_records(self, lo: int, hi: int) -> list:
        out = []
        with self.path.open("rb") as f:
            f.seek(int(self._starts[lo]))
            chunk = f.read(int(self._ends[hi - 1] - self._starts[lo]))
        base = int(self._starts[lo])
        for i in range(lo, hi):
            line = chunk[self._starts[i] - base:self._ends[i] - base]
            where = f"{self.where} line {self._lines[i]}"
            if not line.strip():
                out.append({self.field: ""} if self.field else None)
                continue
            try:
                record = json.loads(sources.utf8_line(line, where))
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not JSON ({error.msg} at column {error.colno})") from None
            out.append(record)
        return out

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
        self._read = self._parquet_records

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
        self._read = lambda lo, hi: self._dataset.select(range(lo, hi)).to_list()

    # a folder of text files: each file one record
    def _open_folder(self):
        from jaxpar.train.data import TEXT_SUFFIXES

        if not self.path.is_dir():
            raise ValueError(f"{self.where} is not a document source (.jsonl, .parquet, a folder written by "
                             "datasets' save_to_disk, or a folder of text files)")
        self._files = sorted(p for p in self.path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not self._files:
            raise ValueError(f"{self.where}: {str(self.path)!r} holds no text files "
                             f"({', '.join(sorted(TEXT_SUFFIXES))})")
        self._count = len(self._files)
        self.field = None
        self._read = self._folder_texts

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
        names = getattr(self, "_names", None)
        if names is not None and self.field not in names:
            raise ValueError(f"{self.where} has no field {self.field!r} (it has {', '.join(map(repr, names))}); "
                             "choose the field with --text-field")
        return [sources.text_of(r, self.field, self.name(i)) for i, r in zip(range(lo, hi), self._read(lo, hi))]

    def name(self, index: int) -> str:
        """Record `index` (0-based) as a message names it: a JSON lines file's 1-based line, else its 1-based
        record number, as a person counts them."""
        lines = getattr(self, "_lines", None)
        return f"{self.where} line {lines[index]}" if lines is not None else f"{self.where} record {index + 1}"

    def records(self, lo: int, hi: int, kind: str) -> list[dict]:
        """Fine-tuning records lo:hi, each checked (`sources.check_record`); the index is opened with field None."""
        return [sources.check_record(r, kind, self.name(i)) for i, r in zip(range(lo, hi), self._read(lo, hi))]


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """The `text_field` of every record of a document source, in file order (`jaxpar tokenize`, windows)."""
    index = RecordIndex(path, text_field)
    return index.texts(0, len(index))

"""How an error names an option: as the Python API's argument (`DataSpec(text_field=...)`), or, while the command
line is the caller (`jaxpar.cli.main`), as its flag (`--text-field`). The layers below raise the same error for both;
only the words for the option differ, so a user of the API is never told about flags they have not got."""

from __future__ import annotations

import contextlib

# option -> (the API's callable, its argument): what a Python caller passed
API = {
    "data": ("DataSpec", "data"),
    "text_field": ("DataSpec", "text_field"),
    "packing": ("DataSpec", "packing"),
    "epochs": ("DataSpec", "epochs"),
    "skip_bad_records": ("DataSpec", "skip_bad_records"),
    "tokenizer": ("DataSpec", "tokenizer"),
    "seq_len": ("batch_stream", "seq_len"),
    "checkpoint_dir": ("Checkpoints", "directory"),
}
_flags = [False]  # the command line is the caller (one entry: `as_flags` sets and restores it)


@contextlib.contextmanager
def as_flags():
    """Name options as command-line flags inside (what `jaxpar.cli.main` runs under)."""
    before = _flags[0]
    _flags[0] = True
    try:
        yield
    finally:
        _flags[0] = before


def name(option: str, value=...) -> str:
    """`option` (with `value`, if given) as the caller wrote it: `--packing documents` or
    `DataSpec(packing='documents')`; a flag without a value for True (`--skip-bad-records`)."""
    if _flags[0]:
        flag = "--" + option.replace("_", "-")
        return flag if value is ... or value is True else f"{flag} {value!r}" if option == "data" else f"{flag} {value}"
    owner, argument = API[option]
    return f"{owner}({argument}={'...' if value is ... else repr(value)})"

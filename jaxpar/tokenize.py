"""`jaxpar tokenize`: text into a `.npy` token file that `jaxpar train --data` and `jaxpar eval --data` read.

The tokenizer is a Hugging Face `tokenizer.json` (the `tokenizers` package), or
UTF-8 bytes without one. Beside the tokens goes a small JSON header
(`tokens.json` for `tokens.npy`): dtype, vocabulary size, the tokenizer file's
SHA-256 and the token count, so a token file can be matched to its tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from jaxpar.data import TEXT_SUFFIXES


def _texts(source: Path) -> list[Path]:
    if not source.exists():
        raise ValueError(f"{str(source)!r} does not exist")
    if source.is_file():
        return [source]
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"{str(source)!r} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
    return files


def tokenize(source, out, tokenizer: str | None = None) -> dict:
    """Tokenize a text file or folder into `out` (.npy) and its JSON header; returns the header."""
    out = Path(out)
    if out.suffix != ".npy":
        raise ValueError(f"--out {str(out)!r} must end in .npy")
    if out.exists():
        raise ValueError(f"--out {str(out)!r} already exists; choose another or remove it")
    files = _texts(Path(source))
    if tokenizer is None:
        ids = np.frombuffer(b"\n\n".join(p.read_bytes() for p in files), dtype=np.uint8)
        vocab, digest, kind = 256, None, "bytes"
    else:
        try:
            from tokenizers import Tokenizer
        except ImportError as error:
            raise ValueError("--tokenizer needs the `tokenizers` package (pip install tokenizers)") from error
        path = Path(tokenizer)
        if not path.is_file():
            raise ValueError(f"--tokenizer {tokenizer!r} is not a file (a Hugging Face tokenizer.json)")
        loaded = Tokenizer.from_file(str(path))
        vocab, digest, kind = loaded.get_vocab_size(), hashlib.sha256(path.read_bytes()).hexdigest(), "tokenizer.json"
        encoded = loaded.encode_batch([p.read_text(encoding="utf-8") for p in files])
        ids = np.concatenate([np.asarray(e.ids, np.int64) for e in encoded])
    dtype = np.uint8 if vocab <= 2**8 else np.uint16 if vocab <= 2**16 else np.uint32
    tokens = ids.astype(dtype)
    if tokens.size == 0:
        raise ValueError(f"{str(source)!r} gave no tokens")
    np.save(out, tokens, allow_pickle=False)
    header = {"dtype": np.dtype(dtype).name, "vocab": int(vocab), "tokens": int(tokens.size), "tokenizer": kind,
              "tokenizer_sha256": digest, "files": len(files)}
    out.with_suffix(".json").write_text(json.dumps(header, indent=2) + "\n")
    return {"path": str(out), **header}

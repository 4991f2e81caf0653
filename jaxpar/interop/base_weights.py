"""The base a LoRA checkpoint was trained on: its `--init-from` path and a fingerprint of the weights' files there.

A LoRA run's adapters mean something only beside the weights they were
trained on. Its run config names them (`record`); resume, eval, generate and
export refuse a checkpoint whose base has changed since (`check`).

The fingerprint is a SHA-256 over the weights' files under the base (a Hugging
Face directory's safetensors and their index; every file of an import-hf or
export directory, whose Orbax files hold only weights): relative path, size and
`SAMPLES` blocks of `SAMPLE_BYTES` spread evenly through it (the start, with a
safetensors header, and the end among them). Hashing every byte would read the
whole model (14 GB for a 7B model, tens of seconds) at every resume and export;
the sample reads 64 KiB per file. Replacing the weights with others (another
model, a further fine-tune, a re-quantized copy) changes every tensor's bytes,
and so the sampled ones; an edit of a few bytes between the samples would pass
unnoticed.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from jaxpar.interop.safetensors_reader import INDEX_FILE

SAMPLES = 16
SAMPLE_BYTES = 4096
KEY = "lora_base"  # where the run config holds {"path", "fingerprint"}


def fingerprint(path) -> str:
    """The hex SHA-256 of the weights' files under `path`: relative path, size and `SAMPLES` evenly spread blocks."""
    path = Path(path)
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
    weights = [p for p in files if p.suffix == ".safetensors" or p.name == INDEX_FILE]
    digest = hashlib.sha256()
    for file in weights or files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            for offset in sorted({max(0, min(size - SAMPLE_BYTES, i * size // (SAMPLES - 1))) for i in range(SAMPLES)}):
                handle.seek(offset)
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def record(init_from: str | None) -> dict | None:
    """{"path", "fingerprint"} of a LoRA run's base (None without --init-from: its base is its own init)."""
    if not init_from:
        return None
    return {"path": str(Path(init_from).absolute()), "fingerprint": fingerprint(init_from)}


def check(config: dict | None, where: str) -> None:
    """ValueError if the base a saved run config names has changed; a warning if it is gone (the checkpoint holds
    the frozen weights it trained beside, so it still runs)."""
    base = (config or {}).get(KEY)
    if not base:
        return
    if not Path(base["path"]).exists():
        print(f"warning: {where} was trained on {base['path']}, which is gone; its saved copy of the frozen weights "
              "is used", file=sys.stderr)
        return
    now = fingerprint(base["path"])
    if now != base["fingerprint"]:
        raise ValueError(f"{where} was trained on {base['path']}, whose weights have changed since (fingerprint "
                         f"{base['fingerprint'][:12]} -> {now[:12]}): its adapters fit the old base only")

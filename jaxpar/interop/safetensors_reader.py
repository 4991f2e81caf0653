"""A Hugging Face model directory's safetensors (one file, or shards listed in the index), read tensor by tensor as slices.

`jaxpar.interop.hf` reads each device's shard of a parameter this way, so no
host buffer holds a whole large model; bfloat16, which numpy lacks, is read
through safetensors' flax reader on the CPU.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsReader:
    """The tensors of a model directory (one `model.safetensors`, or shards listed in the index), read as slices."""

    def __init__(self, directory):
        from safetensors import safe_open

        self._open = safe_open
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{directory}: no *.safetensors files (pytorch_model.bin is not read; convert it first)")
            self.files = {}
            for file in files:
                with safe_open(file, framework="numpy") as f:
                    self.files.update({name: file for name in f.keys()})
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str, framework: str):
        if name not in self.files:
            raise ValueError(f"{self.directory}: tensor {name!r} is missing from the safetensors files")
        key = (self.files[name], framework)
        if key not in self._handles:
            self._handles[key] = self._open(self.files[name], framework=framework)
        return self._handles[key]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name, "numpy").get_slice(name).get_shape())

    def read(self, name: str, *index) -> np.ndarray:
        """tensor[index] as float32 numpy; bfloat16 (which numpy lacks) goes through jax on the CPU."""
        part = self._handle(name, "numpy").get_slice(name)
        if part.get_dtype() != "BF16":
            return np.asarray(part[index], dtype=np.float32)
        with on_host():
            return np.asarray(self._handle(name, "flax").get_slice(name)[index], dtype=np.float32)

    def close(self) -> None:
        self._handles.clear()


@contextlib.contextmanager
def on_host():
    """Run on the CPU device (for jax's bfloat16 conversions) where there is one."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        yield
        return
    with jax.default_device(cpu):
        yield

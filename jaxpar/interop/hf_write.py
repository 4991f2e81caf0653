"""Hugging Face checkpoints written: jaxpar parameters as safetensors in transformers' names and layouts
(`jaxpar export --format hf`).

Each layer's tensor is read alone from the checkpoint (`jaxpar.interop.saved_weights`) and written at its place in
safetensors files whose headers were laid out first (`write_hf_from`), so the host holds about one tensor at a
time. A LoRA checkpoint's adapters are merged into their weights on the way (`merged_reader`), a QLoRA base's
codes dequantized first (`dequantized_parameter`).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterator

import jax
import numpy as np

from jaxpar.interop import export_shares, hf_deepseek_v3, hf_llama4
from jaxpar.interop.hf import PAIRED, flat_paths, saved_hf_config, saved_model_config
from jaxpar.interop.hf_config import HF_CONFIG, config_to_hf
from jaxpar.interop.hf_families import TOP_PARAMS, expected_hf_shapes, jaxpar_shapes, layer_stacks
from jaxpar.interop.safetensors_reader import INDEX_FILE
from jaxpar.interop.saved_weights import SavedParameter, parameter_reader
from jaxpar.models.llama import LlamaConfig
from jaxpar.parallel import lora, quantize, quantized_base

SINGLE_FILE = "model.safetensors"
MAX_SHARD_BYTES = 4 << 30  # export: split the safetensors into files of at most this many bytes
WRITE_BYTES = 16 << 20  # export: a tensor is converted to its file layout and dtype this many bytes at a time


def _to_hf(array: np.ndarray, layout: str, vocab: int) -> np.ndarray:
    if layout == "vector":
        return array
    if layout == "transpose":
        return array.T
    if layout == "heads_vector":
        return array.reshape(-1)
    if layout == "in_heads":
        d = array.shape[0]
        return array.reshape(d, -1).T
    if layout == "out_heads":
        return array.reshape(-1, array.shape[-1]).T
    if layout == "in_heads_pairs":
        d, _, hd = array.shape
        return array[:, :, np.argsort(hf_llama4.half_order(hd))].reshape(d, -1).T
    if layout in ("plain", "as_is"):
        return array
    if layout == "vocab_rows":
        return array[:vocab]
    if layout == "vocab_cols":
        return array[:, :vocab].T
    raise AssertionError(layout)


def _hf_tensors(cfg: LlamaConfig, path: str, read: Callable, wanted=None) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face tensors (name, torch layout) of one jaxpar parameter (`read(path)`: numpy or a
    SavedParameter, read a layer, or a layer's expert, at a time): one per layer (and expert); with `wanted`, only
    those it names, the others never read. A fused tensor (Llama 4's experts' gate_up_proj) comes with its first
    part, its second part read beside it a layer at a time; two parameters interleaved in one tensor (`PAIRED`,
    gpt-oss's) are written together, with the even one's path."""
    if path in TOP_PARAMS:
        name, layout = TOP_PARAMS[path]
        if wanted is None or name in wanted:
            yield name, _to_hf(np.asarray(read(path)), layout, cfg.vocab)
        return
    if hf_deepseek_v3.is_deepseek(cfg):
        yield from hf_deepseek_v3.block_tensors(cfg, path, read, wanted)
        return
    prefix, name = path.rsplit("/", 1)
    layers, params = next((layers, params) for stack, layers, params in layer_stacks(cfg) if stack == prefix)
    suffix, layout = params[name]
    if layout in ("up_half", "odd_cols"):  # written beside their gate_half / even_cols partner
        return
    if layout == "gate_half":
        gate, up = read(path), read(path.removesuffix("expert_gate") + "expert_up")
        for j, i in enumerate(layers):
            if wanted is None or f"model.layers.{i}.{suffix}" in wanted:
                yield f"model.layers.{i}.{suffix}", np.concatenate([np.asarray(gate[j]), np.asarray(up[j])], axis=-1)
        return
    if layout in PAIRED:
        odd = next(k for k, (name, kind) in params.items() if name == suffix and kind == "odd_cols")
        even, odd = read(path), read(f"{prefix}/{odd}")
        for j, i in enumerate(layers):
            if wanted is None or f"model.layers.{i}.{suffix}" in wanted:
                yield f"model.layers.{i}.{suffix}", np.stack([even[j], odd[j]], axis=-1).reshape(*even.shape[1:-1], -1)
        return
    array = read(path)
    for j, i in enumerate(layers):
        experts = range(cfg.n_experts) if "{expert}" in suffix else [None]
        for e in experts:
            name = f"model.layers.{i}.{suffix if e is None else suffix.format(expert=e)}"
            if wanted is None or name in wanted:
                yield name, _to_hf(array[j] if e is None else array[j, e], layout, cfg.vocab)


class SafetensorsFile:
    """One safetensors file laid out before any tensor is in memory: the header (every name, shape and offset)
    first, then each tensor written at its offset when it comes, in any order, so none waits for the others."""

    CODES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(jax.numpy.bfloat16): "BF16"}

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], dtype: np.dtype, metadata: dict):
        self.path, self.dtype, self.places, self.written = path, dtype, {}, set()
        header, offset = {"__metadata__": metadata}, 0
        for name, shape in shapes.items():
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": self.CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.places[name] = (tuple(shape), offset)
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.start = 8 + len(raw)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.file.truncate(self.start + offset)

    def write(self, name: str, array: np.ndarray) -> None:
        shape, offset = self.places[name]
        if array.shape != shape:
            raise ValueError(f"{name}: shape {list(array.shape)}, the file's header says {list(shape)}")
        self.file.seek(self.start + offset)
        rows = max(1, WRITE_BYTES // max(1, math.prod(shape[1:]) * self.dtype.itemsize))
        for lo in range(0, shape[0], rows):  # a transposed or cast tensor copied a few rows at a time, not whole
            self.file.write(np.ascontiguousarray(array[lo:lo + rows], self.dtype).reshape(-1).view(np.uint8).data)
        self.written.add(name)

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, error_type, *_) -> None:
        self.file.close()
        unwritten = sorted(set(self.places) - self.written)
        if error_type is None and unwritten:
            raise ValueError(f"{self.path}: tensors {unwritten[:8]} were never written")


def write_hf(params: dict, cfg: LlamaConfig, out, dtype: str = "float32",
             max_shard_bytes: int = MAX_SHARD_BYTES, source: dict | None = None) -> dict:
    """Write jaxpar parameters (a pure dict) as a Hugging Face directory: `write_hf_from`."""
    flat = flat_paths(params)
    return write_hf_from(lambda path: np.asarray(flat[path]), cfg, out, dtype, max_shard_bytes, source)


def write_hf_from(read: Callable[[str], np.ndarray], cfg: LlamaConfig, out, dtype: str = "float32",
                  max_shard_bytes: int = MAX_SHARD_BYTES, source: dict | None = None) -> dict:
    """Write `config.json` (`source`'s fields kept: `config_to_hf`) and safetensors (split with an index beyond
    `max_shard_bytes`); returns a summary.

    `read(path)` gives one jaxpar parameter ('blocks/wq'): numpy, or a SavedParameter that reads one layer (or
    one layer's expert) at a time. Each block is cut into its Hugging Face tensor and written at its place in
    the files before the next is read, so the host holds about one tensor, not the model. A failed export
    leaves no directory behind. In a job of several processes each writes one file of its share of the tensors
    (`export_shares`), and process 0 the config and index once all are written.
    """
    out = Path(out)
    if out.exists():
        raise ValueError(f"export target {str(out)!r} already exists; choose another --out or remove it")
    np_dtype = _numpy_dtype(dtype)
    shapes = expected_hf_shapes(cfg)
    process, processes = jax.process_index(), jax.process_count()
    groups = _file_groups(shapes, np_dtype, max_shard_bytes) if processes == 1 else \
        [share for share in export_shares.shares(shapes, np_dtype.itemsize, processes) if share]
    files = [SINGLE_FILE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                     for i in range(len(groups))]
    mine = list(zip(files, groups)) if processes == 1 else list(zip(files, groups))[process:process + 1]
    config = config_to_hf(cfg, dtype, source)
    export_shares.barrier("export: target checked")  # by every process before any makes it
    out.mkdir(parents=True, exist_ok=processes > 1)
    try:
        with contextlib.ExitStack() as stack:
            writers = [stack.enter_context(SafetensorsFile(out / file, group, np_dtype, {"format": "pt"}))
                       for file, group in mine]
            where = {name: writer for writer in writers for name in writer.places}
            for path in jaxpar_shapes(cfg):
                for name, tensor in _hf_tensors(cfg, path, read, where):
                    where[name].write(name, tensor)
    except BaseException:
        if processes == 1:
            shutil.rmtree(out)
        for file, _ in mine:
            (out / file).unlink(missing_ok=True)
        raise
    export_shares.barrier("export: files written")
    total = sum(math.prod(shape) * np_dtype.itemsize for shape in shapes.values())
    if process == 0:
        (out / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if len(files) > 1:
            weight_map = {name: file for file, group in zip(files, groups) for name in group}
            (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2))
    return {"path": str(out), "format": "hf", "files": files, "tensors": len(shapes), "bytes": total,
            **({"process": process, "written": [file for file, _ in mine]} if processes > 1 else {})}


def _file_groups(shapes: dict[str, tuple[int, ...]], dtype: np.dtype, max_shard_bytes: int) -> list[dict]:
    """The tensors cut, in order, into files of at most `max_shard_bytes` (a larger tensor alone in its file)."""
    groups: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = shape
        size += nbytes
    return groups


def _numpy_dtype(dtype: str) -> np.dtype:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return np.dtype(jax.numpy.dtype(dtype))


def _save(group: dict[str, np.ndarray], dtype: np.dtype, path: Path, metadata: dict) -> None:
    """One safetensors file of whole arrays in `dtype` (benchmarks/hf_import.py's synthetic checkpoints)."""
    with SafetensorsFile(path, {name: array.shape for name, array in group.items()}, dtype, metadata) as writer:
        for name, array in group.items():
            writer.write(name, array)
def export_hf(path, out, step: int | None = None, dtype: str = "float32", merge: bool = False) -> dict:
    """`jaxpar export --format hf`: a training checkpoint, export or Hugging Face directory as a Hugging Face
    directory, read and written one parameter at a time (`write_hf_from`), with its source config's fields.

    A LoRA checkpoint's adapters are refused unless `merge`: then each adapted weight is written merged."""
    path = Path(path)
    _numpy_dtype(dtype)
    _, cfg = saved_model_config(path)
    with parameter_reader(path, cfg, step) as (read, saved_step, names):
        adapted = lora.adapted_names(names)
        if merge and not adapted:
            raise ValueError(f"--merge: {path} holds no LoRA adapters to merge")
        if adapted and not merge:
            raise ValueError(f"{path} holds LoRA adapters (on {', '.join(adapted)}): give --merge to write the merged "
                             "weights W + (alpha / r) A B, or --format peft to write the adapter alone")
        read = merged_reader(read, adapted, names) if merge else read
        return {**write_hf_from(read, cfg, out, dtype, source=saved_hf_config(path)), "step": saved_step}


def merged_reader(read: Callable[[str], "SavedParameter"], adapted, names=()) -> Callable[[str], "SavedParameter"]:
    """`read` with each adapted weight read as W + (alpha / r) A B, a block (a layer, an expert) at a time; a QLoRA
    base weight (`names` holds its scales) is its codes dequantized first, the W its adapters were trained on."""
    def merged(name: str) -> SavedParameter:
        weight = read(name)
        if name + quantized_base.SCALES in names:
            weight = dequantized_parameter(weight, read(name + quantized_base.SCALES))
        if name not in adapted:
            return weight
        a, b, scale = (read(name + suffix) for suffix in (lora.A, lora.B, lora.SCALE))
        lead = len(scale.shape)

        def block(index: tuple[slice, ...]) -> np.ndarray:
            stacked = index[:lead]
            delta = lora.delta(*(p.read((*stacked, *(slice(None),) * (len(p.shape) - lead))) for p in (a, b, scale)))
            base = weight.read(index).astype(np.float32)  # a LoRA run's frozen weight may be held 2-byte
            return base + np.asarray(delta, np.float32)[(slice(None),) * lead + index[lead:]]

        return SavedParameter(weight.shape, block)

    return merged


def dequantized_parameter(codes: "SavedParameter", scales: "SavedParameter") -> "SavedParameter":
    """A weight QLoRA saved as int8 or NF4 codes with per-block scales, read back as fp32 a block at a time: each
    block's rows are read whole along the last (quantized) dimension, dequantized, then cut to the block asked for."""
    kind = quantized_base.CODE_KINDS[np.dtype(codes.read(tuple(slice(0, 1) for _ in codes.shape)).dtype)]
    per_byte = 2 if kind == "nf4" else 1
    block = codes.shape[-1] * per_byte // scales.shape[-1]

    def read(index: tuple[slice, ...]) -> np.ndarray:
        rows = (*index[:-1], slice(None))
        q = quantize.Quantized(codes.read(rows), scales.read(rows).astype(np.float32), kind, block)
        return np.asarray(quantize.dequantize(q, np.float32))[(..., index[-1])]

    return SavedParameter((*scales.shape[:-1], scales.shape[-1] * block), read)

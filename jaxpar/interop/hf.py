"""Hugging Face checkpoints (the families of hf_config.FAMILIES) in and out: read shard by shard, written as safetensors.

The built-in Llama computes the same function as `transformers.LlamaForCausalLM`
(half-split rotary, so q/k need no permutation); only layouts differ. A jaxpar
weight is a stack over layers with heads split out (wq: [layers, embed, heads,
head_dim]), a Hugging Face one is one torch `Linear` per layer ([out, in]).

Loading builds every parameter with `jax.make_array_from_callback` on the plan's
sharding: each device's shard is read from the safetensors files as a slice
(per layer), so no device and no host buffer ever holds a whole large model.
Export is the same the other way: each layer's tensor is read alone from the
checkpoint and written at its place in safetensors files whose headers were
laid out first (`write_hf_from`), so the host holds about one tensor at a time.
The config mapping, and the refusal by name of what the model cannot represent,
is `jaxpar.interop.hf_config`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np

from jaxpar.interop import base_weights, export_shares, hf_deepseek_v3, hf_gpt_oss, hf_llama4, hf_mixtral
from jaxpar.interop.export import unflatten
from jaxpar.interop.hf_families import TOP_PARAMS, expected_hf_shapes, jaxpar_shapes, layer_stacks
from jaxpar.interop.hf_config import (HF_CONFIG, config_from_hf, config_to_hf, family_of, is_hf_dir, read_hf_config,
                                      resolve_source)
from jaxpar.interop.safetensors_reader import INDEX_FILE, SafetensorsReader
from jaxpar.models.deepseek import DeepseekConfig
from jaxpar.models.llama import LlamaConfig
from jaxpar.models.moe import MoeLlamaConfig
from jaxpar.parallel import lora, quantize, quantized_base

SINGLE_FILE = "model.safetensors"
MAX_SHARD_BYTES = 4 << 30  # export: split the safetensors into files of at most this many bytes
WRITE_BYTES = 16 << 20  # export: a tensor is converted to its file layout and dtype this many bytes at a time
JAXPAR_NAME = "tiny"  # imported checkpoints name a Llama whose every config field is given (see import_hf)
MOE_NAME = "moe-tiny"  # ... and an MoE Llama (Mixtral) likewise
DEEPSEEK_NAME = "deepseek-tiny"  # ... and a DeepSeek-V3


def jaxpar_name(cfg: LlamaConfig) -> str:
    """The built-in model an imported config names (every field is given, so only its type matters)."""
    if hf_deepseek_v3.is_deepseek(cfg):
        return DEEPSEEK_NAME
    return MOE_NAME if hf_mixtral.is_moe(cfg) else JAXPAR_NAME

# -- reading safetensors slices in jaxpar layouts -----------------------------------------------------------


def _bounds(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise ValueError("strided shards are not supported")
    return start, stop


def _read_shard(reader: SafetensorsReader, name: str, layout: str, shape, index, vocab: int) -> np.ndarray:
    """The jaxpar-layout block `index` (slices of `shape`) of one unstacked parameter, read from `name`."""
    bounds = [_bounds(i, n) for i, n in zip(index, shape)]
    if layout == "vector":
        (a, b), = bounds
        return reader.read(name, slice(a, b))
    if layout == "heads_vector":  # jaxpar [heads, head_dim] <- torch [heads * head_dim]
        (h0, h1), (k0, k1) = bounds
        return reader.read(name, slice(h0 * shape[1], h1 * shape[1])).reshape(h1 - h0, shape[1])[:, k0:k1]
    if layout == "transpose":  # jaxpar [in, out] <- torch [out, in]
        (i0, i1), (o0, o1) = bounds
        return reader.read(name, slice(o0, o1), slice(i0, i1)).T
    if layout == "in_heads":  # jaxpar [embed, heads, head_dim] <- torch [heads * head_dim, embed]
        (d0, d1), (h0, h1), (k0, k1) = bounds
        hd = shape[2]
        rows = reader.read(name, slice(h0 * hd, h1 * hd), slice(d0, d1))
        return rows.reshape(h1 - h0, hd, d1 - d0)[:, k0:k1, :].transpose(2, 0, 1)
    if layout == "out_heads":  # jaxpar [heads, head_dim, embed] <- torch [embed, heads * head_dim]
        (h0, h1), (k0, k1), (d0, d1) = bounds
        hd = shape[1]
        cols = reader.read(name, slice(d0, d1), slice(h0 * hd, h1 * hd))
        return cols.reshape(d1 - d0, h1 - h0, hd)[:, :, k0:k1].transpose(1, 2, 0)
    if layout == "in_heads_pairs":  # in_heads, each head's rows from Llama 4's rotary pairs into halves
        (d0, d1), (h0, h1), (k0, k1) = bounds
        hd = shape[2]
        rows = reader.read(name, slice(h0 * hd, h1 * hd), slice(d0, d1)).reshape(h1 - h0, hd, d1 - d0)
        return rows[:, hf_llama4.half_order(hd)[k0:k1], :].transpose(2, 0, 1)
    if layout in ("plain", "gate_half", "up_half"):  # jaxpar [E, a, b] <- torch [E, a, b] (or [E, a, 2 b]: gate, up)
        offset = shape[-1] if layout == "up_half" else 0
        *lead, (f0, f1) = bounds
        return reader.read(name, *(slice(a, b) for a, b in lead), slice(f0 + offset, f1 + offset))
    if layout == "as_is":  # the same layout (gpt-oss's stacked experts)
        return _read_maybe_quantized(reader, name, *(slice(a, b) for a, b in bounds))
    if layout in PAIRED:  # jaxpar [..., f] <- the even (or odd) columns of torch [..., 2f] (gpt-oss's gate_up_proj)
        *rest, (c0, c1) = bounds
        part = _read_maybe_quantized(reader, name, *(slice(a, b) for a, b in rest), slice(2 * c0, 2 * c1))
        return part[..., PAIRED[layout]::2]
    if layout in ("vocab_rows", "vocab_cols"):  # padded vocabulary rows are zero
        (v0, v1), (d0, d1) = bounds if layout == "vocab_rows" else bounds[::-1]
        out = np.zeros((v1 - v0, d1 - d0), np.float32)
        if v0 < vocab:
            out[: min(v1, vocab) - v0] = reader.read(name, slice(v0, min(v1, vocab)), slice(d0, d1))
        return out if layout == "vocab_rows" else out.T
    raise AssertionError(layout)


PAIRED = {"even_cols": 0, "odd_cols": 1}  # layouts of two jaxpar parameters interleaved in one tensor


def _read_maybe_quantized(reader: SafetensorsReader, name: str, *index: slice) -> np.ndarray:
    """`reader.read(name, *index)`, or, where the files hold `name` in MXFP4 (`{name}_blocks` and `_scales`: gpt-oss's
    experts), the experts `index[0]` names dequantized (`hf_gpt_oss.dequantize_mxfp4`) and cut to the rest."""
    if name in reader or f"{name}_blocks" not in reader:
        return reader.read(name, *index)
    experts = index[0]
    full = hf_gpt_oss.dequantize_mxfp4(reader.read(f"{name}_blocks", experts), reader.read(f"{name}_scales", experts))
    return full[(slice(None), *index[1:])]


def _param_sources(cfg: LlamaConfig, reader: SafetensorsReader) -> dict[str, Callable]:
    """For every jaxpar parameter path, a function (shape, index) -> that shard as numpy, read from the files."""

    def top(name, layout):
        return lambda shape, index: _read_shard(reader, name, layout, shape, index, cfg.vocab)

    def layer(name, layout, shape, index):
        if "{expert}" not in name:
            return _read_shard(reader, name, layout, shape, index, cfg.vocab)
        lo, hi = _bounds(index[0], shape[0])  # one tensor per expert, stacked along jaxpar's `experts` axis
        return np.stack([_read_shard(reader, name.format(expert=e), layout, shape[1:], index[1:], cfg.vocab)
                         for e in range(lo, hi)])

    def stacked(suffix, layout, layers):
        def read(shape, index):
            lo, hi = _bounds(index[0], shape[0])
            return np.stack([layer(f"model.layers.{layers[i]}.{suffix}", layout, shape[1:], index[1:])
                             for i in range(lo, hi)])
        return read

    sources = {"embedding": top(*TOP_PARAMS["embedding"]), "final_norm": top(*TOP_PARAMS["final_norm"])}
    if not cfg.tie_embeddings:
        sources["head"] = top(*TOP_PARAMS["head"])
    if hf_deepseek_v3.is_deepseek(cfg):
        return {**sources, **hf_deepseek_v3.block_sources(cfg, reader)}
    for path, layers, params in layer_stacks(cfg):
        sources.update({f"{path}/{k}": stacked(*v, layers) for k, v in params.items()})
    return sources


def check_tensors(reader: SafetensorsReader, cfg: LlamaConfig) -> None:
    """ValueError listing every tensor that is missing, unexpected or of the wrong shape for `cfg`."""
    expected = expected_hf_shapes(cfg)
    for name in [n for n in expected if n not in reader and f"{n}_blocks" in reader]:  # MXFP4 (gpt-oss's experts)
        shape = expected.pop(name)
        expected.update({f"{name}{part}": s for part, s in hf_gpt_oss.quantized_shapes(shape).items()})
    problems = [f"{name}: missing (expected {list(shape)})" for name, shape in expected.items() if name not in reader]
    problems += [f"{name}: shape {list(reader.shape(name))}, expected {list(shape)}"
                 for name, shape in expected.items() if name in reader and reader.shape(name) != shape]
    extra = [n for n in reader.files if n not in expected and not n.endswith("rotary_emb.inv_freq")
             and not (cfg.tie_embeddings and n == "lm_head.weight") and not hf_deepseek_v3.is_prediction_layer(n, cfg)]
    problems += [f"{name}: not part of a {family_of(cfg)} model with this config (bias or unknown layer)"
                 for name in extra]
    if problems:
        raise ValueError(f"{reader.directory}: the safetensors do not fit the config:\n  " + "\n  ".join(problems[:24]))


# -- loading onto a plan ----------------------------------------------------------------------------------


def _flat_paths(tree) -> dict[str, Any]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat}


def load_hf_params(directory, cfg: LlamaConfig | None = None, shardings=None, dtype=None) -> tuple[LlamaConfig, dict]:
    """(config, parameters as jaxpar's pure dict) from a Hugging Face directory.

    With `shardings` (a tree like the parameters, e.g. a plan's), each array is
    built shard by shard on its devices with `jax.make_array_from_callback`;
    without, whole host numpy arrays. `dtype` defaults to the config's param_dtype.
    """
    directory = Path(directory)
    cfg = config_from_hf(read_hf_config(directory)) if cfg is None else cfg
    dtype = np.dtype(jax.numpy.dtype(cfg.param_dtype if dtype is None else dtype))
    reader = SafetensorsReader(directory)
    try:
        check_tensors(reader, cfg)
        shapes = jaxpar_shapes(cfg)
        sources = _param_sources(cfg, reader)
        flat_shardings = _flat_paths(shardings) if shardings is not None else {}
        params = {}
        for path, shape in shapes.items():
            read = sources[path]
            full = tuple(slice(None) for _ in shape)
            if path in flat_shardings:
                params[path] = jax.make_array_from_callback(
                    shape, flat_shardings[path], lambda index, read=read, shape=shape: read(shape, index).astype(dtype))
            else:
                params[path] = read(shape, full).astype(dtype)
    finally:
        reader.close()
    return cfg, unflatten(params)


# -- writing Hugging Face checkpoints ---------------------------------------------------------------------


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
    flat = _flat_paths(params)
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


# -- commands -----------------------------------------------------------------------------------------------


def import_plan(devices=None):
    """The default layout of an import: every parameter split over all local devices where it divides."""
    from jaxpar.core.plan import Plan

    devices = jax.devices() if devices is None else devices
    return Plan.create(f"data={len(devices)}", devices=devices, zero=3, zero_tolerance=1.0)


def import_hf(source, out, plan=None) -> dict:
    """`jaxpar import-hf`: a Hugging Face Llama (directory or Hub id) into a jaxpar export directory.

    The parameters are read shard by shard onto `plan` (default: split over all
    devices) and written by Orbax shard by shard, with a `config.json` that
    `jaxpar train --init-from`, `eval` and `generate` read.
    """
    import time

    import orbax.checkpoint as ocp

    from jaxpar.interop.export import CONFIG_FILE, PARAMS_DIR
    from jaxpar.models import model_factory
    from jaxpar.train.state import describe

    began = time.perf_counter()
    out = Path(out).absolute()
    if out.exists():
        raise ValueError(f"import target {str(out)!r} already exists; choose another --out or remove it")
    directory = resolve_source(str(source))
    hf = read_hf_config(directory)
    cfg = config_from_hf(hf)
    plan = import_plan() if plan is None else plan
    model = describe(model_factory(jaxpar_name(cfg), cfg, 0))
    shardings = plan.shardings(plan.param_specs(model.logical))
    _, params = load_hf_params(directory, cfg, shardings)
    out.mkdir(parents=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / PARAMS_DIR, params)
    config = {"model": {"name": jaxpar_name(cfg), "config": dataclasses.asdict(cfg)}, "step": 0,
              "source": str(source), "hf_config": hf,
              "dtypes": {k: str(v.dtype) for k, v in _flat_paths(params).items()}}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    leaves = jax.tree.leaves(params)
    return {"path": str(out), "params": int(sum(math.prod(a.shape) for a in leaves)),
            "seconds": round(time.perf_counter() - began, 3)}


def saved_model_config(path) -> tuple[str, LlamaConfig]:
    """(model name, config) of a Hugging Face dir, a jaxpar export directory or a training checkpoint directory."""
    path = Path(path)
    if is_hf_dir(path):
        cfg = config_from_hf(read_hf_config(path))
        return jaxpar_name(cfg), cfg
    model = _saved_model(path)
    if not model:
        raise ValueError(f"{path}: holds no model config (saved without a run config)")
    return model["name"], _saved_config(model["config"])


def saved_hf_config(path) -> dict | None:
    """The Hugging Face config.json the weights at `path` came from (None if they never came through one).

    An HF dir's own; an import-hf directory's `hf_config`; a checkpoint's (or its export's) run config carries
    the one its `--init-from` had, so a chain import -> train -> train -> export keeps it.
    """
    path = Path(path)
    if is_hf_dir(path):
        return read_hf_config(path)
    from jaxpar.interop.export import CONFIG_FILE

    if (path / CONFIG_FILE).is_file() and "hf_config" in (saved := json.loads((path / CONFIG_FILE).read_text())):
        return saved["hf_config"]
    return (_saved_model(path) or {}).get("hf_config")


def _saved_model(path: Path) -> dict | None:
    """The `model` entry ({"name", "config", ...}) of an export directory's config or a checkpoint's run config."""
    from jaxpar.interop.export import CONFIG_FILE

    if (path / CONFIG_FILE).is_file():
        return json.loads((path / CONFIG_FILE).read_text()).get("model")
    from jaxpar.train.checkpoint import Checkpoints

    with Checkpoints(path, read_only=True) as checkpoints:
        return (checkpoints.metadata()["config"] or {}).get("model")


def _saved_config(fields: dict) -> LlamaConfig:
    """The dense or MoE Llama config of saved fields (an MoE's carry `n_experts`, a DeepSeek-V3's `kv_lora_rank`)."""
    config_type = MoeLlamaConfig if "n_experts" in fields else LlamaConfig
    config_type = DeepseekConfig if "kv_lora_rank" in fields else config_type
    known = {f.name for f in dataclasses.fields(config_type)}
    extra = set(fields) - known
    if extra:
        raise ValueError(f"the saved model has fields {sorted(extra)} the {config_type.__name__} lacks")
    return config_type(**fields)


def load_params(path, model, plan, step: int | None = None) -> dict:
    """Parameters of an HF dir, export directory or training checkpoint, read shard by shard onto `plan`.

    In natural layer order, as every file holds them (for a forward outside the pipeline; a train state
    takes them through `jaxpar.train.state.state_from_params`).

    `model` is the ModelDef (jaxpar.train.state.describe) the parameters must fit.
    """
    import orbax.checkpoint as ocp

    from jaxpar.interop.export import CONFIG_FILE, PARAMS_DIR
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.checksums import listing, mismatches

    path = Path(path).absolute()
    shardings = plan.shardings(plan.param_specs(model.logical))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model.logical, shardings,
                          is_leaf=lambda x: hasattr(x, "names"))
    if is_hf_dir(path):
        name, cfg = saved_model_config(path)
        expected = unflatten({k: jax.ShapeDtypeStruct(v, np.float32) for k, v in jaxpar_shapes(cfg).items()})
        wrong = mismatches(expected, target, dtypes=False)
        if wrong:
            raise ValueError(f"the Hugging Face model in {path} does not fit the model:{listing(wrong)}")
        params = load_hf_params(path, cfg, shardings)[1]
        return jax.tree.map(lambda a, t: a if a.dtype == t.dtype else a.astype(t.dtype), params, target)
    if (path / CONFIG_FILE).is_file():
        with ocp.StandardCheckpointer() as checkpointer:
            saved = checkpointer.metadata(path / PARAMS_DIR)
            saved = getattr(saved, "item_metadata", saved)
            wrong = mismatches(saved, target, dtypes=False)
            if wrong:
                raise ValueError(f"parameters in {path} do not fit the model:{listing(wrong)}")
            return checkpointer.restore(path / PARAMS_DIR, target)
    with Checkpoints(path, read_only=True) as checkpoints:
        step = checkpoints._step(step)
        base_weights.check(checkpoints.metadata(step)["config"], f"checkpoint step {step} in {checkpoints.directory}")
        saved = checkpoints._array_metadata(step, "params")
        # a LoRA run's adapters, read whole (they are small) and folded into their weights: W + (alpha / r) A B
        whole = jax.sharding.NamedSharding(plan.mesh, jax.P())
        adapted = _with_saved_codes(saved, lora.with_saved_adapters(saved, target, whole), whole)
        wrong = mismatches(saved, adapted, dtypes=False)
        if wrong:
            raise ValueError(f"checkpoint step {step} in {path} does not fit the model:{listing(wrong)}")
        read = ocp.args.PyTreeRestore(adapted, restore_args=ocp.checkpoint_utils.construct_restore_args(adapted),
                                      partial_restore=True)
        params = lora.fold(checkpoints._read(step, ocp.args.Composite(params=read))["params"])
        return jax.tree.map(lambda a, t: jax.device_put(a.astype(t.dtype), t.sharding), params, target)


def _with_saved_codes(saved, adapted, sharding):
    """`adapted` with the codes and scales a QLoRA checkpoint holds for its frozen weights (`name`,
    `name_quant_scales`) in place of those weights, placed by `sharding` (whole: 4 or 8 bits a value); `lora.fold`
    dequantizes them into the weights the adapters were trained on."""
    if not isinstance(saved, dict) or not isinstance(adapted, dict):
        return adapted
    out = {key: _with_saved_codes(saved.get(key), value, sharding) for key, value in adapted.items()}
    for key in saved:
        base = key.removesuffix(quantized_base.SCALES) if isinstance(key, str) else None
        if base != key and base in adapted:
            for name in (base, key):
                out[name] = jax.ShapeDtypeStruct(tuple(saved[name].shape), saved[name].dtype, sharding=sharding)
    return out


def export_hf(path, out, step: int | None = None, dtype: str = "float32", merge: bool = False) -> dict:
    """`jaxpar export --format hf`: a training checkpoint, export or Hugging Face directory as a Hugging Face
    directory, read and written one parameter at a time (`write_hf_from`), with its source config's fields.

    A LoRA checkpoint's adapters are refused unless `merge`: then each adapted weight is written merged."""
    path = Path(path)
    _numpy_dtype(dtype)
    _, cfg = saved_model_config(path)
    with _parameter_reader(path, cfg, step) as (read, saved_step, names):
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


class SavedParameter:
    """One saved parameter read a block at a time: `p[i]` is layer i of a stacked one (`p[i, e]` its expert e),
    `np.asarray(p)` all of it; `read(index)` gives the block of a tuple of slices as host numpy."""

    def __init__(self, shape: tuple[int, ...], read: Callable[[tuple[slice, ...]], np.ndarray]):
        self.shape, self.read = tuple(shape), read

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        block = (*(slice(i, i + 1) for i in index), *(slice(None) for _ in self.shape[len(index):]))
        return self.read(block).reshape(self.shape[len(index):])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.read(tuple(slice(None) for _ in self.shape))


@contextlib.contextmanager
def _parameter_reader(path: Path, cfg: LlamaConfig, step: int | None) -> Iterator[tuple[Callable, int | None, set]]:
    """(read, step, names): `read('blocks/wq')` is that parameter as a SavedParameter, from a Hugging Face
    directory, an export directory or a training checkpoint (its fp32 master under bf16/fp16, as
    `Checkpoints.read_params`; a LoRA run's frozen weights, which have no master, as held); `names` are the paths
    of every parameter saved (a LoRA run's adapters among them).

    Orbax's arrays are read by TensorStore a block at a time; a training checkpoint's blocks are checked against
    the checksums saved with it once every block of a parameter has been read (`_Checksums`).
    """
    from jaxpar.interop.export import CONFIG_FILE, PARAMS_DIR
    from jaxpar.train.checkpoint import CHECKSUMS, MASTER, Checkpoints

    if is_hf_dir(path):
        reader = SafetensorsReader(path)
        try:
            check_tensors(reader, cfg)
            sources, shapes = _param_sources(cfg, reader), jaxpar_shapes(cfg)
            yield (lambda name: SavedParameter(shapes[name], functools.partial(sources[name], shapes[name])), None,
                   set(shapes))
        finally:
            reader.close()
    elif (path / CONFIG_FILE).is_file():
        import orbax.checkpoint as ocp

        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            saved = checkpointer.metadata(path.absolute() / PARAMS_DIR)
        tree = getattr(saved, "item_metadata", saved).tree
        yield (lambda name: _tensorstore_parameter(_leaf(tree, name.split("/"))),
               json.loads((path / CONFIG_FILE).read_text()).get("step"), set(_flat_paths(tree)))
    else:
        with Checkpoints(path, read_only=True) as checkpoints:
            step = checkpoints._step(step)
            meta = checkpoints.metadata(step)
            optimizer = checkpoints._array_metadata(step, "opt_state")
            params = checkpoints._array_metadata(step, "params")
        base_weights.check(meta.get("config"), f"checkpoint step {step} in {checkpoints.directory}")
        masters = set(_flat_paths(optimizer[MASTER])) if isinstance(optimizer, dict) and MASTER in optimizer else set()
        sums = _Checksums(meta.get(CHECKSUMS) or {}, f"checkpoint step {step} in {checkpoints.directory}")

        def read(name: str) -> SavedParameter:
            item, tree, keys = ("opt_state", optimizer, [MASTER, *name.split("/")]) if name in masters else \
                ("params", params, name.split("/"))
            return sums.checked("/".join([item, *keys]), _tensorstore_parameter(_leaf(tree, keys)))

        yield read, step, set(_flat_paths(params))


def _leaf(tree: dict, keys: list[str]):
    """The node of a nested dict at `keys`."""
    for key in keys:
        tree = tree[key]
    return tree


def _tensorstore_parameter(saved) -> SavedParameter:
    """An Orbax-saved array (its ArrayMetadata: directory and name) as a SavedParameter read through TensorStore."""
    import tensorstore as ts

    directory = Path(saved.directory)
    if not (directory / "manifest.ocdbt").is_file():
        raise ValueError(f"{directory}: no manifest.ocdbt; export reads checkpoints written with Orbax's OCDBT format")
    array = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{directory.absolute()}/",
                                                   "path": saved.name}}, open=True, read=True).result()
    chunk = array.chunk_layout.read_chunk.shape

    def read(index: tuple[slice, ...]) -> np.ndarray:
        """The block, read a stored chunk at a time into one buffer: TensorStore decodes every chunk a read
        overlaps at once, and a chunk spans all the layers one saving device held."""
        bounds = [_bounds(i, n) for i, n in zip(index, array.shape)]
        parts = [tuple(slice(max(s, a), min(s + c, b)) for s, c, (a, b) in zip(corner, chunk, bounds))
                 for corner in itertools.product(*(range(a - a % c, b, c) for (a, b), c in zip(bounds, chunk)))]
        if len(parts) == 1:  # within one chunk: TensorStore's buffer is the block, no second copy
            return array[parts[0]].read().result()
        out = np.empty([b - a for a, b in bounds], array.dtype.numpy_dtype)
        for part in parts:
            out[tuple(slice(p.start - a, p.stop - a) for p, (a, _) in zip(part, bounds))] = array[part].read().result()
        return out

    return SavedParameter(array.shape, read)


class _Checksums:
    """The checksums of a training checkpoint's parameters, summed block by block as export reads them, each
    compared with the one saved once all of its blocks are read (each block is read once).

    `jaxpar.train.checksums` sums a hash of each element's bits and flat index modulo 2**32, so blocks in the
    flat order of their array (layers, experts) add up to the whole array's checksum.
    """

    def __init__(self, saved: dict[str, int], where: str):
        self.saved, self.where = saved, where

    def checked(self, key: str, parameter: SavedParameter) -> SavedParameter:
        if key not in self.saved:  # a checkpoint from before checksums: unverified, as its restore is
            return parameter
        read, summed = parameter.read, {"sum": 0, "size": 0}

        def read_summed(index: tuple[slice, ...]) -> np.ndarray:
            block = read(index)
            start = np.ravel_multi_index([i.start or 0 for i in index], parameter.shape) if block.size else 0
            summed["sum"] = (summed["sum"] + _block_checksum(block, start)) % 2**32
            summed["size"] += block.size
            if summed["size"] == math.prod(parameter.shape) and summed["sum"] != self.saved[key]:
                raise ValueError(f"{self.where} is corrupted: {key} differs from the checksum written when it "
                                 "was saved")
            return block

        return SavedParameter(parameter.shape, read_summed)


def _block_checksum(block: np.ndarray, start: int, chunk: int = 1 << 20) -> int:
    """`jaxpar.train.checksums._array_checksum`'s sum over the elements of `block`, whose first is element `start` of
    its array in flat order; in numpy, a chunk at a time, so that it holds no more than the block in memory."""
    bits = block.reshape(-1).view(f"uint{8 * block.dtype.itemsize}")
    total = 0
    for lo in range(0, bits.size, chunk):
        part = bits[lo:lo + chunk].astype(np.uint32)
        index = np.arange(part.size, dtype=np.uint32) + np.uint32((start + lo) % 2**32)
        total += int(_mix(part ^ _mix(index + np.uint32(0x9E3779B9))).sum(dtype=np.uint64))
    return total % 2**32


def _mix(h: np.ndarray) -> np.ndarray:
    """`jaxpar.train.checksums._mix` (MurmurHash3's 32-bit finaliser) on uint32 numpy arrays."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def initial_state(path, model, optimizer, plan, step: int | None = None):
    """`jaxpar train --init-from`: step 0 of a run whose parameters are read from `path` onto `plan`'s shards."""
    from jaxpar.train.state import state_from_params

    return state_from_params(load_params(path, model, plan, step), model, optimizer, plan)

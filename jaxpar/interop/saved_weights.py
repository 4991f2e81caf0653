"""jaxpar's own saved weights read back: a training checkpoint's or an export directory's parameters (and a Hugging
Face directory's, through `jaxpar.interop.hf`), onto a plan's shards (`load_params`: `--init-from`, `eval`,
`generate`) or a block at a time for export (`SavedParameter`, `parameter_reader`).

A training checkpoint is read through `jaxpar.train.checkpoint.Checkpoints`' public reading (`resolve_step`,
`saved_arrays`, `read_arrays`); its blocks are checked against the checksums saved with it as export reads them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
from pathlib import Path
from typing import Callable, Iterator

import jax
import numpy as np

from jaxpar.interop import base_weights
from jaxpar.interop.export import unflatten
from jaxpar.interop.hf import (check_tensors, flat_paths, load_hf_params, param_sources, saved_model_config,
                               slice_bounds)
from jaxpar.interop.hf_config import is_hf_dir
from jaxpar.interop.hf_families import jaxpar_shapes
from jaxpar.interop.safetensors_reader import SafetensorsReader
from jaxpar.models.llama import LlamaConfig
from jaxpar.parallel import lora, quantized_base


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
        step = checkpoints.resolve_step(step)
        base_weights.check(checkpoints.metadata(step)["config"], f"checkpoint step {step} in {checkpoints.directory}")
        saved = checkpoints.saved_arrays(step, "params")
        # a LoRA run's adapters, read whole (they are small) and folded into their weights: W + (alpha / r) A B
        whole = jax.sharding.NamedSharding(plan.mesh, jax.P())
        adapted = _with_saved_codes(saved, lora.with_saved_adapters(saved, target, whole), whole)
        wrong = mismatches(saved, adapted, dtypes=False)
        if wrong:
            raise ValueError(f"checkpoint step {step} in {path} does not fit the model:{listing(wrong)}")
        params = lora.fold(checkpoints.read_arrays(step, {"params": adapted}, partial=True)["params"])
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
def parameter_reader(path: Path, cfg: LlamaConfig, step: int | None) -> Iterator[tuple[Callable, int | None, set]]:
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
            sources, shapes = param_sources(cfg, reader), jaxpar_shapes(cfg)
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
               json.loads((path / CONFIG_FILE).read_text()).get("step"), set(flat_paths(tree)))
    else:
        with Checkpoints(path, read_only=True) as checkpoints:
            step = checkpoints.resolve_step(step)
            meta = checkpoints.metadata(step)
            optimizer = checkpoints.saved_arrays(step, "opt_state")
            params = checkpoints.saved_arrays(step, "params")
        base_weights.check(meta.get("config"), f"checkpoint step {step} in {checkpoints.directory}")
        masters = set(flat_paths(optimizer[MASTER])) if isinstance(optimizer, dict) and MASTER in optimizer else set()
        sums = _Checksums(meta.get(CHECKSUMS) or {}, f"checkpoint step {step} in {checkpoints.directory}")

        def read(name: str) -> SavedParameter:
            item, tree, keys = ("opt_state", optimizer, [MASTER, *name.split("/")]) if name in masters else \
                ("params", params, name.split("/"))
            return sums.checked("/".join([item, *keys]), _tensorstore_parameter(_leaf(tree, keys)))

        yield read, step, set(flat_paths(params))


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
        bounds = [slice_bounds(i, n) for i, n in zip(index, array.shape)]
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

"""Hugging Face checkpoints (the families of hf_config.FAMILIES) in and out: read shard by shard, written as safetensors.

The built-in Llama computes the same function as `transformers.LlamaForCausalLM`
(half-split rotary, so q/k need no permutation); only layouts differ. A jaxpar
weight is a stack over layers with heads split out (wq: [layers, embed, heads,
head_dim]), a Hugging Face one is one torch `Linear` per layer ([out, in]).

Loading builds every parameter with `jax.make_array_from_callback` on the plan's
sharding: each device's shard is read from the safetensors files as a slice
(per layer), so no device and no host buffer ever holds a whole large model.
The config mapping, and the refusal by name of what the model cannot represent,
is `jaxpar.interop.hf_config`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxpar.interop import hf_mixtral
from jaxpar.interop.export import unflatten
from jaxpar.interop.hf_families import TOP_PARAMS, blocks_path, expected_hf_shapes, jaxpar_shapes, layer_params
from jaxpar.interop.hf_config import (HF_CONFIG, config_from_hf, config_to_hf, family_of, is_hf_dir, read_hf_config,
                                      resolve_source)
from jaxpar.interop.safetensors_reader import INDEX_FILE, SafetensorsReader, on_host
from jaxpar.models.llama import LlamaConfig
from jaxpar.models.moe import MoeLlamaConfig

SINGLE_FILE = "model.safetensors"
MAX_SHARD_BYTES = 4 << 30  # export: split the safetensors into files of at most this many bytes
JAXPAR_NAME = "tiny"  # imported checkpoints name a Llama whose every config field is given (see import_hf)
MOE_NAME = "moe-tiny"  # ... and an MoE Llama (Mixtral) likewise


def jaxpar_name(cfg: LlamaConfig) -> str:
    """The built-in model an imported config names (every field is given, so only its type matters)."""
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
    if layout in ("vocab_rows", "vocab_cols"):  # padded vocabulary rows are zero
        (v0, v1), (d0, d1) = bounds if layout == "vocab_rows" else bounds[::-1]
        out = np.zeros((v1 - v0, d1 - d0), np.float32)
        if v0 < vocab:
            out[: min(v1, vocab) - v0] = reader.read(name, slice(v0, min(v1, vocab)), slice(d0, d1))
        return out if layout == "vocab_rows" else out.T
    raise AssertionError(layout)


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

    def stacked(suffix, layout):
        def read(shape, index):
            lo, hi = _bounds(index[0], shape[0])
            return np.stack([layer(f"model.layers.{i}.{suffix}", layout, shape[1:], index[1:]) for i in range(lo, hi)])
        return read

    sources = {"embedding": top(*TOP_PARAMS["embedding"]), "final_norm": top(*TOP_PARAMS["final_norm"])}
    if not cfg.tie_embeddings:
        sources["head"] = top(*TOP_PARAMS["head"])
    sources.update({f"{blocks_path(cfg)}/{k}": stacked(*v) for k, v in layer_params(cfg).items()})
    return sources


def check_tensors(reader: SafetensorsReader, cfg: LlamaConfig) -> None:
    """ValueError listing every tensor that is missing, unexpected or of the wrong shape for `cfg`."""
    expected = expected_hf_shapes(cfg)
    problems = [f"{name}: missing (expected {list(shape)})" for name, shape in expected.items() if name not in reader]
    problems += [f"{name}: shape {list(reader.shape(name))}, expected {list(shape)}"
                 for name, shape in expected.items() if name in reader and reader.shape(name) != shape]
    extra = [n for n in reader.files if n not in expected and not n.endswith("rotary_emb.inv_freq")
             and not (cfg.tie_embeddings and n == "lm_head.weight")]
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
    if layout == "vocab_rows":
        return array[:vocab]
    if layout == "vocab_cols":
        return array[:, :vocab].T
    raise AssertionError(layout)


def hf_state_dict(params: dict, cfg: LlamaConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """Hugging Face tensor name -> numpy array (contiguous, `dtype`) from jaxpar parameters (a pure dict)."""
    flat = {k: np.asarray(v) for k, v in _flat_paths(params).items()}
    out = {}
    for key, (name, layout) in TOP_PARAMS.items():
        if key in flat:
            out[name] = _to_hf(flat[key], layout, cfg.vocab)
    for key, (suffix, layout) in layer_params(cfg).items():
        for i, layer in enumerate(flat[f"{blocks_path(cfg)}/{key}"]):
            if "{expert}" in suffix:
                out.update({f"model.layers.{i}.{suffix.format(expert=e)}": _to_hf(w, layout, cfg.vocab)
                            for e, w in enumerate(layer)})
            else:
                out[f"model.layers.{i}.{suffix}"] = _to_hf(layer, layout, cfg.vocab)
    return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}


def write_hf(params: dict, cfg: LlamaConfig, out, dtype: str = "float32",
             max_shard_bytes: int = MAX_SHARD_BYTES, source: dict | None = None) -> dict:
    """Write `config.json` (`source`'s fields kept: `config_to_hf`) and safetensors (split with an index beyond
    `max_shard_bytes`); returns a summary."""
    out = Path(out)
    if out.exists():
        raise ValueError(f"export target {str(out)!r} already exists; choose another --out or remove it")
    np_dtype = _numpy_dtype(dtype)
    tensors = hf_state_dict(params, cfg, np.float32)
    out.mkdir(parents=True)
    (out / HF_CONFIG).write_text(json.dumps(config_to_hf(cfg, dtype, source), indent=2) + "\n")
    groups: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        nbytes = array.size * np_dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = array
        size += nbytes
    total = sum(a.size * np_dtype.itemsize for a in tensors.values())
    metadata = {"format": "pt"}
    if len(groups) == 1:
        _save(groups[0], np_dtype, out / SINGLE_FILE, metadata)
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        weight_map = {}
        for file, group in zip(files, groups):
            _save(group, np_dtype, out / file, metadata)
            weight_map.update({name: file for name in group})
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return {"path": str(out), "format": "hf", "files": files, "tensors": len(tensors), "bytes": total}


def _numpy_dtype(dtype: str) -> np.dtype:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return np.dtype(jax.numpy.dtype(dtype))


def _save(group: dict[str, np.ndarray], dtype: np.dtype, path: Path, metadata: dict) -> None:
    """One safetensors file; bfloat16 (which safetensors' numpy writer lacks) goes through its flax writer on the CPU."""
    if dtype == np.dtype(jax.numpy.bfloat16):
        from safetensors.flax import save_file

        with on_host():
            save_file({k: jax.numpy.asarray(v, jax.numpy.bfloat16) for k, v in group.items()}, path, metadata=metadata)
        return
    from safetensors.numpy import save_file

    save_file({k: v.astype(dtype) for k, v in group.items()}, path, metadata=metadata)


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
    """The dense or MoE Llama config of saved fields (an MoE's carry `n_experts`)."""
    config_type = MoeLlamaConfig if "n_experts" in fields else LlamaConfig
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
        saved = checkpoints._array_metadata(step, "params")
        wrong = mismatches(saved, target, dtypes=False)
        if wrong:
            raise ValueError(f"checkpoint step {step} in {path} does not fit the model:{listing(wrong)}")
        read = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
        return checkpoints._read(step, ocp.args.Composite(params=read))["params"]


def export_hf(path, out, step: int | None = None, dtype: str = "float32") -> dict:
    """`jaxpar export --format hf`: a training checkpoint (or export) as a Hugging Face Llama directory."""
    from jaxpar.interop.export import CONFIG_FILE
    from jaxpar.interop.export import load_params as load_export
    from jaxpar.train.checkpoint import Checkpoints

    path = Path(path)
    _numpy_dtype(dtype)
    name, cfg = saved_model_config(path)
    if is_hf_dir(path):
        params = load_hf_params(path, cfg)[1]
        saved_step = None
    elif (path / CONFIG_FILE).is_file():
        params, config = load_export(path)
        saved_step = config.get("step")
    else:
        with Checkpoints(path, read_only=True) as checkpoints:
            saved_step = checkpoints.metadata(step)["step"]
            params = checkpoints.read_params(saved_step)
    return {**write_hf(params, cfg, out, dtype, source=saved_hf_config(path)), "step": saved_step}


def initial_state(path, model, optimizer, plan, step: int | None = None):
    """`jaxpar train --init-from`: step 0 of a run whose parameters are read from `path` onto `plan`'s shards."""
    from jaxpar.train.state import state_from_params

    return state_from_params(load_params(path, model, plan, step), model, optimizer, plan)

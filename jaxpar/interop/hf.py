"""Hugging Face checkpoints (the families of hf_config.FAMILIES) read, and `jaxpar import-hf`.

The built-in Llama computes the same function as `transformers.LlamaForCausalLM`
(half-split rotary, so q/k need no permutation); only layouts differ. A jaxpar
weight is a stack over layers with heads split out (wq: [layers, embed, heads,
head_dim]), a Hugging Face one is one torch `Linear` per layer ([out, in]).

Loading builds every parameter with `jax.make_array_from_callback` on the plan's
sharding: each device's shard is read from the safetensors files as a slice
(per layer), so no device and no host buffer ever holds a whole large model.
Writing them is `jaxpar.interop.hf_write`'s; reading jaxpar's own saved weights (a
training checkpoint, an export) is `jaxpar.interop.saved_weights`'. The config mapping,
and the refusal by name of what the model cannot represent, is `jaxpar.interop.hf_config`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxpar.interop import hf_deepseek_v3, hf_gpt_oss, hf_llama4, hf_mixtral
from jaxpar.interop.export import unflatten
from jaxpar.interop.hf_families import TOP_PARAMS, expected_hf_shapes, jaxpar_shapes, layer_stacks
from jaxpar.interop.hf_config import config_from_hf, family_of, is_hf_dir, read_hf_config, resolve_source
from jaxpar.interop.safetensors_reader import SafetensorsReader
from jaxpar.models.deepseek import DeepseekConfig
from jaxpar.models.llama import LlamaConfig
from jaxpar.models.moe import MoeLlamaConfig

JAXPAR_NAME = "tiny"  # imported checkpoints name a Llama whose every config field is given (see import_hf)
MOE_NAME = "moe-tiny"  # ... and an MoE Llama (Mixtral) likewise
DEEPSEEK_NAME = "deepseek-tiny"  # ... and a DeepSeek-V3


def jaxpar_name(cfg: LlamaConfig) -> str:
    """The built-in model an imported config names (every field is given, so only its type matters)."""
    if hf_deepseek_v3.is_deepseek(cfg):
        return DEEPSEEK_NAME
    return MOE_NAME if hf_mixtral.is_moe(cfg) else JAXPAR_NAME

# -- reading safetensors slices in jaxpar layouts -----------------------------------------------------------


def slice_bounds(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise ValueError("strided shards are not supported")
    return start, stop


def _read_shard(reader: SafetensorsReader, name: str, layout: str, shape, index, vocab: int) -> np.ndarray:
    """The jaxpar-layout block `index` (slices of `shape`) of one unstacked parameter, read from `name`."""
    bounds = [slice_bounds(i, n) for i, n in zip(index, shape)]
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


def param_sources(cfg: LlamaConfig, reader: SafetensorsReader) -> dict[str, Callable]:
    """For every jaxpar parameter path, a function (shape, index) -> that shard as numpy, read from the files."""

    def top(name, layout):
        return lambda shape, index: _read_shard(reader, name, layout, shape, index, cfg.vocab)

    def layer(name, layout, shape, index):
        if "{expert}" not in name:
            return _read_shard(reader, name, layout, shape, index, cfg.vocab)
        lo, hi = slice_bounds(index[0], shape[0])  # one tensor per expert, stacked along jaxpar's `experts` axis
        return np.stack([_read_shard(reader, name.format(expert=e), layout, shape[1:], index[1:], cfg.vocab)
                         for e in range(lo, hi)])

    def stacked(suffix, layout, layers):
        def read(shape, index):
            lo, hi = slice_bounds(index[0], shape[0])
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


def flat_paths(tree) -> dict[str, Any]:
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
        sources = param_sources(cfg, reader)
        flat_shardings = flat_paths(shardings) if shardings is not None else {}
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
              "dtypes": {k: str(v.dtype) for k, v in flat_paths(params).items()}}
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

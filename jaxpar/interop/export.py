"""Export: a checkpoint's parameters as one consolidated, unsharded checkpoint for a plain Flax model.

Training checkpoints are cut into whatever shards the saving plan used and
carry the optimizer state. An export holds only the parameters, each array
whole (under bf16/fp16 precision the fp32 master copy, not its bf16 cast),
plus the model config as JSON, in one of two forms (neither uses pickle):

- a directory: `config.json` and an Orbax checkpoint of the parameters as a
  pure dict (`params/`), which Flax's documented recipe reads back:
  `nnx.replace_by_pure_dict(abstract_state, StandardCheckpointer().restore(dir / "params"))`;
- a `.npz` file: one array per parameter path (`blocks/wq`, ...), bf16 stored
  as its exact fp32 value, and the config as a JSON string under `__config__`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxpar.interop import base_weights
from jaxpar.train.checkpoint import Checkpoints
from jaxpar.train.checksums import listing, mismatches

CONFIG_FILE = "config.json"
CONFIG_KEY = "__config__"
PARAMS_DIR = "params"


def export(checkpoint_dir, out, step: int | None = None) -> dict:
    """Write the parameters saved at `step` (default the newest) to `out` (.npz file or directory).

    Returns what was written: path, step, parameter count and bytes.
    """
    out = Path(out).absolute()
    if out.exists():
        raise ValueError(f"export target {str(out)!r} already exists; choose another --out or remove it")
    with Checkpoints(checkpoint_dir, read_only=True) as checkpoints:
        meta = checkpoints.metadata(step)
        base_weights.check(meta["config"], f"checkpoint step {meta['step']} in {checkpoints.directory}")
        params = checkpoints.read_params(meta["step"])
    leaves = jax.tree.leaves(params)
    config = {
        "model": (meta["config"] or {}).get("model"),  # None when saved without a run config
        "step": meta["step"],
        "source": str(checkpoints.directory),
        "dtypes": {path: dtype for path, dtype in _flat(jax.tree.map(lambda a: str(a.dtype), params)).items()},
    }
    if out.suffix == ".npz":
        arrays = {path: _storable(a) for path, a in _flat(params).items()}
        np.savez(out, **arrays, **{CONFIG_KEY: np.asarray(json.dumps(config))})
    else:
        out.mkdir(parents=True)
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(out / PARAMS_DIR, params)
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return {
        "path": str(out), "step": meta["step"], "params": sum(a.size for a in leaves),
        "bytes": sum(a.nbytes for a in leaves),
    }


def load_params(path) -> tuple[dict, dict]:
    """(the parameters as a nested dict of host numpy arrays, the export's config) from `export`'s output."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"exported checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        config = json.loads((path / CONFIG_FILE).read_text())
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(path.absolute() / PARAMS_DIR)
        return params, config
    with np.load(path, allow_pickle=False) as archive:
        config = json.loads(str(archive[CONFIG_KEY]))
        flat = {key: archive[key].astype(config["dtypes"][key]) for key in archive.files if key != CONFIG_KEY}
    return unflatten(flat), config


def load_model(path, make_model: Callable[[], nnx.Module]) -> nnx.Module:
    """The model `make_model` builds, on one device, holding the exported parameters.

    Shapes must match; values are cast to the model's parameter dtypes (e.g. a
    bf16-params run loaded into an fp32 model).
    """
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(make_model)
    graphdef, state = nnx.split(abstract)
    target = nnx.to_pure_dict(state)
    params, _ = load_params(path)
    wrong = mismatches(params, target, dtypes=False)
    if wrong:
        raise ValueError(f"exported parameters in {path} do not fit the model:{listing(wrong)}")
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a, t: jnp.asarray(a, t.dtype), params, target))
    return nnx.merge(graphdef, state)


def _flat(tree) -> dict[str, Any]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in flat}


def unflatten(flat: dict[str, Any]) -> dict:
    """{"a/b/c": leaf} -> {"a": {"b": {"c": leaf}}}: the nested parameter dict of "/"-joined paths."""
    tree: dict = {}
    for key, value in flat.items():
        *parents, name = key.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = value
    return tree


def _storable(array: np.ndarray) -> np.ndarray:
    """The array in a dtype `.npy` can hold: numpy has no bfloat16, whose values fp32 holds exactly."""
    return array.astype(np.float32) if array.dtype == jnp.bfloat16 else array

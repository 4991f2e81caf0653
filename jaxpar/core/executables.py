"""Compiled steps stored whole in the compile cache, so that a restarted or repeated run loads its step untraced.

JAX's persistent cache (core/compile_cache.py) finds an executable by its lowered program, so a run that hits it
still traces and lowers its step in Python first (seconds), and on XLA:CPU a job's other processes miss it (JAX
writes entries from process 0). Here the step's executable is kept (jax.experimental.serialize_executable, as
MaxText's AOT load) under a key of everything that decides the program before it is traced: jaxpar's own
source, the jax and jaxlib versions, the XLA flags and JAX's configuration, the devices, the process count and
index, the caller's description of the program (plan, model, training settings) and the arguments' shapes,
dtypes and shardings. It is loaded only on an exact match of that key; an entry that cannot be read or loaded is
a miss, said in one warning, and the step compiles as before. Entries are written whole (a temporary file
renamed), so processes sharing the directory never read half of one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import pickle
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping

import jax

SUBDIRECTORY = "jaxpar-steps"  # beside JAX's own entries in the compile cache directory


@functools.cache
def source_digest() -> str:
    """A hash of jaxpar's own source (the package and its models): any edit changes every key."""
    digest = hashlib.sha256()
    roots = [Path(__file__).resolve().parents[1]]
    models = importlib.util.find_spec("jaxpar.models")
    if models is not None and models.origin:
        roots.append(Path(models.origin).resolve().parent)
    for root in dict.fromkeys(roots):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _arguments(args) -> tuple[str, list]:
    """The arguments' tree and, per leaf, its path, shape, dtype and sharding (the values never enter a key)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(args)
    described = [(jax.tree_util.keystr(path), tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", type(leaf))),
                  repr(getattr(leaf, "sharding", None)), bool(getattr(leaf, "weak_type", False)))
                 for path, leaf in leaves]
    return str(tree), described


def _devices(args) -> list:
    """The devices the arguments lie on: id, process, platform and kind."""
    devices = {d for leaf in jax.tree.leaves(args) if hasattr(leaf, "sharding") for d in leaf.sharding.device_set}
    return sorted((d.id, d.process_index, d.platform, d.device_kind) for d in devices)


def _execution_devices(args) -> list:
    """The devices the step runs on, in the order jit assigns them: its first argument's mesh (one device: that)."""
    sharding = next(leaf.sharding for leaf in jax.tree.leaves(args) if hasattr(leaf, "sharding"))
    mesh = getattr(sharding, "mesh", None)
    return list(mesh.devices.flat) if mesh is not None else sorted(sharding.device_set, key=lambda d: d.id)


def key(program: Mapping[str, Any], args) -> str:
    """The key of the step compiled for `args`, `program` naming what else decides it (plan, model, settings)."""
    import jaxlib

    config = sorted((name, repr(value)) for name, value in jax.config.values.items())
    parts = (source_digest(), jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS", ""), config,
             _devices(args), jax.process_count(), jax.process_index(), sorted((k, repr(v)) for k, v in program.items()),
             _arguments(args))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def path_of(directory: str | Path, step_key: str) -> Path:
    return Path(directory) / SUBDIRECTORY / f"{step_key}.exe"


def load(directory: str | Path | None, step_key: str, args) -> tuple[jax.stages.Compiled, Any] | None:
    """The stored step of `step_key` loaded onto the arguments' devices, and what was stored with it; None when
    there is none, or when it cannot be read or loaded (then said once, and the caller compiles)."""
    if directory is None:
        return None
    path = path_of(directory, step_key)
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    from jax.experimental import serialize_executable

    try:
        entry = pickle.loads(blob)
        devices = _execution_devices(args)
        compiled = serialize_executable.deserialize_and_load(entry["executable"], entry["in_tree"],
                                                             entry["out_tree"], backend=devices[0].client,
                                                             execution_devices=devices)
    except Exception as error:  # noqa: BLE001 (a damaged or foreign entry of any kind is a miss)
        warnings.warn(f"jaxpar: the stored step {path} cannot be loaded ({type(error).__name__}: {error}); "
                      f"compiling it again", stacklevel=2)
        return None
    return compiled, entry["extra"]


def store(directory: str | Path | None, step_key: str, compiled: jax.stages.Compiled, extra: Any = None) -> bool:
    """Keep `compiled` under `step_key` with `extra` (what the caller needs back without tracing); False when it
    cannot be (no directory, a step JAX cannot serialize, a directory that refuses the write)."""
    if directory is None:
        return False
    from jax.experimental import serialize_executable

    try:
        executable, in_tree, out_tree = serialize_executable.serialize(compiled)
        blob = pickle.dumps({"executable": executable, "in_tree": in_tree, "out_tree": out_tree, "extra": extra})
    except (ValueError, NotImplementedError, TypeError, pickle.PicklingError, AttributeError):
        return False  # closed-over constants, a tree of local classes: the step compiles next time too
    path, temporary = path_of(directory, step_key), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.fchmod(handle, 0o644)  # as readable as JAX's own entries (mkstemp makes it 0600)
        with os.fdopen(handle, "wb") as file:
            file.write(blob)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        return False
    return True

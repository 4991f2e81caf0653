"""What a checkpoint's arrays are checked against: a checksum of each array's values, and the shapes and dtypes
a target state expects.

Orbax's files carry no checksum of the array values (a flipped byte in a data file restores silently), so
`jaxpar.train.checkpoint` writes these checksums into every step's `meta` and verifies them after each restore.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpar.parallel import offload


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaves(tree) -> dict[str, Any]:
    """path -> array leaf, paths as `opt_state/0/mu/blocks/wq` for saved and live trees alike."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in flat}


def _leaf_table(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """path -> (shape, dtype) of every array leaf."""
    return {path: (tuple(leaf.shape), str(np.dtype(leaf.dtype))) for path, leaf in _leaves(tree).items()}


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: each input bit flips about half of the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _array_checksum(x: jax.Array) -> jax.Array:
    """32 bits from an array's values and positions, equal under every sharding of it.

    Each element's bits are mixed with its flat index and the results summed
    modulo 2**32, an exactly associative reduction: the shards' partial sums
    combine to the same value whatever plan holds the array, so a checkpoint
    saved under one plan is verified under another without gathering anything.
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    index, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for axis in reversed(range(x.ndim)):
        index = index + lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    return jnp.sum(_mix(bits ^ _mix(index + jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)


_checksum_tree = jax.jit(lambda tree: jax.tree.map(_array_checksum, tree))


def checksums(arrays: dict) -> dict[str, int]:
    """`item/path` -> checksum of every array in `{item: tree}` (what `save` writes and restores verify).

    Arrays kept in host memory (jaxpar.parallel.offload) visit the device one at a time,
    so a checksum never needs the whole offloaded state in device memory.
    """
    leaves = _leaves(arrays)
    on_host = {path for path, x in leaves.items() if offload.in_host_memory(x)}
    sums = _leaves(jax.device_get(_checksum_tree({p: x for p, x in leaves.items() if p not in on_host})))
    sums.update({path: jax.device_get(_checksum_tree(offload.fetched(leaves[path]))) for path in on_host})
    return {path: int(sums[path]) for path in leaves}


def mismatches(saved, target, dtypes: bool = True) -> list[str]:
    """Every leaf whose shape (or dtype) differs between a saved tree and the target, and leaves only one has."""
    saved, target = _leaf_table(saved), _leaf_table(target)
    lines = []
    for path in [*target, *(p for p in saved if p not in target)]:
        if path not in target:
            lines.append(f"{path}: saved {_show(saved[path])}, not in the model")
        elif path not in saved:
            lines.append(f"{path}: not in the checkpoint, model {_show(target[path])}")
        elif saved[path][0] != target[path][0] or (dtypes and saved[path][1] != target[path][1]):
            lines.append(f"{path}: saved {_show(saved[path])}, model {_show(target[path])}")
    return lines


def listing(lines: list[str], limit: int = 24) -> str:
    """Indented lines for an error message, the middle elided beyond `limit`."""
    if len(lines) > limit:
        lines = lines[: limit - 4] + [f"... {len(lines) - limit + 1} more ..."] + lines[-3:]
    return "\n  " + "\n  ".join(lines)


def _show(entry: tuple[tuple[int, ...], str]) -> str:
    return f"{entry[1]}{list(entry[0])}"


def _skeleton(tree):
    """A tree's containers as Orbax saves them: dicts (named tuples by their fields), lists, "*" for an array, None
    for an empty container (optax's EmptyState) or None."""
    if tree is None:
        return None
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return "*"
    if isinstance(tree, dict):
        children = {str(k): v for k, v in tree.items()}
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        children = list(tree)
    else:  # a named tuple or another pytree node: its children by key, as jax names them
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
        if all(isinstance(path[0], jax.tree_util.SequenceKey) for path, _ in flat):
            children = [leaf for _, leaf in flat]
        else:
            children = {_key_name(path[0]): leaf for path, leaf in flat}
    if isinstance(children, dict):
        out = {k: _skeleton(v) for k, v in children.items()}
        return {k: v for k, v in out.items() if v is not None} or None
    out = [_skeleton(v) for v in children]
    return out if any(v is not None for v in out) else None


def _describe(node) -> str:
    if node is None:
        return "nothing"
    if node == "*":
        return "an array"
    if isinstance(node, dict):
        return f"{{{', '.join(sorted(node))}}}"
    return f"a sequence of {len(node)}"


def structure_difference(saved, target, path: str) -> str | None:
    """Where a saved tree's containers first differ from the target's (as `path/...: saved X, here Y`), else None.

    The arrays may all agree while the containers do not: adamw's state is adam's with one more empty part."""
    return _first_difference(_skeleton(saved), _skeleton(target), path)


def _first_difference(saved, target, path: str) -> str | None:
    same_kind = type(saved) is type(target) and (not isinstance(saved, list) or len(saved) == len(target))
    if not same_kind or (isinstance(saved, dict) and sorted(saved) != sorted(target)):
        return f"{path}: saved {_describe(saved)}, here {_describe(target)}"
    if isinstance(saved, dict):
        pairs = [(f"{path}/{k}", saved[k], target[k]) for k in sorted(saved)]
    elif isinstance(saved, list):
        pairs = [(f"{path}/{i}", s, t) for i, (s, t) in enumerate(zip(saved, target))]
    else:
        return None
    return next((d for p, s, t in pairs if (d := _first_difference(s, t, p)) is not None), None)

"""Logical axis rules: model code names dimensions, a plain dict maps names to mesh axes.

A rule maps a logical name (`embed`, `mlp`, `heads`, ...) to one mesh axis, a
tuple of them, or None (replicated). Rules come as a mapping or, as Flax's
`nnx.logical_axis_rules` and Linen take them, a sequence of (logical, mesh axes)
pairs (`as_rules`). Resolution turns a tuple of logical names
into a PartitionSpec for a concrete mesh, dropping axes of size 1, never using a
mesh axis twice in one spec, and checking divisibility so that a bad shape fails
before anything compiles.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

Rule = str | tuple[str, ...] | None
Rules = Mapping[str, Rule]

# `seq` is the sequence dimension of every activation, split over `context`
# (context parallelism: jaxpar.parallel.attention); `seq_residual` is the sequence
# dimension of the residual stream (norms, adds), over `context` and, under
# sequence parallelism, `tensor` as well.
DEFAULT_RULES: dict[str, Rule] = {
    "batch": ("replica", "data", "expert"),
    "seq": "context",
    "seq_residual": "context",
    "embed": None,
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "vocab": "tensor",
    "layers": "pipe",
    "prefix_layers": None,  # layers before the pipeline's first stage (zero_layout.PREFIX_SCANNED): on every stage
    "experts": "expert",
    "expert_mlp": "tensor",
    "norm": None,
}

# Logical axes whose dimension, when smaller than its mesh axes and a divisor of them, is replicated instead of
# refused: a model with fewer key/value heads than tensor ranks keeps each head on tensor/kv_heads ranks
# (Megatron, MaxText); jaxpar.parallel.tensor.kv_heads_for_ranks hands each rank the head its queries read.
REPLICATED_WHEN_FEWER = frozenset({"kv_heads"})


@dataclasses.dataclass(frozen=True)
class LogicalArray:
    """Shape, dtype and logical axis names of one array of a model (no data): what a plan resolves to specs."""

    shape: tuple[int, ...]
    dtype: Any
    names: tuple[str | None, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def is_logical(x) -> bool:
    return isinstance(x, LogicalArray)


def as_rules(rules: Rules | Sequence[tuple[str, Rule]], rename: Mapping[str, str] | None = None) -> dict[str, Rule]:
    """Rules as a dict from a mapping or a sequence of (logical, mesh axes) pairs, mesh axes renamed by `rename`.

    A sequence may name a logical axis more than once only with the same
    mesh axes (jaxpar maps each logical name to one rule).
    """
    pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    out: dict[str, Rule] = {}
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(f"a rule is a (logical name, mesh axes) pair, got {pair!r}")
        name, rule = pair
        axes = tuple((rename or {}).get(a, a) for a in mesh_axes_of(rule))
        if not all(isinstance(a, str) for a in axes):
            raise ValueError(f"rule {name!r} -> {rule!r}: mesh axes must be names (str), a tuple of them or None")
        rule = None if not axes else axes[0] if isinstance(rule, str) else axes
        if name in out and out[name] != rule:
            raise ValueError(f"logical axis {name!r} has two rules, {out[name]!r} and {rule!r}; give it one")
        out[name] = rule
    return out


def mesh_axes_of(rule: Rule) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def resolve_spec(
    logical: Sequence[str | None],
    shape: Sequence[int],
    mesh_shape: Mapping[str, int],
    rules: Rules,
    path: str = "array",
    skip_axes: Sequence[str] = (),
    check: bool = True,
) -> P:
    """PartitionSpec for an array whose dimensions carry the given logical names.

    Raises ValueError naming the path, dimension, size and mesh axes when a
    sharded dimension does not divide by the product of its mesh axes
    (`check=False`: `shape` is a shard inside a shard_map, already checked whole).
    """
    if len(logical) != len(shape):
        raise ValueError(f"{path}: {len(logical)} logical axis names {tuple(logical)} for a rank-{len(shape)} array")
    used: set[str] = set(skip_axes)
    entries = []
    for dim, (name, size) in enumerate(zip(logical, shape)):
        if name is None:
            entries.append(None)
            continue
        if name not in rules:
            raise ValueError(f"{path}: logical axis {name!r} (dimension {dim}) has no rule; known: {sorted(rules)}")
        axes = tuple(a for a in mesh_axes_of(rules[name]) if mesh_shape.get(a, 1) > 1 and a not in used)
        for axis in mesh_axes_of(rules[name]):
            if axis not in mesh_shape:
                raise ValueError(f"rule {name!r} -> {rules[name]!r} names unknown mesh axis {axis!r}")
        ways = math.prod(mesh_shape[a] for a in axes)
        if check and size % ways:
            if name in REPLICATED_WHEN_FEWER and ways % size == 0:
                entries.append(None)
                continue
            sizes = ", ".join(f"{a}={mesh_shape[a]}" for a in axes)
            fewer = (f", nor is it a divisor of {ways} (then each of the {size} is replicated over "
                     f"{ways}/{size} ranks)") if name in REPLICATED_WHEN_FEWER else ""
            raise ValueError(
                f"{path}: dimension {dim} ({name!r}) of size {size} does not divide by mesh axes "
                f"{sizes} (product {ways}){fewer}"
            )
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def specs_over(specs, axes: Sequence[str]):
    """A tree of specs cut down to the mesh `axes`: the in/out specs of a shard_map manual over those alone."""
    def entry(e):
        kept = tuple(a for a in mesh_axes_of(e) if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return jax.tree.map(lambda spec: P(*map(entry, spec)), specs, is_leaf=lambda x: isinstance(x, P))

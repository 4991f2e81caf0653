"""What a model's code calls to place an activation: a sharding constraint from logical names, read from the
active plan (`jaxpar.core.trace`), and the mesh axes a name or an array is split or varies over.

Outside a plan every one of them is a no-op, so model code runs unchanged on one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxpar.core.rules import mesh_axes_of, resolve_spec
from jaxpar.core.trace import active_plan


def varying_axes(x) -> set[str]:
    """The manual axes along which x (an array or a `jax.eval_shape` result) may differ between devices (`vma`)."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = aval.manual_axis_type  # jax 0.12 leaves it None on a ShapeDtypeStruct varying over nothing
    return set(manual.varying) if manual is not None else set()


def rule_axes(name: str) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that the active plan's rules give a logical name; () outside a plan."""
    plan = active_plan()
    if plan is None:
        return ()
    shape = plan.shape
    return tuple(a for a in mesh_axes_of(plan.logical_rules.get(name)) if shape.get(a, 1) > 1)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Sharding constraint from logical names; a no-op outside a plan (`jaxpar.core.trace`).

    Inside a `jax.shard_map` the manual axes are left out, so the same model
    code runs in a pipeline stage or an expert shard.
    """
    plan = active_plan()
    if plan is None:
        return x
    shape, rules = plan.shape, plan.logical_rules
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if manual >= {a for a, s in shape.items() if s > 1}:
        return x
    spec = resolve_spec(logical, x.shape, shape, rules, path="activation", skip_axes=tuple(manual))
    return jax.lax.with_sharding_constraint(x, spec)

"""The plan being traced under: the one piece of context jaxpar's layers read (mesh, rules, tensor form, ...).

`Plan.activate` sets it around tracing; `jaxpar.rules.constrain`, the
tensor-parallel and MoE layers, the stacked-layer block and the pipeline read
it through `active_plan`. Outside a plan it is None and those layers run as
plain single-device code.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
    from jaxpar.plan import Plan

_active: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("jaxpar_plan", default=None)


def active_plan() -> Plan | None:
    """The plan being traced under, or None."""
    return _active.get()


@contextlib.contextmanager
def activate(plan: Plan):
    """Make `plan` the active plan and its mesh jax's current mesh while the body runs."""
    token = _active.set(plan)
    try:
        with jax.set_mesh(plan.mesh):
            yield
    finally:
        _active.reset(token)

"""The plan being traced under: the one piece of context jaxpar's layers read (mesh, rules, tensor form, ...).

`Plan.activate` sets it around tracing; `jaxpar.core.rules.constrain`, the
tensor-parallel and MoE layers, the stacked-layer block and the pipeline read
it through `active_plan`. Outside a plan it is None and those layers run as
plain single-device code.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
    from jaxpar.core.plan import Plan

_active: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("jaxpar_plan", default=None)
# jax caches what it traces (jit, eval_shape, scan and checkpoint bodies) by the function, not by jaxpar's plan:
# a model's module-level function traced under one plan would be reused under another (sequence parallelism
# changes its shapes). Tracing under a plan therefore sets this jax user context to the plan's own key.
_traced_under = jax.make_user_context(None)
_keys = itertools.count()


def _key_of(plan: Plan) -> tuple[int, int]:
    """A key of this plan object (a Plan holds dicts: unhashable), unique in the process; the process id keeps a
    plan pickled in another process from taking a local plan's key."""
    if "_trace_key" not in plan.__dict__:
        object.__setattr__(plan, "_trace_key", (os.getpid(), next(_keys)))
    return plan.__dict__["_trace_key"]


def active_plan() -> Plan | None:
    """The plan being traced under, or None."""
    return _active.get()


@contextlib.contextmanager
def activate(plan: Plan):
    """Make `plan` the active plan and its mesh jax's current mesh while the body runs."""
    token = _active.set(plan)
    try:
        with jax.set_mesh(plan.mesh), _traced_under(_key_of(plan)):
            yield
    finally:
        _active.reset(token)

"""The one trace context: the plan being traced under, and what jaxpar's layers note while they are traced.

`Plan.activate` sets the plan around tracing; `jaxpar.parallel.constrain`, the
tensor-parallel and MoE layers, the stacked-layer block and the pipeline read
it through `active_plan`. Outside a plan it is None and those layers run as
plain single-device code.

Everything else a trace carries lives here too, in one context variable, so
that nested traces (a pipeline inside the step, a nested shard_map) each see
their own and nothing outlives the trace that set it:

- `used`: the features the model used (`jaxpar.core.usage`), so that a plan
  option that acted on nothing is refused or warned about;
- `ordered`: the ends of the model whose sequence is already in context order
  (`jaxpar.parallel.attention.already_ordered`);
- `zero_layers`: each gathered or cast stacked parameter's source, by array id,
  so that a layer scan gathers one layer at a time (`jaxpar.parallel.zero`);
- `train_state_layers`: the stacked layers come from a train state, so in the
  plan's layer order (`jaxpar.pipeline.layer_order`);
- `bubble_fill`: the value written into the pipeline's empty slots (tests fill
  them with NaN, so that a leak from a bubble cannot hide);
- `documents`: the per-token extras of the rows being traced (segment ids,
  positions, loss weights of packed documents; `jaxpar.parallel.documents`);
- `token_reduction`: what the cross-entropy makes of its per-token losses
  instead of their weighted mean (a training objective over whole sequences,
  `jaxpar.objectives`; None: the mean).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import os
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Trace:
    plan: Any = None  # the jaxpar.core.plan.Plan being traced under, or None
    used: set[str] | None = None
    ordered: frozenset[str] = frozenset()
    zero_layers: dict | None = None
    train_state_layers: bool = False
    bubble_fill: float = 0.0
    documents: dict | None = None
    token_reduction: Any = None  # (losses [b, s], weights or None, order) -> scalar; None: the weighted mean


_trace: contextvars.ContextVar[Trace] = contextvars.ContextVar("jaxpar_trace", default=Trace())
# jax caches what it traces (jit, eval_shape, scan and checkpoint bodies) by the function, not by jaxpar's plan:
# a model's module-level function traced under one plan would be reused under another (sequence parallelism
# changes its shapes). Tracing under a plan therefore sets this jax user context to the plan's own key.
_traced_under = jax.make_user_context(None)
_keys = itertools.count()


def current() -> Trace:
    """What the trace now running carries (all defaults outside one)."""
    return _trace.get()


@contextlib.contextmanager
def scoped(**changes):
    """The current trace with `changes` (fields of `Trace`) while the body runs."""
    token = _trace.set(dataclasses.replace(_trace.get(), **changes))
    try:
        yield
    finally:
        _trace.reset(token)


def active_plan():
    """The plan being traced under, or None."""
    return _trace.get().plan


def _key_of(plan) -> tuple[int, int]:
    """A key of this plan object (a Plan holds dicts: unhashable), unique in the process; the process id keeps a
    plan pickled in another process from taking a local plan's key."""
    if "_trace_key" not in plan.__dict__:
        object.__setattr__(plan, "_trace_key", (os.getpid(), next(_keys)))
    return plan.__dict__["_trace_key"]


@contextlib.contextmanager
def activate(plan):
    """Make `plan` the active plan and its mesh jax's current mesh while the body runs."""
    with scoped(plan=plan), jax.set_mesh(plan.mesh), _traced_under(_key_of(plan)):
        yield

"""The order of stacked layers in a train state: natural, or the interleaved pipeline's.

Under a plan with pipe = p > 1 and virtual_stages = v > 1 (the interleaved
schedule) device i of `pipe` runs the layer chunks k*p + i (k < v) of
c = L / (p*v) layers each. A train state on such a plan holds every stacked
array in *pipeline order*: stored row (i*v + k)*c + r is natural layer
(k*p + i)*c + r. The `layers` -> `pipe` sharding then hands device i exactly
its v chunks, and the pipeline cuts them with a reshape: no weights move
between devices per step. Under every other plan the two orders are the same.

Stacked arrays are the parameters whose first logical axis is `layers` and
the optimizer-state leaves that mirror them (Adam's moments, ZeRO-1's fp32
master). The convention: a state placed on a plan (`init_state`,
`place_state`, `Checkpoints.restore`, `--init-from`) and the gradients of
its step are in that plan's order; everything else is in natural order:
checkpoints and exports, the state `place_state` takes, parameters loaded
for evaluation or generation (a forward outside the pipeline).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

from jaxpar.core import options, trace, zero_layout
from jaxpar.core.rules import is_logical


def reorders(plan) -> bool:
    """Whether `plan` keeps stacked layers in pipeline order (an interleaved pipeline), not natural order."""
    return plan.shape["pipe"] > 1 and plan.virtual_stages > 1


def check_depth(depth: int, stages: int, virtual_stages: int) -> None:
    """Raise ValueError unless `depth` stacked layers cut into stages x virtual_stages equal chunks."""
    if depth % (stages * virtual_stages):
        raise ValueError(f"{depth} stacked layers do not divide into pipe={stages} x virtual_stages={virtual_stages} "
                         f"= {stages * virtual_stages} pipeline chunks")


def to_pipeline_order(tree, logical, plan):
    """`tree` (parameters, gradients: the structure of `logical`, a model's LogicalArrays) in `plan`'s order."""
    return _reordered(tree, logical, plan, to_natural=False)


def to_natural_order(tree, logical, plan):
    """`tree` (parameters, gradients) held in `plan`'s order, in natural layer order."""
    return _reordered(tree, logical, plan, to_natural=True)


def state_to_pipeline_order(state, logical, optimizer, plan, optimized=None):
    """A train state in natural order (parameters and optimizer state) in `plan`'s order.

    `optimized`: the logical names of the parameters the optimizer updates (default `logical`: all of them).
    """
    return _state_reordered(state, logical, optimizer, plan, False, optimized)


def state_to_natural_order(state, logical, optimizer, plan, optimized=None):
    """A train state held in `plan`'s order in natural layer order (what checkpoints hold)."""
    return _state_reordered(state, logical, optimizer, plan, True, optimized)


def _state_reordered(state, logical, optimizer, plan, to_natural: bool, optimized=None):
    """Parameters and every optimizer leaf that mirrors one, matched as `Plan.optimizer_specs` matches them."""
    if not reorders(plan):
        return state
    one = _reorder_leaf(plan, to_natural)
    opt_state = optax.tree_map_params(options.wrapped_optimizer(optimizer, plan), one, state.opt_state,
                                      logical if optimized is None else optimized, is_leaf=is_logical)
    return dataclasses.replace(state, params=_reordered(state.params, logical, plan, to_natural), opt_state=opt_state)


def _reordered(tree, logical, plan, to_natural: bool) -> Any:
    if not reorders(plan):
        return tree
    return jax.tree.map(_reorder_leaf(plan, to_natural), tree, logical, is_leaf=is_logical)


def _reorder_leaf(plan, to_natural: bool):
    """x -> x in the other order if x is stacked (its first logical axis is `layers`), else x."""
    p, v = plan.shape["pipe"], plan.virtual_stages

    def one(x, names):
        if not is_logical(names) or names.names[:1] != (zero_layout.SCANNED,):
            return x
        return _swap_chunks(x, p, v, to_natural)

    return one


def _swap_chunks(x, p: int, v: int, to_natural: bool):
    """x with its p*v chunks of rows transposed between [v, p] (natural) and [p, v] (pipeline) order.

    Reshapes only, so numpy arrays, jax arrays and tracers alike.
    """
    check_depth(x.shape[0], p, v)
    outer, inner = (p, v) if to_natural else (v, p)
    return x.reshape(outer, inner, x.shape[0] // (p * v), *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


ORDERS = ("pipeline", "natural")
def train_state_layers():
    """Parameters traced inside come from a train state on the active plan, so in its order (jaxpar's train
    step traces the loss under this)."""
    return trace.scoped(train_state_layers=True)


def stack_in_plan_order(stacked, plan, order: str | None):
    """`stacked` (arrays whose leading axis is the layers) in `plan`'s order, from the `order` its caller
    names: "pipeline" (a train state's, the default inside jaxpar's train step) or "natural" (moved into
    pipeline order here, inside the step: a relayout of the stack each step).

    Under an interleaved plan a stack whose order is not known is refused: taking natural-order layers for
    pipeline-order ones would train a model with its layers permuted, silently.
    """
    if order is not None and order not in ORDERS:
        raise ValueError(f"layer_order must be one of {ORDERS}, got {order!r}")
    if not reorders(plan):
        return stacked
    order = order or ("pipeline" if trace.current().train_state_layers else None)
    if order is None:
        p, v = plan.shape["pipe"], plan.virtual_stages
        raise ValueError(
            f"the plan's interleaved pipeline (pipe={p} x virtual_stages={v}) takes the stacked layers in pipeline "
            "order, as a train state on it holds them (jaxpar.pipeline.layer_order); outside jaxpar's train step pass "
            "layer_order='pipeline' for parameters from init_state/place_state/restore on this plan (or trace the "
            "loss under jaxpar.pipeline.layer_order.train_state_layers()), or layer_order='natural' for parameters in the "
            "model's own order (moved into place each step)")
    if order == "pipeline":
        return stacked
    return jax.tree.map(lambda x: _swap_chunks(x, plan.shape["pipe"], plan.virtual_stages, to_natural=False), stacked)

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

from jaxpar import precision, zero
from jaxpar.rules import is_logical


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


def state_to_pipeline_order(state, logical, optimizer, plan):
    """A train state in natural order (parameters and optimizer state) in `plan`'s order."""
    return _state_reordered(state, logical, optimizer, plan, to_natural=False)


def state_to_natural_order(state, logical, optimizer, plan):
    """A train state held in `plan`'s order in natural layer order (what checkpoints hold)."""
    return _state_reordered(state, logical, optimizer, plan, to_natural=True)


def _state_reordered(state, logical, optimizer, plan, to_natural: bool):
    """Parameters and every optimizer leaf that mirrors one, matched as `Plan.optimizer_specs` matches them."""
    if not reorders(plan):
        return state
    one = _reorder_leaf(plan, to_natural)
    opt_state = optax.tree_map_params(precision.for_plan(optimizer, plan), one, state.opt_state, logical,
                                      is_leaf=is_logical)
    return dataclasses.replace(state, params=_reordered(state.params, logical, plan, to_natural), opt_state=opt_state)


def _reordered(tree, logical, plan, to_natural: bool) -> Any:
    if not reorders(plan):
        return tree
    return jax.tree.map(_reorder_leaf(plan, to_natural), tree, logical, is_leaf=is_logical)


def _reorder_leaf(plan, to_natural: bool):
    """x -> x with its p*v chunks transposed between [v, p] (natural) and [p, v] (pipeline) order, if stacked.

    Reshapes only, so numpy arrays, jax arrays and tracers alike.
    """
    p, v = plan.shape["pipe"], plan.virtual_stages
    outer, inner = (p, v) if to_natural else (v, p)

    def one(x, names):
        if not is_logical(names) or names.names[:1] != (zero.SCANNED,):
            return x
        check_depth(x.shape[0], p, v)
        return x.reshape(outer, inner, x.shape[0] // (p * v), *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)

    return one

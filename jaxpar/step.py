"""The compiled train step: loss and gradients (accumulated over microbatches), optax update.

`make_train_step` returns a `Step`: a `jax.jit` with in/out shardings from the
plan and the state donated, that enters the plan's mesh and rules whenever it
is traced, so model code can call `jaxpar.rules.constrain`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxpar.plan import Plan
from jaxpar.state import ModelDef, TrainState, state_specs

LossFn = Callable[[Any, dict], tuple[jax.Array, dict]]

REMAT = {
    "none": lambda f: f,
    "full": functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable),
    "selective": functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
}


def remat_wrapper(plan: Plan) -> Callable[[Callable], Callable]:
    """Wrap a per-block function with the plan's activation-checkpointing policy."""
    return REMAT[plan.remat]


class Step:
    """A jitted step that traces and lowers under its plan's mesh and logical rules."""

    def __init__(self, fn: Callable, plan: Plan, **jit_kwargs):
        self.plan = plan
        self._jitted = jax.jit(fn, **jit_kwargs)

    def __call__(self, *args):
        with self.plan.activate():
            return self._jitted(*args)

    def lower(self, *args):
        with self.plan.activate():
            return self._jitted.lower(*args)


def microbatches(batch: dict, k: int) -> dict:
    """Split every [B, ...] leaf into [k, B/k, ...]; microbatch j takes rows j, j+k, ...

    Strided rows keep each device's share of every microbatch local, so the
    split needs no communication whatever the batch sharding.
    """
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def loss_and_grads(model: ModelDef, loss_fn: LossFn, params, batch: dict, plan: Plan):
    """Mean loss, metrics and gradients over `plan.grad_accum` microbatches."""

    def compute(p, b):
        return loss_fn(model.merge(p), b)

    grad_fn = jax.value_and_grad(compute, has_aux=True)
    if plan.grad_accum == 1:
        (loss, aux), grads = grad_fn(params, batch)
        return loss, aux, grads

    def accumulate(carry, b):
        (loss, aux), grads = grad_fn(params, b)
        total = jax.tree.map(jnp.add, carry, (loss, aux, grads))
        return total, None

    mb = microbatches(batch, plan.grad_accum)
    first = jax.tree.map(lambda x: x[0], mb)
    shapes = jax.eval_shape(lambda: grad_fn(params, first))
    (loss_shape, aux_shape), grad_shape = shapes
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss_shape, aux_shape, grad_shape))
    (loss, aux, grads), _ = jax.lax.scan(accumulate, init, mb)
    scale = 1.0 / plan.grad_accum
    return jax.tree.map(lambda x: x * scale, (loss, aux, grads))


def make_train_step(
    model: ModelDef, loss_fn: LossFn, optimizer: optax.GradientTransformation, plan: Plan
) -> Step:
    """Compile-ready step(state, batch) -> (state, metrics) for `plan`."""
    state_shardings = plan.shardings(state_specs(model, optimizer, plan))
    batch_sharding = plan.sharding(plan.batch_spec(1))

    def step(state: TrainState, batch: dict):
        loss, aux, grads = loss_and_grads(model, loss_fn, state.params, batch, plan)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        return TrainState(params, opt_state, state.step + 1), metrics

    return Step(
        step,
        plan,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )

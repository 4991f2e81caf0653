"""The compiled train step: loss and gradients (accumulated over microbatches), optax update.

`make_train_step` returns a `Step`: a `jax.jit` with in/out shardings from the
plan and the state donated, that enters the plan's mesh and rules whenever it
is traced, so model code can call `jaxpar.rules.constrain`. The gradient path
runs per data rank inside `jax.shard_map` over `data`, where the ZeRO stage
decides which collective sums the gradients (jaxpar.zero); the update runs in
the plan's precision (jaxpar.precision).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxpar import precision, zero
from jaxpar.plan import Plan, active_plan
from jaxpar.rules import specs_over, varying_axes
from jaxpar.state import ModelDef, TrainState, state_specs

LossFn = Callable[[Any, dict], tuple[jax.Array, dict]]

# What a block keeps for its backward pass: everything, nothing (recompute the
# whole block), or the outputs of its weight matmuls (recompute attention and
# elementwise work, as in Korthikanti et al.'s selective recomputation).
REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_wrapper(plan: Plan) -> Callable[[Callable], Callable]:
    """Wrap a per-block function with the plan's activation-checkpointing policy.

    The ZeRO stage decides what becomes of a layer's gathered parameters.
    ZeRO-2 keeps them for the backward pass whatever else is recomputed.
    ZeRO-3 never keeps them: even `none` checkpoints the block, keeping every
    matmul output but nothing computed from the parameters alone (the gathered
    weights, their concatenations), so the backward pass gathers them again.
    """
    policy = REMAT[plan.remat]
    if plan.shape[zero.AXIS] > 1 and plan.zero == 2 and policy is not None:
        policy = jax.checkpoint_policies.save_from_both_policies(
            policy, jax.checkpoint_policies.save_only_these_names(zero.GATHERED)
        )
    if plan.shape[zero.AXIS] > 1 and plan.zero == 3 and policy is None:
        policy = jax.checkpoint_policies.dots_saveable
    return (lambda f: f) if policy is None else functools.partial(jax.checkpoint, policy=policy)


def active_remat() -> Callable[[Callable], Callable]:
    """The remat wrapper of the plan being traced (none outside a plan), for a model's layer scan."""
    plan = active_plan()
    return remat_wrapper(plan) if plan is not None else (lambda f: f)


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


def loss_and_grads(model: ModelDef, loss_fn: LossFn, params, batch: dict, plan: Plan, loss_scale=None):
    """Mean loss, metrics and gradients over the global batch, summed over `data` as the ZeRO stage asks.

    Each data rank differentiates its own rows inside `jax.shard_map`, manual
    over `plan.step_manual_axes` (`data`; `tensor` too under the explicit
    form, whose layers then write their collectives directly). Under ZeRO-0/1 its gradients stay local while microbatches
    accumulate and are summed over `data` once per step: all-reduced (ZeRO-0)
    or reduce-scattered into the optimizer's shards (ZeRO-1). Under ZeRO-2/3
    the parameters arrive sharded and each layer's are gathered inside the
    layer scan, so autodiff reduce-scatters each layer's gradients as the
    backward scan produces them: no full-size gradient ever exists.
    `loss_scale` multiplies the loss before differentiation (fp16).
    """
    shape = jax.tree.leaves(batch)[0].shape
    plan.check_batch(shape[0], shape[1] if len(shape) > 1 else None)
    extra = () if loss_scale is None else (loss_scale,)
    manual = plan.step_manual_axes
    if plan.axis_size(*manual) == 1 or zero.AXIS not in plan.batch_axes:
        return _per_rank(model, loss_fn, plan, False, params, batch, *extra)
    return jax.shard_map(
        functools.partial(_per_rank, model, loss_fn, plan, True),
        in_specs=(specs_over(plan.param_specs(model.logical), manual), P(zero.AXIS), *(P(),) * len(extra)),
        out_specs=(P(), P(), specs_over(plan.gradient_specs(model.logical), manual)),
        axis_names=set(manual),
    )(params, batch, *extra)


def _per_rank(model: ModelDef, loss_fn: LossFn, plan: Plan, over_data: bool, params, batch: dict, loss_scale=None):
    """One data rank's share of `loss_and_grads` (`over_data`: inside the shard_map, manual over data)."""
    param_specs, grad_specs = plan.param_specs(model.logical), plan.gradient_specs(model.logical)
    stacked = zero.stacked(model.logical)
    if over_data:
        params = zero.vary(params, param_specs)

    def compute(p, b):
        if over_data:
            with zero.layer_gathers(p, param_specs, stacked):
                loss, aux = loss_fn(model.merge(zero.gather_params(p, param_specs, stacked)), b)
        else:
            loss, aux = loss_fn(model.merge(p), b)
        return (loss if loss_scale is None else loss * loss_scale), (loss, aux)

    def one_microbatch(b):
        grads, (loss, aux) = jax.grad(compute, has_aux=True)(params, b)
        return loss, aux, grads

    k = plan.grad_accum
    loss, aux, grads = one_microbatch(batch) if k == 1 else _accumulate(one_microbatch, batch, k)
    ranks = plan.shape[zero.AXIS] if over_data else 1
    if over_data:
        grads = zero.sum_gradients(zero.scatter_gradients(grads, grad_specs, param_specs), grad_specs, param_specs)
        loss, aux = zero.mean((loss, aux))
    if k * ranks == 1:
        return loss, aux, grads
    return loss / k, jax.tree.map(lambda x: x / k, aux), jax.tree.map(lambda g: g / (k * ranks), grads)


def _accumulate(one_microbatch: Callable, batch: dict, k: int):
    """Sum (loss, aux, grads) over k strided microbatches in a scan, in fp32 accumulators.

    The sums come back in the dtypes one microbatch gives, so gradients are
    communicated in the parameters' dtype.
    """
    mb = microbatches(batch, k)
    shapes = jax.eval_shape(one_microbatch, jax.tree.map(lambda x: x[0], mb))

    def zeros(s):
        z = jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32))
        axes = tuple(sorted(varying_axes(s)))  # as varying as what is added (over data and, explicit, tensor)
        return jax.lax.pcast(z, axes, to="varying") if axes else z

    def add(total, b):
        return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, one_microbatch(b)), None

    total, _ = jax.lax.scan(add, jax.tree.map(zeros, shapes), mb)
    return jax.tree.map(lambda t, s: t.astype(s.dtype), total, shapes)


def keep_finite(old: TrainState, new: TrainState, metrics: dict, loss_scaling: bool) -> tuple[TrainState, dict]:
    """`new`, but with `old`'s params and optimizer state if the loss or gradient norm is NaN/Inf.

    The step counter still advances (its batch was consumed) and the metrics
    gain `nonfinite` (1: update skipped). Under fp16 loss scaling the optimizer
    has already skipped such an update and lowered its scale, which must stand.
    """
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    metrics = {**metrics, "nonfinite": jnp.logical_not(finite).astype(jnp.int32)}
    if loss_scaling:
        return new, metrics
    keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)  # noqa: E731
    return TrainState(keep(new.params, old.params), keep(new.opt_state, old.opt_state), new.step), metrics


def make_train_step(
    model: ModelDef, loss_fn: LossFn, optimizer: optax.GradientTransformation, plan: Plan
) -> Step:
    """Compile-ready step(state, batch) -> (state, metrics) for `plan`.

    Under ZeRO the update runs on each rank's shard of the gradients and
    optimizer state; ZeRO-1 then all-gathers the updated parameters, ZeRO-2/3
    keep them sharded until the layers gather them.
    """
    optimizer = precision.wrap(optimizer, plan.precision)
    state_shardings = plan.shardings(state_specs(model, optimizer, plan))
    batch_sharding = plan.sharding(plan.batch_spec(1))
    update_shardings = plan.shardings(plan.gradient_specs(model.logical))

    def step(state: TrainState, batch: dict):
        scale = optimizer.loss_scale(state.opt_state)
        loss, aux, grads = loss_and_grads(model, loss_fn, state.params, batch, plan, scale)
        params, opt_state, stats = optimizer.apply(grads, state.opt_state, state.params)
        params = jax.lax.with_sharding_constraint(params, update_shardings)
        metrics = {"loss": loss, **stats, **aux}
        return keep_finite(state, TrainState(params, opt_state, state.step + 1), metrics, optimizer.policy.loss_scaling)

    return Step(
        step,
        plan,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )

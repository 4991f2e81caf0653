"""Mixed precision: the dtype the model computes in, an fp32 master copy, and dynamic loss scaling.

The train state's `params` are the copy the model computes with. Under `bf16`
and `fp16` they are low precision and an fp32 master copy lives in the
optimizer state, so ZeRO shards it with the Adam moments (stage 1 and up) and
the step all-gathers only the 2-byte parameters. `fp16` also scales the loss
so small gradients survive its narrow range, skipping a step (and halving the
scale) whenever a gradient overflows. `bf16-params` keeps no master copy at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Policy:
    param_dtype: Any  # dtype of the train state's params, which the model computes in
    master: bool  # keep an fp32 master copy in the optimizer state
    loss_scaling: bool  # dynamic loss scaling (fp16)


POLICIES = {
    "fp32": Policy(jnp.float32, master=False, loss_scaling=False),
    "bf16": Policy(jnp.bfloat16, master=True, loss_scaling=False),
    "fp16": Policy(jnp.float16, master=True, loss_scaling=True),
    "bf16-params": Policy(jnp.bfloat16, master=False, loss_scaling=False),
}


class LossScale(NamedTuple):
    scale: jax.Array  # fp32 factor the loss is multiplied by before differentiation
    good_steps: jax.Array  # int32 steps since the last overflow or growth


class MasterState(NamedTuple):
    master: Any  # fp32 copy of the parameters, updated by the wrapped optimizer
    inner: Any  # the wrapped optimizer's own state
    loss_scale: LossScale | None


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax optimizer under a precision policy: init from fp32 parameters, then `apply` each step."""

    inner: optax.GradientTransformation
    policy: Policy
    initial_scale: float = 2.0**15
    growth_interval: int = 2000  # overflow-free steps before the loss scale doubles

    def cast(self, params):
        """The parameters in the dtype the model computes in."""
        return jax.tree.map(lambda p: p.astype(self.policy.param_dtype), params)

    def init(self, params):
        """Optimizer state from the model's (fp32) initial parameters."""
        if not self.policy.master:
            return self.inner.init(self.cast(params))
        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        scale = None
        if self.policy.loss_scaling:
            scale = LossScale(jnp.asarray(self.initial_scale, jnp.float32), jnp.zeros((), jnp.int32))
        return MasterState(master, self.inner.init(master), scale)

    def loss_scale(self, state) -> jax.Array | None:
        return state.loss_scale.scale if self.policy.loss_scaling else None

    def grad_norm(self, grads) -> jax.Array:
        """The global gradient norm `apply` reports (fp32 under a master copy); without loss scaling only."""
        if self.policy.master:
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return optax.tree.norm(grads)

    def apply(self, grads, state, params):
        """(new params, new state, metrics) from gradients of the (scaled) loss."""
        if not self.policy.master:
            updates, state = self.inner.update(grads, state, params)
            return optax.apply_updates(params, updates), state, {"grad_norm": self.grad_norm(grads)}
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if self.policy.loss_scaling:
            grads = jax.tree.map(lambda g: g / state.loss_scale.scale, grads)
        updates, inner = self.inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        metrics = {"grad_norm": optax.tree.norm(grads)}
        if not self.policy.loss_scaling:
            return self.cast(master), MasterState(master, inner, None), metrics
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        master, inner = keep(master, state.master), keep(inner, state.inner)
        scale = self._next_scale(state.loss_scale, finite)
        metrics |= {"loss_scale": state.loss_scale.scale}
        return self.cast(master), MasterState(master, inner, scale), metrics

    def _next_scale(self, current: LossScale, finite) -> LossScale:
        """Halve on overflow (not below 1); double after `growth_interval` finite steps in a row."""
        good = jnp.where(finite, current.good_steps + 1, 0)
        grow = good >= self.growth_interval
        scale = jnp.where(finite, jnp.where(grow, current.scale * 2, current.scale), jnp.maximum(current.scale / 2, 1.0))
        return LossScale(scale, jnp.where(grow, 0, good).astype(jnp.int32))


def wrap(optimizer, precision: str) -> Optimizer:
    """`optimizer` (an optax transformation, or an `nnx.Optimizer` of `nnx.Param`) under the named precision policy."""
    if isinstance(optimizer, nnx.Optimizer):
        if optimizer.wrt is not nnx.Param:
            raise ValueError(f"jaxpar optimizes the model's nnx.Param variables; this nnx.Optimizer has "
                             f"wrt={optimizer.wrt!r}: build it with wrt=nnx.Param")
        optimizer = optimizer.tx
    if precision not in POLICIES:
        raise ValueError(f"precision must be one of {tuple(POLICIES)}, got {precision!r}")
    if not isinstance(optimizer, Optimizer):
        return Optimizer(optimizer, POLICIES[precision])
    if optimizer.policy != POLICIES[precision]:
        raise ValueError(f"the optimizer is already wrapped for another precision than {precision!r}")
    return optimizer

"""Mixed precision: the dtype the state holds the parameters in, the dtype the model computes in, loss scaling.

Under `bf16` and `fp16` the train state holds the parameters once, in fp32,
and the optimizer updates them there; the model computes with a 2-byte cast
made where each parameter is used (jaxpar.zero.gather_params: per layer
inside the layer scan, and before ZeRO's all-gathers, so those move 2-byte
values). A persistent 2-byte copy beside an fp32 master would cost 2 bytes
per parameter of state on every device. `fp16` also scales the loss so small
gradients survive its narrow range, skipping a step (and halving the scale)
whenever a gradient overflows. `bf16-params` holds and updates bf16 parameters.
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
    param_dtype: Any  # dtype of the train state's params, which the optimizer updates
    compute_dtype: Any  # dtype the model computes in: the params are cast to it where they are used
    loss_scaling: bool  # dynamic loss scaling (fp16)

    @property
    def cast_at_use(self):
        """The dtype the step casts the parameters to for the model (None: they are used as held)."""
        return None if self.compute_dtype == self.param_dtype else self.compute_dtype


POLICIES = {
    "fp32": Policy(jnp.float32, jnp.float32, loss_scaling=False),
    "bf16": Policy(jnp.float32, jnp.bfloat16, loss_scaling=False),
    "fp16": Policy(jnp.float32, jnp.float16, loss_scaling=True),
    "bf16-params": Policy(jnp.bfloat16, jnp.bfloat16, loss_scaling=False),
}


class LossScale(NamedTuple):
    scale: jax.Array  # fp32 factor the loss is multiplied by before differentiation
    good_steps: jax.Array  # int32 steps since the last overflow or growth


class ScaledState(NamedTuple):
    inner: Any  # the wrapped optimizer's own state
    loss_scale: LossScale


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax optimizer under a precision policy: init from fp32 parameters, then `apply` each step."""

    inner: optax.GradientTransformation
    policy: Policy
    initial_scale: float = 2.0**15
    growth_interval: int = 2000  # overflow-free steps before the loss scale doubles

    def cast(self, params):
        """The parameters in the dtype the train state holds them in."""
        return jax.tree.map(lambda p: p.astype(self.policy.param_dtype), params)

    def init(self, params):
        """Optimizer state from the model's (fp32) initial parameters."""
        inner = self.inner.init(self.cast(params))
        if not self.policy.loss_scaling:
            return inner
        return ScaledState(inner, LossScale(jnp.asarray(self.initial_scale, jnp.float32), jnp.zeros((), jnp.int32)))

    def loss_scale(self, state) -> jax.Array | None:
        return state.loss_scale.scale if self.policy.loss_scaling else None

    def grad_norm(self, grads) -> jax.Array:
        """The global gradient norm `apply` reports; without loss scaling only."""
        return optax.tree.norm(grads)

    def apply(self, grads, state, params):
        """(new params, new state, metrics) from gradients of the (scaled) loss."""
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        if not self.policy.loss_scaling:
            updates, state = self.inner.update(grads, state, params)
            return optax.apply_updates(params, updates), state, {"grad_norm": self.grad_norm(grads)}
        grads = jax.tree.map(lambda g: g / state.loss_scale.scale, grads)
        updates, inner = self.inner.update(grads, state.inner, params)
        new = optax.apply_updates(params, updates)
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)  # noqa: E731
        metrics = {"grad_norm": optax.tree.norm(grads), "loss_scale": state.loss_scale.scale}
        scale = self._next_scale(state.loss_scale, finite)
        return keep(new, params), ScaledState(keep(inner, state.inner), scale), metrics

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

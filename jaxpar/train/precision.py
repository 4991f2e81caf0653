"""Mixed precision: the dtype the state holds the parameters in, the dtype the model computes in, loss scaling.

Under `bf16` and `fp16` the train state holds the parameters once, in fp32,
and the optimizer updates them there; the model computes with a 2-byte cast
made where each parameter is used (jaxpar.parallel.zero.gather_params: per layer
inside the layer scan, and before ZeRO's all-gathers, so those move 2-byte
values). A persistent 2-byte copy beside an fp32 master would cost 2 bytes
per parameter of state on every device. That holds where the parameters are
as sharded as the optimizer state (ZeRO-2/3) or nothing is (ZeRO-0).

Under ZeRO-1 the parameters are whole on every data rank while the optimizer
state is sharded, so fp32 parameters would cost 4 bytes per parameter on every
device. There the state holds them whole in the 2-byte compute dtype, and the
fp32 master in the optimizer state (`MasterState`), sharded over data with the
Adam moments: (2 + 2)Psi + 12Psi/N, ZeRO's P_os. The step updates each rank's
master shard and all-gathers its 2-byte cast. `Optimizer.zero` is the ZeRO
stage that acts on the state (`for_plan`), so every caller agrees on the layout.

Gradients are summed over the data ranks in the compute dtype: 2 bytes per
parameter on the wire (half of fp32's) and no fp32 copy of the summed
gradients beside the update (a rank's gradient of one 2-byte use is 2-byte
anyway; the sums are rounded, the cross-rank one once where the collective
adds in fp32, as XLA:CPU's does). The optimizer casts them to the parameters'
dtype.

`fp16` also scales the loss so small gradients survive its narrow range,
skipping a step (and halving the scale) whenever a gradient overflows.
`bf16-params` holds and updates bf16 parameters.

Frozen parameters (a LoRA run's base) get no update, so they need no master:
the state holds them in the compute dtype under every policy (`frozen_dtype`),
the cast the model would make at use anyway.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.core import options


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

options.register_choices("precision", POLICIES)


class LossScale(NamedTuple):
    scale: jax.Array  # fp32 factor the loss is multiplied by before differentiation
    good_steps: jax.Array  # int32 steps since the last overflow or growth


class ScaledState(NamedTuple):
    inner: Any  # the wrapped optimizer's own state
    loss_scale: LossScale


class MasterState(NamedTuple):
    """The optimizer state of ZeRO-1 under bf16/fp16 (the layout older checkpoints of every stage hold)."""

    master: Any  # fp32 parameters, updated by the wrapped optimizer; sharded over data like `inner`
    inner: Any  # the wrapped optimizer's own state
    loss_scale: LossScale | None  # fp16 only


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax optimizer under a precision policy: init from fp32 parameters, then `apply` each step.

    `zero`: the ZeRO stage that shards the train state (0 on a data axis of
    size 1); under ZeRO-1 a bf16/fp16 policy keeps an fp32 master (`master`).
    """

    inner: optax.GradientTransformation
    policy: Policy
    initial_scale: float = 2.0**15
    growth_interval: int = 2000  # overflow-free steps before the loss scale doubles
    zero: int = 0

    @property
    def master(self) -> bool:
        """Whether the state holds 2-byte params and an fp32 master in the optimizer state (ZeRO-1, bf16/fp16)."""
        return self.zero == 1 and self.policy.cast_at_use is not None

    @property
    def param_dtype(self):
        """The dtype the train state holds the parameters in."""
        return self.policy.compute_dtype if self.master else self.policy.param_dtype

    @property
    def master_on_host(self) -> bool:
        """Whether offloading the optimizer state takes the fp32 params too: they are the master (bf16/fp16)."""
        return self.policy.cast_at_use is not None and not self.master

    @property
    def frozen_dtype(self):
        """The dtype the train state holds frozen parameters in (a LoRA base): the compute dtype. They are never
        updated and the model reads them cast to it anyway, so an fp32 copy would only cost memory."""
        return self.policy.compute_dtype

    def cast(self, params, frozen: bool = False):
        """The parameters in the dtype the train state holds them in (`frozen`: parameters that do not train)."""
        dtype = self.frozen_dtype if frozen else self.param_dtype
        return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                            params)  # a quantized base's integer codes stay codes

    def init(self, params):
        """Optimizer state from the model's (fp32) initial parameters."""
        scale = LossScale(jnp.asarray(self.initial_scale, jnp.float32), jnp.zeros((), jnp.int32))
        if self.master:
            master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
            return MasterState(master, self.inner.init(master), scale if self.policy.loss_scaling else None)
        inner = self.inner.init(self.cast(params))
        return ScaledState(inner, scale) if self.policy.loss_scaling else inner

    def loss_scale(self, state) -> jax.Array | None:
        return state.loss_scale.scale if self.policy.loss_scaling else None

    def grad_norm(self, grads) -> jax.Array:
        """The global gradient norm `apply` reports, summed in fp32 (the gradients may be 2-byte); without loss
        scaling only."""
        return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), grads))

    def updated_master(self, grads, state):
        """(new fp32 master, new state, metrics) under ZeRO-1's master: the step casts and gathers the params."""
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if self.policy.loss_scaling:
            grads = jax.tree.map(lambda g: g / state.loss_scale.scale, grads)
        updates, inner = self.inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        metrics = {"grad_norm": optax.tree.norm(grads)}
        if not self.policy.loss_scaling:
            return master, MasterState(master, inner, None), metrics
        finite = _all_finite(grads)
        keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)  # noqa: E731
        master, inner = keep(master, state.master), keep(inner, state.inner)
        metrics["loss_scale"] = state.loss_scale.scale
        return master, MasterState(master, inner, self._next_scale(state.loss_scale, finite)), metrics

    def apply(self, grads, state, params):
        """(new params, new state, metrics) from gradients of the (scaled) loss."""
        if self.master:
            master, state, metrics = self.updated_master(grads, state)
            return self.cast(master), state, metrics
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        if not self.policy.loss_scaling:
            updates, state = self.inner.update(grads, state, params)
            return optax.apply_updates(params, updates), state, {"grad_norm": self.grad_norm(grads)}
        grads = jax.tree.map(lambda g: g / state.loss_scale.scale, grads)
        updates, inner = self.inner.update(grads, state.inner, params)
        new = optax.apply_updates(params, updates)
        finite = _all_finite(grads)
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


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree)]))


@options.register_optimizer_wrap
def for_plan(optimizer, plan) -> Optimizer:
    """`optimizer` under `plan`'s precision and the ZeRO stage that acts on its state (none on data of size 1)."""
    return wrap(optimizer, plan.precision, plan.zero if plan.zero_ranks > 1 else 0)


def wrap(optimizer, precision: str, zero: int = 0) -> Optimizer:
    """`optimizer` (an optax transformation, or an `nnx.Optimizer` of `nnx.Param`) under the named precision policy,
    for a state sharded by ZeRO stage `zero` (see `for_plan`; an optimizer wrapped for another stage is re-targeted)."""
    if isinstance(optimizer, nnx.Optimizer):
        if optimizer.wrt is not nnx.Param:
            raise ValueError(f"jaxpar optimizes the model's nnx.Param variables; this nnx.Optimizer has "
                             f"wrt={optimizer.wrt!r}: build it with wrt=nnx.Param")
        optimizer = optimizer.tx
    if precision not in POLICIES:
        raise ValueError(f"precision must be one of {tuple(POLICIES)}, got {precision!r}")
    if not isinstance(optimizer, Optimizer):
        return Optimizer(optimizer, POLICIES[precision], zero=zero)
    if optimizer.policy != POLICIES[precision]:
        raise ValueError(f"the optimizer is already wrapped for another precision than {precision!r}")
    return optimizer if optimizer.zero == zero else dataclasses.replace(optimizer, zero=zero)

"""Training state: a model's parameters and optimizer state as plain pytrees, placed by a plan.

The NNX module is split once into a static graph definition and a pure dict of
arrays; everything jaxpar shards, steps and checkpoints is that dict, and the
module is merged back only inside the traced loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar import precision
from jaxpar.plan import Plan


@dataclasses.dataclass(frozen=True)
class LogicalArray:
    """Shape, dtype and logical axis names of one parameter (no data)."""

    shape: tuple[int, ...]
    dtype: Any
    names: tuple[str | None, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of a split NNX model: how to rebuild it, and its parameters' logical names."""

    graphdef: nnx.GraphDef
    logical: Any

    def merge(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params)

    def param_count(self) -> int:
        return sum(math.prod(a.shape) for a in jax.tree.leaves(self.logical, is_leaf=_is_logical))

    def param_bytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.logical, is_leaf=_is_logical))


def _is_logical(x) -> bool:
    return isinstance(x, LogicalArray)


def _split(model: nnx.Module):
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def describe(make_model: Callable[[], nnx.Module]) -> ModelDef:
    """Trace the model's construction abstractly: its graph and logical names, no memory used."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(make_model)
    graphdef, state = nnx.split(abstract)
    names = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shapes = nnx.to_pure_dict(state)
    logical = jax.tree.map(
        lambda a, spec: LogicalArray(tuple(a.shape), a.dtype, tuple(spec) + (None,) * (len(a.shape) - len(spec))),
        shapes,
        names,
        is_leaf=lambda x: isinstance(x, P),
    )
    return ModelDef(graphdef, logical)


def state_specs(model: ModelDef, optimizer: optax.GradientTransformation, plan: Plan) -> TrainState:
    """PartitionSpecs of the whole train state under `plan` (checked for divisibility)."""
    return TrainState(
        params=plan.param_specs(model.logical),
        opt_state=plan.optimizer_specs(optimizer, model.logical),
        step=P(),
    )


def init_state(
    make_model: Callable[[], nnx.Module], optimizer: optax.GradientTransformation, plan: Plan
) -> tuple[ModelDef, TrainState]:
    """Build the model and optimizer state directly into their shards (never whole on one device)."""
    model = describe(make_model)
    shardings = plan.shardings(state_specs(model, optimizer, plan))

    def build():
        with nnx.use_eager_sharding(False):
            params = _split(make_model())[1]
        return _initial_state(params, optimizer, plan)

    return model, jax.jit(build, out_shardings=shardings)()


def _initial_state(params, optimizer: optax.GradientTransformation, plan: Plan) -> TrainState:
    """Step 0 from the model's parameters, in the plan's precision (e.g. bf16 params, fp32 master copy)."""
    optimizer = precision.wrap(optimizer, plan.precision)
    return TrainState(optimizer.cast(params), optimizer.init(params), jnp.zeros((), jnp.int32))


def place_state(state: TrainState, model: ModelDef, optimizer: optax.GradientTransformation, plan: Plan) -> TrainState:
    """Copy an existing state onto `plan`'s shardings (e.g. the same initial parameters on two meshes)."""
    return jax.device_put(state, plan.shardings(state_specs(model, optimizer, plan)))


def abstract_state(model: ModelDef, optimizer: optax.GradientTransformation, plan: Plan) -> TrainState:
    """The train state as sharded ShapeDtypeStructs: enough to compile and inspect any size of model."""
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.logical, is_leaf=_is_logical)
    state = jax.eval_shape(lambda p: _initial_state(p, optimizer, plan), shapes)
    shardings = plan.shardings(state_specs(model, optimizer, plan))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings)

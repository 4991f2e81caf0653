"""Training state: a model's parameters, optimizer state and other variables as plain pytrees, placed by a plan.

The NNX module is split once into a static graph definition and pure dicts of
arrays, and merged back only inside the traced loss. Only its `nnx.Param`s are
optimized. Its other variables (BatchNorm statistics, counters) live in
`TrainState.variables`: the step carries them through the model and keeps
what the model wrote. Its RNG streams are not state at all: at step t every
stream's key is `jax.random.fold_in(k, t)`, k the key the model was built with
(its `nnx.Rngs` seed), and its count starts at 0, so a step's randomness
depends on (seed, step) alone, on any mesh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.core.plan import Plan
from jaxpar.core.rules import LogicalArray, is_logical
from jaxpar.parallel import lora, offload, quantized_base
from jaxpar.pipeline import layer_order
from jaxpar.train import precision

# The three groups a model is split into: what the optimizer updates, its RNG streams, everything else.
GROUPS = (nnx.Param, nnx.RngState, ...)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array
    variables: Any = dataclasses.field(default_factory=dict)  # the model's other variables, updated each step


@dataclasses.dataclass(frozen=True)
class Streams:
    """A model's RNG streams as built: each key's raw data (numpy) and PRNG implementation, and every count."""

    keys: Any  # pure dict of the streams' state: uint32 key data for keys, the counts as built
    impls: dict[tuple, str]  # path of each key leaf -> its PRNG implementation

    def at_step(self, step) -> Any:
        """The streams' state for step `step`: keys folded with the step, counts at 0."""
        def one(path, leaf):
            impl = self.impls.get(path)
            if impl is None:
                return jnp.zeros_like(leaf)
            keys = jax.random.wrap_key_data(jnp.asarray(leaf), impl=impl)  # one per layer in a Stack
            return jax.vmap(lambda k: jax.random.fold_in(k, step))(keys.reshape(-1)).reshape(keys.shape)

        return jax.tree_util.tree_map_with_path(lambda p, x: one(_keys(p), x), self.keys)


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of a split NNX model: how to rebuild it, and the logical names of its arrays.

    logical: the parameters (tree of LogicalArray); variables: the other
    variables (same form); streams: its RNG streams (None: it has none);
    trainable: per parameter, whether the optimizer updates it (same tree of
    bools; None: all do). A frozen parameter (a LoRA base weight) gets no
    gradient, no optimizer state and no gradient sum.
    """

    graphdef: nnx.GraphDef
    logical: Any
    variables: Any = dataclasses.field(default_factory=dict)
    streams: Streams | None = None
    trainable: Any = None

    def trained(self, tree) -> Any:
        """The part of a tree shaped like the parameters (arrays, specs, names) that the optimizer updates."""
        return tree if self.trainable is None else _select(tree, self.trainable)

    def with_trained(self, tree, part) -> Any:
        """`tree` (shaped like the parameters) with its trained part replaced by `part`."""
        return part if self.trainable is None else _replace(tree, part)

    def frozen_false(self, part) -> Any:
        """A per-parameter tree of flags from one over the trained part, False for every frozen parameter."""
        if self.trainable is None:
            return part
        return _replace(jax.tree.map(lambda _: False, self.trainable), part)

    @property
    def stateful(self) -> bool:
        """Whether the model has variables besides its parameters or draws random numbers (see `jaxpar.train.step`)."""
        return bool(jax.tree.leaves(self.variables, is_leaf=is_logical)) or self.streams is not None

    def merge(self, params, variables=None, step=0, rngs=None) -> nnx.Module:
        """The module from its parameters, its other variables and its RNG streams (by default those of `step`)."""
        if variables is None:
            if jax.tree.leaves(self.variables, is_leaf=is_logical):
                raise ValueError("this model has variables besides its parameters: pass TrainState.variables too")
            variables = {}
        return nnx.merge(self.graphdef, params, self.streams_at(step) if rngs is None else rngs, variables)

    def streams_at(self, step) -> Any:
        """The RNG streams' state at step `step` (empty for a model without streams)."""
        return {} if self.streams is None else self.streams.at_step(step)

    @staticmethod
    def carried_of(module: nnx.Module) -> tuple[Any, Any]:
        """(RNG streams, other variables) of a merged module after it ran: what passes on to the next microbatch."""
        _, _, rngs, variables = nnx.split(module, *GROUPS)
        return nnx.to_pure_dict(rngs), nnx.to_pure_dict(variables)

    def param_count(self) -> int:
        return sum(math.prod(a.shape) for a in jax.tree.leaves(self.logical, is_leaf=is_logical))

    def param_bytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.logical, is_leaf=is_logical))


def _select(tree, mask):
    if not isinstance(mask, dict):
        return tree
    return {k: _select(tree[k], m) for k, m in mask.items() if any(jax.tree.leaves(m))}


def _replace(tree, part):
    if not isinstance(part, dict):
        return part
    return {k: _replace(v, part[k]) if k in part else v for k, v in tree.items()}


def _trainable_mask(abstract: nnx.Module, trainable) -> Any:
    """Per parameter whether `trainable` (an nnx filter) selects it; None when it selects all."""
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    chosen = {p for p, _ in jax.tree_util.tree_flatten_with_path(
        nnx.to_pure_dict(nnx.state(abstract, nnx.All(nnx.Param, trainable))))[0]}
    if not chosen:
        raise ValueError(f"the trainable filter {trainable!r} selects none of the model's parameters")
    mask = jax.tree_util.tree_map_with_path(lambda p, _: p in chosen, params)
    return None if all(jax.tree.leaves(mask)) else mask


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _split(model: nnx.Module):
    graphdef, params, _, variables = nnx.split(model, *GROUPS)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(variables)


def _logical(state: nnx.State) -> Any:
    """LogicalArrays of an abstract state, names read from each variable's own annotation.

    The annotation (`out_sharding`), not `nnx.get_partition_spec`: inside
    `nnx.logical_axis_rules(...)` the latter gives Flax's mesh axes instead of the logical names.
    """
    def one(variable):
        names = tuple(variable.get_metadata().get("out_sharding") or ())
        value = variable.get_value()
        shape = tuple(value.shape)
        return LogicalArray(shape, value.dtype, names + (None,) * (len(shape) - len(names)))

    return nnx.to_pure_dict(jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def describe(make_model: Callable[[], nnx.Module], trainable=nnx.Param) -> ModelDef:
    """Trace the model's construction abstractly: its graph and logical names, no memory used.

    A model with RNG streams is also built once for real, its parameters
    left out, to read the keys it was seeded with. `trainable`: the nnx filter
    of the parameters the optimizer updates (`jaxpar.lora.apply` returns the
    adapters'); the others are frozen.
    """
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(make_model)
    graphdef, params, rngs, variables = nnx.split(abstract, *GROUPS)
    streams = _streams(make_model) if jax.tree.leaves(rngs) else None
    return ModelDef(graphdef, _logical(params), _logical(variables), streams, _trainable_mask(abstract, trainable))


def _streams(make_model: Callable[[], nnx.Module]) -> Streams:
    impls: dict[tuple, str] = {}

    def build():
        with nnx.use_eager_sharding(False):
            state = nnx.to_pure_dict(nnx.split(make_model(), *GROUPS)[2])
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        for path, leaf in flat:
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                impls[_keys(path)] = str(jax.random.key_impl(leaf))
        return jax.tree.map(lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
                            state)

    keys = jax.tree.map(np.asarray, jax.jit(build)())
    return Streams(keys, impls)


def state_specs(model: ModelDef, optimizer, plan: Plan) -> TrainState:
    """PartitionSpecs of the whole train state under `plan` (checked for divisibility)."""
    quantized_base.check_plan(model.logical, plan)  # a quantized base in whole blocks on each device
    return TrainState(
        params=plan.param_specs(model.logical),
        opt_state=plan.optimizer_specs(optimizer, model.trained(model.logical)),
        step=jax.sharding.PartitionSpec(),
        variables=plan.variable_specs(model.variables),
    )


def state_shardings(model: ModelDef, optimizer, plan: Plan) -> TrainState:
    """Shardings of the whole train state under `plan`, in host memory where `plan.offload` puts it.

    Offloading the optimizer state takes the fp32 master with it: under bf16 and
    fp16 that is the parameters themselves, which the step casts at use, but
    under ZeRO-1 the master in the optimizer state (jaxpar.train.precision), the
    2-byte parameters staying on the device.
    """
    shardings = plan.shardings(state_specs(model, optimizer, plan))
    if plan.offload != "optimizer":
        return shardings
    master = precision.for_plan(optimizer, plan).master_on_host
    return dataclasses.replace(shardings, opt_state=offload.on_host(shardings.opt_state),
                               params=offload.on_host(shardings.params) if master else shardings.params)


def init_state(make_model: Callable[[], nnx.Module], optimizer, plan: Plan,
               trainable=nnx.Param) -> tuple[ModelDef, TrainState]:
    """Build the model and optimizer state directly into their shards (never whole on one device).

    `optimizer`: an optax transformation, or an `nnx.Optimizer` (its `tx`; it must update `nnx.Param`).
    The state holds the stacked layers in `plan`'s order (jaxpar.pipeline.layer_order). `trainable`: the
    nnx filter of what the optimizer updates (see `describe`); the other parameters are frozen.
    """
    model = describe(make_model, trainable)

    def build():
        with nnx.use_eager_sharding(False):
            _, params, variables = _split(make_model())
        return _initial_state(params, variables, model, optimizer, plan)

    return model, jax.jit(build, out_shardings=state_shardings(model, optimizer, plan))()


def state_from_params(params, model: ModelDef, optimizer, plan: Plan) -> TrainState:
    """Step 0 from given parameters in natural layer order (imported weights), built into `plan`'s shards."""
    build = lambda p: _initial_state(p, {}, model, optimizer, plan)  # noqa: E731
    return jax.jit(build, out_shardings=state_shardings(model, optimizer, plan))(params)


def state_from_base(base_params, make_model: Callable[[], nnx.Module], model: ModelDef, optimizer,
                    plan: Plan) -> TrainState:
    """Step 0 from given weights (natural order) of a model that `make_model` adds parameters to (LoRA adapters):
    the given ones as they are (quantized where `make_model` holds codes: QLoRA), the added ones as `make_model`
    initialises them (the rest of its init is unused, so XLA drops it)."""
    def build(base):
        with nnx.use_eager_sharding(False):
            _, params, _ = _split(make_model())
        return _initial_state(quantized_base.quantized_like(_replace(params, base), params), {}, model, optimizer,
                              plan)

    return jax.jit(build, out_shardings=state_shardings(model, optimizer, plan))(base_params)


def _initial_state(params, variables, model: ModelDef, optimizer, plan: Plan) -> TrainState:
    """Step 0 from the model's parameters (natural order), in `plan`'s layer order and parameter dtype (fp32 but
    under bf16-params, and bf16/fp16 under ZeRO-1, whose fp32 master the optimizer state holds; a frozen base in
    the compute dtype)."""
    optimizer = precision.for_plan(optimizer, plan)
    params = layer_order.to_pipeline_order(params, model.logical, plan)
    return TrainState(_held(params, optimizer, model), optimizer.init(model.trained(params)),
                      jnp.zeros((), jnp.int32), variables)


def _held(params, optimizer: precision.Optimizer, model: ModelDef) -> Any:
    """The parameters in the dtypes the state holds them in: what trains in the optimizer's parameter dtype, a
    frozen base in the compute dtype (jaxpar.train.precision)."""
    if model.trainable is None:
        return optimizer.cast(params)
    frozen = jax.tree_util.tree_map_with_path(  # a LoRA scale alpha / r keeps the value exports write (one per layer)
        lambda path, p: p if str(_keys(path)[-1]).endswith(lora.SCALE) else optimizer.cast(p, frozen=True), params)
    return model.with_trained(frozen, optimizer.cast(model.trained(params)))


def place_state(state: TrainState, model: ModelDef, optimizer, plan: Plan) -> TrainState:
    """Copy an existing state onto `plan`'s shardings (e.g. the same initial parameters on two meshes).

    `state` is in natural layer order, and comes back in `plan`'s (jaxpar.pipeline.layer_order): a state held by an
    interleaved plan goes through `layer_order.state_to_natural_order` first. Under bf16/fp16 a state of the
    other layout (fp32 params held once, or ZeRO-1's 2-byte params beside an fp32 master) is converted to
    `plan`'s: its fp32 values are what carry over (see jaxpar.train.precision).
    """
    state = _relayout(state, precision.for_plan(optimizer, plan), model)
    state = layer_order.state_to_pipeline_order(state, model.logical, optimizer, plan, model.trained(model.logical))
    return jax.device_put(state, state_shardings(model, optimizer, plan))


def _relayout(state: TrainState, optimizer: precision.Optimizer, model: ModelDef) -> TrainState:
    """`state` in `optimizer`'s layout: ZeRO-1's 2-byte params beside an fp32 master (of the trained parameters),
    or fp32 params held once; frozen ones in the compute dtype either way."""
    held = isinstance(state.opt_state, precision.MasterState)
    if optimizer.master and not held:
        scaled = isinstance(state.opt_state, precision.ScaledState)
        inner, scale = (state.opt_state.inner, state.opt_state.loss_scale) if scaled else (state.opt_state, None)
        return dataclasses.replace(state, params=optimizer.cast(state.params),
                                   opt_state=precision.MasterState(model.trained(state.params), inner, scale))
    if held and not optimizer.master:
        opt = state.opt_state
        inner = opt.inner if opt.loss_scale is None else precision.ScaledState(opt.inner, opt.loss_scale)
        return dataclasses.replace(state, params=model.with_trained(_held(state.params, optimizer, model), opt.master),
                                   opt_state=inner)
    return dataclasses.replace(state, params=_held(state.params, optimizer, model))


def abstract_state(model: ModelDef, optimizer, plan: Plan) -> TrainState:
    """The train state as sharded ShapeDtypeStructs: enough to compile and inspect any size of model."""
    shape_of = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree,  # noqa: E731
                                         is_leaf=is_logical)
    state = jax.eval_shape(lambda p, v: _initial_state(p, v, model, optimizer, plan), shape_of(model.logical),
                           shape_of(model.variables))
    shardings = state_shardings(model, optimizer, plan)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings)

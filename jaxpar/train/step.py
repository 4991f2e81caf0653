"""The compiled train step: loss and gradients (accumulated over microbatches), optax update.

`make_train_step` returns a `Step`: a `jax.jit` with in/out shardings from the
plan and the state donated, that enters the plan's mesh and rules whenever it
is traced, so model code can call `jaxpar.parallel.constrain.constrain`. The gradient path
runs per data rank inside `jax.shard_map` over `data`, where the ZeRO stage
decides which collective sums the gradients (jaxpar.parallel.zero); the update runs in
the plan's precision (jaxpar.train.precision). A model may then move what no gradient trains
from the step's metrics (`after_update`: DeepSeek-V3's router correction by its expert loads).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.core import trace, usage
from jaxpar.core.microbatches import microbatches
from jaxpar.core.plan import Plan
from jaxpar.core.rules import specs_over
from jaxpar.parallel import documents, grad_sink, lora, lora_dropout, offload, zero
from jaxpar.parallel.tensor import WEIGHTED
from jaxpar.parallel.constrain import varying_axes
from jaxpar.pipeline import layer_order
from jaxpar.train import precision
from jaxpar.train.state import ModelDef, TrainState, state_shardings

LossFn = Callable[..., Any]  # (model, batch[, rngs=]) -> loss or (loss, aux dict)

class Step:
    """A jitted step that traces and lowers under its plan, checking first what jax would otherwise refuse obscurely.

    Before jax sees the arguments, `check_args` (the batch against the plan);
    while tracing, the plan's options against what the model used
    (`jaxpar.core.usage`); and a sharding constraint over one of the step's manual
    axes is reported as such.
    """

    def __init__(self, fn: Callable, plan: Plan, check_args: Callable | None = None, **jit_kwargs):
        self.plan = plan
        self._check_args = check_args
        self.used: set[str] = set()  # what the model used when the step was last traced (jaxpar.core.usage)

        def traced(*args):
            with usage.explained(plan) as used:
                out = fn(*args)
            usage.check(plan, used)
            self.used = used
            return out

        self._jitted = jax.jit(traced, **jit_kwargs)

    def __call__(self, *args):
        return self._run(self._jitted, *args)

    def lower(self, *args):
        return self._run(self._jitted.lower, *args)

    def _run(self, call: Callable, *args):
        if self._check_args is not None:
            self._check_args(*args)
        with self.plan.activate():
            try:
                return call(*args)
            except ValueError as error:
                raise _manual_axis_error(error, self.plan) or error


def _manual_axis_error(error: ValueError, plan: Plan) -> ValueError | None:
    """jaxpar's message for a `with_sharding_constraint` naming an axis the step is manual over (None: another error)."""
    text = str(error)
    named = [a for a in plan.step_manual_axes if plan.shape[a] > 1 and f"'{a}'" in text]
    if "manual" not in text.lower() or not named:
        return None
    return ValueError(
        f"a sharding constraint in the model names mesh axis {named[0]!r}, but the step runs the model once per "
        f"{named[0]} rank (manual over {', '.join(a for a in plan.step_manual_axes if plan.shape[a] > 1)}), so that "
        f"axis cannot appear in it; constrain with logical names instead (jaxpar.constrain(x, ('batch', ...))), "
        f"which leaves the manual axes out"
    )


def check_batch(plan: Plan, batch) -> None:
    """The batch against the plan (jaxpar.core.plan.Plan.check_batch), from its first leaf's shape."""
    shape = jax.tree.leaves(batch)[0].shape
    plan.check_batch(shape[0], shape[1] if len(shape) > 1 else None)


def takes_rngs(loss_fn: Callable) -> bool:
    """Whether `loss_fn` takes an `rngs` argument (then it gets an `nnx.Rngs` for the step)."""
    try:
        return "rngs" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False


def call_loss(loss_fn: Callable, module, batch, key=None) -> tuple[jax.Array, dict]:
    """(loss, aux) from a loss_fn returning a scalar or (scalar, aux); aux that is not a dict becomes {"aux": aux}."""
    out = loss_fn(module, batch) if key is None else loss_fn(module, batch, rngs=nnx.Rngs(key))
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ValueError(f"loss_fn returns a scalar loss or (loss, aux), got a tuple of {len(out)}")
        loss, aux = out
    else:
        loss, aux = out, {}
    if jnp.shape(loss) != ():
        raise ValueError(f"loss_fn must return a scalar loss (or (loss, aux)), got shape {jnp.shape(loss)}")
    return loss, dict(aux) if isinstance(aux, Mapping) else {"aux": aux}


def loss_and_grads(model: ModelDef, loss_fn: LossFn, params, batch: dict, plan: Plan, loss_scale=None,
                   variables=None, step=0, seed: int = 0):
    """Mean loss, metrics, gradients and the model's updated variables over the global batch.

    Each data rank differentiates its own rows inside `jax.shard_map`, manual
    over `plan.step_manual_axes` (`data`; `tensor` too under the explicit
    form, whose layers then write their collectives directly). Under ZeRO-0/1
    its gradients stay local while microbatches accumulate and are summed over
    `data` once per step: all-reduced (ZeRO-0) or reduce-scattered into the
    optimizer's shards (ZeRO-1). With one microbatch under remat, ZeRO-0
    all-reduces each layer's gradients in the backward layer scan instead
    (`_sums_at_use`). Under HSDP the shard_map is manual over `replica` too,
    and each shard is then all-reduced over it once per step
    (`jaxpar.parallel.zero.sum_gradients`). Under ZeRO-2/3
    the parameters arrive sharded and each layer's are gathered inside the
    layer scan, so autodiff reduce-scatters each layer's gradients as the
    backward scan produces them: no full-size gradient ever exists.
    `loss_scale` multiplies the loss before differentiation (fp16). The
    model computes with the parameters cast to the plan's compute dtype where
    they are used (`jaxpar.parallel.zero.gather_params`), and the gradients are summed
    and come back in that dtype (`_to`; the optimizer casts them).

    A model with variables besides its parameters (BatchNorm statistics) or
    random numbers (dropout, a loss_fn taking `rngs`) runs on the global
    batch instead, XLA placing the collectives: its batch statistics are
    those of the whole batch and its random bits those of one device
    (partitionable threefry), so it computes the same on any mesh.
    """
    check_batch(plan, batch)
    batch = lora_dropout.with_seeds(normalised_weights(batch), plan.lora_dropout, seed, step)
    variables = {} if variables is None else variables
    extra = () if loss_scale is None else (loss_scale,)
    manual = plan.step_manual_axes
    whole = model.stateful or takes_rngs(loss_fn)
    per_rank = functools.partial(_per_rank, model, loss_fn, plan, seed)
    if whole or plan.axis_size(*manual) == 1 or not set(plan.rank_axes) <= set(plan.batch_axes):
        return per_rank(False, params, batch, variables, step, *extra)
    return jax.shard_map(
        functools.partial(per_rank, True),
        in_specs=(specs_over(plan.param_specs(model.logical), manual), P(plan.rank_axes), P(), P(),
                  *(P(),) * len(extra)),
        out_specs=(P(), P(), specs_over(plan.gradient_specs(model.trained(model.logical)), manual), P()),
        axis_names=set(manual),
    )(params, batch, variables, step, *extra)


def _per_rank(model: ModelDef, loss_fn: LossFn, plan: Plan, seed: int, over_data: bool, params, batch: dict,
              variables, step, loss_scale=None):
    """One data rank's share of `loss_and_grads` (`over_data`: inside the shard_map, manual over data)."""
    param_specs = plan.param_specs(model.logical)
    trained_specs, grad_specs = model.trained(param_specs), plan.gradient_specs(model.trained(model.logical))
    k = plan.grad_accum
    at_use = zero.summed_at_use(trained_specs, grad_specs) if over_data and _sums_at_use(plan) else None
    if over_data:  # only what trains is marked varying: a frozen parameter's gradient is never formed nor summed
        trained = zero.vary(model.trained(params), trained_specs, at_use)
        if plan.shape["pipe"] > 1 and model.trainable is not None:
            # except in a pipeline: its residual ring hands each stage's saved weights back varying over data, so a
            # frozen weight must be too, or its (never used) gradient has another type than the weight
            params = zero.vary(params, param_specs)
        params = model.with_trained(params, trained)
    at_use_all = None if at_use is None else model.frozen_false(at_use)
    ranks = plan.axis_size(*plan.rank_axes) if over_data else 1
    # Each rank differentiates its share of the global mean, so the gradients summed over ranks and
    # microbatches are the mean's: nothing sums k * ranks full-size gradients first (fp16 would overflow).
    share = 1.0 if loss_scale is None else loss_scale
    share = share / (k * ranks) if k * ranks > 1 else share
    step_key = jax.random.fold_in(jax.random.key(seed), step) if takes_rngs(loss_fn) else None

    dtype = precision.POLICIES[plan.precision].cast_at_use  # bf16/fp16: fp32 params, 2-byte compute

    def compute(trained, b, carried, j, acc=None, sinks=None):
        key = step_key if step_key is None or k == 1 else jax.random.fold_in(step_key, j)  # None over data
        p = model.with_trained(params, trained)
        with zero.layer_registry(), layer_order.train_state_layers():
            if acc is not None:  # the layer scans sum this microbatch's gradients into them (grad_sink)
                sinks.extend(grad_sink.offer(trained, acc))
            whole = zero.gather_params(p, param_specs if over_data else None, dtype, at_use_all)
            module = model.merge(lora.fold(whole, unstacked_only=True, keep=True), carried[1], rngs=carried[0])
            with documents.scope(documents.of_batch(b)):
                loss, aux = call_loss(loss_fn, module, b, key)
            check_weights_read(b)
        return (loss if loss_scale is None and k * ranks == 1 else loss * share), (loss, aux, model.carried_of(module))

    def one_microbatch(b, carried, j=0):
        grads, (loss, aux, carried) = jax.grad(compute, has_aux=True)(model.trained(params), b, carried, j)
        return (loss, aux, grads), carried

    def into(acc, b, carried, j):
        """`acc` plus one microbatch's gradients: summed in place by the layer scans that claim their
        accumulators, the rest (and any other use of those parameters) added after."""
        sinks = []
        (grads, summed), (loss, aux, carried) = jax.grad(
            functools.partial(compute, sinks=sinks), argnums=(0, 4), has_aux=True)(model.trained(params), b,
                                                                                    carried, j, acc)
        claimed = jax.tree.unflatten(jax.tree.structure(acc), [s.claimed for s in sinks])
        total = jax.tree.map(lambda a, s, g, c: (s if c else a) + g.astype(a.dtype), acc, summed, grads, claimed)
        return (loss, aux, total), carried

    carried = (model.streams_at(step), variables)
    if k == 1:
        (loss, aux, grads), carried = one_microbatch(batch, carried)
    else:
        sums_in_scan = plan.axis_size("pipe") == 1
        (loss, aux, grads), carried = _accumulate(one_microbatch, batch, k, carried, into if sums_in_scan else None)
    grads = _to(grads, dtype)
    if over_data:
        grads = zero.sum_gradients(zero.scatter_gradients(grads, grad_specs, trained_specs), grad_specs, at_use)
        loss, aux = zero.mean((loss, aux))
    if k > 1:
        loss, aux = loss / k, jax.tree.map(lambda x: x / k, aux)
    return loss, aux, grads, carried[1]


def normalised_weights(batch):
    """The batch with its `loss_weights` divided by their mean over the whole (global) batch, before it is split.

    The loss then takes mean(w' x nll) over each rank's and microbatch's rows,
    and the step's mean over ranks, microbatches and pipeline slots of those
    equal-sized means is sum(w x nll) / sum(w) over the global batch: every
    averaging path stays as it is. All-zero weights give a zero loss.
    """
    if not isinstance(batch, Mapping) or "loss_weights" not in batch:
        return batch
    weights = jnp.asarray(batch["loss_weights"], jnp.float32)
    mean = jnp.mean(weights)
    return {**batch, "loss_weights": jnp.where(mean > 0, weights / jnp.where(mean > 0, mean, 1.0), 0.0)}


def check_weights_read(batch) -> None:
    """Refuse a batch whose loss weights the loss never read (they would be ignored without a word)."""
    used = trace.current().used
    if used is not None and isinstance(batch, Mapping) and "loss_weights" in batch and WEIGHTED not in used:
        raise ValueError("the batch carries loss_weights (packed documents or fine-tuning records), but the model's "
                         "loss never read them: compute it with jaxpar.parallel.tensor.vocab_parallel_cross_entropy, "
                         "which weights each token, or train on windows (--packing windows)")


def _sums_at_use(plan: Plan) -> bool:
    """Whether whole gradients are all-reduced where their parameters are used (`zero.summed_at_use`).

    Only with one microbatch per step and no pipeline: every microbatch's
    backward, or every pipeline slot's, would sum its gradients again. And only
    under remat: without it the backward keeps what the forward made of each
    layer's parameters, so the per-layer mark would keep a copy of every
    layer (+16.8 MB fp32 per device on issue 16's llama2 at data=8).
    """
    return plan.grad_accum == 1 and plan.axis_size("pipe") == 1 and plan.remat != "none"


def _to(grads, dtype):
    """Gradients in the compute dtype (None: as they are): summed over the batch ranks and returned in it.

    A rank's gradient of one 2-byte use is 2-byte already (the fp32 view is
    the transpose of the cast); its sums over microbatches or over tied uses
    and the cross-rank sum are rounded. The sum moves 2 bytes per parameter, as
    ZeRO-2/3's reduce-scatters (the transposes of 2-byte gathers) do, and the
    optimizer casts it to fp32 inside its update, so no fp32 copy of the summed
    gradients is kept (`Optimizer.apply`).
    """
    if dtype is None:
        return grads
    return jax.tree.map(lambda g: g.astype(dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g, grads)


def _accumulate(one_microbatch: Callable, batch: dict, k: int, carried, into: Callable | None = None):
    """Sum (loss, aux, grads) over k strided microbatches in a scan, in fp32 accumulators; carry the model's state.

    The sums come back in the dtypes one microbatch gives (the step then sums
    the gradients over the ranks in the compute dtype, `_to`). The model's
    variables and RNG streams pass from one microbatch to the next, as over
    consecutive batches.
    """
    mb = microbatches(batch, k)
    shapes = jax.eval_shape(one_microbatch, jax.tree.map(lambda x: x[0], mb), carried)[0]

    def zeros(s):
        z = jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32))
        axes = tuple(sorted(varying_axes(s)))  # as varying as what is added (over data and, explicit, tensor)
        return jax.lax.pcast(z, axes, to="varying") if axes else z

    def add(state, inputs):
        total, carried = state
        b, j = inputs
        if into is None:
            out, carried = one_microbatch(b, carried, j)
            return (jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, out), carried), None
        (loss, aux, grads), carried = into(total[2], b, carried, j)
        summed = jax.tree.map(lambda t, x: t + x.astype(t.dtype), total[:2], (loss, aux))
        return ((*summed, grads), carried), None

    (total, carried), _ = jax.lax.scan(add, (jax.tree.map(zeros, shapes), carried), (mb, jnp.arange(k)))
    return jax.tree.map(lambda t, s: t.astype(s.dtype), total, shapes), carried


def keep_finite(old: TrainState, new: TrainState, metrics: dict, loss_scaling: bool) -> tuple[TrainState, dict]:
    """`new`, but with `old`'s params, optimizer state and variables if the loss or gradient norm is NaN/Inf.

    The step counter still advances (its batch was consumed) and the metrics
    gain `nonfinite` (1: update skipped). Under fp16 loss scaling the optimizer
    has already skipped such an update and lowered its scale, which must stand.
    `make_train_step` skips the update itself with `guarded_update` instead:
    a `where` over the whole state makes XLA copy every state buffer it
    updates in place (one more params + Adam state of temp memory).
    """
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    metrics = {**metrics, "nonfinite": jnp.logical_not(finite).astype(jnp.int32)}
    keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)  # noqa: E731
    if loss_scaling:
        return TrainState(new.params, new.opt_state, new.step, keep(new.variables, old.variables)), metrics
    return TrainState(keep(new.params, old.params), keep(new.opt_state, old.opt_state), new.step,
                      keep(new.variables, old.variables)), metrics


def guarded_update(finite, update: Callable, params, opt_state):
    """`update(params, opt_state)` where `finite`, else the two unchanged: a `lax.cond`, not a `where`.

    Only the branch taken runs, so the update writes the donated state in
    place; a `where(finite, new, old)` keeps old and new alive together
    (measured on the dp8 llama2 of issue 16: 246 MB of copies of the fp32
    master and Adam moments).
    """
    return jax.lax.cond(finite, update, lambda p, s: (p, s), params, opt_state)


def after_update(model: ModelDef, params, variables, metrics: dict, batch, finite):
    """`params` moved by the model's own rule for what no gradient trains, where its module has one and the step was
    not skipped: `after_step(params, metrics, batch)` (DeepSeek-V3's router correction, moved by the step's expert
    loads over the whole batch). The jit's out_shardings place the result like the parameters it replaces."""
    rule = getattr(model.merge(params, variables), "after_step", None)
    if rule is None:
        return params
    moved = rule(params, metrics, batch)
    return jax.tree.map(lambda new, old: old if new is old else jnp.where(finite, new, old), moved, params)


def gather_master(master, model: ModelDef, plan: Plan, dtype):
    """ZeRO-1's parameters from its fp32 master: each rank's shard cast to `dtype`, then all-gathered over data.

    Written out inside `jax.shard_map` like ZeRO-2/3's gathers (jaxpar.parallel.zero), so
    the gather moves the 2-byte cast, never the fp32 master.
    """
    trained = model.trained(model.logical)
    grad_specs, param_specs = plan.gradient_specs(trained), plan.param_specs(trained)
    manual = plan.step_manual_axes
    if plan.zero_ranks == 1:
        return jax.tree.map(lambda m: m.astype(dtype), master)
    return jax.shard_map(
        lambda m: zero.gather_params(m, grad_specs, dtype),
        in_specs=(specs_over(grad_specs, manual),),
        out_specs=specs_over(param_specs, manual),
        axis_names=set(manual),
        check_vma=False,  # an all-gather's result is the same on every data rank: replicated, as out_specs say
    )(master)


def make_train_step(model: ModelDef, loss_fn: LossFn, optimizer, plan: Plan, seed: int = 0) -> Step:
    """Compile-ready step(state, batch) -> (state, metrics) for `plan`.

    `loss_fn(model, batch)` returns a scalar loss or (loss, aux dict); one that
    takes `rngs` gets an `nnx.Rngs` keyed by (`seed`, step). `optimizer` is an
    optax transformation or an `nnx.Optimizer` of `nnx.Param`. Under ZeRO the
    update runs on each rank's shard of the gradients and optimizer state;
    ZeRO-1 then all-gathers the updated parameters (under bf16/fp16 the 2-byte
    cast of its fp32 master shard), ZeRO-2/3 keep them sharded until the layers
    gather them.
    """
    if plan.lora_rank and model.trainable is None:
        raise ValueError(f"the plan sets lora_rank={plan.lora_rank} but every parameter of the model trains: build it "
                         "with jaxpar.lora.apply and pass the filter it returns to init_state / describe (trainable=)")
    if plan.lora_dropout and not lora.has_salts(model.logical):
        raise ValueError(f"the plan sets lora_dropout={plan.lora_dropout} but the model's adapters have no dropout "
                         "salts: put them on with jaxpar.lora.apply(..., dropout=plan.lora_dropout)")
    optimizer = precision.for_plan(optimizer, plan)
    shardings = state_shardings(model, optimizer, plan)
    if plan.offload == "optimizer" and not offload.moved(shardings):
        warnings.warn(f"offload='optimizer' moves nothing: this optimizer keeps no state and precision="
                      f"{plan.precision!r} no separate fp32 master", usage.PlanOptionUnused, stacklevel=2)
    batch_sharding = plan.sharding(plan.batch_spec(1))
    update_shardings = plan.shardings(plan.gradient_specs(model.trained(model.logical)))

    def settled(params, trained, opt_state, aux, batch, variables, finite):
        """(params, optimizer state) after the update and the model's own rule (`after_update`). Under ZeRO-1's
        fp32 master the rule moves the master, and the params follow from it (all-gathered in their dtype)."""
        if not optimizer.master:
            return after_update(model, model.with_trained(params, trained), variables, aux, batch, finite), opt_state
        moved = after_update(model, model.with_trained(params, opt_state.master), variables, aux, batch, finite)
        opt_state = opt_state._replace(master=model.trained(moved))
        return model.with_trained(moved, gather_master(opt_state.master, model, plan, optimizer.param_dtype)), opt_state

    def step(state: TrainState, batch: dict):
        usage.mark_tensor_params(plan.param_specs(model.logical))
        params, opt_state = state.params, state.opt_state
        if plan.offload == "optimizer":  # what lives in host memory comes to the device for this step
            params, opt_state = offload.to_device((params, opt_state), (shardings.params, shardings.opt_state))
        scale = optimizer.loss_scale(opt_state)
        loss, aux, grads, variables = loss_and_grads(model, loss_fn, params, batch, plan, scale,
                                                     state.variables, state.step, seed)
        trained = model.trained(params)  # a frozen parameter (a LoRA base weight) passes through unchanged
        if optimizer.policy.loss_scaling:  # the optimizer skips overflowing updates itself (and lowers its scale)
            trained, opt_state, stats = optimizer.apply(grads, opt_state, trained)
            trained = trained if optimizer.master else jax.lax.with_sharding_constraint(trained, update_shardings)
            finite = jnp.isfinite(loss) & jnp.isfinite(stats["grad_norm"])
            params, opt_state = settled(params, trained, opt_state, aux, batch, variables, finite)
            new = TrainState(params, opt_state, state.step + 1, variables)
            return keep_finite(state, new, {"loss": loss, **stats, **aux}, True)
        stats = {"grad_norm": optimizer.grad_norm(grads)}
        finite = jnp.isfinite(loss) & jnp.isfinite(stats["grad_norm"])

        def update(trained, opt_state):
            if optimizer.master:  # the params follow from the master below, skipped step or not
                return trained, optimizer.updated_master(grads, opt_state)[1]
            trained, opt_state, _ = optimizer.apply(grads, opt_state, trained)
            return jax.lax.with_sharding_constraint(trained, update_shardings), opt_state

        trained, opt_state = guarded_update(finite, update, () if optimizer.master else trained, opt_state)
        params, opt_state = settled(params, trained, opt_state, aux, batch, variables, finite)
        metrics = {"loss": loss, **stats, **aux, "nonfinite": jnp.logical_not(finite).astype(jnp.int32)}
        keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)  # noqa: E731
        return TrainState(params, opt_state, state.step + 1, keep(variables, state.variables)), metrics

    return Step(
        step,
        plan,
        check_args=lambda state, batch: check_batch(plan, batch),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )

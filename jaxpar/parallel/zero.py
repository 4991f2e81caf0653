"""ZeRO over `data` (and HSDP): where each array's shard lies, what stays whole, and the collectives between the two.

Stage 1 shards the optimizer state over `data`; parameters stay whole, and
each step reduce-scatters the gradients into the optimizer's shards and
all-gathers the updated parameters. Stage 2 also keeps the parameters sharded
between steps and gathers each layer's once per step, keeping them for the
backward pass (PyTorch FSDP's SHARD_GRAD_OP): the same traffic, but a layer's
gradients are reduce-scattered as soon as the backward pass produces them, so
no full-size gradient ever exists. Stage 3 (FSDP) drops the gathered
parameters after use and gathers them again for the backward pass.

Each array takes `data` on one more of its dimensions than its tensor-parallel
spec already uses, never the stacked `layers` axis that the layer scan walks,
so that one layer's parameters can be gathered on their own. The collectives
run inside `jax.shard_map` over `data` (see `jaxpar.train.step`): the CPU backend
compiles a gradient annotated as sharded into all-reduce plus slice, while
`psum_scatter` written out is a true reduce-scatter. Every parameter reaches
the model whole; stacked layers run through `jaxpar.scan_layers` are gathered
one layer at a time inside the scan instead, and autodiff turns each gather
into the reduce-scatter of that layer's gradients.

HSDP (`Plan.zero_axes`): the batch also splits over `replica`, the axis that
crosses hosts. With the default `zero_axes=("data",)` every array is sharded
over `data` only and whole on each replica, so the gathers and reduce-scatters
stay within a host and the only cross-host traffic is one all-reduce of each
gradient shard over `replica`. `zero_axes=("replica", "data")` shards over
both (full ZeRO across hosts). A spec names the axes its array is sharded
over, so the collectives below read them from the spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxpar.core import trace
from jaxpar.core.zero_layout import (
    AXES,
    axes_of,
    dim_over_zero_axes,
    entries_of,
    over_zero_axes,
    zero_axes_of,
)
from jaxpar.parallel import bits

GATHERED = "zero_gathered"  # checkpoint name of a layer's gathered parameters (remat policies keep or drop them)


def _rank_axes() -> tuple[str, ...]:
    """The batch axes the current shard_map runs per rank over: `data`, and `replica` when it has ranks.

    A size-1 `replica` is manual too (as every size-1 axis), but nothing
    splits over it, so it takes no part in the collectives.
    """
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in AXES if a in mesh.manual_axes and (a == "data" or mesh.shape[a] > 1))


# -- inside jax.shard_map over the batch axes (replica, data) ---------------------


def _fully_manual(collective, x, entries: tuple = ()):
    """Run a collective over `data` (or `replica`) with every other mesh axis manual too.

    Inside the step's shard_map the other axes (pipe, expert, tensor, ...) are
    left to the compiler, and XLA's partitioner gathers an operand sharded over
    them before a `data` collective (and its CPU compiler crashes on bf16 ones
    there). A nested shard_map over those axes, with the operand's own spec
    `entries`, keeps the collective on each device's local shard.
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = {a for a, n in mesh.shape.items() if n > 1 and a not in mesh.manual_axes}
    if not auto:
        return collective(x)
    spec = P(*(tuple(a for a in axes_of(e) if a in auto) or None for e in entries))
    return jax.shard_map(collective, in_specs=spec, out_specs=spec, axis_names=auto)(x)


def mean(tree):
    """Mean over the batch ranks (`data`, `replica`) of per-rank values (losses, metrics)."""
    axes = _rank_axes()
    return jax.tree.map(lambda x: _fully_manual(lambda v: jax.lax.pmean(v, axes), x), tree)


def _summed_axes(spec) -> tuple[str, ...]:
    """The batch rank axes a parameter (or gradient) with `spec` is whole over: its gradient is summed over them."""
    held = {a for e in spec for a in zero_axes_of(e)}
    return tuple(a for a in _rank_axes() if a not in held)


def summed_at_use(param_specs, grad_specs):
    """Per parameter: True where autodiff can all-reduce its gradient where the model uses it.

    Those whole at rest whose gradients are whole too (ZeRO-0's): marked at
    their use (`vary_at_use`, per layer in `jaxpar.scan_layers`), each layer's
    gradients are summed inside the backward layer scan as it makes them, as
    DDP's buckets are: the sum overlaps the backward pass, and no full-size
    gradient waits for one combined all-reduce at the end of it. The step
    chooses this only with one microbatch per step (`jaxpar.train.step`): each
    microbatch's backward would sum again.
    """
    return jax.tree.map(lambda p, g: not over_zero_axes(tuple(p)) and not over_zero_axes(tuple(g)) and bool(_summed_axes(p)),
                        param_specs, grad_specs, is_leaf=lambda v: isinstance(v, P))


def _none_summed(tree):
    """`summed_at_use`'s answer where nothing is summed at its use."""
    return jax.tree.map(lambda _: False, tree)


def vary(params, specs, at_use=None):
    """Mark each parameter varying over the batch ranks it is whole over, so its gradients stay per-device sums.

    Under HSDP a shard over `data` is whole over `replica`: marked varying
    there too, its gradient is summed over `replica` once per step
    (`sum_gradients`) rather than by autodiff at every use. Parameters
    `at_use` marks (`summed_at_use`) are left to `gather_params`, which marks
    them where they are used.
    """
    at_use = _none_summed(params) if at_use is None else at_use

    def one(x, spec, later):
        axes = _summed_axes(spec)
        return jax.lax.pcast(x, axes, to="varying") if axes and not later else x

    return jax.tree.map(one, params, specs, at_use, is_leaf=lambda v: isinstance(v, P))


def vary_at_use(x, entries: tuple):
    """`x` marked varying over the batch ranks where it is used: autodiff all-reduces its gradient there.

    Its spec `entries` place the all-reduce on each device's shard of the
    other mesh axes (`_fully_manual`).
    """
    axes = _summed_axes(entries)
    return _fully_manual(lambda v: jax.lax.pcast(v, axes, to="varying"), x, entries)


def gather(x, entries: tuple):
    """All-gather `x` over the ZeRO axes of the dimension its spec `entries` shards over them.

    Autodiff turns the gather into the reduce-scatter of the gradient.
    """
    dim = dim_over_zero_axes(entries)
    axes = zero_axes_of(entries[dim])
    full = _fully_manual(lambda v: bits.all_gather(v, axes, axis=dim), x, entries)
    return checkpoint_name(full, GATHERED)


def layer_registry():
    """While the step's loss is traced, remember which arrays are stacked layers sharded over data (see below)."""
    return trace.scoped(zero_layers={})


@dataclasses.dataclass(frozen=True)
class Use:
    """How one layer of a stacked array reaches the block: cast to `dtype` (None: as held), then gathered over
    data by its spec `entries` (None: it is whole already)."""

    entries: tuple | None
    dtype: Any = None
    summed: tuple | None = None  # whole at rest, its gradient summed where used: the spec entries of one layer

    def __call__(self, x):
        if self.dtype is not None:
            x = x.astype(self.dtype)
        if self.summed is not None:
            x = vary_at_use(x, self.summed)
        return x if self.entries is None else gather(x, (None,) * (x.ndim - len(self.entries)) + tuple(self.entries))


def gather_params(params, specs=None, dtype=None, at_use=None):
    """Every parameter whole and in the compute dtype `dtype` (None: as held), as any model computes with them.

    `specs`: the parameters' specs inside the step's shard_map over data (None:
    nothing is manual over data, so nothing is gathered). A parameter is cast
    before it is gathered, so the gather moves `dtype`'s bytes. A cast or
    gathered array that may be a stack of layers is remembered with its
    source: `jaxpar.scan_layers` then casts and gathers it one layer at a time
    instead, the whole-stack result goes unused and XLA drops it (no
    full-size copy). A model that runs such an array in its own scan still
    gets it whole: correct, with every layer cast or gathered at once.
    """
    def one(x, spec, summed):
        entries = entries_of(spec, x.ndim)
        cast = dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else None
        low = x if cast is None else x.astype(cast)
        if not over_zero_axes(entries):
            if summed:
                low = vary_at_use(low, entries)
            if (cast is not None or summed) and x.ndim > 1:
                _remember(low, x, Use(None, cast, entries[1:] if summed else None))
            return low
        whole = gather(low, entries)
        if dim_over_zero_axes(entries) == 0:
            _remember(whole, low, zero_axes_of(entries[0]), kind="rows")
        if x.ndim > 1 and dim_over_zero_axes(entries) != 0:
            _remember(whole, x, Use(entries[1:], cast))
        return whole

    if specs is None:
        return jax.tree.map(lambda x: one(x, P(), False), params)
    at_use = _none_summed(params) if at_use is None else at_use
    return jax.tree.map(one, params, specs, at_use, is_leaf=lambda v: isinstance(v, P))


def scatter_gradients(grads, grad_specs, param_specs):
    """Sum per-device gradients over the ZeRO axes into each device's shard (reduce-scatter).

    Only for parameters whole at rest: those sharded at rest were gathered, and
    autodiff has already reduce-scattered their gradients.
    """
    def one(g, grad_spec, param_spec):
        entries = entries_of(grad_spec, g.ndim)
        dim = dim_over_zero_axes(entries)
        if dim is None or over_zero_axes(param_spec):
            return g
        axes = zero_axes_of(entries[dim])
        return _fully_manual(lambda v: jax.lax.psum_scatter(v, axes, scatter_dimension=dim, tiled=True), g, entries)

    return jax.tree.map(one, grads, grad_specs, param_specs, is_leaf=lambda v: isinstance(v, P))


def sum_gradients(grads, grad_specs, at_use=None):
    """All-reduce each gradient over the batch ranks it is not sharded over (after `scatter_gradients`).

    A gradient ZeRO leaves whole is summed over every batch rank; under HSDP a
    shard over `data` is summed over `replica`, the one cross-host collective.
    Those `at_use` marks were summed where they were used.
    """
    def one(g, grad_spec, summed):
        axes = _summed_axes(grad_spec)
        if not axes or summed:
            return g
        return _fully_manual(lambda v: jax.lax.psum(v, axes), g, entries_of(grad_spec, g.ndim))

    at_use = _none_summed(grads) if at_use is None else at_use
    return jax.tree.map(one, grads, grad_specs, at_use, is_leaf=lambda v: isinstance(v, P))


# -- stacked layers gathered one at a time (jaxpar.parallel.stack.scan_layers) ---------------------------

# The trace's `zero_layers` (jaxpar.core.trace): (kind, id(array)) -> (array, what it was made from (its fp32
# shard over data), the `Use` that makes one layer of it). The array itself is kept so that its id cannot be
# reused while the trace runs.


def _remember(array, source, use, kind: str = "use") -> None:
    registry = trace.current().zero_layers
    if registry is not None:
        registry[kind, id(array)] = (array, source, use)


def _lookup(array, kind: str = "use"):
    found = (trace.current().zero_layers or {}).get((kind, id(array)))
    return found[1:] if found is not None and found[0] is array else None


def held_rows(array):
    """(the shard `array` was gathered from along its first dimension, as it is used; the ZeRO axes) or None."""
    return _lookup(array, kind="rows")


def layer_sources(stacked):
    """(what to scan over, a list of per-layer `Use`s aligned with its leaves) for a tree of stacked arrays.

    A stacked parameter that `gather_params` cast or gathered whole is
    replaced by what it was made from (the held fp32 array or shard), with the
    `Use` that `gather_layer` makes each layer by; other arrays are scanned as
    they are (None).
    """
    leaves, treedef = jax.tree.flatten(stacked)
    found = [_lookup(leaf) for leaf in leaves]
    sources = [leaf if f is None else f[0] for leaf, f in zip(leaves, found)]
    return jax.tree.unflatten(treedef, sources), [None if f is None else f[1] for f in found]


def mark_layers(stacked, uses: list) -> None:
    """Declare each array of `stacked` a source whose layers `gather_layer` makes by its `Use` (None: as it is).

    For code that reshapes or re-slices what `layer_sources` gave (the pipeline's stage chunks).
    """
    for leaf, use in zip(jax.tree.leaves(stacked), uses):
        if use is not None:
            _remember(leaf, leaf, use)


def regroup(stacked, groups: int):
    """[L, ...] -> [groups, L / groups, ...] for every stacked array, keeping per-layer casts and ZeRO gathers.

    Scanning over the groups then casts and gathers a whole group (its L / groups layers) at a time.
    """
    def one(leaf):
        grouped = leaf.reshape(groups, leaf.shape[0] // groups, *leaf.shape[1:])
        found = _lookup(leaf)
        if found is not None:
            source, use = found
            entries = None if use.entries is None else (None, *use.entries)
            _remember(grouped, source.reshape(groups, source.shape[0] // groups, *source.shape[1:]),
                      Use(entries, use.dtype))
        return grouped

    return jax.tree.map(one, stacked)


def layer_range(stacked, start: int, stop: int):
    """Layers start..stop - 1 of every stacked array, keeping per-layer casts and ZeRO gathers (a run of layers
    scanned on its own: an MoE model's blocks of no period, `jaxpar.models.moe`)."""
    def one(leaf):
        taken = leaf[start:stop]
        found = _lookup(leaf)
        if found is not None:
            source, use = found
            _remember(taken, source[start:stop], use)
        return taken

    return jax.tree.map(one, stacked)


def gather_layer(layer, uses: list):
    """One layer's parameters (a slice of `layer_sources`' sources), each cast and gathered by its `Use`."""
    leaves, treedef = jax.tree.flatten(layer)
    return jax.tree.unflatten(treedef, [x if use is None else use(x) for x, use in zip(leaves, uses)])

"""The explicit form of the Megatron layers: forward and backward each one `jax.shard_map`, f and g written out.

jax's own differentiation of a shard_map nested in another (the step's shard_map
over `data`) gives saved activations specs naming the outer manual axes, which
fails to lower; a custom VJP saves exactly what it names, with specs it chooses.
The public layers (jaxpar.parallel.tensor) call these under `Plan.tensor_form ==
"explicit"`; only this form guarantees true reduce-scatters under sequence
parallelism on the CPU backend. The vocabulary-split `embedding` serves both
forms: XLA's partitioning of a gather on the split table is not to be relied on
(jax 0.12 aborts on it beside a manual `data` and a batch split over `expert`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.core.rules import mesh_axes_of, resolve_spec, specs_over
from jaxpar.core.trace import active_plan
from jaxpar.parallel import bits, vocab
from jaxpar.parallel.constrain import varying_axes
from jaxpar.parallel.matmul import weight_einsum
from jaxpar.parallel.tensor_axes import region_axes, replicated_over, ways

# -- Megatron's f and g (inside shard_map over `axes`) -----------------------------
# f enters a region: `whole` forward, `summed` backward. g leaves it: `summed`
# forward, `whole` backward. `dim` is the sequence dimension under sequence
# parallelism, None without it.


def whole(x, axes, dim):
    """Every tensor rank gets the whole activation: x as is (identity), or its sequence all-gathered."""
    if dim is None:
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return bits.all_gather(x, axes, axis=dim)


def summed(partial, axes, dim):
    """The tensor ranks' partial sums combined: all-reduced, or reduce-scattered along the sequence."""
    if dim is None:
        return jax.lax.psum(partial, axes)
    return bits.psum_scatter(partial, axes, scatter_dimension=dim)


# -- the layers -------------------------------------------------------------------


def column(x, ws, eq, in_logical, w_names, outs_logical, axes):
    """Column-parallel einsums of x with each of `ws`: x made whole on entry, its gradient summed once."""
    x_spec = _manual_spec(in_logical, x.shape, axes)
    dim = _split_dim(x_spec, axes, "a column-parallel input")
    w_specs = tuple(_manual_spec(names, w.shape, axes) for names, w in zip(w_names, ws))
    out_specs = tuple(_manual_spec(names, eq.out_shape(x, w), axes) for names, w in zip(outs_logical, ws))
    saved_spec = P(axes)  # the whole input each rank multiplied, one copy per rank along a new leading axis
    count = len(ws)

    def local(x_whole, *ws):
        return tuple(weight_einsum(eq.equation, x_whole, w) for w in ws)

    def forward(x, *ws):
        x_whole = whole(x, axes, dim)
        return local(x_whole, *ws), x_whole[None]

    def backward(saved, *args):
        ws, cts = args[:count], args[count:]
        _, vjp = jax.vjp(local, saved[0], *ws)
        d_whole, *d_ws = vjp(tuple(cts))
        return (summed(d_whole, axes, dim), *d_ws)

    forward_map = _shard_map(forward, axes, (x_spec, *w_specs), (out_specs, saved_spec))
    backward_map = _shard_map(backward, axes, (saved_spec, *w_specs, *out_specs), (x_spec, *w_specs))

    def fwd(x, *ws):
        outs, saved = forward_map(x, *ws)
        return outs, (saved, ws)

    return _custom_vjp(fwd, lambda res, cts: backward_map(res[0], *res[1], *cts), x, *ws)


def row(x, w, eq, in_logical, w_names, out_logical, axes):
    """A row-parallel einsum: the partial products summed on exit, the cotangent made whole backward."""
    x_spec, w_spec = _manual_spec(in_logical, x.shape, axes), _manual_spec(w_names, w.shape, axes)
    out_spec = _manual_spec(out_logical, eq.out_shape(x, w), axes)
    dim = _split_dim(out_spec, axes, "a row-parallel output")

    def local(x, w):
        return weight_einsum(eq.equation, x, w)

    def backward(x, w, ct):
        return jax.vjp(local, x, w)[1](whole(ct, axes, dim))

    forward_map = _shard_map(lambda x, w: summed(local(x, w), axes, dim), axes, (x_spec, w_spec), out_spec)
    backward_map = _shard_map(backward, axes, (x_spec, w_spec, out_spec), (x_spec, w_spec))
    return _custom_vjp(lambda x, w: (forward_map(x, w), (x, w)), lambda res, ct: backward_map(*res, ct), x, w)


def embedding(tokens, table, table_logical, out_logical, axes):
    """Each vocabulary shard looks up the tokens it holds (zeros elsewhere); the rows are summed (both forms).

    The batch axes are manual too: XLA would otherwise all-gather the batch for
    the scatter-add of the table's gradient, rather than add locally and reduce.
    """
    batch_axes = tuple(a for a in region_axes(out_logical[:1]) if a not in manual_axes())
    manual = (*axes, *batch_axes)
    out_spec = _manual_spec(out_logical, (*tokens.shape, table.shape[-1]), manual)
    dim = _split_dim(out_spec, axes, "the embedding's output")
    tokens_spec = _manual_spec(replicated_over(out_logical[: tokens.ndim], axes), tokens.shape, manual)
    table_spec = _manual_spec(table_logical, table.shape, manual)
    shard_rows = table.shape[0] if direct(axes) else table.shape[0] // ways(axes)

    def forward(tokens, table):
        local, hit = vocab.local_index(tokens, shard_rows, axes)
        return summed(jnp.where(hit[..., None], jnp.take(table, local, axis=0), 0), axes, dim)

    def backward(tokens, ct):
        local, hit = vocab.local_index(tokens, shard_rows, axes)
        grad = jnp.where(hit[..., None], whole(ct, axes, dim), 0)
        d_table = jnp.zeros((shard_rows, *grad.shape[tokens.ndim:]), grad.dtype).at[local].add(grad)
        return jax.lax.psum(d_table, batch_axes) if batch_axes else d_table

    forward_map = _shard_map(forward, manual, (tokens_spec, table_spec), out_spec)
    backward_map = _shard_map(backward, manual, (tokens_spec, out_spec), table_spec)
    return _custom_vjp(
        lambda tokens, table: (forward_map(tokens, table), tokens),
        lambda tokens, ct: (None, backward_map(tokens, ct)),
        tokens,
        table,
    )


def cross_entropy(x, w, targets, vocab_size, in_logical, w_names, axes, padded, softcap=None):
    """Per-token loss [batch, seq] with Megatron's vocab-parallel softmax; saves the local probabilities.

    `softcap` caps each shard's logits before the softmax; the backward's vjp recomputes the cap's derivative.
    """
    x_spec, w_spec = _manual_spec(in_logical, x.shape, axes), _manual_spec(w_names, w.shape, axes)
    dim = _split_dim(x_spec, axes, "the output layer's input")
    probs_spec = _manual_spec(("batch", "seq", "vocab"), (*targets.shape, w.shape[-1]), axes)
    saved_spec = P(axes)

    def logits_of(x_whole, w):
        return vocab.softcap(weight_einsum("bsd,dv->bsv", x_whole, w, out_dtype=jnp.float32), softcap)

    def forward(x, w, targets):
        x_whole = whole(x, axes, dim)
        start = jax.lax.axis_index(axes) * w.shape[-1]
        logits = vocab.mask_padding(logits_of(x_whole, w), start, vocab_size, padded)
        peak = jax.lax.pmax(jnp.max(logits, axis=-1), axes)
        exp = jnp.exp(logits - peak[..., None])
        normaliser = jax.lax.psum(jnp.sum(exp, axis=-1), axes)
        local, hit = vocab.local_index(targets, w.shape[-1], axes)
        picked = jnp.take_along_axis(logits, local[..., None], axis=-1)[..., 0]
        target_logit = jax.lax.psum(jnp.where(hit, picked, 0.0), axes)
        loss = jnp.log(normaliser) + peak - target_logit
        return loss, x_whole[None], exp / normaliser[..., None]

    def backward(saved, w, probs, targets, ct):
        local, hit = vocab.local_index(targets, w.shape[-1], axes)
        d_logits = (probs - (vocab.is_target(local, w.shape[-1]) & hit[..., None])) * ct[..., None]
        d_whole, d_w = jax.vjp(logits_of, saved[0], w)[1](d_logits)
        return summed(d_whole, axes, dim), d_w

    forward_map = _shard_map(forward, axes, (x_spec, w_spec, P()), (P(), saved_spec, probs_spec))
    backward_map = _shard_map(backward, axes, (saved_spec, w_spec, probs_spec, P(), P()), (x_spec, w_spec))

    def fwd(x, w, targets):
        loss, saved, probs = forward_map(x, w, targets)
        return loss, (saved, w, probs, targets)

    return _custom_vjp(fwd, lambda res, ct: (*backward_map(*res, ct), None), x, w, targets)


# -- shard_map plumbing -----------------------------------------------------------


def _custom_vjp(fwd, bwd, *args):
    """Call the function whose forward `fwd(*args) -> (out, saved)` and backward `bwd(saved, ct)` are given."""
    layer = jax.custom_vjp(lambda *a: fwd(*a)[0])
    layer.defvjp(fwd, bwd)
    return layer(*args)


def _shard_map(body, axes, in_specs, out_specs):
    """`body` manual over `axes`, every other mesh axis staying with the compiler.

    Axes a caller's shard_map (the step's, under the explicit form) made manual
    already are not mapped again: there the operands are this device's shards
    and the body's collectives run as written.
    """
    todo = [a for a in axes if a not in manual_axes()]
    if not todo:
        return body
    cut = functools.partial(specs_over, axes=todo)
    return jax.shard_map(body, in_specs=cut(in_specs), out_specs=cut(out_specs), axis_names=set(todo))


def manual_axes() -> tuple[str, ...]:
    """The mesh axes a caller's shard_map made manual already."""
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def direct(axes) -> bool:
    """Whether all of `axes` are manual already (see `_shard_map`): operand shapes are then shards."""
    return set(axes) <= set(manual_axes())


def _manual_spec(names, shape, axes) -> P:
    """An operand's PartitionSpec over the given axes only: what shard_map's specs name.

    Where `axes` are manual already (`direct`) the spec still says which
    dimension is split over them, and `shape` is this device's shard.
    """
    plan = active_plan()
    mesh_shape, rules = plan.shape, plan.logical_rules
    manual = manual_axes()
    spec = resolve_spec(names, shape, mesh_shape, rules, path="tensor-parallel operand",
                        skip_axes=[a for a in manual if a not in axes], check=not set(axes) & set(manual))
    kept = [tuple(a for a in mesh_axes_of(entry) if a in axes) for entry in spec]
    return P(*(None if not k else k[0] if len(k) == 1 else k for k in kept))


def _split_dim(spec: P, axes, what: str) -> int | None:
    """The one dimension `spec` splits over the tensor axes (the sequence under sequence parallelism), or None."""
    dims = [d for d, entry in enumerate(spec) if set(mesh_axes_of(entry)) & set(axes)]
    if not dims:
        return None
    if len(dims) > 1 or mesh_axes_of(spec[dims[0]]) != axes:
        raise ValueError(f"{what} is split as {spec}, but only one dimension may be split, over all of {axes}")
    return dims[0]

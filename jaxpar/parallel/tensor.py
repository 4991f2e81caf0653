"""Megatron tensor parallelism (and sequence parallelism) over the axes the rules give `heads`, `mlp`, `vocab`.

A column-parallel linear splits its output features over the tensor axes (no
communication forward); a row-parallel one splits its input features and sums
the partial products. Attention and the MLP are each one column -> row pair, so
activations cross devices twice per block forward and twice backward. Under
sequence parallelism the residual stream between the pairs is split along the
sequence, and each all-reduce becomes an all-gather entering a pair plus a
reduce-scatter leaving it, for the same bytes.

Two forms give the same numbers, chosen by `Plan.tensor_form`; model code calls
these functions and does not know which runs:
- annotation: einsums and sharding constraints; XLA places the collectives;
- explicit: each layer is a custom VJP whose forward and backward are each one
  `jax.shard_map` over the tensor axes, with Megatron's f and g written out.
The CPU backend lowers an annotated reduce-scatter to all-reduce + slice, so
only the explicit form guarantees true reduce-scatters under sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.core import options, usage
from jaxpar.core.rules import mesh_axes_of, resolve_spec, specs_over
from jaxpar.core.trace import active_plan
from jaxpar.parallel import bits, zero
from jaxpar.parallel.attention import context_order
from jaxpar.parallel.constrain import constrain, rule_axes, varying_axes
from jaxpar.parallel.matmul import weight_einsum

FORMS = ("annotation", "explicit")
options.register_choices("tensor_form", FORMS)
RESIDUAL = ("batch", "seq_residual", "embed")


def _explicit() -> bool:
    """Whether the active plan asks for the explicit form (annotation outside a plan)."""
    plan = active_plan()
    return plan is not None and plan.tensor_form == "explicit"


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


def enter_tensor_region(x, logical=RESIDUAL):
    """Mark the residual stream entering a tensor-parallel region: the whole sequence on every tensor rank.

    The annotation form gathers here; the explicit form gathers inside each
    region's shard_map (so the gradient is a true reduce-scatter) and leaves x as is.
    """
    if _explicit():
        return x
    return constrain(x, _replicated_over(logical, rule_axes("seq_residual")))


def column_parallel(x, weights, equation: str, out_logical, in_logical=RESIDUAL):
    """einsum(equation, x, W) for one weight or a tuple of weights split along their output features.

    x is the residual stream (split along the sequence under sequence
    parallelism); the outputs stay split. A tuple of weights (Q, K, V; gate,
    up) shares one entry collective, so the input's gradient is reduced once.
    `out_logical` names the output's dimensions: one tuple for all weights or
    one per weight.
    """
    single = not isinstance(weights, (tuple, list))
    ws = (weights,) if single else tuple(weights)
    outs_logical = (out_logical,) * len(ws) if _is_names(out_logical) else tuple(out_logical)
    eq = _Einsum.parse(equation)
    w_names = [eq.weight_names(in_logical, names) for names in outs_logical]
    axes = _region_axes(names[i] for names in w_names for i in eq.positions(eq.features))
    if axes:
        usage.mark(usage.TENSOR)
    if not axes:
        outs = [weight_einsum(equation, x, w) for w in ws]
    elif _explicit():
        outs = _explicit_column(x, ws, eq, in_logical, w_names, outs_logical, axes)
    else:
        x_names = _replicated_over(in_logical, axes)
        x = constrain(x, x_names)
        outs = [weight_einsum(equation, x, ws[0])] if single else _fused_column(x, x_names, ws, eq, w_names, axes)
    outs = [constrain(o, names) for o, names in zip(outs, outs_logical)]
    return outs[0] if single else tuple(outs)


def row_parallel(x, w, equation: str, in_logical, out_logical=RESIDUAL):
    """einsum(equation, x, w) for w split along its input features: the partial sums are combined.

    The result is the residual stream: an all-reduce over the tensor axes, or a
    reduce-scatter along the sequence under sequence parallelism.
    """
    eq = _Einsum.parse(equation)
    w_names = eq.weight_names(in_logical, out_logical)
    axes = _region_axes(w_names[i] for i in eq.positions(eq.contracted))
    if axes:
        usage.mark(usage.TENSOR)
    if axes and _explicit():
        y = _explicit_row(x, w, eq, in_logical, w_names, out_logical, axes)
    else:
        y = weight_einsum(equation, x, w)
    return constrain(y, out_logical)


def embedding_lookup(tokens, table, table_logical=("vocab", "embed"), out_logical=RESIDUAL):
    """Rows of `table` for `tokens`; a table split along the vocabulary is looked up shard by shard and summed.

    Under ZeRO-2/3 the table is not gathered for this: each data rank looks up the
    whole data group's tokens in the rows it holds and the rows are summed back
    to each rank's batch (a token gather and a reduce-scatter of activations,
    against gathering the table and reduce-scattering its whole gradient), as
    MaxText does. Under context parallelism the tokens are first put in the
    load-balanced sequence order the rest of the model runs in (jaxpar.parallel.attention).
    """
    tokens = context_order(tokens, usage.CONTEXT_TOKENS)
    axes = _region_axes(table_logical[:1])
    if axes:
        usage.mark(usage.TENSOR)
    held = None if axes else zero.held_rows(table)
    if held is not None:
        shard, data_axes = held
        everyone = jax.lax.all_gather(tokens, data_axes, axis=0, tiled=True)
        local, hit = _local_index(everyone, shard.shape[0], data_axes)
        found = jnp.where(hit[..., None], jnp.take(shard, local, axis=0), 0)
        rows = bits.psum_scatter(found, data_axes, scatter_dimension=0)
    elif axes and _explicit():
        rows = _explicit_embedding(tokens, table, table_logical, out_logical, axes)
    else:
        rows = constrain(jnp.take(table, tokens, axis=0), _replicated_over(out_logical, axes))
    return constrain(rows, out_logical)


def vocab_parallel_cross_entropy(x, w, targets, vocab_size: int | None = None, in_logical=RESIDUAL):
    """Mean cross-entropy of x @ w against targets; the [batch, seq, vocab] logits stay split along vocab.

    Only the softmax normaliser's max and sum and the target logit ([batch,
    seq] each) cross devices. Columns at or beyond `vocab_size` (padding that
    makes the vocabulary divide by the tensor size) are masked out of the softmax.
    Under context parallelism the targets are put in the order the embedding
    gave the tokens (jaxpar.parallel.attention).
    """
    targets = context_order(targets, usage.CONTEXT_TARGETS)
    eq = _Einsum.parse("bsd,dv->bsv")
    logits_logical = ("batch", "seq", "vocab")
    w_names = eq.weight_names(in_logical, logits_logical)
    axes = _region_axes(w_names[-1:])
    if axes:
        usage.mark(usage.TENSOR)
    columns = w.shape[-1] * (_ways(axes) if _direct(axes) else 1)
    vocab_size = columns if vocab_size is None else vocab_size
    if not 0 < vocab_size <= columns:
        raise ValueError(f"vocab_size {vocab_size} must be in 1..{columns} (the output layer's columns)")
    if axes and _explicit():
        return jnp.mean(_explicit_cross_entropy(x, w, targets, vocab_size, in_logical, w_names, axes, columns))
    x = constrain(x, _replicated_over(in_logical, axes))
    logits = constrain(weight_einsum(eq.equation, x, w, out_dtype=jnp.float32), logits_logical)
    logits = _mask_padding(logits, 0, vocab_size, w.shape[-1])
    if axes:  # the vocabulary split by the compiler: a where over it stays local to each shard
        target_logit = jnp.sum(jnp.where(_is_target(targets, logits.shape[-1]), logits, 0.0), axis=-1)
    else:
        target_logit = _target_logit(logits.shape[-1], logits, targets)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logit)


def _is_target(targets, vocab: int):
    """[..., vocab] booleans: True at each position's target column."""
    return targets[..., None] == jnp.arange(vocab)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _target_logit(vocab: int, logits, targets):
    """logits[..., targets]: each position's target logit, read where it lies.

    Picked as `jnp.sum(jnp.where(one_hot, logits, 0))`, XLA:CPU writes the whole
    where (an fp32 [tokens, vocab] array, the size of the logits) before it sums
    it. The backward is that where's: the cotangent at each target, zero
    elsewhere, an elementwise expression the softmax's backward fuses.
    """
    return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _target_logit_forward(vocab, logits, targets):
    return _target_logit(vocab, logits, targets), targets


def _target_logit_backward(vocab, targets, cotangent):
    return jnp.where(_is_target(targets, vocab), cotangent[..., None], 0).astype(cotangent.dtype), None


_target_logit.defvjp(_target_logit_forward, _target_logit_backward)


# -- explicit form: forward and backward each one shard_map -------------------------
# jax's own differentiation of a shard_map nested in another (the step's shard_map
# over `data`) gives saved activations specs naming the outer manual axes, which
# fails to lower; a custom VJP saves exactly what it names, with specs it chooses.


def _explicit_column(x, ws, eq, in_logical, w_names, outs_logical, axes):
    x_spec = _manual_spec(in_logical, x.shape, axes)
    dim = _split_dim(x_spec, axes, "a column-parallel input")
    w_specs = tuple(_manual_spec(names, w.shape, axes) for names, w in zip(w_names, ws))
    out_specs = tuple(_manual_spec(names, _einsum_shape(eq, x, w), axes) for names, w in zip(outs_logical, ws))
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


def _explicit_row(x, w, eq, in_logical, w_names, out_logical, axes):
    x_spec, w_spec = _manual_spec(in_logical, x.shape, axes), _manual_spec(w_names, w.shape, axes)
    out_spec = _manual_spec(out_logical, _einsum_shape(eq, x, w), axes)
    dim = _split_dim(out_spec, axes, "a row-parallel output")

    def local(x, w):
        return weight_einsum(eq.equation, x, w)

    def backward(x, w, ct):
        return jax.vjp(local, x, w)[1](whole(ct, axes, dim))

    forward_map = _shard_map(lambda x, w: summed(local(x, w), axes, dim), axes, (x_spec, w_spec), out_spec)
    backward_map = _shard_map(backward, axes, (x_spec, w_spec, out_spec), (x_spec, w_spec))
    return _custom_vjp(lambda x, w: (forward_map(x, w), (x, w)), lambda res, ct: backward_map(*res, ct), x, w)


def _explicit_embedding(tokens, table, table_logical, out_logical, axes):
    """Each vocabulary shard looks up the tokens it holds (zeros elsewhere); the rows are summed.

    The batch axes are manual too: XLA would otherwise all-gather the batch for
    the scatter-add of the table's gradient, rather than add locally and reduce.
    """
    batch_axes = tuple(a for a in _region_axes(out_logical[:1]) if a not in _manual_axes())
    manual = (*axes, *batch_axes)
    out_spec = _manual_spec(out_logical, (*tokens.shape, table.shape[-1]), manual)
    dim = _split_dim(out_spec, axes, "the embedding's output")
    tokens_spec = _manual_spec(_replicated_over(out_logical[: tokens.ndim], axes), tokens.shape, manual)
    table_spec = _manual_spec(table_logical, table.shape, manual)
    shard_rows = table.shape[0] if _direct(axes) else table.shape[0] // _ways(axes)

    def forward(tokens, table):
        local, hit = _local_index(tokens, shard_rows, axes)
        return summed(jnp.where(hit[..., None], jnp.take(table, local, axis=0), 0), axes, dim)

    def backward(tokens, ct):
        local, hit = _local_index(tokens, shard_rows, axes)
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


def _explicit_cross_entropy(x, w, targets, vocab_size, in_logical, w_names, axes, padded):
    """Per-token loss [batch, seq] with Megatron's vocab-parallel softmax; saves the local probabilities."""
    x_spec, w_spec = _manual_spec(in_logical, x.shape, axes), _manual_spec(w_names, w.shape, axes)
    dim = _split_dim(x_spec, axes, "the output layer's input")
    probs_spec = _manual_spec(("batch", "seq", "vocab"), (*targets.shape, w.shape[-1]), axes)
    saved_spec = P(axes)

    def logits_of(x_whole, w):
        return weight_einsum("bsd,dv->bsv", x_whole, w, out_dtype=jnp.float32)

    def forward(x, w, targets):
        x_whole = whole(x, axes, dim)
        start = jax.lax.axis_index(axes) * w.shape[-1]
        logits = _mask_padding(logits_of(x_whole, w), start, vocab_size, padded)
        peak = jax.lax.pmax(jnp.max(logits, axis=-1), axes)
        exp = jnp.exp(logits - peak[..., None])
        normaliser = jax.lax.psum(jnp.sum(exp, axis=-1), axes)
        local, hit = _local_index(targets, w.shape[-1], axes)
        picked = jnp.take_along_axis(logits, local[..., None], axis=-1)[..., 0]
        target_logit = jax.lax.psum(jnp.where(hit, picked, 0.0), axes)
        loss = jnp.log(normaliser) + peak - target_logit
        return loss, x_whole[None], exp / normaliser[..., None]

    def backward(saved, w, probs, targets, ct):
        local, hit = _local_index(targets, w.shape[-1], axes)
        d_logits = (probs - (_is_target(local, w.shape[-1]) & hit[..., None])) * ct[..., None]
        d_whole, d_w = jax.vjp(logits_of, saved[0], w)[1](d_logits)
        return summed(d_whole, axes, dim), d_w

    forward_map = _shard_map(forward, axes, (x_spec, w_spec, P()), (P(), saved_spec, probs_spec))
    backward_map = _shard_map(backward, axes, (saved_spec, w_spec, probs_spec, P(), P()), (x_spec, w_spec))

    def fwd(x, w, targets):
        loss, saved, probs = forward_map(x, w, targets)
        return loss, (saved, w, probs, targets)

    return _custom_vjp(fwd, lambda res, ct: (*backward_map(*res, ct), None), x, w, targets)


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
    todo = [a for a in axes if a not in _manual_axes()]
    if not todo:
        return body
    cut = functools.partial(specs_over, axes=todo)
    return jax.shard_map(body, in_specs=cut(in_specs), out_specs=cut(out_specs), axis_names=set(todo))


def _ways(axes) -> int:
    """How many shards the mesh `axes` cut a dimension into."""
    return math.prod(active_plan().shape[a] for a in axes)


def _direct(axes) -> bool:
    """Whether all of `axes` are manual already (see `_shard_map`): operand shapes are then shards."""
    return set(axes) <= set(_manual_axes())


def _local_index(ids, shard_size: int, axes):
    """Offsets of global ids into this shard's `shard_size` rows (0 where absent), and which ids it holds."""
    local = ids - jax.lax.axis_index(axes) * shard_size
    hit = (local >= 0) & (local < shard_size)
    return jnp.where(hit, local, 0), hit


def _mask_padding(logits, start, vocab_size: int, padded: int):
    """Logits of padding columns (global index >= vocab_size) set to -inf; a no-op without padding."""
    if vocab_size == padded:
        return logits
    return jnp.where(start + jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)


# -- annotation form ------------------------------------------------------------------


def _fused_column(x, x_names, ws, eq, w_names, axes):
    """Several column-parallel weights as one einsum, so the input's gradient is one all-reduce.

    Each weight [contracted..., features...] is viewed as [C, t, F/t] (its t
    feature shards; a local reshape), the views are concatenated along the last
    dimension and multiplied at once, and the result is split and reshaped back.
    """
    n_contract, n_lead = len(eq.contracted), len(eq.x) - len(eq.contracted)
    if not (eq.w == eq.contracted + eq.features and eq.x[n_lead:] == eq.contracted
            and eq.out == eq.x[:n_lead] + eq.features):
        raise ValueError(
            "column_parallel with several weights needs an equation '...c,cf->...f' (contracted "
            f"dimensions last in x and first in each weight), got {eq.equation!r}"
        )
    for names in w_names:
        if _region_axes(names[n_contract:n_contract + 1]) != axes:
            raise ValueError(
                f"column_parallel with several weights splits each weight's first output feature; "
                f"{names[n_contract]!r} of a weight named {names} is not split over {axes}"
            )
    ways = _ways(axes)
    views = [
        constrain(w.reshape(math.prod(w.shape[:n_contract]), ways, -1), (None, names[n_contract], None))
        for w, names in zip(ws, w_names)
    ]
    lead = "ghijklmnopqrs"[:n_lead]
    y = weight_einsum(f"{lead}c,ctf->{lead}tf", x.reshape(*x.shape[:n_lead], -1), jnp.concatenate(views, axis=-1))
    y = constrain(y, (*x_names[:n_lead], w_names[0][n_contract], None))
    parts = jnp.split(y, list(itertools.accumulate(v.shape[-1] for v in views))[:-1], axis=-1)
    return [part.reshape(*x.shape[:n_lead], *w.shape[n_contract:]) for part, w in zip(parts, ws)]


# -- logical bookkeeping -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Einsum:
    """The letters of a two-operand einsum `x,w->out`: which of w's dimensions are contracted or features."""

    x: str
    w: str
    out: str

    @classmethod
    def parse(cls, equation: str) -> "_Einsum":
        inputs, arrow, out = equation.replace(" ", "").partition("->")
        x, comma, w = inputs.partition(",")
        if not (arrow and comma) or "." in equation:
            raise ValueError(f"tensor-parallel layers take an explicit two-operand einsum 'x,w->out', got {equation!r}")
        return cls(x, w, out)

    @property
    def equation(self) -> str:
        return f"{self.x},{self.w}->{self.out}"

    @property
    def contracted(self) -> str:
        return "".join(c for c in self.w if c in self.x and c not in self.out)

    @property
    def features(self) -> str:
        return "".join(c for c in self.w if c not in self.x)

    def positions(self, letters: str) -> list[int]:
        return [i for i, c in enumerate(self.w) if c in letters]

    def weight_names(self, x_names, out_names) -> tuple:
        """The weight's logical names, read off the names of x and of the output."""
        for operand, letters, names in (("x", self.x, x_names), ("output", self.out, out_names)):
            if len(letters) != len(names):
                raise ValueError(f"{self.equation}: {operand} has {len(letters)} dimensions but {len(names)} names {names}")
        named = {**dict(zip(self.x, x_names)), **dict(zip(self.out, out_names))}
        return tuple(named[c] for c in self.w)


def _is_names(value) -> bool:
    return all(n is None or isinstance(n, str) for n in value)


def _region_axes(split_names) -> tuple[str, ...]:
    """The tensor-parallel axes: mesh axes (size > 1) the active rules give the split dimensions."""
    axes: list[str] = []
    for name in split_names:
        axes.extend(a for a in rule_axes(name) if a not in axes)
    return tuple(axes)


def _replicated_over(names, axes) -> tuple:
    """The names with every dimension split over the tensor axes made whole (entering a region).

    The residual stream's sequence becomes any activation's (`seq`): whole
    over tensor, still split over `context` (jaxpar.parallel.attention).
    """
    return tuple(("seq" if n == "seq_residual" else None) if set(rule_axes(n)) & set(axes) else n for n in names)


def _manual_axes() -> tuple[str, ...]:
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def _manual_spec(names, shape, axes) -> P:
    """An operand's PartitionSpec over the given axes only: what shard_map's specs name.

    Where `axes` are manual already (`_direct`) the spec still says which
    dimension is split over them, and `shape` is this device's shard.
    """
    plan = active_plan()
    mesh_shape, rules = plan.shape, plan.logical_rules
    manual = _manual_axes()
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


def _einsum_shape(eq: _Einsum, x, w) -> tuple[int, ...]:
    sizes = {**dict(zip(eq.x, x.shape)), **dict(zip(eq.w, w.shape))}
    return tuple(sizes[c] for c in eq.out)

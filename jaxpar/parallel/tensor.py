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
  `jax.shard_map` over the tensor axes, with Megatron's f and g written out
  (jaxpar.parallel.tensor_explicit).
The CPU backend lowers an annotated reduce-scatter to all-reduce + slice, so
only the explicit form guarantees true reduce-scatters under sequence parallelism.
This module holds the layers, the choice between the forms, and the annotation form.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp

from jaxpar.core import options, trace, usage, zero_layout
from jaxpar.core.trace import active_plan
from jaxpar.parallel import bits, documents, lora_dropout, loss_chunks, tensor_explicit, vocab, zero
from jaxpar.parallel.attention import context_order
from jaxpar.parallel.constrain import constrain, rule_axes
from jaxpar.parallel.matmul import weight_einsum
from jaxpar.parallel.tensor_axes import Einsum, region_axes, replicated_over, ways

FORMS = ("annotation", "explicit")
options.register_choices("tensor_form", FORMS)
RESIDUAL = ("batch", "seq_residual", "embed")
WEIGHTED = "document loss weights"  # usage mark: the loss read the batch's loss_weights (jaxpar.train.step checks it)


def _explicit() -> bool:
    """Whether the active plan asks for the explicit form (annotation outside a plan)."""
    plan = active_plan()
    return plan is not None and plan.tensor_form == "explicit"


# -- the layers -------------------------------------------------------------------


def enter_tensor_region(x, logical=RESIDUAL):
    """Mark the residual stream entering a tensor-parallel region: the whole sequence on every tensor rank.

    The annotation form gathers here; the explicit form gathers inside each
    region's shard_map (so the gradient is a true reduce-scatter) and leaves x as is.
    """
    if _explicit():
        return x
    return constrain(x, replicated_over(logical, rule_axes("seq_residual")))


def column_parallel(x, weights, equation: str, out_logical, in_logical=RESIDUAL):
    """einsum(equation, x, W) for one weight or a tuple of weights split along their output features.

    x is the residual stream (split along the sequence under sequence
    parallelism); the outputs stay split. A tuple of weights (Q, K, V; gate,
    up) shares one entry collective, so the input's gradient is reduced once.
    `out_logical` names the output's dimensions: one tuple for all weights or
    one per weight. A weight left `lora_dropout.Adapted` (LoRA dropout) adds its branch.
    """
    single = not isinstance(weights, (tuple, list))
    ws, adapted = lora_dropout.split((weights,) if single else tuple(weights))
    outs_logical = (out_logical,) * len(ws) if _is_names(out_logical) else tuple(out_logical)
    eq = Einsum.parse(equation)
    w_names = [eq.weight_names(in_logical, names) for names in outs_logical]
    axes = region_axes(names[i] for names in w_names for i in eq.positions(eq.features))
    if axes:
        usage.mark(usage.TENSOR)
    if not axes:
        outs = [weight_einsum(equation, x, w) for w in ws]
    elif _explicit():
        outs = tensor_explicit.column(x, ws, eq, in_logical, w_names, outs_logical, axes)
    else:
        x_names = replicated_over(in_logical, axes)
        x = constrain(x, x_names)
        outs = [weight_einsum(equation, x, ws[0])] if single else _fused_column(x, x_names, ws, eq, w_names, axes)
    outs = [o if a is None else o + lora_dropout.branch(x, a, equation) for o, a in zip(outs, adapted)]
    outs = [constrain(o, names) for o, names in zip(outs, outs_logical)]
    return outs[0] if single else tuple(outs)


def kv_heads_for_ranks(w, n_kv_heads: int, logical):
    """Key/value weights with fewer heads than tensor ranks, cut so that each rank holds the head its queries read.

    The parameter keeps its `n_kv_heads` heads, replicated over the tensor ranks
    (jaxpar.core.rules.REPLICATED_WHEN_FEWER), so checkpoints and Hugging Face
    weights are unchanged. Each head is repeated tensor/n_kv_heads times in place,
    which keeps query head h reading its key/value head h // (heads / kv_heads),
    and the repeats are split over the ranks (annotation: a local slice of the
    replicated weight; explicit: this rank's head picked by its index). The
    gradient of a head is summed over the ranks that use it (the transpose of
    the repeat or of the pick). Otherwise `w` as it is.
    """
    if isinstance(w, lora_dropout.Adapted):  # B [r, kv_heads, head_dim] repeats its heads like W
        return dataclasses.replace(w, w=kv_heads_for_ranks(w.w, n_kv_heads, logical),
                                   b=kv_heads_for_ranks(w.b, n_kv_heads, (None, *logical[1:])))
    axes, dim = region_axes(("kv_heads",)), logical.index("kv_heads")
    if not axes or ways(axes) <= n_kv_heads:
        return w
    usage.mark(usage.TENSOR)
    copies = ways(axes) // n_kv_heads
    if tensor_explicit.direct(axes):  # the step is manual over tensor: this rank holds every head
        rank = jax.lax.axis_index(axes)
        return jax.lax.dynamic_slice_in_dim(w, rank // copies, 1, axis=dim)
    return constrain(jnp.repeat(w, copies, axis=dim), logical)


def row_parallel(x, w, equation: str, in_logical, out_logical=RESIDUAL):
    """einsum(equation, x, w) for w split along its input features: the partial sums are combined.

    The result is the residual stream: an all-reduce over the tensor axes, or a
    reduce-scatter along the sequence under sequence parallelism. A weight left
    `lora_dropout.Adapted` (LoRA dropout) adds its branch.
    """
    (w,), (adapted,) = lora_dropout.split((w,))
    eq = Einsum.parse(equation)
    w_names = eq.weight_names(in_logical, out_logical)
    axes = region_axes(w_names[i] for i in eq.positions(eq.contracted))
    if axes:
        usage.mark(usage.TENSOR)
    if axes and _explicit():
        y = tensor_explicit.row(x, w, eq, in_logical, w_names, out_logical, axes)
    else:
        y = weight_einsum(equation, x, w)
    if adapted is not None:
        y = y + lora_dropout.branch(x, adapted, equation)
    return constrain(y, out_logical)


def embedding_lookup(tokens, table, table_logical=("vocab", "embed"), out_logical=RESIDUAL):
    """Rows of `table` for `tokens`; a table split along the vocabulary is looked up shard by shard and summed.

    That split lookup is Megatron's vocab-parallel embedding written out in both
    tensor forms (jaxpar.parallel.tensor_explicit.embedding): each tensor rank
    reads the ids in its rows, zeros elsewhere, and the rows are summed over
    `tensor` (reduce-scattered along the sequence under sequence parallelism).
    Left to XLA as a gather on the split table, jax 0.12's SPMD partitioner
    aborts the process (a CHECK in PartitionGatherTrivialSlicedOperandDimensions)
    when the step is manual over `data` and the batch is also split over `expert`.

    Under ZeRO-2/3, when that moves fewer bytes than gathering the table and
    reduce-scattering its whole gradient (`zero_layout.table_gather_is_cheaper`),
    each data rank looks up the whole data group's tokens in the rows it holds
    and the rows are summed back to each rank's batch (a token gather and a
    reduce-scatter of activations), as MaxText does. Under context parallelism the tokens are first put in the
    load-balanced sequence order the rest of the model runs in (jaxpar.parallel.attention).
    """
    tokens = context_order(tokens, usage.CONTEXT_TOKENS)
    axes = region_axes(table_logical[:1])
    if axes:
        usage.mark(usage.TENSOR)
    held = None if axes else zero.held_rows(table)
    if held is not None and _gather_is_cheaper(tokens, held):
        held = None  # the whole table is used as gathered (autodiff reduce-scatters its gradient)
    if held is not None:
        shard, data_axes = held
        everyone = jax.lax.all_gather(tokens, data_axes, axis=0, tiled=True)
        local, hit = vocab.local_index(everyone, shard.shape[0], data_axes)
        found = jnp.where(hit[..., None], jnp.take(shard, local, axis=0), 0)
        rows = bits.psum_scatter(found, data_axes, scatter_dimension=0)
    elif axes:  # both forms: XLA never sees a gather on a vocabulary-split table (see the docstring)
        rows = tensor_explicit.embedding(tokens, table, table_logical, out_logical, axes)
    else:
        rows = jnp.take(table, tokens, axis=0)
    return constrain(rows, out_logical)


def _gather_is_cheaper(tokens, held) -> bool:
    shard, data_axes = held
    n = math.prod(jax.lax.axis_size(a) for a in data_axes)
    return zero_layout.table_gather_is_cheaper(shard.shape[0] * n, shard.shape[1], n, tokens.size,
                                               shard.dtype.itemsize, tokens.dtype.itemsize)


def vocab_parallel_cross_entropy(x, w, targets, vocab_size: int | None = None, in_logical=RESIDUAL,
                                 softcap: float | None = None):
    """Mean cross-entropy of x @ w against targets; the [batch, seq, vocab] logits stay split along vocab.

    Only the softmax normaliser's max and sum and the target logit ([batch,
    seq] each) cross devices. Columns at or beyond `vocab_size` (padding that
    makes the vocabulary divide by the tensor size) are masked out of the softmax.
    Under context parallelism the targets are put in the order the embedding
    gave the tokens (jaxpar.parallel.attention). A batch of packed documents'
    `loss_weights` (jaxpar.parallel.documents), in the same order, weight each
    token: the mean of weight x loss (the step normalises them over the global batch).
    `softcap` c caps the logits to c * tanh(logits / c) (Gemma 2), elementwise
    on each vocabulary shard. The per-token losses are computed in chunks of
    tokens when the logits are large (`Plan.loss_chunks`, jaxpar.parallel.loss_chunks).
    Within an objective over whole sequences (`jaxpar.objectives`: DPO's
    per-answer log-probs) the per-token losses go to its reduction instead.
    """
    targets = context_order(targets, usage.CONTEXT_TARGETS)
    weights = _loss_weights(targets.shape)
    eq = Einsum.parse("bsd,dv->bsv")
    logits_logical = ("batch", "seq", "vocab")
    w_names = eq.weight_names(in_logical, logits_logical)
    axes = region_axes(w_names[-1:])
    if axes:
        usage.mark(usage.TENSOR)
    columns = w.shape[-1] * (ways(axes) if tensor_explicit.direct(axes) else 1)
    vocab_size = columns if vocab_size is None else vocab_size
    if not 0 < vocab_size <= columns:
        raise ValueError(f"vocab_size {vocab_size} must be in 1..{columns} (the output layer's columns)")
    explicit = bool(axes) and _explicit()

    def losses_of(x, targets):
        if explicit:
            return tensor_explicit.cross_entropy(x, w, targets, vocab_size, in_logical, w_names, axes, columns, softcap)
        x = constrain(x, replicated_over(in_logical, axes))
        logits = constrain(vocab.softcap(weight_einsum(eq.equation, x, w, out_dtype=jnp.float32), softcap),
                           logits_logical)
        logits = vocab.mask_padding(logits, 0, vocab_size, w.shape[-1])
        if axes:  # the vocabulary split by the compiler: a where over it stays local to each shard
            target_logit = jnp.sum(jnp.where(vocab.is_target(targets, logits.shape[-1]), logits, 0.0), axis=-1)
        else:
            target_logit = vocab.target_logit(logits.shape[-1], logits, targets)
        return jax.nn.logsumexp(logits, axis=-1) - target_logit

    local_columns = columns // ways(axes) if axes else columns
    plan = active_plan()
    losses = loss_chunks.token_losses(losses_of, x, targets, local_columns, plan.loss_chunks if plan else 0)
    reduction = trace.current().token_reduction  # an objective over whole sequences (jaxpar.objectives)
    if reduction is not None:
        return reduction(losses, weights, lambda a: context_order(a, usage.CONTEXT_TARGETS))
    return _mean(losses, weights)


def _loss_weights(shape):
    """The traced rows' loss weights in context order like the targets (None: a plain batch, every token alike)."""
    weights = documents.get("loss_weights")
    if weights is None:
        return None
    if weights.shape != tuple(shape):
        raise ValueError(f"loss_weights {list(weights.shape)} and targets {list(shape)} differ in shape; a batch's "
                         "document fields are [batch, seq] like its inputs and targets")
    usage.mark(WEIGHTED)
    return context_order(weights, usage.CONTEXT_TARGETS)


def _mean(losses, weights):
    return jnp.mean(losses) if weights is None else jnp.mean(weights.astype(losses.dtype) * losses)


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
        if region_axes(names[n_contract:n_contract + 1]) != axes:
            raise ValueError(
                f"column_parallel with several weights splits each weight's first output feature; "
                f"{names[n_contract]!r} of a weight named {names} is not split over {axes}"
            )
    shards = ways(axes)
    views = [
        constrain(w.reshape(math.prod(w.shape[:n_contract]), shards, -1), (None, names[n_contract], None))
        for w, names in zip(ws, w_names)
    ]
    lead = "ghijklmnopqrs"[:n_lead]
    y = weight_einsum(f"{lead}c,ctf->{lead}tf", x.reshape(*x.shape[:n_lead], -1), jnp.concatenate(views, axis=-1))
    y = constrain(y, (*x_names[:n_lead], w_names[0][n_contract], None))
    parts = jnp.split(y, list(itertools.accumulate(v.shape[-1] for v in views))[:-1], axis=-1)
    return [part.reshape(*x.shape[:n_lead], *w.shape[n_contract:]) for part, w in zip(parts, ws)]


def _is_names(value) -> bool:
    """Whether `out_logical` is one tuple of names (for every weight) rather than one tuple per weight."""
    return all(n is None or isinstance(n, str) for n in value)

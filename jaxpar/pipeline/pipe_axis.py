"""Values inside the pipeline's shard_map over `pipe`: varying casts, table rows, sums over the stages.

Every executor path (the forward scan, gpipe's autodiff, the action tables)
shares these: how a value is made to vary over the manual axes, how a traced
table entry picks a row, how the loss head gets each stage's share of the
positions, and how per-stage gradients and statistics are summed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.parallel import bits, documents, zero
from jaxpar.parallel.constrain import varying_axes

AXIS = "pipe"


def varying(tree, axes: set[str]):
    """Mark values as varying over the manual `axes` (jax's `vma` type).

    Scan carries must start as varying as what the ticks put in them;
    parameters replicated over `pipe` are cast over it once before use, so
    their gradients stay per stage until one explicit psum (an implicit cast at
    each use would psum the gradients on every tick). Nothing is cast over
    axes it does not vary along: autodiff would then sum replicated gradients.
    """
    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def activation_axes(embedded, targets) -> set[str]:
    """The manual axes activations between stages vary over: pipe, and those of the embedded batch.

    That is `data`, and `tensor` where sequence parallelism splits the
    residual stream inside the step's shard_map (explicit tensor form).
    `embedded` may be an array or its `jax.eval_shape`.
    """
    return {AXIS} | varying_axes(embedded) | varying_axes(targets)


def row_at(x, index):
    """x[index] along the leading axis for a traced index (clamped: EMPTY slots read row 0)."""
    return jax.lax.dynamic_index_in_dim(x, jnp.maximum(index, 0), 0, keepdims=False)


def head_share(outputs, targets, stage, p: int):
    """This stage's share of the sequence positions of the last stage's `outputs` [..., b, s, d] and `targets`.

    An all-to-all over pipe cuts every stage's outputs into p pieces of s/p
    positions; each stage keeps the piece the last stage sent it, so all of
    them run the loss head on s/p positions. Returned as [-1, s/p, d] and [-1, s/p].
    Under sequence parallelism inside the step's shard_map (explicit tensor
    form) `outputs` hold this tensor rank's c-th of the sequence and `targets`
    all of it; the head gathers the c pieces of a share, so its targets are
    the same piece of each of the c chunks.
    """
    *lead, seq, d = outputs.shape
    width = seq // p
    pieces = jnp.moveaxis(outputs.reshape(*lead, p, width, d), len(lead), 0)
    share = bits.all_to_all(pieces, AXIS, split_axis=0, concat_axis=0)[p - 1]
    return share.reshape(-1, width, d), targets_share(targets, seq, stage, p)


def targets_share(targets, seq: int, stage, p: int):
    """This stage's share of `targets` [..., b, s] (or of anything laid out like them) for outputs of `seq` positions."""
    width = seq // p
    chunks = targets.shape[-1] // seq
    tgt = targets.reshape(*targets.shape[:-1], chunks, p, width)
    tgt = jax.lax.dynamic_index_in_dim(tgt, stage, axis=tgt.ndim - 2, keepdims=False)
    return tgt.reshape(-1, chunks * width)


def layer_documents(docs: dict, j) -> dict:
    """What a stage's layers read of microbatch j (docs: [m, b, s] each): its segment ids and positions.

    Varying over pipe whatever j is (a slot's j is, a probe's constant 0 is not), so that the layers trace the
    same way, with the same residuals, in a probe and in every slot.
    """
    return {name: varying(row_at(value, j), {AXIS}) for name, value in docs.items()
            if name not in documents.TARGET_FIELDS}


def head_documents(docs: dict, seq: int, stage, p: int) -> dict:
    """What the loss head reads of its share of positions (docs laid out like the targets it gets): the fields per
    target (loss weights; a preference batch's answer sides and reference log-probs)."""
    return {name: targets_share(value, seq, stage, p) for name, value in docs.items()
            if name in documents.TARGET_FIELDS}


def stage_layers(params, entries: list):
    """A stage's slice of the stacked layers, declared to ZeRO as shards it gathers layer by layer.

    Call it inside whatever differentiates the stage: ZeRO recognises the very arrays it is given.
    """
    zero.mark_layers(params, entries)
    return params


def masked(tree, valid):
    """The stats of a slot that holds a microbatch; zeros for a bubble slot."""
    return jax.tree.map(lambda s: jnp.where(valid, s, jnp.zeros_like(s)), tree)


def sum_over_ticks(stats):
    """Sum over ticks (the leading axis) in fp32."""
    return jnp.sum(stats.astype(jnp.promote_types(stats.dtype, jnp.float32)), axis=0)


def sum_over_stages(tree):
    """psum over pipe in at least fp32 (better sums; XLA:CPU also fails to compile bf16 reductions here)."""
    def stage_total(x):
        return jax.lax.psum(x.astype(jnp.promote_types(x.dtype, jnp.float32)), AXIS).astype(x.dtype)

    return jax.tree.map(stage_total, tree)


def accumulator(x):
    """A zero to sum x's gradients into: at least fp32, varying over the axes x does."""
    return varying(jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), varying_axes(x))


def add(sums, part):
    """sums + part leaf by leaf, in the accumulators' dtype."""
    return jax.tree.map(lambda t, g: t + g.astype(t.dtype), sums, part)


def add_at(sums, part, k, v: int):
    """sums[k] += part leaf by leaf: `sums` stacks the gradients of a stage's v chunks."""
    if v == 1:
        return jax.tree.map(lambda t, g: t + g.astype(t.dtype)[None], sums, part)
    return jax.tree.map(
        lambda t, g: jax.lax.dynamic_update_index_in_dim(t, row_at(t, k) + g.astype(t.dtype), k, 0), sums, part)

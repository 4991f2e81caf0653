"""Causal attention owned by the library, so that context parallelism reaches every model that calls it.

Under a plan with context = C > 1 the sequence of every activation is split
over the `context` mesh axis (the `seq` and `seq_residual` rules). A causal
mask would give the rank holding the last positions C times the work of the
first, so the sequence is cut into 2C chunks and rank c holds chunks c and
2C - 1 - c (`balanced_order`): every rank then has the same number of
(query, key) pairs under the mask. jaxpar's embedding lookup and loss put
tokens and targets in that order (`context_order`), so the whole model runs on
it and only attention, which mixes positions, needs to know: `positions` gives
the positions for rotary embeddings, and `causal_attention` builds its mask
from them.

Two forms, `Plan.context_form`, give the same numbers:
- all-gather: each rank all-gathers K and V over `context` and attends its
  queries to every key;
- ring: K/V blocks travel around the ring of context ranks with `ppermute`
  (C - 1 hops) and each rank folds one block at a time into an online
  softmax; thanks to the mirrored chunks every block after a rank's own is
  half visible, so the ring multiplies only those halves (half the pairs of
  the all-gather form, which masks whole blocks).
Either is a custom VJP whose forward and backward are each one `jax.shard_map`
over `context`; the backward recomputes the forward, as flash attention does,
so no [queries, keys] score matrix outlives its layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.core import options, trace, usage
from jaxpar.core.trace import active_plan
from jaxpar.parallel import bits
from jaxpar.parallel.constrain import rule_axes, varying_axes

AXIS = "context"
FORMS = ("all-gather", "ring")
options.register_choices("context_form", FORMS)


def context_ways() -> int:
    """The active plan's context size (1 outside a plan)."""
    plan = active_plan()
    return 1 if plan is None else plan.shape[AXIS]


def check_sequence(seq: int, ways: int) -> None:
    """Raise ValueError when a sequence cannot be cut into two mirrored chunks per context rank."""
    if ways > 1 and seq % (2 * ways):
        raise ValueError(
            f"sequence length {seq} does not divide by 2 x context={ways} = {2 * ways}: context parallelism "
            f"gives each of the {ways} context ranks two mirrored chunks of the sequence (causal load balancing); "
            f"make the sequence a multiple of {2 * ways} or use a smaller context axis"
        )


def balanced_order(seq: int, ways: int) -> np.ndarray:
    """The positions in the order the model holds them: rank c's chunks c and 2·ways − 1 − c, rank after rank."""
    check_sequence(seq, ways)
    chunks = np.arange(seq).reshape(2 * ways, -1)
    return np.concatenate([np.concatenate([chunks[c], chunks[2 * ways - 1 - c]]) for c in range(ways)])


def already_ordered(feature: str):
    """Within: `context_order(x, feature)` returns x as it is (still recording the feature).

    The pipeline orders the whole batch's targets before it cuts them into
    microbatches and sequence shares for each stage's loss head; a share is
    not a sequence that `balanced_order` could reorder.
    """
    return trace.scoped(ordered=trace.current().ordered | {feature})


def context_order(x: jax.Array, feature: str, axis: int = 1) -> jax.Array:
    """x reordered along its sequence `axis` into `balanced_order` under context > 1 (x itself otherwise).

    `feature` (usage.CONTEXT_TOKENS or CONTEXT_TARGETS) records which end of
    the model did it, so that a model reordering only one end is refused.
    """
    ways = context_ways()
    if ways == 1:
        return x
    usage.mark(feature)
    if feature in trace.current().ordered:
        return x
    return jnp.take(x, jnp.asarray(balanced_order(x.shape[axis], ways)), axis=axis)


@options.register_batch_check
def _check_batch(plan, global_batch: int, seq_len: int | None) -> None:
    if seq_len is not None:
        check_sequence(seq_len, plan.shape[AXIS])


def positions(seq: int) -> jax.Array:
    """The positions of the `seq` entries of the activations' sequence dimension (for rotary embeddings)."""
    return jnp.asarray(balanced_order(seq, context_ways()))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal grouped-query attention: q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim].

    Query head h reads key/value head h // (heads / kv_heads). The sequence is
    in the order `positions` gives; under context > 1 it is split over
    `context` and the plan's `context_form` gathers the keys and values.
    """
    ways = context_ways()
    if ways == 1:
        pos = jnp.arange(q.shape[1])
        return _attend(q, k, v, pos, pos)
    usage.mark(usage.CONTEXT_ATTENTION)
    check_sequence(q.shape[1], ways)
    local = functools.partial(_ring if active_plan().context_form == "ring" else _gathered, ways=ways)
    return _context_parallel(local, q, k, v, _head_axes(q, k))


def _head_axes(q, k) -> tuple[str, ...]:
    """The auto mesh axes the rules split both `heads` and `kv_heads` over (tensor parallelism), where they
    divide both: the context shard_map keeps the heads split over them, each rank attending its own heads.
    Left to the partitioner, they would be all-gathered into every tensor rank."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    axes = tuple(a for a in rule_axes("heads") if a not in manual)
    if not axes or axes != tuple(a for a in rule_axes("kv_heads") if a not in manual):
        return ()
    ways = int(np.prod([active_plan().shape[a] for a in axes]))
    return axes if q.shape[2] % ways == 0 and k.shape[2] % ways == 0 else ()


def _attend(q, k, v, q_pos, k_pos):
    """Plain masked softmax attention of queries at `q_pos` to keys at `k_pos` (a key attends if not later)."""
    scores = _scores(q, k, q_pos, k_pos)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return _weighted(weights, v, q.shape)


def _scores(q, k, q_pos, k_pos):
    """Masked scores [batch, kv_heads, group, queries, keys] in fp32; masked entries are fp32's minimum."""
    return jnp.where(q_pos[:, None] >= k_pos[None, :], _raw_scores(q, k), jnp.finfo(jnp.float32).min)


def _raw_scores(q, k):
    """Scaled scores [batch, kv_heads, group, queries, keys] in fp32, unmasked."""
    b, s, h, d = q.shape
    grouped = q.reshape(b, s, k.shape[2], h // k.shape[2], d)
    return jnp.einsum("bqngk,bsnk->bngqs", grouped, k).astype(jnp.float32) / jnp.sqrt(d).astype(jnp.float32)


def _weighted(weights, v, q_shape):
    return jnp.einsum("bngqs,bsnk->bqngk", weights, v).reshape(q_shape)


def _local_positions(ways: int, chunk: int):
    """Positions of this context rank's two chunks (inside the shard_map over `context`)."""
    rank = jax.lax.axis_index(AXIS)
    return _rank_positions(rank, ways, chunk)


def _rank_positions(rank, ways: int, chunk: int):
    steps = jnp.arange(chunk)
    return jnp.concatenate([rank * chunk + steps, (2 * ways - 1 - rank) * chunk + steps])


def _gathered(q, k, v, ways: int):
    """All-gather form on one rank's shard: every key and value gathered, then plain masked attention."""
    chunk = q.shape[1] // 2
    k_all, v_all = (bits.all_gather(x, AXIS, axis=1) for x in (k, v))
    k_pos = jnp.asarray(balanced_order(2 * chunk * ways, ways))
    return _attend(q, k_all, v_all, _local_positions(ways, chunk), k_pos)


def _ring(q, k, v, ways: int):
    """Ring form on one rank's shard: K/V blocks from rank c, c − 1, ... folded into an online softmax.

    Mirrored chunks make every block after the rank's own half-visible in a
    fixed way: one from an earlier rank j < c is seen whole by both query
    chunks in its first chunk only (its second, 2C − 1 − j, lies beyond both);
    one from a later rank is seen whole by the second query chunk only. So each
    of those steps multiplies half the pairs, unmasked, on every rank alike.
    """
    chunk = q.shape[1] // 2
    rank = jax.lax.axis_index(AXIS)
    shift = [(j, (j + 1) % ways) for j in range(ways)]
    own = _rank_positions(rank, ways, chunk)
    # The rank's own block first: every query sees at least itself, so the running peak is finite from the start.
    scores = _scores(q, k, own, own)
    peak = jnp.max(scores, axis=-1)
    weights = jnp.exp(scores - peak[..., None])
    state = (peak, jnp.sum(weights, axis=-1), _values(weights, v))
    block = (k, v)
    for step in range(1, ways):
        block = bits.ppermute(block, AXIS, shift)  # depends on the last block only: free to overlap its use
        state = jax.lax.cond((rank - step) % ways < rank, _from_earlier, _from_later, state, q, *block)
    _, total, acc = state
    out = (acc / total[..., None]).astype(v.dtype)  # [b, kv_heads, group, q, head_dim]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(q.shape)


def _from_earlier(state, q, k, v):
    """A block of an earlier rank: every query sees its first chunk, none its second."""
    chunk = q.shape[1] // 2
    return _fold(state, _raw_scores(q, k[:, :chunk]), v[:, :chunk])


def _from_later(state, q, k, v):
    """A block of a later rank: the second query chunk sees all of it, the first none."""
    chunk = q.shape[1] // 2
    folded = _fold(tuple(x[:, :, :, chunk:] for x in state), _raw_scores(q[:, chunk:], k), v)
    return tuple(x.at[:, :, :, chunk:].set(f) for x, f in zip(state, folded))


def _values(weights, v):
    """Softmax weights [b, kv_heads, group, q, s] times values [b, s, kv_heads, head_dim], in fp32."""
    return jnp.einsum("bngqs,bsnk->bngqk", weights.astype(v.dtype), v).astype(jnp.float32)


def _fold(state, scores, v):
    """The online-softmax state (running peak, weight total, weighted values) with one more block of keys."""
    peak, total, acc = state
    new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
    weights, fade = jnp.exp(scores - new_peak[..., None]), jnp.exp(peak - new_peak)
    return new_peak, total * fade + jnp.sum(weights, axis=-1), acc * fade[..., None] + _values(weights, v)


def _context_parallel(local, q, k, v, head_axes: tuple[str, ...]):
    """`local(q, k, v)` on each context rank's shard (and its heads over `head_axes`), as a custom VJP:
    forward and backward one shard_map each.

    The forward does not track replication (check_vma=False), as the MoE
    layer's does (jaxpar.parallel.experts): it is never differentiated, and under a
    caller's manual axes (the step's `data`) a remat policy would otherwise
    save values from inside it under specs naming those axes, which fails to
    lower. Its output is typed as varying over those axes, as it is.
    """
    spec = P(None, AXIS, head_axes or None)
    manual = {AXIS, *head_axes}
    outer = tuple(sorted(set().union(*(varying_axes(x) for x in (q, k, v)))))
    untracked = jax.shard_map(local, in_specs=(spec,) * 3, out_specs=spec, axis_names=manual, check_vma=False)
    backward = jax.shard_map(lambda q, k, v, ct: jax.vjp(local, q, k, v)[1](ct), in_specs=(spec,) * 4,
                             out_specs=(spec,) * 3, axis_names=manual)

    def forward(q, k, v):
        out = untracked(q, k, v)
        return jax.lax.pcast(out, outer, to="varying") if outer else out

    layer = jax.custom_vjp(forward)
    layer.defvjp(lambda q, k, v: (forward(q, k, v), (q, k, v)), lambda saved, ct: backward(*saved, ct))
    return layer(q, k, v)

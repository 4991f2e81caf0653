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
over `context`; both attend with flash attention (`jaxpar.parallel.attention_flash`)
on their local blocks, so no [queries, keys] score matrix outlives one block pair.
Outside context parallelism the plan's `attention` picks flash attention, a fused
kernel or the plain masked softmax (`jaxpar.parallel.attention_kernels`).

Every form takes the same options (`jaxpar.parallel.attention_math.Scoring`:
a sliding window, a logit soft cap, a query scale) and keeps attention inside
each packed document when the rows carry segment ids
(`jaxpar.parallel.documents`); the ring form is `jaxpar.parallel.attention_ring`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.core import device_facts, options, trace, usage
from jaxpar.core.trace import active_plan
from jaxpar.parallel import attention_kernels as kernels
from jaxpar.parallel import attention_ring, bits, documents
from jaxpar.parallel.attention_flash import Blocks, flash_attention
from jaxpar.parallel.attention_math import Scoring, attend, sink_weight
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
    if ways == 1:  # the natural order, whatever the length (an odd one has no two chunks)
        return np.arange(seq)
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


def _in_context_order(x: jax.Array) -> jax.Array:
    """[batch, seq] document fields (natural order) in the order the activations hold the sequence."""
    ways = context_ways()
    return x if ways == 1 else jnp.take(x, jnp.asarray(balanced_order(x.shape[1], ways)), axis=1)


def positions(seq: int) -> jax.Array:
    """The positions of the `seq` entries of the activations' sequence dimension (for rotary embeddings).

    [seq] by sequence index; [batch, seq] when the rows are packed documents that carry their own
    positions (`jaxpar.parallel.documents`), so that rotary embeddings restart in each document.
    """
    packed = documents.get("positions")
    if packed is not None:
        _check_rows("positions", packed, seq)
        return _in_context_order(packed)
    return jnp.asarray(balanced_order(seq, context_ways()))


def _check_rows(name: str, field: jax.Array, seq: int, batch: int | None = None) -> None:
    if field.ndim != 2 or field.shape[1] != seq or (batch is not None and field.shape[0] != batch):
        rows = f"[{batch if batch is not None else 'batch'}, {seq}]"
        raise ValueError(f"the packed documents' {name} have shape {tuple(field.shape)}, but attention runs on "
                         f"rows {rows}: they must hold the same rows as the tokens the model is called with")


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                     softcap: float | None = None, scale: float | None = None, sinks: jax.Array | None = None
                     ) -> jax.Array:
    """Causal grouped-query attention: q [batch, seq, heads, head_dim], k [batch, seq, kv_heads, head_dim],
    v [batch, seq, kv_heads, value_dim] (value_dim may differ from head_dim).

    Query head h reads key/value head h // (heads / kv_heads). `window` None (every earlier key) or
    W: query i sees key j iff j <= i and i - j < W, by sequence index (Mistral's sliding window);
    `softcap` c: scores -> c * tanh(scores / c) after scaling, before masking (Gemma 2); `scale`:
    the multiplier of q . k (None: head_dim ** -0.5). When the rows are packed documents
    (`jaxpar.parallel.documents` segment ids) a query sees only keys of its own document, and a
    padding query (segment 0) none: its output is 0. `sinks` [heads] (gpt-oss): each query head's learned
    logit in its softmax's denominator (`jaxpar.parallel.attention_math.sink_weight`); no fused kernel takes it,
    every context form does (applied once to each query row after its key blocks are merged).

    The plan's `attention` picks the implementation (`jaxpar.parallel.attention_kernels`: flash
    attention unless a fused kernel applies). The sequence is in the order `positions` gives; under
    context > 1 it is split over `context` and the plan's `context_form` gathers the keys and values.
    """
    scoring = Scoring(window, softcap, scale)
    segments = documents.get("segment_ids")
    if segments is not None:
        _check_rows("segment_ids", segments, q.shape[1], q.shape[0])
    ways = context_ways()
    if sinks is not None:
        _check_sinks(sinks, q.shape[2])
    call = kernels.Call(q.dtype, q.shape[-1], v.shape[-1], segments is not None, scoring, ways, sinks is not None,
                        _whole_on(q, k) if ways == 1 and device_facts.current().nvidia else ())
    implementation = kernels.chosen(call)
    blocks = kernels.blocks() if implementation == "flash" else Blocks(q.shape[1], q.shape[1])
    if ways == 1:
        if implementation == "cudnn":
            return _cudnn(q, k, v, scoring)
        if implementation in kernels.KERNELS:
            return _fused(implementation, q, k, v, scoring, segments)
        pos = np.arange(q.shape[1])
        if implementation == "xla":
            return attend(q, k, v, jnp.asarray(pos), jnp.asarray(pos), scoring, segments, segments, sinks)
        if sinks is None:
            return flash_attention(q, k, v, pos, pos, scoring, segments, segments, blocks)[0]
        out, lse = flash_attention(q, k, v, pos, pos, scoring, segments, segments, blocks, out_dtype=jnp.float32)
        return (out * sink_weight(lse, sinks)).astype(v.dtype)
    usage.mark(usage.CONTEXT_ATTENTION)
    check_sequence(q.shape[1], ways)
    if active_plan().context_form == "ring":
        local = functools.partial(attention_ring.ring, ways=ways, axis=AXIS, scoring=scoring, blocks=blocks)
    else:
        local = functools.partial(_gathered, ways=ways, scoring=scoring,
                                  blocks=None if implementation == "xla" else blocks)
    segments = None if segments is None else _in_context_order(segments)
    return _context_parallel(local, q, k, v, _head_axes(q, k), segments, sinks)


def _check_sinks(sinks: jax.Array, heads: int) -> None:
    """Raise ValueError for sink logits that are not one per query head."""
    if sinks.shape != (heads,):
        raise ValueError(f"attention sinks have shape {tuple(sinks.shape)}: expected one logit per query head, "
                         f"({heads},)")


def _fused(name: str, q, k, v, scoring: Scoring, segments):
    """The Pallas or splash kernel per shard: a Pallas call is opaque to XLA's partitioner, which would gather
    its operands whole onto every device, so it runs in a shard_map over the auto mesh axes that split the batch
    (where they divide it) and the heads (`_head_axes`). Its outputs carry no varying-axes type, which a
    caller's manual axes (the step's `data`) require, so both directions run untracked (`_per_shard`; over no
    axis at all when the caller's region leaves none); the backward recomputes the kernel's forward."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    batch, heads = _batch_axes(q), _head_axes(q, k)

    def local(q, k, v, *segments):
        return kernels.fused(name, q, k, v, scoring, *segments)

    if not batch and not heads and not manual:
        return local(q, k, v, *(() if segments is None else (segments,)))
    return _per_shard(local, q, k, v, P(batch or None, None, heads or None), {*batch, *heads}, segments,
                      track_backward=False)


def _batch_axes(q) -> tuple[str, ...]:
    """The auto mesh axes the rules split the batch over, where together they divide q's batch."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    batch = tuple(a for a in rule_axes("batch") if a not in manual)
    return () if batch and q.shape[0] % int(np.prod([active_plan().shape[a] for a in batch])) else batch


def _whole_on(q, k) -> tuple[str, ...]:
    """The auto mesh axes larger than 1 that split neither q's batch nor its heads: a kernel run per shard
    (`_cudnn`) runs whole on each of their ranks."""
    plan = active_plan()
    if plan is None:
        return ()
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    split = {*_batch_axes(q), *_head_axes(q, k)}
    return tuple(a for a, n in plan.shape.items() if n > 1 and a not in manual and a not in split)


def _cudnn(q, k, v, scoring: Scoring):
    """cuDNN's fused attention per shard, in a shard_map manual over every mesh axis the caller's region leaves
    to the compiler: JAX's cuDNN sharding rule cannot partition a partly manual sharding (the step's shard_map is
    manual over `data`), and XLA's SPMD partitioner aborts on it. Batch and heads stay split over their axes
    (`_batch_axes`, `_head_axes`, as tensor parallelism splits attention anyway); any other axis sees the call
    whole on each rank (`auto` takes flash attention there instead, `kernels.choose`)."""
    plan = active_plan()
    local = lambda q, k, v: kernels.cudnn(q, k, v, scoring)  # noqa: E731
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    free = set() if plan is None else {a for a in plan.shape if a not in manual}
    if not free:
        return local(q, k, v)
    batch, heads = _batch_axes(q), _head_axes(q, k)
    return _per_shard(local, q, k, v, P(batch or None, None, heads or None), free, track_backward=False)


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


def _gathered(q, k, v, segments=None, *, ways: int, scoring: Scoring, blocks: Blocks | None, sinks=None):
    """All-gather form on one rank's shard: every key and value gathered, then flash attention over them
    (`blocks` None: plain masked attention, attention=xla); `sinks`: this rank's heads' sink logits."""
    chunk = q.shape[1] // 2
    k_all, v_all = (bits.all_gather(x, AXIS, axis=1) for x in (k, v))
    k_pos = balanced_order(2 * chunk * ways, ways)
    k_seg = None if segments is None else jax.lax.all_gather(segments, AXIS, axis=1, tiled=True)
    q_pos = attention_ring.rank_positions(jax.lax.axis_index(AXIS), ways, chunk)
    if blocks is None:
        return attend(q, k_all, v_all, q_pos, jnp.asarray(k_pos), scoring, segments, k_seg, sinks)
    if sinks is None:
        return flash_attention(q, k_all, v_all, q_pos, k_pos, scoring, segments, k_seg, blocks)[0]
    out, lse = flash_attention(q, k_all, v_all, q_pos, k_pos, scoring, segments, k_seg, blocks, out_dtype=jnp.float32)
    return (out * sink_weight(lse, sinks)).astype(v.dtype)


def _context_parallel(local, q, k, v, head_axes: tuple[str, ...], segments=None, sinks=None):
    """`local(q, k, v[, segments], sinks=)` on each context rank's shard (and its heads over `head_axes`)."""
    spec = P(None, AXIS, head_axes or None)
    if sinks is None:
        return _per_shard(local, q, k, v, spec, {AXIS, *head_axes}, segments)
    return _per_shard(lambda q, k, v, sinks, *segments: local(q, k, v, *segments, sinks=sinks), q, k, v, spec,
                      {AXIS, *head_axes}, segments, sinks=sinks)


def _per_shard(local, q, k, v, spec: P, manual: set[str], segments=None, track_backward: bool = True, sinks=None):
    """`local(q, k, v[, sinks][, segments])` on each shard of q, k, v under `spec` (manual over `manual`), as a
    custom VJP: forward and backward one shard_map each.

    The forward does not track replication (check_vma=False), as the MoE
    layer's does (jaxpar.parallel.experts): it is never differentiated, and under a
    caller's manual axes (the step's `data`) a remat policy would otherwise
    save values from inside it under specs naming those axes, which fails to
    lower. Its output is typed as varying over those axes, as it is.
    Segment ids (integers, [batch, seq], in context order under context parallelism) are split like q's
    batch and sequence and get no cotangent. Sink logits [heads] are split like q's heads and differentiated
    like q, k and v (each shard's cotangent summed over the ranks that share its heads). The backward is tracked unless
    `local` holds a Pallas call (`track_backward=False`), whose outputs carry
    no varying-axes type; its cotangents are then typed varying like the forward's output.
    """
    primals = (q, k, v) if sinks is None else (q, k, v, sinks)
    specs = (spec,) * 3 + (() if sinks is None else (P(spec[2]),))
    extra = () if segments is None else (segments,)
    extra_specs = () if segments is None else (P(*spec[:2]),)
    outer = tuple(sorted(set().union(*(varying_axes(x) for x in (*primals, *extra)))))
    untracked = jax.shard_map(local, in_specs=specs + extra_specs, out_specs=spec, axis_names=manual,
                              check_vma=False)

    def pullback(*args):
        primals, fixed, ct = args[:len(specs)], args[len(specs):-1], args[-1]
        if not track_backward:  # untracked, an op's result has no varying-axes type, like the Pallas call's output:
            primals, ct = tuple(x * 1 for x in primals), ct * 1  # the vjp wants its primals and cotangents typed alike
        return jax.vjp(lambda *primals: local(*primals, *fixed), *primals)[1](ct)

    backward = jax.shard_map(pullback, in_specs=specs + extra_specs + (spec,), out_specs=specs,
                             axis_names=manual, check_vma=track_backward)

    def varying(x):
        missing = tuple(a for a in outer if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    def forward(q, k, v, *fixed):
        return varying(untracked(q, k, v, *fixed))

    def backward_rule(saved, ct):
        grads = backward(*saved, ct)
        return (*(grads if track_backward else map(varying, grads)), *(None for _ in extra))

    layer = jax.custom_vjp(forward)
    layer.defvjp(lambda *args: (forward(*args), args), backward_rule)
    return layer(*primals, *extra)

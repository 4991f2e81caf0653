"""Flash attention in XLA: blockwise causal attention whose memory grows with the sequence, not its square.

Queries and keys are cut into blocks. The forward folds key blocks into an
online softmax (running peak, weight total, weighted values per query row) and
keeps, besides the output, only each row's log-sum-exp. The backward (a custom
VJP) recomputes each block pair's probabilities from q, k, v, the output and
the log-sum-exp. No array of [queries, keys] outlives one block pair, on any
backend: this is jaxpar's attention wherever no fused kernel applies.

The (query block, key block) pairs run as one while loop over a table of
pairs. When the positions are known at trace time (numpy arrays: one device),
the table holds only the pairs with a visible entry, so the blocks above the
diagonal or beyond a sliding window are never computed. When they are traced
(the context forms, where a rank's positions depend on its index) every pair
is in the table and a `lax.cond` skips the hidden ones at run time.

Besides the output, `flash_attention` returns each row's log-sum-exp, and its
VJP takes a cotangent for it: the ring form of context parallelism merges the
partial results of its key blocks by their log-sum-exps
(`merge`), and differentiates through the merge.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core import device_facts
from jaxpar.parallel.attention_math import MASKED, Scoring
from jaxpar.parallel.constrain import varying_axes

_FAR = np.iinfo(np.int32).max // 2  # the position of a padding key: no query reaches it


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Query and key block lengths (a sequence shorter than a block is one block; a longer one is padded)."""

    q: int = 512
    k: int = 512

    def __post_init__(self):
        for name in ("q", "k"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"flash attention's {name} block must be an int >= 1, got {size!r}")


# Per backend: the XLA:CPU loop pays per step, so its blocks are larger; GPUs and TPUs keep a block pair's scores
# (batch x heads x bq x bk in fp32) small next to the activations.
BACKEND_BLOCKS = {"cpu": Blocks(512, 1024), "gpu": Blocks(512, 512), "tpu": Blocks(512, 1024)}


def default_blocks() -> Blocks:
    return BACKEND_BLOCKS.get(device_facts.current().backend, Blocks())


def flash_attention(q, k, v, q_pos, k_pos, scoring: Scoring, q_seg=None, k_seg=None, blocks: Blocks | None = None,
                    out_dtype=None):
    """Causal grouped-query attention of queries at `q_pos` to keys at `k_pos`, blockwise.

    q [b, sq, heads, d], k [b, sk, kv_heads, d], v [b, sk, kv_heads, dv] (dv may differ from d);
    q_pos [sq], k_pos [sk] (numpy: block pairs with nothing visible are left out of the loop; jax arrays:
    skipped at run time); q_seg [b, sq], k_seg [b, sk] packed documents' segment ids, or None.
    Returns (out [b, sq, heads, dv] in `out_dtype` (default v's dtype), lse [b, kv_heads, group, sq] in fp32);
    a query that sees no key has output 0 and log-sum-exp MASKED. A window of 1 needs no softmax at all.
    """
    blocks = blocks or default_blocks()
    b, sq, h, d = q.shape
    sk, n = k.shape[1], k.shape[2]
    if h % n:
        raise ValueError(f"attention has {h} query heads and {n} key/value heads: the query heads must be a "
                         f"multiple of the key/value heads (grouped-query attention)")
    if scoring.window == 1:
        return _own_key_only(q, k, v, q_pos, k_pos, scoring, q_seg, k_seg, out_dtype)
    bq, bk = min(blocks.q, sq), min(blocks.k, sk)
    nq, nk = -(-sq // bq), -(-sk // bk)
    static = isinstance(q_pos, np.ndarray) and isinstance(k_pos, np.ndarray)
    pairs = _visible_pairs(q_pos, k_pos, bq, bk, nq, nk, scoring.window) if static else None
    xp = np if static else jnp
    # Padding: a padded query repeats the last position (its rows are cut off and get no cotangent); a padded
    # key sits beyond every query.
    q_pos = xp.concatenate([xp.asarray(q_pos, np.int32), xp.full((nq * bq - sq,), q_pos[-1], np.int32)])
    k_pos = xp.concatenate([xp.asarray(k_pos, np.int32), xp.full((nk * bk - sk,), _FAR, np.int32)])
    q_seg, k_seg = (None, None) if q_seg is None else (_pad(q_seg, nq * bq, 1), _pad(k_seg, nk * bk, 1))
    grouped = _pad(q.reshape(b, sq, n, h // n, d), nq * bq, 1)
    k, v = _pad(k, nk * bk, 1), _pad(v, nk * bk, 1)
    sizes = (bq, bk, jnp.dtype(out_dtype or v.dtype))
    if pairs is None:
        out, lse = _flash(None, scoring, sizes, None, grouped, k, v, q_pos, k_pos, q_seg, k_seg)
    else:  # positions known at trace time are compiled in, never residuals
        fixed = (_Fixed(q_pos), _Fixed(k_pos))
        out, lse = _flash(pairs, scoring, sizes, fixed, grouped, k, v, None, None, q_seg, k_seg)
    return out[:, :sq].reshape(b, sq, h, v.shape[-1]), lse[..., :sq]


class _Fixed:
    """Positions known at trace time as a static argument of the custom VJP (hashable by their values)."""

    def __init__(self, array: np.ndarray):
        self.array, self._key = array, array.tobytes()

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Fixed) and self._key == other._key


def _own_key_only(q, k, v, q_pos, k_pos, scoring: Scoring, q_seg, k_seg, out_dtype):
    """A window of 1: each query sees only the key at its own position (in its own document), so its output is
    that value and its log-sum-exp that one score; no softmax, and exactly no gradient to q and k from the output.
    """
    b, sq, h, _ = q.shape
    n = k.shape[2]
    q_pos, k_pos = jnp.asarray(q_pos), jnp.asarray(k_pos)
    order = jnp.argsort(k_pos)
    at = jnp.clip(jnp.searchsorted(k_pos[order], q_pos), 0, k_pos.shape[0] - 1)
    own = order[at]  # [sq]: the index of the key at each query's position
    seen = jnp.broadcast_to(k_pos[own] == q_pos, (b, sq))
    if q_seg is not None:
        seen &= (k_seg[:, own] == q_seg) & (q_seg != 0)
    grouped = q.reshape(b, sq, n, h // n, q.shape[-1])
    score = jnp.einsum("bqngd,bqnd->bqng", grouped, k[:, own], preferred_element_type=jnp.float32)
    score = score * _scale(scoring, q.shape[-1])
    if scoring.softcap is not None:
        score = jnp.float32(scoring.softcap) * jnp.tanh(score / jnp.float32(scoring.softcap))
    values = jnp.broadcast_to(v[:, own][:, :, :, None], (b, sq, n, h // n, v.shape[-1]))
    out = jnp.where(seen[:, :, None, None, None], values, 0).reshape(b, sq, h, v.shape[-1])
    lse = jnp.where(seen[:, :, None, None], score, MASKED)
    return out.astype(out_dtype or v.dtype), jnp.transpose(lse, (0, 2, 3, 1))


def merge(first, second):
    """The attention of a query row over two disjoint sets of keys, from each set's (out, lse).

    out [b, s, heads, dv], lse [b, kv_heads, group, s] as `flash_attention` returns them; the result's out is in
    fp32. A row that saw no key in a set has lse MASKED there, and weight 0 (or both halves' zeros when it saw
    none in either).
    """
    (out_a, lse_a), (out_b, lse_b) = first, second
    lse = jnp.logaddexp(lse_a, lse_b)
    b, s, h, dv = out_a.shape

    def weight(part):  # [b, n, g, s] -> [b, s, heads, 1]
        return jnp.transpose(jnp.exp(part - lse), (0, 3, 1, 2)).reshape(b, s, h, 1)

    return out_a.astype(jnp.float32) * weight(lse_a) + out_b.astype(jnp.float32) * weight(lse_b), lse


def _pad(x, length: int, axis: int):
    extra = length - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _visible_pairs(q_pos, k_pos, bq: int, bk: int, nq: int, nk: int, window) -> tuple[tuple[int, int], ...]:
    """The (query block, key block) pairs holding an entry the causal mask (and window) lets through.

    Judged on each block's position range: a pair is kept when some distance q - k in it lies in [0, window).
    Ranges over-approximate sets of positions, so a kept pair may still be all masked, never the reverse.
    """
    q_lo, q_hi = _block_ranges(q_pos, bq, nq)
    k_lo, k_hi = _block_ranges(k_pos, bk, nk)
    seen = q_hi[:, None] >= k_lo[None, :]
    if window is not None:
        seen &= q_lo[:, None] - k_hi[None, :] < window
    return tuple((int(i), int(j)) for i, j in zip(*np.nonzero(seen)))


def _block_ranges(pos: np.ndarray, block: int, count: int):
    padded = np.concatenate([pos, np.full(count * block - len(pos), pos[-1])]).reshape(count, block)
    return padded.min(axis=1), padded.max(axis=1)


def _runtime_visible(q_pos, k_pos, window):
    """Traced twin of `_visible_pairs` for one block pair (padding keys left out of the range)."""
    real = k_pos < _FAR
    k_lo = jnp.min(jnp.where(real, k_pos, _FAR))
    k_hi = jnp.max(jnp.where(real, k_pos, -_FAR))
    seen = jnp.max(q_pos) >= k_lo
    if window is not None:
        seen &= jnp.min(q_pos) - k_hi < window
    return seen


def _over_pairs(pair, init, pairs, nq: int, nk: int, blocked, window):
    """`pair(carry, i, j)` folded over the block pairs: the static table, or every pair with the hidden ones
    skipped at run time.

    A while loop, not a scan: a remat policy around the caller that saves matmul outputs (ZeRO-3's
    dots_saveable) would stack every block pair's scores out of a scan to recompute its carry, [seq, seq]
    again; a while loop keeps no per-iteration values.
    """
    dynamic = pairs is None
    if dynamic:
        pairs = tuple((i, j) for i in range(nq) for j in range(nk))
    table = jnp.asarray(np.asarray(pairs, np.int32).reshape(-1, 2))

    def step(state):
        t, carry = state
        i, j = table[t, 0], table[t, 1]
        if dynamic:
            seen = _runtime_visible(blocked[3][i], blocked[4][j], window)
            return t + 1, jax.lax.cond(seen, pair, lambda c, *_: c, carry, i, j)
        return t + 1, pair(carry, i, j)

    return jax.lax.while_loop(lambda state: state[0] < table.shape[0], step, (jnp.int32(0), init))[1]


def _blocked(x, block: int, axis: int = 1):
    """x with its `axis` cut into blocks of `block`, the block index moved to the front."""
    shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocked(x, axis: int = 1):
    """The inverse of `_blocked`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _scale(scoring: Scoring, d: int):
    return jnp.float32(d ** -0.5 if scoring.scale is None else scoring.scale)


def _block_scores(qb, kb, qp, kp, qs, ks, scoring: Scoring):
    """One block pair's capped scores [b, n, g, bq, bk] (fp32, unmasked) and its mask."""
    scores = jnp.einsum("bqngd,bknd->bngqk", qb, kb, preferred_element_type=jnp.float32) * _scale(scoring, qb.shape[-1])
    if scoring.softcap is not None:
        cap = jnp.float32(scoring.softcap)
        scores = cap * jnp.tanh(scores / cap)
    mask = qp[:, None] >= kp[None, :]
    if scoring.window is not None:
        mask &= qp[:, None] - kp[None, :] < scoring.window
    if qs is not None:  # same document, and a padding query (segment 0) sees nothing
        same = (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)
        mask = (mask[None] & same)[:, None, None]
    return scores, mask


def _varying_like(carry, *inputs):
    """The loop's initial carry typed as varying over the manual axes its inputs vary over (inside a
    shard_map the carry the body returns does, and scan and cond want both alike)."""
    axes = tuple(sorted(set().union(*(varying_axes(x) for x in inputs if x is not None))))
    return carry if not axes else jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), carry)


def _inputs(q, k, v, q_pos, k_pos, q_seg, k_seg, bq, bk):
    qb, kb, vb = _blocked(q, bq), _blocked(k, bk), _blocked(v, bk)
    qp, kp = q_pos.reshape(-1, bq), k_pos.reshape(-1, bk)
    qs = None if q_seg is None else _blocked(q_seg, bq)
    ks = None if k_seg is None else _blocked(k_seg, bk)
    return qb, kb, vb, qp, kp, qs, ks


def _pick(i, j, qb, kb, vb, qp, kp, qs, ks):
    return qb[i], kb[j], vb[j], qp[i], kp[j], None if qs is None else qs[i], None if ks is None else ks[j]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash(pairs, scoring, sizes, fixed, q, k, v, q_pos, k_pos, q_seg, k_seg):
    return _forward(pairs, scoring, sizes, fixed, q, k, v, q_pos, k_pos, q_seg, k_seg)


def _positions(fixed, q_pos, k_pos):
    return (q_pos, k_pos) if fixed is None else (jnp.asarray(fixed[0].array), jnp.asarray(fixed[1].array))


def _forward(pairs, scoring, sizes, fixed, q, k, v, q_pos, k_pos, q_seg, k_seg):
    """out [b, sq, n, g, dv], lse [b, n, g, sq] of grouped q [b, sq, n, g, d] (sequences padded to blocks)."""
    bq, bk, out_dtype = sizes
    b, sq, n, g, _ = q.shape
    dv = v.shape[-1]
    q_pos, k_pos = _positions(fixed, q_pos, k_pos)
    blocked = _inputs(q, k, v, q_pos, k_pos, q_seg, k_seg, bq, bk)
    nq, nk = sq // bq, k.shape[1] // bk
    rows = (nq, b, n, g, bq)
    init = (jnp.full(rows, MASKED, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(rows + (dv,), jnp.float32))
    init = _varying_like(init, q, k, v, q_pos, k_pos, q_seg, k_seg)

    def pair(carry, i, j):
        peak, total, acc = carry
        qb, kb, vb, qp, kp, qs, ks = _pick(i, j, *blocked)
        scores, mask = _block_scores(qb, kb, qp, kp, qs, ks, scoring)
        scores = jnp.where(mask, scores, MASKED)
        new_peak = jnp.maximum(peak[i], jnp.max(scores, axis=-1))
        weights = jnp.where(mask, jnp.exp(scores - new_peak[..., None]), 0.0)
        fade = jnp.exp(peak[i] - new_peak)
        values = jnp.einsum("bngqk,bknd->bngqd", weights.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return (peak.at[i].set(new_peak), total.at[i].set(total[i] * fade + jnp.sum(weights, axis=-1)),
                acc.at[i].set(acc[i] * fade[..., None] + values))

    peak, total, acc = _over_pairs(pair, init, pairs, nq, nk, blocked, scoring.window)
    seen_any = total > 0
    out = acc / jnp.where(seen_any, total, 1.0)[..., None]  # [nq, b, n, g, bq, dv]
    lse = jnp.where(seen_any, peak + jnp.log(jnp.where(seen_any, total, 1.0)), MASKED)
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(b, sq, n, g, dv).astype(out_dtype)
    lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(b, n, g, sq)
    return out, lse


def _flash_fwd(pairs, scoring, sizes, fixed, q, k, v, q_pos, k_pos, q_seg, k_seg):
    out, lse = _forward(pairs, scoring, sizes, fixed, q, k, v, q_pos, k_pos, q_seg, k_seg)
    return (out, lse), (q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse)


def _flash_bwd(pairs, scoring, sizes, fixed, saved, cotangents):
    """dq, dk, dv from each block pair's probabilities recomputed from the saved log-sum-exp.

    With P = exp(S - lse) and dS = P * (dP - D), D = rowsum(dout * out) - dlse: the log-sum-exp's own
    cotangent (the ring's merge) enters as a shift of D.
    """
    q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse = saved
    d_out, d_lse = cotangents
    bq, bk, _ = sizes
    b, sq, n, g, d = q.shape
    q_pos, k_pos = _positions(fixed, q_pos, k_pos)
    blocked = _inputs(q, k, v, q_pos, k_pos, q_seg, k_seg, bq, bk)
    nq, nk = sq // bq, k.shape[1] // bk
    shift = jnp.moveaxis(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, 3) - d_lse
    lse_b, shift_b = (_blocked(x, bq, axis=3) for x in (lse, shift))  # [nq, b, n, g, bq]
    d_out_b = _blocked(d_out, bq)  # [nq, b, bq, n, g, dv]
    scale = _scale(scoring, d)
    init = (jnp.zeros((nq, b, bq, n, g, d), jnp.float32), jnp.zeros((nk, b, bk, n, d), jnp.float32),
            jnp.zeros((nk, b, bk, n, v.shape[-1]), jnp.float32))
    init = _varying_like(init, q, k, v, q_pos, k_pos, q_seg, k_seg, d_out, d_lse)

    def pair(carry, i, j):
        dq, dk, dv = carry
        qb, kb, vb, qp, kp, qs, ks = _pick(i, j, *blocked)
        scores, mask = _block_scores(qb, kb, qp, kp, qs, ks, scoring)
        probs = jnp.where(mask, jnp.exp(scores - lse_b[i][..., None]), 0.0)
        dob = d_out_b[i]
        dv_j = jnp.einsum("bngqk,bqngd->bknd", probs.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
        d_probs = jnp.einsum("bqngd,bknd->bngqk", dob, vb, preferred_element_type=jnp.float32)
        d_scores = probs * (d_probs - shift_b[i][..., None])
        if scoring.softcap is not None:
            d_scores = d_scores * (1.0 - jnp.square(scores / jnp.float32(scoring.softcap)))
        d_scores = d_scores * scale
        dq_i = jnp.einsum("bngqk,bknd->bqngd", d_scores.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bngqk,bqngd->bknd", d_scores.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
        return dq.at[i].add(dq_i), dk.at[j].add(dk_j), dv.at[j].add(dv_j)

    dq, dk, dv = _over_pairs(pair, init, pairs, nq, nk, blocked, scoring.window)
    return (_unblocked(dq).astype(q.dtype), _unblocked(dk).astype(k.dtype), _unblocked(dv).astype(v.dtype),
            None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)

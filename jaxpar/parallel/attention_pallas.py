"""Causal attention as a Pallas (Triton) flash kernel for NVIDIA GPUs: the fused path for what cuDNN refuses.

cuDNN's JAX entry takes no segment ids and no logit soft cap, so packed
documents and Gemma 2's capped scores would otherwise fall back to flash
attention in XLA. JAX's own Pallas GPU kernel
(`jax.experimental.pallas.ops.gpu.attention.mha`) does not serve either: it has
no soft cap, no window, no grouped-query heads, a padding query (segment 0)
attends other padding instead of nothing, and jax 0.12 deprecates it in favour
of tokamax. This module is the kernel it lacks: one forward and two backward
kernels (dq; dk and dv per query head, summed over each key/value head's group)
with every option of `causal_attention` (GQA, window, soft cap, scale, segment
ids with padding, a value head dimension of its own). Mask and arithmetic are
those of `jaxpar.parallel.attention_flash`: masked scores carry fp32's minimum
and a row that sees nothing has output 0.

`interpret=True` runs the kernels through Pallas' interpreter on any backend
(how the tests hold them to the reference on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.core import device_facts
from jaxpar.parallel.attention_flash import Blocks
from jaxpar.parallel.attention_math import MASKED, Scoring

DEFAULT_BLOCKS = Blocks(64, 64)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
HEAD_DIMS = (16, 32, 64, 128, 256)  # Triton tiles are powers of two; 256 is the largest that fits shared memory


def pallas_refusal(call, device_kind: str | None = None, blocks: Blocks | None = None,
                   interpret: bool = False) -> str | None:
    """Why the Pallas kernel cannot run `call` (an attention_kernels.Call) on `device_kind` (default: this
    process's) with `blocks` (None: its own), or None. Under `interpret` any backend runs it."""
    device_kind = device_kind or device_facts.current().kind
    if not interpret and not device_kind.startswith("NVIDIA"):
        return f"the device is {device_kind}: the Pallas kernel is Triton, for NVIDIA GPUs"
    if call.context_ways > 1:
        return "context parallelism: each rank's queries and keys are non-contiguous chunks of the sequence"
    if jnp.dtype(call.dtype) not in [jnp.dtype(t) for t in DTYPES]:
        return f"dtype {jnp.dtype(call.dtype).name}: the Pallas kernel runs fp32, bf16 or fp16"
    for name, size in (("head dimension", call.head_dim), ("value head dimension", call.value_dim)):
        if size not in HEAD_DIMS:
            return f"{name} {size}: the Pallas kernel takes {', '.join(map(str, HEAD_DIMS))}"
    return block_refusal(blocks or DEFAULT_BLOCKS)


def block_refusal(blocks: Blocks) -> str | None:
    for name, size in (("query", blocks.q), ("key", blocks.k)):
        if size < 16 or size & (size - 1):
            return f"{name} block {size}: the Pallas kernel's blocks are powers of two >= 16"
    return None


def pallas_attention(q, k, v, scoring: Scoring, segments=None, blocks: Blocks | None = None,
                     interpret: bool = False):
    """Causal grouped-query attention: q [b, s, heads, d], k [b, s, kv_heads, d], v [b, s, kv_heads, dv],
    segments [b, s] packed documents' ids (0: padding, sees nothing) or None. Returns [b, s, heads, dv]."""
    blocks = blocks or DEFAULT_BLOCKS
    b, s, h, d = q.shape
    if h % k.shape[2]:
        raise ValueError(f"attention has {h} query heads and {k.shape[2]} key/value heads: the query heads must be "
                         f"a multiple of the key/value heads (grouped-query attention)")
    fit = max(16, 1 << (s - 1).bit_length())  # a sequence shorter than a block: the block shrinks to it
    blocks = Blocks(min(blocks.q, fit), min(blocks.k, fit))
    padded = -(-s // math.lcm(blocks.q, blocks.k)) * math.lcm(blocks.q, blocks.k)
    # Every row gets a segment id: padding to the blocks is segment 0, which no query sees and which sees nothing.
    seg = jnp.ones((b, s), jnp.int32) if segments is None else jnp.asarray(segments, jnp.int32)
    q, k, v, seg = (jnp.pad(x, [(0, 0), (0, padded - s)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, seg))
    static = _Static(scoring, blocks.q, blocks.k, interpret)
    return _attention(static, q, k, v, seg)[:, :s]


class _Static:
    """The kernels' compile-time settings, hashable (a nondiff argument of the custom VJP)."""

    def __init__(self, scoring: Scoring, bq: int, bk: int, interpret: bool):
        self.scoring, self.bq, self.bk, self.interpret = scoring, bq, bk, interpret
        self._key = (scoring, bq, bk, interpret)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Static) and self._key == other._key


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, seg):
    return _forward(static, q, k, v, seg)[0]


def _dot(a, b, contract=(1, 1)):
    """a [m, x] . b [n, x] (contract=(1, 1)) or a [x, m] . b [x, n] (0, 0) or a [m, x] . b [x, n] (1, 0), in fp32
    (fp32 operands at full precision: Triton would otherwise multiply them in TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _scores(qb, kb, qs, ks, i0, j0, scoring: Scoring):
    """One block pair's capped scores [bq, bk] (fp32, unmasked) and its mask; i0, j0 the blocks' first rows."""
    scale = jnp.float32(qb.shape[-1] ** -0.5 if scoring.scale is None else scoring.scale)
    scores = _dot(qb, kb) * scale
    if scoring.softcap is not None:
        cap = jnp.float32(scoring.softcap)
        scores = cap * jnp.tanh(scores / cap)
    qp = i0 + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 0)
    kp = j0 + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    mask = (qp >= kp) & (qs[:, None] == ks[None, :]) & (qs[:, None] != 0)
    if scoring.window is not None:
        mask &= qp - kp < scoring.window
    return scores, mask


def _key_blocks(i, bq, bk, nk, window):
    """The key blocks [lo, hi) query block i can see (causal, and within the window)."""
    hi = jnp.minimum(((i + 1) * bq - 1) // bk + 1, nk)
    lo = 0 if window is None else jnp.maximum(i * bq - window + 1, 0) // bk
    return lo, hi


def _query_blocks(j, bq, bk, nq, window):
    """The query blocks [lo, hi) that can see key block j."""
    lo = (j * bk) // bq
    hi = nq if window is None else jnp.minimum((j * bk + bk - 1 + window - 1) // bq + 1, nq)
    return lo, hi


def _params(d: int):
    return plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2)


def _forward_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, *, static: _Static, nk: int):
    bq, bk, scoring = static.bq, static.bk, static.scoring
    i = pl.program_id(2)
    qb, qs = q_ref[...], qs_ref[...]

    def step(j, carry):
        peak, total, acc = carry
        kb, vb = k_ref[pl.ds(j * bk, bk), :], v_ref[pl.ds(j * bk, bk), :]
        scores, mask = _scores(qb, kb, qs, ks_ref[pl.ds(j * bk, bk)], i * bq, j * bk, scoring)
        scores = jnp.where(mask, scores, MASKED)
        new_peak = jnp.maximum(peak, jnp.max(scores, axis=1))
        weights = jnp.where(mask, jnp.exp(scores - new_peak[:, None]), 0.0)
        fade = jnp.exp(peak - new_peak)
        acc = acc * fade[:, None] + _dot(weights.astype(vb.dtype), vb, (1, 0))
        return new_peak, total * fade + jnp.sum(weights, axis=1), acc

    init = (jnp.full((bq,), MASKED, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros((bq, o_ref.shape[-1]), jnp.float32))
    peak, total, acc = jax.lax.fori_loop(*_key_blocks(i, bq, bk, nk, scoring.window), step, init)
    seen = total > 0
    o_ref[...] = (acc / jnp.where(seen, total, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, peak + jnp.log(jnp.where(seen, total, 1.0)), MASKED)


def _forward(static, q, k, v, seg):
    b, s, h, d = q.shape
    n, dv = k.shape[2], v.shape[-1]
    g, bq, bk = h // n, static.bq, static.bk
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, static=static, nk=s // bk),
        grid=(b, h, s // bq),
        in_specs=[pl.BlockSpec((None, bq, None, d), lambda z, x, i: (z, i, x, 0)),
                  pl.BlockSpec((None, s, None, d), lambda z, x, i: (z, 0, x // g, 0)),
                  pl.BlockSpec((None, s, None, dv), lambda z, x, i: (z, 0, x // g, 0)),
                  pl.BlockSpec((None, bq), lambda z, x, i: (z, i)),
                  pl.BlockSpec((None, s), lambda z, x, i: (z, 0))],
        out_specs=[pl.BlockSpec((None, bq, None, dv), lambda z, x, i: (z, i, x, 0)),
                   pl.BlockSpec((None, None, bq), lambda z, x, i: (z, x, i))],
        out_shape=[jax.ShapeDtypeStruct((b, s, h, dv), v.dtype), jax.ShapeDtypeStruct((b, h, s), jnp.float32)],
        compiler_params=_params(max(d, dv)), interpret=static.interpret, name="jaxpar_attention_forward",
    )(q, k, v, seg, seg)
    return out, lse


def _score_grads(scores, mask, lse, dp, delta, scoring: Scoring, d: int):
    """dS (scaled, through the soft cap) of one block pair from its capped scores and dP = dO . V^T."""
    probs = jnp.where(mask, jnp.exp(scores - lse[:, None]), 0.0)
    d_scores = probs * (dp - delta[:, None])
    if scoring.softcap is not None:
        d_scores = d_scores * (1.0 - jnp.square(scores / jnp.float32(scoring.softcap)))
    return probs, d_scores * jnp.float32(d ** -0.5 if scoring.scale is None else scoring.scale)


def _dq_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dq_ref, *, static, nk: int):
    bq, bk, scoring = static.bq, static.bk, static.scoring
    i = pl.program_id(2)
    qb, qs, dob, lse, delta = q_ref[...], qs_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def step(j, dq):
        kb, vb = k_ref[pl.ds(j * bk, bk), :], v_ref[pl.ds(j * bk, bk), :]
        scores, mask = _scores(qb, kb, qs, ks_ref[pl.ds(j * bk, bk)], i * bq, j * bk, scoring)
        _, d_scores = _score_grads(scores, mask, lse, _dot(dob, vb), delta, scoring, qb.shape[-1])
        return dq + _dot(d_scores.astype(kb.dtype), kb, (1, 0))

    dq = jax.lax.fori_loop(*_key_blocks(i, bq, bk, nk, scoring.window), step, jnp.zeros(qb.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, static, nq: int):
    bq, bk, scoring = static.bq, static.bk, static.scoring
    j = pl.program_id(2)
    kb, vb, ks = k_ref[...], v_ref[...], ks_ref[...]

    def step(i, carry):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        qb, dob = q_ref[rows, :], do_ref[rows, :]
        scores, mask = _scores(qb, kb, qs_ref[rows], ks, i * bq, j * bk, scoring)
        probs, d_scores = _score_grads(scores, mask, lse_ref[rows], _dot(dob, vb), delta_ref[rows], scoring,
                                       qb.shape[-1])
        return dk + _dot(d_scores.astype(qb.dtype), qb, (0, 0)), dv + _dot(probs.astype(dob.dtype), dob, (0, 0))

    init = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(*_query_blocks(j, bq, bk, nq, scoring.window), step, init)
    dk_ref[...], dv_ref[...] = dk, dv


def _forward_rule(static, q, k, v, seg):
    out, lse = _forward(static, q, k, v, seg)
    return out, (q, k, v, seg, out, lse)


def _backward_rule(static, saved, d_out):
    """dq per query block; dk and dv per query head and key block (fp32), summed over each group."""
    q, k, v, seg, out, lse = saved
    b, s, h, d = q.shape
    n, dv = k.shape[2], v.shape[-1]
    g, bq, bk = h // n, static.bq, static.bk
    delta = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
    whole = [pl.BlockSpec((None, s, None, d), lambda z, x, t: (z, 0, x, 0)),
             pl.BlockSpec((None, s, None, d), lambda z, x, t: (z, 0, x // g, 0)),
             pl.BlockSpec((None, s, None, dv), lambda z, x, t: (z, 0, x // g, 0)),
             pl.BlockSpec((None, s), lambda z, x, t: (z, 0)), pl.BlockSpec((None, s), lambda z, x, t: (z, 0)),
             pl.BlockSpec((None, s, None, dv), lambda z, x, t: (z, 0, x, 0)),
             pl.BlockSpec((None, None, s), lambda z, x, t: (z, x, 0)),
             pl.BlockSpec((None, None, s), lambda z, x, t: (z, x, 0))]
    by_query = list(whole)
    by_query[0] = pl.BlockSpec((None, bq, None, d), lambda z, x, i: (z, i, x, 0))
    by_query[3] = pl.BlockSpec((None, bq), lambda z, x, i: (z, i))
    by_query[5] = pl.BlockSpec((None, bq, None, dv), lambda z, x, i: (z, i, x, 0))
    by_query[6] = pl.BlockSpec((None, None, bq), lambda z, x, i: (z, x, i))
    by_query[7] = pl.BlockSpec((None, None, bq), lambda z, x, i: (z, x, i))
    args = (q, k, v, seg, seg, d_out, lse, delta)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, static=static, nk=s // bk), grid=(b, h, s // bq), in_specs=by_query,
        out_specs=pl.BlockSpec((None, bq, None, d), lambda z, x, i: (z, i, x, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), compiler_params=_params(max(d, dv)),
        interpret=static.interpret, name="jaxpar_attention_dq",
    )(*args)
    by_key = list(whole)
    by_key[1] = pl.BlockSpec((None, bk, None, d), lambda z, x, j: (z, j, x // g, 0))
    by_key[2] = pl.BlockSpec((None, bk, None, dv), lambda z, x, j: (z, j, x // g, 0))
    by_key[4] = pl.BlockSpec((None, bk), lambda z, x, j: (z, j))
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, static=static, nq=s // bq), grid=(b, h, s // bk), in_specs=by_key,
        out_specs=[pl.BlockSpec((None, bk, None, d), lambda z, x, j: (z, j, x, 0)),
                   pl.BlockSpec((None, bk, None, dv), lambda z, x, j: (z, j, x, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, s, h, d), jnp.float32), jax.ShapeDtypeStruct((b, s, h, dv), jnp.float32)],
        compiler_params=_params(max(d, dv)), interpret=static.interpret, name="jaxpar_attention_dkv",
    )(*args)
    dk = dk.reshape(b, s, n, g, d).sum(axis=3).astype(k.dtype)
    dv_ = dv_.reshape(b, s, n, g, dv).sum(axis=3).astype(v.dtype)
    return dq, dk, dv_, None


_attention.defvjp(_forward_rule, _backward_rule)

"""Causal attention on TPU through JAX's splash attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`).

Splash takes what the options need: a causal or local (sliding-window) mask
per head, segment ids, a logit soft cap, and grouped-query heads (its MHA
kernel reads query head h's keys from key/value head h // group). It is
per example ([heads, seq, head_dim]), so the batch is vmapped; it has no
scale, so the queries are scaled before it (the soft cap follows, as
`causal_attention` wants). Two things differ from jaxpar's semantics and are
put right around it: a padding query (segment 0) attends other padding in
splash and nothing here, so its rows are zeroed (their cotangent too, so
they send no gradient anywhere); and splash's blocks are multiples of 128,
so the sequence is padded to the block with keys beyond every query.

`interpret=True` runs it through Pallas' interpreter on any backend (how the
tests hold it to the reference on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from jaxpar.core import device_facts
from jaxpar.parallel.attention_flash import Blocks
from jaxpar.parallel.attention_math import Scoring

LANES = 128  # splash's key blocks are multiples of the TPU's 128 lanes
DEFAULT_BLOCK = 512
DTYPES = (jnp.float32, jnp.bfloat16)
HEAD_DIM_MULTIPLE = 64  # the head dimensions splash runs at in the field (64, 128, 256)


def splash_refusal(call, device_kind: str | None = None, blocks: Blocks | None = None,
                   interpret: bool = False) -> str | None:
    """Why splash attention cannot run `call` (an attention_kernels.Call) on `device_kind` (default: this
    process's) with `blocks` (None: its own), or None. Under `interpret` any backend runs it."""
    device_kind = device_kind or device_facts.current().kind
    if not interpret and not device_kind.startswith("TPU"):
        return f"the device is {device_kind}: splash attention is a TPU kernel"
    if call.context_ways > 1:
        return "context parallelism: each rank's queries and keys are non-contiguous chunks of the sequence"
    if jnp.dtype(call.dtype) not in [jnp.dtype(t) for t in DTYPES]:
        return f"dtype {jnp.dtype(call.dtype).name}: splash attention runs fp32 or bf16"
    for name, size in (("head dimension", call.head_dim), ("value head dimension", call.value_dim)):
        if size % HEAD_DIM_MULTIPLE:
            return f"{name} {size}: splash attention takes multiples of {HEAD_DIM_MULTIPLE}"
    return None if blocks is None else block_refusal(blocks)


def block_refusal(blocks: Blocks) -> str | None:
    for name, size in (("query", blocks.q), ("key", blocks.k)):
        if size % LANES:
            return f"{name} block {size}: splash attention's blocks are multiples of {LANES}"
    return None


def splash_attention(q, k, v, scoring: Scoring, segments=None, blocks: Blocks | None = None,
                     interpret: bool = False):
    """Causal grouped-query attention: q [b, s, heads, d], k [b, s, kv_heads, d], v [b, s, kv_heads, dv],
    segments [b, s] packed documents' ids (0: padding, sees nothing) or None. Returns [b, s, heads, dv]."""
    b, s, h, d = q.shape
    if h % k.shape[2]:
        raise ValueError(f"attention has {h} query heads and {k.shape[2]} key/value heads: the query heads must be "
                         f"a multiple of the key/value heads (grouped-query attention)")
    fitted = -(-s // LANES) * LANES
    bq, bk = (min(DEFAULT_BLOCK, fitted),) * 2 if blocks is None else (min(blocks.q, fitted), min(blocks.k, fitted))
    step = max(bq, bk)
    padded = -(-s // step) * step
    kernel = _kernel(h, padded, scoring.window, scoring.softcap, bq, bk, interpret)
    scale = jnp.asarray(d ** -0.5 if scoring.scale is None else scoring.scale, q.dtype)

    def heads_first(x):  # [b, s, heads, d] -> [b, heads, padded, d]; padded keys come after every query
        return jnp.transpose(jnp.pad(x, [(0, 0), (0, padded - s), (0, 0), (0, 0)]), (0, 2, 1, 3))

    q, k, v = heads_first(q * scale), heads_first(k), heads_first(v)
    if segments is None:
        out = jax.vmap(kernel)(q, k, v)
    else:
        seg = jnp.pad(jnp.asarray(segments, jnp.int32), [(0, 0), (0, padded - s)])
        out = jax.vmap(lambda q, k, v, seg: kernel(q, k, v, segment_ids=splash.SegmentIds(seg, seg)))(q, k, v, seg)
    out = jnp.transpose(out, (0, 2, 1, 3))[:, :s]
    if segments is not None:
        out = jnp.where((jnp.asarray(segments) != 0)[:, :, None, None], out, 0)
    return out


def _kernel(heads: int, seq: int, window, softcap, bq: int, bk: int, interpret: bool):
    """Splash's kernel for one mask and block shape, built per trace: it holds its mask tables as arrays of the
    tracing context's mesh, so no cache may hand them to another trace."""
    shape = (seq, seq)
    mask = splash.CausalMask(shape) if window is None else splash.LocalMask(shape, (window - 1, 0), 0)
    sizes = splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                              block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)

"""The arithmetic of masked softmax attention, shared by every form of `jaxpar.parallel.attention`.

What decides which key a query sees and how a score is formed is one small
value, `Scoring` (the sliding window, the logit soft cap, the scale); the
document segment ids are arrays beside it. `attend` is the textbook form
(attention=xla, and the reference the blockwise `jaxpar.parallel.attention_flash`
is held to). Masked entries carry fp32's minimum as their score and, wherever
a query row may see no key at all (padding of packed documents), an exact zero
weight: exp(min - peak) is 1, not 0, when the row's peak is that minimum too.

Attention sinks (gpt-oss) are a learned logit per query head that joins each row's softmax denominator
and weighs no value: `attend` takes them as one more column of scores; the blockwise forms attend
without them and scale each row afterwards by `sink_weight`, from the row's log-sum-exp, which is the
same function (and whose derivative in the sink is -sum_q p_sink(q) * rowsum(dO * O), by the chain rule).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

MASKED = jnp.finfo(jnp.float32).min  # the score of a key a query does not see


@dataclasses.dataclass(frozen=True)
class Scoring:
    """How a query's scores are formed (static: Python values, part of the compiled function).

    window: None (every earlier key) or W: query i sees key j iff j <= i and i - j < W (Hugging Face's
    sliding window; W = 1 sees only itself). softcap: None or c, scores -> c * tanh(scores / c) after
    scaling, before masking (Gemma 2). scale: None (head_dim ** -0.5) or the multiplier of q . k.
    """

    window: int | None = None
    softcap: float | None = None
    scale: float | None = None

    def __post_init__(self):
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, numbers.Integral)
                                        or self.window < 1):
            raise ValueError(f"window must be None or an int >= 1 (a Python value: masks are static), "
                             f"got {self.window!r}")
        if self.window is not None:
            object.__setattr__(self, "window", int(self.window))
        if self.softcap is not None and not float(self.softcap) > 0:
            raise ValueError(f"softcap must be None or a float > 0, got {self.softcap!r}")
        if self.scale is not None and not float(self.scale) > 0:
            raise ValueError(f"scale must be None or a float > 0, got {self.scale!r}")


def raw_scores(q, k, scoring: Scoring):
    """Scaled (and soft-capped) scores [batch, kv_heads, group, queries, keys] in fp32, unmasked.

    q [batch, queries, heads, head_dim], k [batch, keys, kv_heads, head_dim]; query head h reads
    key head h // (heads / kv_heads).
    """
    b, s, h, d = q.shape
    grouped = q.reshape(b, s, k.shape[2], h // k.shape[2], d)
    scores = jnp.einsum("bqngk,bsnk->bngqs", grouped, k).astype(jnp.float32)
    if scoring.scale is None:
        scores = scores / jnp.sqrt(d).astype(jnp.float32)
    else:
        scores = scores * jnp.float32(scoring.scale)
    if scoring.softcap is not None:
        cap = jnp.float32(scoring.softcap)
        scores = cap * jnp.tanh(scores / cap)
    return scores


def visible(q_pos, k_pos, window: int | None, q_seg=None, k_seg=None):
    """Which keys each query sees: [queries, keys], or [batch, queries, keys] with segment ids [batch, *].

    Causal (and within the window) by sequence index; with segment ids also in the same document,
    and a padding query (segment 0) sees nothing.
    """
    mask = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
    if q_seg is not None:
        same = (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] != 0)
        mask = mask[None] & same
    return mask


def on_scores(mask):
    """A `visible` mask broadcast against scores [batch, kv_heads, group, queries, keys]."""
    return mask if mask.ndim == 2 else mask[:, None, None]


def attend(q, k, v, q_pos, k_pos, scoring: Scoring, q_seg=None, k_seg=None, sinks=None):
    """Plain masked softmax attention of queries at `q_pos` to keys at `k_pos`; a query seeing no key gives 0.

    `sinks` [heads] (or None): each query head's sink logit, one more entry of its softmax that weighs no value.
    """
    mask = on_scores(visible(q_pos, k_pos, scoring.window, q_seg, k_seg))
    scores = jnp.where(mask, raw_scores(q, k, scoring), MASKED)
    if sinks is None:
        weights = jax.nn.softmax(scores, axis=-1)
    else:
        b, n, g, sq, _ = scores.shape
        column = jnp.broadcast_to(grouped_sinks(sinks, n, g)[..., None, None], (b, n, g, sq, 1))
        weights = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
    if q_seg is not None:  # padding rows see nothing: their softmax is uniform, their weights must be 0
        weights = jnp.where(mask, weights, 0.0)
    return weighted(weights.astype(v.dtype), v, q.shape)


def weighted(weights, v, q_shape):
    """Weights [b, kv_heads, group, q, s] times values [b, s, kv_heads, head_dim], as [b, q, heads, head_dim]."""
    return jnp.einsum("bngqs,bsnk->bqngk", weights, v).reshape(q_shape[:3] + v.shape[-1:])


def grouped_sinks(sinks, kv_heads: int, group: int):
    """Sink logits [heads] in fp32 as [kv_heads, group], the grouped layout of the scores (head h = n * group + g)."""
    return sinks.astype(jnp.float32).reshape(kv_heads, group)


def sink_weight(lse, sinks):
    """The share of each row's softmax its keys keep beside the sink, exp(lse) / (exp(lse) + exp(sink)), as
    [b, q, heads, 1] against the output; lse [b, kv_heads, group, q] (MASKED for a row that sees no key: 0)."""
    b, n, g, s = lse.shape
    share = jax.nn.sigmoid(lse - grouped_sinks(sinks, n, g)[None, :, :, None])
    return jnp.transpose(share, (0, 3, 1, 2)).reshape(b, s, n * g, 1)

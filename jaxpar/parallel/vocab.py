"""Reading arrays indexed by the vocabulary: a token's row in its shard, padding columns, each position's target logit.

The embedding lookup and the cross-entropy of both forms of the Megatron layers
(jaxpar.parallel.tensor, jaxpar.parallel.tensor_explicit) read the vocabulary this way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def local_index(ids, shard_size: int, axes):
    """Offsets of global ids into this shard's `shard_size` rows (0 where absent), and which ids it holds."""
    local = ids - jax.lax.axis_index(axes) * shard_size
    hit = (local >= 0) & (local < shard_size)
    return jnp.where(hit, local, 0), hit


def mask_padding(logits, start, vocab_size: int, padded: int):
    """Logits of padding columns (global index >= vocab_size) set to -inf; a no-op without padding."""
    if vocab_size == padded:
        return logits
    return jnp.where(start + jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)


def softcap(logits, cap: float | None):
    """cap * tanh(logits / cap): Gemma 2's final logit soft-capping (logits unchanged when cap is None)."""
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def is_target(targets, vocab: int):
    """[..., vocab] booleans: True at each position's target column."""
    return targets[..., None] == jnp.arange(vocab)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def target_logit(vocab: int, logits, targets):
    """logits[..., targets]: each position's target logit, read where it lies.

    Picked as `jnp.sum(jnp.where(one_hot, logits, 0))`, XLA:CPU writes the whole
    where (an fp32 [tokens, vocab] array, the size of the logits) before it sums
    it. The backward is that where's: the cotangent at each target, zero
    elsewhere, an elementwise expression the softmax's backward fuses.
    """
    return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _target_logit_forward(vocab, logits, targets):
    return target_logit(vocab, logits, targets), targets


def _target_logit_backward(vocab, targets, cotangent):
    return jnp.where(is_target(targets, vocab), cotangent[..., None], 0).astype(cotangent.dtype), None


target_logit.defvjp(_target_logit_forward, _target_logit_backward)

"""DeepSeek-V3's inference forward: logits with positions and a padding mask, and a decode whose cache holds MLA's
compressed tokens.

The cache keeps, per layer and token, what `latent_attention.compressed` gives: the normed kv latent
(`kv_lora_rank`) and the rotated shared key (`qk_rope_head_dim`), not per-head keys and values; each call expands
them to the heads' keys and values (`latent_attention.keys_values`). For DeepSeek-V3 that is 576 numbers a token and
layer in place of 128 heads x (192 + 128) = 40,960. Prompts are left-padded as `models.inference` has them: the
mask marks real tokens, positions count them, and a padded key is seen by no query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.models import latent_attention
from jaxpar.models.block import Q_NAMES, block_norm, mlp, output_projection
from jaxpar.models.inference import logits_of, padded_positions
from jaxpar.parallel import experts, tensor
from jaxpar.parallel.constrain import constrain

CACHE = ("layers", "batch", "seq", None)


def init_cache(cfg, batch: int, slots: int, dtype=jnp.float32) -> dict:
    """An empty compressed cache for `batch` sequences of up to `slots` tokens: latent [layers, batch, slots,
    kv_lora_rank] and rope_key [layers, batch, slots, qk_rope_head_dim]; mask, length and index as
    `models.inference.init_cache`'s."""
    n = cfg.n_layers
    return {"latent": constrain(jnp.zeros((n, batch, slots, cfg.kv_lora_rank), dtype), CACHE),
            "rope_key": constrain(jnp.zeros((n, batch, slots, cfg.qk_rope_head_dim), dtype), CACHE),
            "mask": jnp.zeros((batch, slots), bool), "length": jnp.zeros((batch,), jnp.int32),
            "index": jnp.zeros((), jnp.int32)}


def cached_attention(p, x, cfg, positions, key_mask, cached=None, index=None):
    """MLA of x's tokens at `positions` [batch, seq]: with `cached` (latent, rope_key) [batch, slots, ...] the new
    tokens' compressed keys are written at slots index..index+seq and the queries see every earlier real slot.
    Returns (output, (latent, rope_key))."""
    q = latent_attention.queries(p, x, cfg, positions)
    latent, rope_key = latent_attention.compressed(p, x, cfg, positions)
    query_slots = jnp.arange(q.shape[1])
    if cached is not None:
        latent = jax.lax.dynamic_update_slice(cached[0], latent.astype(cached[0].dtype), (0, index, 0))
        rope_key = jax.lax.dynamic_update_slice(cached[1], rope_key.astype(cached[1].dtype), (0, index, 0))
        query_slots = query_slots + index
    k, v = latent_attention.keys_values(p, latent.astype(q.dtype), rope_key.astype(q.dtype), cfg)
    allowed = (jnp.arange(k.shape[1])[None, :] <= query_slots[:, None])[None] & key_mask[:, None, :]
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(latent_attention.softmax_scale(cfg))
    scores = jnp.where(allowed[:, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqs,bshk->bqhk", weights, v).astype(x.dtype)
    return output_projection(p, constrain(out, Q_NAMES)), (latent, rope_key)


def _layers(stacked, x, cfg, positions, key_mask, cache, index, experts_ffn: bool):
    """Scan one stack of blocks (dense or MoE) for inference: (x, the stack's compressed cache)."""

    def body(h, layer):
        p, cached = layer
        out, cached = cached_attention(p, tensor.enter_tensor_region(block_norm(h, p["attn_norm"], cfg)), cfg,
                                       positions, key_mask, cached, index)
        h = h + out
        normed = tensor.enter_tensor_region(block_norm(h, p["mlp_norm"], cfg))
        if experts_ffn:
            routed = experts.moe_ffn(p, normed, cfg.moe)[0]
            shared = mlp({"w_gate": p["shared_gate"], "w_up": p["shared_up"], "w_down": p["shared_down"]}, normed)
            return h + routed + shared, cached
        return h + mlp(p, normed), cached

    return jax.lax.scan(body, x, (stacked, cache))


def run_layers(model, tokens, positions, key_mask, cache=None, index=None):
    """The dense then the MoE blocks on tokens' embeddings: (x, every layer's compressed keys, stacked)."""
    x = model.embed(tokens)
    stacks = model.blocks.stacked()
    if cache is None:
        b, s = tokens.shape
        cache = init_cache(model.cfg, b, s, x.dtype)
        cache, index = (cache["latent"], cache["rope_key"]), jnp.zeros((), jnp.int32)
    first = model.cfg.first_dense
    kept = []
    if "dense" in stacks:
        x, dense = _layers(stacks["dense"], x, model.cfg, positions, key_mask,
                           tuple(c[:first] for c in cache), index, experts_ffn=False)
        kept.append(dense)
    x, moe = _layers(stacks["moe"], x, model.cfg, positions, key_mask, tuple(c[first:] for c in cache), index,
                     experts_ffn=True)
    kept.append(moe)
    return x, tuple(jnp.concatenate(parts) for parts in zip(*kept))


def _refuse_documents(segment_ids) -> None:
    if segment_ids is not None:
        raise ValueError("segment_ids (packed documents) are not supported by DeepSeek-V3's inference forward")


def deepseek_logits(model, tokens, positions=None, mask=None, segment_ids=None):
    """Logits [batch, seq, vocab] (float32) of tokens [batch, seq]; `mask` marks real tokens, positions count them."""
    _refuse_documents(segment_ids)
    mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
    positions = jnp.broadcast_to(padded_positions(mask) if positions is None else positions, tokens.shape)
    x, _ = run_layers(model, tokens, positions, mask)
    return logits_of(model, x)


def deepseek_decode(model, tokens, cache: dict, mask=None, positions=None, segment_ids=None):
    """(logits [batch, seq, vocab], updated cache) for tokens [batch, seq] appended to the compressed cache."""
    _refuse_documents(segment_ids)
    index = cache["index"]
    mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
    if positions is None:
        positions = cache["length"][:, None] + padded_positions(mask)
    key_mask = jax.lax.dynamic_update_slice(cache["mask"], mask, (0, index))
    x, (latent, rope_key) = run_layers(model, tokens, positions, key_mask, (cache["latent"], cache["rope_key"]), index)
    cache = {**cache, "latent": constrain(latent, CACHE), "rope_key": constrain(rope_key, CACHE), "mask": key_mask,
             "index": index + tokens.shape[1], "length": cache["length"] + mask.sum(axis=1).astype(jnp.int32)}
    return logits_of(model, x), cache

"""The inference forward: logits with positions, a padding mask and packed documents, and a KV-cache decode.

Separate from the training path (which runs through jaxpar.pipeline.executor): one forward over the stacked
layers that takes explicit positions, a key padding mask and, while generating, a key/value cache it
updates in place. With `segment_ids` (packed documents, 0 = padding) a token sees only earlier tokens of
its own document, positions restart per document and a sliding window is measured in positions, so a
packed row gives each document the logits it has alone. A cache made with `init_cache(..., segments=True)`
keeps each slot's segment id and position: tokens decoded after a packed prefill continue each row's last
document. Without segment ids the masks are those of the plain path (padding and causality by slot).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.models import layer_pattern
from jaxpar.models.block import (KV_NAMES, Q_NAMES, block_norm, dense_feed_forward, output_projection, query_key_value,
                                 residual_add)
from jaxpar.models.config import LlamaConfig
from jaxpar.parallel import attention as attention_lib
from jaxpar.parallel import attention_math
from jaxpar.parallel import lora
from jaxpar.parallel import tensor
from jaxpar.parallel.constrain import constrain
from jaxpar.parallel.vocab import softcap

CACHE = ("layers", "batch", "seq", "kv_heads", "head_dim")


def init_cache(cfg: LlamaConfig, batch: int, slots: int, dtype=jnp.float32, segments: bool = False) -> dict:
    """An empty KV cache for `batch` sequences of up to `slots` tokens.

    k, v: [layers, batch, slots, kv_heads, head_dim]; mask: which slots hold a
    real token; length: the next position per sequence; index: the next slot to
    write (the same for every sequence: prompts are left-padded). `segments`: for
    packed prompts, also segment_ids and positions [batch, slots] of each slot and
    segment [batch], the row's last document (the one decoded tokens continue).
    """
    shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.head_dim)
    cache = {
        "k": constrain(jnp.zeros(shape, dtype), CACHE), "v": constrain(jnp.zeros(shape, dtype), CACHE),
        "mask": jnp.zeros((batch, slots), bool), "length": jnp.zeros((batch,), jnp.int32),
        "index": jnp.zeros((), jnp.int32),
    }
    if segments:
        cache.update(segment_ids=jnp.zeros((batch, slots), jnp.int32), positions=jnp.zeros((batch, slots), jnp.int32),
                     segment=jnp.zeros((batch,), jnp.int32))
    return cache


def document_visible(q_slots, k_slots, window, q_seg, k_seg, q_pos, k_pos):
    """[batch, queries, keys]: causal by slot, the same document (a padding query, segment 0, sees nothing),
    and within the window by position (a document's own positions, whatever lies between its slots)."""
    allowed = (k_slots[None, :] <= q_slots[:, None])[None]
    allowed = allowed & (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] != 0)
    if window is not None:
        allowed = allowed & (q_pos[:, :, None] - k_pos[:, None, :] < window)
    return allowed


def cached_attention(p, x, cfg: LlamaConfig, positions, key_mask, kv=None, index=None, window=None, documents=None,
                     inv_freq=None, layer=None):
    """Causal GQA attention of x's tokens at `positions` ([batch, seq]); keys where `key_mask` is False are ignored.

    Without `kv` the keys are x's own tokens (key_mask [batch, seq]). With
    kv = (k, v) [batch, slots, kv_heads, head_dim] the new keys and values are
    written at slots index..index+seq and the queries attend to every earlier
    slot (key_mask [batch, slots]). `window` (None: global; an int or a traced
    scalar, see `layer_pattern.layer_window`) hides keys W or more slots older than the query,
    as Hugging Face measures it (cache positions: left padding counts). `documents`
    (q_seg, k_seg, k_pos): segment ids of the queries and keys and the keys'
    positions; then only a query's own document is seen (`document_visible`) and
    key_mask is not read. cfg's soft cap and query scale apply; `inv_freq` (None: cfg's) are the layer's rotary
    frequencies, `layer` its Llama 4 options (`layer_pattern.layer_options`: its chunk, of positions).
    Returns (output, (k, v)).
    """
    layer = {} if layer is None else layer
    q, k, v = query_key_value(p, x, cfg, positions, replicate_kv=False, inv_freq=inv_freq, layer=layer)
    b, s = q.shape[:2]  # the whole sequence: under sequence parallelism x may hold a shard of it
    query_slots = jnp.arange(s)
    if kv is not None:
        k = constrain(jax.lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), (0, index, 0, 0)), KV_NAMES)
        v = constrain(jax.lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), (0, index, 0, 0)), KV_NAMES)
        query_slots = query_slots + index
    if documents is not None:
        allowed = document_visible(query_slots, jnp.arange(k.shape[1]), window, documents[0], documents[1],
                                   positions, documents[2])
    else:
        allowed = jnp.arange(k.shape[1])[None, :] <= query_slots[:, None]
        if window is not None:
            allowed = allowed & (query_slots[:, None] - jnp.arange(k.shape[1])[None, :] < window)
        allowed = allowed[None] & key_mask[:, None, :]
    if "chunk" in layer:  # chunks of positions: the keys' own, or in a plain cache (left-padded rows) each row's
        # slots less its last query's offset
        if documents is not None or kv is None:
            k_at = positions if documents is None else documents[2]
        else:
            k_at = jnp.arange(k.shape[1])[None] - (query_slots[-1] - positions[:, -1:])
        allowed = allowed & (positions[:, :, None] // layer["chunk"] == k_at[:, None, :] // layer["chunk"])
    kv_heads = k.shape[2]
    scoring = attention_math.Scoring(softcap=cfg.attn_softcap, scale=cfg.query_scale)
    scores = attention_math.raw_scores(q, k.astype(q.dtype), scoring)
    q = q.reshape(b, s, kv_heads, q.shape[2] // kv_heads, q.shape[3])
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if "sinks" in p:  # gpt-oss: each head's sink logit joins the softmax and weighs no value
        sinks = attention_math.grouped_sinks(p["sinks"], kv_heads, q.shape[3])[None, :, :, None, None]
        weights = jax.nn.softmax(jnp.concatenate([scores, jnp.broadcast_to(sinks, scores.shape[:4] + (1,))], -1),
                                 axis=-1)[..., :-1]
    else:
        weights = jax.nn.softmax(scores, axis=-1)
    if documents is not None:  # a padding query sees nothing: its softmax is uniform, its weights must be 0
        weights = jnp.where(allowed[:, None, None], weights, 0.0)
    weights = weights.astype(v.dtype)
    out = jnp.einsum("bngqs,bsnk->bqngk", weights, v).reshape(b, s, -1, q.shape[-1]).astype(x.dtype)
    return output_projection(p, constrain(out, Q_NAMES)), (k, v)


def inference_layers(stacked, x, cfg: LlamaConfig, positions, key_mask, cache=None, index=None, feed_forward=None,
                     documents=None):
    """Scan the blocks over the layer axis for inference; returns (x, (k, v) of every layer).

    `feed_forward(p, x, cfg)` is the blocks' (`Blocks.inference`; default the dense MLP); a layer's LoRA
    adapters (`jaxpar.parallel.lora`) are folded into its weights inside the scan, one layer at a time;
    `documents` as in `cached_attention`. Blocks of several kinds in a repeating group (an MoE model's dense
    blocks between its MoE ones) come as a tuple of stacks, one per place in the group, each [groups, ...], and
    a tuple of feed-forwards: the scan then runs over the groups, each running its blocks in order. Runs of layers
    one after another (an MoE model's dense prefix, then its groups) come as a list of such stacks and a list of
    their feed-forwards.
    """
    feed_forward = dense_feed_forward if feed_forward is None else feed_forward

    window = layer_pattern.layer_windows(cfg)  # None: no layer has a window
    frequencies = layer_pattern.layer_frequencies(cfg, cfg.head_dim)  # None: every layer rotates by cfg's
    options = layer_pattern.layer_options(cfg)  # Llama 4's per-layer chunks, q/k norms and query temperatures

    def block(h, p, kv, window, inv_freq, options, feed_forward):
        p = lora.fold(p)  # one layer's LoRA adapters folded (dequantized first under QLoRA): no stack-wide copy
        attn, kv = cached_attention(p, tensor.enter_tensor_region(block_norm(h, p["attn_norm"], cfg)), cfg,
                                    positions, key_mask, kv, index, window, documents=documents, inv_freq=inv_freq,
                                    layer=options)
        h = residual_add(p, h, attn, "post_attn_norm", cfg)
        out = feed_forward(p, tensor.enter_tensor_region(block_norm(h, p["mlp_norm"], cfg)), cfg)
        return residual_add(p, h, out, "post_mlp_norm", cfg), kv

    per_layer = (cache, window, frequencies, options)
    if not isinstance(stacked, list):
        return scan_blocks(block, stacked, x, per_layer, feed_forward)
    kvs, start = [], 0
    for run, run_feed_forward in zip(stacked, feed_forward):  # runs of layers in order, each scanned
        count = layer_count(run)
        x, kv = scan_blocks(block, run, x, jax.tree.map(lambda a: a[start:start + count], per_layer),
                            run_feed_forward)
        kvs.append(kv)
        start += count
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *kvs)


def layer_count(stacked) -> int:
    """The layers a stack holds: its leading dimension, or a tuple of stacks' (one per place in a group) total."""
    if isinstance(stacked, tuple):
        return sum(layer_count(s) for s in stacked)
    return jax.tree.leaves(stacked)[0].shape[0]


def scan_blocks(block, stacked, x, per_layer, feed_forward):
    """Scan `block` over one stack (or a tuple of stacks, one per place in a repeating group, with a tuple of
    feed-forwards): (x, (k, v) of every layer)."""
    if not isinstance(stacked, tuple):
        return jax.lax.scan(lambda h, layer: block(h, *layer, feed_forward), x, (stacked, *per_layer))
    size = len(stacked)

    def group(h, layers):
        weights, per_layer = layers
        kvs = []
        for j in range(size):
            h, kv = block(h, weights[j], *jax.tree.map(lambda a: a[j], per_layer), feed_forward[j])
            kvs.append(kv)
        return h, jax.tree.map(lambda *a: jnp.stack(a), *kvs)

    grouped = jax.tree.map(lambda a: a.reshape(-1, size, *a.shape[1:]), per_layer)
    x, kv = jax.lax.scan(group, x, (stacked, grouped))
    return x, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), kv)


def padded_positions(mask):
    """Positions of left- (or right-) padded rows: 0, 1, ... counting real tokens only; padding gets 0 or the last."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)


def segment_positions(segment_ids):
    """Each token's index within its run of equal segment ids [batch, seq] (a packed document's positions)."""
    index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def logits_of(model, x):
    """Logits [batch, seq, vocab] (float32, padding columns dropped, final soft cap) of the last hidden states."""
    x = block_norm(x, model.final_norm[...], model.cfg)
    logits = softcap(jnp.einsum("bsd,dv->bsv", x, model.output_weights()).astype(jnp.float32), model.cfg.final_softcap)
    return constrain(logits, ("batch", "seq", "vocab"))[..., : model.cfg.vocab]


def inference_blocks(model) -> tuple[dict[str, jax.Array], Callable]:
    """The blocks' per-layer weights and feed-forward layer for inference (see `Blocks.inference`)."""
    if attention_lib.context_ways() > 1:
        raise ValueError("inference (logits, decode) does not run context-parallel; use a plan with context=1")
    if not hasattr(model.blocks, "inference"):
        raise ValueError(f"inference (logits, decode) is not defined for blocks of type {type(model.blocks).__name__}")
    return model.blocks.inference()


def real_segments(tokens, mask, segment_ids):
    """Segment ids [batch, seq] int32 with the tokens `mask` marks as padding set to 0 (a shape mismatch is refused)."""
    if tuple(segment_ids.shape) != tuple(tokens.shape):
        raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}; it must match tokens "
                         f"[batch, seq] = {tuple(tokens.shape)}")
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    return segment_ids if mask is None else jnp.where(mask.astype(bool), segment_ids, 0)


def llama_logits(model, tokens, positions=None, mask=None, segment_ids=None):
    """Logits [batch, seq, vocab] (float32, padding columns dropped) of tokens [batch, seq].

    `mask` [batch, seq] marks real tokens (False: padding, which no token
    attends to); `positions` default to the count of real tokens before each one,
    so left-padded prompts get the positions they would have alone. `segment_ids`
    [batch, seq] (packed documents, 0: padding): a token sees only earlier tokens
    of its own document and positions default to each token's index in its document.
    """
    stacked, feed_forward = inference_blocks(model)
    documents = None
    if segment_ids is not None:
        segment_ids = real_segments(tokens, mask, segment_ids)
        mask = segment_ids > 0
        positions = segment_positions(segment_ids) if positions is None else positions
    mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
    positions = padded_positions(mask) if positions is None else positions
    positions = jnp.broadcast_to(positions, tokens.shape)
    if segment_ids is not None:
        documents = (segment_ids, segment_ids, positions)
    x, _ = inference_layers(stacked, model.embed(tokens), model.cfg, positions, mask, feed_forward=feed_forward,
                            documents=documents)
    return logits_of(model, x)


def last_real(values, real, default):
    """[batch]: each row's value at its last real token, `default` [batch] where the row has none."""
    last = real.shape[1] - 1 - jnp.argmax(real[:, ::-1], axis=1)
    return jnp.where(real.any(axis=1), jnp.take_along_axis(values, last[:, None], axis=1)[:, 0], default)


def decode_documents(cache: dict, tokens, mask, positions, segment_ids):
    """The segment cache's side of a decode call: (positions, key mask, documents, cache fields to store).

    New tokens without `segment_ids` continue each row's last document; with them
    (a packed prefill), a token of the cache's last document continues its positions
    and the others start their own at 0.
    """
    index = cache["index"]
    if segment_ids is None:
        segment_ids = jnp.where(mask, cache["segment"][:, None], 0)
    else:
        segment_ids = real_segments(tokens, mask, segment_ids)
    real = segment_ids > 0
    if positions is None:
        continues = segment_ids == cache["segment"][:, None]
        positions = segment_positions(segment_ids) + jnp.where(continues, cache["length"][:, None], 0)
    positions = jnp.broadcast_to(positions, segment_ids.shape).astype(jnp.int32)
    k_seg = jax.lax.dynamic_update_slice(cache["segment_ids"], segment_ids, (0, index))
    k_pos = jax.lax.dynamic_update_slice(cache["positions"], positions, (0, index))
    key_mask = jax.lax.dynamic_update_slice(cache["mask"], real, (0, index))
    stored = {"segment_ids": k_seg, "positions": k_pos, "segment": last_real(segment_ids, real, cache["segment"]),
              "length": last_real(positions + 1, real, cache["length"])}
    return positions, key_mask, (segment_ids, k_seg, k_pos), stored


def llama_decode(model, tokens, cache: dict, mask=None, positions=None, segment_ids=None):
    """(logits [batch, seq, vocab], updated cache) for tokens [batch, seq] appended to the cache (see init_cache).

    `segment_ids` [batch, seq] (a packed prompt, 0: padding) need a cache made with `segments=True`;
    with such a cache, tokens given without them continue each row's last document.
    """
    stacked, feed_forward = inference_blocks(model)
    index = cache["index"]
    if "segment_ids" in cache:
        mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
        positions, key_mask, documents, stored = decode_documents(cache, tokens, mask, positions, segment_ids)
    elif segment_ids is not None:
        raise ValueError("decode with segment_ids (packed prompts) needs a cache that keeps each slot's segment: "
                         "init_cache(cfg, batch, slots, dtype, segments=True)")
    else:
        documents = None
        mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
        if positions is None:
            positions = cache["length"][:, None] + padded_positions(mask)
        key_mask = jax.lax.dynamic_update_slice(cache["mask"], mask, (0, index))
        stored = {"length": cache["length"] + mask.sum(axis=1).astype(jnp.int32)}
    x, (k, v) = inference_layers(stacked, model.embed(tokens), model.cfg, positions, key_mask,
                                 (cache["k"], cache["v"]), index, feed_forward, documents)
    cache = {**cache, "k": constrain(k, CACHE), "v": constrain(v, CACHE), "mask": key_mask,
             "index": index + tokens.shape[1], **stored}
    return logits_of(model, x), cache

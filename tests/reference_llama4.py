"""An independent single-device Llama 4 (text) loss in plain JAX, beside tests/reference.py's Llama and MoE.

It reads the parameter tree jaxpar's train state holds (`blocks/moe` with the shared expert's weights, `blocks/dense`
the dense layers' between the MoE ones) and
re-derives Llama 4 from its definition: every sliding_pattern-th layer is NoPE (no rotation, queries times
log1p(floor((i + 1) / floor)) * scale + 1), the others rotate, L2-norm q and k and attend causally within
chunks of positions; the feed-forward is the shared SwiGLU plus the one chosen expert's SwiGLU of the input
times the sigmoid of its router logit. Imports nothing from jaxpar; default (unscaled) rotary only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from reference import cross_entropy, embed, layer, masked_attention, norm, rope, swiglu


def attention(p, x, cfg, nope: bool):
    q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", x, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
    s = x.shape[1]
    positions = np.arange(s)
    if nope:
        q = q * (np.log1p(np.floor((positions + 1) / cfg.temperature_floor)) * cfg.temperature_scale + 1)[:, None, None]
        segments = None
    else:
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
        if cfg.qk_l2_norm:
            ones = jnp.ones(q.shape[-1])
            q, k = norm(q, ones, cfg.norm_eps), norm(k, ones, cfg.norm_eps)
        segments = jnp.broadcast_to(jnp.asarray(positions // cfg.attention_chunk + 1), x.shape[:2])
    out = masked_attention(q, k, v, segments)
    return jnp.einsum("bqhk,hkd->bqd", out, p["wo"])


def feed_forward(p, x, cfg):
    logits = x @ p["router"]  # [b, s, experts]
    choice = jnp.argmax(logits, axis=-1)
    gate = jax.nn.sigmoid(jnp.max(logits, axis=-1, keepdims=True))
    y = swiglu(x, p["shared_gate"], p["shared_up"], p["shared_down"])
    for j in range(cfg.n_experts):
        y = y + jnp.where((choice == j)[..., None], swiglu(x * gate, p["expert_gate"][j], p["expert_up"][j],
                                                            p["expert_down"][j]), 0.0)
    return y


def llama4_loss(params, batch, cfg):
    """(loss, metrics) of a Llama 4: layer i an MoE layer when (i + 1) % moe_every == 0, else a dense SwiGLU one."""
    x = embed(params, batch["inputs"], cfg)
    every = cfg.moe_every
    for i in range(cfg.n_layers):
        moe = (i + 1) % every == 0
        p = layer(params["blocks"]["moe"], i // every) if moe else \
            layer(params["blocks"]["dense"], i // every * (every - 1) + i % every)
        nope = cfg.global_nope and (i + 1) % cfg.sliding_pattern == 0
        x = x + attention(p, norm(x, p["attn_norm"], cfg.norm_eps), cfg, nope)
        h = norm(x, p["mlp_norm"], cfg.norm_eps)
        x = x + (feed_forward(p, h, cfg) if moe else swiglu(h, p["w_gate"], p["w_up"], p["w_down"]))
    ce = cross_entropy(params, x, batch["targets"], cfg)
    return ce, {"ce_loss": ce}


def loss_fn(cfg):
    if cfg.rope_type != "default":
        raise ValueError(f"the Llama 4 reference rotates unscaled ('default'), got rope_type={cfg.rope_type!r}")
    return lambda params, batch: llama4_loss(params, batch, cfg)

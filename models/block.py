"""One transformer block's arithmetic on the residual stream: norms, q/k/v with rotary, attention, the gated MLP.

Shared by training (`models.llama.run_layers`, through jaxpar.parallel's layers) and the inference forward
(`models.inference`, which reuses `query_key_value`, the norms and the residual adds around its cached attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.models import layer_pattern
from jaxpar.models.config import ACTIVATIONS, LlamaConfig
from jaxpar.models.rotary import attention_factor, rope_frequencies, rotary
from jaxpar.parallel import attention as attention_lib
from jaxpar.parallel import attention_chunks
from jaxpar.parallel import tensor
from jaxpar.parallel.constrain import constrain


def rms_norm(x, weight, eps, plus_one: bool = False):
    """RMSNorm in fp32; `plus_one` scales by (1 + weight), as Gemma does (its weights start at 0)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scale = weight.astype(jnp.float32) + 1.0 if plus_one else weight.astype(jnp.float32)
    return (normed * scale).astype(x.dtype)


def block_norm(x, weight, cfg: LlamaConfig):
    """The RMSNorm of the residual stream (blocks and final): the config's eps and weight convention."""
    return rms_norm(x, weight, cfg.norm_eps, cfg.norm_plus_one)


RESIDUAL = ("batch", "seq_residual", "embed")


Q_NAMES, KV_NAMES = ("batch", "seq", "heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")


def l2_norm(x, eps):
    """A weightless RMSNorm over the last axis in fp32 (Llama 4's q/k norm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def query_temperature(q, positions, floor: float, scale):
    """Llama 4's NoPE queries times log1p(floor((position + 1) / floor)) * scale + 1 (scale 0: q itself)."""
    positions = positions if positions.ndim == 2 else positions[None, :]
    factor = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor)) * scale + 1.0
    return (q * factor[:, :, None, None]).astype(q.dtype)


def query_key_value(p, x, cfg: LlamaConfig, positions=None, replicate_kv: bool = True, inv_freq=None, layer=None):
    """q, k, v of x: the projections, the family's biases and per-head norms, then the rotation at `positions`.

    `positions` None: training's, those of q's whole sequence in jaxpar.parallel.attention's order.
    `inv_freq` None: `cfg`'s rotary frequencies (a layer's config: `layer_pattern.layer_config`); the
    inference scan passes each layer's as data (`layer_pattern.layer_frequencies`), and Llama 4's q/k L2
    norm and query temperature likewise in `layer` (`layer_pattern.layer_options`).

    The biases pass through `kv_heads_for_ranks` like their weights, so under
    tensor parallelism each rank adds the bias of the heads it computes.
    """
    kv_params = ("wk", "wv") + (("bk", "bv") if cfg.qkv_bias else ())
    kv = {w: p[w] for w in kv_params}
    if replicate_kv:
        kv = {w: tensor.kv_heads_for_ranks(a, cfg.n_kv_heads, ("embed", "kv_heads", "head_dim")[-a.ndim:])
              for w, a in kv.items()}
    q, k, v = tensor.column_parallel(x, (p["wq"], kv["wk"], kv["wv"]), "bsd,dhk->bshk", (Q_NAMES, KV_NAMES, KV_NAMES))
    if cfg.qkv_bias:
        q, k, v = (constrain(a + b.astype(a.dtype), n) for a, b, n in
                   ((q, p["bq"], Q_NAMES), (k, kv["bk"], KV_NAMES), (v, kv["bv"], KV_NAMES)))
    if cfg.qk_norm:
        q, k = (rms_norm(a, p[w], cfg.norm_eps, cfg.norm_plus_one) for a, w in ((q, "q_norm"), (k, "k_norm")))
    positions = attention_lib.positions(q.shape[1]) if positions is None else positions
    inv_freq = rope_frequencies(cfg, q.shape[-1]) if inv_freq is None else inv_freq
    scale = attention_factor(cfg)
    q, k = (rotary(q, positions, cfg.rope_theta, inv_freq, scale),
            rotary(k, positions, cfg.rope_theta, inv_freq, scale))
    layer = {} if layer is None else layer
    if "l2" in layer:
        q, k = (jnp.where(layer["l2"], l2_norm(a, cfg.norm_eps), a) for a in (q, k))
    elif cfg.qk_l2_norm:
        q, k = l2_norm(q, cfg.norm_eps), l2_norm(k, cfg.norm_eps)
    if cfg.temperature_floor is not None:
        q = query_temperature(q, positions, cfg.temperature_floor, layer.get("temperature", cfg.temperature_scale))
    return q, k, v


def attention(p, x, cfg: LlamaConfig):
    """Causal grouped-query attention (jaxpar.parallel.attention: split over `context` too); heads over the `heads` axes."""
    # q holds the whole sequence (under sequence parallelism x may hold a shard of it), in the order
    # jaxpar.parallel.attention keeps it (load-balanced under context parallelism): positions say which is which.
    q, k, v = query_key_value(p, x, cfg, positions=None)
    options = layer_pattern.attention_options(cfg)
    if cfg.attention_chunk is None:
        out = attention_lib.causal_attention(q, k, v, sinks=p.get("sinks"), **options)
    else:
        out = attention_chunks.chunked_causal_attention(q, k, v, chunk=cfg.attention_chunk, **options)
    return output_projection(p, constrain(out, Q_NAMES))


def output_projection(p, out):
    """The attention's heads [batch, seq, heads, head_dim] projected back to the residual stream (plus the output
    bias `bo` where the block has one: gpt-oss)."""
    y = tensor.row_parallel(out, p["wo"], "bshk,hkd->bsd", Q_NAMES)
    return y if "bo" not in p else constrain(y + p["bo"].astype(y.dtype), RESIDUAL)


def mlp(p, x, activation: str = "silu"):
    """The gated MLP: activation(x @ w_gate) * (x @ w_up) @ w_down (SwiGLU, or GeGLU with "gelu_tanh")."""
    hidden = ("batch", "seq", "mlp")
    gate, up = tensor.column_parallel(x, (p["w_gate"], p["w_up"]), "bsd,df->bsf", hidden)
    return tensor.row_parallel(ACTIVATIONS[activation](gate) * up, p["w_down"], "bsf,fd->bsd", hidden)


def dense_feed_forward(p, x, cfg: LlamaConfig):
    """The dense blocks' feed-forward, as inference calls a block's: the MLP in the config's activation."""
    return mlp(p, x, cfg.mlp_activation)


def residual_add(p, x, out, post_norm: str, cfg: LlamaConfig):
    """x + out, out first normed by p[post_norm] under `post_norms` (Gemma 2's sandwich norms)."""
    if cfg.post_norms:
        out = block_norm(out, p[post_norm], cfg)
    return constrain(x + out, RESIDUAL)


def attention_residual(p, x, cfg: LlamaConfig):
    """The first half of a block, x + attention(norm(x)), which any feed-forward layer can follow."""
    return residual_add(p, x, attention(p, tensor.enter_tensor_region(block_norm(x, p["attn_norm"], cfg)), cfg),
                        "post_attn_norm", cfg)


def block(p, x, cfg: LlamaConfig):
    """One pre-norm transformer block on the residual stream x: [batch, seq, embed]."""
    x = attention_residual(p, x, cfg)
    out = mlp(p, tensor.enter_tensor_region(block_norm(x, p["mlp_norm"], cfg)), cfg.mlp_activation)
    return residual_add(p, x, out, "post_mlp_norm", cfg)


"""Multi-head latent attention (MLA, DeepSeek-V2/V3): queries and keys/values through low-rank latents.

Each token's keys and values come from one compressed latent of `kv_lora_rank` (normed, then expanded per head to
a key part without position, `qk_nope_head_dim`, and a value, `v_head_dim`) and one rotary key of `qk_rope_head_dim`
shared by every head (the decoupled rotary key). Queries come from x directly (`q_lora_rank` None) or through their
own normed latent of `q_lora_rank`. Each head's query and key are [nope part, rotated part], so q . k spans
qk_nope_head_dim + qk_rope_head_dim entries while the value has v_head_dim: the attention core
(`jaxpar.parallel.attention`) takes a value head dimension of its own. The rotation acts on halves (i, i + rope / 2)
as jaxpar's does everywhere; DeepSeek's interleaved pairs are reordered into halves at import
(`jaxpar.interop.hf_deepseek_v3`), which leaves every q . k unchanged.

The latent norms' eps is DeepSeek's 1e-6 whatever the model's `norm_eps` (transformers builds them with its default).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxpar.models.block import Q_NAMES, output_projection, rms_norm
from jaxpar.models.rotary import attention_factor, rope_frequencies, rotary
from jaxpar.parallel import attention as attention_lib
from jaxpar.parallel import tensor
from jaxpar.parallel.constrain import constrain

LATENT_EPS = 1e-6
LATENT = ("batch", "seq", None)  # a latent's dimensions: never split over tensor (every head reads all of it)


def latent_params(cfg, rngs: nnx.Rngs, n: int, param) -> dict[str, nnx.Param]:
    """The MLA parameters of `n` stacked layers: `param(shape, names, scale=None)` builds one (models.llama._param)."""
    d, h = cfg.d_model, cfg.n_heads
    qk, kv_rank, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    heads = ("layers", None, "heads", "head_dim")
    params = {}
    if cfg.q_lora_rank is None:
        params["wq"] = param((n, d, h, qk), ("layers", "embed", "heads", "head_dim"), d**-0.5)
    else:
        r = cfg.q_lora_rank
        params["wq_a"] = param((n, d, r), ("layers", "embed", None), d**-0.5)
        params["q_a_norm"] = param((n, r), ("layers", None))
        params["wq_b"] = param((n, r, h, qk), heads, r**-0.5)
    params["wkv_a"] = param((n, d, kv_rank + cfg.qk_rope_head_dim), ("layers", "embed", None), d**-0.5)
    params["kv_a_norm"] = param((n, kv_rank), ("layers", None))
    params["wkv_b"] = param((n, kv_rank, h, cfg.qk_nope_head_dim + v), heads, kv_rank**-0.5)
    out_scale = (h * v) ** -0.5 / (2 * cfg.n_layers) ** 0.5
    params["wo"] = param((n, h, v, d), ("layers", "heads", "head_dim", "embed"), out_scale)
    return params


def latent_param_count(cfg) -> int:
    """One layer's MLA parameters (norms included)."""
    d, h = cfg.d_model, cfg.n_heads
    qk, kv_rank, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    q = d * h * qk if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    kv = d * (kv_rank + cfg.qk_rope_head_dim) + kv_rank + kv_rank * h * (cfg.qk_nope_head_dim + v)
    return q + kv + h * v * d


def softmax_scale(cfg) -> float:
    """The multiplier of q . k: `query_scale` (the import folds YaRN's mscale into it), else (nope + rope) ** -0.5."""
    return cfg.query_scale if cfg.query_scale is not None else (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5


def queries(p, x, cfg, positions=None):
    """q [batch, seq, heads, nope + rope]: x through q's latent (or q_proj), its rope part rotated at `positions`
    (None: training's, those of the whole sequence in jaxpar.parallel.attention's order)."""
    if "wq" in p:
        q = tensor.column_parallel(x, p["wq"], "bsd,dhk->bshk", Q_NAMES)
    else:
        latent = rms_norm(tensor.column_parallel(x, p["wq_a"], "bsd,dr->bsr", LATENT), p["q_a_norm"], LATENT_EPS)
        q = tensor.column_parallel(latent, p["wq_b"], "bsr,rhk->bshk", Q_NAMES, in_logical=LATENT)
    positions = attention_lib.positions(q.shape[1]) if positions is None else positions
    nope, rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    return jnp.concatenate([nope, _rotate(rope, positions, cfg)], axis=-1)


def _rotate(x, positions, cfg):
    return rotary(x, positions, cfg.rope_theta, rope_frequencies(cfg, cfg.qk_rope_head_dim), attention_factor(cfg))


def compressed(p, x, cfg, positions=None):
    """What MLA caches per token: (the normed kv latent [batch, seq, kv_lora_rank], the rotated shared key
    [batch, seq, qk_rope_head_dim])."""
    kv = tensor.column_parallel(x, p["wkv_a"], "bsd,dr->bsr", LATENT)
    positions = attention_lib.positions(kv.shape[1]) if positions is None else positions
    latent, rope = jnp.split(kv, [cfg.kv_lora_rank], axis=-1)
    return rms_norm(latent, p["kv_a_norm"], LATENT_EPS), _rotate(rope[:, :, None, :], positions, cfg)[:, :, 0, :]


def keys_values(p, latent, rope_key, cfg):
    """Per-head k [batch, seq, heads, nope + rope] and v [batch, seq, heads, v_head_dim] of the compressed tokens."""
    kv = tensor.column_parallel(latent, p["wkv_b"], "bsr,rhk->bshk", Q_NAMES, in_logical=LATENT)
    k_nope, v = jnp.split(kv, [cfg.qk_nope_head_dim], axis=-1)
    shared = jnp.broadcast_to(rope_key[:, :, None, :], (*k_nope.shape[:3], rope_key.shape[-1])).astype(k_nope.dtype)
    return constrain(jnp.concatenate([k_nope, shared], axis=-1), Q_NAMES), constrain(v, Q_NAMES)


def latent_attention(p, x, cfg):
    """Causal MLA on x [batch, seq, embed] (training's order and positions, split over `context` like any
    attention), projected back to the residual stream."""
    q = queries(p, x, cfg)
    latent, rope_key = compressed(p, x, cfg)
    k, v = keys_values(p, latent, rope_key, cfg)
    out = attention_lib.causal_attention(q, k, v, scale=softmax_scale(cfg))
    return output_projection(p, constrain(out, Q_NAMES))


def check(cfg) -> None:
    """ValueError naming an MLA size that cannot work (rotary halves need an even qk_rope_head_dim)."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (rotary pairs)")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank < 1:
        raise ValueError(f"q_lora_rank must be None or >= 1, got {cfg.q_lora_rank}")


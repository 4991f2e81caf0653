"""A Llama-style decoder in Flax NNX that names every dimension logically.

Blocks are stacked along a leading `layers` axis and run with `lax.scan`, so a
pipeline can cut that axis into stages and the compiled step stays the same
size whatever the depth. The model never names a mesh axis: sharding comes
from the plan's rules through `jaxpar.rules.constrain` and the parameters'
logical names.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.rules import constrain
from jaxpar import pipeline, tensor, zero
from jaxpar.step import active_remat


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 8
    d_ff: int = 128
    seq_len: int = 64
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    param_dtype: str = "float32"
    vocab_multiple: int = 128  # embedding rows padded to a multiple (Megatron's make-vocab-size-divisible-by)

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1, got {self.vocab_multiple}")

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and columns of the head: the vocabulary rounded up so it splits over tensor.

        Padded entries are never looked up and are masked out of the softmax, so
        the model computes the same function as with `vocab` rows.
        """
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple

    def param_count(self) -> int:
        d, h, kv, hd, f, v, n = (self.d_model, self.n_heads, self.n_kv_heads, self.head_dim,
                                 self.d_ff, self.padded_vocab, self.n_layers)
        block = 2 * d + d * hd * (h + 2 * kv) + h * hd * d + 3 * d * f
        return n * block + v * d * (1 if self.tie_embeddings else 2) + d


CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "small": LlamaConfig(d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=768, seq_len=256),
    "1b": LlamaConfig(vocab=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                      d_ff=8192, seq_len=2048),
    "7b": LlamaConfig(vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                      d_ff=11008, seq_len=4096),
    "70b": LlamaConfig(vocab=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                       d_ff=28672, seq_len=4096),
    "405b": LlamaConfig(vocab=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, head_dim=128,
                        d_ff=53248, seq_len=8192, rope_theta=500000.0),
}


def _param(rngs: nnx.Rngs, shape, names, dtype, scale: float | None = None) -> nnx.Param:
    """A parameter carrying its logical axis names (truncated-normal init, or ones for norms)."""
    if scale is None:
        init = nnx.initializers.ones
    else:
        init = nnx.initializers.truncated_normal(stddev=scale)
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, dtype))


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def rotary(x, positions, theta):
    """Rotary position embedding on the last dimension of [batch, seq, heads, head_dim]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


RESIDUAL = ("batch", "seq_residual", "embed")


def attention(p, x, cfg: LlamaConfig):
    """Causal grouped-query attention; heads split over the plan's `heads` axes."""
    b, s, _ = x.shape
    q_names, kv_names = ("batch", "seq", "heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")
    q, k, v = tensor.column_parallel(
        x, (p["wq"], p["wk"], p["wv"]), "bsd,dhk->bshk", (q_names, kv_names, kv_names)
    )
    positions = jnp.arange(s)
    q, k = rotary(q, positions, cfg.rope_theta), rotary(k, positions, cfg.rope_theta)
    kv_heads = k.shape[2]
    q = q.reshape(b, s, kv_heads, q.shape[2] // kv_heads, q.shape[3])
    scores = jnp.einsum("bqngk,bsnk->bngqs", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1]).astype(jnp.float32)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bngqs,bsnk->bqngk", weights, v).reshape(b, s, -1, q.shape[-1])
    out = constrain(out, q_names)
    return tensor.row_parallel(out, p["wo"], "bshk,hkd->bsd", q_names)


def mlp(p, x):
    hidden = ("batch", "seq", "mlp")
    gate, up = tensor.column_parallel(x, (p["w_gate"], p["w_up"]), "bsd,df->bsf", hidden)
    return tensor.row_parallel(jax.nn.silu(gate) * up, p["w_down"], "bsf,fd->bsd", hidden)


def attention_residual(p, x, cfg: LlamaConfig):
    """The first half of a block, x + attention(norm(x)), which any feed-forward layer can follow."""
    x = x + attention(p, tensor.enter_tensor_region(rms_norm(x, p["attn_norm"], cfg.norm_eps)), cfg)
    return constrain(x, RESIDUAL)


def block(p, x, cfg: LlamaConfig):
    """One pre-norm transformer block on the residual stream x: [batch, seq, embed]."""
    x = attention_residual(p, x, cfg)
    x = x + mlp(p, tensor.enter_tensor_region(rms_norm(x, p["mlp_norm"], cfg.norm_eps)))
    return constrain(x, RESIDUAL)


class Blocks(nnx.Module):
    """All transformer blocks, each parameter stacked along a leading `layers` axis."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, count: int | None = None, dense_ffn: bool = True):
        """`count` of the model's blocks (default all); `dense_ffn=False` leaves the MLP to another layer (MoE)."""
        n = cfg.n_layers if count is None else count
        d, h, kv, hd, f, depth = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.n_layers
        dt = jnp.dtype(cfg.param_dtype)
        s_in, s_attn, s_ff = d**-0.5, (h * hd) ** -0.5 / (2 * depth) ** 0.5, f**-0.5 / (2 * depth) ** 0.5
        self.attn_norm = _param(rngs, (n, d), ("layers", "norm"), dt)
        self.wq = _param(rngs, (n, d, h, hd), ("layers", "embed", "heads", "head_dim"), dt, s_in)
        self.wk = _param(rngs, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), dt, s_in)
        self.wv = _param(rngs, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), dt, s_in)
        self.wo = _param(rngs, (n, h, hd, d), ("layers", "heads", "head_dim", "embed"), dt, s_attn)
        self.mlp_norm = _param(rngs, (n, d), ("layers", "norm"), dt)
        if dense_ffn:
            self.w_gate = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dt, s_in)
            self.w_up = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dt, s_in)
            self.w_down = _param(rngs, (n, f, d), ("layers", "mlp", "embed"), dt, s_ff)

    def stacked(self) -> dict[str, jax.Array]:
        """The per-layer weights as a dict of arrays with a leading layer axis."""
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


def run_layers(stacked: dict[str, jax.Array], x, cfg: LlamaConfig, remat: Callable | None = None):
    """Scan `block` over the leading layer axis of `stacked` (a stage's or all layers).

    `remat` defaults to the active plan's policy; under ZeRO-2/3 each layer's
    parameters are gathered inside the scan, just before the block uses them.
    """
    remat = active_remat() if remat is None else remat
    body = remat(lambda h, p: (block(zero.gather_layer(p), h, cfg), None))
    return jax.lax.scan(body, x, stacked)[0]


def embed_tokens(table, tokens):
    return constrain(tensor.embedding_lookup(tokens, table), RESIDUAL)


def head_loss(p, x, targets, cfg: LlamaConfig):
    """Mean next-token cross-entropy from the last hidden state; logits stay vocab-sharded."""
    x = tensor.enter_tensor_region(rms_norm(x, p["final_norm"], cfg.norm_eps))
    return tensor.vocab_parallel_cross_entropy(x, p["output"], targets, cfg.vocab)


class Llama(nnx.Module):
    blocks_type: type[nnx.Module] = Blocks  # a variant (e.g. MoE) swaps in its own stacked blocks

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.param_dtype)
        self.embedding = _param(rngs, (cfg.padded_vocab, cfg.d_model), ("vocab", "embed"), dt, 1.0)
        self.blocks = self.blocks_type(cfg, rngs)
        self.final_norm = _param(rngs, (cfg.d_model,), ("norm",), dt)
        if not cfg.tie_embeddings:
            self.head = _param(rngs, (cfg.d_model, cfg.padded_vocab), ("embed", "vocab"), dt, cfg.d_model**-0.5)

    def embed(self, tokens):
        return embed_tokens(self.embedding[...], tokens)

    def output_weights(self):
        """[embed, vocab] weights of the output projection (the embedding's transpose if tied)."""
        return self.embedding[...].T if self.cfg.tie_embeddings else self.head[...]

    def head_params(self) -> dict[str, jax.Array]:
        return {"final_norm": self.final_norm[...], "output": self.output_weights()}

    def loss(self, x, targets):
        return head_loss(self.head_params(), x, targets, self.cfg)

    def __call__(self, batch, remat: Callable | None = None):
        """(mean loss, {}); under a plan with pipe > 1 the blocks run as a pipeline (jaxpar.pipeline)."""
        stages = pipeline.Stages(
            embed=embed_tokens,
            layers=functools.partial(run_layers, cfg=self.cfg, remat=remat),
            head=functools.partial(head_loss, cfg=self.cfg),
        )
        loss = pipeline.loss(
            stages, self.embedding[...], self.blocks.stacked(), self.head_params(), batch["inputs"], batch["targets"]
        )
        return loss, {}

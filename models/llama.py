"""A Llama-style decoder in Flax NNX that names every dimension logically.

Blocks are stacked along a leading `layers` axis and run with `lax.scan`, so a
pipeline can cut that axis into stages and the compiled step stays the same
size whatever the depth. The model never names a mesh axis: sharding comes
from the plan's rules through `jaxpar.parallel.constrain.constrain` and the parameters'
logical names.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import inference, layer_pattern
from jaxpar.models.block import (  # noqa: F401 (the block's arithmetic, imported from here by variants and tests)
    KV_NAMES, Q_NAMES, RESIDUAL, attention, attention_residual, block, block_norm, dense_feed_forward, mlp,
    query_key_value, residual_add, rms_norm)
from jaxpar.models.config import ACTIVATIONS, CONFIGS, ROPE_TYPES, LlamaConfig  # noqa: F401 (the model's API)
from jaxpar.parallel import tensor
from jaxpar.parallel.constrain import constrain
from jaxpar.parallel.stack import scan_layers
from jaxpar.pipeline import executor as pipeline


def _param(rngs: nnx.Rngs, shape, names, dtype, scale: float | None = None, zeros: bool = False) -> nnx.Param:
    """A parameter carrying its logical axis names (truncated-normal init; ones for norms, zeros for (1 + w) norms).

    The names are metadata for the plan (`jaxpar.train.state` places the parameters by them), never a sharding
    Flax applies itself: without `eager_sharding=False`, building a model outside a plan raises Flax's 'An auto
    mesh context or metadata is required'. Outside a plan the model is plain single-device code."""
    if scale is None:
        init = nnx.initializers.zeros if zeros else nnx.initializers.ones
    else:
        init = nnx.initializers.truncated_normal(stddev=scale)
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, dtype), eager_sharding=False)


class Blocks(nnx.Module):
    """All transformer blocks, each parameter stacked along a leading `layers` axis."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, count: int | None = None, dense_ffn: bool = True,
                 axis: str = "layers"):
        """`count` of the model's blocks (default all); `dense_ffn=False` leaves the MLP to another layer (MoE);
        `axis`: the stack's logical axis (`zero_layout.PREFIX_SCANNED` for blocks no pipeline stage cuts)."""
        n = cfg.n_layers if count is None else count
        d, h, kv, hd, f, depth = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.n_layers
        dt = jnp.dtype(cfg.param_dtype)
        s_in, s_attn, s_ff = d**-0.5, (h * hd) ** -0.5 / (2 * depth) ** 0.5, f**-0.5 / (2 * depth) ** 0.5
        norm = functools.partial(_param, rngs, (n, d), (axis, "norm"), dt, zeros=cfg.norm_plus_one)
        self.attn_norm = norm()
        self.wq = _param(rngs, (n, d, h, hd), (axis, "embed", "heads", "head_dim"), dt, s_in)
        self.wk = _param(rngs, (n, d, kv, hd), (axis, "embed", "kv_heads", "head_dim"), dt, s_in)
        self.wv = _param(rngs, (n, d, kv, hd), (axis, "embed", "kv_heads", "head_dim"), dt, s_in)
        self.wo = _param(rngs, (n, h, hd, d), (axis, "heads", "head_dim", "embed"), dt, s_attn)
        self.mlp_norm = norm()
        if cfg.post_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        if dense_ffn:
            self.w_gate = _param(rngs, (n, d, f), (axis, "embed", "mlp"), dt, s_in)
            self.w_up = _param(rngs, (n, d, f), (axis, "embed", "mlp"), dt, s_in)
            self.w_down = _param(rngs, (n, f, d), (axis, "mlp", "embed"), dt, s_ff)
        if cfg.qkv_bias:  # zero-initialised in Qwen2; small random here so that a test sees them
            self.bq = _param(rngs, (n, h, hd), (axis, "heads", "head_dim"), dt, s_in)
            self.bk = _param(rngs, (n, kv, hd), (axis, "kv_heads", "head_dim"), dt, s_in)
            self.bv = _param(rngs, (n, kv, hd), (axis, "kv_heads", "head_dim"), dt, s_in)
        if cfg.attn_sinks:
            self.sinks = _param(rngs, (n, h), (axis, "heads"), dt, 1.0)
        if cfg.attn_out_bias:
            self.bo = _param(rngs, (n, d), (axis, "embed"), dt, s_in)
        if cfg.qk_norm:
            self.q_norm = _param(rngs, (n, hd), (axis, "head_dim"), dt, zeros=cfg.norm_plus_one)
            self.k_norm = _param(rngs, (n, hd), (axis, "head_dim"), dt, zeros=cfg.norm_plus_one)

    def stacked(self) -> dict[str, jax.Array]:
        """The per-layer weights as a dict of arrays with a leading layer axis."""
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}

    def inference(self) -> tuple[dict[str, jax.Array], Callable]:
        """(per-layer weights, feed_forward(p, x, cfg)) for `inference_layers`; a variant's blocks give their own."""
        return self.stacked(), dense_feed_forward


def run_layers(stacked: dict[str, jax.Array], x, cfg: LlamaConfig, remat: Callable | None = None):
    """Run `block` over the leading layer axis of `stacked` (a stage's or all layers) with `jaxpar.scan_layers`.

    `remat` defaults to the active plan's policy; under ZeRO-2/3 each layer's
    parameters are gathered inside the scan, just before the block uses them.
    """
    if cfg.sliding_pattern > 1:  # local and global layers: windows are static per layer (models.layer_pattern)
        return layer_pattern.run_groups(block, stacked, x, cfg, remat)
    return scan_layers(lambda p, h: block(p, h, cfg), stacked, x, remat=remat)


def embed_tokens(table, tokens, cfg: LlamaConfig | None = None):
    """The tokens' rows, times sqrt(d_model) under `embed_scale` (cast to the rows' dtype first, as Gemma does)."""
    rows = tensor.embedding_lookup(tokens, table)
    if cfg is not None and cfg.embed_scale:
        rows = rows * jnp.asarray(cfg.d_model**0.5, jnp.float32).astype(rows.dtype)
    return constrain(rows, RESIDUAL)


def head_loss(p, x, targets, cfg: LlamaConfig):
    """Mean next-token cross-entropy from the last hidden state; logits stay vocab-sharded (and soft-capped per shard)."""
    x = tensor.enter_tensor_region(block_norm(x, p["final_norm"], cfg))
    return tensor.vocab_parallel_cross_entropy(x, p["output"], targets, cfg.vocab, softcap=cfg.final_softcap)


class Llama(nnx.Module):
    blocks_type: type[nnx.Module] = Blocks  # a variant (e.g. MoE) swaps in its own stacked blocks

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.param_dtype)
        self.embedding = _param(rngs, (cfg.padded_vocab, cfg.d_model), ("vocab", "embed"), dt, 1.0)
        self.blocks = self.blocks_type(cfg, rngs)
        self.final_norm = _param(rngs, (cfg.d_model,), ("norm",), dt, zeros=cfg.norm_plus_one)
        if not cfg.tie_embeddings:
            self.head = _param(rngs, (cfg.d_model, cfg.padded_vocab), ("embed", "vocab"), dt, cfg.d_model**-0.5)

    def embed(self, tokens):
        return embed_tokens(self.embedding[...], tokens, self.cfg)

    def output_weights(self):
        """[embed, vocab] weights of the output projection (the embedding's transpose if tied)."""
        return self.embedding[...].T if self.cfg.tie_embeddings else self.head[...]

    def head_params(self) -> dict[str, jax.Array]:
        return {"final_norm": self.final_norm[...], "output": self.output_weights()}

    def loss(self, x, targets):
        return head_loss(self.head_params(), x, targets, self.cfg)

    def logits(self, tokens, positions=None, mask=None, segment_ids=None):
        """Logits [batch, seq, vocab] with positions, a padding mask, packed documents (see `inference.llama_logits`)."""
        return inference.llama_logits(self, tokens, positions, mask, segment_ids)

    def init_cache(self, batch: int, slots: int, dtype=jnp.float32) -> dict:
        """An empty cache for `decode` (`inference.init_cache`); a variant with another attention gives its own."""
        return inference.init_cache(self.cfg, batch, slots, dtype)

    def decode(self, tokens, cache: dict, mask=None, positions=None, segment_ids=None):
        """(logits, cache) for tokens appended to a KV cache (see `inference.init_cache`, `inference.llama_decode`)."""
        return inference.llama_decode(self, tokens, cache, mask, positions, segment_ids)

    def __call__(self, batch, remat: Callable | None = None):
        """(mean loss, {}); under a plan with pipe > 1 the blocks run as a pipeline (jaxpar.pipeline.executor)."""
        stages = pipeline.Stages(
            embed=functools.partial(embed_tokens, cfg=self.cfg),
            layers=functools.partial(run_layers, cfg=self.cfg, remat=remat),
            head=functools.partial(head_loss, cfg=self.cfg),
        )
        loss = pipeline.loss(
            stages, self.embedding[...], self.blocks.stacked(), self.head_params(), batch["inputs"], batch["targets"]
        )
        return loss, {}

"""A Llama-style decoder in Flax NNX that names every dimension logically.

Blocks are stacked along a leading `layers` axis and run with `lax.scan`, so a
pipeline can cut that axis into stages and the compiled step stays the same
size whatever the depth. The model never names a mesh axis: sharding comes
from the plan's rules through `jaxpar.parallel.constrain.constrain` and the parameters'
logical names.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import layer_pattern
from jaxpar.models.layer_pattern import layer_config, layer_window  # noqa: F401 (the families' API)
from jaxpar.models.rotary import rope_frequencies, rotary
from jaxpar.parallel import attention as attention_lib
from jaxpar.parallel import attention_math
from jaxpar.parallel import tensor
from jaxpar.parallel.constrain import constrain
from jaxpar.parallel.stack import scan_layers
from jaxpar.parallel.vocab import softcap
from jaxpar.pipeline import executor as pipeline

ROPE_TYPES = ("default", "llama3")
# the MLP's gate activation: SiLU (SwiGLU: Llama, Qwen, Mistral) or GELU's tanh approximation (GeGLU: Gemma)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


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
    # Rotary scaling: "default" (none) or "llama3" (Llama 3.1's wavelength-dependent frequency scaling).
    rope_type: str = "default"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # Family options (default off: a Llama). qkv_bias: biases on the q/k/v projections (Qwen2);
    # qk_norm: an RMSNorm over head_dim on each query and key head before the rotation (Qwen3).
    qkv_bias: bool = False
    qk_norm: bool = False
    # Gemma: mlp_activation="gelu_tanh"; norm_plus_one: every RMSNorm scales by (1 + w), w stored as Gemma stores it;
    # embed_scale: embeddings times sqrt(d_model) in the compute dtype. Gemma 2 adds post_norms (an RMSNorm on the
    # attention's and the MLP's outputs before each residual add) and final_softcap (logits = c * tanh(logits / c)).
    mlp_activation: str = "silu"
    norm_plus_one: bool = False
    embed_scale: bool = False
    post_norms: bool = False
    final_softcap: float | None = None
    # Attention options (default off). sliding_window W: a local layer's query sees the W latest keys, itself
    # included (Mistral, Gemma 2); sliding_pattern P: with a window, every layer is local (P = 1, Mistral) or
    # layer i is global when (i + 1) % P == 0 and local otherwise (P = 2: Gemma 2's alternation);
    # attn_softcap c: scores -> c * tanh(scores / c) (Gemma 2's attn_logit_softcapping); query_scale: the
    # multiplier of q . k, None for head_dim ** -0.5 (Gemma 2: query_pre_attn_scalar ** -0.5).
    sliding_window: int | None = None
    sliding_pattern: int = 1
    attn_softcap: float | None = None
    query_scale: float | None = None

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1, got {self.vocab_multiple}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.mlp_activation not in ACTIVATIONS:
            raise ValueError(f"mlp_activation must be one of {tuple(ACTIVATIONS)}, got {self.mlp_activation!r}")
        if self.final_softcap is not None and not self.final_softcap > 0:
            raise ValueError(f"final_softcap must be None or > 0, got {self.final_softcap}")
        layer_pattern.check(self)

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
        block += hd * (h + 2 * kv) * self.qkv_bias + 2 * hd * self.qk_norm + 2 * d * self.post_norms
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


def _param(rngs: nnx.Rngs, shape, names, dtype, scale: float | None = None, zeros: bool = False) -> nnx.Param:
    """A parameter carrying its logical axis names (truncated-normal init; ones for norms, zeros for (1 + w) norms)."""
    if scale is None:
        init = nnx.initializers.zeros if zeros else nnx.initializers.ones
    else:
        init = nnx.initializers.truncated_normal(stddev=scale)
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, dtype))


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


def query_key_value(p, x, cfg: LlamaConfig, positions=None, replicate_kv: bool = True):
    """q, k, v of x: the projections, the family's biases and per-head norms, then the rotation at `positions`.

    `positions` None: training's, those of q's whole sequence in jaxpar.parallel.attention's order.

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
        q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
    positions = attention_lib.positions(q.shape[1]) if positions is None else positions
    inv_freq = rope_frequencies(cfg, q.shape[-1])
    return rotary(q, positions, cfg.rope_theta, inv_freq), rotary(k, positions, cfg.rope_theta, inv_freq), v


def attention(p, x, cfg: LlamaConfig):
    """Causal grouped-query attention (jaxpar.parallel.attention: split over `context` too); heads over the `heads` axes."""
    # q holds the whole sequence (under sequence parallelism x may hold a shard of it), in the order
    # jaxpar.parallel.attention keeps it (load-balanced under context parallelism): positions say which is which.
    q, k, v = query_key_value(p, x, cfg, positions=None)
    out = constrain(attention_lib.causal_attention(q, k, v, **layer_pattern.attention_options(cfg)), Q_NAMES)
    return tensor.row_parallel(out, p["wo"], "bshk,hkd->bsd", Q_NAMES)


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


class Blocks(nnx.Module):
    """All transformer blocks, each parameter stacked along a leading `layers` axis."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, count: int | None = None, dense_ffn: bool = True):
        """`count` of the model's blocks (default all); `dense_ffn=False` leaves the MLP to another layer (MoE)."""
        n = cfg.n_layers if count is None else count
        d, h, kv, hd, f, depth = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.n_layers
        dt = jnp.dtype(cfg.param_dtype)
        s_in, s_attn, s_ff = d**-0.5, (h * hd) ** -0.5 / (2 * depth) ** 0.5, f**-0.5 / (2 * depth) ** 0.5
        norm = functools.partial(_param, rngs, (n, d), ("layers", "norm"), dt, zeros=cfg.norm_plus_one)
        self.attn_norm = norm()
        self.wq = _param(rngs, (n, d, h, hd), ("layers", "embed", "heads", "head_dim"), dt, s_in)
        self.wk = _param(rngs, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), dt, s_in)
        self.wv = _param(rngs, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), dt, s_in)
        self.wo = _param(rngs, (n, h, hd, d), ("layers", "heads", "head_dim", "embed"), dt, s_attn)
        self.mlp_norm = norm()
        if cfg.post_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        if dense_ffn:
            self.w_gate = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dt, s_in)
            self.w_up = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dt, s_in)
            self.w_down = _param(rngs, (n, f, d), ("layers", "mlp", "embed"), dt, s_ff)
        if cfg.qkv_bias:  # zero-initialised in Qwen2; small random here so that a test sees them
            self.bq = _param(rngs, (n, h, hd), ("layers", "heads", "head_dim"), dt, s_in)
            self.bk = _param(rngs, (n, kv, hd), ("layers", "kv_heads", "head_dim"), dt, s_in)
            self.bv = _param(rngs, (n, kv, hd), ("layers", "kv_heads", "head_dim"), dt, s_in)
        if cfg.qk_norm:
            self.q_norm = _param(rngs, (n, hd), ("layers", "head_dim"), dt)
            self.k_norm = _param(rngs, (n, hd), ("layers", "head_dim"), dt)

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

    def logits(self, tokens, positions=None, mask=None):
        """Logits [batch, seq, vocab] with positions and a padding mask (see `llama_logits`)."""
        return llama_logits(self, tokens, positions, mask)

    def decode(self, tokens, cache: dict, mask=None, positions=None):
        """(logits, cache) for tokens appended to a KV cache (see `init_cache`, `llama_decode`)."""
        return llama_decode(self, tokens, cache, mask, positions)

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


# -- inference: logits with positions and a padding mask, and a KV cache -------------------------------------------
# Separate from the training path (which runs through jaxpar.pipeline.executor): one forward over the stacked layers that
# takes explicit positions, a key padding mask and, while generating, a key/value cache it updates in place.

CACHE = ("layers", "batch", "seq", "kv_heads", "head_dim")


def init_cache(cfg: LlamaConfig, batch: int, slots: int, dtype=jnp.float32) -> dict[str, jax.Array]:
    """An empty KV cache for `batch` sequences of up to `slots` tokens.

    k, v: [layers, batch, slots, kv_heads, head_dim]; mask: which slots hold a
    real token; length: real tokens per sequence (the next position); index: the
    next slot to write (the same for every sequence: prompts are left-padded).
    """
    shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.head_dim)
    return {
        "k": constrain(jnp.zeros(shape, dtype), CACHE), "v": constrain(jnp.zeros(shape, dtype), CACHE),
        "mask": jnp.zeros((batch, slots), bool), "length": jnp.zeros((batch,), jnp.int32),
        "index": jnp.zeros((), jnp.int32),
    }


def cached_attention(p, x, cfg: LlamaConfig, positions, key_mask, kv=None, index=None, window=None):
    """Causal GQA attention of x's tokens at `positions` ([batch, seq]); keys where `key_mask` is False are ignored.

    Without `kv` the keys are x's own tokens (key_mask [batch, seq]). With
    kv = (k, v) [batch, slots, kv_heads, head_dim] the new keys and values are
    written at slots index..index+seq and the queries attend to every earlier
    slot (key_mask [batch, slots]). `window` (None: global; an int or a traced
    scalar, see `layer_pattern.layer_window`) hides keys W or more slots older than the query,
    as Hugging Face measures it (cache positions: left padding counts). cfg's
    soft cap and query scale apply. Returns (output, (k, v)).
    """
    q, k, v = query_key_value(p, x, cfg, positions, replicate_kv=False)
    b, s = q.shape[:2]  # the whole sequence: under sequence parallelism x may hold a shard of it
    query_slots = jnp.arange(s)
    if kv is not None:
        k = constrain(jax.lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), (0, index, 0, 0)), KV_NAMES)
        v = constrain(jax.lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), (0, index, 0, 0)), KV_NAMES)
        query_slots = query_slots + index
    allowed = jnp.arange(k.shape[1])[None, :] <= query_slots[:, None]
    if window is not None:
        allowed = allowed & (query_slots[:, None] - jnp.arange(k.shape[1])[None, :] < window)
    allowed = allowed[None] & key_mask[:, None, :]
    kv_heads = k.shape[2]
    scoring = attention_math.Scoring(softcap=cfg.attn_softcap, scale=cfg.query_scale)
    scores = attention_math.raw_scores(q, k.astype(q.dtype), scoring)
    q = q.reshape(b, s, kv_heads, q.shape[2] // kv_heads, q.shape[3])
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bngqs,bsnk->bqngk", weights, v).reshape(b, s, -1, q.shape[-1]).astype(x.dtype)
    out = constrain(out, Q_NAMES)
    return tensor.row_parallel(out, p["wo"], "bshk,hkd->bsd", Q_NAMES), (k, v)


def inference_layers(stacked, x, cfg: LlamaConfig, positions, key_mask, cache=None, index=None, feed_forward=None):
    """Scan the blocks over the layer axis for inference; returns (x, (k, v) of every layer).

    `feed_forward(p, x, cfg)` is the blocks' (`Blocks.inference`; default the dense MLP).
    """
    feed_forward = dense_feed_forward if feed_forward is None else feed_forward

    windows = layer_pattern.layer_windows(cfg)

    def body(h, layer):
        p, kv, *window = layer
        attn, kv = cached_attention(p, tensor.enter_tensor_region(block_norm(h, p["attn_norm"], cfg)),
                                    cfg, positions, key_mask, kv, index, *window)
        h = residual_add(p, h, attn, "post_attn_norm", cfg)
        out = feed_forward(p, tensor.enter_tensor_region(block_norm(h, p["mlp_norm"], cfg)), cfg)
        return residual_add(p, h, out, "post_mlp_norm", cfg), kv

    return jax.lax.scan(body, x, (stacked, cache, *windows))


def padded_positions(mask):
    """Positions of left- (or right-) padded rows: 0, 1, ... counting real tokens only; padding gets 0 or the last."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)


def _logits_of(model: "Llama", x):
    x = block_norm(x, model.final_norm[...], model.cfg)
    logits = softcap(jnp.einsum("bsd,dv->bsv", x, model.output_weights()).astype(jnp.float32), model.cfg.final_softcap)
    return constrain(logits, ("batch", "seq", "vocab"))[..., : model.cfg.vocab]


def _inference_blocks(model: "Llama") -> tuple[dict[str, jax.Array], Callable]:
    """The blocks' per-layer weights and feed-forward layer for inference (see `Blocks.inference`)."""
    if attention_lib.context_ways() > 1:
        raise ValueError("inference (logits, decode) does not run context-parallel; use a plan with context=1")
    if not hasattr(model.blocks, "inference"):
        raise ValueError(f"inference (logits, decode) is not defined for blocks of type {type(model.blocks).__name__}")
    return model.blocks.inference()


def llama_logits(model: "Llama", tokens, positions=None, mask=None):
    """Logits [batch, seq, vocab] (float32, padding columns dropped) of tokens [batch, seq].

    `mask` [batch, seq] marks real tokens (False: padding, which no token
    attends to); `positions` default to the count of real tokens before each one,
    so left-padded prompts get the positions they would have alone.
    """
    stacked, feed_forward = _inference_blocks(model)
    mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
    positions = padded_positions(mask) if positions is None else positions
    positions = jnp.broadcast_to(positions, tokens.shape)
    x, _ = inference_layers(stacked, model.embed(tokens), model.cfg, positions, mask, feed_forward=feed_forward)
    return _logits_of(model, x)


def llama_decode(model: "Llama", tokens, cache: dict, mask=None, positions=None):
    """(logits [batch, seq, vocab], updated cache) for tokens [batch, seq] appended to the cache (see init_cache)."""
    stacked, feed_forward = _inference_blocks(model)
    mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
    if positions is None:
        positions = cache["length"][:, None] + padded_positions(mask)
    index = cache["index"]
    key_mask = jax.lax.dynamic_update_slice(cache["mask"], mask, (0, index))
    x, (k, v) = inference_layers(stacked, model.embed(tokens), model.cfg, positions, key_mask,
                                 (cache["k"], cache["v"]), index, feed_forward)
    cache = {"k": constrain(k, CACHE), "v": constrain(v, CACHE), "mask": key_mask,
             "length": cache["length"] + mask.sum(axis=1).astype(jnp.int32), "index": index + tokens.shape[1]}
    return _logits_of(model, x), cache


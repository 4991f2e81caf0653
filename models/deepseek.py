"""DeepSeek-V3: multi-head latent attention (`models.latent_attention`) in every block, the first `first_dense`
blocks with a dense SwiGLU MLP and the others with DeepSeekMoE.

DeepSeekMoE (jaxpar.parallel.experts with score="sigmoid"): each token's top-k experts are chosen by their sigmoid
scores plus a per-expert correction (`router_correction`, DeepSeek's e_score_correction_bias), among the best
`router_topk_groups` of `router_groups` groups; the gates are the chosen sigmoids (renormalised under `norm_topk`)
times `routed_scale`; a shared expert, one SwiGLU of `n_shared_experts * expert_d_ff`, is added to every token's
output. The correction enters only the choice, so it gets no gradient; with `router_bias_update` = gamma > 0 (DeepSeek
used 0.001) the train step moves it after each update by DeepSeek's auxiliary-loss-free balance,
+gamma * sign(mean load - load) per layer and expert over the step's whole batch (`after_step`); 0 keeps it as
imported, as transformers does.

The dense and the MoE blocks are two stacks, each scanned. The pipeline cuts the MoE stack; the dense blocks run
with the embedding, before the first stage (`embed_and_dense`). Their cost under pipe > 1: every stage holds the
dense blocks' weights (not cut over `pipe`, like the embedding), stage 0 runs their forward and backward for each
microbatch on top of its own blocks (the published DeepSeek-V3's 3 of 61 blocks: about 3 / (58 / pipe) more work
there), and the other stages compute the forward the executor selects away, as they do the embedding's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core import trace, zero_layout
from jaxpar.models import latent_attention, latent_cache, llama, moe
from jaxpar.models.block import RESIDUAL, block_norm, mlp, residual_add
from jaxpar.parallel import experts, tensor
from jaxpar.parallel.constrain import constrain
from jaxpar.parallel.stack import scan_layers
from jaxpar.pipeline import executor as pipeline


@dataclasses.dataclass(frozen=True)
class DeepseekConfig(moe.MoeLlamaConfig):
    """An MoE Llama config whose attention is MLA and whose experts route as DeepSeek-V3's (see the module)."""

    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    moe_every: int = 1
    dropless: bool = True
    load_balance_coef: float = 0.0
    shared_expert: bool = True
    expert_d_ff: int = 32
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 24
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 12
    first_dense: int = 1
    n_shared_experts: int = 1
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scale: float = 1.0
    norm_topk: bool = True
    router_bias_update: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        latent_attention.check(self)
        if self.router_bias_update < 0:
            raise ValueError(f"router_bias_update={self.router_bias_update} must be >= 0 (0: the correction stays)")
        if self.moe_every != 1:
            raise ValueError(f"moe_every={self.moe_every}: DeepSeek-V3's MoE blocks follow its first_dense dense ones "
                             "(moe_every=1)")
        unsupported = {name: getattr(self, name) for name, off in (
            ("qkv_bias", False), ("qk_norm", False), ("post_norms", False), ("attn_sinks", False),
            ("sliding_window", None), ("attention_chunk", None), ("expert_bias", False),
            ("sigmoid_input_gate", False)) if getattr(self, name) != off}
        if unsupported:
            raise ValueError(f"{unsupported}: DeepSeek-V3's latent attention and experts take none of these options")

    @property
    def moe(self) -> experts.MoEConfig:
        return dataclasses.replace(super().moe, score="sigmoid", normalize=self.norm_topk,
                                   routed_scale=self.routed_scale, n_groups=self.router_groups,
                                   topk_groups=self.router_topk_groups)

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.first_dense

    @property
    def shared_d_ff(self) -> int:
        return self.n_shared_experts * self.expert_d_ff

    def param_count(self) -> int:
        d, e, fe, v = self.d_model, self.n_experts, self.expert_d_ff, self.padded_vocab
        per_layer = latent_attention.latent_param_count(self) + 2 * d
        moe_ffn = d * e + e + 3 * e * d * fe + 3 * d * self.shared_d_ff
        return (self.n_layers * per_layer + self.first_dense * 3 * d * self.d_ff + self.n_moe_layers * moe_ffn
                + v * d * (1 if self.tie_embeddings else 2) + d)

    def active_param_count(self) -> int:
        """The parameters one token uses: every expert's weights counted only for the top_k it is routed to."""
        unused = (self.n_experts - self.top_k) * 3 * self.d_model * self.expert_d_ff
        return self.param_count() - self.n_moe_layers * unused


CONFIGS: dict[str, DeepseekConfig] = {
    "deepseek-tiny": DeepseekConfig(),
    # DeepSeek-V3's published shape (deepseek-ai/DeepSeek-V3, its multi-token prediction module left out): 61 blocks,
    # the first 3 dense; top-8 of 256 experts in 4 of 8 groups plus one shared; YaRN factor 40 over 4096 positions
    "deepseek-v3": DeepseekConfig(vocab=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                                  head_dim=64, d_ff=18432, expert_d_ff=2048, n_experts=256, top_k=8, seq_len=4096,
                                  norm_eps=1e-6, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                  qk_rope_head_dim=64, v_head_dim=128, first_dense=3, n_shared_experts=1,
                                  router_groups=8, router_topk_groups=4, routed_scale=2.5, rope_type="yarn",
                                  rope_factor=40.0, rope_original_max_position=4096, rope_attention_factor=1.0,
                                  query_scale=192**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2),
}


class DeepseekLayers(nnx.Module):
    """`count` stacked DeepSeek blocks: norms, MLA, then a dense MLP or (`experts_ffn`) the router, experts and
    shared expert."""

    def __init__(self, cfg: DeepseekConfig, rngs: nnx.Rngs, count: int, experts_ffn: bool):
        n, d, e, fe, f = count, cfg.d_model, cfg.n_experts, cfg.expert_d_ff, cfg.d_ff
        dt = jnp.dtype(cfg.param_dtype)
        param = functools.partial(llama._param, rngs)

        def build(shape, names, scale=None):  # the dense blocks' stack is no pipeline's `layers`: not cut over pipe
            return param(shape, names if experts_ffn else (zero_layout.PREFIX_SCANNED, *names[1:]), dt, scale)

        self.attn_norm = build((n, d), ("layers", "norm"))
        for name, value in latent_attention.latent_params(cfg, rngs, n, build).items():
            setattr(self, name, value)
        self.mlp_norm = build((n, d), ("layers", "norm"))
        s_in, s_out = d**-0.5, (2 * cfg.n_layers) ** -0.5
        if not experts_ffn:
            self.w_gate = build((n, d, f), ("layers", "embed", "mlp"), s_in)
            self.w_up = build((n, d, f), ("layers", "embed", "mlp"), s_in)
            self.w_down = build((n, f, d), ("layers", "mlp", "embed"), f**-0.5 * s_out)
            return
        hidden = ("layers", "experts", "embed", "expert_mlp")
        self.router = build((n, d, e), ("layers", "embed", None), s_in)
        self.router_correction = build((n, e), ("layers", None), 0.1)  # zero in DeepSeek's init; random: tests see it
        self.expert_gate = build((n, e, d, fe), hidden, s_in)
        self.expert_up = build((n, e, d, fe), hidden, s_in)
        self.expert_down = build((n, e, fe, d), ("layers", "experts", "expert_mlp", "embed"), fe**-0.5 * s_out)
        fs = cfg.shared_d_ff
        self.shared_gate = build((n, d, fs), ("layers", "embed", "mlp"), s_in)
        self.shared_up = build((n, d, fs), ("layers", "embed", "mlp"), s_in)
        self.shared_down = build((n, fs, d), ("layers", "mlp", "embed"), fs**-0.5 * s_out)

    def stacked(self) -> dict[str, jax.Array]:
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


class DeepseekBlocks(nnx.Module):
    """The first `first_dense` blocks (dense MLP), then the MoE blocks: two stacks."""

    def __init__(self, cfg: DeepseekConfig, rngs: nnx.Rngs):
        self.dense = DeepseekLayers(cfg, rngs, cfg.first_dense, experts_ffn=False) if cfg.first_dense else None
        self.moe = DeepseekLayers(cfg, rngs, cfg.n_moe_layers, experts_ffn=True)

    def stacked(self) -> dict[str, dict[str, jax.Array]]:
        moe_layers = {"moe": self.moe.stacked()}
        return moe_layers if self.dense is None else {"dense": self.dense.stacked(), **moe_layers}


def attention_residual(p, x, cfg: DeepseekConfig):
    """x + MLA(norm(x))."""
    h = tensor.enter_tensor_region(block_norm(x, p["attn_norm"], cfg))
    return residual_add(p, x, latent_attention.latent_attention(p, h, cfg), "post_attn_norm", cfg)


def dense_block(p, x, cfg: DeepseekConfig):
    """One of the first blocks: MLA, then the dense SwiGLU MLP."""
    x = attention_residual(p, x, cfg)
    return constrain(x + mlp(p, tensor.enter_tensor_region(block_norm(x, p["mlp_norm"], cfg))), RESIDUAL)


def moe_block(p, x, cfg: DeepseekConfig, moe_layer: moe.MoeLayer = experts.moe_ffn):
    """MLA, then the routed experts plus the shared expert: (residual stream, the layer's routing statistics)."""
    x = attention_residual(p, x, cfg)
    h = tensor.enter_tensor_region(block_norm(x, p["mlp_norm"], cfg))
    y, stats = moe_layer(p, h, cfg.moe)
    return constrain(x + moe.with_shared_expert(p, h, cfg, y), RESIDUAL), stats


def run_layers(stacked, x, cfg: DeepseekConfig, remat: Callable | None = None,
               moe_layer: moe.MoeLayer = experts.moe_ffn):
    """The dense stack, then the MoE stack, each scanned: (x, statistics stacked per MoE block)."""
    if "dense" in stacked:
        x = scan_layers(lambda p, h: dense_block(p, h, cfg), stacked["dense"], x, remat=remat)
    x, stats = scan_layers(lambda p, h: moe_block(p, h, cfg, moe_layer), stacked["moe"], x, remat=remat)
    if cfg.router_bias_update:  # each layer's loads, for `DeepseekV3.after_step`
        stats = {**stats, "expert_load": experts.per_layer_rows(stats["expert_share"])}
    return x, stats


def check_plan(cfg: DeepseekConfig) -> None:
    """ValueError for a plan this model cannot run on: the balance under a pipeline."""
    plan = trace.active_plan()
    if plan is not None and plan.shape["pipe"] > 1 and cfg.router_bias_update:
        raise ValueError(f"router_bias_update={cfg.router_bias_update} with pipe={plan.shape['pipe']}: the balance "
                         "needs each layer's loads, and a pipeline's stages hand back their layers' sum")


def embed_and_dense(params, tokens, cfg: DeepseekConfig, remat: Callable | None = None):
    """The embedding's rows, then the dense blocks (`params["dense"]`, where the model has them): the pipeline's
    input to its first stage, so that the stages cut only the MoE blocks."""
    x = llama.embed_tokens(params["table"], tokens)
    if "dense" in params:
        x = scan_layers(lambda p, h: dense_block(p, h, cfg), params["dense"], x, remat=remat)
    return x


class DeepseekV3(moe.MoeLlama):
    blocks_type = DeepseekBlocks
    run_blocks = staticmethod(run_layers)

    def __call__(self, batch, remat: Callable | None = None, moe_layer: moe.MoeLayer = experts.moe_ffn):
        """(cross-entropy + the routers' auxiliary losses, metrics), as `models.moe.MoeLlama`'s; a pipeline over
        `pipe` cuts the MoE blocks, the dense ones running with the embedding (`embed_and_dense`)."""
        check_plan(self.cfg)
        stacked = self.blocks.stacked()
        stages = pipeline.Stages(
            embed=functools.partial(embed_and_dense, cfg=self.cfg, remat=remat),
            layers=functools.partial(run_layers, cfg=self.cfg, remat=remat, moe_layer=moe_layer),
            head=functools.partial(llama.head_loss, cfg=self.cfg),
            aux_loss=experts.aux_loss,
        )
        embed_params = {"table": self.embedding[...], **({"dense": stacked["dense"]} if "dense" in stacked else {})}
        loss, sums = pipeline.loss(stages, embed_params, {"moe": stacked["moe"]}, self.head_params(),
                                   batch["inputs"], batch["targets"])
        aux_loss, metrics = experts.summarize(sums, self.cfg.n_moe_layers)
        return loss, {"ce_loss": loss - aux_loss, **metrics}

    def after_step(self, params: dict, metrics: dict, batch: dict) -> dict:
        """`params` with each MoE layer's router correction moved by the step's loads (`experts.rebalanced`, the
        whole global batch's); as they are when `router_bias_update` is 0. The train step calls this after its update."""
        if not self.cfg.router_bias_update:
            return params
        moe_params = params["blocks"]["moe"]
        moved = experts.rebalanced(moe_params[experts.CORRECTION], metrics["expert_load"], self.cfg.router_bias_update,
                                   batch["inputs"].size * self.cfg.top_k)
        return {**params, "blocks": {**params["blocks"], "moe": {**moe_params, experts.CORRECTION: moved}}}

    def logits(self, tokens, positions=None, mask=None, segment_ids=None):
        """Logits [batch, seq, vocab] with positions and a padding mask (see `latent_cache.deepseek_logits`)."""
        return latent_cache.deepseek_logits(self, tokens, positions, mask, segment_ids)

    def init_cache(self, batch: int, slots: int, dtype=jnp.float32) -> dict:
        """An empty cache of MLA's compressed tokens (`latent_cache.init_cache`)."""
        return latent_cache.init_cache(self.cfg, batch, slots, dtype)

    def decode(self, tokens, cache: dict, mask=None, positions=None, segment_ids=None):
        """(logits, cache) for tokens appended to the compressed cache (see `latent_cache.deepseek_decode`)."""
        return latent_cache.deepseek_decode(self, tokens, cache, mask, positions, segment_ids)

"""The reference Llama with a mixture-of-experts feed-forward layer in every `moe_every`-th block.

Blocks come in groups of `moe_every`: `moe_every - 1` dense Llama blocks, then
one block whose MLP is `jaxpar.parallel.experts.moe_ffn` (or, with `moe_pattern`, any
kinds in any order: dense layers wherever a Qwen3-MoE's `mlp_only_layers` puts them,
`models.moe_layout`). Groups are stacked along the `layers` axis and scanned, like the
dense model's blocks, so the compiled step stays the same size whatever the depth; a
pattern of no period is one group, its runs of blocks scanned one after another
(`run_apart`). The first `first_dense` blocks may be dense ones before the groups (a
Qwen3-MoE's `mlp_only_layers=[0]`): a stack of their own along `zero_layout.PREFIX_SCANNED`,
run with the embedding as DeepSeek-V3's first dense blocks are (`models.deepseek`): before a
pipeline's first stage, on every stage. The loss adds the routers' auxiliary losses, and
the aux dict carries the routing metrics. With local/global layers (`sliding_pattern` P)
the groups are scanned a pattern of P / moe_every groups at a time (`run_patterns`);
inference scans the groups too (`MoeBlocks.inference`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core import zero_layout
from jaxpar.core.trace import active_plan
from jaxpar.models import layer_pattern, llama, moe_layout
from jaxpar.models.block import dense_feed_forward
from jaxpar.parallel import experts, tensor, zero
from jaxpar.parallel.constrain import constrain
from jaxpar.parallel.stack import scan_layers
from jaxpar.pipeline import executor as pipeline

MoeLayer = Callable[[dict, jax.Array, experts.MoEConfig], tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class MoeLlamaConfig(llama.LlamaConfig):
    """A LlamaConfig plus the experts (see jaxpar.parallel.experts.MoEConfig for the routing fields)."""

    n_experts: int = 8
    top_k: int = 2
    moe_every: int = 2
    expert_d_ff: int = 128
    capacity_factor: float = 1.25
    dropless: bool = False
    group_size: int | None = None
    load_balance_coef: float = 1e-2
    router_z_coef: float = 0.0
    # Llama 4: shared_expert, a dense SwiGLU MLP of expert_d_ff added to the routed output of every MoE layer;
    # sigmoid_input_gate, its top-1 routing (see experts.MoEConfig)
    shared_expert: bool = False
    sigmoid_input_gate: bool = False
    # gpt-oss: biases on the router and the experts' projections, and its clamped SwiGLU (experts.MoEConfig)
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    first_dense: int = 0  # dense blocks before the groups (their own stack, run with the embedding)
    # one group's moe_every blocks in order, D dense and M MoE (e.g. "MDMDMM": a Qwen3-MoE's mlp_only_layers
    # anywhere, `models.moe_layout`); "" for moe_every - 1 dense blocks, then one MoE block
    moe_pattern: str = ""

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.first_dense < self.n_layers:
            raise ValueError(f"first_dense={self.first_dense} must be between 0 and n_layers - 1={self.n_layers - 1}")
        if self.moe_every < 1 or (self.n_layers - self.first_dense) % self.moe_every:
            after = f" less first_dense={self.first_dense}" if self.first_dense else ""
            raise ValueError(f"moe_every={self.moe_every} must be >= 1 and divide n_layers={self.n_layers}{after}")
        if self.first_dense and self.sliding_pattern > 1:
            raise ValueError(f"first_dense={self.first_dense} with sliding_pattern={self.sliding_pattern}: dense "
                             "blocks before the MoE groups take no local/global layer pattern")
        if self.moe_pattern:
            moe_layout.check(self.moe_pattern, self.moe_every)
            if self.moe_pattern == moe_layout.classic(self.moe_every):  # one spelling of each layout
                object.__setattr__(self, "moe_pattern", "")
        if self.moe_pattern and self.sliding_pattern > 1:
            raise ValueError(f"moe_pattern={self.moe_pattern!r} with sliding_pattern={self.sliding_pattern}: a "
                             "pattern of dense and MoE blocks takes no local/global layer pattern")
        self.moe.group(self.seq_len)

    @property
    def moe(self) -> experts.MoEConfig:
        return experts.MoEConfig(
            n_experts=self.n_experts, top_k=self.top_k, capacity_factor=self.capacity_factor,
            dropless=self.dropless, group_size=self.group_size,
            load_balance_coef=self.load_balance_coef, router_z_coef=self.router_z_coef,
            sigmoid_input_gate=self.sigmoid_input_gate,
            activation=self.expert_activation, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha,
        )

    @property
    def n_moe_layers(self) -> int:
        return moe_layout.kinds(self).count("M")

    def param_count(self) -> int:
        d, e, fe, n_moe = self.d_model, self.n_experts, self.expert_d_ff, self.n_moe_layers
        dense_mlp = 3 * d * self.d_ff
        biases = (e + 2 * e * fe + e * d) * self.expert_bias
        return (super().param_count() - n_moe * dense_mlp
                + n_moe * (d * e + 3 * (e + self.shared_expert) * d * fe + biases))


CONFIGS: dict[str, MoeLlamaConfig] = {
    "moe-tiny": MoeLlamaConfig(),
    "moe-small": MoeLlamaConfig(d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=768,
                                expert_d_ff=384, n_experts=16, seq_len=256),
    # Mixtral 8x7B's published shape: an MoE feed-forward in every block, dropless top-2 of 8 (d_ff: the experts')
    "mixtral-8x7b": MoeLlamaConfig(vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                                   d_ff=14336, expert_d_ff=14336, n_experts=8, top_k=2, moe_every=1, dropless=True,
                                   seq_len=4096, rope_theta=1e6),
    # Qwen3-30B-A3B's (Qwen/Qwen3-30B-A3B): Qwen3 blocks (q/k norms), dropless top-8 of 128 experts in every block
    "qwen3-30b-a3b": MoeLlamaConfig(vocab=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                                    d_ff=6144, expert_d_ff=768, n_experts=128, top_k=8, moe_every=1, dropless=True,
                                    seq_len=4096, rope_theta=1e6, norm_eps=1e-6, qk_norm=True),
    # Llama 4 Scout's text model (meta-llama/Llama-4-Scout-17B-16E): top-1 of 16 experts plus a shared one in every
    # block; 3 of 4 layers rotate (llama3-scaled), attend in 8192-token chunks and L2-norm q/k, every 4th is NoPE
    # with query temperature
    "llama4-scout": MoeLlamaConfig(vocab=202048, vocab_multiple=64, d_model=5120, n_layers=48, n_heads=40,
                                   n_kv_heads=8, head_dim=128, d_ff=16384, expert_d_ff=8192, n_experts=16, top_k=1,
                                   moe_every=1, dropless=True, load_balance_coef=0.0, shared_expert=True,
                                   sigmoid_input_gate=True, seq_len=8192, rope_theta=5e5, rope_type="llama3",
                                   rope_factor=16.0, rope_low_freq_factor=1.0, rope_high_freq_factor=1.0,
                                   rope_original_max_position=8192, sliding_pattern=4, attention_chunk=8192,
                                   global_nope=True, temperature_floor=8192.0, temperature_scale=0.1,
                                   qk_l2_norm=True),
    # gpt-oss-20b's (openai/gpt-oss-20b): biased attention with sinks, 128-token windows on alternate layers, YaRN;
    # dropless top-4 of 32 biased experts with the clamped SwiGLU in every block
    "gpt-oss-20b": MoeLlamaConfig(vocab=201088, d_model=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
                                  d_ff=2880, expert_d_ff=2880, n_experts=32, top_k=4, moe_every=1, dropless=True,
                                  seq_len=4096, rope_theta=150000.0, rope_type="yarn", rope_factor=32.0,
                                  rope_original_max_position=4096, rope_truncate=False, sliding_window=128,
                                  sliding_pattern=2, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
                                  expert_bias=True, expert_activation="clamped"),
}


class ExpertBlocks(llama.Blocks):
    """The MoE blocks: Llama attention and norms, then a router and the experts, stacked over `layers`."""

    def __init__(self, cfg: MoeLlamaConfig, rngs: nnx.Rngs, axis: str = "layers"):
        """`axis`: the stack's logical axis (`zero_layout.PREFIX_SCANNED` for blocks no pipeline stage cuts)."""
        super().__init__(cfg, rngs, count=cfg.n_moe_layers, dense_ffn=False, axis=axis)
        n, e, d, fe = cfg.n_moe_layers, cfg.n_experts, cfg.d_model, cfg.expert_d_ff
        dt = jnp.dtype(cfg.param_dtype)
        s_in, s_out = d**-0.5, fe**-0.5 / (2 * cfg.n_layers) ** 0.5
        hidden = (axis, "experts", "embed", "expert_mlp")
        self.router = llama._param(rngs, (n, d, e), (axis, "embed", None), dt, s_in)
        self.expert_gate = llama._param(rngs, (n, e, d, fe), hidden, dt, s_in)
        self.expert_up = llama._param(rngs, (n, e, d, fe), hidden, dt, s_in)
        self.expert_down = llama._param(rngs, (n, e, fe, d), (axis, "experts", "expert_mlp", "embed"), dt, s_out)
        if cfg.shared_expert:
            self.shared_gate = llama._param(rngs, (n, d, fe), (axis, "embed", "mlp"), dt, s_in)
            self.shared_up = llama._param(rngs, (n, d, fe), (axis, "embed", "mlp"), dt, s_in)
            self.shared_down = llama._param(rngs, (n, fe, d), (axis, "mlp", "embed"), dt, s_out)
        if cfg.expert_bias:  # zero-initialised in gpt-oss; small random here so that a test sees them
            self.router_bias = llama._param(rngs, (n, e), (axis, None), dt, s_in)
            self.expert_gate_bias = llama._param(rngs, (n, e, fe), (axis, "experts", "expert_mlp"), dt, s_in)
            self.expert_up_bias = llama._param(rngs, (n, e, fe), (axis, "experts", "expert_mlp"), dt, s_in)
            self.expert_down_bias = llama._param(rngs, (n, e, d), (axis, "experts", "embed"), dt, s_out)


class MoeBlocks(nnx.Module):
    """The `first_dense` dense blocks (`prefix`), then the groups of `moe_every` blocks (`models.moe_layout`): the
    dense ones (`dense`) and the MoE ones (`moe`), each a stack in layer order (on `prefix_layers`, which no
    pipeline cuts, where they run apart)."""

    def __init__(self, cfg: MoeLlamaConfig, rngs: nnx.Rngs):
        first = cfg.first_dense
        self.prefix = llama.Blocks(cfg, rngs, count=first, axis=zero_layout.PREFIX_SCANNED) if first else None
        dense = cfg.n_layers - first - cfg.n_moe_layers
        # blocks that run apart: no pipeline stage cuts them (a pipeline plan is refused by name when traced)
        axis = zero_layout.PREFIX_SCANNED if moe_layout.runs_apart(cfg) else zero_layout.SCANNED
        self.dense = llama.Blocks(cfg, rngs, count=dense, axis=axis) if dense else None
        self.moe = ExpertBlocks(cfg, rngs, axis=axis)
        self.cfg = cfg

    def stacked(self) -> dict[str, dict[str, jax.Array]]:
        """Each group's weights along a leading group axis (the dense blocks' as [groups, dense per group, ...], the
        MoE ones' so too where a group has several); the prefix's (`prefix`), where the model has one, along its
        own. Blocks that run apart (`moe_layout.runs_apart`) keep their stacks' [layers, ...]."""
        cfg, moe = self.cfg, self.moe.stacked()
        prefix = {} if self.prefix is None else {"prefix": self.prefix.stacked()}
        dense = {} if self.dense is None else {"dense": self.dense.stacked()}
        if moe_layout.runs_apart(cfg):
            return {**prefix, **dense, "moe": moe}
        groups = (cfg.n_layers - cfg.first_dense) // cfg.moe_every
        if moe["router"].shape[0] > groups:  # several MoE blocks per group
            moe = zero.regroup(moe, groups=groups)
        return {**prefix, **{k: zero.regroup(v, groups=groups) for k, v in dense.items()}, "moe": moe}

    def inference(self):
        """(per-layer weights, feed-forward) for `inference.inference_layers`: one stack and one feed-forward per
        place in a group (its blocks in order) where a group has several blocks, a list of runs (the prefix's, then
        the groups', or each run of blocks that run apart).

        The layer's routing statistics (its auxiliary losses) are training's and are dropped here.
        """
        cfg, stacked = self.cfg, self.stacked()
        kinds = {"D": dense_feed_forward, "M": experts_feed_forward}
        group = cfg.moe_pattern or moe_layout.classic(cfg.moe_every)
        if moe_layout.runs_apart(cfg):
            places = moe_layout.runs(group)
            stacks = [jax.tree.map(lambda a, s=start, n=n: a[s:s + n], stacked["dense" if kind == "D" else "moe"])
                      for kind, start, n in places]
            body = stacks, [kinds[kind] for kind, _, _ in places]
        elif len(group) == 1:
            body = [stacked["moe"]], [experts_feed_forward]
        else:
            seen, stacks = {"D": 0, "M": 0}, []
            for kind in group:
                name = "dense" if kind == "D" else "moe"
                grouped = stacked[name]["attn_norm"].ndim == 3  # [groups, per group, d]
                stacks.append(jax.tree.map(lambda a, j=seen[kind]: a[:, j], stacked[name]) if grouped
                              else stacked[name])
                seen[kind] += 1
            body = [tuple(stacks)], [tuple(kinds[kind] for kind in group)]
        if self.prefix is None:
            return (body[0][0], body[1][0]) if len(body[0]) == 1 else body
        return [stacked["prefix"], *body[0]], [dense_feed_forward, *body[1]]


def experts_feed_forward(p, x, cfg: MoeLlamaConfig):
    """An MoE block's feed-forward as inference calls it: the routed experts (plus the shared one), no statistics."""
    return with_shared_expert(p, x, cfg, experts.moe_ffn(p, x, cfg.moe)[0])


def with_shared_expert(p, x, cfg: MoeLlamaConfig, routed):
    """The experts' output `routed` plus, under `shared_expert`, the shared expert's SwiGLU MLP of x (Llama 4)."""
    if not cfg.shared_expert:
        return routed
    return routed + llama.mlp({"w_gate": p["shared_gate"], "w_up": p["shared_up"], "w_down": p["shared_down"]}, x)


def moe_block(p, x, cfg: MoeLlamaConfig, moe_layer: MoeLayer = experts.moe_ffn):
    """Attention, then the experts in place of the MLP: (residual stream, the layer's routing statistics)."""
    x = llama.attention_residual(p, x, cfg)
    h = tensor.enter_tensor_region(llama.block_norm(x, p["mlp_norm"], cfg))
    y, stats = moe_layer(p, h, cfg.moe)
    return constrain(x + with_shared_expert(p, h, cfg, y), llama.RESIDUAL), stats


def run_groups(stacked, x, cfg: MoeLlamaConfig, remat: Callable | None = None,
               moe_layer: MoeLayer = experts.moe_ffn):
    """Scan the block groups over the leading axis of `stacked`: (x, statistics stacked per MoE layer).

    Like `llama.run_layers`: the plan's remat policy by default, and under ZeRO-3 each group's parameters
    gathered just before it runs; a group runs its blocks' homogeneous runs in order (`moe_layout.runs`), and
    blocks of no period run apart (`run_apart`). A dense prefix is not among `stacked`: it runs with the
    embedding (`embed_and_prefix`).
    """
    if cfg.sliding_pattern > 1 and "dense" in stacked:  # local/global layers and dense blocks: patterns of groups
        return run_patterns(stacked, x, cfg, remat, moe_layer)
    if cfg.sliding_pattern > 1:  # local and global layers (models.layer_pattern), each with its experts
        return layer_pattern.run_groups(lambda p, h, c: moe_block(p, h, c, moe_layer), stacked["moe"], x, cfg, remat)
    group = cfg.moe_pattern or moe_layout.classic(cfg.moe_every)
    if moe_layout.runs_apart(cfg):
        return run_apart(stacked, x, cfg, group, remat, moe_layer)
    several = group.count("M") > 1  # the MoE blocks too stacked [groups, per group, ...]
    moe_run = functools.partial(run_moe_blocks, cfg=cfg, remat=lambda f: f, moe_layer=moe_layer)

    def run_group(p, h):
        stats = []
        for kind, start, n in moe_layout.runs(group):
            if kind == "D":
                h = llama.run_layers(part(p["dense"], start, n), h, cfg, remat=lambda f: f)
            elif several:
                h, run_stats = moe_run(part(p["moe"], start, n), h)
                stats.append(run_stats)
            else:
                h, run_stats = moe_block(p["moe"], h, cfg, moe_layer)
        return h, jax.tree.map(lambda *a: jnp.concatenate(a), *stats) if several else run_stats

    x, stats = scan_layers(run_group, stacked, x, remat=remat)
    return x, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats) if several else stats


def part(stacked, start: int, n: int):
    """Layers start..start + n - 1 of a group's stacks (all of them where that is the whole)."""
    if jax.tree.leaves(stacked)[0].shape[0] == n:
        return stacked
    return jax.tree.map(lambda a: a[start:start + n], stacked)


def run_moe_blocks(stacked, x, cfg: MoeLlamaConfig, remat: Callable | None = None,
                   moe_layer: MoeLayer = experts.moe_ffn):
    """Scan MoE blocks over the leading axis of `stacked`: (x, statistics stacked per block)."""
    return scan_layers(lambda p, h: moe_block(p, h, cfg, moe_layer), stacked, x, remat=remat)


def run_apart(stacked, x, cfg: MoeLlamaConfig, group: str, remat: Callable | None, moe_layer: MoeLayer):
    """A pattern of no period (`moe_layout.runs_apart`): its homogeneous runs one after another, each a scan over
    its slice of the dense or MoE stack, gathered a layer at a time under ZeRO-3 (`zero.layer_range`)."""
    stats = []
    for kind, start, n in moe_layout.runs(group):
        if kind == "D":
            x = llama.run_layers(zero.layer_range(stacked["dense"], start, start + n), x, cfg, remat)
        else:
            x, run_stats = run_moe_blocks(zero.layer_range(stacked["moe"], start, start + n), x, cfg, remat, moe_layer)
            stats.append(run_stats)
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *stats)


def run_patterns(stacked, x, cfg: MoeLlamaConfig, remat: Callable | None = None,
                 moe_layer: MoeLayer = experts.moe_ffn):
    """The block groups scanned a local/global pattern at a time (Llama 4 Maverick's: P = sliding_pattern layers,
    P / moe_every groups of dense blocks then an MoE block), each layer with its own static window and rotation
    (`layer_pattern.layer_config`): (x, statistics stacked per MoE layer). A pattern must hold whole groups, and
    `stacked` (all groups, or a pipeline chunk of them) whole patterns: other layouts are refused naming the sizes."""
    pattern, every = cfg.sliding_pattern, cfg.moe_every
    groups = stacked["moe"]["router"].shape[0]
    per_pattern = pattern // every
    if pattern % every or cfg.n_layers % pattern or groups % per_pattern:
        raise ValueError(f"sliding_pattern={pattern} with moe_every={every}: a local/global pattern must hold whole "
                         f"groups of moe_every blocks, and the {groups * every} layers run here (n_layers="
                         f"{cfg.n_layers}, or a pipeline chunk) whole patterns")

    def run_pattern(p, h):
        stats = []
        for g in range(per_pattern):
            for j in range(every - 1):
                h = llama.block(jax.tree.map(lambda a: a[g, j], p["dense"]), h,
                                layer_pattern.layer_config(cfg, g * every + j))
            h, layer_stats = moe_block(jax.tree.map(lambda a: a[g], p["moe"]), h,
                                       layer_pattern.layer_config(cfg, g * every + every - 1), moe_layer)
            stats.append(layer_stats)
        return h, jax.tree.map(lambda *a: jnp.stack(a), *stats)

    x, stats = scan_layers(run_pattern, zero.regroup(stacked, groups // per_pattern), x, remat=remat)
    return x, jax.tree.map(lambda a: a.reshape(groups, *a.shape[2:]), stats)


def embed_and_prefix(params, tokens, cfg: MoeLlamaConfig, remat: Callable | None = None):
    """The embedding's rows, then the dense prefix blocks (`params["prefix"]`): the pipeline's input to its first
    stage, so that the stages cut only the groups (as `deepseek.embed_and_dense`)."""
    return llama.run_layers(params["prefix"], llama.embed_tokens(params["table"], tokens), cfg, remat)


class MoeLlama(llama.Llama):
    blocks_type = MoeBlocks
    run_blocks = staticmethod(run_groups)  # (stacked, x, cfg, remat, moe_layer) -> (x, statistics): a variant's own

    def __call__(self, batch, remat: Callable | None = None, moe_layer: MoeLayer = experts.moe_ffn):
        """(cross-entropy + the routers' auxiliary losses, metrics); a pipeline over `pipe` like the dense model.

        Metrics: ce_loss, load_balance_loss (and router_z_loss) summed over the
        MoE layers; dropped_fraction and expert_share [E] averaged over them.
        """
        plan = active_plan()
        if plan is not None and plan.shape["pipe"] > 1:
            moe_layout.check_pipeline(self.cfg, plan.shape["pipe"], plan.virtual_stages)
        stacked, embed, embed_params = self.blocks.stacked(), llama.embed_tokens, self.embedding[...]
        if "prefix" in stacked:  # the dense prefix runs with the embedding, before a pipeline's first stage
            embed = functools.partial(embed_and_prefix, cfg=self.cfg, remat=remat)
            embed_params = {"table": embed_params, "prefix": stacked.pop("prefix")}
        stages = pipeline.Stages(
            embed=embed,
            layers=functools.partial(self.run_blocks, cfg=self.cfg, remat=remat, moe_layer=moe_layer),
            head=functools.partial(llama.head_loss, cfg=self.cfg),
            aux_loss=experts.aux_loss,
        )
        loss, sums = pipeline.loss(stages, embed_params, stacked, self.head_params(), batch["inputs"], batch["targets"])
        aux_loss, metrics = experts.summarize(sums, self.cfg.n_moe_layers)
        return loss, {"ce_loss": loss - aux_loss, **metrics}

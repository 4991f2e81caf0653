"""What is being trained, as the planner sees it: each parameter's shape and logical names, and the dimensions.

Shapes only: a registry model (jaxpar.models) is counted from its config, never
traced, so planning a 405B model costs nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.models import moe_layout


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter array: its shape and logical names (stacked: leading `layers` axis)."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    trained: bool = True  # False: frozen (a LoRA base), no gradient, no optimizer state, no gradient sum
    adapted: bool = False  # LoRA adapters sit beside it: its layer's backward forms W + A B and its cotangent
    held_bytes: float = 0.0  # bytes a value is held in when quantized (QLoRA's base); 0: the precision's

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        return self.names[:1] == ("layers",)


@dataclasses.dataclass(frozen=True)
class Model:
    """The shapes the planner needs: the parameter inventory and the transformer's dimensions."""

    name: str
    leaves: tuple[Leaf, ...]
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int  # padded (the embedding's rows)
    n_experts: int = 0
    top_k: int = 0
    moe_every: int = 1
    expert_d_ff: int = 0
    capacity_factor: float = 1.0
    dropless: bool = False
    group_size: int | None = None
    layer_pattern: int = 1  # layers of one local/global attention pattern (Gemma 2: 2), never cut by a pipeline
    plan_options: tuple[tuple[str, object], ...] = ()  # what trains, as Plan options: LoRA's (planner.adapters)
    dense_first: int = 0  # DeepSeek-V3's dense first blocks: a stack of their own before the MoE blocks, no pipeline
    moe_pattern: str = ""  # one group's blocks, D dense and M MoE ("": moe_every - 1 dense, then one MoE)
    # DeepSeek-V3's latent attention: head_dim is the query/key head (nope + rope), v_head_dim the value head (0: the
    # same), latent_width the per-token widths of its compressions (q latent, kv latent and the shared rotary key)
    v_head_dim: int = 0
    latent_width: int = 0

    @functools.cached_property
    def params(self) -> int:
        return sum(leaf.size for leaf in self.leaves)

    @functools.cached_property
    def frozen(self) -> bool:
        """Whether part of the model is frozen (LoRA: all but the adapters)."""
        return not all(leaf.trained for leaf in self.leaves)

    @functools.cached_property
    def quantized_bytes(self) -> float:
        """Bytes a quantized base value is held in (0: none is quantized)."""
        return max((leaf.held_bytes for leaf in self.leaves), default=0.0)

    @property
    def value_dim(self) -> int:
        """A value head's width (MLA's v_head_dim; else the query/key head_dim)."""
        return self.v_head_dim or self.head_dim

    @property
    def attention_matmul_width(self) -> int:
        """Per head, the reduced widths of attention's two matmuls per key: q . k (head_dim) and p v (value_dim)."""
        return self.head_dim + self.value_dim

    @property
    def moe_layers(self) -> int:
        if not self.n_experts:
            return 0
        return (self.n_layers - self.dense_first) // self.moe_every * (self.moe_pattern.count("M") or 1)

    @property
    def scan_depth(self) -> int:
        """The stacked leading dimension: layers (dense) or groups of moe_every blocks (MoE)."""
        return self.n_layers // self.moe_every if self.n_experts else self.n_layers

    @property
    def pipeline_units(self) -> int:
        """What each pipeline chunk must hold a whole number of: scan_depth's entries in whole attention patterns
        (one unit when local layers follow the last whole pattern, as Gemma 3's: no pipeline cuts those layers)."""
        units, left = divmod(self.scan_depth, self.layer_pattern)
        apart = self.moe_pattern and self.n_layers - self.dense_first == self.moe_every  # no period: no pipeline
        return 1 if left or self.dense_first or apart else units

    @functools.cached_property
    def separate_head(self) -> bool:
        """Whether the output layer has its own weight (not tied to the embedding table)."""
        return any(leaf.path.endswith("head") for leaf in self.leaves)

    @functools.cached_property
    def flop_params(self) -> int:
        """Parameters a token's forward multiplies with (2 FLOPs each): all but the embedding table and
        the experts a token does not visit."""
        n = self.params
        if self.separate_head:
            n -= self.vocab * self.d_model  # the embedding lookup is no matmul (tied: the table is the head)
        if self.n_experts:
            per_expert = 3 * self.d_model * self.expert_d_ff
            n -= self.moe_layers * (self.n_experts - self.top_k) * per_expert
        return n

    @classmethod
    def named(cls, name: str, overrides: dict | None = None) -> "Model":
        """A model from the registry (jaxpar.models), its inventory counted from the config (no tracing)."""
        from jaxpar.models import model_config

        return cls.of_config(name, model_config(name, overrides))

    @classmethod
    def of_config(cls, name: str, config) -> "Model":
        """From registry model `name`'s config: Llama-style leaves from its shapes (`llama_leaves`), DeepSeek-V3's
        (latent attention, dense and MoE stacks) read from the model itself, traced abstractly."""
        if not hasattr(config, "kv_lora_rank"):
            return cls.from_config(name, config, llama_leaves(config))
        from jaxpar.models import model_factory
        from jaxpar.train.state import describe

        leaves = leaves_of(describe(model_factory(name, config, 0)).logical)  # paths "['blocks']['moe']['wo']"
        dotted = tuple(dataclasses.replace(leaf, path=leaf.path[2:-2].replace("']['", ".")) for leaf in leaves)
        return cls.from_config(name, config, dotted)

    @classmethod
    def from_config(cls, name: str, config, leaves: tuple[Leaf, ...]) -> "Model":
        """From a Llama-style config (jaxpar.models) and its parameters (`llama_leaves`, or `leaves_of`)."""
        moe = {}
        if getattr(config, "n_experts", 0):
            moe = dict(n_experts=config.n_experts, top_k=config.top_k, moe_every=config.moe_every,
                       moe_pattern=getattr(config, "moe_pattern", ""),
                       expert_d_ff=config.expert_d_ff, capacity_factor=config.capacity_factor,
                       dropless=config.dropless, group_size=config.group_size)
        pattern = getattr(config, "sliding_pattern", 1)
        head_dim, latent = config.head_dim, {}
        if hasattr(config, "kv_lora_rank"):  # MLA: its heads' real widths, not the Llama head_dim it inherits
            head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
            latent = dict(v_head_dim=config.v_head_dim, latent_width=(config.q_lora_rank or 0) + config.kv_lora_rank
                          + config.qk_rope_head_dim)
        return cls(name, tuple(leaves), config.d_model, config.n_layers, config.n_heads, config.n_kv_heads,
                   head_dim, config.d_ff, config.padded_vocab, **moe, layer_pattern=pattern,
                   dense_first=getattr(config, "first_dense", 0), **latent)


def llama_leaves(c) -> tuple[Leaf, ...]:
    """The parameters of jaxpar.models.llama (and its MoE variant), shapes and logical names, from the config."""
    d, h, kv, hd, f, v = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.padded_vocab

    def blocks(prefix: str, n: int, dense_ffn: bool = True) -> list[Leaf]:
        out = [
            Leaf(prefix + "attn_norm", (n, d), ("layers", "norm")),
            Leaf(prefix + "wq", (n, d, h, hd), ("layers", "embed", "heads", "head_dim")),
            Leaf(prefix + "wk", (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
            Leaf(prefix + "wv", (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
            Leaf(prefix + "wo", (n, h, hd, d), ("layers", "heads", "head_dim", "embed")),
            Leaf(prefix + "mlp_norm", (n, d), ("layers", "norm")),
        ]
        if getattr(c, "qkv_bias", False):  # Qwen2
            out += [Leaf(prefix + "bq", (n, h, hd), ("layers", "heads", "head_dim")),
                    Leaf(prefix + "bk", (n, kv, hd), ("layers", "kv_heads", "head_dim")),
                    Leaf(prefix + "bv", (n, kv, hd), ("layers", "kv_heads", "head_dim"))]
        if getattr(c, "qk_norm", False):  # Qwen3
            out += [Leaf(prefix + "q_norm", (n, hd), ("layers", "head_dim")),
                    Leaf(prefix + "k_norm", (n, hd), ("layers", "head_dim"))]
        if getattr(c, "post_norms", False):  # Gemma 2
            out += [Leaf(prefix + "post_attn_norm", (n, d), ("layers", "norm")),
                    Leaf(prefix + "post_mlp_norm", (n, d), ("layers", "norm"))]
        if getattr(c, "attn_sinks", False):  # gpt-oss
            out += [Leaf(prefix + "sinks", (n, h), ("layers", "heads"))]
        if getattr(c, "attn_out_bias", False):
            out += [Leaf(prefix + "bo", (n, d), ("layers", "embed"))]
        if dense_ffn:
            out += [Leaf(prefix + "w_gate", (n, d, f), ("layers", "embed", "mlp")),
                    Leaf(prefix + "w_up", (n, d, f), ("layers", "embed", "mlp")),
                    Leaf(prefix + "w_down", (n, f, d), ("layers", "mlp", "embed"))]
        return out

    leaves = [Leaf("embedding", (v, d), ("vocab", "embed"))]
    if getattr(c, "n_experts", 0):
        first = getattr(c, "first_dense", 0)
        groups, e, fe = c.n_moe_layers, c.n_experts, c.expert_d_ff  # the MoE blocks' stack
        if first:  # the dense prefix: its own stack, on every pipeline stage
            leaves += [dataclasses.replace(leaf, names=("prefix_layers", *leaf.names[1:]))
                       for leaf in blocks("blocks.prefix.", first)]
        rest = blocks("blocks.dense.", c.n_layers - first - groups) if c.n_layers - first - groups else []
        rest += blocks("blocks.moe.", groups, dense_ffn=False)
        rest += [Leaf("blocks.moe.router", (groups, d, e), ("layers", "embed", None)),
                 Leaf("blocks.moe.expert_gate", (groups, e, d, fe), ("layers", "experts", "embed", "expert_mlp")),
                 Leaf("blocks.moe.expert_up", (groups, e, d, fe), ("layers", "experts", "embed", "expert_mlp")),
                 Leaf("blocks.moe.expert_down", (groups, e, fe, d), ("layers", "experts", "expert_mlp", "embed"))]
        if getattr(c, "shared_expert", False):  # Llama 4
            rest += [Leaf("blocks.moe.shared_gate", (groups, d, fe), ("layers", "embed", "mlp")),
                     Leaf("blocks.moe.shared_up", (groups, d, fe), ("layers", "embed", "mlp")),
                     Leaf("blocks.moe.shared_down", (groups, fe, d), ("layers", "mlp", "embed"))]
        if getattr(c, "expert_bias", False):  # gpt-oss
            rest += [Leaf("blocks.moe.router_bias", (groups, e), ("layers", None)),
                     Leaf("blocks.moe.expert_gate_bias", (groups, e, fe), ("layers", "experts", "expert_mlp")),
                     Leaf("blocks.moe.expert_up_bias", (groups, e, fe), ("layers", "experts", "expert_mlp")),
                     Leaf("blocks.moe.expert_down_bias", (groups, e, d), ("layers", "experts", "embed"))]
        if moe_layout.runs_apart(c):  # blocks of no period: stacks no pipeline cuts (jaxpar.models.moe_layout)
            rest = [dataclasses.replace(leaf, names=("prefix_layers", *leaf.names[1:])) for leaf in rest]
        leaves += rest
    else:
        leaves += blocks("blocks.", c.n_layers)
    leaves.append(Leaf("final_norm", (d,), ("norm",)))
    if not c.tie_embeddings:
        leaves.append(Leaf("head", (d, v), ("embed", "vocab")))
    return tuple(leaves)


def leaves_of(logical) -> tuple[Leaf, ...]:
    """The parameters of any model from its tree of `jaxpar.train.state.LogicalArray` (jaxpar.train.state.describe)."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: hasattr(x, "names"))[0]
    return tuple(Leaf(jax.tree_util.keystr(p), tuple(a.shape), tuple(a.names)) for p, a in flat)


def capacity(model: Model, group: int) -> int:
    """Slots per expert in a routing group (jaxpar.parallel.experts.MoEConfig.capacity)."""
    if model.dropless:
        return group
    return max(1, min(group, math.ceil(model.top_k * group * model.capacity_factor / model.n_experts - 1e-9)))


def model_seq(name: str) -> int:
    """The registry model's own sequence length (what `jaxpar plan` uses without --seq-len)."""
    from jaxpar.models import model_config

    return model_config(name).seq_len

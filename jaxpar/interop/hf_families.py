"""Each Hugging Face family's tensor names and shapes: which jaxpar parameter each `model.layers.{i}.` tensor is.

A family adds its block options' parameters in its own entry of FAMILY_PARAMS
(keyed by the LlamaConfig option that builds them), and may rename a Llama one
there: Gemma 2's `post_attention_layernorm` is the norm on the attention's
output, so its pre-MLP norm (jaxpar's `mlp_norm`) is `pre_feedforward_layernorm`.
`jaxpar.interop.hf` reads and writes the tensors with these maps.
"""

from __future__ import annotations

from jaxpar.interop import hf_deepseek_v3, hf_gpt_oss, hf_llama4, hf_mixtral, hf_qwen3_moe
from jaxpar.models.llama import LlamaConfig

# jaxpar block parameter -> (Hugging Face name within `model.layers.{i}.`, layout)
LAYER_PARAMS = {
    "attn_norm": ("input_layernorm.weight", "vector"),
    "wq": ("self_attn.q_proj.weight", "in_heads"),
    "wk": ("self_attn.k_proj.weight", "in_heads"),
    "wv": ("self_attn.v_proj.weight", "in_heads"),
    "wo": ("self_attn.o_proj.weight", "out_heads"),
    "mlp_norm": ("post_attention_layernorm.weight", "vector"),
    "w_gate": ("mlp.gate_proj.weight", "transpose"),
    "w_up": ("mlp.up_proj.weight", "transpose"),
    "w_down": ("mlp.down_proj.weight", "transpose"),
}

# the families' extra (or renamed) block parameters: LlamaConfig option -> {jaxpar parameter: (HF name, layout)}
QWEN2_PARAMS = {"bq": ("self_attn.q_proj.bias", "heads_vector"), "bk": ("self_attn.k_proj.bias", "heads_vector"),
                "bv": ("self_attn.v_proj.bias", "heads_vector")}
QWEN3_PARAMS = {"q_norm": ("self_attn.q_norm.weight", "vector"), "k_norm": ("self_attn.k_norm.weight", "vector")}
GEMMA2_PARAMS = {"post_attn_norm": ("post_attention_layernorm.weight", "vector"),
                 "mlp_norm": ("pre_feedforward_layernorm.weight", "vector"),
                 "post_mlp_norm": ("post_feedforward_layernorm.weight", "vector")}
FAMILY_PARAMS = {"qkv_bias": QWEN2_PARAMS, "qk_norm": QWEN3_PARAMS, "post_norms": GEMMA2_PARAMS}

TOP_PARAMS = {
    "embedding": ("model.embed_tokens.weight", "vocab_rows"),
    "final_norm": ("model.norm.weight", "vector"),
    "head": ("lm_head.weight", "vocab_cols"),
}


def moe_family(cfg: LlamaConfig):
    """The Hugging Face MoE family module of an MoE config: Llama 4's with its routing, else Qwen3-MoE's with q/k
    norms, Mixtral's without."""
    if hf_llama4.is_llama4(cfg):
        return hf_llama4
    return hf_qwen3_moe if cfg.qk_norm else hf_mixtral


def layer_params(cfg: LlamaConfig) -> dict[str, tuple[str, str]]:
    """LAYER_PARAMS plus (or renamed by) the block parameters of the options `cfg` turns on (an MoE's experts for
    its MLP)."""
    extra = [params for option, params in FAMILY_PARAMS.items() if getattr(cfg, option)]
    params = {**LAYER_PARAMS, **{k: v for params in extra for k, v in params.items()}}
    if hf_gpt_oss.is_gpt_oss(cfg):
        return {k: v for k, v in params.items() if k not in hf_mixtral.DENSE_MLP} | hf_gpt_oss.layer_params(cfg)
    if hf_mixtral.is_moe(cfg):
        params = {k: v for k, v in params.items() if k not in hf_mixtral.DENSE_MLP} | moe_family(cfg).LAYER_PARAMS
    return params


def dense_layer_params(cfg: LlamaConfig) -> dict[str, tuple[str, str]]:
    """The block parameters of an MoE model's dense blocks: its MoE blocks' attention and norms, and the family's
    dense MLP (Qwen3-MoE's `mlp.*`, Llama 4's `feed_forward.*`) in place of the router and experts."""
    family = moe_family(cfg)
    moe_only = [k for k in family.LAYER_PARAMS if k not in LAYER_PARAMS]
    dense_mlp = getattr(family, "DENSE_MLP_PARAMS", {k: LAYER_PARAMS[k] for k in hf_mixtral.DENSE_MLP})
    return {k: v for k, v in layer_params(cfg).items() if k not in moe_only} | dense_mlp


def layer_stacks(cfg: LlamaConfig) -> list[tuple[str, list[int], dict[str, tuple[str, str]]]]:
    """Each stack of block parameters as (its path in the parameter tree, the Hugging Face layers it holds in order,
    its parameters' (name, layout)): one, or an MoE model's dense prefix (its first `first_dense` blocks), its
    other dense blocks and its MoE blocks (`jaxpar.models.moe_layout`), each where it has them."""
    n = cfg.n_layers
    if not hf_mixtral.is_moe(cfg) or (cfg.moe_every == 1 and not cfg.first_dense):
        return [(blocks_path(cfg), list(range(n)), layer_params(cfg))]
    first, moe = cfg.first_dense, hf_qwen3_moe.moe_layers(cfg)
    stacks = [("blocks/prefix", list(range(first)), dense_layer_params(cfg)),
              ("blocks/dense", [i for i in range(first, n) if i not in moe], dense_layer_params(cfg)),
              ("blocks/moe", moe, layer_params(cfg))]
    return [stack for stack in stacks if stack[1]]


def blocks_path(cfg: LlamaConfig) -> str:
    """Where the stacked block parameters lie in the parameter tree (an MoE Llama's under `moe`)."""
    return "blocks/moe" if hf_mixtral.is_moe(cfg) else "blocks"


def jaxpar_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every jaxpar parameter path ('blocks/wq') -> its shape (stacked over layers; vocabulary padded)."""
    n, d, vp = cfg.n_layers, cfg.d_model, cfg.padded_vocab
    if hf_deepseek_v3.is_deepseek(cfg):  # latent attention, dense then MoE blocks: its own stacks
        top = {"embedding": (vp, d), "final_norm": (d,), **({} if cfg.tie_embeddings else {"head": (d, vp)})}
        return {**top, **hf_deepseek_v3.jaxpar_block_shapes(cfg)}
    shapes = {"embedding": (vp, d), "final_norm": (d,), **({} if cfg.tie_embeddings else {"head": (d, vp)})}
    if not hf_mixtral.is_moe(cfg):
        return {**shapes, **_block_shapes(cfg, "blocks", n, experts=False)}
    if cfg.first_dense:  # the dense blocks before the MoE ones: a stack of their own
        shapes |= _block_shapes(cfg, "blocks/prefix", cfg.first_dense, experts=False)
    if n - cfg.first_dense - cfg.n_moe_layers:  # the dense blocks among the MoE ones: a stack of their own
        shapes |= _block_shapes(cfg, "blocks/dense", n - cfg.first_dense - cfg.n_moe_layers, experts=False)
    return {**shapes, **_block_shapes(cfg, "blocks/moe", cfg.n_moe_layers, experts=True)}


def _block_shapes(cfg: LlamaConfig, prefix: str, n: int, experts: bool) -> dict[str, tuple[int, ...]]:
    """The shapes of a stack of `n` blocks under `prefix`: attention, norms, then the MLP or (`experts`) the router
    and experts."""
    d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {"attn_norm": (n, d), "wq": (n, d, h, hd), "wk": (n, d, kv, hd), "wv": (n, d, kv, hd),
              "wo": (n, h, hd, d), "mlp_norm": (n, d)}
    if cfg.qkv_bias:
        shapes.update({"bq": (n, h, hd), "bk": (n, kv, hd), "bv": (n, kv, hd)})
    if cfg.qk_norm:
        shapes.update({"q_norm": (n, hd), "k_norm": (n, hd)})
    if cfg.post_norms:
        shapes.update({"post_attn_norm": (n, d), "post_mlp_norm": (n, d)})
    if cfg.attn_sinks:
        shapes["sinks"] = (n, h)
    if cfg.attn_out_bias:
        shapes["bo"] = (n, d)
    if not experts:
        shapes.update({"w_gate": (n, d, f), "w_up": (n, d, f), "w_down": (n, f, d)})
    else:
        shapes |= hf_mixtral.jaxpar_layer_shapes(cfg)
        if cfg.shared_expert:
            shapes |= hf_llama4.shared_expert_shapes(cfg)
    return {f"{prefix}/{k}": s for k, s in shapes.items()}


def expected_hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name a `cfg` model's safetensors hold -> its shape (torch layout, vocab unpadded)."""
    d, h, kv, hd, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab
    if hf_deepseek_v3.is_deepseek(cfg):
        top = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
        return {**top, **({} if cfg.tie_embeddings else {"lm_head.weight": (v, d)}),
                **hf_deepseek_v3.expected_block_shapes(cfg)}
    layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
             "self_attn.q_proj.weight": (h * hd, d), "self_attn.k_proj.weight": (kv * hd, d),
             "self_attn.v_proj.weight": (kv * hd, d), "self_attn.o_proj.weight": (d, h * hd),
             "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    if cfg.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (h * hd,), "self_attn.k_proj.bias": (kv * hd,),
                      "self_attn.v_proj.bias": (kv * hd,)})
    if cfg.qk_norm:
        layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if cfg.post_norms:
        layer.update({"pre_feedforward_layernorm.weight": (d,), "post_feedforward_layernorm.weight": (d,)})
    dense_layer = layer
    if hf_gpt_oss.is_gpt_oss(cfg):
        layer = {k: s for k, s in layer.items() if not k.startswith("mlp.")} | hf_gpt_oss.expected_layer_shapes(cfg)
    elif hf_mixtral.is_moe(cfg):
        attention = {k: s for k, s in layer.items() if not k.startswith("mlp.")}
        layer = attention | moe_family(cfg).expected_layer_shapes(cfg)
        dense_mlp = dense_layer_params(cfg)  # an MoE model's dense layers (moe_every > 1): the family's MLP names
        dense_layer = attention | {dense_mlp[k][0]: (f, d) for k in ("w_gate", "w_up")} | {dense_mlp["w_down"][0]: (d, f)}
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    dense = {i for path, layers, _ in layer_stacks(cfg) if path in ("blocks/prefix", "blocks/dense") for i in layers}
    for i in range(cfg.n_layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in (dense_layer if i in dense else layer).items()})
    return shapes

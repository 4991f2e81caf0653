"""gpt-oss through the Hugging Face door: its config's fields, its tensor names and its MXFP4 experts.

A gpt-oss block is a Llama block with q/k/v and output biases, attention sinks (a learned logit per query
head in the softmax's denominator: `attn_sinks`) and, on alternating layers (sliding first), a 128-token
window, rotated with YaRN; its feed-forward is jaxpar's MoE (`jaxpar.models.moe`) in every block with a
biased router and biased experts whose gate is the clamped SwiGLU (`expert_activation="clamped"`). Its
router softmaxes the top k logits, which equals jaxpar's top k of the softmax renormalised to sum to one
for k > 1 (k = 1 would keep the probability: refused). The experts drop no token (`dropless`), and
transformers' pooled auxiliary loss (`output_router_logits`) is refused like Mixtral's.

The checkpoints hold each layer's experts stacked: `mlp.experts.gate_up_proj` [E, d, 2f], gate and up
interleaved along the last axis (gate at the even columns), with `gate_up_proj_bias` [E, 2f], and
`down_proj` [E, f, d] with `down_proj_bias` [E, d]. The published checkpoints quantize the two
projections to MXFP4: `{name}_blocks` [E, out, in / 32, 16] (two 4-bit values per byte, low nibble first)
and `{name}_scales` [E, out, in / 32] (a power-of-two exponent per 32 values, biased by 127), which the
import dequantizes (`dequantize_mxfp4`, as transformers' `convert_moe_packed_tensors`); the export writes
them unquantized, without the source's `quantization_config`.
"""

from __future__ import annotations

import numpy as np

from jaxpar.models.moe import MoeLlamaConfig

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
# jaxpar MoE block parameter -> (Hugging Face name within `model.layers.{i}.`, layout); the even and odd columns
# of one tensor are the gate's and the up projection's
LAYER_PARAMS = {
    "router": ("mlp.router.weight", "transpose"),
    "router_bias": ("mlp.router.bias", "vector"),
    "expert_gate": ("mlp.experts.gate_up_proj", "even_cols"),
    "expert_up": ("mlp.experts.gate_up_proj", "odd_cols"),
    "expert_down": ("mlp.experts.down_proj", "as_is"),
    "expert_gate_bias": ("mlp.experts.gate_up_proj_bias", "even_cols"),
    "expert_up_bias": ("mlp.experts.gate_up_proj_bias", "odd_cols"),
    "expert_down_bias": ("mlp.experts.down_proj_bias", "as_is"),
}
ATTENTION_PARAMS = {"sinks": ("self_attn.sinks", "vector"), "bo": ("self_attn.o_proj.bias", "vector")}
# MXFP4: the 16 values of a 4-bit code (sign bit 3), and the exponent bias of the scales
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
SCALE_BIAS = 127
QUANTIZED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def is_gpt_oss(cfg) -> bool:
    """gpt-oss's blocks are the ones with attention sinks."""
    return bool(getattr(cfg, "attn_sinks", False))


def fields_from_hf(hf: dict) -> dict:
    """The config fields of a gpt-oss `config.json` beyond a Llama's; ValueError naming what jaxpar cannot represent."""
    for field in ("num_local_experts", "num_experts_per_tok", "intermediate_size"):
        if hf.get(field) is None:
            raise ValueError(f"config.json: {field} is missing")
    top_k = hf["num_experts_per_tok"]
    if top_k < 2:
        raise ValueError(f"config.json: num_experts_per_tok={top_k} is not supported: gpt-oss softmaxes the chosen "
                         "logits (weight 1 for one choice), jaxpar's top-1 router keeps its probability (Switch)")
    if hf.get("output_router_logits"):
        raise ValueError("config.json: output_router_logits=true is not supported: transformers then adds a load-"
                         "balancing loss pooled over all layers, jaxpar's is per layer; set it to false (jaxpar's "
                         "own is the model field load_balance_coef)")
    bias = bool(hf.get("attention_bias", True))
    return {"qkv_bias": bias, "attn_out_bias": bias, "attn_sinks": True, "n_experts": hf["num_local_experts"],
            "top_k": top_k, "moe_every": 1, "expert_d_ff": hf["intermediate_size"], "dropless": True,
            "load_balance_coef": 0.0, "router_z_coef": 0.0, "expert_bias": True, "expert_activation": "clamped",
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)), "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702))}


def fields_to_hf(cfg: MoeLlamaConfig) -> dict:
    """The gpt-oss `config.json` fields of a config with attention sinks; ValueError for what gpt-oss cannot express."""
    if not isinstance(cfg, MoeLlamaConfig) or cfg.moe_every != 1 or cfg.first_dense or not cfg.expert_bias \
            or cfg.expert_activation != "clamped":
        raise ValueError("attn_sinks=True: a Hugging Face gpt-oss has a biased MoE feed-forward with the clamped "
                         "SwiGLU in every block (moe_every=1, first_dense=0, expert_bias=True, "
                         "expert_activation='clamped')")
    if cfg.top_k < 2:
        raise ValueError(f"top_k={cfg.top_k}: a Hugging Face gpt-oss softmaxes the chosen logits, which for one "
                         "choice is not jaxpar's top-1 router")
    if cfg.qkv_bias != cfg.attn_out_bias or cfg.qk_norm or cfg.post_norms or cfg.norm_plus_one or cfg.embed_scale:
        raise ValueError(f"qkv_bias={cfg.qkv_bias}, attn_out_bias={cfg.attn_out_bias}, qk_norm={cfg.qk_norm}, "
                         f"post_norms={cfg.post_norms}: a Hugging Face gpt-oss has q/k/v and output biases together "
                         "(attention_bias), and none of the others")
    return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "intermediate_size": cfg.expert_d_ff,
            "attention_bias": cfg.qkv_bias, "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha,
            "output_router_logits": False, "router_aux_loss_coef": cfg.load_balance_coef}


def layer_params(cfg: MoeLlamaConfig) -> dict[str, tuple[str, str]]:
    """The block's gpt-oss tensors beyond a Llama's attention and norms (the q/k/v biases are Qwen2's names)."""
    return {**LAYER_PARAMS, "sinks": ATTENTION_PARAMS["sinks"], **({"bo": ATTENTION_PARAMS["bo"]}
                                                                   if cfg.attn_out_bias else {})}


def expected_layer_shapes(cfg: MoeLlamaConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face shapes of one block's sinks, output bias, router and experts (unquantized)."""
    d, e, f = cfg.d_model, cfg.n_experts, cfg.expert_d_ff
    shapes = {"self_attn.sinks": (cfg.n_heads,), "mlp.router.weight": (e, d), "mlp.router.bias": (e,),
              "mlp.experts.gate_up_proj": (e, d, 2 * f), "mlp.experts.gate_up_proj_bias": (e, 2 * f),
              "mlp.experts.down_proj": (e, f, d), "mlp.experts.down_proj_bias": (e, d)}
    return shapes | ({"self_attn.o_proj.bias": (d,)} if cfg.attn_out_bias else {})


def quantized_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The `_blocks` and `_scales` shapes of an MXFP4 tensor whose dequantized shape is [E, in, out]."""
    experts, size_in, size_out = shape
    return {"_blocks": (experts, size_out, size_in // 32, 16), "_scales": (experts, size_out, size_in // 32)}


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 `blocks` [E, out, G, 16] (uint8 codes, two per byte, low nibble first) and `scales` [E, out, G]
    (exponents biased by 127) as fp32 [E, in = G * 32, out]: each code's value times 2 ** exponent."""
    blocks = np.asarray(blocks).astype(np.uint8)
    exponents = np.asarray(scales).astype(np.int32) - SCALE_BIAS
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [E, out, G, 16, 2]
    values = np.ldexp(values.reshape(*blocks.shape[:-1], 32), exponents[..., None])
    return values.reshape(blocks.shape[0], blocks.shape[1], -1).transpose(0, 2, 1).astype(np.float32)

"""Mixtral through the Hugging Face door: its config's MoE fields and its experts' tensor names.

A Mixtral is a Mistral whose every feed-forward is a sparse MoE: jaxpar's MoE Llama with
`moe_every=1` (`jaxpar.models.moe`). Its router takes the top k of a softmax over all experts
and renormalises their probabilities to sum to one, as `jaxpar.parallel.experts.route` does
for k > 1. Mixtral drops no token, so the import routes `dropless` (every expert has room
for the whole group): a capacity factor would drop tokens transformers keeps. Its auxiliary
loss joins transformers' loss only under `output_router_logits`, and then pooled over the
layers, which jaxpar's per-layer Switch loss is not: the import sets `load_balance_coef=0`
(the loss is transformers' cross-entropy) and refuses `output_router_logits=true` by name.

The checkpoints on the Hub, and those transformers 5's `save_pretrained` writes, hold one
tensor per expert (`block_sparse_moe.experts.{e}.w1.weight`: gate, `w3`: up, `w2`: down);
transformers 5 fuses them into `mlp.experts.gate_up_proj` only in memory.
"""

from __future__ import annotations

from jaxpar.models.llama import LlamaConfig
from jaxpar.models.moe import MoeLlamaConfig

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
DENSE_MLP = ("w_gate", "w_up", "w_down")  # the Llama block's MLP, which the experts replace
# jaxpar MoE block parameter -> (Hugging Face name within `model.layers.{i}.`, layout); `{expert}`: one tensor each
LAYER_PARAMS = {
    "router": ("block_sparse_moe.gate.weight", "transpose"),
    "expert_gate": ("block_sparse_moe.experts.{expert}.w1.weight", "transpose"),
    "expert_up": ("block_sparse_moe.experts.{expert}.w3.weight", "transpose"),
    "expert_down": ("block_sparse_moe.experts.{expert}.w2.weight", "transpose"),
}


def is_moe(cfg: LlamaConfig) -> bool:
    return isinstance(cfg, MoeLlamaConfig)


def moe_fields_from_hf(hf: dict) -> dict:
    """The MoeLlamaConfig fields of a Mixtral `config.json`; ValueError naming a field jaxpar cannot represent."""
    for field in ("num_local_experts", "num_experts_per_tok"):
        if field not in hf:
            raise ValueError(f"config.json: {field} is missing")
    top_k = hf["num_experts_per_tok"]
    if top_k < 2:
        raise ValueError(f"config.json: num_experts_per_tok={top_k} is not supported: transformers renormalises "
                         "a single choice's weight to 1, jaxpar's top-1 router keeps its probability (Switch)")
    if hf.get("router_jitter_noise"):
        raise ValueError(f"config.json: router_jitter_noise={hf['router_jitter_noise']} is not supported "
                         "(jaxpar's router adds no noise)")
    if hf.get("output_router_logits"):
        raise ValueError("config.json: output_router_logits=true is not supported: transformers then adds a load-"
                         "balancing loss pooled over all layers, jaxpar's is per layer; set it to false (jaxpar's "
                         "own is the model field load_balance_coef)")
    return {"n_experts": hf["num_local_experts"], "top_k": top_k, "moe_every": 1,
            "expert_d_ff": hf["intermediate_size"], "dropless": True, "load_balance_coef": 0.0, "router_z_coef": 0.0}


def moe_fields_to_hf(cfg: MoeLlamaConfig) -> dict:
    """The Mixtral `config.json` fields of an MoE config; ValueError if it is not a Mixtral (a dense block in between)."""
    if cfg.moe_every != 1 or cfg.first_dense:
        raise ValueError(f"moe_every={cfg.moe_every}, first_dense={cfg.first_dense}: a Hugging Face Mixtral has an "
                         "MoE feed-forward in every block (moe_every=1, first_dense=0)")
    if cfg.top_k < 2:
        raise ValueError(f"top_k={cfg.top_k}: a Hugging Face Mixtral renormalises the chosen weights, which for "
                         "one choice is not jaxpar's top-1 router")
    if cfg.qkv_bias or cfg.qk_norm:
        raise ValueError(f"qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}: a Hugging Face Mixtral has neither")
    return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "intermediate_size": cfg.expert_d_ff,
            "output_router_logits": False, "router_aux_loss_coef": cfg.load_balance_coef, "router_jitter_noise": 0.0}


def expected_layer_shapes(cfg: MoeLlamaConfig, names: dict = LAYER_PARAMS) -> dict[str, tuple[int, ...]]:
    """The Hugging Face shapes of one block's router and experts, named as `names` (Mixtral's by default)."""
    d, e, f = cfg.d_model, cfg.n_experts, cfg.expert_d_ff
    shapes = {names["router"][0]: (e, d)}
    for j in range(e):
        shapes.update({names["expert_gate"][0].format(expert=j): (f, d),
                       names["expert_up"][0].format(expert=j): (f, d),
                       names["expert_down"][0].format(expert=j): (d, f)})
    return shapes


def jaxpar_layer_shapes(cfg: MoeLlamaConfig) -> dict[str, tuple[int, ...]]:
    """jaxpar's stacked shapes of the router and experts (`jaxpar.models.moe.ExpertBlocks`)."""
    n, d, e, f = cfg.n_moe_layers, cfg.d_model, cfg.n_experts, cfg.expert_d_ff
    shapes = {"router": (n, d, e), "expert_gate": (n, e, d, f), "expert_up": (n, e, d, f), "expert_down": (n, e, f, d)}
    if cfg.expert_bias:  # gpt-oss's
        shapes.update(router_bias=(n, e), expert_gate_bias=(n, e, f), expert_up_bias=(n, e, f),
                      expert_down_bias=(n, e, d))
    return shapes

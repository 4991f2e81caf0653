"""Qwen3-MoE through the Hugging Face door: its config's MoE fields and its experts' tensor names.

A Qwen3-MoE is a Qwen3 block (per-head q/k RMSNorm) whose feed-forward is a sparse MoE: jaxpar's MoE
Llama (`jaxpar.models.moe`) with `qk_norm`. Its router takes the top k of a softmax over all experts and,
under `norm_topk_prob`, renormalises them to sum to one: jaxpar's router (`jaxpar.parallel.experts.route`)
renormalises for k > 1 and keeps the probability for k = 1 (Switch), so the import takes k > 1 with
`norm_topk_prob=true` and k = 1 without it, and refuses the other two by name. Like Mixtral's, the
experts drop no token (`dropless`) and transformers adds its pooled auxiliary loss only under
`output_router_logits`, which is refused; the import's `load_balance_coef` is 0.

A layer is an MoE layer when `(i + 1) % decoder_sparse_step == 0` and i is not in `mlp_only_layers`, and the
others have a dense MLP of `intermediate_size` (`mlp.gate_proj.weight`, ...). jaxpar's MoE Llama takes any such
set (`jaxpar.models.moe_layout`): `first_dense` dense layers, then groups of `moe_every` blocks of the kinds of
`moe_pattern`, the shortest group that makes the layers (a period, so that a pipeline can cut the groups into
stages; with none, one group of every layer after the prefix, its runs of layers scanned one after another). A
config without an MoE layer is refused by name. The export writes the largest `decoder_sparse_step` every MoE
layer keeps (the greatest common divisor of their i + 1) and, in `mlp_only_layers`, the dense layers that step does
not make; the source's own, where they are the same layers, are kept. The checkpoints hold one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`); the router is `mlp.gate`.
"""

from __future__ import annotations

import math

from jaxpar.interop import hf_mixtral
from jaxpar.models import moe_layout
from jaxpar.models.moe import MoeLlamaConfig

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
# jaxpar MoE block parameter -> (Hugging Face name within `model.layers.{i}.`, layout); `{expert}`: one tensor each
LAYER_PARAMS = {
    "router": ("mlp.gate.weight", "transpose"),
    "expert_gate": ("mlp.experts.{expert}.gate_proj.weight", "transpose"),
    "expert_up": ("mlp.experts.{expert}.up_proj.weight", "transpose"),
    "expert_down": ("mlp.experts.{expert}.down_proj.weight", "transpose"),
}


def moe_fields_from_hf(hf: dict) -> dict:
    """The MoeLlamaConfig fields of a Qwen3-MoE `config.json`; ValueError naming a field jaxpar cannot represent."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    for field, value in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                         ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
        if value is None:
            raise ValueError(f"config.json: {field} is missing")
    top_k, norm = hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False))
    if norm != (top_k > 1):
        raise ValueError(f"config.json: norm_topk_prob={str(norm).lower()} with num_experts_per_tok={top_k} is not "
                         "supported: jaxpar's router renormalises the chosen probabilities for k > 1 and keeps "
                         "the one probability for k = 1 (norm_topk_prob=true for k > 1, false for k = 1)")
    first, every, pattern = layout_from_hf(hf)
    if hf.get("output_router_logits"):
        raise ValueError("config.json: output_router_logits=true is not supported: transformers then adds a load-"
                         "balancing loss pooled over all layers, jaxpar's is per layer; set it to false (jaxpar's "
                         "own is the model field load_balance_coef)")
    return {"n_experts": experts, "top_k": top_k, "moe_every": every, "first_dense": first, "moe_pattern": pattern,
            "expert_d_ff": hf["moe_intermediate_size"], "dropless": True, "load_balance_coef": 0.0,
            "router_z_coef": 0.0}


def layout_from_hf(hf: dict) -> tuple[int, int, str]:
    """jaxpar's (`first_dense`, `moe_every`, `moe_pattern`) of a config's `decoder_sparse_step` and
    `mlp_only_layers` as transformers builds them (`moe_layout.layout_of`); ValueError naming the fields where no
    layer is MoE."""
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config.json: decoder_sparse_step={step!r} must be an int >= 1")
    experts = hf.get("num_experts", hf.get("num_local_experts")) or 0
    kinds = "".join("M" if i not in dense and (i + 1) % step == 0 and experts > 0 else "D" for i in range(n))
    if "M" not in kinds:
        raise ValueError(f"config.json: num_experts={experts}, decoder_sparse_step={step}, mlp_only_layers="
                         f"{sorted(dense)} make layers [] of {n} MoE layers: a model without an MoE layer is a Qwen3 "
                         "(model_type qwen3)")
    return moe_layout.layout_of(kinds)


def moe_layers(cfg: MoeLlamaConfig) -> list[int]:
    """The MoE layers of `cfg` in order (`moe_layout.kinds`; the others dense)."""
    return [i for i, kind in enumerate(moe_layout.kinds(cfg)) if kind == "M"]


def moe_fields_to_hf(cfg: MoeLlamaConfig) -> dict:
    """The Qwen3-MoE `config.json` fields of an MoE config with q/k norms; ValueError for what it cannot express."""
    if cfg.qkv_bias:
        raise ValueError("qkv_bias=True: a Hugging Face Qwen3-MoE has no q/k/v biases")
    moe = moe_layers(cfg)
    step = math.gcd(*(i + 1 for i in moe))
    dense = [i for i in range(cfg.n_layers) if i not in moe and (i + 1) % step == 0]
    return {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "norm_topk_prob": cfg.top_k > 1,
            "moe_intermediate_size": cfg.expert_d_ff, "intermediate_size": cfg.d_ff, "decoder_sparse_step": step,
            "mlp_only_layers": dense, "output_router_logits": False, "router_aux_loss_coef": cfg.load_balance_coef}


def expected_layer_shapes(cfg: MoeLlamaConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face shapes of one block's router and experts."""
    return hf_mixtral.expected_layer_shapes(cfg, LAYER_PARAMS)

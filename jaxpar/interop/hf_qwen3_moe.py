"""Qwen3-MoE through the Hugging Face door: its config's MoE fields and its experts' tensor names.

A Qwen3-MoE is a Qwen3 block (per-head q/k RMSNorm) whose feed-forward is a sparse MoE: jaxpar's MoE
Llama (`jaxpar.models.moe`) with `qk_norm`. Its router takes the top k of a softmax over all experts and,
under `norm_topk_prob`, renormalises them to sum to one: jaxpar's router (`jaxpar.parallel.experts.route`)
renormalises for k > 1 and keeps the probability for k = 1 (Switch), so the import takes k > 1 with
`norm_topk_prob=true` and k = 1 without it, and refuses the other two by name. Like Mixtral's, the
experts drop no token (`dropless`) and transformers adds its pooled auxiliary loss only under
`output_router_logits`, which is refused; the import's `load_balance_coef` is 0.

A layer is an MoE layer when `(i + 1) % decoder_sparse_step == 0` and i is not in `mlp_only_layers`, and the
others have a dense MLP of `intermediate_size` (`mlp.gate_proj.weight`, ...). jaxpar's MoE Llama takes
`first_dense` dense layers, then MoE layers every `moe_every`-th: the import takes any step and MLP-only layers
whose MoE layers are that pattern (MoE iff i >= k and (i - k + 1) % m == 0, m dividing the n - k layers after
the prefix; the shortest prefix k that fits), and refuses any other set by name, listing its MoE layers (a dense
layer after an MoE one that breaks the period: a dense last layer, say). The export writes
`decoder_sparse_step=moe_every` and, with a prefix, the dense layers that step does not make
(`decoder_sparse_step=1` and every dense layer where the prefix is no whole number of steps); the source's own,
where they are the same layers, are kept. The checkpoints hold one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`); the router is `mlp.gate`.
"""

from __future__ import annotations

from jaxpar.interop import hf_mixtral
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
    first, every = moe_layout(hf)
    if hf.get("output_router_logits"):
        raise ValueError("config.json: output_router_logits=true is not supported: transformers then adds a load-"
                         "balancing loss pooled over all layers, jaxpar's is per layer; set it to false (jaxpar's "
                         "own is the model field load_balance_coef)")
    return {"n_experts": experts, "top_k": top_k, "moe_every": every, "first_dense": first,
            "expert_d_ff": hf["moe_intermediate_size"], "dropless": True, "load_balance_coef": 0.0,
            "router_z_coef": 0.0}


def moe_layout(hf: dict) -> tuple[int, int]:
    """jaxpar's (`first_dense`, `moe_every`) of a config's `decoder_sparse_step` and `mlp_only_layers`: the
    shortest dense prefix after which the MoE layers are every m-th; ValueError naming the MoE layers where no
    prefix and period make them."""
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config.json: decoder_sparse_step={step!r} must be an int >= 1")
    moe = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    for first in range(moe[0] + 1 if moe else 0):  # the prefix ends within the first MoE layer's group
        every = moe[0] - first + 1
        if (n - first) % every == 0 and moe == list(range(moe[0], n, every)):
            return first, every
    raise ValueError(f"config.json: decoder_sparse_step={step}, mlp_only_layers={sorted(dense)} make layers "
                     f"{moe} of {n} MoE layers; jaxpar's are dense layers 0..k-1, then every m-th (layers "
                     "k + m - 1, k + 2m - 1, ... with m dividing num_hidden_layers - k)")


def moe_layers(cfg: MoeLlamaConfig) -> list[int]:
    """The MoE layers of `cfg`: every `moe_every`-th after the `first_dense` dense ones (the others dense)."""
    return list(range(cfg.first_dense + cfg.moe_every - 1, cfg.n_layers, cfg.moe_every))


def moe_fields_to_hf(cfg: MoeLlamaConfig) -> dict:
    """The Qwen3-MoE `config.json` fields of an MoE config with q/k norms; ValueError for what it cannot express."""
    if cfg.qkv_bias:
        raise ValueError("qkv_bias=True: a Hugging Face Qwen3-MoE has no q/k/v biases")
    step = cfg.moe_every if cfg.first_dense % cfg.moe_every == 0 else 1
    moe = moe_layers(cfg)
    dense = [i for i in range(cfg.n_layers) if i not in moe and (i + 1) % step == 0]
    return {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "norm_topk_prob": cfg.top_k > 1,
            "moe_intermediate_size": cfg.expert_d_ff, "intermediate_size": cfg.d_ff, "decoder_sparse_step": step,
            "mlp_only_layers": dense, "output_router_logits": False, "router_aux_loss_coef": cfg.load_balance_coef}


def expected_layer_shapes(cfg: MoeLlamaConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face shapes of one block's router and experts."""
    return hf_mixtral.expected_layer_shapes(cfg, LAYER_PARAMS)

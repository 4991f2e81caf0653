"""Llama 4's text model through the Hugging Face door: its config's MoE and attention fields, its tensor names.

A Llama 4 (`Llama4ForCausalLM`, model_type `llama4_text`) is jaxpar's MoE Llama (`jaxpar.models.moe`) with:
- top-1 routing whose sigmoid of the chosen logit scales the expert's input (`sigmoid_input_gate`), plus a
  shared expert, a SwiGLU MLP of the experts' width added to the routed output (`shared_expert`);
- NoPE layers (`no_rope_layers`, 0: no rotation) every P-th layer: jaxpar's global layers of a
  `sliding_pattern` P under `global_nope`, whose queries take the temperature of `attn_temperature_tuning`
  (`temperature_floor` = floor_scale, `temperature_scale` = attn_scale); the other, rotating, layers attend
  within chunks of `attention_chunk_size` positions and L2-norm q and k after the rotation (`use_qk_norm`).
Llama 4 rotates interleaved pairs (2i, 2i + 1) of each head, jaxpar the halves (i, i + head_dim / 2): the
import reorders q_proj's and k_proj's output rows within each head into halves (layout `in_heads_pairs`) and
the export back, which leaves q . k, and so the model, unchanged. The experts are fused in the checkpoint:
`feed_forward.experts.gate_up_proj` [experts, d, 2 f] (gate, then up) and `down_proj` [experts, f, d].
Dense layers between the MoE ones (Maverick's `interleave_moe_layer_step` 2) are jaxpar's `moe_every` groups:
the MoE layers `moe_layers` must be every m-th (m - 1, 2m - 1, ...), the others have a SwiGLU MLP of
`intermediate_size_mlp` (`feed_forward.gate_proj.weight`, ...). Refused by name: the multimodal model
(`llama4`), top-k > 1, MoE layers of no period, NoPE layers of no period, and the router options
transformers adds a loss or noise with.
"""

from __future__ import annotations

import numpy as np

from jaxpar.models.llama import LlamaConfig
from jaxpar.models.moe import MoeLlamaConfig

MODEL_TYPE = "llama4_text"
ARCHITECTURE = "Llama4ForCausalLM"
# jaxpar MoE block parameter -> (Hugging Face name within `model.layers.{i}.`, layout)
LAYER_PARAMS = {
    "wq": ("self_attn.q_proj.weight", "in_heads_pairs"),
    "wk": ("self_attn.k_proj.weight", "in_heads_pairs"),
    "router": ("feed_forward.router.weight", "transpose"),
    "expert_gate": ("feed_forward.experts.gate_up_proj", "gate_half"),
    "expert_up": ("feed_forward.experts.gate_up_proj", "up_half"),
    "expert_down": ("feed_forward.experts.down_proj", "plain"),
    "shared_gate": ("feed_forward.shared_expert.gate_proj.weight", "transpose"),
    "shared_up": ("feed_forward.shared_expert.up_proj.weight", "transpose"),
    "shared_down": ("feed_forward.shared_expert.down_proj.weight", "transpose"),
}
# the dense layers' MLP (of intermediate_size_mlp), in place of the router and experts
DENSE_MLP_PARAMS = {"w_gate": ("feed_forward.gate_proj.weight", "transpose"),
                    "w_up": ("feed_forward.up_proj.weight", "transpose"),
                    "w_down": ("feed_forward.down_proj.weight", "transpose")}


def is_llama4(cfg: LlamaConfig) -> bool:
    """A config of Llama 4's routing (the only family with it)."""
    return isinstance(cfg, MoeLlamaConfig) and cfg.sigmoid_input_gate


def half_order(head_dim: int) -> np.ndarray:
    """jaxpar's head_dim entry j is Llama 4's entry half_order[j]: the pairs' first members, then their seconds."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def moe_fields_from_hf(hf: dict) -> dict:
    """The MoeLlamaConfig fields of a Llama 4 text `config.json` (experts and attention pattern); ValueError naming
    a field jaxpar cannot represent."""
    n = hf["num_hidden_layers"]
    top_k, step = hf.get("num_experts_per_tok", 1), hf.get("interleave_moe_layer_step", 1)
    if top_k != 1:
        raise ValueError(f"config.json: num_experts_per_tok={top_k} is not supported: jaxpar's Llama 4 router "
                         "scales one expert's input (top-1, as every published Llama 4)")
    moe_layers = list(hf.get("moe_layers") or range(step - 1, n, step))
    every = moe_layers[0] + 1 if moe_layers else 0
    if not moe_layers or n % every or moe_layers != list(range(every - 1, n, every)):
        raise ValueError(f"config.json: interleave_moe_layer_step={step}, moe_layers={hf.get('moe_layers')} make "
                         f"layers {moe_layers} of {n} MoE layers; jaxpar's MoE layers are every m-th (layers m - 1, "
                         "2m - 1, ... with m dividing num_hidden_layers)")
    for field in ("output_router_logits", "router_jitter_noise"):
        if hf.get(field):
            raise ValueError(f"config.json: {field}={hf[field]} is not supported (jaxpar's Llama 4 router adds "
                             "neither transformers' pooled loss nor noise)")
    return {"n_experts": hf.get("num_local_experts", 16), "top_k": 1, "moe_every": every,
            "expert_d_ff": hf["intermediate_size"], "d_ff": hf.get("intermediate_size_mlp", 16384), "dropless": True,
            "load_balance_coef": 0.0, "router_z_coef": 0.0, "shared_expert": True, "sigmoid_input_gate": True,
            **_attention_from_hf(hf)}


def _attention_from_hf(hf: dict) -> dict:
    """The NoPE period, chunks, q/k L2 norm and query temperature of `no_rope_layers` and the fields beside it."""
    n = hf["num_hidden_layers"]
    interval = hf.get("no_rope_layer_interval", 4)
    rotates = list(hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)])
    period = rotates.index(0) + 1 if 0 in rotates else 1
    if len(rotates) != n or rotates != [int(period == 1 or (i + 1) % period != 0) for i in range(n)]:
        raise ValueError(f"config.json: no_rope_layers={rotates} is not supported: jaxpar's NoPE layers repeat with a "
                         "period P (layer i NoPE iff (i + 1) % P == 0), one entry per layer")
    chunk = hf.get("attention_chunk_size", 8192)
    types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rotates]
    if hf.get("layer_types") is not None and list(hf["layer_types"]) != types:
        raise ValueError(f"config.json: layer_types={hf['layer_types']} is not supported: jaxpar's Llama 4 chunks "
                         f"the rotating layers' attention (expected {types})")
    nope = period > 1
    tuned = nope and hf.get("attn_temperature_tuning", True)
    return {"sliding_pattern": period, "global_nope": nope, "attention_chunk": chunk,
            "qk_l2_norm": bool(hf.get("use_qk_norm", True)),
            "temperature_floor": float(hf.get("floor_scale", 8192)) if tuned else None,
            "temperature_scale": float(hf.get("attn_scale", 0.1)) if tuned else 0.1}


def moe_fields_to_hf(cfg: MoeLlamaConfig) -> dict:
    """The Llama 4 text `config.json` fields of a Llama 4 config; ValueError for what it cannot express."""
    wanted = {"top_k": 1, "shared_expert": True, "first_dense": 0, "moe_pattern": ""}
    problems = [f"{name}={getattr(cfg, name)}" for name, value in wanted.items() if getattr(cfg, name) != value]
    if cfg.qkv_bias or cfg.qk_norm or cfg.sliding_window is not None:
        problems.append(f"qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}, sliding_window={cfg.sliding_window}")
    if problems:
        raise ValueError(f"{', '.join(problems)}: a Hugging Face Llama 4 has top-1 routing with a shared expert in "
                         "every MoE block and none of q/k/v biases, q/k norms with weights or windows")
    n = cfg.n_layers
    rotates = [int(not (cfg.global_nope and (i + 1) % cfg.sliding_pattern == 0)) for i in range(n)]
    return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": 1, "intermediate_size": cfg.expert_d_ff,
            "intermediate_size_mlp": cfg.d_ff, "interleave_moe_layer_step": cfg.moe_every,
            "moe_layers": list(range(cfg.moe_every - 1, n, cfg.moe_every)),
            "output_router_logits": False, "router_aux_loss_coef": cfg.load_balance_coef, "router_jitter_noise": 0.0,
            "no_rope_layers": rotates, "no_rope_layer_interval": cfg.sliding_pattern if cfg.global_nope else 4,
            "attention_chunk_size": cfg.attention_chunk, "use_qk_norm": cfg.qk_l2_norm,
            "layer_types": ["chunked_attention" if r and cfg.attention_chunk else "full_attention" for r in rotates],
            "attn_temperature_tuning": cfg.temperature_floor is not None,
            "floor_scale": _integral(cfg.temperature_floor or 8192), "attn_scale": cfg.temperature_scale,
            "attention_bias": False}


def _integral(value: float):
    """An integral float as the int transformers' config requires (floor_scale)."""
    return int(value) if float(value).is_integer() else value


def expected_layer_shapes(cfg: MoeLlamaConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face shapes of one block's router, experts and shared expert."""
    d, e, f = cfg.d_model, cfg.n_experts, cfg.expert_d_ff
    return {"feed_forward.router.weight": (e, d), "feed_forward.experts.gate_up_proj": (e, d, 2 * f),
            "feed_forward.experts.down_proj": (e, f, d), "feed_forward.shared_expert.gate_proj.weight": (f, d),
            "feed_forward.shared_expert.up_proj.weight": (f, d), "feed_forward.shared_expert.down_proj.weight": (d, f)}


def shared_expert_shapes(cfg: MoeLlamaConfig) -> dict[str, tuple[int, ...]]:
    """jaxpar's stacked shapes of the shared expert."""
    n, d, f = cfg.n_moe_layers, cfg.d_model, cfg.expert_d_ff
    return {"shared_gate": (n, d, f), "shared_up": (n, d, f), "shared_down": (n, f, d)}

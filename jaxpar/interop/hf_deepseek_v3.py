"""DeepSeek-V3 through the Hugging Face door (`DeepseekV3ForCausalLM`, model_type `deepseek_v3`): its config fields,
its tensor names and layouts, for jaxpar's `models.deepseek`.

Every block holds MLA's tensors (`self_attn.q_a_proj` / `q_a_layernorm` / `q_b_proj`, or `q_proj` without a q latent;
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`); the first `first_k_dense_replace` blocks a dense
`mlp.{gate,up,down}_proj`, the others the router `mlp.gate.weight` with its `e_score_correction_bias`, one tensor per
expert (`mlp.experts.{e}.gate_proj.weight`) and `mlp.shared_experts`. Under `rope_interleave` (DeepSeek's own form)
the rotated part of each head's query (q_b_proj's rows) and of the shared key (kv_a_proj_with_mqa's last rows) is in
interleaved pairs: the import reorders it into halves (jaxpar's rotation) and the export back, which leaves every
q . k unchanged. YaRN's `mscale_all_dim` is folded into the softmax scale (`query_scale`) as transformers does.

Refused by name: attention biases, another activation, `output_router_logits`, `pretraining_tp`; the multi-token
prediction layers (`num_nextn_predict_layers`) are not part of the model transformers builds, which ignores their
weights: so does the import, with a warning.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from jaxpar.models.deepseek import DeepseekConfig

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"

ATTENTION = {"attn_norm": ("input_layernorm.weight", "vector"),
             "mlp_norm": ("post_attention_layernorm.weight", "vector"),
             "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", "kv_a"),
             "kv_a_norm": ("self_attn.kv_a_layernorm.weight", "vector"),
             "wkv_b": ("self_attn.kv_b_proj.weight", "in_heads"),
             "wo": ("self_attn.o_proj.weight", "out_heads")}
Q_PLAIN = {"wq": ("self_attn.q_proj.weight", "q_heads")}
Q_LATENT = {"wq_a": ("self_attn.q_a_proj.weight", "transpose"),
            "q_a_norm": ("self_attn.q_a_layernorm.weight", "vector"),
            "wq_b": ("self_attn.q_b_proj.weight", "q_heads")}
DENSE = {"w_gate": ("mlp.gate_proj.weight", "transpose"), "w_up": ("mlp.up_proj.weight", "transpose"),
         "w_down": ("mlp.down_proj.weight", "transpose")}
EXPERTS = {"router": ("mlp.gate.weight", "transpose"),
           "router_correction": ("mlp.gate.e_score_correction_bias", "vector"),
           "expert_gate": ("mlp.experts.{expert}.gate_proj.weight", "transpose"),
           "expert_up": ("mlp.experts.{expert}.up_proj.weight", "transpose"),
           "expert_down": ("mlp.experts.{expert}.down_proj.weight", "transpose"),
           "shared_gate": ("mlp.shared_experts.gate_proj.weight", "transpose"),
           "shared_up": ("mlp.shared_experts.up_proj.weight", "transpose"),
           "shared_down": ("mlp.shared_experts.down_proj.weight", "transpose")}


def is_deepseek(cfg) -> bool:
    return isinstance(cfg, DeepseekConfig)


def is_prediction_layer(name: str, cfg) -> bool:
    """Whether tensor `name` belongs to a multi-token prediction layer (`model.layers.{i}.` past the model's layers,
    which transformers does not build and the import does not read)."""
    if not is_deepseek(cfg) or not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) >= cfg.n_layers


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude factor 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1), as transformers' yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def config_from_hf(hf: dict, fields: dict) -> DeepseekConfig:
    """The DeepseekConfig of a `deepseek_v3` config.json, from `fields` (the Llama fields hf_config read: sizes,
    norms, rotation) and the MLA and DeepSeekMoE fields; ValueError naming a field jaxpar cannot represent."""
    for field in ("output_router_logits", "attention_bias"):
        if hf.get(field):
            raise ValueError(f"config.json: {field}=true is not supported by jaxpar's DeepSeek-V3")
    # the published config's fields for DeepSeek's own code, which transformers reads as these values
    for field, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(field, value) != value:
            raise ValueError(f"config.json: {field}={hf[field]!r} is not supported: DeepSeek-V3's is {value!r}")
    if hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)):
        warnings.warn(f"config.json: num_nextn_predict_layers={hf.get('num_nextn_predict_layers')}: the multi-token "
                      "prediction layers are ignored (their weights are not read), as transformers' "
                      "DeepseekV3ForCausalLM ignores them", stacklevel=2)
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    qk = hf.get("qk_nope_head_dim", 128) + hf.get("qk_rope_head_dim", 64)
    scale = qk**-0.5
    if kind != "default" and rope.get("mscale_all_dim"):
        scale *= _mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    extra = {}
    if kind == "yarn" and rope.get("mscale") and rope.get("mscale_all_dim") and rope.get("attention_factor") is None:
        extra["rope_attention_factor"] = (_mscale(float(rope["factor"]), float(rope["mscale"]))
                                          / _mscale(float(rope["factor"]), float(rope["mscale_all_dim"])))
    first = hf.get("first_k_dense_replace", 3)
    return DeepseekConfig(**{
        **fields, **extra, "head_dim": hf.get("qk_rope_head_dim", 64),
        "n_kv_heads": fields["n_heads"], "n_experts": hf.get("n_routed_experts", 256),
        "top_k": hf.get("num_experts_per_tok", 8), "moe_every": 1, "expert_d_ff": hf.get("moe_intermediate_size", 2048),
        "dropless": True, "load_balance_coef": 0.0, "router_z_coef": 0.0, "shared_expert": True,
        "q_lora_rank": hf.get("q_lora_rank", 1536), "kv_lora_rank": hf.get("kv_lora_rank", 512),
        "qk_nope_head_dim": hf.get("qk_nope_head_dim", 128), "qk_rope_head_dim": hf.get("qk_rope_head_dim", 64),
        "v_head_dim": hf.get("v_head_dim", 128), "first_dense": min(first, fields["n_layers"]),
        "n_shared_experts": hf.get("n_shared_experts", 1), "router_groups": hf.get("n_group") or 1,
        "router_topk_groups": hf.get("topk_group") or 1, "routed_scale": float(hf.get("routed_scaling_factor", 2.5)),
        "norm_topk": bool(hf.get("norm_topk_prob", True)), "query_scale": scale})


def _softmax_scale_to_hf(cfg: DeepseekConfig, rope: dict) -> dict:
    """`rope` (hf_config's table of the rotation) with the mscale_all_dim that gives `query_scale`: transformers
    scales q . k by (nope + rope) ** -0.5 times YaRN's mscale squared, and by nothing else."""
    plain = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.query_scale is None or math.isclose(cfg.query_scale, plain, rel_tol=1e-12):
        return rope
    if cfg.rope_type != "yarn" or cfg.rope_factor <= 1 or cfg.query_scale < plain:
        raise ValueError(f"query_scale={cfg.query_scale}: a Hugging Face DeepSeek-V3 scales q . k by (qk_nope_head_dim "
                         "+ qk_rope_head_dim) ** -0.5, times YaRN's mscale squared (rope_type='yarn', factor > 1) only")
    mscale_all = (math.sqrt(cfg.query_scale / plain) - 1) / (0.1 * math.log(cfg.rope_factor))
    return {**rope, "mscale_all_dim": mscale_all}


def fields_to_hf(cfg: DeepseekConfig, rope: dict) -> dict:
    """The DeepSeek-V3 fields of a config.json beyond the Llama ones (which `hf_config` writes; `rope`: its
    rope_parameters table)."""
    if cfg.n_shared_experts < 1:
        raise ValueError("n_shared_experts=0: a Hugging Face DeepSeek-V3 has at least one shared expert")
    rope = _softmax_scale_to_hf(cfg, rope)
    scaling = None if cfg.rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_parameters": rope, "rope_scaling": scaling, "n_routed_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.expert_d_ff,
            "n_shared_experts": cfg.n_shared_experts, "first_k_dense_replace": cfg.first_dense,
            "n_group": cfg.router_groups, "topk_group": cfg.router_topk_groups,
            "routed_scaling_factor": cfg.routed_scale, "norm_topk_prob": cfg.norm_topk, "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_rope_head_dim,
            "num_key_value_heads": cfg.n_heads, "rope_interleave": True, "output_router_logits": False,
            "num_nextn_predict_layers": 0}


def _stacks(cfg: DeepseekConfig) -> dict[str, tuple[int, int, dict]]:
    """Each block stack's parameter path -> (first layer, layers, {parameter: (Hugging Face suffix, layout)})."""
    attention = {**ATTENTION, **(Q_PLAIN if cfg.q_lora_rank is None else Q_LATENT)}
    stacks = {"blocks/moe": (cfg.first_dense, cfg.n_moe_layers, {**attention, **EXPERTS})}
    if cfg.first_dense:
        stacks = {"blocks/dense": (0, cfg.first_dense, {**attention, **DENSE}), **stacks}
    return stacks


def _layer_shapes(cfg: DeepseekConfig, experts: bool) -> dict[str, tuple[int, ...]]:
    """jaxpar's shapes of one block's parameters (unstacked)."""
    d, h, e, fe = cfg.d_model, cfg.n_heads, cfg.n_experts, cfg.expert_d_ff
    qk, r, rope, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    shapes = {"attn_norm": (d,), "mlp_norm": (d,), "wkv_a": (d, r + rope), "kv_a_norm": (r,),
              "wkv_b": (r, h, cfg.qk_nope_head_dim + v), "wo": (h, v, d)}
    if cfg.q_lora_rank is None:
        shapes["wq"] = (d, h, qk)
    else:
        shapes.update(wq_a=(d, cfg.q_lora_rank), q_a_norm=(cfg.q_lora_rank,), wq_b=(cfg.q_lora_rank, h, qk))
    if not experts:
        return {**shapes, "w_gate": (d, cfg.d_ff), "w_up": (d, cfg.d_ff), "w_down": (cfg.d_ff, d)}
    fs = cfg.shared_d_ff
    return {**shapes, "router": (d, e), "router_correction": (e,), "expert_gate": (e, d, fe),
            "expert_up": (e, d, fe), "expert_down": (e, fe, d), "shared_gate": (d, fs), "shared_up": (d, fs),
            "shared_down": (fs, d)}


def jaxpar_block_shapes(cfg: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """Every block parameter path ('blocks/moe/wkv_b') -> its stacked shape."""
    return {f"{stack}/{name}": (count, *shape) for stack, (_, count, params) in _stacks(cfg).items()
            for name, shape in _layer_shapes(cfg, stack.endswith("moe")).items() if name in params}


def _rope_order(cfg: DeepseekConfig, nope: int) -> np.ndarray:
    """jaxpar's entry j of a [nope part, rotated part] vector is DeepSeek's entry order[j]: the rotated part's
    interleaved pairs into halves (their first members, then their seconds)."""
    rope = cfg.qk_rope_head_dim
    halves = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    return np.concatenate([np.arange(nope), nope + halves])


def _from_torch(t: np.ndarray, layout: str, cfg: DeepseekConfig, shape) -> np.ndarray:
    """One layer's tensor in jaxpar's layout `shape` from torch's."""
    if layout == "vector":
        return t
    if layout == "transpose":
        return t.T
    if layout == "kv_a":  # [r + rope, d] -> [d, r + rope], the rotated rows into halves
        return t[_rope_order(cfg, cfg.kv_lora_rank)].T
    heads, width = shape[1], shape[2]
    if layout == "q_heads":  # [h * (nope + rope), in] -> [in, h, nope + rope], each head's rotated rows into halves
        return t.reshape(heads, width, -1)[:, _rope_order(cfg, cfg.qk_nope_head_dim)].transpose(2, 0, 1)
    if layout == "in_heads":  # [h * k, in] -> [in, h, k]
        return t.reshape(heads, width, -1).transpose(2, 0, 1)
    if layout == "out_heads":  # [d, h * v] -> [h, v, d]
        return t.reshape(t.shape[0], shape[0], shape[1]).transpose(1, 2, 0)
    raise AssertionError(layout)


def _to_torch(a: np.ndarray, layout: str, cfg: DeepseekConfig) -> np.ndarray:
    """The inverse of `_from_torch`."""
    if layout == "vector":
        return a
    if layout == "transpose":
        return a.T
    if layout == "kv_a":
        return a.T[np.argsort(_rope_order(cfg, cfg.kv_lora_rank))]
    if layout == "q_heads":
        return a[:, :, np.argsort(_rope_order(cfg, cfg.qk_nope_head_dim))].transpose(1, 2, 0).reshape(-1, a.shape[0])
    if layout == "in_heads":
        return a.transpose(1, 2, 0).reshape(-1, a.shape[0])
    if layout == "out_heads":
        return a.transpose(2, 0, 1).reshape(a.shape[-1], -1)
    raise AssertionError(layout)


def block_sources(cfg: DeepseekConfig, reader) -> dict:
    """For every block parameter path, a function (stacked shape, index) -> that block of it from the files, read a
    layer (an expert) at a time."""

    def source(first: int, suffix: str, layout: str):
        def read(shape, index):
            layers = range(*index[0].indices(shape[0]))
            rest = tuple(index[1:])

            def one(i):
                name = f"model.layers.{first + i}.{suffix}"
                if "{expert}" not in suffix:
                    return _from_torch(reader.read(name), layout, cfg, shape[1:])[rest]
                experts = range(*rest[0].indices(shape[1]))
                return np.stack([_from_torch(reader.read(name.format(expert=e)), layout, cfg, shape[2:])[rest[1:]]
                                 for e in experts])
            return np.stack([one(i) for i in layers])
        return read

    return {f"{stack}/{name}": source(first, *params[name])
            for stack, (first, _, params) in _stacks(cfg).items() for name in params}


def expected_block_shapes(cfg: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face block tensor name -> its torch shape."""
    shapes = {}
    for stack, (first, count, params) in _stacks(cfg).items():
        layer = _layer_shapes(cfg, stack.endswith("moe"))
        for name, (suffix, layout) in params.items():
            shape = layer[name][1:] if "{expert}" in suffix else layer[name]
            torch_shape = _to_torch(np.empty(shape, np.uint8), layout, cfg).shape
            for i in range(first, first + count):
                for e in range(cfg.n_experts) if "{expert}" in suffix else [None]:
                    shapes[f"model.layers.{i}.{suffix.format(expert=e)}"] = tuple(torch_shape)
    return shapes


def block_tensors(cfg: DeepseekConfig, path: str, read, wanted=None):
    """The Hugging Face tensors (name, torch layout) of one stacked block parameter, a layer (expert) at a time."""
    stack, name = path.rsplit("/", 1)
    first, count, params = _stacks(cfg)[stack]
    suffix, layout = params[name]
    array = read(path)
    for i in range(count):
        for e in range(cfg.n_experts) if "{expert}" in suffix else [None]:
            hf_name = f"model.layers.{first + i}.{suffix.format(expert=e)}"
            if wanted is None or hf_name in wanted:
                yield hf_name, _to_torch(np.asarray(array[i] if e is None else array[i, e]), layout, cfg)

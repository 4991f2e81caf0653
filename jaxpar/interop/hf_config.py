"""A Hugging Face `config.json` as jaxpar's model config and back; what the model cannot represent (biases,
other activations, `pretraining_tp`, rope scaling other than linear and Llama 3's, local layers of no period) is
refused with the config field named. Families: `llama`; `qwen2` (q/k/v biases); `qwen3` (per-head q/k RMSNorm); Qwen's
sliding windows where their local layers repeat with a period; `mistral` (a
Llama with a sliding window); `mixtral` (a Mistral with sparse MoE feed-forwards: `jaxpar.interop.hf_mixtral`);
`qwen3_moe` (a Qwen3 with sparse MoE feed-forwards: `jaxpar.interop.hf_qwen3_moe`); `gemma` (GeGLU, (1 + w)
RMSNorm, embeddings times sqrt(d), tied head); `gemma2` (gemma's, plus post-norms, logit soft-capping and
local/global layers); `gemma3_text` (Gemma 3's text model: gemma2's block with (1 + w) q/k norms, local layers
rotating with their own base, global ones with theirs and its scaling); `llama4_text` (Llama 4's text model: a
Llama with top-1 experts beside a shared one, NoPE layers and chunked attention: `jaxpar.interop.hf_llama4`);
`gpt_oss` (biased attention with sinks, alternating windows, YaRN rotation, biased clamped-SwiGLU experts:
`jaxpar.interop.hf_gpt_oss`); `deepseek_v3` (its own model, `jaxpar.models.deepseek`: latent attention, dense then
DeepSeekMoE blocks: `jaxpar.interop.hf_deepseek_v3`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxpar.interop import hf_deepseek_v3, hf_gpt_oss, hf_llama4, hf_mixtral, hf_qwen3_moe
from jaxpar.models.layer_pattern import layer_window
from jaxpar.models.llama import LlamaConfig
from jaxpar.models.moe import MoeLlamaConfig

HF_CONFIG = "config.json"
# model_type -> the LlamaConfig block options it sets (every option named, so a config maps to one family)
FAMILIES = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
}
# Mistral and Mixtral: Llama blocks with a window on every layer (Mixtral's feed-forwards the experts of
# jaxpar.models.moe); `family_of` tells them from a Llama by the window and the experts
WINDOWED = ("mistral", hf_mixtral.MODEL_TYPE)
FAMILIES.update({name: {"qkv_bias": False, "qk_norm": False} for name in WINDOWED})
GEMMA = {"qkv_bias": False, "qk_norm": False, "mlp_activation": "gelu_tanh", "norm_plus_one": True, "embed_scale": True}
FAMILIES.update({"gemma": {**GEMMA, "post_norms": False}, "gemma2": {**GEMMA, "post_norms": True},
                 "gemma3_text": {**GEMMA, "post_norms": True, "qk_norm": True}})
GEMMA3 = "gemma3_text"
# the MoE families: model_type -> (the dense family whose blocks theirs are, the module of their experts)
MOE = {hf_mixtral.MODEL_TYPE: ("llama", hf_mixtral), hf_qwen3_moe.MODEL_TYPE: ("qwen3", hf_qwen3_moe),
       hf_llama4.MODEL_TYPE: ("llama", hf_llama4)}
FAMILIES[hf_qwen3_moe.MODEL_TYPE] = FAMILIES["qwen3"]
FAMILIES[hf_llama4.MODEL_TYPE] = FAMILIES["llama"]
GPT_OSS = hf_gpt_oss.MODEL_TYPE  # told apart by its attention sinks (`family_of`); its fields: hf_gpt_oss
FAMILIES[GPT_OSS] = {"qkv_bias": True, "qk_norm": False}
DEEPSEEK = hf_deepseek_v3.MODEL_TYPE  # latent attention and DeepSeekMoE: its own model (models.deepseek)
FAMILIES[DEEPSEEK] = FAMILIES["llama"]
# the options a family's entry leaves out are off (a Llama's)
LLAMA_OPTIONS = {"mlp_activation": "silu", "norm_plus_one": False, "embed_scale": False, "post_norms": False}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", GEMMA3: "Gemma3ForCausalLM",
                 "mistral": "MistralForCausalLM", GPT_OSS: hf_gpt_oss.ARCHITECTURE,
                 DEEPSEEK: hf_deepseek_v3.ARCHITECTURE,
                 **{name: module.ARCHITECTURE for name, (_, module) in MOE.items()}}
# Hugging Face activation names -> LlamaConfig.mlp_activation (Gemma's config field, and its legacy "gelu", as
# transformers reads them: GemmaConfig turns hidden_act="gelu" into the tanh approximation)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
GEMMA_ACTIVATIONS = {"gemma": ("hidden_act", {**ACTIVATIONS, "gelu": "gelu_tanh"}),
                     "gemma2": ("hidden_activation", ACTIVATIONS), GEMMA3: ("hidden_activation", ACTIVATIONS)}
GEMMA3_PATTERN = 6  # transformers' sliding_window_pattern, where config.json gives neither it nor layer_types
# LlamaConfig fields beyond the block options -> the families whose Hugging Face config can express them when on
QWEN = ("qwen2", "qwen3")  # use_sliding_window: a window on the layers from max_window_layers on
QWEN_MAX_WINDOW_LAYERS = 28  # transformers' default, where config.json leaves it out
FAMILY_FIELDS = {"final_softcap": ("gemma2", GEMMA3), "attn_softcap": ("gemma2", GEMMA3),
                 "query_scale": ("gemma2", GEMMA3),
                 "sliding_pattern": ("gemma2", GEMMA3, *QWEN, hf_llama4.MODEL_TYPE, GPT_OSS),
                 "sliding_window": ("gemma2", GEMMA3, *QWEN, *WINDOWED, hf_qwen3_moe.MODEL_TYPE, GPT_OSS),
                 "rope_local_theta": (GEMMA3,), **{field: (hf_llama4.MODEL_TYPE,) for field in (
                     "attention_chunk", "global_nope", "temperature_floor", "qk_l2_norm")}}
FIELD_OFF = {"sliding_pattern": 1, "global_nope": False, "qk_l2_norm": False}  # the others are off at None


def family_options(model_type: str) -> dict:
    """Every block option of a family, those its FAMILIES entry leaves out off."""
    return {**LLAMA_OPTIONS, **FAMILIES[model_type]}


def config_from_hf(hf: dict, vocab_multiple: int = 128) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face Llama `config.json`; ValueError naming any field the model cannot represent."""
    source = hf
    model_type = hf.get("model_type", "llama")
    if model_type == "llama4":
        raise ValueError("config.json: model_type='llama4' (Llama 4's multimodal model, vision included) is not "
                         "supported; jaxpar takes its text model, model_type='llama4_text' (Llama4ForCausalLM)")
    if model_type == "gemma3":
        raise ValueError("config.json: model_type='gemma3' (Gemma 3's multimodal model) is not supported; jaxpar "
                         "takes its text model, model_type='gemma3_text' (Gemma3ForCausalLM)")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json: model_type={model_type!r} is not supported; only {sorted(FAMILIES)} are")
    quantization = (hf.get("quantization_config") or {}).get("quant_method")
    if quantization and (model_type, quantization) != (GPT_OSS, "mxfp4"):
        raise ValueError(f"config.json: quantization_config.quant_method={quantization!r} is not supported: jaxpar reads "
                         "unquantized weights, and gpt-oss's MXFP4 experts")
    for field in ("attention_bias", "mlp_bias") if model_type != GPT_OSS else ("mlp_bias",):
        if hf.get(field):
            raise ValueError(f"config.json: {field}=true is not supported: jaxpar's {model_type} has no such bias terms")
    options = family_options(model_type)
    act_field, activations = GEMMA_ACTIVATIONS.get(model_type, ("hidden_act", {"silu": "silu"}))
    act = hf.get(act_field, "gelu_pytorch_tanh" if model_type in GEMMA_ACTIVATIONS else "silu")
    if model_type != GPT_OSS and activations.get(act) != options["mlp_activation"]:  # gpt-oss's experts: their own
        raise ValueError(f"config.json: {act_field}={act!r} is not supported: jaxpar's {model_type} MLP uses "
                         f"{[name for name, ours in activations.items() if ours == options['mlp_activation']]}")
    if model_type in GEMMA_ACTIVATIONS:
        extra = _gemma_fields(hf, model_type)
    elif model_type in QWEN:
        extra = _qwen_window(hf)
    elif model_type == hf_qwen3_moe.MODEL_TYPE:  # transformers' window, when on, is on every layer
        extra = _window_from_hf(hf, model_type) if hf.get("use_sliding_window") else {}
    elif model_type == GPT_OSS:  # alternating, sliding first, as transformers defaults layer_types
        extra = _sliding_pattern({"sliding_window": 128, **hf})
    else:
        extra = _window_from_hf(hf, model_type)
    if hf.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"config.json: pretraining_tp={hf['pretraining_tp']} is not supported (only 1)")
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if field not in hf:
            raise ValueError(f"config.json: {field} is missing")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if model_type == DEEPSEEK:  # its YaRN mscale pair acts on the softmax scale (hf_deepseek_v3), not the rotation
        hf = {**hf, **{field: {k: v for k, v in hf[field].items() if k not in ("mscale", "mscale_all_dim")}
                       for field in ("rope_parameters", "rope_scaling") if hf.get(field)}}
    rope = _gemma3_rope(hf, extra) if model_type == GEMMA3 else _rope_from_hf(hf)
    fields = dict(
        vocab=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim, d_ff=hf["intermediate_size"],
        seq_len=min(hf.get("max_position_embeddings", 2048), 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", model_type in GEMMA_ACTIVATIONS)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), param_dtype="float32", vocab_multiple=vocab_multiple, **rope,
        **options, **extra,
    )
    if model_type == GPT_OSS:
        return MoeLlamaConfig(**{**fields, **hf_gpt_oss.fields_from_hf(hf)})
    if model_type == DEEPSEEK:
        return hf_deepseek_v3.config_from_hf(source, fields)
    if model_type in MOE:
        return MoeLlamaConfig(**{**fields, **MOE[model_type][1].moe_fields_from_hf(hf)})
    return LlamaConfig(**fields)


def _qwen_window(hf: dict) -> dict:
    """Qwen2's and Qwen3's window, as transformers applies it: only under use_sliding_window, on the layers
    `layer_types` marks 'sliding_attention' (without it, those from max_window_layers on).

    jaxpar's local layers repeat with a period (`_sliding_pattern`): every layer local (max_window_layers=0),
    none, or a Gemma 2-like alternation. Global layers first and local ones after (0 < max_window_layers <
    num_hidden_layers, Qwen's own form) have no period, and are refused naming max_window_layers.
    """
    n, given = hf["num_hidden_layers"], hf.get("layer_types")
    if not hf.get("use_sliding_window"):
        local = sorted(set(given or []) - {"full_attention"})
        if local:
            raise ValueError(f"config.json: layer_types {local} with use_sliding_window=false: transformers then "
                             "has no window for those layers")
        return {}
    first = hf.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
    types = given or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if given is None and 0 < first < n:
        raise ValueError(f"config.json: max_window_layers={first} with use_sliding_window=true is not supported: "
                         f"its first {first} layers global and the other {n - first} local have no period; jaxpar's local "
                         "layers repeat with one (layer i global iff (i + 1) % P == 0)")
    return _sliding_pattern({**hf, "layer_types": types})


def _window_from_hf(hf: dict, model_type: str) -> dict:
    """Mistral's and Mixtral's `sliding_window` (null: full causal attention) on every layer; Llama's has none."""
    if model_type not in (*WINDOWED, hf_qwen3_moe.MODEL_TYPE) or hf.get("sliding_window") is None:
        return {}
    return {"sliding_window": int(hf["sliding_window"]), "sliding_pattern": 1}


def _gemma_fields(hf: dict, model_type: str) -> dict:
    """The LlamaConfig fields of a Gemma config beyond the block options: Gemma 2's attention and logit soft-caps."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true is not supported: jaxpar's attention is causal")
    if model_type == "gemma":
        return {}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    scalar = hf.get("query_pre_attn_scalar", 256)
    caps = (30.0, 50.0) if model_type == "gemma2" else (None, None)  # Gemma 3's q/k norms replace the soft caps
    final, attn = hf.get("final_logit_softcapping", caps[0]), hf.get("attn_logit_softcapping", caps[1])
    if model_type == GEMMA3 and not hf.get("layer_types"):  # a Hub config of before layer_types
        every = hf.get("sliding_window_pattern", GEMMA3_PATTERN)
        hf = {**hf, "layer_types": ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                    for i in range(hf["num_hidden_layers"])]}
    return {"final_softcap": None if final is None else float(final),
            "attn_softcap": None if attn is None else float(attn),
            "query_scale": None if scalar == head_dim else float(scalar) ** -0.5, **_sliding_pattern(hf)}


def _sliding_pattern(hf: dict) -> dict:
    """sliding_window and sliding_pattern P (layer i global iff (i + 1) % P == 0) of Gemma 2's (or Qwen's) `layer_types`.

    Without `layer_types`, transformers alternates (sliding first), as Gemma 2 was
    released. Layer types of no such period are refused by name.
    """
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"config.json: layer_types {unknown or types} are not supported: jaxpar knows "
                         f"'sliding_attention' and 'full_attention', one per layer (num_hidden_layers={n})")
    if "sliding_attention" not in types:
        return {}
    window = hf.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json: sliding_window={window!r} with sliding_attention layers: expected an int >= 1")
    period = types.index("full_attention") + 1 if "full_attention" in types else 1
    expected = ["full_attention" if period > 1 and (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    if types != expected:
        raise ValueError(f"config.json: layer_types {types} are not supported: jaxpar's local layers repeat with a "
                         f"period P, layer i global iff (i + 1) % P == 0")
    return {"sliding_window": window, "sliding_pattern": period}


def family_of(cfg: LlamaConfig) -> str:
    """The Hugging Face model_type whose block `cfg`'s options describe (a Llama block with a window on every layer:
    Mistral's; with experts: Mixtral's, a Qwen3 block with experts: Qwen3-MoE's; with attention sinks: gpt-oss's)."""
    if hf_gpt_oss.is_gpt_oss(cfg):
        hf_gpt_oss.fields_to_hf(cfg)  # refuses what gpt-oss cannot express
        return _checked_fields(cfg, GPT_OSS)
    if hf_deepseek_v3.is_deepseek(cfg):
        return DEEPSEEK
    if cfg.attn_out_bias or getattr(cfg, "expert_bias", False) or getattr(cfg, "expert_activation", "silu") != "silu":
        raise ValueError(f"attn_out_bias={cfg.attn_out_bias}, expert_bias={getattr(cfg, 'expert_bias', False)}, "
                         f"expert_activation={getattr(cfg, 'expert_activation', 'silu')!r}: only gpt-oss (attn_sinks="
                         "True) has an output bias, biased experts and the clamped SwiGLU")
    matches = [name for name in FAMILIES if name not in WINDOWED and name not in MOE
               and all(getattr(cfg, option) == value for option, value in family_options(name).items())]
    if not matches:
        options = ", ".join(f"{option}={getattr(cfg, option)!r}" for option in family_options("gemma"))
        raise ValueError(f"no Hugging Face family has the block options {options}")
    family = matches[0]
    if hf_llama4.is_llama4(cfg):
        family = hf_llama4.MODEL_TYPE
    elif hf_mixtral.is_moe(cfg) and cfg.shared_expert:
        raise ValueError("shared_expert=True: the Hugging Face family with a shared expert is Llama 4, whose routing "
                         "is sigmoid_input_gate=True")
    elif hf_mixtral.is_moe(cfg):
        moe = [name for name, (dense, _) in MOE.items() if dense == family]
        if not moe:
            raise ValueError(f"no Hugging Face family has experts on a {family} block (Mixtral's are Llama blocks, "
                             "Qwen3-MoE's Qwen3 blocks)")
        family = moe[0]
    elif family == "llama" and cfg.sliding_window is not None and cfg.sliding_pattern == 1:
        family = "mistral"  # a windowless Mistral is a Llama
    return _checked_fields(cfg, family)


def _checked_fields(cfg: LlamaConfig, family: str) -> str:
    """`family`, once every field `cfg` sets beyond the block options is one its Hugging Face config expresses."""
    for field, families in FAMILY_FIELDS.items():
        if getattr(cfg, field) != FIELD_OFF.get(field) and family not in families:
            raise ValueError(f"{field}={getattr(cfg, field)}: a {family} Hugging Face config cannot express it "
                             f"(only {list(families)} can)")
    return family


def _rope_from_hf(hf: dict) -> dict:
    """rope_theta and scaling fields; transformers 5 keeps them in `rope_parameters`, 4 in `rope_theta`/`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    kinds = {field: table.get("rope_type", table.get("type", "default"))
             for field, table in (("rope_parameters", params), ("rope_scaling", scaling)) if table}
    field, kind = next(((f, k) for f, k in kinds.items() if k != "default"), ("rope_scaling", "default"))
    merged = {**params, **scaling} if field == "rope_scaling" else {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind == "linear":
        return {"rope_theta": float(theta), "rope_type": "linear", "rope_factor": float(merged["factor"])}
    if kind == "yarn":
        return _yarn_from_hf(merged, field, float(theta))
    if kind != "llama3":
        raise ValueError(f"config.json: {field}.rope_type={kind!r} is not supported; only 'default', 'linear', "
                         "'llama3' and 'yarn' are")
    return {
        "rope_theta": float(theta), "rope_type": "llama3", "rope_factor": float(merged["factor"]),
        "rope_low_freq_factor": float(merged["low_freq_factor"]),
        "rope_high_freq_factor": float(merged["high_freq_factor"]),
        "rope_original_max_position": int(merged["original_max_position_embeddings"]),
    }


def _yarn_from_hf(table: dict, field: str, theta: float) -> dict:
    """YaRN's fields (gpt-oss's rotation); DeepSeek's mscale pair and a partial rotation are refused by name."""
    for name in ("mscale", "mscale_all_dim"):
        if table.get(name):
            raise ValueError(f"config.json: {field}.{name}={table[name]} is not supported with rope_type='yarn'")
    if table.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json: {field}.partial_rotary_factor={table['partial_rotary_factor']} is not "
                         "supported: jaxpar rotates the whole head")
    for name in ("factor", "original_max_position_embeddings"):
        if table.get(name) is None:
            raise ValueError(f"config.json: {field}.{name} is missing (rope_type='yarn')")
    factor = table.get("attention_factor")
    return {"rope_theta": theta, "rope_type": "yarn", "rope_factor": float(table["factor"]),
            "rope_original_max_position": int(table["original_max_position_embeddings"]),
            "rope_beta_fast": float(table.get("beta_fast") or 32.0), "rope_beta_slow": float(table.get("beta_slow") or 1.0),
            "rope_truncate": bool(table.get("truncate", True)),
            "rope_attention_factor": None if factor is None else float(factor)}


def _gemma3_rope(hf: dict, attention: dict) -> dict:
    """Gemma 3's rotary fields: the global layers' base and scaling, and the local layers' own base.

    transformers 5 keeps them per layer type in `rope_parameters` ({"full_attention": ..., "sliding_attention":
    ...}); 4 in `rope_theta`, `rope_scaling` (the global layers') and `rope_local_base_freq`. Where every layer
    is local (or global), the model has one rotation: that layer type's.
    """
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
        local = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
    full.setdefault("rope_theta", 1e6)
    local.setdefault("rope_theta", 1e4)
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise ValueError(f"config.json: rope_parameters.sliding_attention.rope_type={kind!r} is not supported: "
                         "jaxpar's local layers rotate unscaled ('default')")
    if "sliding_window" not in attention:  # no local layer
        return _rope_from_hf({"rope_parameters": full})
    if attention["sliding_pattern"] == 1:  # no global layer
        return {"rope_theta": float(local["rope_theta"])}
    return {**_rope_from_hf({"rope_parameters": full}), "rope_local_theta": float(local["rope_theta"])}


def config_to_hf(cfg: LlamaConfig, dtype: str = "float32", source: dict | None = None) -> dict:
    """A Hugging Face `config.json` for `cfg` in its family's architecture, readable by transformers 4 and 5.

    With `source`, the config.json the weights were imported from, its every field is written back as it was
    (token ids, `max_position_embeddings`, Mixtral's `router_aux_loss_coef`, Qwen's `max_window_layers`, ...)
    except those `cfg` changes: where `cfg` maps to another value than the source's own config does. Training
    on shorter sequences changes no field; on longer ones, `max_position_embeddings`. The dtype is the files'.
    """
    fields = _config_to_hf(cfg, dtype)
    if source is None:
        return fields
    imported = _config_to_hf(dataclasses.replace(config_from_hf(source), seq_len=cfg.seq_len), dtype)
    changed = {k: v for k, v in fields.items() if k not in imported or imported[k] != v}
    merged = {k: v for k, v in {**source, **changed, "torch_dtype": dtype, "dtype": dtype}.items()
              if k != "quantization_config"}  # the weights are written unquantized (gpt-oss's MXFP4 experts)
    if cfg.seq_len > source.get("max_position_embeddings", cfg.seq_len):
        merged["max_position_embeddings"] = cfg.seq_len
    return merged


def _config_to_hf(cfg: LlamaConfig, dtype: str) -> dict:
    """Every field of `config_to_hf` for `cfg` alone."""
    family = family_of(cfg)
    rope = _rope_to_hf(cfg)
    return {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_parameters": rope, "max_position_embeddings": max(cfg.seq_len, cfg.rope_original_max_position
                                                                 if cfg.rope_type == "llama3" else cfg.seq_len),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "pretraining_tp": 1, "torch_dtype": dtype, "dtype": dtype,
        **(_qwen_window_to_hf(cfg) if family in QWEN else {}),
        **({"sliding_window": cfg.sliding_window} if family in WINDOWED else {}),
        **(MOE[family][1].moe_fields_to_hf(cfg) if family in MOE else {}),
        **(_gpt_oss_to_hf(cfg) if family == GPT_OSS else {}),
        **(hf_deepseek_v3.fields_to_hf(cfg, rope) if family == DEEPSEEK else {}),
        **(_qwen3_moe_window_to_hf(cfg) if family == hf_qwen3_moe.MODEL_TYPE else {}),
        **(_gemma_to_hf(cfg, family) if family in GEMMA_ACTIVATIONS else {}),
    }


def _rope_to_hf(cfg: LlamaConfig) -> dict:
    """The (global layers') rotation as a Hugging Face rope_parameters table."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "linear":
        rope.update(rope_type="linear", factor=cfg.rope_factor)
    if cfg.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rope_factor, beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                    truncate=cfg.rope_truncate, original_max_position_embeddings=cfg.rope_original_max_position,
                    **({} if cfg.rope_attention_factor is None else {"attention_factor": cfg.rope_attention_factor}))
    if cfg.rope_type == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position)
    return rope


def _gpt_oss_to_hf(cfg: LlamaConfig) -> dict:
    """gpt-oss's own fields: biases, experts and their SwiGLU (hf_gpt_oss), and each layer's type."""
    types = ["full_attention" if layer_window(cfg, i) is None else "sliding_attention" for i in range(cfg.n_layers)]
    return {**hf_gpt_oss.fields_to_hf(cfg), "sliding_window": cfg.sliding_window or cfg.seq_len, "layer_types": types}


def _qwen_window_to_hf(cfg: LlamaConfig) -> dict:
    """Qwen's window fields: off, or on with each layer's type (max_window_layers=0 when every layer is local)."""
    if cfg.sliding_window is None:
        return {"use_sliding_window": False, "sliding_window": None}
    types = ["full_attention" if layer_window(cfg, i) is None else "sliding_attention" for i in range(cfg.n_layers)]
    return {"use_sliding_window": True, "sliding_window": cfg.sliding_window, "layer_types": types,
            **({"max_window_layers": 0} if cfg.sliding_pattern == 1 else {})}


def _qwen3_moe_window_to_hf(cfg: LlamaConfig) -> dict:
    """Qwen3-MoE's window fields: off, or on every layer."""
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window}


def _gemma_to_hf(cfg: LlamaConfig, family: str) -> dict:
    """A Gemma config's own fields: its activation field, and Gemma 2's scaling, soft-capping and layer types."""
    fields = {"hidden_act": "gelu_pytorch_tanh", "use_bidirectional_attention": None}
    if family == GEMMA3:  # the rotations per layer type (transformers 5's form, and 4's fields beside)
        local = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
        fields.update(rope_parameters={"full_attention": _rope_to_hf(cfg),
                                       "sliding_attention": {"rope_type": "default", "rope_theta": local}},
                      rope_local_base_freq=local, use_bidirectional_attention=False)
    if family in ("gemma2", GEMMA3):
        scalar = cfg.head_dim if cfg.query_scale is None else round(cfg.query_scale ** -2, 6)
        scalar = int(scalar) if float(scalar).is_integer() else scalar
        types = ["full_attention" if layer_window(cfg, i) is None else "sliding_attention" for i in range(cfg.n_layers)]
        fields.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                      attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
                      sliding_window=cfg.sliding_window or cfg.seq_len, layer_types=types)  # window unused if global
    return fields


def read_hf_config(directory) -> dict:
    path = Path(directory) / HF_CONFIG
    if not path.is_file():
        raise ValueError(f"{directory}: no {HF_CONFIG}; expected a Hugging Face model directory")
    return json.loads(path.read_text())


def is_hf_dir(path) -> bool:
    """A Hugging Face model directory: config.json with a model_type, and safetensors files."""
    path = Path(path)
    if not (path / HF_CONFIG).is_file():
        return False
    return "model_type" in json.loads((path / HF_CONFIG).read_text())


def resolve_source(source: str) -> Path:
    """A local directory as is; otherwise a Hub repo id, downloaded with huggingface_hub (config and safetensors)."""
    path = Path(source)
    if path.is_dir():
        return path
    if source.startswith(("/", ".", "~")) or source.count("/") != 1:
        raise ValueError(f"{source!r}: no such directory (and not a Hub repo id like 'meta-llama/Llama-3.2-1B')")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise ValueError(f"{source!r} is not a directory, and huggingface_hub is not installed to download it") from error
    try:
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as error:  # network, authentication or missing repo: say which
        raise ValueError(f"{source!r} is not a directory and could not be downloaded: {error}") from error

"""A Hugging Face `config.json` as jaxpar's model config and back; what the model cannot represent (biases,
other activations, `pretraining_tp`, rope scaling other than Llama 3's, Qwen's sliding windows) is refused with
the config field named. Families: `llama`; `qwen2` (q/k/v biases); `qwen3` (per-head q/k RMSNorm); `mistral` (a
Llama, with a sliding window); `mixtral` (a Mistral with sparse MoE feed-forwards: `jaxpar.interop.hf_mixtral`).
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxpar.interop import hf_mixtral
from jaxpar.models.llama import LlamaConfig
from jaxpar.models.moe import MoeLlamaConfig

HF_CONFIG = "config.json"
# model_type -> the LlamaConfig block options it sets (every option named, so a config maps to one family)
FAMILIES = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Mistral and Mixtral: Llama blocks (Mixtral's feed-forwards the experts of jaxpar.models.moe)
FAMILIES.update({"mistral": {"qkv_bias": False, "qk_norm": False}, "mixtral": {"qkv_bias": False, "qk_norm": False}})
ARCHITECTURES.update({"mistral": "MistralForCausalLM", hf_mixtral.MODEL_TYPE: hf_mixtral.ARCHITECTURE})


def config_from_hf(hf: dict, vocab_multiple: int = 128) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face Llama `config.json`; ValueError naming any field the model cannot represent."""
    model_type = hf.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json: model_type={model_type!r} is not supported; only {sorted(FAMILIES)} are")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise ValueError(f"config.json: {field}=true is not supported: jaxpar's {model_type} has no such bias terms")
    _refuse_sliding_window(hf)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r} is not supported: jaxpar's Llama MLP uses SiLU (SwiGLU)")
    if hf.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"config.json: pretraining_tp={hf['pretraining_tp']} is not supported (only 1)")
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if field not in hf:
            raise ValueError(f"config.json: {field} is missing")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rope = _rope_from_hf(hf)
    fields = dict(
        vocab=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim, d_ff=hf["intermediate_size"],
        seq_len=min(hf.get("max_position_embeddings", 2048), 2048), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), param_dtype="float32", vocab_multiple=vocab_multiple, **rope,
        **FAMILIES[model_type], **_window_from_hf(hf, model_type),
    )
    if model_type == hf_mixtral.MODEL_TYPE:
        return MoeLlamaConfig(**fields, **hf_mixtral.moe_fields_from_hf(hf))
    return LlamaConfig(**fields)


def _refuse_sliding_window(hf: dict) -> None:
    """Qwen configs carry sliding-window fields; jaxpar's attention is full causal, so only 'off' is accepted."""
    if hf.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported: jaxpar's attention is full causal")
    other = sorted(set(hf.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if other:
        raise ValueError(f"config.json: layer_types {other} are not supported; only 'full_attention' is")


def _window_from_hf(hf: dict, model_type: str) -> dict:
    """Mistral's and Mixtral's `sliding_window` (null: full causal attention) on every layer; others' refused above."""
    if model_type not in ("mistral", "mixtral") or hf.get("sliding_window") is None:
        return {}
    return {"sliding_window": int(hf["sliding_window"]), "sliding_pattern": 1}


def family_of(cfg: LlamaConfig) -> str:
    """The Hugging Face model_type whose block `cfg`'s options describe (a dense Llama block: `llama`)."""
    if hf_mixtral.is_moe(cfg):
        return hf_mixtral.MODEL_TYPE
    matches = [name for name, options in FAMILIES.items() if name not in ("mistral", "mixtral")
               and all(getattr(cfg, option) == value for option, value in options.items())]
    if not matches:
        raise ValueError(f"no Hugging Face family has qkv_bias={cfg.qkv_bias} and qk_norm={cfg.qk_norm}")
    if cfg.sliding_window is not None:  # a window on every layer: Mistral's (a windowless Mistral is a Llama)
        if matches[0] != "llama" or cfg.sliding_pattern != 1:
            raise ValueError(f"no Hugging Face family has sliding_window={cfg.sliding_window} with "
                             f"sliding_pattern={cfg.sliding_pattern} on a {matches[0]} block")
        return "mistral"
    return matches[0]


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
    if kind != "llama3":
        raise ValueError(f"config.json: {field}.rope_type={kind!r} is not supported; only 'default' and 'llama3' are")
    return {
        "rope_theta": float(theta), "rope_type": "llama3", "rope_factor": float(merged["factor"]),
        "rope_low_freq_factor": float(merged["low_freq_factor"]),
        "rope_high_freq_factor": float(merged["high_freq_factor"]),
        "rope_original_max_position": int(merged["original_max_position_embeddings"]),
    }


def config_to_hf(cfg: LlamaConfig, dtype: str = "float32") -> dict:
    """A Hugging Face `config.json` for `cfg` in its family's architecture, readable by transformers 4 and 5."""
    family = family_of(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position)
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
        **({"use_sliding_window": False, "sliding_window": None} if family in ("qwen2", "qwen3") else {}),
        **({"sliding_window": cfg.sliding_window} if family in ("mistral", hf_mixtral.MODEL_TYPE) else {}),
        **(hf_mixtral.moe_fields_to_hf(cfg) if family == hf_mixtral.MODEL_TYPE else {}),
    }


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

"""Reference models, by name: each entry is (constructor, default config).

Models name dimensions logically and never a mesh axis; any config field can be
overridden (e.g. from the `[model]` table of a `--config` TOML file).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx

from jaxpar.models.deepseek import CONFIGS as DEEPSEEK_CONFIGS
from jaxpar.models.deepseek import DeepseekV3
from jaxpar.models.llama import CONFIGS as LLAMA_CONFIGS
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.models.moe import CONFIGS as MOE_CONFIGS
from jaxpar.models.moe import MoeLlama

# The published shapes of the Hugging Face families (jaxpar.interop.hf_config), for `plan` and `inspect`;
# mixtral-8x7b is an MoE config (jaxpar.models.moe).
FAMILY_CONFIGS: dict[str, LlamaConfig] = {
    "mistral-7b": LlamaConfig(vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                              d_ff=14336, seq_len=4096, rope_theta=10000.0, sliding_window=4096),  # v0.1's window
    "qwen2.5-7b": LlamaConfig(vocab=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                              d_ff=18944, seq_len=4096, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    "qwen3-8b": LlamaConfig(vocab=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                            d_ff=12288, seq_len=4096, rope_theta=1e6, norm_eps=1e-6, qk_norm=True),
    # Gemma 2 9B (google/gemma-2-9b): local (4096-token window) and global layers alternating, soft caps 50
    # (attention) and 30 (logits), query_pre_attn_scalar 256 = head_dim (the default scale).
    "gemma2-9b": LlamaConfig(vocab=256000, d_model=3584, n_layers=42, n_heads=16, n_kv_heads=8, head_dim=256,
                             d_ff=14336, seq_len=8192, tie_embeddings=True, norm_eps=1e-6, mlp_activation="gelu_tanh",
                             norm_plus_one=True, embed_scale=True, post_norms=True, final_softcap=30.0,
                             attn_softcap=50.0, sliding_window=4096, sliding_pattern=2),
    # Gemma 3 1B (google/gemma-3-1b-pt, text): (1 + w) q/k norms in place of soft caps, 5 local layers (512-token
    # window, rotary base 10k) to 1 global (base 1M), 26 layers: the last two local.
    "gemma3-1b": LlamaConfig(vocab=262144, d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256,
                             d_ff=6912, seq_len=8192, tie_embeddings=True, norm_eps=1e-6, mlp_activation="gelu_tanh",
                             norm_plus_one=True, embed_scale=True, post_norms=True, qk_norm=True, rope_theta=1e6,
                             rope_local_theta=1e4, sliding_window=512, sliding_pattern=6),
}

MODELS: dict[str, tuple[Callable[..., nnx.Module], Any]] = {
    **{name: (Llama, config) for name, config in LLAMA_CONFIGS.items()},
    **{name: (Llama, config) for name, config in FAMILY_CONFIGS.items()},
    **{name: (MoeLlama, config) for name, config in MOE_CONFIGS.items()},
    **{name: (DeepseekV3, config) for name, config in DEEPSEEK_CONFIGS.items()},
}


def model_config(name: str, overrides: dict | None = None):
    """The named config with `overrides` applied; unknown names or fields are errors."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    config = MODELS[name][1]
    overrides = dict(overrides or {})
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} for model {name!r}; fields: {sorted(fields)}")
    return dataclasses.replace(config, **overrides)


def model_factory(name: str, config, seed: int) -> Callable[[], nnx.Module]:
    """A zero-argument constructor (what jaxpar.train.state.init_state takes)."""
    constructor = MODELS[name][0]
    return lambda: constructor(config, nnx.Rngs(seed))

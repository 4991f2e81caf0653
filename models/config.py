"""The Llama family's config: sizes, rotary scaling and the family options (Qwen, Gemma, Mistral, Llama 4), checked
on creation.

Its own module so that the block arithmetic (`models.block`), the inference forward (`models.inference`) and
the model (`models.llama`) all read it without importing one another in a cycle.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxpar.models import layer_pattern

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "none")  # "none": no rotation (a NoPE layer of Llama 4)
# the MLP's gate activation: SiLU (SwiGLU: Llama, Qwen, Mistral) or GELU's tanh approximation (GeGLU: Gemma)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 8
    d_ff: int = 128
    seq_len: int = 64
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    param_dtype: str = "float32"
    vocab_multiple: int = 128  # embedding rows padded to a multiple (Megatron's make-vocab-size-divisible-by)
    # Rotary scaling: "default" (none), "linear" (every frequency divided by rope_factor: Gemma 3's global layers)
    # or "llama3" (Llama 3.1's wavelength-dependent frequency scaling).
    rope_type: str = "default"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # YaRN (rope_type="yarn", gpt-oss): the ramp's ends in rotations, whether they are rounded outwards, and the
    # factor on cos and sin (None: 0.1 ln(rope_factor) + 1); rope_factor and rope_original_max_position as above.
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float | None = None
    # Family options (default off: a Llama). qkv_bias: biases on the q/k/v projections (Qwen2);
    # qk_norm: an RMSNorm over head_dim on each query and key head before the rotation (Qwen3).
    qkv_bias: bool = False
    qk_norm: bool = False
    # Gemma: mlp_activation="gelu_tanh"; norm_plus_one: every RMSNorm scales by (1 + w), w stored as Gemma stores it;
    # embed_scale: embeddings times sqrt(d_model) in the compute dtype. Gemma 2 adds post_norms (an RMSNorm on the
    # attention's and the MLP's outputs before each residual add) and final_softcap (logits = c * tanh(logits / c)).
    mlp_activation: str = "silu"
    norm_plus_one: bool = False
    embed_scale: bool = False
    post_norms: bool = False
    final_softcap: float | None = None
    # Attention options (default off). sliding_window W: a local layer's query sees the W latest keys, itself
    # included (Mistral, Gemma 2); sliding_pattern P: with a window, every layer is local (P = 1, Mistral) or
    # layer i is global when (i + 1) % P == 0 and local otherwise (P = 2: Gemma 2's alternation);
    # attn_softcap c: scores -> c * tanh(scores / c) (Gemma 2's attn_logit_softcapping); query_scale: the
    # multiplier of q . k, None for head_dim ** -0.5 (Gemma 2: query_pre_attn_scalar ** -0.5).
    sliding_window: int | None = None
    sliding_pattern: int = 1
    attn_softcap: float | None = None
    query_scale: float | None = None
    # rope_local_theta: the local layers' own rotary base, unscaled, beside global layers that keep rope_theta and
    # its scaling (Gemma 3's rope_local_base_freq); None: every layer rotates alike.
    rope_local_theta: float | None = None
    # Llama 4: attention_chunk C: a local layer's query sees the earlier keys of its own chunk of C positions;
    # global_nope: the global layers rotate not (NoPE), and temperature_floor F scales their queries by
    # log1p(floor((position + 1) / F)) * temperature_scale + 1; qk_l2_norm: a weightless RMSNorm on the q and k heads
    # of the rotating layers, after the rotation.
    attention_chunk: int | None = None
    global_nope: bool = False
    temperature_floor: float | None = None
    temperature_scale: float = 0.1
    qk_l2_norm: bool = False
    # gpt-oss: attn_sinks, a learned logit per query head in each softmax's denominator
    # (jaxpar.parallel.attention_math.sink_weight); attn_out_bias, a bias on the output projection.
    attn_sinks: bool = False
    attn_out_bias: bool = False

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1, got {self.vocab_multiple}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.mlp_activation not in ACTIVATIONS:
            raise ValueError(f"mlp_activation must be one of {tuple(ACTIVATIONS)}, got {self.mlp_activation!r}")
        if self.final_softcap is not None and not self.final_softcap > 0:
            raise ValueError(f"final_softcap must be None or > 0, got {self.final_softcap}")
        layer_pattern.check(self)

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and columns of the head: the vocabulary rounded up so it splits over tensor.

        Padded entries are never looked up and are masked out of the softmax, so
        the model computes the same function as with `vocab` rows.
        """
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple

    def param_count(self) -> int:
        d, h, kv, hd, f, v, n = (self.d_model, self.n_heads, self.n_kv_heads, self.head_dim,
                                 self.d_ff, self.padded_vocab, self.n_layers)
        block = 2 * d + d * hd * (h + 2 * kv) + h * hd * d + 3 * d * f
        block += hd * (h + 2 * kv) * self.qkv_bias + 2 * hd * self.qk_norm + 2 * d * self.post_norms
        block += h * self.attn_sinks + d * self.attn_out_bias
        return n * block + v * d * (1 if self.tie_embeddings else 2) + d


CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "small": LlamaConfig(d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=768, seq_len=256),
    "1b": LlamaConfig(vocab=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                      d_ff=8192, seq_len=2048),
    "7b": LlamaConfig(vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                      d_ff=11008, seq_len=4096),
    "8b": LlamaConfig(vocab=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                      d_ff=14336, seq_len=8192, rope_theta=500000.0),  # Llama 3's 8B shapes
    "70b": LlamaConfig(vocab=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                       d_ff=28672, seq_len=4096),
    "405b": LlamaConfig(vocab=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, head_dim=128,
                        d_ff=53248, seq_len=8192, rope_theta=500000.0),
}


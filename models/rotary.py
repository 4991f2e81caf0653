"""Rotary position embeddings: the half-split rotation of Llama and Hugging Face, and its frequencies.

Plain theta ** (-i / half) frequencies, divided by a factor (`rope_type="linear"`, Gemma 3's global layers),
Llama 3.1's wavelength-dependent scaling (`rope_type="llama3"` on a models.llama.LlamaConfig), YaRN's
(`rope_type="yarn"`, gpt-oss): frequencies between interpolated and kept by a linear ramp over the dimensions,
and cos and sin scaled by an attention factor (`rope_attention_factor`), as Hugging Face's
`_compute_yarn_parameters` does, or none at all (`rope_type="none"`: Llama 4's NoPE layers, zero frequencies).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def rope_frequencies(cfg, head_dim: int | None = None) -> np.ndarray:
    """The rotary inverse frequencies (float32, head_dim / 2 of them): divided by `rope_factor` under
    rope_type="linear" (position interpolation), Llama-3.1-scaled under rope_type="llama3".

    llama3 divides the low frequencies (wavelength beyond original/low_freq_factor)
    by `rope_factor`, keeps the high ones (below original/high_freq_factor) and
    interpolates smoothly between, as Meta's and Hugging Face's reference code do.
    """
    dim = cfg.head_dim if head_dim is None else head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    inv = inv.astype(np.float32)
    if cfg.rope_type == "none":  # every angle 0: the rotation is the identity
        return np.zeros_like(inv)
    if cfg.rope_type == "default":
        return inv
    if cfg.rope_type == "linear":
        return (inv / np.float32(cfg.rope_factor)).astype(np.float32)
    if cfg.rope_type == "yarn":
        return _yarn_frequencies(cfg, dim)
    factor, low, high = np.float32(cfg.rope_factor), np.float32(cfg.rope_low_freq_factor), np.float32(cfg.rope_high_freq_factor)
    original = np.float32(cfg.rope_original_max_position)
    wavelen = np.float32(2 * np.pi) / inv
    scaled = np.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_frequencies(cfg, dim: int) -> np.ndarray:
    """YaRN's frequencies: dimension i keeps theta's (extrapolation) below the ramp from the correction
    dimension of `rope_beta_fast` rotations to that of `rope_beta_slow`, takes theta's / factor (interpolation)
    above it, and blends linearly on it (the ends floored and ceiled under `rope_truncate`)."""
    theta, factor, original = cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_position

    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(cfg.rope_beta_fast), correction(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # Hugging Face's guard against a zero-width ramp
    powers = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)
    blended = 1.0 / (np.float32(factor) * powers) * (1 - keep) + 1.0 / powers * keep
    return blended.astype(np.float32)


def attention_factor(cfg) -> float:
    """The factor YaRN scales cos and sin by (so scores by its square): `rope_attention_factor`, by default
    0.1 ln(factor) + 1 (1 for a factor <= 1); 1 for the other rope types."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return float(cfg.rope_attention_factor)
    return 1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1.0


def rotary(x, positions, theta, inv_freq=None, scale: float = 1.0):
    """Rotary position embedding on the last dimension of [batch, seq, heads, head_dim].

    `positions` is [seq] (shared by the batch) or [batch, seq]; `inv_freq`
    (see `rope_frequencies`) overrides the plain theta ** (-i / half) frequencies; `scale` multiplies cos and
    sin (YaRN's `attention_factor`).
    """
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half) if inv_freq is None else jnp.asarray(inv_freq)
    positions = positions if positions.ndim == 2 else positions[None, :]
    angles = positions[..., None].astype(jnp.float32) * freqs
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    if scale != 1.0:
        sin, cos = sin * jnp.float32(scale), cos * jnp.float32(scale)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

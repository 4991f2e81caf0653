"""Rotary position embeddings: the half-split rotation of Llama and Hugging Face, and its frequencies.

Plain theta ** (-i / half) frequencies, divided by a factor (`rope_type="linear"`, Gemma 3's global layers), or
Llama 3.1's wavelength-dependent scaling (`rope_type="llama3"` on a models.llama.LlamaConfig), or none at all
(`rope_type="none"`: Llama 4's NoPE layers, zero frequencies).
"""

from __future__ import annotations

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
    factor, low, high = np.float32(cfg.rope_factor), np.float32(cfg.rope_low_freq_factor), np.float32(cfg.rope_high_freq_factor)
    original = np.float32(cfg.rope_original_max_position)
    wavelen = np.float32(2 * np.pi) / inv
    scaled = np.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary(x, positions, theta, inv_freq=None):
    """Rotary position embedding on the last dimension of [batch, seq, heads, head_dim].

    `positions` is [seq] (shared by the batch) or [batch, seq]; `inv_freq`
    (see `rope_frequencies`) overrides the plain theta ** (-i / half) frequencies.
    """
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half) if inv_freq is None else jnp.asarray(inv_freq)
    positions = positions if positions.ndim == 2 else positions[None, :]
    angles = positions[..., None].astype(jnp.float32) * freqs
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

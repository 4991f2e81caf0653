"""Frozen weights stored in fewer bits for QLoRA: int8 and 4-bit NormalFloat (NF4) with a scale per block.

A weight's last dimension is cut into blocks (64 values by default, as in the
QLoRA paper); each block keeps its absolute maximum as an fp32 scale and each
value a code: an int8 of value / (absmax / 127), or the index of the nearest
of NF4's 16 levels to value / absmax, two codes to a byte. Blocks run along the
last dimension only, so a weight split over its other dimensions, or over the
last one in whole blocks, quantizes and dequantizes shard by shard with no
communication. `dequantize` restores the compute dtype where a layer uses the
weight, so only that layer's full-width copy ever exists.

NF4 (Dettmers et al., "QLoRA", 2023, section 3 and appendix E) places its levels
at quantiles of N(0, 1) normalised to [-1, 1], 8 on the positive side and 7 on
the negative, with an exact zero: each level is equally likely for normally
distributed weights. `normal_float_levels` builds them from that definition;
`NF4` is the published table (bitsandbytes' `create_normal_map`), which the
tests hold equal.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("int8", "nf4")
BLOCK = 64  # values per scale (the QLoRA paper's block size)
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)
NF4_OFFSET = 0.9677083  # the outermost quantile: 1/2 (1/30 + 1/32) in from each tail, as the paper sets it


def normal_float_levels(offset: float = NF4_OFFSET) -> np.ndarray:
    """NF4's 16 levels from their definition: quantiles of N(0, 1), 8 positive, 7 negative and 0, scaled to [-1, 1]."""
    from scipy.special import ndtri  # here, not at import: scipy.special costs every start a quarter second

    positive = ndtri(np.linspace(offset, 0.5, 9)[:-1])  # in float64, as the published table was computed
    negative = -ndtri(np.linspace(offset, 0.5, 8)[:-1])
    levels = np.sort(np.concatenate([positive, [0.0], negative]))
    return (levels / levels.max()).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight as codes and per-block scales: int8 codes [..., n], or NF4 codes two to a uint8 [..., n / 2];
    fp32 scales [..., n / block]."""

    codes: jax.Array
    scales: jax.Array
    kind: str = dataclasses.field(metadata={"static": True})
    block: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for."""
        return (*self.scales.shape[:-1], self.scales.shape[-1] * self.block)

    @property
    def nbytes(self) -> int:
        return self.codes.size * self.codes.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize


def bytes_per_value(kind: str, block: int = BLOCK) -> float:
    """Bytes a quantized weight takes per value it stands for: the code and its share of the block's scale."""
    check_kind(kind)
    return (1.0 if kind == "int8" else 0.5) + 4 / block


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"quantized base dtype must be one of {', '.join(KINDS)}, got {kind!r}")


def check_shape(shape, kind: str, block: int = BLOCK, name: str = "the weight") -> None:
    """Refuse a weight whose last dimension is not a whole number of blocks."""
    check_kind(kind)
    if not shape or shape[-1] % block:
        raise ValueError(f"{kind} quantization cuts {name}'s last dimension into blocks of {block} values, but "
                         f"{name} has shape {list(shape)}: {shape[-1] if shape else 0} is not a multiple of {block}")


def quantize(w, kind: str, block: int = BLOCK) -> Quantized:
    """`w` as `kind` codes with an absmax scale per `block` values of its last dimension."""
    check_shape(w.shape, kind, block)
    blocks = jnp.asarray(w, jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // block, block)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    safe = jnp.where(absmax > 0, absmax, 1.0)[..., None]
    if kind == "int8":
        codes = jnp.clip(jnp.round(blocks / safe * 127), -127, 127).astype(jnp.int8).reshape(w.shape)
    else:
        codes = _pack(nearest_nf4(blocks / safe).reshape(w.shape))
    return Quantized(codes, absmax, kind, block)


def dequantize(q: Quantized, dtype=jnp.float32) -> jax.Array:
    """The weight `q` stands for, in `dtype`: each code's value times its block's scale."""
    if q.kind == "int8":
        values = q.codes.astype(jnp.float32) / 127
    else:
        values = jnp.take(jnp.asarray(NF4), _unpack(q.codes).astype(jnp.int32))
    blocks = values.reshape(*q.scales.shape, q.block) * q.scales[..., None]
    return blocks.reshape(q.shape).astype(dtype)


def nearest_nf4(x) -> jax.Array:
    """The index of the NF4 level nearest to each x in [-1, 1] (uint8): x compared with the midpoints between levels."""
    midpoints = jnp.asarray((NF4[1:] + NF4[:-1]) / 2)
    return jnp.searchsorted(midpoints, x).astype(jnp.uint8)


def _pack(codes) -> jax.Array:
    """4-bit codes [..., n] (n even) -> bytes [..., n / 2], the even position in the high nibble."""
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def _unpack(packed) -> jax.Array:
    high, low = packed >> 4, packed & 0xF
    return jnp.stack([high, low], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)

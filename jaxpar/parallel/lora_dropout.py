"""LoRA dropout: PEFT's y = x W + (alpha / r) dropout(x) A B, on the branch's input only, in training only.

A folded weight W + (alpha / r) A B cannot carry a dropout of the branch's
input, so with the plan's `lora_dropout` p > 0 the training step's layer scan
leaves each adapted weight as an `Adapted` (W beside its adapters,
`jaxpar.parallel.lora.fold`), and the tensor layers that multiply by it
(`jaxpar.parallel.tensor.column_parallel` / `row_parallel`) add `branch`:
((x * keep / (1 - p)) A) B * (alpha / r). Evaluation, generation and export
never see the seeds below, so they fold as before: no dropout.

The mask depends on global coordinates only, so every plan of the same global
batch draws the same one (any data, ZeRO, tensor or pipeline layout, any
microbatching): the step draws one uint32 per token of the global batch before
it is split, seeds = jax.random.bits(fold_in(key(seed), step), [batch, seq]),
and the seeds travel with their tokens as a document field (`SEEDS`,
jaxpar.parallel.documents) into every rank, microbatch and pipeline slot. Each
adapted weight holds a per-layer salt (`w_lora_salt`, crc32 of 'path/layer',
travelling with its layer like the scale). Input feature i (the flat index over
the weight's input dimensions) of a token is kept iff
    mix(mix(seed ^ salt) + i * 0x9E3779B9) >= round(p * 2**32),
mix being MurmurHash3's 32-bit finalizer.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.trace import active_plan
from jaxpar.parallel import documents

SEEDS = "lora_dropout_seeds"  # the batch's document field of per-token uint32 seeds (training only)
GOLDEN = 0x9E3779B9


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Adapted:
    """One layer's adapted weight whose branch runs apart: W, A [in..., r], B [r, out...], alpha / r, the salt."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: jax.Array
    salt: jax.Array

    @property
    def ndim(self) -> int:
        return self.w.ndim


def salts(path: str, stack: tuple[int, ...]) -> np.ndarray:
    """int32 [stack...]: crc32 of 'path/l' for each layer l of a weight's stack (31 bits, so it fits int32)."""
    flat = [zlib.crc32(f"{path}/{i}".encode()) & 0x7FFFFFFF for i in range(math.prod(stack))]
    return np.asarray(flat, np.int32).reshape(stack)


def rate() -> float:
    """The dropout rate of the rows being traced: the plan's lora_dropout in a training step, else 0."""
    plan = active_plan()
    return plan.lora_dropout if plan is not None and documents.get(SEEDS) is not None else 0.0


def with_seeds(batch, lora_dropout: float, seed: int, step):
    """The batch with its per-token seeds (`SEEDS`) for a step with lora_dropout > 0; else as it is."""
    if not lora_dropout:
        return batch
    if not isinstance(batch, Mapping) or "inputs" not in batch:
        raise ValueError("lora_dropout draws a mask per token of the batch's 'inputs'; this batch has no 'inputs'")
    key = jax.random.fold_in(jax.random.key(seed), step)
    return {**batch, SEEDS: jax.random.bits(key, jnp.shape(batch["inputs"]), jnp.uint32)}


def _mix(h):
    """MurmurHash3's 32-bit finalizer (uint32 in, uint32 out)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def dropped(x, salt, p: float):
    """x [batch, seq, in...] with each input feature of each token kept with probability 1 - p (scaled by
    1 / (1 - p)) or zeroed, by the rule in this module's docstring."""
    seeds = documents.get(SEEDS)
    if seeds.shape != x.shape[:2]:
        raise ValueError(f"lora_dropout: the batch's seeds {list(seeds.shape)} and the branch's input "
                         f"{list(x.shape)} differ in batch or sequence")
    n = math.prod(x.shape[2:])
    token = _mix(seeds.astype(jnp.uint32) ^ salt.astype(jnp.uint32))
    feature = jnp.arange(n, dtype=jnp.uint32).reshape(x.shape[2:]) * jnp.uint32(GOLDEN)
    bits = _mix(token.reshape(*token.shape, *(1,) * (x.ndim - 2)) + feature)
    keep = bits >= jnp.uint32(min(round(p * 2**32), 2**32 - 1))
    return jnp.where(keep, x / jnp.asarray(1 - p, x.dtype), jnp.zeros((), x.dtype))


def split(weights) -> tuple[list, list]:
    """(the plain weights, each one's `Adapted` or None) of a list of weights."""
    return [w.w if isinstance(w, Adapted) else w for w in weights], [w if isinstance(w, Adapted) else None
                                                                      for w in weights]


def branch(x, adapted: Adapted, equation: str):
    """(alpha / r) dropout(x) A B for `equation` 'x,w->out' of x [batch, seq, in...] and W [in..., out...]."""
    inputs, _, out = equation.replace(" ", "").partition("->")
    xs, ws = inputs.split(",")
    contracted = "".join(c for c in ws if c in xs and c not in out)
    if xs[2:] != contracted or ws[:len(contracted)] != contracted:
        raise ValueError(f"lora_dropout's branch needs x [batch, seq, in...] and W [in..., out...], got {equation!r}")
    r = next(c for c in "rqpzyxw" if c not in equation)
    h = jnp.einsum(f"{xs},{contracted}{r}->{xs[:2]}{r}", dropped(x, adapted.salt, rate()), adapted.a.astype(x.dtype))
    y = jnp.einsum(f"{xs[:2]}{r},{r}{ws[len(contracted):]}->{out}", h, adapted.b.astype(x.dtype))
    return y * adapted.scale.astype(y.dtype)

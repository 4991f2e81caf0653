"""An independent single-device LoRA reference in plain JAX + optax: W + (alpha / r) A B, only A and B trained.

It reads the adapters from jaxpar's parameter tree by their names (`w_lora_a`
[..., in..., r], `w_lora_b` [..., r, out...] beside `w`), forms each effective
weight with its own einsum and the scale alpha / r it is given, and runs
tests/reference.py's model on the result. It imports nothing from jaxpar, so a
bug in jaxpar's folding, its frozen-parameter step or its sharding of the
adapters cannot hide in it.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
import optax

import reference


def with_random_b(state, seed: int = 0):
    """`state` (on host) with every B drawn small and random: at B = 0, A would get no gradient at first."""
    rng = np.random.default_rng(seed)
    state.params = jax.tree_util.tree_map_with_path(
        lambda path, x: (0.05 * rng.standard_normal(x.shape)).astype(x.dtype)
        if str(path[-1]).endswith("_lora_b']") else x, state.params)
    return state


def split(params):
    """(adapters, frozen): the `*_lora_a` / `*_lora_b` leaves, and everything else (scales included)."""
    if not isinstance(params, dict):
        return None, params
    adapters, frozen = {}, {}
    for k, v in params.items():
        if isinstance(v, dict):
            a, f = split(v)
            if a:
                adapters[k] = a
            frozen[k] = f
        elif k.endswith(("_lora_a", "_lora_b")):
            adapters[k] = v
        else:
            frozen[k] = v
    return adapters, frozen


def effective(frozen, adapters, scale: float):
    """The frozen weights with W + scale * einsum(A, B) wherever adapters sit beside W (scale leaves dropped)."""
    out = {}
    for k, v in frozen.items():
        if isinstance(v, dict):
            out[k] = effective(v, adapters.get(k, {}), scale)
        elif k.endswith("_lora_scale"):
            continue
        elif k + "_lora_a" in adapters:
            a, b = adapters[k + "_lora_a"], adapters[k + "_lora_b"]
            lead = a.ndim + b.ndim - v.ndim - 2
            letters = iter(string.ascii_letters)
            lead_ix = "".join(next(letters) for _ in range(lead))
            in_ix = "".join(next(letters) for _ in range(a.ndim - lead - 1))
            out_ix = "".join(next(letters) for _ in range(b.ndim - lead - 1))
            r = next(letters)
            product = jnp.einsum(f"{lead_ix}{in_ix}{r},{lead_ix}{r}{out_ix}->{lead_ix}{in_ix}{out_ix}", a, b,
                                 precision=jax.lax.Precision.HIGHEST)
            out[k] = v + scale * product
        else:
            out[k] = v
    return out


def train(cfg, params0, batches, optimizer: optax.GradientTransformation, scale: float) -> reference.Result:
    """Train only the adapters of `params0` (jaxpar's natural-order parameter tree) on each batch in turn."""
    adapters, frozen = split(jax.tree.map(jnp.asarray, params0))
    loss = reference.loss_fn(cfg)
    return reference.train(lambda a, batch: loss(effective(frozen, a, scale), batch), adapters, batches, optimizer)

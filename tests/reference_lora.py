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
import zlib

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


# -- LoRA dropout: PEFT's x W + scale * dropout(x) A B, the mask drawn by jaxpar.parallel.lora_dropout's documented rule


def dropout_seeds(seed: int, step: int, shape) -> jax.Array:
    """The rule's per-token uint32 seeds of a step: bits of fold_in(key(seed), step) for the whole batch."""
    return jax.random.bits(jax.random.fold_in(jax.random.key(seed), step), shape, jnp.uint32)


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def dropout(x, seeds, path: str, layer: int, p: float):
    """x [b, s, in...] with the rule's mask: feature i of a token kept iff
    fmix32(fmix32(seed ^ crc32('path/layer')) + i * 0x9E3779B9) >= round(p * 2**32), kept ones times 1 / (1 - p)."""
    salt = np.uint32(zlib.crc32(f"{path}/{layer}".encode()) & 0x7FFFFFFF)
    token = _fmix32(seeds ^ salt)
    index = (np.arange(int(np.prod(x.shape[2:])), dtype=np.uint64) * 0x9E3779B9 % 2**32).astype(np.uint32)
    bits = _fmix32(token[..., None] + index).reshape(x.shape)
    return jnp.where(bits >= np.uint32(round(p * 2**32)), x / (1 - p), 0.0).astype(x.dtype)


def dropout_llama_loss(frozen, adapters, scale: float, p: float, batch, cfg):
    """A plain Llama (no biases, no q/k norms) whose adapted projections are x W + scale * (dropout(x) A) B."""
    seeds = batch["seeds"]

    def project(i, name, x, equation):
        w = frozen["blocks"][name][i]
        out = jnp.einsum(equation, x, w, precision=jax.lax.Precision.HIGHEST)
        if name + "_lora_a" not in adapters["blocks"]:
            return out
        a, b = adapters["blocks"][name + "_lora_a"][i], adapters["blocks"][name + "_lora_b"][i]
        xs, ws = equation.split("->")[0].split(",")
        cut = len(xs) - 2
        h = jnp.einsum(f"{xs},{ws[:cut]}r->bsr", dropout(x, seeds, f"blocks/{name}", i, p), a,
                       precision=jax.lax.Precision.HIGHEST)
        return out + scale * jnp.einsum(f"bsr,r{ws[cut:]}->{equation.split('->')[1]}", h, b,
                                        precision=jax.lax.Precision.HIGHEST)

    x = reference.embed(frozen, batch["inputs"], cfg)
    for i in range(cfg.n_layers):
        blocks = frozen["blocks"]
        h = reference.residual_norm(x, blocks["attn_norm"][i], cfg)
        q, k, v = (project(i, n, h, "bsd,dhk->bshk") for n in ("wq", "wk", "wv"))
        q, k = reference.rope(q, cfg.rope_theta), reference.rope(k, cfg.rope_theta)
        repeat = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        logits = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.float32(np.sqrt(q.shape[-1]))
        seen = np.tril(np.ones((q.shape[1], q.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(seen, logits, jnp.finfo(jnp.float32).min), axis=-1)
        x = x + project(i, "wo", jnp.einsum("bhqs,bshk->bqhk", probs, v), "bshk,hkd->bsd")
        h = reference.residual_norm(x, blocks["mlp_norm"][i], cfg)
        gated = jax.nn.silu(project(i, "w_gate", h, "bsd,df->bsf")) * project(i, "w_up", h, "bsd,df->bsf")
        x = x + project(i, "w_down", gated, "bsf,fd->bsd")
    return reference.cross_entropy(frozen, x, batch["targets"], cfg), {}


def train_with_dropout(cfg, params0, batches, optimizer, scale: float, p: float, seed: int = 0) -> reference.Result:
    """`train` with PEFT's dropout on every adapter's input; step t's mask from `dropout_seeds(seed, t, ...)`."""
    adapters, frozen = split(jax.tree.map(jnp.asarray, params0))
    batches = [{**b, "seeds": dropout_seeds(seed, t, np.shape(b["inputs"]))} for t, b in enumerate(batches)]
    return reference.train(lambda a, batch: dropout_llama_loss(frozen, a, scale, p, batch, cfg), adapters, batches,
                           optimizer)

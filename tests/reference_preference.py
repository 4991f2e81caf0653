"""An independent plain-JAX DPO reference: each answer's document run alone, its log-probs summed, the sigmoid loss.

It reads a batch of pairs packed two documents a row (inputs, targets, segment_ids, pair_sides), cuts every
document out to a row of its own (causal attention never looks past it, so the padding after it changes nothing),
runs tests/reference.py's dense or MoE model on those rows and sums the log-probs of each answer's targets. It
imports nothing from jaxpar.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import reference


def alone(batch) -> dict[str, np.ndarray]:
    """Rows [2b, seq]: row 2r the chosen document of pair r, 2r + 1 its rejected one, each from position 0."""
    seq = batch["inputs"].shape[1]
    out = {k: np.zeros((2 * len(batch["inputs"]), seq), np.asarray(batch[k]).dtype)
           for k in ("inputs", "targets", "pair_sides", "reference_logps") if k in batch}
    for r, ids in enumerate(np.asarray(batch["segment_ids"])):
        for side in (1, 2):
            at = np.flatnonzero(ids == side)
            for k in out:
                out[k][2 * r + side - 1, : at.size] = np.asarray(batch[k])[r, at]
    return out


def dense_token_losses(params, inputs, targets, cfg):
    x = reference.embed(params, inputs, cfg)
    for i in range(cfg.n_layers):
        x = reference.dense_block(reference.layer(params["blocks"], i), x, cfg)
    return reference.token_losses(params, x, targets, cfg)


def moe_token_losses(params, inputs, targets, cfg):
    """Mixtral-style blocks (an MoE feed-forward in each), dropless: routing is per token, so per document too."""
    x = reference.embed(params, inputs, cfg)
    for g in range(cfg.n_layers):
        p = reference.layer(params["blocks"]["moe"], g)
        x = x + reference.self_attention(p, reference.norm(x, p["attn_norm"], cfg.norm_eps), cfg)
        y, _, _ = reference.experts_ffn(p, reference.norm(x, p["mlp_norm"], cfg.norm_eps), cfg)
        x = x + y
    return reference.token_losses(params, x, targets, cfg)


def answer_token_logps(params, docs, cfg) -> jax.Array:
    """[documents, seq] log-probs of each answer target (0 elsewhere)."""
    token_losses = moe_token_losses if hasattr(cfg, "n_experts") else dense_token_losses
    nll = token_losses(params, jnp.asarray(docs["inputs"]), jnp.asarray(docs["targets"]), cfg)
    return jnp.where(jnp.asarray(docs["pair_sides"]) > 0, -nll, 0.0)


def answer_logps(params, docs, cfg) -> jax.Array:
    """[b, 2] summed log-probs of each pair's chosen and rejected answer."""
    return jnp.sum(answer_token_logps(params, docs, cfg), axis=-1).reshape(-1, 2)


def in_rows(values, batch) -> np.ndarray:
    """[documents, seq] values of `alone(batch)`'s rows put back where their documents lie in the batch's rows."""
    out = np.zeros(np.asarray(batch["inputs"]).shape, np.float32)
    for r, ids in enumerate(np.asarray(batch["segment_ids"])):
        for side in (1, 2):
            at = np.flatnonzero(ids == side)
            out[r, at] = np.asarray(values)[2 * r + side - 1, : at.size]
    return out


def dpo_loss(policy, reference_params, docs, cfg, beta):
    """(mean sigmoid DPO loss, {}) on `alone(batch)`; the reference's log-probs from `reference_params`, or, where
    None, the docs' `reference_logps` (the batch's, carried over)."""
    ours = answer_logps(policy, docs, cfg)
    if reference_params is None:
        ref = jnp.sum(jnp.asarray(docs["reference_logps"]), axis=-1).reshape(-1, 2)
    else:
        ref = jax.lax.stop_gradient(answer_logps(reference_params, docs, cfg))
    delta = (ours[:, 0] - ref[:, 0]) - (ours[:, 1] - ref[:, 1])
    return jnp.mean(-jax.nn.log_sigmoid(beta * delta)), {}

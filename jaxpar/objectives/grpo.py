"""GRPO's loss: the clipped importance ratio of sampled completions, the k3 KL to a reference, TRL's normalizations.

Written to compute what TRL's `GRPOTrainer._compute_loss` computes (TRL 1.16, token-level importance sampling,
one process, no accumulation) from the same per-token log-probabilities:

    ratio = exp(logp - old_logp)
    loss_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * (exp(ref - logp) - (ref - logp) - 1)

summed over the completion tokens the mask keeps and normalized as `loss_type` says:

    grpo     mean over completions of each one's token mean
    bnpo     sum / the batch's kept tokens
    dr_grpo  sum / (completions x max_completion_length)
    dapo     sum / the generation batch's kept tokens (`num_items`; default this batch's)

Every normalization is a weighted sum, sum(c x loss_t), with weights `token_weights` computes from the mask alone:
the training step carries them with the batch, so that each data rank's mean is its share of the global figure and
the loss is the same on any mesh. The mask is TRL's (`completion_mask`): a completion's tokens through its first
stop token; a completion cut at the length limit counts all its tokens, or none under `mask_truncated`.
Advantages are the rewards less their group's mean, divided by the group's (unbiased) std + 1e-4 unless `scale`
is off (Dr. GRPO).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo")
STD_EPSILON = 1e-4  # TRL's: advantages / (std + 1e-4)


def completion_mask(completion_ids, stop_tokens: Sequence[int], mask_truncated: bool = False) -> np.ndarray:
    """[n, length] int32: 1 through each row's first stop token (all of a row without one), 0 after.

    A row without a stop token was cut at the length limit: kept whole as TRL keeps it, or masked out entirely
    with `mask_truncated` (TRL's mask_truncated_completions).
    """
    ids = np.asarray(completion_ids)
    is_stop = np.isin(ids, np.asarray(list(stop_tokens), ids.dtype)) if len(stop_tokens) else np.zeros(ids.shape, bool)
    stopped = is_stop.any(axis=1)
    first = np.where(stopped, is_stop.argmax(axis=1), ids.shape[1])
    mask = (np.arange(ids.shape[1])[None, :] <= first[:, None]).astype(np.int32)
    if mask_truncated:
        mask = mask * stopped[:, None].astype(np.int32)
    return mask


def group_advantages(rewards, group_size: int, scale: bool = True) -> tuple[np.ndarray, dict]:
    """(advantages [n], figures) from rewards [n] in groups of `group_size` consecutive completions.

    The figures are TRL's: the rewards' mean and std over the batch, the mean of the groups' stds and the
    fraction of groups whose rewards are all equal (no signal: every advantage 0).
    """
    rewards = np.asarray(rewards, np.float64)
    if group_size < 2 or rewards.size % group_size:
        raise ValueError(f"group-normalized advantages need groups of >= 2 completions dividing the batch: "
                         f"{rewards.size} rewards in groups of {group_size}")
    groups = rewards.reshape(-1, group_size)
    std = np.repeat(groups.std(axis=1, ddof=1), group_size)
    advantages = rewards - np.repeat(groups.mean(axis=1), group_size)
    if scale:
        advantages = advantages / (std + STD_EPSILON)
    figures = {"reward": float(rewards.mean()), "reward_std": float(rewards.std(ddof=1)),
               "reward_group_std": float(std.mean()), "frac_reward_zero_std": float(np.isclose(std, 0.0).mean())}
    return advantages.astype(np.float32), figures


def token_weights(mask, loss_type: str, max_completion_length: int | None = None, num_items=None):
    """c [n, length] with the batch's loss = sum(c x loss_t): `loss_type`'s normalization of the masked tokens."""
    mask = jnp.asarray(mask, jnp.float32)
    rows = mask.shape[0]
    if loss_type == "grpo":
        return mask / (rows * jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0))
    if loss_type == "bnpo":
        return mask / jnp.maximum(mask.sum(), 1.0)
    if loss_type == "dr_grpo":
        length = mask.shape[1] if max_completion_length is None else max_completion_length
        return mask / (rows * length)
    if loss_type == "dapo":
        return mask / jnp.maximum(mask.sum() if num_items is None else jnp.asarray(num_items, jnp.float32), 1.0)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def token_losses(logps, old_logps, advantages, ref_logps=None, beta: float = 0.0, epsilon: float = 0.2,
                 epsilon_high: float | None = None):
    """(loss_t, kl_t, ratio) [n, length]: the clipped surrogate plus beta x the k3 KL (kl_t 0 where beta is 0)."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    advantages = jnp.asarray(advantages, jnp.float32)
    advantages = advantages[:, None] if advantages.ndim == 1 else advantages
    ratio = jnp.exp(logps - old_logps)
    clipped = jnp.clip(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -jnp.minimum(ratio * advantages, clipped * advantages)
    kl = jnp.zeros_like(loss)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"beta={beta} weighs the KL to the reference policy: pass ref_logps (or set beta=0)")
        delta = ref_logps - logps
        kl = jnp.exp(delta) - delta - 1
        loss = loss + beta * kl
    return loss, kl, ratio


def clip_fractions(ratio, advantages, weights, epsilon: float, epsilon_high: float | None = None) -> dict:
    """TRL's clip_ratio figures: the weighted share of tokens whose ratio the clip held (low, high, either)."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    advantages = jnp.asarray(advantages, jnp.float32)
    advantages = advantages[:, None] if advantages.ndim == 1 else advantages
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    share = lambda hit: jnp.sum(weights * hit.astype(jnp.float32))  # noqa: E731
    return {"clip_ratio/low_mean": share(low), "clip_ratio/high_mean": share(high),
            "clip_ratio/region_mean": share(low | high)}


def grpo_loss(logps, old_logps, advantages, mask, ref_logps=None, beta: float = 0.0, epsilon: float = 0.2,
              epsilon_high: float | None = None, loss_type: str = "dapo", max_completion_length: int | None = None,
              num_items=None) -> tuple[jax.Array, dict]:
    """(loss, figures) of one batch of completions: logps, old_logps, ref_logps, mask [n, length], advantages [n].

    `loss_type`: grpo, dr_grpo, bnpo or dapo (TRL's default); `max_completion_length` (dr_grpo; default the
    mask's length); `num_items` (dapo: the generation batch's kept tokens; default this batch's). The figures:
    the masked mean KL (with beta) and the clip fractions.
    """
    loss_t, kl, ratio = token_losses(logps, old_logps, advantages, ref_logps, beta, epsilon, epsilon_high)
    weights = token_weights(mask, loss_type, max_completion_length, num_items)
    share = jnp.asarray(mask, jnp.float32) / jnp.maximum(jnp.sum(jnp.asarray(mask, jnp.float32)), 1.0)
    figures = clip_fractions(ratio, advantages, share, epsilon, epsilon_high)
    if beta != 0.0:
        figures["kl"] = jnp.sum(share * kl)
    return jnp.sum(weights * loss_t), figures


def token_logps(logits, targets, temperature: float = 1.0):
    """log p(target) [batch, seq] under softmax(logits / temperature), as TRL scores completions (float32)."""
    logits = logits.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)

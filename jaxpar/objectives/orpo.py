"""ORPO (Hong et al. 2024): the chosen answer's SFT loss minus beta x the log-sigmoid of the answers' log odds ratio.

As TRL 1.16 computes it (`ORPOTrainer`): on the answers' mean token
log-probs, log odds = (c - r) - (log(1 - e^c) - log(1 - e^r)); the loss is the
chosen answers' token-mean cross-entropy minus beta x mean log sigmoid(log odds).
No reference model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"--beta (ORPO's lambda) must be positive, got {beta}")


def log1mexp(x):
    """log(1 - e^x) for x < 0, computed stably on both sides of -ln 2."""
    t = -0.6931471805599453
    return jnp.where(x < t, jnp.log1p(-jnp.exp(jnp.minimum(x, t))), jnp.log(-jnp.expm1(jnp.maximum(x, t))))


def orpo_loss(chosen_mean_logps, rejected_mean_logps, beta: float = 0.1):
    """(per-pair odds-ratio terms beta x log sigmoid(log odds), chosen rewards, rejected rewards, log odds).

    The training loss is the chosen cross-entropy minus the mean of the first.
    """
    log_odds = (chosen_mean_logps - rejected_mean_logps) - (log1mexp(chosen_mean_logps)
                                                            - log1mexp(rejected_mean_logps))
    ratio = beta * jax.nn.log_sigmoid(log_odds)
    return (ratio, beta * jax.lax.stop_gradient(chosen_mean_logps),
            beta * jax.lax.stop_gradient(rejected_mean_logps), jax.lax.stop_gradient(log_odds))

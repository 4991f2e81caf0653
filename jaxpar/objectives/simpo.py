"""SimPO (Meng et al. 2024): reference-free, on length-normalized log-probs with a target margin gamma.

As TRL 1.16 computes it (`CPOTrainer` with `loss_type="simpo"`): the answers'
mean token log-probs, logits = mean_chosen - mean_rejected - gamma / beta, a
sigmoid loss with optional label smoothing; CPO's `cpo_alpha` times the chosen
answers' cross-entropy may be added (`sft_weight`, 0 for plain SimPO).
"""

from __future__ import annotations

import jax


def check(beta: float, gamma: float, label_smoothing: float) -> None:
    if not beta > 0:
        raise ValueError(f"--beta must be positive for SimPO, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"--label-smoothing must lie in [0, 0.5) for SimPO, got {label_smoothing}")


def simpo_loss(chosen_mean_logps, rejected_mean_logps, beta: float = 2.0, gamma: float = 0.5,
               label_smoothing: float = 0.0):
    """(per-pair losses, chosen rewards, rejected rewards) from the answers' mean token log-probs."""
    logits = chosen_mean_logps - rejected_mean_logps - gamma / beta
    losses = (-jax.nn.log_sigmoid(beta * logits) * (1.0 - label_smoothing)
              - jax.nn.log_sigmoid(-beta * logits) * label_smoothing)
    return (losses, beta * jax.lax.stop_gradient(chosen_mean_logps),
            beta * jax.lax.stop_gradient(rejected_mean_logps))

"""DPO and its losses (sigmoid, IPO, hinge, robust) on preference pairs' summed log-probs, as TRL 1.16 has them.

Rafailov et al. 2023 (sigmoid), Azar et al. 2023 (IPO, whose log-ratios TRL
divides by the answers' token counts), SLiC's hinge, and robust DPO
(Chowdhury et al. 2024: `label_smoothing` is the chance that a pair's
preference was flipped). The reference's log-probs come from the frozen base:
the same weights with the adapters off under LoRA, or carried with the data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSSES = ("sigmoid", "ipo", "hinge", "robust")


def check(beta: float, loss_type: str, label_smoothing: float) -> None:
    """One line for options DPO cannot run with (before anything compiles)."""
    if loss_type not in LOSSES:
        raise ValueError(f"--dpo-loss {loss_type!r} is not one of {', '.join(LOSSES)}")
    if not beta > 0:
        raise ValueError(f"--beta must be positive for DPO, got {beta}")
    if label_smoothing and loss_type != "robust":
        raise ValueError(f"--label-smoothing {label_smoothing} acts only on --dpo-loss robust (TRL's sigmoid, ipo and "
                         f"hinge losses have no such term); this run uses {loss_type!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"--label-smoothing must lie in [0, 0.5) for robust DPO, got {label_smoothing}")


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, chosen_tokens=None, rejected_tokens=None):
    """(per-pair losses, chosen rewards, rejected rewards), each [pairs], from per-answer summed log-probs.

    The rewards are beta x (policy - reference) log-ratios, as TRL logs them.
    `chosen_tokens` / `rejected_tokens` (answer lengths) are needed by IPO only.
    """
    chosen_ratios = chosen_logps - ref_chosen_logps
    rejected_ratios = rejected_logps - ref_rejected_logps
    delta = chosen_ratios - rejected_ratios
    if loss_type == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1.0 - beta * delta)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the IPO loss needs the answers' token counts (chosen_tokens, rejected_tokens)")
        per_token = (chosen_ratios / jnp.maximum(chosen_tokens, 1.0)
                     - rejected_ratios / jnp.maximum(rejected_tokens, 1.0))
        losses = (per_token - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * delta)
        flipped = -label_smoothing * jax.nn.log_sigmoid(-beta * delta)
        losses = (clean - flipped) / (1.0 - 2.0 * label_smoothing)
    else:
        raise ValueError(f"dpo loss_type {loss_type!r} is not one of {', '.join(LOSSES)}")
    return losses, beta * jax.lax.stop_gradient(chosen_ratios), beta * jax.lax.stop_gradient(rejected_ratios)

"""GRPO in the training step: sampled completions as a batch, and the loss the step differentiates on any plan.

Each row is a prompt and one of its completions, right-padded to the run's sequence, so causal attention needs
no padding mask and each token keeps the position it had when it was sampled. The per-token fields (the mask,
the old and reference log-probs) are in the targets' coordinates. The normalization is carried as weights:
`grpo_weights` = c x (rows x seq) with c `grpo.token_weights`' coefficients over the whole batch, so that each
data rank's mean of weight x loss is its share of the batch's loss and the step's mean over ranks (and
microbatches) is the batch's loss on any mesh. `token_share` does the same for the figures (a mean over the
batch's masked tokens).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.objectives import grpo


@dataclasses.dataclass(frozen=True)
class GrpoOptions:
    """GRPO's settings (TRL's names and defaults where TRL has them)."""

    group_size: int = 4  # completions per prompt (TRL's num_generations)
    beta: float = 0.0  # weight of the k3 KL to the reference policy (0: no reference forward)
    loss_type: str = "dapo"  # grpo, dr_grpo, bnpo or dapo: how the token losses are normalized
    epsilon: float = 0.2  # the ratio's clip below 1 (and above, without epsilon_high)
    epsilon_high: float | None = None  # the ratio's clip above 1 (DAPO's clip-higher)
    iterations: int = 1  # optimizer steps on each generation batch (TRL's num_iterations)
    scale_rewards: bool = True  # advantages divided by their group's std (False: Dr. GRPO)
    mask_truncated: bool = False  # completions cut at the length limit weigh nothing (TRL's mask_truncated_completions)
    temperature: float = 1.0  # sampling temperature, and the one the log-probs are scored at
    top_p: float = 1.0
    max_new_tokens: int = 32  # TRL's max_completion_length
    stop_tokens: tuple = ()

    def __post_init__(self):
        if self.loss_type not in grpo.LOSS_TYPES:
            raise ValueError(f"--grpo-loss must be one of {', '.join(grpo.LOSS_TYPES)}, got {self.loss_type!r}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (advantages compare completions of a prompt), got "
                             f"{self.group_size}")
        if self.iterations < 1 or self.max_new_tokens < 1 or self.beta < 0 or self.epsilon <= 0:
            raise ValueError("--grpo-iterations and --max-new-tokens must be >= 1, --beta >= 0, --epsilon > 0")
        if not self.temperature > 0:
            raise ValueError(f"GRPO scores completions at the sampling temperature: it must be > 0, got "
                             f"{self.temperature}")


def check_batch_size(batch_size: int, group_size: int) -> int:
    """Prompts per generation batch; refused in one line where the group size does not divide the batch."""
    if batch_size % group_size:
        raise ValueError(f"--group-size {group_size} does not divide --batch {batch_size}: each step trains on "
                         f"whole groups of completions (batch = prompts per step x group size)")
    return batch_size // group_size


def rows(prompt_ids: list, completion_ids: np.ndarray, completion_mask: np.ndarray, seq_len: int, pad: int = 0):
    """(inputs, targets, mask [rows, seq_len]): prompt + completion right-padded; mask on the completion's targets."""
    n, new = completion_ids.shape
    tokens = np.full((n, seq_len + 1), pad, np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    for i, prompt in enumerate(prompt_ids):
        p = len(prompt)
        if p + new > seq_len + 1:
            raise ValueError(f"a prompt of {p} tokens and {new} new ones exceed the sequence of {seq_len}")
        tokens[i, :p] = prompt
        tokens[i, p:p + new] = completion_ids[i]
        mask[i, p - 1:p - 1 + new] = completion_mask[i]
    return tokens[:, :-1], tokens[:, 1:], mask


def batch(prompt_ids, completion_ids, completion_mask, advantages, seq_len: int, options: GrpoOptions,
          pad: int = 0) -> dict[str, np.ndarray]:
    """The step's batch of one generation batch (old and reference log-probs are added by the caller)."""
    inputs, targets, mask = rows(prompt_ids, completion_ids, completion_mask, seq_len, pad)
    size = mask.size
    weights = np.asarray(grpo.token_weights(mask, options.loss_type, options.max_new_tokens)) * size
    share = mask / max(mask.sum(), 1.0) * size
    return {"inputs": inputs, "targets": targets, "completion_mask": mask,
            "advantages": np.asarray(advantages, np.float32), "grpo_weights": weights.astype(np.float32),
            "token_share": share.astype(np.float32)}


def token_logps(module, inputs, targets, temperature: float):
    """log p(target) [rows, seq] of the module's logits at `temperature` (rows right-padded: no mask needed)."""
    return grpo.token_logps(module.logits(inputs), targets, temperature)


def loss_fn(options: GrpoOptions):
    """(module, batch) -> (loss, figures) for `make_train_step`: this rank's share of the batch's GRPO loss."""

    def loss(module, b):
        logps = token_logps(module, b["inputs"], b["targets"], options.temperature)
        old = jax.lax.stop_gradient(logps) if "old_logps" not in b else b["old_logps"]
        token_loss, kl, ratio = grpo.token_losses(logps, old, b["advantages"], b.get("ref_logps"), options.beta,
                                                  options.epsilon, options.epsilon_high)
        share = b["token_share"]
        figures = {k: v / share.size for k, v in grpo.clip_fractions(ratio, b["advantages"], share, options.epsilon,
                                                                     options.epsilon_high).items()}
        if options.beta:
            figures["kl"] = jnp.mean(share * kl)
        return jnp.mean(b["grpo_weights"] * token_loss), figures

    return loss


def objective(**options):
    """GRPO's loss_fn from its options by name (`GrpoOptions`' fields): the objective registry's factory form."""
    return loss_fn(GrpoOptions(**options))

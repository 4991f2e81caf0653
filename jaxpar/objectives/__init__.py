"""Training objectives beyond next-token prediction: GRPO (reinforcement learning with verifiable rewards)."""

from jaxpar.objectives.grpo import grpo_loss

__all__ = ["grpo_loss"]

"""Training objectives beyond next-token cross-entropy, by name: what `jaxpar train --objective` picks.

An objective is a factory of options -> loss_fn(module, batch) -> (loss, metrics)
for jaxpar's train step (`jaxpar.train.step.make_train_step`). It computes its
loss from the model's own forward: inside `sequences.reducing(fn)` the model's
cross-entropy hands fn its per-token losses (-log-probs of the targets), the
loss weights and the batch's order, so any field of the batch (answer sides,
reference log-probs, advantages) can enter the loss on every plan.
`register` adds one. GRPO (`grpo`, `grpo_step`, `rewards`) samples its own batches, so its run is
`jaxpar.run.grpo` rather than a registered loss_fn; `grpo_loss` is its loss for one's own loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jaxpar.objectives.dpo import dpo_loss
from jaxpar.objectives.grpo import grpo_loss
from jaxpar.objectives.orpo import orpo_loss
from jaxpar.objectives.preference import Preference, adapters_off, reference_logps
from jaxpar.objectives.sequences import REFERENCE, SIDES, answer_sums, reducing
from jaxpar.objectives.simpo import simpo_loss

OBJECTIVES: dict[str, Callable[..., Callable]] = {}


def register(name: str, factory: Callable[..., Callable]) -> None:
    """Make `factory(**options)` -> loss_fn the objective `name` (`jaxpar train --objective name`)."""
    OBJECTIVES[name] = factory


def make(name: str, **options) -> Callable:
    """The loss_fn of objective `name` with `options` (one line naming the known objectives if it is not one)."""
    if name not in OBJECTIVES:
        raise ValueError(f"--objective {name!r} is not one of {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name](**options)


for _name in ("dpo", "simpo", "orpo"):
    register(_name, functools.partial(Preference, _name))

__all__ = ["OBJECTIVES", "Preference", "REFERENCE", "SIDES", "adapters_off", "answer_sums", "dpo_loss", "grpo_loss", "make",
           "orpo_loss", "reducing", "reference_logps", "register", "simpo_loss"]

"""Preference objectives (DPO, SimPO, ORPO) as a loss_fn for jaxpar's train step: pairs packed as documents.

Each row of a preference batch holds one pair: the prompt with its chosen
answer and the prompt with its rejected answer, two documents (`segment_ids`
1 and 2, positions from 0 in each, so attention stays inside each) and
`pair_sides` marking each answer's target tokens (jaxpar.data.preference).
The model runs once on the rows; its cross-entropy hands the per-token losses
to the objective (`sequences.reducing`), which sums each answer's log-probs
and takes the per-pair loss. Rows are whole pairs, so a plan splits the batch
by rows and the mean over pairs is the mean of the ranks' means.

DPO's reference: the batch's `reference_logps` [b, s] where present (computed
once, `--precompute-reference`), else, under LoRA, the same module with every
adapter's scale set to 0: the frozen base, no second copy of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.objectives import dpo, orpo, simpo
from jaxpar.core.trace import active_plan
from jaxpar.objectives.sequences import (REFERENCE, SIDES, answer_sums, pipeline_stages, pipeline_value, reducing,
                                         side_sums, whole)
from jaxpar.parallel import documents, lora

NAMES = ("dpo", "simpo", "orpo")
DEFAULT_BETA = {"dpo": 0.1, "simpo": 2.0, "orpo": 0.1}  # TRL 1.16's DPOConfig, SimPO paper's / CPO, ORPOConfig


@dataclasses.dataclass(frozen=True)
class Preference:
    """A preference objective and its options; an instance is the loss_fn(module, batch) -> (loss, metrics)."""

    name: str = "dpo"
    beta: float | None = None  # None: DEFAULT_BETA[name]
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0  # SimPO: CPO's cpo_alpha, the chosen answers' cross-entropy added (ORPO's is always 1)

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"preference objective {self.name!r} is not one of {', '.join(NAMES)}")
        if self.beta is None:
            object.__setattr__(self, "beta", DEFAULT_BETA[self.name])
        if self.name == "dpo":
            dpo.check(self.beta, self.dpo_loss, self.label_smoothing)
        elif self.name == "simpo":
            simpo.check(self.beta, self.simpo_gamma, self.label_smoothing)
        else:
            orpo.check(self.beta)
            if self.label_smoothing:
                raise ValueError("--label-smoothing does not act on ORPO")
        if self.sft_weight and self.name != "simpo":
            raise ValueError(f"an SFT weight acts on SimPO only (ORPO always adds its chosen answers' loss; DPO none), "
                             f"not on {self.name}")

    @property
    def needs_reference(self) -> bool:
        return self.name == "dpo"

    @property
    def sft(self) -> str | None:
        """What the objective's cross-entropy term trains on the chosen side (the batch's `loss_weights`): its
        answer (SimPO with an SFT weight, as CPO), its whole document (ORPO, as TRL), or nothing (None)."""
        return "document" if self.name == "orpo" else "answer" if self.sft_weight else None

    def __call__(self, module, batch):
        if not isinstance(batch, Mapping) or SIDES not in batch:
            raise ValueError(f"a {self.name} batch carries {SIDES} (which answer each target belongs to): pack the "
                             "pairs with jaxpar.data.preference.pack_pairs")
        reference = None  # per-row sums [b, 2] of the in-step reference (under LoRA: the adapters off)
        if self.needs_reference and REFERENCE not in batch:
            if pipeline_planned():
                raise ValueError("under a pipeline (pipe > 1) DPO's reference log-probs must come with the data: "
                                 "train with --precompute-reference")
            reference = reference_logps(adapters_off(module), batch, per_token=False)
        metrics = {}

        def reduce(losses, weights, order):
            sides = order(documents.get(SIDES))
            sums = whole(answer_sums(losses, sides))
            if reference is None and self.needs_reference:
                ref = whole(side_sums(order(documents.get(REFERENCE)), sides))
            else:
                ref = None if reference is None else (reference[:, 0], reference[:, 1])
            pairs, sft, found = self.pairs_loss(*sums, ref)
            nll = _nll(losses, weights) if sft else None
            if pipeline_stages() == 1:  # inside a pipeline's scans the figures cannot leave the head
                metrics.update(found, **({} if nll is None else {"nll_loss": jax.lax.stop_gradient(nll)}))
            return pipeline_value(pairs) + (0.0 if nll is None else sft * nll)

        loss, aux = _run(module, batch, reduce)
        return loss, {**aux, **metrics}

    def pairs_loss(self, chosen, rejected, chosen_tokens, rejected_tokens, reference):
        """(mean loss over the rows' pairs, the weight of the chosen side's cross-entropy added to it, metrics), from
        the answers' summed log-probs and token counts (and DPO's reference sums)."""
        extra, sft = {}, 0.0
        if self.name == "dpo":
            per_pair, good, bad = dpo.dpo_loss(chosen, rejected, *reference, self.beta, self.dpo_loss,
                                               self.label_smoothing, chosen_tokens, rejected_tokens)
            loss = jnp.mean(per_pair)
        else:
            chosen_mean = chosen / jnp.maximum(chosen_tokens, 1.0)
            rejected_mean = rejected / jnp.maximum(rejected_tokens, 1.0)
            if self.name == "simpo":
                per_pair, good, bad = simpo.simpo_loss(chosen_mean, rejected_mean, self.beta, self.simpo_gamma,
                                                       self.label_smoothing)
                loss, sft = jnp.mean(per_pair), self.sft_weight
            else:
                ratio, good, bad, log_odds = orpo.orpo_loss(chosen_mean, rejected_mean, self.beta)
                loss, sft = -jnp.mean(ratio), 1.0
                extra = {"log_odds_ratio": jnp.mean(ratio) / self.beta, "log_odds_chosen": jnp.mean(log_odds)}
        metrics = {"chosen_reward": jnp.mean(good), "rejected_reward": jnp.mean(bad),
                   "reward_margin": jnp.mean(good - bad), "reward_accuracy": jnp.mean((good > bad).astype(jnp.float32)),
                   **self._logps(chosen, rejected, chosen_tokens, rejected_tokens), **extra}
        return loss, sft, metrics

    def _logps(self, chosen, rejected, chosen_tokens, rejected_tokens) -> dict:
        """The answers' log-probs the loss compares, as TRL logs them: summed (DPO) or per token (SimPO, ORPO)."""
        if self.name != "dpo":
            chosen, rejected = chosen / jnp.maximum(chosen_tokens, 1.0), rejected / jnp.maximum(rejected_tokens, 1.0)
        return {"chosen_logps": jnp.mean(jax.lax.stop_gradient(chosen)),
                "rejected_logps": jnp.mean(jax.lax.stop_gradient(rejected))}


def pipeline_planned() -> bool:
    plan = active_plan()
    return plan is not None and plan.shape.get("pipe", 1) > 1


def _nll(losses, weights):
    """The chosen side's token-mean cross-entropy: weights mark its targets (`Preference.sft`), normalised by the step
    over the global batch (jaxpar.train.step.normalised_weights), so this is TRL's mean over all of them."""
    if weights is None:
        raise ValueError("this objective adds the chosen answers' cross-entropy, but the batch carries no loss_weights "
                         "(pack the pairs with jaxpar.data.preference.pack_pairs(..., sft=objective.sft))")
    return jnp.mean(weights.astype(jnp.float32) * losses.astype(jnp.float32))


def _run(module, batch, reduce):
    """(loss, aux) of the module's own loss on `batch`, its cross-entropy reduced by `reduce`; the rows' documents in
    scope (as the train step sets them; here too for one's own loop), so attention stays inside each answer."""
    with reducing(reduce), documents.scope(documents.of_batch(batch)):
        out = module(batch)
    if isinstance(out, tuple):
        return out[0], dict(out[1]) if isinstance(out[1], Mapping) else {"aux": out[1]}
    return out, {}


def reference_logps(module, batch, per_token: bool = True) -> jax.Array:
    """The log-probs of the batch's answers under `module`, no gradient through them: per target [b, s] (0 off the
    answers; what `--precompute-reference` carries with the data as REFERENCE), or per row [b, 2] (chosen, rejected
    sums, on any plan without pipe). Per target in natural order: on a plan without context or pipe parallelism."""
    plan = active_plan()
    if per_token and plan is not None and (plan.shape.get("context", 1) > 1 or plan.shape.get("pipe", 1) > 1):
        raise ValueError("per-target reference log-probs are computed on a plan without context or pipe parallelism "
                         f"(this one: {plan.shape}); compute them on the same devices over data")
    found = []

    def reduce(losses, weights, order):
        sides = order(documents.get(SIDES))
        found.append(jnp.where(sides > 0, -losses.astype(jnp.float32), 0.0) if per_token
                     else jnp.stack(side_sums(-losses, sides), axis=-1))
        return jnp.zeros((), jnp.float32)

    _run(module, {k: v for k, v in batch.items() if k != REFERENCE}, reduce)
    if len(found) != 1:
        raise ValueError(f"the model's loss called jaxpar's cross-entropy {len(found)} times; a preference objective "
                         "needs it called once, on all of the batch's rows")
    return jax.lax.stop_gradient(found[0])


def adapters_off(module):
    """The module with every LoRA adapter's scale 0: the frozen base it adapts, sharing its weights (no copy)."""
    graphdef, state = nnx.split(module)
    tree = nnx.to_pure_dict(state)
    count = [0]

    def off(node):
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if isinstance(key, str) and key.endswith(lora.SCALE):
                if jnp.ndim(value) == 0:
                    raise ValueError(f"adapter {key} sits outside a layer stack (already folded into its weight), so "
                                     "its base cannot be recovered for DPO's reference: use --precompute-reference")
                count[0] += 1
                out[key] = jnp.zeros_like(value)
            else:
                out[key] = off(value)
        return out

    tree = off(tree)
    if not count[0]:
        raise ValueError("DPO needs a reference: the model has no LoRA adapters (whose base would be it), and the "
                         "batch carries no reference_logps; train with LoRA (--lora-rank) or --precompute-reference")
    nnx.replace_by_pure_dict(state, tree)
    return nnx.merge(graphdef, state)

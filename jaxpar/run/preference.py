"""`jaxpar train --objective dpo|simpo|orpo`: a run's objective, its preference data and, once, its reference.

The objective (jaxpar.objectives) is the step's loss_fn; the data are the
records of a .jsonl file of preferences (jaxpar.data.preference), every pair
one row, read and checked at start-up (a bad record is refused by its line,
before anything compiles). `--precompute-reference` computes DPO's reference
log-probs once, from the initial weights (the base, adapters off, under
LoRA), and carries them with the data; without it DPO needs LoRA, whose base
is its reference in the step itself.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxpar.core.plan import Plan
from jaxpar.data.preference import REFERENCE, PreferenceBatches, read_pairs
from jaxpar.data.stream import BatchStream
from jaxpar.objectives import Preference, adapters_off, make, reference_logps

FIGURES = ("chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy")  # the progress line's


def objective_of(config, plan: Plan):
    """The loss_fn of `config.objective` with its options, checked against the plan and the other options."""
    options = {"beta": config.beta, "dpo_loss": config.dpo_loss, "label_smoothing": config.label_smoothing,
               "simpo_gamma": config.simpo_gamma, "sft_weight": config.sft_weight}
    defaults = {f.name: f.default for f in dataclasses.fields(Preference)}
    for name, owner in (("dpo_loss", "dpo"), ("simpo_gamma", "simpo")):
        if config.objective != owner and options[name] != defaults[name]:
            raise ValueError(f"--{name.replace('_', '-')} acts on --objective {owner} only, not {config.objective}")
    if config.precompute_reference and config.objective != "dpo":
        raise ValueError(f"--precompute-reference: {config.objective} has no reference model")
    objective = make(config.objective, **options)
    if isinstance(objective, Preference):
        if objective.needs_reference and not config.precompute_reference and not plan.lora_rank:
            raise ValueError("DPO without LoRA needs its reference's log-probs: add --precompute-reference (computed "
                             "once from the initial weights), or train LoRA adapters (--lora-rank), whose base is it")
        if objective.needs_reference and plan.shape["pipe"] > 1 and not config.precompute_reference:
            raise ValueError("DPO under a pipeline (pipe > 1) takes its reference with the data: add "
                             "--precompute-reference")
        for name in ("eval_every", "packing"):
            if getattr(config, name):
                raise ValueError(f"--{name.replace('_', '-')} does not act on preference pairs (one pair a row)")
    return objective


def preference_stream(config, plan: Plan, objective: Preference) -> BatchStream:
    """The run's pairs as global batches (every pair one row of `config.seq_len`), read and checked now."""
    from jaxpar.data.records import ChatTemplate
    from jaxpar.data.tokenize import load_tokenizer

    if not config.data or not str(config.data).endswith(".jsonl"):
        raise ValueError(f"--objective {config.objective} reads preference records from a .jsonl file (prompt, chosen, "
                         f"rejected), got --data {config.data}")
    tokenizer = load_tokenizer(config.tokenizer)
    try:
        chat = ChatTemplate.of(config.tokenizer, "chat records")
    except ValueError:
        chat = None  # plain-text records need none; a chat record then says so by its line
    pairs = read_pairs(config.data, tokenizer, config.seq_len, chat, objective.sft)
    batches = PreferenceBatches(pairs, config.batch_size, config.seed)
    return BatchStream(batches, plan.sharding(plan.batch_spec(2)), config.seed)


def batch_fields(run) -> dict:
    """The dtype of each field of the run's batches (with the reference log-probs --precompute-reference adds)."""
    fields = {k: v.dtype for k, v in run.batches.rows(0, 0, 1).items()}
    return {**fields, REFERENCE: np.dtype(np.float32)} if run.config.precompute_reference else fields


def precompute_reference(run) -> None:
    """Fill the run's pairs' REFERENCE from the initial weights, on the same devices laid out over data only."""
    batches: PreferenceBatches = run.batches
    plan = run.plan
    if plan.shape["pipe"] > 1 or plan.shape["context"] > 1:
        lora = {f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)
                if f.name.startswith("lora_") or f.name == "base_dtype"}
        plan = Plan.create(f"data={plan.mesh.devices.size}", devices=list(plan.mesh.devices.flat), **lora)
    params = dataclasses.replace(run, plan=plan).init().params
    lorad = bool(plan.lora_rank)

    @jax.jit
    def forward(params, batch):
        module = run.model.merge(params)
        return reference_logps(adapters_off(module) if lorad else module, batch)

    sharding = plan.sharding(plan.batch_spec(2))
    out = np.zeros(batches.pairs["inputs"].shape, np.float32)
    size = batches.batch_size
    for lo in range(0, len(batches), size):
        at = np.arange(lo, lo + size) % len(batches)  # the last batch wraps round to stay full
        batch = {k: jax.device_put(v[at], sharding) for k, v in batches.pairs.items()}
        with plan.activate():
            out[at] = np.asarray(forward(params, batch))
    batches.reference = out

"""`jaxpar train --objective grpo`: sample G completions per prompt on the training mesh, reward them, train on them.

Each generation batch: `batch / G` prompt records, G completions each drawn by `jaxpar.sample` on the parameters
as they train; the reward functions score them (`jaxpar.objectives.rewards`), advantages are normalized within
each group, and `iterations` optimizer steps run on the batch with GRPO's loss (`jaxpar.objectives.grpo_step`).
With several steps per generation batch the sampling policy's log-probs are scored once before the first step; with
beta > 0 the reference policy's are too: under LoRA the same weights with the adapters off (no second copy), else a
frozen copy of the initial parameters sharded like them. Everything is read and checked before anything compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.plan import Plan
from jaxpar.data.prompts import Prompts, read_prompts
from jaxpar.core import compile_cache
from jaxpar.objectives import grpo, grpo_step, rewards as rewards_lib
from jaxpar.objectives.grpo_step import GrpoOptions
from jaxpar.parallel import lora
from jaxpar.run.sample import check_options, sample
from jaxpar.train import precision
from jaxpar.train.state import ModelDef, TrainState
from jaxpar.train.step import make_train_step


def check_plan(plan: Plan) -> None:
    """What GRPO's scoring forward (the inference forward, whole rows per data rank) cannot run on, in one line."""
    if plan.zero == 3 and plan.zero_ranks > 1:
        raise ValueError("--objective grpo scores completions with the inference forward, which reads each data "
                         "rank's whole parameters: use --zero 0, 1 or 2 (ZeRO-3 shards them over data)")
    if plan.lora_dropout:
        raise ValueError(f"--objective grpo does not run LoRA dropout (lora_dropout={plan.lora_dropout}): set it to 0")
    if plan.tensor_form != "annotation" and plan.shape["tensor"] > 1:
        raise ValueError(f"--objective grpo runs tensor parallelism in the annotation form, got tensor_form="
                         f"{plan.tensor_form!r}")


def _logps(model: ModelDef, temperature: float, dtype, base: bool, params, inputs, targets):
    """log p(target) [rows, seq] at `temperature` (`base`: with every LoRA adapter off, the reference policy), the
    parameters cast to the plan's compute dtype as the step casts them where they are used."""
    params = lora.without_adapters(params) if base else params
    if dtype is not None:
        params = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    module = model.merge(lora.fold(params, unstacked_only=True, keep=True))
    return grpo_step.token_logps(module, inputs, targets, temperature)


class GrpoTrainer:
    """One generation batch of completions -> `options.iterations` optimizer steps, on one plan."""

    def __init__(self, model: ModelDef, optimizer, plan: Plan, options: GrpoOptions, seq_len: int, pad: int = 0):
        check_plan(plan)
        check_options(plan, options.max_new_tokens, options.temperature, options.top_p, options.group_size)
        self.model, self.plan, self.options, self.seq_len, self.pad = model, plan, options, seq_len, pad
        self.step = make_train_step(model, grpo_step.loss_fn(options), optimizer, plan)
        dtype = precision.POLICIES[plan.precision].cast_at_use
        self._logps = {base: jax.jit(functools.partial(_logps, model, options.temperature, dtype, base))
                       for base in (False, True)}
        self.reference = None  # a full fine-tune's frozen initial parameters (beta > 0)

    def start(self, state: TrainState) -> None:
        """Keep the reference policy a full fine-tune with beta > 0 needs: the initial parameters, as they lie."""
        if self.options.beta and not self.plan.lora_rank:
            self.reference = jax.tree.map(lambda a: a.copy(), state.params)

    def scored(self, params, b: dict, base: bool = False):
        with self.plan.activate():
            return self._logps[base](params, b["inputs"], b["targets"])

    def train_on(self, state: TrainState, prompt_ids, completion_ids, completion_mask, advantages):
        """(state, metrics of each step) after `iterations` steps on one generation batch."""
        host = grpo_step.batch(prompt_ids, completion_ids, completion_mask, advantages, self.seq_len, self.options,
                               self.pad)
        b = jax.device_put(host, self.plan.sharding(self.plan.batch_spec(1)))
        if self.options.iterations > 1:
            b["old_logps"] = self.scored(state.params, b)
        if self.options.beta:
            lora_base = bool(self.plan.lora_rank)
            b["ref_logps"] = self.scored(state.params if lora_base else self.reference, b, base=lora_base)
        out = []
        for _ in range(self.options.iterations):
            state, metrics = self.step(state, b)
            out.append(metrics)
        return state, out


@dataclasses.dataclass
class GrpoRun:
    """A prepared GRPO run: the model and state builder (`jaxpar.run.training.Run`), the prompts, the rewards."""

    run: object  # jaxpar.run.training.Run (its data unused)
    prompts: Prompts
    rewards: list[tuple[str, Callable]]
    options: GrpoOptions
    trainer: GrpoTrainer
    prompts_per_batch: int


def prepare_grpo(config, options: GrpoOptions, prompts_path: str, reward_specs: Sequence[str], plan: Plan) -> GrpoRun:
    """Everything read and checked (plan, batch, prompts, reward functions), nothing compiled."""
    from jaxpar.run.training import Run, make_optimizer, model_config
    from jaxpar.models import model_factory
    from jaxpar.train.state import describe

    compile_cache.use(config.compile_cache)
    check_plan(plan)
    per_batch = grpo_step.check_batch_size(config.batch_size, options.group_size)
    if not reward_specs:
        raise ValueError("--objective grpo needs at least one --reward (exact_answer, format, or module:function)")
    rewards = [rewards_lib.load_reward(spec) for spec in reward_specs]
    name, saved, hf_config = config.model, {}, None
    if config.init_from:
        from jaxpar.interop.hf import saved_hf_config, saved_model_config

        name, saved_config = saved_model_config(config.init_from)
        saved, hf_config = dataclasses.asdict(saved_config), saved_hf_config(config.init_from)
        config = dataclasses.replace(config, model=name)
    mcfg = model_config(name, {**saved, "seq_len": config.seq_len, **config.model_overrides})
    prompts = read_prompts(prompts_path, config.tokenizer, mcfg.vocab, config.seq_len, options.max_new_tokens)
    if len(prompts.records) < per_batch:
        raise ValueError(f"--prompts {prompts_path} holds {len(prompts.records)} records; a generation batch takes "
                         f"{per_batch} (--batch {config.batch_size} / --group-size {options.group_size})")
    probe(rewards, prompts, options.group_size)
    plan.check_batch(config.batch_size)
    make_model, trainable = lora.for_plan(model_factory(name, mcfg, config.seed), plan)
    model = describe(make_model, trainable)
    plan.param_specs(model.logical)
    optimizer = make_optimizer(config)
    trainer = GrpoTrainer(model, optimizer, plan, options, config.seq_len)
    run = Run(config, plan, mcfg, model, optimizer, None, make_model, trainer.step, None, hf_config)
    return GrpoRun(run, prompts, rewards, options, trainer, per_batch)


def probe(rewards, prompts: Prompts, group_size: int) -> None:
    """Each reward function called once on the first record's group with empty completions: what it returns is
    checked (one number per completion) before anything compiles."""
    record = prompts.records[0]
    rewards_lib.score(rewards, [record.prompt] * group_size, [""] * group_size, [[] for _ in range(group_size)],
                      [record.fields] * group_size, [prompts.where(record)])


def generation_rows(grpo_run: GrpoRun, state: TrainState, generation: int, order: np.ndarray):
    """(samples, rewards [rows, functions], the records) of one generation batch."""
    config, options, prompts = grpo_run.run.config, grpo_run.options, grpo_run.prompts
    n = grpo_run.prompts_per_batch
    records = [prompts.records[order[(generation * n + i) % len(order)]] for i in range(n)]
    stops = options.stop_tokens or ((prompts.end_of_turn,) if prompts.end_of_turn is not None else
                                    ((prompts.tokenizer.eos,) if prompts.tokenizer.eos is not None else ()))
    drawn = sample(grpo_run.run.model, grpo_run.run.plan, [r.ids for r in records], state.params,
                   group_size=options.group_size, max_new_tokens=options.max_new_tokens,
                   temperature=options.temperature, top_p=options.top_p, stop_tokens=stops,
                   seed=config.seed * 100003 + generation, mask_truncated=options.mask_truncated)
    texts = [prompts.tokenizer.decode([t for t in row if t not in stops]) for row in drawn.completions()]
    rows = [r for r in records for _ in range(options.group_size)]
    scores = rewards_lib.score(grpo_run.rewards, [r.prompt for r in rows], texts, drawn.completions(),
                               [r.fields for r in rows], [prompts.where(r) for r in records])
    return drawn, scores, records


def generation_figures(grpo_run: GrpoRun, drawn, scores: np.ndarray) -> tuple[np.ndarray, dict]:
    """(advantages, the figures users watch: rewards per function, completion lengths, cut completions)."""
    total = scores.sum(axis=1)
    advantages, figures = grpo.group_advantages(total, grpo_run.options.group_size, grpo_run.options.scale_rewards)
    for j, (name, _) in enumerate(grpo_run.rewards):
        figures[f"rewards/{name}/mean"] = float(scores[:, j].mean())
        figures[f"rewards/{name}/std"] = float(scores[:, j].std(ddof=1))
    figures.update({"completions/mean_length": float(drawn.lengths.mean()),
                    "completions/min_length": float(drawn.lengths.min()),
                    "completions/max_length": float(drawn.lengths.max()),
                    "completions/clipped_ratio": float(drawn.truncated.mean())})
    return advantages, figures


def iterate_grpo(grpo_run: GrpoRun, state: TrainState, write: Callable[[dict], None]):
    """Train for `config.steps` optimizer steps; yields (state, row) per step, each row written by `write`."""
    from jaxpar.run.training import learning_rate, scalar_metrics

    config, options, trainer = grpo_run.run.config, grpo_run.options, grpo_run.trainer
    trainer.start(state)
    lrs = np.asarray(jax.vmap(learning_rate(config))(np.arange(config.steps)))
    order = np.random.default_rng(config.seed).permutation(len(grpo_run.prompts.records))
    done = 0
    for generation in range(math.ceil(config.steps / options.iterations)):
        began = time.perf_counter()
        drawn, scores, _ = generation_rows(grpo_run, state, generation, order)
        advantages, figures = generation_figures(grpo_run, drawn, scores)
        sampled = time.perf_counter() - began
        began = time.perf_counter()
        state, metrics = trainer.train_on(state, drawn.prompt_ids, drawn.completion_ids, drawn.completion_mask,
                                          advantages)
        metrics = jax.block_until_ready(metrics)
        trained = time.perf_counter() - began
        for m in metrics[: config.steps - done]:
            row = {"step": done + 1, **scalar_metrics(m), **figures, "lr": float(lrs[done]), "generation": generation,
                   "sample_time_s": sampled, "train_time_s": trained / len(metrics)}
            done += 1
            write(row)
            yield state, row

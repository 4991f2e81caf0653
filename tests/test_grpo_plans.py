"""GRPO's optimizer steps on a plan equal plain single-device JAX for fixed sampled completions (<= 1e-5 per step).

One generation batch (4 prompts of different lengths x G=2 completions, stop tokens and padding, one completion
cut at the length limit), rewards fixed; two optimizer steps on it (old log-probs scored before the first), with
the k3 KL to the reference (LoRA: the base, adapters off; full: the initial weights). The reference is
tests/reference.py's Llama, GRPO's loss written out over the whole batch, and optax: it shares no code with jaxpar.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
import reference
import reference_lora
from helpers import max_relative_error
from jaxpar.core.plan import Plan
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.objectives.grpo_step import GrpoOptions
from jaxpar.run.grpo import GrpoTrainer
from jaxpar.train.state import TrainState, init_state

CFG = LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=16)
G, NEW, STOP, TEMPERATURE, BETA, SCALE = 2, 6, 1, 0.8, 0.1, 2.0
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20, 21, 22, 23], [30, 31, 32, 33, 34]]
COMPLETIONS = np.array([[40, 41, STOP, 0, 0, 0], [42, 43, 44, 45, 46, 47], [48, STOP, 0, 0, 0, 0],
                        [50, 51, 52, 53, STOP, 0], [STOP, 0, 0, 0, 0, 0], [54, 55, 56, 57, 58, STOP],
                        [59, 60, 61, STOP, 0, 0], [62, 63, 2, 3, 4, 5]], np.int32)
REWARDS = np.array([1.0, 0.0, 0.5, 2.0, 0.0, 1.0, 3.0, 1.0], np.float32)
OPTIMIZER = optax.adam(1e-3)
CASES = {"data8-full-bnpo": ("data=8", False, "bnpo"), "data8-lora-dr_grpo": ("data=8", True, "dr_grpo"),
         "data4-tensor2-full-dapo": ("data=4,tensor=2", False, "dapo"),
         "data4-tensor2-lora-grpo": ("data=4,tensor=2", True, "grpo")}


def plan_of(mesh: str, lora_on: bool) -> Plan:
    spec, parsed = jaxpar.parse_mesh(mesh)
    devices = jax.devices()[: int(np.prod(list(spec.shape.values())))]
    extra = {"lora_rank": 4, "lora_alpha": 8} if lora_on else {}
    return Plan.create(spec, devices=devices, **parsed, **extra)


@functools.lru_cache(maxsize=2)
def initial(lora_on: bool) -> TrainState:
    """The host state of the tiny Llama (with adapters whose B is random under LoRA), natural layer order."""
    plan = plan_of("data=1", lora_on)
    make, trainable = jaxpar.lora.for_plan(lambda: Llama(CFG, nnx.Rngs(0)), plan)
    state = jax.device_get(init_state(make, OPTIMIZER, plan, trainable)[1])
    if not lora_on:
        return state
    # B far enough from 0 that the policy is well off its base: the KL (the loss at the first step, where the
    # advantages of each group sum to 0) is then not a difference of nearly equal numbers
    params = jax.tree_util.tree_map_with_path(lambda path, x: 8 * x if str(path[-1]).endswith("_lora_b']") else x,
                                              reference_lora.with_random_b(state).params)
    return dataclasses.replace(state, params=params)


def written_out_batch():
    """The rows, targets and completion mask built here (prompt + completion, right-padded; TRL's mask)."""
    rows = [p for p in PROMPTS for _ in range(G)]
    tokens = np.zeros((len(rows), CFG.seq_len + 1), np.int32)
    mask = np.zeros((len(rows), CFG.seq_len), np.float32)
    for i, (prompt, completion) in enumerate(zip(rows, COMPLETIONS)):
        tokens[i, : len(prompt) + NEW] = list(prompt) + completion.tolist()
        stop = completion.tolist().index(STOP) if STOP in completion else NEW - 1
        mask[i, len(prompt) - 1: len(prompt) + stop] = 1.0
    groups = REWARDS.reshape(-1, G)
    advantages = (REWARDS - groups.mean(1).repeat(G)) / (groups.std(1, ddof=1).repeat(G) + 1e-4)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask, "advantages": advantages}


def logps(params, b):
    x = reference.embed(params, b["inputs"], CFG)
    for i in range(CFG.n_layers):
        x = reference.dense_block(reference.layer(params["blocks"], i), x, CFG)
    logits = (reference.residual_norm(x, params["final_norm"], CFG) @ params["head"]).astype(jnp.float32)
    logits = logits[..., : CFG.vocab] / TEMPERATURE
    return jnp.take_along_axis(jax.nn.log_softmax(logits), b["targets"][..., None], -1)[..., 0]


def grpo_loss(params, b, loss_type):
    new = logps(params, b)
    ratio, a, m = jnp.exp(new - b["old"]), b["advantages"][:, None], b["mask"]
    per = -jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a)
    per = per + BETA * (jnp.exp(b["ref"] - new) - (b["ref"] - new) - 1)
    if loss_type == "grpo":
        return jnp.mean((per * m).sum(1) / jnp.maximum(m.sum(1), 1.0)), {}
    if loss_type == "dr_grpo":
        return (per * m).sum() / (m.shape[0] * NEW), {}
    return (per * m).sum() / jnp.maximum(m.sum(), 1.0), {}  # bnpo, dapo: one step's batch is the generation batch


def reference_steps(params0, lora_on: bool, loss_type: str):
    b = {k: jnp.asarray(v) for k, v in written_out_batch().items()}
    scored = jax.jit(logps)
    if lora_on:
        adapters, frozen = reference_lora.split(jax.tree.map(jnp.asarray, params0))
        whole = lambda a: reference_lora.effective(frozen, a, SCALE)  # noqa: E731
        b["old"], b["ref"] = scored(whole(adapters), b), scored(reference_lora.effective(frozen, {}, SCALE), b)
        return reference.train(lambda a, batch: grpo_loss(whole(a), batch, loss_type), adapters, [b, b], OPTIMIZER)
    params0 = jax.tree.map(jnp.asarray, params0)
    b["old"] = b["ref"] = scored(params0, b)
    return reference.train(lambda p, batch: grpo_loss(p, batch, loss_type), params0, [b, b], OPTIMIZER)


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_steps_on_a_plan_equal_one_device(case):
    mesh, lora_on, loss_type = CASES[case]
    start = initial(lora_on)
    expected = reference_steps(start.params, lora_on, loss_type)

    plan = plan_of(mesh, lora_on)
    make, trainable = jaxpar.lora.for_plan(lambda: Llama(CFG, nnx.Rngs(0)), plan)
    model = jaxpar.describe(make, trainable)
    state = jaxpar.place_state(start, model, OPTIMIZER, plan)
    options = GrpoOptions(group_size=G, beta=BETA, loss_type=loss_type, iterations=2, temperature=TEMPERATURE,
                          max_new_tokens=NEW, stop_tokens=(STOP,))
    trainer = GrpoTrainer(model, OPTIMIZER, plan, options, CFG.seq_len)
    trainer.start(state)
    mask = jaxpar.objectives.grpo.completion_mask(COMPLETIONS, [STOP])
    advantages = written_out_batch()["advantages"]
    state, metrics = trainer.train_on(state, [p for p in PROMPTS for _ in range(G)], COMPLETIONS, mask, advantages)
    losses = np.array([float(m["loss"]) for m in metrics])
    errors = np.abs(losses - expected.losses) / np.abs(expected.losses)
    trained = reference_lora.split(jax.device_get(state.params))[0] if lora_on else jax.device_get(state.params)
    params_error = max_relative_error(trained, expected.params)
    print(f"{case}: losses {losses}, relative errors {errors}, parameters {params_error:.1e}, "
          f"clip {float(metrics[1]['clip_ratio/region_mean']):.3f}, kl {float(metrics[1]['kl']):.2e}")
    assert np.all(errors <= 1e-5), (losses, expected.losses)
    assert params_error <= 1e-5
    assert float(metrics[1]["kl"]) > 0  # the second step has moved off the reference

"""DeepSeek-V3's auxiliary-loss-free load balancing (`router_bias_update`): each MoE layer's router correction moved
after every step by gamma * sign(mean load - load), over the step's whole batch.

A tiny DeepSeek (3 blocks, the first dense; top-2 of 8 experts in 2 of 4 groups) trains 2 AdamW steps on each plan.
The reference is the rule in numpy on the loads the step reports: the corrections must equal it within 1e-6 on
every plan (and the plans' loads must be the same counts); AdamW (with the run's decay mask) leaves the correction
alone, it gets no gradient. From a correction that sends every token to two experts, the rule brings the loads
towards balance.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import copy_state, single_device_plan
from jaxpar.core.plan import Plan
from jaxpar.models.deepseek import DeepseekConfig, DeepseekV3
from jaxpar.run.training import decayed
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step

slow = pytest.mark.slow
GAMMA = 0.1
CONFIG = DeepseekConfig(vocab=64, d_model=32, n_layers=3, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=48,
                        expert_d_ff=16, n_experts=8, top_k=2, seq_len=16, q_lora_rank=16, kv_lora_rank=12,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, router_groups=4, router_topk_groups=2,
                        routed_scale=2.5, router_bias_update=GAMMA)
PLANS = {
    "data": ("data=8", {}),
    "zero3": ("data=4", {"zero": 3}),
    "expert": ("data=2,expert=4", {}),
    "expert-tensor-zero3-accum": ("data=2,expert=2,tensor=2", {"zero": 3, "grad_accum": 2}, slow),
    "context-ring": ("data=4,context=2", {"context_form": "ring"}, slow),
}


def correction(params) -> np.ndarray:
    return np.asarray(params["blocks"]["moe"]["router_correction"], np.float64)


def reference_rule(bias: np.ndarray, share: np.ndarray, assignments: int) -> np.ndarray:
    """The paper's update in numpy: loads as counts, each expert moved by gamma towards the mean load."""
    load = np.rint(share * assignments)
    assert np.all(load.sum(-1) == assignments), load.sum(-1)  # every token's top-k choices counted once per layer
    return bias + GAMMA * np.sign(load.mean(-1, keepdims=True) - load)


@functools.cache
def start():
    """(model, initial state, optimizer, 2 batches)."""
    optimizer = optax.adamw(1e-2, weight_decay=0.1, mask=decayed)  # the run's optimizer: no decay on the correction
    model, state = init_state(lambda: DeepseekV3(CONFIG, nnx.Rngs(0)), optimizer, single_device_plan())
    rng = np.random.default_rng(0)
    batches = [{"inputs": jnp.asarray(x, jnp.int32), "targets": jnp.asarray((x + 1) % CONFIG.vocab, jnp.int32)}
               for x in (rng.integers(0, CONFIG.vocab, (8, 16)) for _ in range(2))]
    return model, state, optimizer, batches


def train(plan: Plan, steps: int = 2, state=None):
    """(corrections before each step and after the last, each step's reported loads [layers, E]) under `plan`."""
    model, initial, optimizer, batches = start()
    placed = place_state(copy_state(initial if state is None else state), model, optimizer, plan)
    step = make_train_step(model, lambda m, b: m(b), optimizer, plan)
    biases, shares = [correction(jax.device_get(placed.params))], []
    for i in range(steps):
        placed, metrics = step(placed, batches[i % len(batches)])
        biases.append(correction(jax.device_get(placed.params)))
        shares.append(np.asarray(metrics["expert_load"], np.float64))
    return biases, shares


@functools.cache
def one_device():
    return train(single_device_plan())


def test_one_device_follows_the_rule():
    """Each step's corrections equal the numpy rule on that step's loads; the loads change with the corrections."""
    biases, shares = one_device()
    assignments = 8 * 16 * CONFIG.top_k
    assert shares[0].shape == (CONFIG.n_layers - CONFIG.first_dense, CONFIG.n_experts)
    for before, share, after in zip(biases, shares, biases[1:]):
        expected = reference_rule(before, share, assignments)
        assert np.max(np.abs(after - expected)) <= 1e-6
        assert np.any(after != before)


@pytest.mark.parametrize("name", [pytest.param(name, marks=cell[2:]) for name, cell in PLANS.items()])
def test_every_plan_moves_the_corrections_as_one_device(name):
    """The same loads (as counts) and the same corrections, within 1e-6, on each plan."""
    mesh, options = PLANS[name][:2]
    ranks = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    biases, shares = train(Plan.create(mesh, devices=jax.devices()[:ranks], **options))
    expected_biases, expected_shares = one_device()
    assignments = 8 * 16 * CONFIG.top_k
    for share, expected in zip(shares, expected_shares):
        assert np.array_equal(np.rint(share * assignments), np.rint(expected * assignments)), name
    for bias, expected in zip(biases, expected_biases):
        assert np.max(np.abs(bias - expected)) <= 1e-6, name


def test_a_skewed_start_moves_towards_balance():
    """Corrections that send every token to experts 0 and 1: the rule takes load from them step by step."""
    model, state, optimizer, batches = start()
    skewed = copy_state(state)
    bias = np.zeros_like(correction(skewed.params), np.float32)
    bias[:, :2] = 1.0  # more than any gap between two sigmoid scores: both always chosen
    skewed.params["blocks"]["moe"]["router_correction"] = bias
    biases, shares = train(single_device_plan(), steps=12, state=skewed)
    overload = [float(np.max(s)) * CONFIG.n_experts for s in shares]  # 1: balanced, 4: all on 2
    print("overload per step", np.round(overload, 3))
    assert overload[0] == pytest.approx(4.0)
    assert np.mean(overload[-4:]) < 2.0, overload  # it settles around balance, within a step of gamma
    assert np.all(biases[-1][:, :2] < 1.0)


def test_off_keeps_the_imported_correction():
    """router_bias_update=0 (the default): no loads are kept and the correction stays as it was."""
    optimizer = optax.adamw(1e-2, weight_decay=0.1, mask=decayed)
    cfg = dataclasses.replace(CONFIG, router_bias_update=0.0)
    model, state = init_state(lambda: DeepseekV3(cfg, nnx.Rngs(0)), optimizer, single_device_plan())
    before = correction(copy_state(state).params)
    new, metrics = make_train_step(model, lambda m, b: m(b), optimizer, single_device_plan())(state, start()[3][0])
    assert "expert_load" not in metrics
    assert np.array_equal(correction(jax.device_get(new.params)), before)


def test_a_pipeline_and_a_negative_rate_are_refused():
    """A pipeline's stages sum their layers' loads: refused by name, before compiling; gamma < 0 too."""
    cfg = dataclasses.replace(CONFIG, first_dense=0, n_layers=2)
    optimizer = optax.sgd(0.1)
    model, state = init_state(lambda: DeepseekV3(cfg, nnx.Rngs(0)), optimizer, single_device_plan())
    plan = Plan.create("data=2,pipe=2", devices=jax.devices()[:4], schedule="1f1b")
    placed = place_state(copy_state(state), model, optimizer, plan)
    with pytest.raises(ValueError, match="router_bias_update=0.1 with pipe=2"):
        make_train_step(model, lambda m, b: m(b), optimizer, plan)(placed, start()[3][0])
    with pytest.raises(ValueError, match="router_bias_update=-0.1 must be >= 0"):
        dataclasses.replace(CONFIG, router_bias_update=-0.1)


def test_zero1_bf16_moves_the_fp32_master():
    """ZeRO-1 under bf16 holds 2-byte params and an fp32 master they are gathered from: the rule moves the master
    (by the plan's own loads), and the params are its 2-byte cast, so no step's move is lost."""
    model, initial, optimizer, batches = start()
    plan = Plan.create("data=4", devices=jax.devices()[:4], zero=1, precision="bf16")
    placed = place_state(copy_state(initial), model, optimizer, plan)
    step = make_train_step(model, lambda m, b: m(b), optimizer, plan)
    master = lambda state: correction(jax.device_get(state.opt_state.master))  # noqa: E731
    for batch in batches:
        before = master(placed)
        placed, metrics = step(placed, batch)
        expected = reference_rule(before, np.asarray(metrics["expert_load"], np.float64), 8 * 16 * CONFIG.top_k)
        assert np.max(np.abs(master(placed) - expected)) <= 1e-6
        params = jax.device_get(placed.params)["blocks"]["moe"]["router_correction"]
        assert params.dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(params, np.float32), master(placed).astype(jnp.bfloat16).astype(np.float32))

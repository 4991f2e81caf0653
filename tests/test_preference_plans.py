"""DPO trains the same on every plan as a plain-JAX single-device reference (tests/reference_preference.py).

Pairs packed two documents a row; full fine-tuning with the reference's log-probs carried in the batch, and LoRA
with the reference the same weights with the adapters off (carried in the batch too under a pipeline). Two SGD
steps; losses and parameters within 1e-5. On data=8 ZeRO-3, data=2,tensor=4, data=4,pipe=2 1F1B, an MoE on
data=4,expert=2, and (LoRA) data=2,context=4.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import reference_lora
import reference_preference
from helpers import TINY, copy_state, max_relative_error, single_device_plan
from jaxpar.core.plan import Plan
from jaxpar.data.packing import Document
from jaxpar.data.preference import pack_pairs
from jaxpar.models.llama import Llama
from jaxpar.models.moe import MoeLlama, MoeLlamaConfig
from jaxpar.objectives import REFERENCE, Preference
from jaxpar.parallel import lora
from jaxpar.pipeline.layer_order import to_natural_order
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step

BETA, RANK, ALPHA, STEPS, SEQ, PAIRS = 0.5, 4, 8.0, 2, 32, 8
OPTIMIZER = optax.sgd(0.5)
MIXTRAL = MoeLlamaConfig(vocab=256, d_model=32, n_layers=2, moe_every=1, n_heads=2, n_kv_heads=2, head_dim=16,
                         d_ff=64, expert_d_ff=32, n_experts=4, top_k=2, dropless=True, seq_len=SEQ,
                         load_balance_coef=0.0)  # no router loss: the reference runs each document alone
CONFIGS = {"llama": (Llama, TINY), "mixtral": (MoeLlama, MIXTRAL)}


def pairs(seed: int) -> dict[str, np.ndarray]:
    """PAIRS random pairs: a prompt of 2..6 tokens shared by answers of 2..8, the answers trained."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(PAIRS):
        prompt = rng.integers(3, 250, rng.integers(2, 7))
        docs = []
        for _ in range(2):
            answer = rng.integers(3, 250, rng.integers(2, 9))
            docs.append(Document(np.concatenate([prompt, answer]),
                                 np.concatenate([np.zeros(len(prompt)), np.ones(len(answer))]).astype(np.float32)))
        out.append(tuple(docs))
    return pack_pairs(out, SEQ)


@functools.cache
def initial(family: str, adapters: bool):
    make, cfg = CONFIGS[family]

    def build():
        model = make(cfg, nnx.Rngs(0))
        if adapters:
            lora.apply(model, RANK, ALPHA, targets=("q", "k", "v", "o", "gate", "up", "down"), rngs=nnx.Rngs(1))
        return model

    kwargs = {"trainable": lora.TRAINABLE} if adapters else {}
    model, state = init_state(build, OPTIMIZER, single_device_plan(), **kwargs)
    state = copy_state(state)
    return model, reference_lora.with_random_b(state) if adapters else state


@functools.cache
def data(family: str, adapters: bool, carried: bool):
    """The batch of every step (the same: the second step's loss then shows learning); `carried`: with the
    reference's log-probs (the initial model's, or the base's under LoRA) in it, as --precompute-reference makes it."""
    batches = [pairs(0)] * STEPS
    if not carried:
        return batches
    params = jax.tree.map(jnp.asarray, initial(family, adapters)[1].params)
    if adapters:
        params = reference_lora.effective(reference_lora.split(params)[1], {}, ALPHA / RANK)
    cfg = CONFIGS[family][1]
    return [{**b, REFERENCE: reference_preference.in_rows(reference_preference.answer_token_logps(
        params, reference_preference.alone(b), cfg), b)} for b in batches]


@functools.cache
def expected(family: str, adapters: bool, carried: bool):
    cfg, params0 = CONFIGS[family][1], initial(family, adapters)[1].params
    batches = [reference_preference.alone(b) for b in data(family, adapters, carried)]
    if not adapters:
        loss = functools.partial(reference_preference.dpo_loss, reference_params=None, cfg=cfg, beta=BETA)
        return reference_preference.reference.train(lambda p, b: loss(p, docs=b), params0, batches, OPTIMIZER)
    trained, frozen = reference_lora.split(jax.tree.map(jnp.asarray, params0))
    base = None if carried else reference_lora.effective(frozen, {}, ALPHA / RANK)

    def loss(a, batch):
        return reference_preference.dpo_loss(reference_lora.effective(frozen, a, ALPHA / RANK), base, batch, cfg, BETA)

    return reference_preference.reference.train(loss, trained, batches, OPTIMIZER)


def run(family: str, adapters: bool, carried: bool, mesh: str, **options):
    model, state = initial(family, adapters)
    plan = Plan.create(mesh, **options)
    state = place_state(copy_state(state), model, OPTIMIZER, plan)
    batches = data(family, adapters, carried)
    step = make_train_step(model, Preference("dpo", beta=BETA), OPTIMIZER, plan).lower(state, batches[0]).compile()
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    state = jax.device_get(state)
    state.params = to_natural_order(state.params, model.logical, plan)
    return np.array(losses), state, metrics


CELLS = [("llama", False, "data=8", {"zero": 3}), ("llama", True, "data=8", {"zero": 3}),
         ("llama", False, "data=2,tensor=4", {}), ("llama", True, "data=2,tensor=4", {}),
         ("mixtral", False, "data=4,expert=2", {}), ("mixtral", True, "data=4,expert=2", {}),
         ("llama", False, "data=4,pipe=2", {"schedule": "1f1b", "microbatches": 2}),
         ("llama", True, "data=4,pipe=2", {"schedule": "1f1b", "microbatches": 2}),
         ("llama", True, "data=2,context=4", {})]


@pytest.mark.parametrize("family,adapters,mesh,options", CELLS,
                         ids=lambda v: v if isinstance(v, str) else ("lora" if v is True else "full" if v is False
                                                                     else ",".join(f"{k}={o}" for k, o in v.items())))
def test_dpo_on_a_plan_matches_plain_jax(family, adapters, mesh, options):
    carried = not adapters or "pipe" in mesh  # a pipeline's DPO reference comes with the data
    losses, state, metrics = run(family, adapters, carried, mesh, **options)
    ref = expected(family, adapters, carried)
    assert np.max(np.abs(losses / ref.losses - 1)) <= 1e-5, (losses, ref.losses)
    params = reference_lora.split(state.params)[0] if adapters else state.params
    assert max_relative_error(params, ref.params) <= 1e-5
    assert ref.losses[-1] < ref.losses[0]
    if "pipe" not in mesh:
        assert {"chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy"} <= set(metrics)

"""Shared test fixtures: tiny models, identical initial states on several plans, relative errors."""

from __future__ import annotations

import os

import jax
import numpy as np
import optax
from flax import nnx

from jaxpar.data.tokens import Batches, default_corpus
from jaxpar.pipeline.layer_order import to_natural_order, to_pipeline_order
from jaxpar.models.llama import CONFIGS, Llama
from jaxpar.core.plan import Plan
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step

TINY = CONFIGS["tiny"]


def single_device_plan(**options) -> Plan:
    return Plan.create("data=1", devices=jax.devices()[:1], **options)


def reference_state(config=TINY, optimizer=None, seed: int = 0):
    """Model definition and train state on one device: the baseline every strategy must match."""
    optimizer = optimizer or optax.adamw(1e-3)
    model, state = init_state(lambda: Llama(config, nnx.Rngs(seed)), optimizer, single_device_plan())
    return model, state, optimizer


def copy_state(state):
    return jax.tree.map(lambda x: np.array(x), state)


def train(model, state, optimizer, plan: Plan, batches, steps: int, loss_fn=lambda m, b: m(b)):
    """Run `steps` steps of `plan` from a copy of `state`; return the losses and final state on host."""
    state = place_state(copy_state(state), model, optimizer, plan)
    step = make_train_step(model, loss_fn, optimizer, plan)
    losses = []
    for i in range(steps):
        state, metrics = step(state, batches[i])
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state)


def compile_and_train(model, state, optimizer, plan: Plan, data, steps: int):
    """Compile the step once, run `steps` steps from a copy of `state`: (losses, final state, compiled step)."""
    state = place_state(copy_state(state), model, optimizer, plan)
    compiled = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(state, data[0]).compile()
    losses = []
    for i in range(steps):
        state, metrics = compiled(state, data[i])
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state), compiled


def batches(batch_size=16, seq_len=32, seed=0) -> Batches:
    return Batches(default_corpus(), batch_size, seq_len, seed)


def max_relative_error(a, b) -> float:
    """Largest per-leaf relative error ||a - b|| / ||b|| (Frobenius norms), over matching leaves.

    Norm-wise per leaf, as numerical analysis defines the relative error of a
    vector: an element whose gradient is near zero carries roundoff that Adam's
    normalisation turns into a full-size step, so element-wise ratios on such
    entries measure noise rather than the strategy.
    """
    def leaf_error(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))

    return max(jax.tree.leaves(jax.tree.map(leaf_error, a, b)))


def gradients(model, params, batch, plan: Plan, loss_fn=lambda m, b: m(b)):
    """Loss and gradients of `params` on `batch`, computed under `plan` and returned on host.

    Parameters and gradients in natural layer order; under `plan` in its own (jaxpar.pipeline.layer_order).
    """
    from jaxpar.train.step import loss_and_grads

    params = to_pipeline_order(copy_state(params), model.logical, plan)
    params = jax.device_put(params, plan.shardings(plan.param_specs(model.logical)))

    def compute(p, b):
        loss, _, grads, _ = loss_and_grads(model, loss_fn, p, b, plan)
        return loss, grads

    with plan.activate():
        loss, grads = jax.device_get(jax.jit(compute)(params, batch))
    return loss, to_natural_order(grads, model.logical, plan)


class ResidualMLP(nnx.Module):
    """A residual MLP block [.., width] -> [.., width] written as a Flax user writes one, its weights named logically."""

    def __init__(self, rngs: nnx.Rngs, width: int = 32, hidden: int = 64):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(width, hidden, use_bias=False, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             rngs=rngs)
        self.down = nnx.Linear(hidden, width, use_bias=False,
                               kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


def sharded_lookup_bytes(config, group_rows: int, accum: int = 1) -> dict[str, int]:
    """The collective bytes a ZeRO-2/3 embedding lookup trades (jaxpar.parallel.tensor.embedding_lookup) for a data group
    of `group_rows` sequences: the fp32 table is neither all-gathered nor its gradient reduce-scattered; the
    group's int32 tokens are all-gathered, and its fp32 rows reduce-scattered forward and all-gathered backward.
    All zero where the lookup gathers the table instead: when the table and its gradient (2 V d fp32) are fewer
    bytes than one accumulation run's tokens and rows both ways (group tokens x (4 + 2 d fp32))."""
    tokens_per_run = group_rows * config.seq_len // accum
    if 2 * config.vocab * config.d_model * 4 < tokens_per_run * (4 + 2 * config.d_model * 4):
        return {"table": 0, "tokens": 0, "rows": 0}
    return {"table": config.vocab * config.d_model * 4, "tokens": group_rows * config.seq_len * 4,
            "rows": group_rows * config.seq_len * config.d_model * 4}


def flash_recomputed_flops(config, sequences: int, seq: int) -> float:
    """The matmul FLOPs flash attention's backward adds to the model FLOPs (6 N + attention): it recomputes q . k^T,
    2 s^2 h hd per sequence and layer (one block pair at the tests' lengths, so the whole square)."""
    return sequences * config.n_layers * 2 * seq * seq * config.n_heads * config.head_dim


def inspection_as_users_compile(run) -> dict:
    """`jaxpar inspect --json` of `run`, compiled with XLA:CPU's default fusion emitters where the suite compiles
    with its classic ones (conftest.CLASSIC_EMITTERS: their buffer assignment can differ): the memory the planner
    is held against is what a user's XLA:CPU compiles."""
    from jaxpar.core import gpu_profile
    from jaxpar.run.report import inspection

    original = gpu_profile.compile_options
    classic = "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")

    def with_default_emitters(facts, profile="auto", environ=os.environ):
        options = original(facts, profile, environ)
        return options if facts.target or not classic else {**options, "xla_cpu_use_fusion_emitters": True}

    gpu_profile.compile_options = with_default_emitters
    try:
        return inspection(run)
    finally:
        gpu_profile.compile_options = original

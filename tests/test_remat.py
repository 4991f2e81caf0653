"""Activation checkpointing: none, selective and full give the same step, trading memory for recomputation."""

import jax
import optax
import pytest
from flax import nnx

from helpers import batches, copy_state, max_relative_error, single_device_plan
from jaxpar.planner import inspect
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step

CONFIG = LlamaConfig(vocab=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=32)


@pytest.mark.parametrize("attention", ["xla", "flash"])
def test_remat_policies_trade_memory_for_flops_and_change_nothing_else(attention):
    """Under the plain softmax, whose kept scores dominate at this size, no remat needs over twice full remat's
    temp memory; under flash attention, which keeps none, the order holds."""
    optimizer = optax.adamw(3e-3)
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optimizer, single_device_plan())
    batch = batches(batch_size=16, seq_len=CONFIG.seq_len)[0]
    results = {}
    for policy in ("none", "selective", "full"):
        plan = single_device_plan(remat=policy, attention=attention)
        placed = place_state(copy_state(state), model, optimizer, plan)
        compiled = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(placed, batch).compile()
        new_state, metrics = compiled(placed, batch)
        results[policy] = (float(metrics["loss"]), jax.device_get(new_state.params),
                           inspect.memory(compiled)["temp"], inspect.flops(compiled))
    loss, params, temp, flops = results["none"]
    for policy in ("selective", "full"):
        assert results[policy][0] == loss
        assert max_relative_error(results[policy][1], params) <= 1e-6
    temps = [results[p][2] for p in ("none", "selective", "full")]
    assert temps[0] > temps[1] > temps[2] and (temps[0] > 2 * temps[2] or attention == "flash")
    flops = [results[p][3] for p in ("none", "selective", "full")]
    assert flops[0] < flops[1] < flops[2]

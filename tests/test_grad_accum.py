"""Gradient accumulation: K microbatches in a scan equal one step on the whole batch, reduced once per step."""

import numpy as np
import optax
import pytest
from flax import nnx

from helpers import batches, compile_and_train, max_relative_error, single_device_plan
from jaxpar.planner import inspect
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.core.plan import Plan
from jaxpar.train.state import init_state

CONFIG = LlamaConfig(vocab=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=32)
STEPS = 3


def run(model, state, optimizer, plan, data):
    """(losses, final state, compiled step) of STEPS steps of `plan` from a copy of `state`."""
    return compile_and_train(model, state, optimizer, plan, data, STEPS)


@pytest.fixture(scope="module")
def whole_batch():
    optimizer = optax.adamw(3e-3)
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optimizer, single_device_plan())
    data = batches(batch_size=32, seq_len=CONFIG.seq_len)
    return model, state, optimizer, data, *run(model, state, optimizer, single_device_plan(), data)


def test_accumulation_on_one_device_equals_the_whole_batch_in_less_memory(whole_batch):
    model, state, optimizer, data, ref_losses, ref_final, ref_compiled = whole_batch
    losses, final, compiled = run(model, state, optimizer, single_device_plan(grad_accum=4), data)
    assert np.max(np.abs(losses / ref_losses - 1)) <= 1e-5
    assert max_relative_error(final.params, ref_final.params) <= 1e-5
    # Activations live for one microbatch (a quarter of the batch) at a time.
    assert inspect.memory(compiled)["temp"] < 0.5 * inspect.memory(ref_compiled)["temp"]


def test_data_parallel_accumulation_reduces_gradients_once_per_step(whole_batch):
    model, state, optimizer, data, ref_losses, ref_final, _ = whole_batch
    plan = Plan.create("data=8", grad_accum=4)
    losses, final, compiled = run(model, state, optimizer, plan, data)
    assert np.max(np.abs(losses / ref_losses - 1)) <= 1e-5
    assert max_relative_error(final.params, ref_final.params) <= 1e-5
    reductions = [op for op in inspect.collective_ops(compiled, plan.mesh) if op.axes == ("data",)]
    assert {op.kind for op in reductions} == {"all-reduce"}
    assert all(op.count == 1 for op in reductions)  # none inside the microbatch loop
    assert model.param_bytes() <= sum(op.bytes for op in reductions) < model.param_bytes() + 64

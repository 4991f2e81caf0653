"""DDP over data=8 trains exactly like one device, and its gradient all-reduce moves the parameter bytes."""

import jax
import numpy as np
import pytest

from helpers import TINY, batches, gradients, max_relative_error, reference_state, single_device_plan, train
from jaxpar import inspect
from jaxpar.plan import Plan
from jaxpar.state import init_state, place_state
from jaxpar.step import make_train_step

STEPS = 10


@pytest.fixture(scope="module")
def reference():
    model, state, optimizer = reference_state()
    data = batches()
    losses, final = train(model, state, optimizer, single_device_plan(), data, STEPS)
    return model, state, optimizer, data, losses, final


def test_ddp_matches_single_device(reference):
    model, state, optimizer, data, ref_losses, ref_final = reference
    losses, final = train(model, state, optimizer, Plan.create("data=8"), data, STEPS)
    assert np.max(np.abs(losses / ref_losses - 1)) <= 1e-5
    assert max_relative_error(final.params, ref_final.params) <= 1e-5
    assert ref_losses[-1] < ref_losses[0]


def test_ddp_gradients_match_single_device(reference):
    model, state, _, data, _, _ = reference
    ref_loss, ref_grads = gradients(model, state.params, data[0], single_device_plan())
    loss, grads = gradients(model, state.params, data[0], Plan.create("data=8"))
    assert abs(loss / ref_loss - 1) <= 1e-6
    assert max_relative_error(grads, ref_grads) <= 1e-5


def test_same_seed_same_parameters_on_any_mesh():
    from flax import nnx
    from jaxpar.models.llama import Llama
    import optax

    made = [
        jax.device_get(init_state(lambda: Llama(TINY, nnx.Rngs(3)), optax.sgd(0.1), plan)[1].params)
        for plan in (single_device_plan(), Plan.create("data=4,tensor=2"), Plan.create("data=8"))
    ]
    for other in made[1:]:
        assert max_relative_error(other, made[0]) == 0.0


def test_ddp_gradient_all_reduce_moves_parameter_bytes(reference):
    model, state, optimizer, data, _, _ = reference
    plan = Plan.create("data=8")
    placed = place_state(jax.tree.map(np.array, state), model, optimizer, plan)
    step = make_train_step(model, lambda m, b: m(b), optimizer, plan)
    compiled = step.lower(placed, data[0]).compile()
    rows = inspect.collectives(compiled, plan.mesh)
    assert [(r["kind"], r["axes"]) for r in rows] == [("all-reduce", ["data"])]
    param_bytes = model.param_bytes()
    assert abs(rows[0]["bytes"] / param_bytes - 1) <= 0.01
    assert rows[0]["traffic"] == pytest.approx(2 * 7 / 8 * rows[0]["bytes"])

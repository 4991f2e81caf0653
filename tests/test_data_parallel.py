"""DDP over data=8 trains exactly like one device, and its gradient all-reduce moves the parameter bytes."""

import jax
import numpy as np
import pytest

from helpers import TINY, batches, gradients, max_relative_error, reference_state, single_device_plan, train
from jaxpar.planner import inspect
from jaxpar.core.plan import Plan
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step

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


@pytest.mark.parametrize("grad_accum,remat", [(1, "full"), (2, "full"), (1, "none")])
def test_ddp_sums_each_layers_gradients_as_the_backward_scan_makes_them(reference, grad_accum, remat):
    """One microbatch per step, under remat: each layer's gradients are all-reduced inside the backward layer scan
    (DDP's overlap with the backward pass; no full-size gradient waits for one combined sum), the embedding's,
    head's and final norm's after it. Accumulated microbatches are summed once per step, after the last one, and
    so is everything without remat (the backward would keep each layer's marked parameters)."""
    model, state, optimizer, data, _, _ = reference
    plan = Plan.create("data=8", grad_accum=grad_accum, remat=remat)
    placed = place_state(jax.tree.map(np.array, state), model, optimizer, plan)
    compiled = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(placed, data[0]).compile()
    sums = [op for op in inspect.collective_ops(compiled, plan.mesh) if op.kind == "all-reduce" and op.bytes >= 64]
    per_layer = [op for op in sums if op.count == TINY.n_layers]
    assert len(per_layer) == (1 if (grad_accum, remat) == (1, "full") else 0)
    layers = sum(op.bytes * op.count for op in per_layer)
    once = sum(op.bytes for op in sums if op.count == 1)
    assert abs((once + layers) / model.param_bytes() - 1) <= 0.01
    if per_layer:
        assert layers == 4 * sum(x.size for x in jax.tree.leaves(state.params["blocks"]))  # fp32, every layer

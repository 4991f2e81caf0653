"""A Hugging Face family's config trained under a strategy against the plain-JAX reference (the families' files)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import reference as reference_lib
from helpers import copy_state, max_relative_error, single_device_plan
from jaxpar.core.plan import Plan
from jaxpar.pipeline.layer_order import to_natural_order
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step


def reference_run(make_model, cfg):
    """(model, initial state, optimizer, 3 batches, the single-device reference's result after 3 SGD steps)."""
    optimizer = optax.sgd(0.5)
    model, state = init_state(make_model, optimizer, single_device_plan())
    rng = np.random.default_rng(0)
    batches = [{"inputs": jnp.asarray(rng.integers(0, cfg.vocab, (8, 16)), jnp.int32),
                "targets": jnp.asarray(rng.integers(0, cfg.vocab, (8, 16)), jnp.int32)} for _ in range(3)]
    expected = reference_lib.train(reference_lib.loss_fn(cfg), copy_state(state).params, batches, optimizer)
    return model, state, optimizer, batches, expected


def assert_matches(run, mesh: str, options: dict, label: str) -> None:
    """3 SGD steps of `run` (reference_run's) under the plan: every loss and the final parameters within 1e-5."""
    model, state, optimizer, batches, expected = run
    plan = Plan.create(mesh, devices=jax.devices()[:8], **options)
    placed = place_state(copy_state(state), model, optimizer, plan)
    step = make_train_step(model, lambda m, b: m(b), optimizer, plan)
    losses = []
    for batch in batches:
        placed, metrics = step(placed, batch)
        losses.append(float(metrics["loss"]))
    loss_error = np.max(np.abs(np.array(losses) / expected.losses - 1))
    assert loss_error <= 1e-5, loss_error
    params = to_natural_order(jax.device_get(placed.params), model.logical, plan)
    param_error = max_relative_error(params, expected.params)
    assert param_error <= 1e-5, param_error
    assert expected.losses[-1] < expected.losses[0]
    print(f"{label}: losses {loss_error:.1e}, parameters {param_error:.1e}")


def assert_explicit_tensor_form_refused(run) -> None:
    """An MoE family's experts split their hidden width by annotations only: tensor_form='explicit' is refused
    by name, before compiling."""
    model, state, optimizer, batches, _ = run
    plan = Plan.create("data=4,tensor=2", devices=jax.devices()[:8], tensor_form="explicit")
    placed = place_state(copy_state(state), model, optimizer, plan)
    try:
        make_train_step(model, lambda m, b: m(b), optimizer, plan)(placed, batches[0])
    except ValueError as error:
        assert "tensor_form='annotation'" in str(error), error
    else:
        raise AssertionError("tensor_form='explicit' on an MoE family trained instead of being refused")

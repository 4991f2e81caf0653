"""`jaxpar.checkpoint.Checkpoints` in a loop of one's own: exact resume with its data state, restore onto another
plan, SIGTERM as a forced save and a stop, a damaged step passed over."""

import os
import signal

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.checkpoint import Checkpoints
from jaxpar.models.llama import CONFIGS, Llama

CONFIG = CONFIGS["tiny"]
OPTIMIZER = optax.adamw(1e-3)


def _batch(step: int) -> dict:
    tokens = np.random.default_rng(step).integers(0, CONFIG.vocab, (8, 17)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _start(plan):
    model, state = jaxpar.init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), OPTIMIZER, plan)
    return model, state, jaxpar.make_train_step(model, lambda m, b: m(b), OPTIMIZER, plan)


def _loop(checkpoints, step_fn, state, start, stop, losses):
    for step in range(start, stop):
        state, metrics = step_fn(state, _batch(step))
        losses.append(float(metrics["loss"]))
        checkpoints.save(step + 1, state, data_state={"position": step + 1})
        if checkpoints.reached_preemption(step + 1):
            break
    return state


def test_a_loop_resumes_exactly_with_its_data_state_and_restores_onto_another_plan(tmp_path):
    plan = jaxpar.Plan.create("data=8")
    model, state, step_fn = _start(plan)
    initial = jax.device_get(state)  # the step donates its input state: each run starts from a copy
    whole = []
    with Checkpoints(tmp_path / "whole", model, OPTIMIZER, plan, save_every=100) as checkpoints:
        _loop(checkpoints, step_fn, state, 0, 4, whole)

    first = []
    with Checkpoints(tmp_path / "ck", model, OPTIMIZER, plan, save_every=2, keep=2) as checkpoints:
        _loop(checkpoints, step_fn, jaxpar.place_state(initial, model, OPTIMIZER, plan), 0, 2, first)
    with Checkpoints(tmp_path / "ck", model, OPTIMIZER, plan, save_every=2, keep=2) as checkpoints:
        assert checkpoints.latest_step() == 2
        resumed, data_state = checkpoints.restore()
        assert data_state == {"position": 2} and int(resumed.step) == 2
        _loop(checkpoints, step_fn, resumed, data_state["position"], 4, first)
        assert checkpoints.all_steps() == [2, 4]
    np.testing.assert_array_equal(first, whole)  # the same compiled step on the same values: bit for bit

    other = jaxpar.Plan.create("data=2,tensor=2,pipe=2", zero=3)
    other_model, _, _ = _start(other)
    with Checkpoints(tmp_path / "ck", other_model, OPTIMIZER, other, read_only=True) as checkpoints:
        moved, data_state = checkpoints.restore(2)
    with Checkpoints(tmp_path / "ck", model, OPTIMIZER, plan, read_only=True) as checkpoints:
        here, _ = checkpoints.restore(2)
    assert data_state == {"position": 2}
    natural = jaxpar.to_natural_order(jax.device_get(moved.params), other_model.logical, other)
    jax.tree.map(np.testing.assert_array_equal, natural, jax.device_get(here.params))


def test_sigterm_saves_the_step_it_came_in_and_stops_the_loop(tmp_path):
    plan = jaxpar.Plan.create("data=8")
    model, state, step_fn = _start(plan)
    losses = []
    with Checkpoints(tmp_path / "ck", model, OPTIMIZER, plan, save_every=100) as checkpoints:
        state = _loop(checkpoints, step_fn, state, 0, 1, losses)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption notice, between steps
        _loop(checkpoints, step_fn, state, 1, 10, losses)
        checkpoints.wait_until_finished()
        assert len(losses) == 2 and checkpoints.all_steps() == [2]
        assert checkpoints.metadata()["data_state"] == {"position": 2}
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back on close


def test_a_damaged_newest_step_is_set_aside_and_the_one_before_restored(tmp_path):
    plan = jaxpar.Plan.create("data=8")
    model, state, step_fn = _start(plan)
    with Checkpoints(tmp_path / "ck", model, OPTIMIZER, plan) as checkpoints:
        _loop(checkpoints, step_fn, state, 0, 2, [])
    for path in (tmp_path / "ck" / "2" / "params").rglob("*"):
        if path.is_file() and path.parent.name == "d":  # the array data files
            path.write_bytes(b"\0" * path.stat().st_size)
    with Checkpoints(tmp_path / "ck", model, OPTIMIZER, plan) as checkpoints:
        restored, data_state = checkpoints.restore()
        assert data_state == {"position": 1} and checkpoints.all_steps() == [1]
    assert (tmp_path / "ck" / "2.corrupted").is_dir()


def test_a_data_state_that_is_not_json_is_refused_in_one_line(tmp_path):
    plan = jaxpar.Plan.create("data=8")
    model, state, _ = _start(plan)
    with Checkpoints(tmp_path / "ck", model, OPTIMIZER, plan) as checkpoints:
        with pytest.raises(TypeError, match="data_state must be a JSON value .* got object"):
            checkpoints.save(1, state, data_state=object())

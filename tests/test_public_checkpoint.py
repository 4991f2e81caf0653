"""`jaxpar.checkpoint.Checkpoints` in a loop of one's own: exact resume with its data state, restore onto another
plan, SIGTERM as a forced save and a stop, a damaged step passed over."""

import dataclasses
import os
import signal
import subprocess
import sys

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


def test_another_optimizer_is_named_in_one_line_and_the_checkpoint_kept(tmp_path):
    """adamw's state is adam's with one more empty part: every array fits, the containers do not. Not "corrupt",
    and the good step is not set aside; a parameter of another shape is named too."""
    plan = jaxpar.Plan.create("data=8")
    model, state = jaxpar.init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), OPTIMIZER, plan)
    with Checkpoints(tmp_path / "ck", model, OPTIMIZER, plan) as checkpoints:
        checkpoints.save(1, state)
    adam = optax.adam(1e-3)
    with Checkpoints(tmp_path / "ck", model, adam, plan) as checkpoints:
        with pytest.raises(ValueError) as error:
            checkpoints.restore()
    message = str(error.value)
    assert "\n" not in message and "unreadable" not in message and "orrupt" not in message
    assert "optimizer's state tree differs at opt_state: saved a sequence of 3, here a sequence of 2" in message
    assert not isinstance(error.value, jaxpar.checkpoint.CorruptCheckpoint)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["1"]
    wider = jaxpar.describe(lambda: Llama(dataclasses.replace(CONFIG, vocab=2 * CONFIG.vocab), nnx.Rngs(0)))
    with Checkpoints(tmp_path / "ck", wider, OPTIMIZER, plan) as checkpoints:
        with pytest.raises(ValueError, match=r"does not fit the model:\n  params/embedding: saved float32\[256, "):
            checkpoints.restore()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["1"]


LEFT_OPEN = """
import sys, time, optax
from flax import nnx
import jaxpar
from jaxpar.checkpoint import Checkpoints
from jaxpar.models.llama import CONFIGS, Llama
plan = jaxpar.Plan.create("data=8")
model, state = jaxpar.init_state(lambda: Llama(CONFIGS["tiny"], nnx.Rngs(0)), optax.adamw(1e-3), plan)
checkpoints = Checkpoints(sys.argv[1], model, optax.adamw(1e-3), plan)
for step in range(1, 5):
    checkpoints.save(step, state, data_state={"position": step})
print("saved", flush=True)
if sys.argv[2] == "wait":
    time.sleep(60)
"""


@pytest.mark.parametrize("end", ["ctrl-c", "exit"])
def test_checkpoints_left_open_finish_every_save_that_returned(tmp_path, end):
    """Never closed: Ctrl-C after the last save returned, or the script's end, and every step is complete with
    nothing half-written left (Orbax's commit once found Python's thread pools shut). Python >= 3.12 starts no
    thread once a script has ended: there the save in flight is removed and said so, never left half-written."""
    script = tmp_path / "left_open.py"
    script.write_text(LEFT_OPEN)
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck"), "wait" if end == "ctrl-c" else "end"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "saved\n"
    if end == "ctrl-c":
        child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == (-signal.SIGINT if end == "ctrl-c" else 0), err
    assert "cannot schedule new futures" not in err and "RuntimeError" not in err, err
    steps = sorted(p.name for p in (tmp_path / "ck").iterdir())
    if end == "exit" and sys.version_info >= (3, 12) and steps != ["1", "2", "3", "4"]:
        assert steps == ["1", "2", "3"] and "was left open at exit: its save in flight could not finish" in err, err
    else:
        assert steps == ["1", "2", "3", "4"], err

"""Checkpoints: restore onto other plans, exact resume, the non-finite guard, export, bad input.

One checkpoint saved under a 3D plan with ZeRO (data=2,tensor=2,pipe=2) is
restored under other meshes, ZeRO stages, pipeline splits and device counts:
values must come back bit for bit, in each target's sharding, and training
must continue with the source plan's losses. Crash and preemption safety with
real processes are in test_checkpoint_crash.py.
"""

import dataclasses
import json
import shutil
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.interop import saved_weights
from jaxpar.train.checkpoint import Checkpoints
from jaxpar.cli import main
from jaxpar.interop.export import export, load_model, load_params
from jaxpar.pipeline.layer_order import state_to_natural_order, to_natural_order
from jaxpar.models.llama import Llama, rms_norm, run_layers
from jaxpar.models.moe import CONFIGS as MOE_CONFIGS
from jaxpar.models.moe import MoeLlama
from jaxpar.core.plan import Plan
from jaxpar.train.state import describe, init_state, place_state, state_specs
from jaxpar.train.step import make_train_step
from jaxpar.run.training import TrainConfig, iterate, open_checkpoints, prepare, resume

from helpers import TINY, batches, copy_state, max_relative_error, reference_state, single_device_plan

CONFIG = dataclasses.replace(TINY, d_model=32, head_dim=8, d_ff=64, n_layers=4, seq_len=16)
OPTIMIZER = optax.adamw(1e-2)
SOURCE = ("data=2,tensor=2,pipe=2", {"zero": 1}, 8)
TARGETS = {
    "data8-zero3": ("data=8", {"zero": 3}, 8),
    "data4-tensor2": ("data=4,tensor=2", {}, 8),
    "pipe4-zero2": ("data=2,pipe=4", {"zero": 2}, 8),
    "4-devices": ("data=2,tensor=2", {"zero": 1}, 4),
    "pipe2-interleaved": ("data=4,pipe=2", {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 2}, 8),
}
SAVED_STEP, CONTINUE = 2, 2
SMALL = {"d_model": 32, "head_dim": 8, "n_layers": 2}  # the `jaxpar train` runs' model overrides


def make_plan(mesh, options, devices) -> Plan:
    return Plan.create(mesh, devices=jax.devices()[:devices], **options)


def loss_fn(module, batch):
    return module(batch)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Train SAVED_STEP steps under SOURCE, save, then CONTINUE more steps: the losses a restore must match."""
    model, state, _ = reference_state(CONFIG, OPTIMIZER)
    data = batches(batch_size=8, seq_len=16)
    plan = make_plan(*SOURCE)
    state = place_state(copy_state(state), model, OPTIMIZER, plan)
    step = make_train_step(model, loss_fn, OPTIMIZER, plan)
    for i in range(SAVED_STEP):
        state, _ = step(state, data[i])
    directory = tmp_path_factory.mktemp("source") / "checkpoints"
    with Checkpoints(directory) as checkpoints:
        checkpoints.save(SAVED_STEP, state)
        host = copy_state(state)
        losses = []
        for i in range(SAVED_STEP, SAVED_STEP + CONTINUE):
            state, metrics = step(state, data[i])
            losses.append(float(metrics["loss"]))
    return model, directory, host, np.array(losses), data


@pytest.mark.parametrize("target", TARGETS)
def test_restore_onto_another_plan_continues_the_same_run(saved, target):
    model, directory, host, source_losses, data = saved
    plan = make_plan(*TARGETS[target])
    with Checkpoints(directory, read_only=True) as checkpoints:
        state, meta = checkpoints.restore(model, OPTIMIZER, plan)
    assert meta["step"] == SAVED_STEP and int(state.step) == SAVED_STEP

    expected = plan.shardings(state_specs(model, OPTIMIZER, plan))
    laid_out = jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), state, expected)
    assert all(jax.tree.leaves(laid_out)), f"restored arrays not in {target}'s shardings: {laid_out}"
    natural = state_to_natural_order(copy_state(state), model.logical, OPTIMIZER, plan)  # interleaved: pipeline order
    equal = jax.tree.map(np.array_equal, natural, host)
    assert all(jax.tree.leaves(equal)), f"restored values differ from the saved ones: {equal}"

    losses = continued(model, state, plan, data)
    error = np.max(np.abs(np.array(losses) / source_losses - 1))
    print(f"{target}: continued losses {losses}, relative error vs source plan {error:.2e}")
    assert error <= 1e-5



def test_interleaved_saves_trace_their_layer_order_conversion_once(saved, tmp_path, monkeypatch):
    """Saving an interleaved state converts it to natural order: traced and compiled at the first save, reused
    at the next ones (a run saves every few steps)."""
    from jaxpar.pipeline import layer_order
    model, directory, _, _, _ = saved
    plan = make_plan(*TARGETS["pipe2-interleaved"])
    with Checkpoints(directory, read_only=True) as checkpoints:
        state, _ = checkpoints.restore(model, OPTIMIZER, plan)
    traced = []
    convert = layer_order.state_to_natural_order
    monkeypatch.setattr(layer_order, "state_to_natural_order", lambda *a: traced.append(1) or convert(*a))
    with Checkpoints(tmp_path / "every-step", async_save=False) as saving:
        for step in (1, 2, 3):
            saving.save(step, state, model=model, optimizer=OPTIMIZER, plan=plan)
        assert saving.steps() == [1, 2, 3]
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, saving.read_params(3),
                                                convert(copy_state(state), model.logical, OPTIMIZER, plan).params)))
    assert len(traced) == 1, f"the conversion was traced {len(traced)} times for 3 saves"

def continued(model, state, plan, data) -> list[float]:
    """Losses of the CONTINUE steps after SAVED_STEP from `state` under `plan`."""
    step = make_train_step(model, loss_fn, OPTIMIZER, plan)
    losses = []
    for i in range(SAVED_STEP, SAVED_STEP + CONTINUE):
        state, metrics = step(state, data[i])
        losses.append(float(metrics["loss"]))
    return losses


def test_interleaved_state_is_saved_in_natural_order_and_restores_onto_any_plan(saved, tmp_path):
    """A state the interleaved plan holds in pipeline order is written as the same state saved from 1F1B (same
    arrays, same checksums), and restores onto pipe=1, 1F1B and interleaved, each continuing the run."""
    model, directory, _, source_losses, data = saved
    plans = {"interleaved": make_plan(*TARGETS["pipe2-interleaved"]), "1f1b": make_plan("data=4,pipe=2", {}, 8),
             "pipe=1": make_plan("data=8", {}, 8)}
    interleaved = plans["interleaved"]
    with Checkpoints(directory, read_only=True) as checkpoints:
        state, _ = checkpoints.restore(model, OPTIMIZER, interleaved)
    held = copy_state(state)
    natural = state_to_natural_order(held, model.logical, OPTIMIZER, interleaved)
    assert not np.array_equal(held.params["blocks"]["wq"], natural.params["blocks"]["wq"])  # the orders differ
    written, placed = tmp_path / "interleaved", tmp_path / "1f1b"
    with Checkpoints(written, config={"mesh": {"pipe": 2}, "plan": {"virtual_stages": 2}}) as saving:
        with pytest.raises(ValueError, match="keeps the stacked layers in pipeline order"):
            saving.save(SAVED_STEP, state)
        with pytest.raises(ValueError, match="pipeline order: save needs the state's model and optimizer"):
            saving.save(SAVED_STEP, state, plan=interleaved)
        saving.save(SAVED_STEP, state, model=model, optimizer=OPTIMIZER, plan=interleaved)
    with Checkpoints(placed) as saving:
        saving.save(SAVED_STEP, place_state(natural, model, OPTIMIZER, plans["1f1b"]))
    with Checkpoints(written, read_only=True) as a, Checkpoints(placed, read_only=True) as b:
        assert a.metadata()["checksums"] == b.metadata()["checksums"]
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, a.read_params(), natural.params)))
        restored = {name: a.restore(model, OPTIMIZER, plan)[0] for name, plan in plans.items()}
    again = jax.tree.map(np.array_equal, copy_state(restored["interleaved"]), held)
    assert all(jax.tree.leaves(again)), f"the interleaved plan's state did not come back as it held it: {again}"
    initial = saved_weights.initial_state(written, model, OPTIMIZER, interleaved)  # `jaxpar train --init-from`
    same = jax.tree.map(np.array_equal, to_natural_order(copy_state(initial.params), model.logical, interleaved),
                        natural.params)
    assert all(jax.tree.leaves(same)), f"--init-from did not put the layers in the plan's order: {same}"

    reference = continued(model, state, interleaved, data)
    assert np.max(np.abs(np.array(reference) / source_losses - 1)) <= 1e-5
    assert continued(model, restored["interleaved"], interleaved, data) == reference
    for name in ("1f1b", "pipe=1"):
        losses = continued(model, restored[name], plans[name], data)
        assert np.max(np.abs(np.array(losses) / np.array(reference) - 1)) <= 1e-5, (name, losses, reference)


def test_jaxpar_train_interleaved_evaluates_and_saves_in_natural_order(tmp_path):
    """`jaxpar train` under the interleaved schedule: losses, held-out losses and the saved parameters as on data=8."""
    def run(name, *flags):
        metrics, directory = tmp_path / f"{name}.jsonl", tmp_path / name
        assert main(["train", "--steps", "2", "--batch-size", "8", "--seq-len", "16", "--eval-every", "2",
                     "--checkpoint-dir", str(directory), "--metrics", str(metrics), *flags]) == 0
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        with Checkpoints(directory, read_only=True) as checkpoints:
            return np.array([[row["loss"] for row in rows], [rows[-1]["eval_loss"]] * 2]), checkpoints.read_params()

    figures, params = run("interleaved", "--mesh", "data=4,pipe=2", "--schedule", "interleaved",
                          "--virtual-stages", "2", "--microbatches", "2")
    expected, expected_params = run("data8", "--mesh", "data=8")
    assert np.max(np.abs(figures / expected - 1)) <= 1e-5
    assert max_relative_error(params, expected_params) <= 1e-5


def test_moe_checkpoint_restores_onto_another_expert_split(tmp_path):
    config = dataclasses.replace(MOE_CONFIGS["moe-tiny"], d_model=32, head_dim=8, n_layers=2, n_experts=4,
                                 expert_d_ff=32, seq_len=16)
    source = make_plan("data=2,expert=4", {"zero": 1}, 8)
    model, state = init_state(lambda: MoeLlama(config, nnx.Rngs(0)), OPTIMIZER, source)
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(0, state)
    target = make_plan("data=4,expert=2", {"zero": 3}, 8)
    with Checkpoints(tmp_path, read_only=True) as checkpoints:
        restored, _ = checkpoints.restore(model, OPTIMIZER, target)
    expected = target.shardings(state_specs(model, OPTIMIZER, target))
    assert restored.params["blocks"]["moe"]["expert_up"].sharding.spec[1] == "expert"
    assert all(jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), restored, expected)))
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, b), restored, jax.device_get(state))))


@pytest.fixture(scope="module")
def tiny():
    """A prepared 20-step run of the tiny model (SMALL), shared so its step compiles once, and its initial state."""
    train = TrainConfig(model="tiny", model_overrides=SMALL, steps=20, batch_size=8, seq_len=16)
    run = prepare(train, Plan.create("data=4,tensor=2"))
    return run, copy_state(run.init())


def start(run, initial):
    return place_state(initial, run.model, run.optimizer, run.plan)


def saving(run, directory, **options):
    """The same run (and compiled step), writing checkpoints to `directory`."""
    return dataclasses.replace(run, config=dataclasses.replace(run.config, checkpoint_dir=str(directory), **options))


def test_resume_after_stop_gives_the_uninterrupted_losses_bitwise(tiny, tmp_path):
    run, initial = tiny
    uninterrupted = [row["loss"] for _, row in iterate(run, start(run, initial))]

    run = saving(run, tmp_path, save_every=5, keep=2)
    checkpoints = open_checkpoints(run)
    first = []
    for _, row in iterate(run, start(run, initial), 0, checkpoints):
        first.append(row["loss"])
        if row["step"] == 10:
            break
    checkpoints.close()
    with Checkpoints(tmp_path, read_only=True) as saved:
        assert saved.steps() == [5, 10]

    checkpoints = open_checkpoints(run)
    state, position = resume(run, checkpoints)
    assert position["step"] == 10 and position["data"]["position"] == 10
    second = [row["loss"] for _, row in iterate(run, state, position["step"], checkpoints)]
    checkpoints.close()
    assert first + second == uninterrupted
    with Checkpoints(tmp_path, read_only=True) as saved:
        assert saved.steps() == [15, 20]

    meta = json.loads((tmp_path / "20" / "meta" / "metadata").read_text())
    assert meta["step"] == 20 and meta["config"]["model"]["config"]["d_model"] == 32
    assert meta["config"]["mesh"] == {"replica": 1, "data": 4, "pipe": 1, "expert": 1, "context": 1, "tensor": 2}
    assert meta["config"]["train"]["save_every"] == 5 and meta["rng"]["seed"] == 0


def poisoned_loss(module, batch):
    """The model's loss times the batch's `poison` factor: NaN or Inf there makes the loss and gradients so."""
    loss, aux = module(batch)
    return loss * jnp.mean(batch["poison"]), aux


def test_nonfinite_steps_keep_the_parameters_and_are_counted_or_stop_the_run(tiny):
    run, initial = tiny
    step = make_train_step(run.model, poisoned_loss, run.optimizer, run.plan)

    def poisoned(factors):
        factors = iter(factors)
        return lambda state, batch: step(state, {**batch, "poison": np.full(8, next(factors), np.float32)})

    states, rows = [], []
    for state, row in iterate(dataclasses.replace(run, step_fn=poisoned([1.0, np.nan, np.inf, 1.0])),
                              start(run, initial)):
        states.append(copy_state(state))
        rows.append(row)
        if row["step"] == 4:
            break
    assert [r["nonfinite"] for r in rows] == [0, 1, 1, 0]
    assert [r["nonfinite_steps"] for r in rows] == [0, 1, 2, 2]
    assert [int(s.step) for s in states] == [1, 2, 3, 4]
    for skipped in (1, 2):
        same = jax.tree.map(np.array_equal, (states[skipped].params, states[skipped].opt_state),
                            (states[0].params, states[0].opt_state))
        assert all(jax.tree.leaves(same)), f"step {skipped + 1} changed the state: {same}"
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(states[3].params))
    assert not np.array_equal(states[3].params["head"], states[0].params["head"])

    stopping = dataclasses.replace(run, config=dataclasses.replace(run.config, on_nonfinite="stop"),
                                   step_fn=poisoned([1.0, np.nan]))
    rows = []
    with pytest.raises(FloatingPointError, match="step 2: loss nan"):
        for _, row in iterate(stopping, start(run, initial)):
            rows.append(row)
    assert [r["step"] for r in rows] == [1]


@pytest.fixture(scope="module")
def trained_dir(tiny, tmp_path_factory):
    """A checkpoint directory holding steps 2 and 3 of `tiny`, and the optimizer it used."""
    run, initial = tiny
    directory = tmp_path_factory.mktemp("trained")
    run = saving(run, directory, save_every=1, keep=2)
    checkpoints = open_checkpoints(run)
    for _, row in iterate(run, start(run, initial), 0, checkpoints):
        if row["step"] == 3:
            break
    checkpoints.close()
    return directory, run.optimizer


def logits(module, tokens):
    hidden = run_layers(module.blocks.stacked(), module.embed(tokens), module.cfg)
    return rms_norm(hidden, module.final_norm[...], module.cfg.norm_eps) @ module.output_weights()


@pytest.mark.parametrize("name", ["model.npz", "model_dir"])
def test_export_loads_into_a_plain_flax_model_with_the_same_logits(trained_dir, tmp_path, name, capsys):
    directory, optimizer = trained_dir
    out = tmp_path / name
    assert main(["export", "--checkpoint-dir", str(directory), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 3 and summary["bytes"] == summary["params"] * 4

    config = dataclasses.replace(TINY, **SMALL, seq_len=16)
    exported = load_model(out, lambda: Llama(config, nnx.Rngs(7)))
    tokens = jnp.asarray(batches(batch_size=4, seq_len=16)[0]["inputs"])
    got = logits(exported, tokens)

    model = describe(lambda: Llama(config, nnx.Rngs(0)))
    with Checkpoints(directory, read_only=True) as checkpoints:
        one, _ = checkpoints.restore(model, optimizer, single_device_plan())
    assert np.array_equal(got, logits(model.merge(one.params), tokens))
    assert load_params(out)[1]["model"]["config"]["d_model"] == 32


def test_export_of_a_bf16_run_holds_the_fp32_weights(tmp_path):
    """A bf16 run holds its parameters in fp32 (it computes with bf16 casts; ZeRO-1 in its fp32 master beside
    bf16 params): the export holds them exactly."""
    config = dataclasses.replace(TINY, **SMALL, seq_len=16)
    for zero in (0, 1):
        plan = Plan.create("data=4,tensor=2", zero=zero, precision="bf16")
        model, state = init_state(lambda: Llama(config, nnx.Rngs(0)), OPTIMIZER, plan)
        fp32 = state.opt_state.master if zero == 1 else state.params
        assert fp32["head"].dtype == jnp.float32
        with Checkpoints(tmp_path / f"run{zero}") as checkpoints:
            checkpoints.save(1, state)
        export(tmp_path / f"run{zero}", tmp_path / f"model{zero}.npz")
        params, exported = load_params(tmp_path / f"model{zero}.npz")
        assert set(exported["dtypes"].values()) == {"float32"}
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, params, jax.device_get(fp32))))


class OlderMasterState(typing.NamedTuple):
    """The optimizer state older bf16/fp16 checkpoints hold: an fp32 master beside their 2-byte params."""

    master: typing.Any
    inner: typing.Any
    loss_scale: typing.Any


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_an_older_checkpoint_with_a_master_copy_restores_its_master_as_the_params(tmp_path, name):
    """The 2-byte params of the older layout are a cast of its master: the master is what restores and exports."""
    config = dataclasses.replace(TINY, **SMALL, seq_len=16)
    plan = Plan.create("data=4", zero=0, precision=name, devices=jax.devices()[:4])  # fp32 params held once
    model, state = init_state(lambda: Llama(config, nnx.Rngs(0)), OPTIMIZER, plan)
    master = jax.tree.map(lambda p: p + 1e-3, state.params)  # not representable in 2 bytes
    inner, scale = (state.opt_state.inner, state.opt_state.loss_scale) if name == "fp16" else (state.opt_state, None)
    low = jax.tree.map(lambda p: p.astype(jnp.bfloat16 if name == "bf16" else jnp.float16), master)
    with Checkpoints(tmp_path / "old") as checkpoints:
        checkpoints.save(5, dataclasses.replace(state, params=low, opt_state=OlderMasterState(master, inner, scale)))
    with Checkpoints(tmp_path / "old", read_only=True) as checkpoints:
        restored, meta = checkpoints.restore(model, OPTIMIZER, Plan.create("data=8", zero=3, precision=name))
        exported = checkpoints.read_params()
    assert meta["step"] == 5 and int(restored.step) == 5
    host = jax.device_get(master)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(restored.params), host)))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, exported, host)))
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(state.opt_state)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(restored.opt_state),
                                            jax.device_get(state.opt_state))))
    with Checkpoints(tmp_path / "old", read_only=True) as checkpoints:
        with pytest.raises(ValueError, match="does not fit the model"):
            checkpoints.restore(model, OPTIMIZER, Plan.create("data=8", precision="bf16" if name == "fp16" else "fp16"))


def test_restoring_into_a_model_of_other_shapes_lists_every_mismatch(trained_dir):
    directory, optimizer = trained_dir
    wider = describe(lambda: Llama(dataclasses.replace(TINY, **{**SMALL, "d_model": 48}), nnx.Rngs(0)))
    with Checkpoints(directory, read_only=True) as checkpoints:
        with pytest.raises(ValueError, match="does not fit the model") as error:
            checkpoints.restore(wider, optimizer, single_device_plan())
    message = str(error.value)
    assert "params/blocks/wq: saved float32[2, 32, 8, 8], model float32[2, 48, 8, 8]" in message
    assert "params/embedding: saved float32[256, 32], model float32[256, 48]" in message
    assert "opt_state/1/0/nu/head: saved float32[32, 256], model float32[48, 256]" in message
    assert "... 13 more ..." in message  # 12 parameters, their two Adam moments: 36 lines, the middle elided


def test_another_models_directory_is_never_overwritten(trained_dir, capsys):
    directory, _ = trained_dir
    before = sorted(p.name for p in directory.iterdir())
    flags = ["--mesh", "data=8", "--steps", "6", "--batch-size", "8", "--seq-len", "16"]
    assert main(["train", *flags, "--checkpoint-dir", str(directory)]) == 2
    out = " ".join(capsys.readouterr().err.split())
    assert "holds checkpoints of another model" in out and "d_model: 32 -> 64" in out
    assert sorted(p.name for p in directory.iterdir()) == before


def test_missing_and_corrupt_directories_fail_clearly(trained_dir, tmp_path, capsys):
    assert main(["export", "--checkpoint-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        Checkpoints(empty, read_only=True)

    directory, optimizer = trained_dir
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    (broken / "3" / "meta" / "metadata").write_text("{not json")
    with Checkpoints(broken, read_only=True) as checkpoints, pytest.raises(ValueError, match="step 3 .* is unreadable"):
        checkpoints.metadata()
    for chunk in (broken / "2" / "params").rglob("d/*"):
        chunk.write_bytes(b"\0" * 16)
    model = describe(lambda: Llama(dataclasses.replace(TINY, **SMALL), nnx.Rngs(0)))
    with Checkpoints(broken, read_only=True) as checkpoints, pytest.raises(ValueError, match="step 2 .* is unreadable"):
        checkpoints.restore(model, optimizer, single_device_plan(), step=2)

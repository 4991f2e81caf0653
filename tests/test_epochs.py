"""Epochs (`jaxpar train --epochs`): each row once per epoch in a seeded order, and resume onto any mesh.

The order is unit-tested on a row table whose rows name themselves. One tiny
run with `--epochs` (data=8) is trained uninterrupted and again stopped mid-epoch
and resumed: the resumed losses must equal the uninterrupted ones bitwise, and
resumed onto data=2,tensor=2,pipe=2 the loop must draw the same batches bitwise
(losses within 1e-5: that mesh sums in another order).
"""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.cli import build_parser, main, resolve
from jaxpar.core.plan import Plan
from jaxpar.run.training import TrainConfig, iterate, make_optimizer, open_checkpoints, prepare, resume
from jaxpar.data.tokens import BadBatch, global_batch
from jaxpar.data.epochs import EpochBatches, TokenWindows
from jaxpar.train.state import place_state

from helpers import copy_state

SEQ = 4  # unit tests: rows of 5 tokens


def numbered(rows: int, tail: int = 0) -> TokenWindows:
    """A token stream whose row i starts with token i * (SEQ + 1), so a row's first input names it."""
    return TokenWindows(np.arange(rows * (SEQ + 1) + tail, dtype=np.uint16), SEQ)


def row_ids(batch) -> np.ndarray:
    return batch["inputs"][:, 0] // (SEQ + 1)


def test_every_row_once_per_epoch_in_a_new_order_each_epoch():
    table = numbered(10, tail=3)
    assert len(table) == 10 and table.dropped == 3
    batches = EpochBatches(table, batch_size=4, seq_len=SEQ, seed=0)
    seen = np.concatenate([row_ids(batches.rows(step)) for step in range(5)])  # 20 rows: two whole epochs
    first, second = seen[:10], seen[10:]
    assert sorted(first) == sorted(second) == list(range(10)), seen
    assert not np.array_equal(first, second)
    assert [batches.epoch_of(step) for step in (0, 2, 5)] == [0.0, 0.8, 2.0]

    batch = batches.rows(2)  # epoch 0's last two rows, then epoch 1's first two
    np.testing.assert_array_equal(row_ids(batch), seen[8:12])
    windows = np.arange(50).reshape(10, SEQ + 1)[row_ids(batch)]
    np.testing.assert_array_equal(batch["inputs"], windows[:, :-1])
    np.testing.assert_array_equal(batch["targets"], windows[:, 1:])
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32


def test_the_order_is_a_function_of_the_seed():
    table = numbered(64)

    def order(seed):  # two epochs, from a fresh sampler each time
        return np.concatenate([EpochBatches(table, 8, SEQ, seed).indices(s) for s in range(16)])

    np.testing.assert_array_equal(order(3), order(3))
    assert not np.array_equal(order(3), order(4))
    with pytest.raises(ValueError, match=r"--seed -1: the epoch order .* \[0, 2\*\*32\)"):
        EpochBatches(table, 8, SEQ, seed=-1)


def test_a_process_reads_only_its_rows_of_the_global_batch():
    batches = EpochBatches(numbered(13), batch_size=8, seq_len=SEQ, seed=1)
    for step in (0, 1, 3):
        whole = batches.rows(step)
        for lo, hi in ((0, 2), (2, 6), (6, 8), (3, 5)):
            part = batches.rows(step, lo, hi)
            assert all(np.array_equal(part[k], whole[k][lo:hi]) for k in whole), (step, lo, hi)
    sharding = Plan.create("data=4,tensor=2").sharding(jax.sharding.PartitionSpec("data"))
    placed = global_batch(batches, 3, sharding)
    assert all(np.array_equal(np.asarray(placed[k]), batches.rows(3)[k]) for k in ("inputs", "targets"))


@dataclasses.dataclass(frozen=True)
class Packed:
    """A row table with a per-token extra field, as packed documents have."""

    def __len__(self):
        return 6

    def rows(self, indices):
        tokens = np.repeat(indices[:, None], SEQ, axis=1).astype(np.int64)
        return {"inputs": tokens, "targets": tokens + 6, "segment_ids": np.ones_like(tokens, np.int8)}


def test_extra_fields_pass_through_and_token_ids_are_checked_per_batch():
    rows = EpochBatches(Packed(), batch_size=4, seq_len=SEQ).rows(1)
    assert rows["segment_ids"].dtype == np.int8 and rows["segment_ids"].shape == (4, SEQ)
    assert rows["inputs"].dtype == np.int32
    with pytest.raises(BadBatch, match=r"--data 'packed' holds token ids outside .* \[0, 6\).* in the batch of step 1"):
        EpochBatches(Packed(), batch_size=4, seq_len=SEQ, vocab=6, source="packed").rows(1)


def test_steps_come_from_epochs_as_written():
    batches = EpochBatches(numbered(30), batch_size=3, seq_len=SEQ)
    assert [batches.steps_for(e) for e in (0.1, 1, 2.5, 1e-9)] == [1, 10, 25, 1]


def test_steps_and_epochs_together_are_refused(capsys, tmp_path):
    assert main(["train", "--steps", "10", "--epochs", "2"]) == 2
    assert "--steps 10 and --epochs 2.0 both set the run's length; give one" in capsys.readouterr().err
    config = tmp_path / "run.toml"
    config.write_text("[train]\nsteps = 10\n")
    assert main(["train", "--config", str(config), "--epochs", "1"]) == 2
    assert f"[train] steps = 10 in {config} and --epochs 1.0 both" in capsys.readouterr().err.replace("\n", "")
    train, _, _ = resolve(build_parser().parse_args(["train", "--epochs", "0.5"]))
    assert train.epochs == 0.5 and train.steps == TrainConfig.steps
    with pytest.raises(ValueError, match="epochs must be > 0 and finite"):
        TrainConfig(epochs=0)


# -- a run with --epochs, stopped mid-epoch and resumed -------------------------------------------

ROWS, BATCH, LENGTH, EPOCHS = 20, 8, 16, 2  # 5 steps; the save after step 2 is 0.8 epochs in
SAVED = 2
SMALL = {"d_model": 32, "head_dim": 8, "n_layers": 2}


def token_file(path, rows: int):
    np.save(path, np.random.default_rng(7).integers(0, 256, rows * (LENGTH + 1) + 5, dtype=np.int32))
    return str(path)


def recording(run, batches: list):
    """The same run, keeping every batch its loop draws (on the host, whole)."""
    step = run.step_fn

    def record(state, batch):
        batches.append(jax.device_get(batch))
        return step(state, batch)

    return dataclasses.replace(run, step_fn=record)


def with_checkpoints(run, directory):
    return dataclasses.replace(run, config=dataclasses.replace(run.config, checkpoint_dir=str(directory),
                                                               save_every=SAVED))


@pytest.fixture(scope="module")
def epochs_run(tmp_path_factory):
    """The data=8 run, its uninterrupted losses and batches, and a checkpoint directory stopped after SAVED."""
    folder = tmp_path_factory.mktemp("epochs")
    config = TrainConfig(model="tiny", model_overrides=SMALL, epochs=EPOCHS, batch_size=BATCH, seq_len=LENGTH,
                         warmup=1, data=token_file(folder / "tokens.npy", ROWS))
    run = prepare(config, Plan.create("data=8"))
    initial = copy_state(run.init())
    batches, rows = [], []
    for _, row in iterate(recording(run, batches), place_state(initial, run.model, run.optimizer, run.plan)):
        rows.append(row)
    saving = with_checkpoints(run, folder / "checkpoints")
    checkpoints = open_checkpoints(saving)
    for _, row in iterate(saving, place_state(initial, run.model, run.optimizer, run.plan), 0, checkpoints):
        if row["step"] == SAVED:
            break
    checkpoints.close()
    return config, run, rows, batches, folder


def test_a_run_of_epochs_has_the_derived_steps_schedule_and_epoch_column(epochs_run):
    config, run, rows, batches, _ = epochs_run
    assert run.config.steps == 5 and [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["epoch"] for r in rows] == [0.4, 0.8, 1.2, 1.6, 2.0]
    seen = np.concatenate([b["inputs"][:, 0] for b in batches])
    starts = np.load(config.data)[: ROWS * (LENGTH + 1)].reshape(ROWS, -1)[:, 0]
    for epoch in (seen[:ROWS], seen[ROWS:2 * ROWS]):
        assert sorted(epoch) == sorted(starts)

    params, grads = {"w": jnp.ones(4)}, {"w": jnp.full(4, 0.5)}

    def updates(optimizer):
        state, out = optimizer.init(params), []
        for _ in range(5):
            update, state = optimizer.update(grads, state, params)
            out.append(np.asarray(update["w"]))
        return np.stack(out)

    schedule = dataclasses.replace(config, epochs=None, steps=5)
    np.testing.assert_array_equal(updates(run.optimizer), updates(make_optimizer(schedule)))
    assert not np.array_equal(updates(run.optimizer), updates(make_optimizer(dataclasses.replace(schedule, steps=150))))


def test_resume_mid_epoch_gives_the_uninterrupted_losses_bitwise(epochs_run, tmp_path):
    _, run, rows, batches, folder = epochs_run
    directory = shutil.copytree(folder / "checkpoints", tmp_path / "checkpoints")
    run = with_checkpoints(run, directory)
    checkpoints = open_checkpoints(run)
    state, position = resume(run, checkpoints)
    assert position["data"] == {"position": SAVED, "seed": 0, "order": "epochs", "rows": ROWS}
    resumed = []
    losses = [row["loss"] for _, row in iterate(recording(run, resumed), state, SAVED, checkpoints)]
    checkpoints.close()
    assert losses == [row["loss"] for row in rows[SAVED:]]
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(resumed, batches[SAVED:]) for k in a)


def test_resume_onto_another_mesh_draws_the_same_batches(epochs_run):
    config, _, rows, batches, folder = epochs_run
    run = with_checkpoints(prepare(config, Plan.create("data=2,tensor=2,pipe=2")), folder / "checkpoints")
    checkpoints = open_checkpoints(run)
    state, position = resume(run, checkpoints)
    checkpoints.close()
    assert position["step"] == SAVED
    resumed = []
    losses = np.array([row["loss"] for _, row in iterate(recording(run, resumed), state, SAVED)])
    assert len(resumed) == len(batches) - SAVED
    for drawn, uninterrupted in zip(resumed, batches[SAVED:]):
        assert drawn.keys() == uninterrupted.keys()
        assert all(np.array_equal(drawn[k], uninterrupted[k]) for k in drawn)
    error = np.max(np.abs(losses / np.array([row["loss"] for row in rows[SAVED:]]) - 1))
    print(f"resumed on data=2,tensor=2,pipe=2: losses {losses.tolist()}, relative error vs data=8 {error:.2e}")
    assert error <= 1e-5


def test_a_resume_in_another_order_or_over_other_rows_is_refused(epochs_run):
    config, _, _, _, folder = epochs_run
    plan = Plan.create("data=8")
    windows = dataclasses.replace(config, epochs=None, steps=5)
    more_rows = dataclasses.replace(config, data=token_file(folder / "more.npy", ROWS + 4))
    for changed, message in ((windows, "order: epochs -> windows"), (more_rows, f"rows: {ROWS} -> {ROWS + 4}")):
        run = with_checkpoints(prepare(changed, plan), folder / "checkpoints")
        with open_checkpoints(run) as checkpoints, pytest.raises(ValueError, match=f"another order \\({message}\\)"):
            resume(run, checkpoints)

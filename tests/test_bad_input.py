"""Every known bad input: exit code 2, one message on stderr naming the file or parameter, no traceback.

Data and config files are refused before anything compiles (in process, through
`jaxpar.cli.main`). Damaged checkpoints run as real processes, because the
echoes of a failed Orbax read reach stderr from other threads and as late as
interpreter exit; a damaged newest step makes `jaxpar train` fall back to the
newest intact one, and nothing in the directory is deleted.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.train.checkpoint import Checkpoints, CorruptCheckpoint
from jaxpar.cli import main
from jaxpar.core.plan import Plan
from jaxpar.run.training import TrainConfig, open_checkpoints, prepare, resume

SMALL = {"d_model": 32, "head_dim": 8, "n_layers": 2}
CONFIG = '[model]\nname = "tiny"\nd_model = 32\nhead_dim = 8\nn_layers = 2\n'
FLAGS = ["--batch-size", "8", "--seq-len", "16", "--steps", "1"]


def jaxpar(*args, devices=2):
    """`jaxpar ARGS` as its own process: (exit code, stdout, stderr)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    return done.returncode, done.stdout, done.stderr


def assert_refused(code, out, err, *fragments):
    """Exit code 2, one message on stderr (an `error:` line, maybe an indented list) holding every fragment."""
    assert code == 2, out + err
    assert "Traceback" not in out + err and "Event loop is closed" not in out + err, err
    first, *rest = err.strip().splitlines()
    assert first.startswith("error:") and all(line.startswith("  ") for line in rest), err
    for fragment in fragments:
        assert fragment in first, first


def refused_in_process(capsys, *args):
    code = main(["train", *FLAGS, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- data ----------------------------------------------------------------------------


def test_token_ids_below_zero_are_refused_before_training(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.array([5, -3, 7, 11] * 64, dtype=np.int32))
    assert_refused(*jaxpar("train", "--mesh", "data=2", *FLAGS, "--data", str(tokens)),
                   f"--data '{tokens}'", "outside the model's vocabulary [0, 256): -3", "smallest -3")


@pytest.mark.parametrize("name, write, fragments", [
    ("big.npy", lambda p: np.save(p, np.arange(300, dtype=np.int64)),  # the whole file, scanned at start-up
     ["holds token ids outside the model's vocabulary [0, 256): 256, 257", "the first is token 257 of 300 (1-based);"]),
    ("odd.bin", lambda p: p.write_bytes(b"\0" * 101),
     ["a .bin file holds uint16 token ids of 2 bytes each", "its size, 101 bytes, is not a multiple of 2"]),
    ("text.npy", lambda p: p.write_text("not numpy at all " * 20),
     ["is not a .npy file (no numpy header); write token ids with numpy.save"]),
    ("objects.npy", lambda p: np.save(p, np.array([1, "a"], dtype=object), allow_pickle=True),
     ["is not a readable .npy token array"]),
    ("floats.npy", lambda p: np.save(p, np.ones(100, np.float32)), ["expected a 1-D integer token array, got float32"]),
    ("empty.bin", lambda p: p.write_bytes(b""), ["holds no text or tokens"]),
    ("folder.npy", lambda p: p.mkdir(), ["is a directory, not a .npy token file"]),
])
def test_bad_token_files_are_named(tmp_path, capsys, name, write, fragments):
    path = tmp_path / name
    write(path)
    assert_refused(*refused_in_process(capsys, "--mesh", "data=8", "--data", str(path)), f"--data '{path}'", *fragments)


# -- config ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, fragments", [
    (CONFIG + "[mesh]\ndata = 4\ntensr = 2\n", ["unknown mesh axes ['tensr'] in [mesh]; axes are replica, data, pipe"]),
    (CONFIG + "[mesh]\ndata = \"8\"\n", ["mesh axis 'data' needs an integer size, got '8'"]),
    ("mesh = 8\n" + CONFIG, ["mesh must be a table ([mesh]), got 8"]),
    (CONFIG + "[train]\nsteps = \"3\"\n", ["[train] steps must be an int, got '3'"]),
    (CONFIG + "[plan]\nzero = true\n", ["[plan] zero must be an int, got True"]),
    (CONFIG + "[train\nsteps = 3\n", ["is not valid TOML"]),
])
def test_bad_config_files_are_named(tmp_path, capsys, text, fragments):
    config = tmp_path / "run.toml"
    config.write_text(text)
    assert_refused(*refused_in_process(capsys, "--config", str(config)), str(config), *fragments)


def test_a_sequence_that_context_parallelism_cannot_split_is_refused(capsys):
    assert_refused(*refused_in_process(capsys, "--mesh", "data=2,context=4", "--seq-len", "12"),
                   "sequence length 12 does not divide by 2 x context=4 = 8")


def test_an_unknown_context_form_is_refused(capsys):
    assert_refused(*refused_in_process(capsys, "--mesh", "context=2,data=4", "--context-form", "ulysses"),
                   "context_form must be one of ('all-gather', 'ring')")


def test_a_mesh_file_typo_is_named(tmp_path, capsys):
    mesh = tmp_path / "mesh.toml"
    mesh.write_text("[mesh]\ndata = 8\nexperts = 1\n")
    assert_refused(*refused_in_process(capsys, "--mesh", str(mesh)), str(mesh), "unknown mesh axes ['experts']")


# -- checkpoints -----------------------------------------------------------------------


def chunk_files(step_dir):
    """The data files of a step's arrays (OCDBT's b-tree and manifests are checksummed by TensorStore itself)."""
    return [p for item in ("params", "opt_state") for p in (step_dir / item).glob("ocdbt.process_*/d/*")]


def flip_bytes(step_dir):
    for path in chunk_files(step_dir):
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 8):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))


def empty_chunks(step_dir):
    for path in chunk_files(step_dir):
        path.write_bytes(b"")


def garbage_manifest(step_dir):
    (step_dir / "params" / "manifest.ocdbt").write_bytes(b"garbage " * 8)


def run_config(directory, steps=3):
    return TrainConfig(model="tiny", model_overrides=SMALL, steps=steps, batch_size=8, seq_len=16,
                       checkpoint_dir=str(directory), save_every=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 of the small model, saved with their checksums (no step compiled: the initial state twice)."""
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    run = prepare(run_config(directory), Plan.create("data=8"))
    checkpoints = open_checkpoints(run)
    state = run.init()
    for step in (1, 2):
        checkpoints.save(step, state, force=True)
    checkpoints.close()
    return directory


def damaged_copy(saved, tmp_path, damage, steps=(2,)):
    directory = tmp_path / "checkpoints"
    shutil.copytree(saved, directory)
    for step in steps:
        damage(directory / str(step))
    return directory


def test_flipped_bytes_are_caught_and_training_falls_back_to_the_newest_intact_step(saved, tmp_path):
    directory = damaged_copy(saved, tmp_path, flip_bytes)
    config = tmp_path / "small.toml"
    config.write_text(CONFIG)
    code, out, err = jaxpar("train", "--config", str(config), "--mesh", "data=2", "--batch-size", "8", "--seq-len",
                            "16", "--steps", "3", "--save-every", "1", "--checkpoint-dir", str(directory))
    assert code == 0, out + err
    assert "Traceback" not in out + err
    message = " ".join(err.split())
    assert f"checkpoint step 2 in {directory} is corrupted" in message
    assert "differ from the checksums written when it was saved: params/" in message
    assert f"kept it as {directory / '2.corrupted'}; resuming from step 1, the newest intact checkpoint" in message
    assert "resumed from step 1" in " ".join(out.split())
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2", "2.corrupted", "3"]


@pytest.mark.parametrize("damage", [empty_chunks, garbage_manifest, flip_bytes])
def test_a_damaged_newest_step_is_reported_by_name_and_step(saved, tmp_path, damage):
    directory = damaged_copy(saved, tmp_path, damage)
    before = sorted(p.name for p in directory.iterdir())
    code, out, err = jaxpar("export", "--checkpoint-dir", str(directory), "--out", str(tmp_path / "model.npz"))
    reason = "is corrupted" if damage is flip_bytes else "is unreadable"
    assert_refused(code, out, err, f"checkpoint step 2 in {directory} {reason}")
    assert sorted(p.name for p in directory.iterdir()) == before


@pytest.mark.parametrize("damage", [empty_chunks, garbage_manifest])
def test_unreadable_newest_step_falls_back(saved, tmp_path, capsys, damage):
    directory = damaged_copy(saved, tmp_path, damage)
    run = prepare(run_config(directory), Plan.create("data=8"))
    with open_checkpoints(run) as checkpoints:
        _, position = resume(run, checkpoints)
        assert position["step"] == 1 and checkpoints.steps() == [1]
    assert f"checkpoint step 2 in {directory} is unreadable" in capsys.readouterr().err
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2.corrupted"]


def test_with_every_step_damaged_nothing_is_moved(saved, tmp_path):
    directory = damaged_copy(saved, tmp_path, flip_bytes, steps=(1, 2))
    run = prepare(run_config(directory), Plan.create("data=8"))
    with open_checkpoints(run) as checkpoints, pytest.raises(ValueError, match="damaged steps: 2, 1") as error:
        resume(run, checkpoints)
    assert f"checkpoint step 1 in {directory} is corrupted" in str(error.value)
    assert not isinstance(error.value, CorruptCheckpoint)
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]


def test_restore_verifies_onto_another_plan(saved):
    """The checksums do not depend on the layout: a step saved under data=8 verifies under data=2,tensor=4."""
    run = prepare(run_config(saved), Plan.create("data=2,tensor=4"))
    with Checkpoints(saved, read_only=True) as checkpoints:
        _, position = checkpoints.restore(run.model, run.optimizer, run.plan)
    assert position["step"] == 2 and len(position["checksums"]) == 3 * 12 + 2  # params, Adam's mu and nu, counts

"""Crash and preemption safety with real `jaxpar train` processes.

A run is killed with SIGKILL while an async save is being written; the same
command started again continues from the newest complete checkpoint, until a
SIGTERM makes it finish its step, save and exit 0. Every step's loss equals
the uninterrupted run's, bit for bit.
"""

import json
import os
import signal
import subprocess
import sys
import time

from jaxpar.train.checkpoint import TEMPORARY, Checkpoints
from jaxpar.cli import main

STEPS = 16


def flags(tmp_path, name):
    config = tmp_path / "tiny32.toml"
    config.write_text('[model]\nname = "tiny"\nd_model = 32\nhead_dim = 8\nn_layers = 2\n')
    return ["train", "--config", str(config), "--mesh", "data=4,tensor=2", "--steps", str(STEPS), "--batch-size", "8",
            "--seq-len", "16", "--metrics", str(tmp_path / f"{name}.jsonl")]


def start(command):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # conftest's XLA_FLAGS: 8 devices, fast compiles
    return subprocess.Popen([sys.executable, "-m", "jaxpar.cli", *command], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(condition, process, timeout=300.0):
    """Poll `condition` every millisecond until it holds; fail if the process ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"process ended early:\n{process.stdout.read()}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def entries(directory):
    names = [entry.name for entry in os.scandir(directory)] if directory.exists() else []
    return sorted(int(n) for n in names if n.isdigit()), [n for n in names if TEMPORARY in n]


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigkill_mid_save_then_resume_then_sigterm_gives_the_uninterrupted_losses(tmp_path):
    directory = tmp_path / "checkpoints"
    command = [*flags(tmp_path, "interrupted"), "--checkpoint-dir", str(directory), "--save-every", "1", "--keep", "3"]
    log = tmp_path / "interrupted.jsonl"

    crashed = start(command)
    wait_for(lambda: all(entries(directory)), crashed)  # a committed step and one being written
    crashed.send_signal(signal.SIGKILL)
    crashed.wait()
    committed, half_written = entries(directory)
    assert half_written, "the kill did not land during a save"
    with Checkpoints(directory, read_only=True) as complete:
        assert complete.steps() == committed
    Checkpoints(directory).close()  # what every start does first: remove half-written steps
    assert entries(directory) == (committed, [])
    resume_at, logged = committed[-1], len(rows(log))

    preempted = start(command)
    wait_for(lambda: len(rows(log)) >= logged + 2, preempted)
    preempted.send_signal(signal.SIGTERM)
    output = preempted.communicate(timeout=120)[0]
    assert preempted.returncode == 0, output
    stopped_at = rows(log)[-1]
    assert stopped_at.get("preempted") and stopped_at["saved"]
    saved, half_written = entries(directory)
    assert not half_written and saved[-1] == stopped_at["step"] < STEPS
    assert f"resumed from step {resume_at}" in " ".join(output.split())
    with Checkpoints(directory, read_only=True) as complete:
        assert complete.metadata()["step"] == stopped_at["step"]

    assert main(flags(tmp_path, "uninterrupted")) == 0
    expected = {row["step"]: row["loss"] for row in rows(tmp_path / "uninterrupted.jsonl")}
    got = rows(log)
    assert {row["step"] for row in got} == set(range(1, stopped_at["step"] + 1))
    assert [row["step"] for row in got[logged:]] == list(range(resume_at + 1, stopped_at["step"] + 1))
    mismatched = [(row["step"], row["loss"], expected[row["step"]])
                  for row in got if row["loss"] != expected[row["step"]]]
    assert not mismatched

"""Two cooperating processes (4 host devices each, jax.distributed + gloo) train like one process of 8."""

import json
import os
import subprocess
import sys

from conftest import FAST_COMPILE
from jaxpar.cli import main

FLAGS = ["--mesh", "data=4,tensor=2", "--steps", "3", "--batch-size", "8", "--seq-len", "32"]


def losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_two_processes_match_one(tmp_path):
    multi = tmp_path / "multi.jsonl"
    command = [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "4",
               "train", *FLAGS, "--metrics", str(multi)]
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE}  # launch gives each process its own device count
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 processes" in " ".join(result.stdout.split())  # the console wraps long lines

    single = tmp_path / "single.jsonl"
    assert main(["train", *FLAGS, "--metrics", str(single)]) == 0
    for a, b in zip(losses(multi), losses(single), strict=True):
        assert abs(a / b - 1) <= 1e-5


def test_hsdp_shards_inside_each_process_and_replicates_across(tmp_path):
    """The hsdp-2x4 preset on 2 processes of 4: data inside each process, replica the axis that crosses them."""
    flags = ["--mesh", "hsdp-2x4", "--steps", "2", "--batch-size", "8", "--seq-len", "32"]
    multi = tmp_path / "multi.jsonl"
    command = [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "4",
               "train", *flags, "--metrics", str(multi)]
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 processes; across processes: replica)" in " ".join(result.stdout.split())

    single = tmp_path / "single.jsonl"
    assert main(["train", *flags, "--metrics", str(single)]) == 0
    for a, b in zip(losses(multi), losses(single), strict=True):
        assert abs(a / b - 1) <= 1e-5

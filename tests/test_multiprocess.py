"""Two cooperating processes (4 host devices each, jax.distributed + gloo) train like one process of 8."""

import json
import os
import re
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


def test_two_processes_share_the_block_counts_of_a_jsonl_and_train_like_one(tmp_path):
    """--data docs.jsonl --epochs on 2 processes: each tokenizes its own blocks, the counts go through the
    coordination service's store (jaxpar.data.shared_counts), and the losses are one process's."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "ab" * (i % 4 + 1)}) + "\n" for i in range(1500)))  # 6 blocks
    flags = ["--mesh", "data=8", "--batch-size", "8", "--seq-len", "32", "--data", str(data), "--epochs", "0.05"]
    multi, logs = tmp_path / "multi.jsonl", tmp_path / "logs"
    command = [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "4",
               "--log-dir", str(logs), "train", *flags, "--metrics", str(multi)]
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for rank in (0, 1):
        printed = " ".join((logs / f"rank{rank}.out").read_text().split())
        assert "1,500 documents in 6 blocks" in printed
        tokenized = int(re.search(rf"process {rank} of 2 tokenized (\d+) of them", printed).group(1))
        assert tokenized in (3, 4)  # its own 3 (blocks rank, rank + 2, ...), and the one with its rows of batch 0

    single = tmp_path / "single.jsonl"
    assert main(["train", *flags, "--metrics", str(single)]) == 0
    assert len(losses(single)) >= 2
    for a, b in zip(losses(multi), losses(single), strict=True):
        assert abs(a / b - 1) <= 1e-5
